"""LoRA on a Hugging Face model through ``peft``, for the HF-model strategies (DeepSpeed and FSDP2).

Math (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685): each adapted
linear ``h = W x`` becomes ``h = W x + (alpha / r) B A dropout(x)``, ``A [r, in]``, ``B [out, r]``, ``W`` frozen.
peft holds one adapter per HF projection (``q_proj``, ``k_proj``, ... ``down_proj``), as verl's FSDP LoRA does.

The same keys and the same start as the megatron actor (``megatron_bridge.lora``):

* ``target_modules`` / ``exclude_modules`` are megatron patterns (``linear_qkv`` ... ``linear_fc2``, or wildcard
  patterns of the canonical module name such as ``*.layers.0.*``). They pick canonical linears
  (``megatron_bridge.lora.is_target``), and each picked linear adapts the HF projections it fuses (``linear_qkv``:
  ``q_proj``, ``k_proj``, ``v_proj``); peft gets exactly those modules.
* The init: megatron draws one ``A`` and one ``B`` per canonical linear from a generator seeded by the strategy's
  seed and the linear's name. Here the same tensors are drawn and split into peft's parts
  (``megatron_bridge.lora.lora_state_to_peft``: ``A`` copied to every part, ``B``'s rows split like the fused
  weight). So at step 0 the two strategies hold the same function, and the parity test can compare their first
  update. From then on they differ by design: megatron's fused ``linear_qkv`` has one ``A`` that all three parts
  share, while peft steps ``A_q``, ``A_k`` and ``A_v`` apart (their gradients are the parts of megatron's sum).
* ``adapter_path``: a peft adapter directory loaded over the init (every adapter this model holds must be in it).

What the strategy reads from here: the reference policy (peft's ``disable_adapter``: the base model, bit for
bit), the weights a sync moves (the adapters in peft's layout with HF names and no prefix, which
``trainer.rollout.adapters`` merges at the engine; or merged weights ``W + (alpha / r) B A``), the base weights
(the engines' one-time base check), which parameters a checkpoint holds (the adapters only), and the peft
adapter directory of the export.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterator

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from megatron_bridge.convert import hf_names_for
from megatron_bridge.hf_config import read_hf_config
from megatron_bridge.lora import (PEFT_CONFIG, PEFT_WEIGHTS, adaptable_modules, full_factors, is_target,
                                  lora_state_to_peft, merged_weight, peft_adapter_config, peft_target_modules)
from trainer.fsutil import staged_dir
from trainer.lora import LoRASettings

PREFIX = "base_model.model."  # peft's PeftModelForCausalLM wraps the HF model twice
ADAPTER = "default"  # peft's adapter name
ADAPTER_DIR = "lora_adapter"  # the peft adapter beside the merged HF export (as the megatron actor's)


def hf_name(peft_name: str) -> str:
    """A peft parameter name as the HF model names it (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``);
    an adapter as peft's files name it without the prefix (``...q_proj.lora_A.weight``)."""
    n = peft_name[len(PREFIX):] if peft_name.startswith(PREFIX) else peft_name
    return n.replace(".base_layer.", ".").replace(f".{ADAPTER}.", ".")


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


