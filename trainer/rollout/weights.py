"""The weights' wire format, the same for every engine and every transport: the checkpoint's tensor index and
the validation of a pushed stream against it, buckets sized after the cast to the engine's dtype, flat
buckets (every tensor cast into one ``uint8`` buffer, laid out as SGLang's ``FlattenedTensorBucket``), the
whole-model checksum combined from per-tensor digests, and the few rows read back from a GPU engine to
check a push (``probe_rows``).

A model's checksum is the hash of ``tensor_digest(name, t)`` over its tensors in name order
(:func:`trainer.rollout.engine.checksum_named_tensors`); :func:`combine_digests` computes the same value
from digests taken one tensor at a time (on whatever rank or bucket they were), so a sender and a receiver
never need the whole model in one place to compare.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from trainer.hf_io import SafetensorsDir, read_config
from trainer.rollout.engine import iter_buckets, new_hasher

# the parameters default_probe_names picks, by suffix (a receiver keeps their rows while it hashes a stream)
PROBE_SUFFIXES = ("embed_tokens.weight", "q_proj.weight", "down_proj.weight", "norm.weight")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string of the checkpoint ("BF16", "F32", ...)
    file: str


def read_checkpoint_index(model_path: str) -> tuple[dict[str, TensorSpec], frozenset[str]]:
    """(name -> spec, names to skip) of an HF safetensors checkpoint, from file headers only
    (:class:`trainer.hf_io.SafetensorsDir`; its config.json is read, and refused, as the trainer's).

    Skipped names, as the native engine skips them: rotary ``inv_freq`` buffers, and
    ``lm_head.weight`` of a tied-embedding model (the trainer's export leaves it out too).
    """
    ck = SafetensorsDir(model_path)
    tied = read_config(model_path).tie_word_embeddings
    specs: dict[str, TensorSpec] = {}
    skip = {"lm_head.weight"} if tied else set()
    for name in ck.keys():
        if name.endswith("rotary_emb.inv_freq"):
            skip.add(name)
            continue
        shape, dtype = ck.spec(name)
        specs[name] = TensorSpec(shape, dtype, ck.file_of(name))
    for name in skip:
        specs.pop(name, None)
    return specs, frozenset(skip)


def validate_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    specs: Mapping[str, TensorSpec],
    skip: Container = frozenset(),
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs to push: skipped names dropped; an unknown name, a wrong shape, a
    non-floating tensor or a repeated name raise (SGLang itself would skip or mis-load them silently)."""
    out, seen = [], set()
    for name, t in named_tensors:
        if name in skip:
            continue
        spec = specs.get(name)
        if spec is None:
            raise KeyError(f"unknown weight {name!r}: not in the engine's checkpoint")
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} != expected {spec.shape}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: dtype {t.dtype} is not a floating type")
        if name in seen:
            raise ValueError(f"weight {name!r} appears twice in one update")
        seen.add(name)
        out.append((name, t))
    return out


def iter_cast_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream into buckets of at most ``bucket_bytes`` measured AFTER the cast to ``dtype``
    (what is sent); a lone larger tensor forms its own bucket. Order is kept."""
    return iter_buckets(named_tensors, bucket_bytes, dtype=dtype)


@dataclass(frozen=True)
class FlatMeta:
    """One tensor's place in a flat bucket: the fields of SGLang's ``FlattenedTensorMetadata``
    (weight_sync/tensor_bucket.py); offsets and ``numel`` count BYTES, as there."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def flatten_bucket(
    named_tensors: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device | str | None = None
) -> tuple[torch.Tensor, list[FlatMeta]]:
    """Cast each tensor to ``dtype`` straight into one uint8 buffer ``[total_bytes]`` (on ``device``,
    default the first tensor's). One dtype for all keeps every offset a multiple of the element
    size, which reading the buffer back with ``.view(dtype)`` needs."""
    if not named_tensors:
        raise ValueError("empty bucket")
    itemsize = torch.empty((), dtype=dtype).element_size()
    device = torch.device(device) if device is not None else named_tensors[0][1].device
    metas, off = [], 0
    for name, t in named_tensors:
        nb = t.numel() * itemsize
        metas.append(FlatMeta(name, tuple(t.shape), dtype, off, off + nb, nb))
        off += nb
    flat = torch.empty(off, dtype=torch.uint8, device=device)  # [total_bytes]
    for m, (_, t) in zip(metas, named_tensors):
        if m.numel:
            flat[m.start_idx:m.end_idx].view(dtype).copy_(t.detach().reshape(-1))  # cast on copy (RNE)
    return flat, metas


def unflatten_bucket(flat: torch.Tensor, metas: Sequence[FlatMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat``, as SGLang's ``FlattenedTensorBucket.reconstruct_tensors`` makes them."""
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in metas]


def combine_digests(digests: Mapping[str, bytes]) -> str:
    """The whole-model checksum from per-tensor :func:`~trainer.rollout.engine.tensor_digest`\\ s:
    equal to ``checksum_named_tensors`` over the same tensors (the sync hash of the digests in name order)."""
    total = new_hasher()
    for name in sorted(digests):
        total.update(digests[name])
    return total.hexdigest()


def default_probe_names(names: Iterable[str]) -> list[str]:
    """A few parameters to read back from the GPU: the embedding, the first layer's q_proj, the last
    layer's down_proj and the final norm (those that exist)."""
    names = list(names)
    layer = {}
    for n in names:
        parts = n.split(".")
        if "layers" in parts:
            k = parts.index("layers")
            if k + 1 < len(parts) and parts[k + 1].isdigit():
                layer[n] = int(parts[k + 1])
    first, last = (min(layer.values()), max(layer.values())) if layer else (None, None)
    picks = [
        next((n for n in names if n.endswith("embed_tokens.weight")), None),
        next((n for n in names if layer.get(n) == first and n.endswith("q_proj.weight")), None),
        next((n for n in names if layer.get(n) == last and n.endswith("down_proj.weight")), None),
        next((n for n in names if n not in layer and n.endswith("norm.weight")), None),
    ]
    return [p for p in picks if p is not None]


def readback_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max ``|got - want|`` of read-back probe rows, where the engine may hold the tensor PADDED: SGLang pads
    some dimensions for its kernels (an MLP's intermediate size to a multiple of its block, so ``down_proj``'s
    rows come back longer). The region ``want`` covers is compared, and the padding must be zero (the padded
    columns meet zero activations only while they are zero); a padding that is not, or a shape that is
    smaller or of another rank, is ``inf``."""
    if got.dim() != want.dim() or any(g < w for g, w in zip(got.shape, want.shape)):
        return float("inf")
    region = tuple(slice(0, w) for w in want.shape)
    diff = float((got[region] - want).abs().max()) if want.numel() else 0.0
    if got.shape != want.shape:
        pad = got.clone()
        pad[region] = 0
        if bool(pad.ne(0).any()):
            return float("inf")
    return diff


def probe_rows(t: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``rows`` rows (elements, for 1-D) of ``t`` as the engine holds them: cast to the
    engine dtype, then to float32 (exact), as ``get_weights_by_name`` reports them. Always a copy: for an
    fp32 view ``.to`` would alias it (and keep a whole flat bucket alive, or follow later writes into it)."""
    return t.detach()[:rows].to("cpu").to(dtype).to(torch.float32, copy=True)
