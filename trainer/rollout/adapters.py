"""Adapter-only weight sync: an engine that takes LoRA adapters and holds ``W = W0 + (alpha / r) B A``.

With ``actor_rollout_ref.model.lora.merge=false`` (verl's default) a weight sync moves only the adapters: the
actor streams them in peft's layout and HF names (``model.layers.0.self_attn.q_proj.lora_A.weight``, ``[r, in]``;
``...lora_B.weight``, ``[out, r]``; a fused megatron layer's ``A`` once per part, ``B`` split as the base weight
is: :func:`megatron_bridge.lora.lora_state_to_peft`), through whichever transport the rollout chose (the
transports move named tensors and do not know what they carry). :class:`AdapterEngine` sits between the rollout
worker and its engine: it keeps a copy ``W0`` of each adapted base weight as the engine loaded it from the
model's checkpoint (the same frozen base the actor trains over), and loads the merged
``W = W0 + scale * B @ A`` (computed in float32, cast once to the engine's dtype) into the engine through the
engine's own ``update_weights``. Generation then costs what it costs with full weights: no adapter matmuls in
the decode loop (LoRA "Without Regret" notes the same; Hu et al. 2021, arXiv:2106.09685, section 4.2: the
merged form has no inference latency), and the sync moves ``r (in + out)`` numbers per adapted matrix instead
of ``in * out``.

Verification is the transports' own rule on what was moved: the engine's ``weights_checksum`` is the checksum
of the adapters it holds, cast to its dtype (:func:`trainer.rollout.engine.checksum_named_tensors`), which the
actor's stream checksum of the same tensors must equal. ``base_checksum`` is the checksum of the base weights
under the merges (``W0`` where an adapter is applied), which the actor's base (its adapters switched off) must
equal: the one-time end-to-end check of what the adapters are added to.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from trainer.rollout.engine import checksum_named_tensors

SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}


def split_adapter_name(name: str) -> tuple[str, str] | None:
    """``(base weight name, "A" | "B")`` of a peft-layout adapter tensor, None for any other name."""
    for suffix, which in SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight", which
    return None


def merged(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``W0 + scale * B @ A`` in float32 (``W0`` ``[out, in]``, ``A`` ``[r, in]``, ``B`` ``[out, r]``), cast to
    ``dtype`` once."""
    return torch.addmm(w0.float(), b.float(), a.float(), alpha=scale).to(dtype)


class AdapterEngine:
    """An engine behind adapter-only syncs. ``engine``: any engine whose ``hf_views()`` gives its weights by HF
    name and whose ``update_weights`` takes full HF tensors; ``scale``: alpha / rank; ``dtype``: the engine's
    dtype (what its checksums are taken in). Every other attribute is the engine's."""

    def __init__(self, engine, *, scale: float, dtype: str):
        self.engine = engine
        self.scale = float(scale)
        self.dtype = getattr(torch, dtype)
        self.adapters: dict[str, torch.Tensor] = {}  # peft name -> the adapter tensor as received
        self.base: dict[str, torch.Tensor] = {}  # base weight name -> W0 (a copy, taken before its first merge)

    def __getattr__(self, name):  # only for what this class does not define: the engine's own API
        return getattr(self.__dict__["engine"], name)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Take one bucket: adapter tensors are kept and their base weights re-merged; a full weight (a name
        without an adapter suffix) is refused, since it would be merged over. Returns the names taken."""
        touched, taken = set(), []
        for name, t in named_tensors:
            parts = split_adapter_name(name)
            if parts is None:
                raise ValueError(f"adapter-only sync received the full weight {name!r}: with lora.merge=false the "
                                 f"actor streams its adapters only (peft names ending in .lora_A.weight / .lora_B.weight)")
            self.adapters[name] = t.detach().to("cpu", copy=True)
            touched.add(parts[0])
            taken.append(name)
        views = self.engine.hf_views() if touched else {}
        out = []
        for base in sorted(touched):
            a = self.adapters.get(base[: -len(".weight")] + ".lora_A.weight")
            b = self.adapters.get(base[: -len(".weight")] + ".lora_B.weight")
            if base not in views:
                raise KeyError(f"adapter for {base!r}, which the engine does not hold")
            if base not in self.base:
                self.base[base] = views[base].detach().to("cpu", copy=True)
            if a is None or b is None:  # its other factor is in a later bucket of this sync
                continue
            out.append((base, merged(self.base[base], a, b, self.scale, self.dtype)))
        if out:
            self.engine.update_weights(out)
        return taken

    def weights_checksum(self) -> str:
        """The checksum of the adapters this engine holds, in its dtype (what an adapter sync moved)."""
        return checksum_named_tensors(sorted(self.adapters.items()), dtype=self.dtype)

    def base_checksum(self) -> str:
        """The checksum of the engine's weights with every merged weight replaced by its base ``W0``."""
        views = self.engine.hf_views()
        return checksum_named_tensors(sorted((n, self.base.get(n, t)) for n, t in views.items()), dtype=self.dtype)