class PeftLoRA:
    """The adapters of one HF model: :meth:`apply` wraps it in peft with the megatron actor's init; the rest reads
    the wrapped model through the strategy's ``read(params)``: whole, detached tensors of those parameters (ZeRO-3's
    gather, FSDP2's ``full_tensor``; collective where the strategy shards)."""

    def __init__(self, settings: LoRASettings, model_path: str, hf_overrides: dict | None = None):
        self.s = settings
        self.hf = read_hf_config(model_path, hf_overrides)
        picked = [n for n in adaptable_modules(self.hf)
                  if is_target(n, self.s.target_modules, self.s.exclude_modules)]
        if not picked:
            raise ValueError(f"LoRA target_modules {list(self.s.target_modules)} minus exclude_modules "
                             f"{list(self.s.exclude_modules)} leave no linear of {model_path} to adapt")
        self.canonical = picked  # megatron's names of the adapted linears

    # ------------------------------------------------------------------ building
    def apply(self, model, *, seed: int):
        """``model`` wrapped in peft (base frozen), its adapters at the megatron actor's init (or ``adapter_path``)."""
        s = self.s
        parts = {n: hf_names_for(n + ".weight", self.hf) for n in self.canonical}
        modules = dict(model.named_modules())
        missing = [p[: -len(".weight")] for ps in parts.values() for p in ps
                   if not isinstance(modules.get(p[: -len(".weight")]), torch.nn.Linear)]
        if missing:
            raise NotImplementedError(f"LoRA through peft adapts torch.nn.Linear projections; this model has none at "
                                      f"{missing[:3]} (a mixture-of-experts' fused experts): use the megatron actor")
        cfg = LoraConfig(r=s.rank, lora_alpha=s.alpha, lora_dropout=s.dropout, bias="none",
                         target_modules=peft_target_modules([n + ".lora_A.weight" for n in self.canonical], self.hf),
                         use_rslora=False, init_lora_weights=True)
        peft_model = get_peft_model(model, cfg)
        # the megatron actor's draw, per canonical linear, split into peft's parts
        state = {}
        for name, ps in parts.items():
            first = modules[ps[0][: -len(".weight")]]
            out = sum(modules[p[: -len(".weight")]].out_features for p in ps)
            a, b = full_factors(name, first.in_features, out, s.rank, s.a_init, s.b_init, seed)
            state[name + ".lora_A.weight"], state[name + ".lora_B.weight"] = a, b
        init = lora_state_to_peft(state, self.hf, prefix="")
        if s.adapter_path:
            init = self._read_adapter(s.adapter_path, set(init))
        self.load_adapters(peft_model, init)
        return peft_model

    @staticmethod
    def _read_adapter(path: str, want: set) -> dict[str, torch.Tensor]:
        got = {hf_name(k): v for k, v in load_file(f"{path}/{PEFT_WEIGHTS}").items()}
        lacking = sorted(want - set(got))
        if lacking:
            raise KeyError(f"the peft adapter {path} has no {lacking[:3]} ({len(lacking)} adapters this model holds); "
                           f"its target_modules must cover lora.target_modules")
        return {k: got[k] for k in want}

    @staticmethod
    @torch.no_grad()
    def load_adapters(peft_model, state: dict[str, torch.Tensor]) -> None:
        """Copy adapters ``{peft name without prefix: tensor}`` into the model (every adapter must be given)."""
        seen = set()
        for n, p in peft_model.named_parameters():
            if is_adapter_name(n):
                key = hf_name(n)
                if key not in state:
                    raise KeyError(f"no adapter tensor for {key}")
                p.copy_(state[key].to(p.dtype))
                seen.add(key)
        extra = sorted(set(state) - seen)
        if extra:
            raise KeyError(f"adapter tensors for modules this model does not adapt: {extra[:3]}")

    # ------------------------------------------------------------------ reading
    @staticmethod
    def reference(peft_model):
        """The base model: the adapters off (peft's ``disable_adapter``)."""
        return peft_model.disable_adapter()

    @staticmethod
    def adapter_params(peft_model) -> list[tuple[str, torch.nn.Parameter]]:
        return [(hf_name(n), p) for n, p in peft_model.named_parameters() if is_adapter_name(n)]

    @staticmethod
    def lora_layers(peft_model) -> Iterator[tuple[str, LoraLayer]]:
        """``(HF weight name, peft LoRA layer)`` of every adapted projection."""
        for n, m in peft_model.named_modules():
            if isinstance(m, LoraLayer) and ADAPTER in m.lora_A:
                yield hf_name(n) + ".weight", m

    def adapters(self, peft_model, read: Callable) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapters in name order, whole (an adapter-only sync's stream)."""
        for name, p in sorted(self.adapter_params(peft_model), key=lambda x: x[0]):
            yield name, read([p])[0]

    def weights(self, peft_model, read: Callable, *, merged: bool, skip=()) -> Iterator[tuple[str, torch.Tensor]]:
        """The HF model's weights by HF name, whole: merged ``W + (alpha / r) B A`` where adapted (``merged``), or the
        base weights (the adapters off). ``skip``: HF names left out (a tied output head)."""
        lora = dict(self.lora_layers(peft_model))
        for n, p in peft_model.named_parameters():
            if is_adapter_name(n):
                continue
            name = hf_name(n)
            if name in skip:
                continue
            layer = lora.get(name) if merged else None
            if layer is None:
                yield name, read([p])[0]
                continue
            w, a, b = read([p, layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight])
            yield name, merged_weight(w, a, b, layer.scaling[ADAPTER])

    def adapter_config(self, base_model_name_or_path: str | None) -> dict:
        """``adapter_config.json`` of the export (peft's LoraConfig for these adapters)."""
        canonical = [n + ".lora_A.weight" for n in self.canonical]
        return peft_adapter_config(canonical, self.hf, rank=self.s.rank, alpha=self.s.alpha, dropout=self.s.dropout,
                                   base_model_name_or_path=base_model_name_or_path)

    def write_adapter_dir(self, out_dir: str, adapters: dict[str, torch.Tensor], source_dir: str | None) -> None:
        """The peft adapter directory of the export (``adapter_model.safetensors`` with peft's prefix, and
        ``adapter_config.json``), written into a temporary directory renamed into place."""
        with staged_dir(out_dir) as tmp:
            save_file({PREFIX + n: t.cpu().contiguous() for n, t in adapters.items()}, os.path.join(tmp, PEFT_WEIGHTS),
                      metadata={"format": "pt"})
            with open(os.path.join(tmp, PEFT_CONFIG), "w", encoding="utf-8") as f:
                json.dump(self.adapter_config(os.path.abspath(source_dir) if source_dir else None), f, indent=2,
                          sort_keys=True)

    @staticmethod
    def report(peft_model, optimizer_params: int) -> dict[str, float]:
        """What this rank trains (the megatron actor's ``lora/*`` keys): adapted projections, adapter elements (whole
        tensors, ZeRO-3's partitions counted whole), elements the optimizer was given, base parameters that train."""
        def numel(p):
            return int(getattr(p, "ds_numel", p.numel()))

        adapters = [p for n, p in peft_model.named_parameters() if is_adapter_name(n)]
        base_trains = sum(1 for n, p in peft_model.named_parameters() if not is_adapter_name(n) and p.requires_grad)
        return {"adapters": float(sum(1 for _ in PeftLoRA.lora_layers(peft_model))),
                "adapter_params": float(sum(numel(p) for p in adapters)),
                "optimizer_params": float(optimizer_params), "frozen_with_grad": float(base_trains)}

