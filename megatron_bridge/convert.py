"""Weight conversion HF <-> megatron-core, with tensor-parallel splitting and pipeline assignment.

Naming. Every megatron parameter has a *canonical* name: the local-spec name it would have in a
TP=1, PP=1 model, with the global layer index (``decoder.layers.{i}.…``). The TE spec fuses the two
pre-norms into the following linear (``…linear_qkv.layer_norm_weight``, ``…linear_fc1.layer_norm_weight``);
:func:`canonical_name` / :func:`local_name` translate, so one table serves both specs.

Transforms (HF -> canonical full tensor -> TP shard), for ``nh`` query heads, ``ng`` kv groups,
``hd`` head dim, ``q = nh / ng``:

* fused QKV, interleaved per query group (megatron's layout, any GQA ratio)::

      W_qkv = stack_g [ W_q[g*q*hd:(g+1)*q*hd] ; W_k[g*hd:(g+1)*hd] ; W_v[g*hd:(g+1)*hd] ]   # [ng*(q+2)*hd, H]

  then TP rank ``r`` takes row block ``r`` of ``tp`` equal blocks (when ``ng < tp`` a group spans
  ranks; megatron gathers it back in attention). Biases (Qwen2) are fused the same way.
* SwiGLU ``linear_fc1``: TP=1 is ``[W_gate; W_up]``; rank ``r`` holds ``[W_gate_r; W_up_r]`` (its
  own block of each), because megatron splits the local fc1 output in two halves.
* row-parallel ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj): column blocks (dim 1).
* embedding / output layer: rows padded with zeros to the padded vocabulary, then row blocks.
  With tied embeddings and PP > 1 the last stage holds its own copy of the embedding as
  ``output_layer.weight`` (megatron keeps the two in sync through the embedding group).
* norms and the critic head are replicated on every TP rank.

All transforms are pure copies and concatenations, so HF -> megatron -> HF is bit-identical.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Iterator

import torch

from megatron_bridge.hf_config import HFModelConfig, padded_vocab_size, pipeline_layout
from trainer.hf_io import SafetensorsDir as HFCheckpoint  # the shared safetensors reader, by its bridge name
from megatron_bridge.model import chunks, unwrap

# ---------------------------------------------------------------------------------------------------
# names

_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_LOCAL_TO_TE = {v: k for k, v in _TE_TO_LOCAL.items()}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def _shift_expert(rest: str, by: int) -> str:
    m = _EXPERT.match(rest)
    return f"mlp.experts.local_experts.{int(m.group(1)) + by}.{m.group(2)}" if m else rest


def is_expert(canonical: str) -> bool:
    """A routed expert's parameter (split over expert-parallel ranks, sharded over expert-TP ranks)."""
    m = _LAYER.match(canonical)
    return bool(m and _EXPERT.match(m.group(2)))


def expert_index(canonical: str) -> int:
    return int(_EXPERT.match(_LAYER.match(canonical).group(2)).group(1))


def canonical_name(name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """Model-local parameter name -> canonical name (local spec, global layer and expert indices)."""
    m = _LAYER.match(name)
    if not m:
        return name
    rest = _shift_expert(_TE_TO_LOCAL.get(m.group(2), m.group(2)), expert_offset)
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{rest}"


def local_name(canonical: str, layer_offset: int, te: bool, expert_offset: int = 0) -> str:
    m = _LAYER.match(canonical)
    if not m:
        return canonical
    rest = _LOCAL_TO_TE.get(m.group(2), m.group(2)) if te else m.group(2)
    return f"decoder.layers.{int(m.group(1)) - layer_offset}.{_shift_expert(rest, -expert_offset)}"


def canonical_names(hf: HFModelConfig, *, layers: range | None = None, pre: bool = True, post: bool = True,
                    value_head: bool = False, tie_in_post: bool | None = None) -> list[str]:
    """Canonical parameter names of a chunk holding ``layers`` (and embedding / head if pre / post)."""
    layers = range(hf.num_layers) if layers is None else layers
    out = ["embedding.word_embeddings.weight"] if pre else []
    for i in layers:
        p = f"decoder.layers.{i}."
        out += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
        if hf.qkv_bias:
            out.append(p + "self_attention.linear_qkv.bias")
        if hf.qk_norm:
            out += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        out += [p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight"]
        if hf.is_moe:  # router, every routed expert (global index), the shared expert and its gate
            out.append(p + "mlp.router.weight")
            for e in range(hf.num_experts):
                out += [p + f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                        p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"]
            if hf.shared_expert_intermediate_size:
                out += [p + "mlp.shared_experts.linear_fc1.weight", p + "mlp.shared_experts.linear_fc2.weight",
                        p + "mlp.shared_experts.gate_weight"]
        else:
            out += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    if post:
        out.append("decoder.final_layernorm.weight")
        if value_head:
            out += ["output_layer.weight", "output_layer.bias"]
        else:
            tied = hf.tie_word_embeddings
            if tie_in_post is None:
                tie_in_post = not pre  # tied + PP>1: the last stage keeps its own copy
            if not tied or tie_in_post:
                out.append("output_layer.weight")
    return out


# ---------------------------------------------------------------------------------------------------
# HF -> canonical full tensors

_HF_LAYER = "model.layers.{i}."


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf: HFModelConfig) -> torch.Tensor:
    ng, hd = hf.num_kv_heads, hf.head_dim
    qpg = hf.num_heads // ng
    tail = q.shape[1:]  # (H,) for weights, () for biases
    qg = q.reshape(ng, qpg * hd, *tail)  # [ng, q*hd, (H)]
    kg = k.reshape(ng, hd, *tail)  # [ng, hd, (H)]
    vg = v.reshape(ng, hd, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(ng * (qpg + 2) * hd, *tail)  # [ng*(q+2)*hd, (H)]


def _split_qkv(w: torch.Tensor, hf: HFModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, hd = hf.num_kv_heads, hf.head_dim
    qpg = hf.num_heads // ng
    tail = w.shape[1:]
    g = w.reshape(ng, (qpg + 2) * hd, *tail)
    q, k, v = torch.split(g, [qpg * hd, hd, hd], dim=1)
    return (q.reshape(ng * qpg * hd, *tail).contiguous(), k.reshape(ng * hd, *tail).contiguous(),
            v.reshape(ng * hd, *tail).contiguous())


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    pad = torch.zeros(rows - w.shape[0], *w.shape[1:], dtype=w.dtype)
    return torch.cat([w, pad], 0)


def hf_names_for(canonical: str, hf: HFModelConfig) -> list[str]:
    """HF tensor names that make up one canonical megatron parameter."""
    if canonical == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if canonical == "decoder.final_layernorm.weight":
        return ["model.norm.weight"]
    if canonical in ("output_layer.weight", "output_layer.bias"):
        return [canonical.replace("output_layer", "lm_head")]
    m = _LAYER.match(canonical)
    if not m:
        raise KeyError(canonical)
    p, rest = f"model.layers.{m.group(1)}.", m.group(2)
    ex = _EXPERT.match(rest)
    if ex:
        q = f"{p}mlp.experts.{ex.group(1)}."
        return [q + "gate_proj.weight", q + "up_proj.weight"] if ex.group(2) == "linear_fc1.weight" else [q + "down_proj.weight"]
    table = {
        "input_layernorm.weight": ["input_layernorm.weight"],
        "self_attention.linear_qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"],
        "self_attention.linear_qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                           "self_attn.v_proj.bias"],
        "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"],
        "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
        "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
        "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
        "mlp.router.weight": ["mlp.gate.weight"],
        "mlp.shared_experts.linear_fc1.weight": ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"],
        "mlp.shared_experts.linear_fc2.weight": ["mlp.shared_expert.down_proj.weight"],
        "mlp.shared_experts.gate_weight": ["mlp.shared_expert_gate.weight"],
    }
    return [p + n for n in table[rest]]


def hf_to_canonical(canonical: str, get: Callable[[str], torch.Tensor], hf: HFModelConfig, *,
                    padded_vocab: int, value_head: bool = False) -> torch.Tensor:
    """Full (unsharded) megatron tensor for ``canonical``, read through ``get(hf_name)``."""
    if canonical == "embedding.word_embeddings.weight":
        return _pad_rows(get("model.embed_tokens.weight"), padded_vocab)
    if canonical.startswith("output_layer."):
        if value_head:
            return get(canonical.replace("output_layer", "score"))
        src = "model.embed_tokens.weight" if hf.tie_word_embeddings else "lm_head.weight"
        return _pad_rows(get(src), padded_vocab)
    names = hf_names_for(canonical, hf)
    parts = [get(n) for n in names]
    if canonical.endswith("linear_qkv.weight") or canonical.endswith("linear_qkv.bias"):
        return _fuse_qkv(*parts, hf)
    if canonical.endswith("linear_fc1.weight"):
        return torch.cat(parts, 0)  # [gate; up]
    (t,) = parts
    return t


def canonical_to_hf(canonical: str, full: torch.Tensor, hf: HFModelConfig, *,
                    value_head: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`hf_to_canonical` (drops vocabulary padding; tied output is not emitted)."""
    V = hf.vocab_size
    if canonical == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", full[:V])]
    if canonical.startswith("output_layer."):
        if value_head:
            return [(canonical.replace("output_layer", "score"), full)]
        return [] if hf.tie_word_embeddings else [("lm_head.weight", full[:V])]
    names = hf_names_for(canonical, hf)
    if canonical.endswith("linear_qkv.weight") or canonical.endswith("linear_qkv.bias"):
        return list(zip(names, _split_qkv(full, hf)))
    if canonical.endswith("linear_fc1.weight"):
        g, u = full.chunk(2, 0)
        return [(names[0], g), (names[1], u)]
    return [(names[0], full)]


# ---------------------------------------------------------------------------------------------------
# tensor-parallel split / merge of canonical tensors


def tp_kind(canonical: str, value_head: bool = False) -> str:
    """'row' (split dim 0), 'col' (split dim 1), 'glu' (gate/up blocks) or 'rep' (replicated)."""
    if canonical.startswith("output_layer."):
        return "rep" if value_head else "row"
    if canonical == "embedding.word_embeddings.weight":
        return "row"
    if canonical.endswith("linear_qkv.weight") or canonical.endswith("linear_qkv.bias"):
        return "row"
    if canonical.endswith("linear_fc1.weight"):
        return "glu"
    if canonical.endswith("linear_proj.weight") or canonical.endswith("linear_fc2.weight"):
        return "col"
    return "rep"


def tp_shard(canonical: str, full: torch.Tensor, tp: int, rank: int, value_head: bool = False) -> torch.Tensor:
    kind = tp_kind(canonical, value_head)
    if kind == "rep" or tp == 1:
        return full
    if kind == "row":
        return full.chunk(tp, 0)[rank]
    if kind == "col":
        return full.chunk(tp, 1)[rank]
    g, u = full.chunk(2, 0)
    return torch.cat([g.chunk(tp, 0)[rank], u.chunk(tp, 0)[rank]], 0)


def tp_merge(canonical: str, shards: list[torch.Tensor], value_head: bool = False) -> torch.Tensor:
    kind = tp_kind(canonical, value_head)
    if kind == "rep" or len(shards) == 1:
        return shards[0]
    if kind == "row":
        return torch.cat(shards, 0)
    if kind == "col":
        return torch.cat(shards, 1)
    halves = [s.chunk(2, 0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)


# ---------------------------------------------------------------------------------------------------
# pure (no torch.distributed) whole-layout conversion, used by tests and offline tools


def stage_of_layers(hf: HFModelConfig, pp: int, pp_layers=None) -> list[range]:
    layout = pipeline_layout(hf.num_layers, pp, pp_layers)
    starts = [sum(layout[:s]) for s in range(pp)]
    return [range(starts[s], starts[s] + layout[s]) for s in range(pp)]


def hf_to_megatron_shards(get: Callable[[str], torch.Tensor], hf: HFModelConfig, *, tp: int, pp: int = 1,
                          pp_layers=None, vocab_multiple: int = 128, value_head: bool = False
                          ) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """``{(pp_rank, tp_rank): {canonical name: shard}}`` for a whole TP x PP layout."""
    padded = padded_vocab_size(hf.vocab_size, tp, vocab_multiple)
    out = {}
    for s, layers in enumerate(stage_of_layers(hf, pp, pp_layers)):
        names = canonical_names(hf, layers=layers, pre=s == 0, post=s == pp - 1, value_head=value_head)
        for r in range(tp):
            out[(s, r)] = {n: tp_shard(n, hf_to_canonical(n, get, hf, padded_vocab=padded, value_head=value_head),
                                       tp, r, value_head) for n in names}
    return out


def megatron_shards_to_hf(shards: dict[tuple[int, int], dict[str, torch.Tensor]], hf: HFModelConfig, *,
                          value_head: bool = False) -> dict[str, torch.Tensor]:
    tp = 1 + max(r for _, r in shards)
    pp = 1 + max(s for s, _ in shards)
    out: dict[str, torch.Tensor] = {}
    for s in range(pp):
        for n in shards[(s, 0)]:
            full = tp_merge(n, [shards[(s, r)][n] for r in range(tp)], value_head)
            for k, v in canonical_to_hf(n, full, hf, value_head=value_head):
                if k == "model.embed_tokens.weight" and k in out:
                    continue
                out[k] = v
    return out


# ---------------------------------------------------------------------------------------------------
# loading into a live model chunk


def iter_local_params(model) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """(local name, canonical name, parameter) for every parameter of one model chunk."""

    m = unwrap(model)
    for name, p in m.named_parameters():
        yield name, canonical_name(name, m.layer_offset, getattr(m, "expert_offset", 0)), p


@torch.no_grad()
def load_hf_weights(model, source) -> None:
    """Copy HF weights into this rank's model chunk(s) (only the tensors this rank needs are read).

    ``source``: a HF directory, an :class:`HFCheckpoint`, or a ``{hf_name: tensor}`` dict.
    """

    if isinstance(source, (str, os.PathLike)):
        source = HFCheckpoint(str(source))
    for c in chunks(model):
        _load_chunk(c, source)


@torch.no_grad()
def _load_chunk(model, source) -> None:
    from megatron.core import parallel_state as ps


    m = unwrap(model)
    get = source.get if isinstance(source, HFCheckpoint) else source.__getitem__
    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    keys = source.keys()
    for name, can, p in iter_local_params(m):
        if m.is_critic and can.startswith("output_layer.") and can.replace("output_layer", "score") not in keys:
            continue  # a causal-LM checkpoint has no critic head: keep the fresh init
        full = hf_to_canonical(can, get, m.hf_config, padded_vocab=m.padded_vocab_size, value_head=m.is_critic)
        if is_expert(can):  # routed experts are split over the expert-tensor-parallel ranks
            shard = tp_shard(can, full, ps.get_expert_tensor_parallel_world_size(),
                             ps.get_expert_tensor_parallel_rank(), m.is_critic)
        else:
            shard = tp_shard(can, full, tp, r, m.is_critic)
        if shard.shape != p.shape:
            raise ValueError(f"{name} ({can}): checkpoint shard {tuple(shard.shape)} != parameter {tuple(p.shape)}")
        p.copy_(shard)
