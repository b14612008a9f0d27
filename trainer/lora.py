"""LoRA on the actor: verl's ``actor_rollout_ref.model.lora.*`` keys (and the older ``model.lora_rank`` /
``lora_alpha`` / ``target_modules`` / ``exclude_modules`` / ``lora_adapter_path`` spelling) resolved into one
:class:`LoRASettings`, and the load-time checks that refuse what is not built (docs/strategies.md#lora).

LoRA is on when the rank is positive (verl's rule). What is built: adapters on the megatron actor's decoder
linears (:mod:`megatron_bridge.lora`) or, with the same keys and init, on the deepspeed and fsdp2 actors' HF
projections through peft (:mod:`trainer.strategies.hf_lora`), only the adapters in the optimizer, the reference policy as the actor
with its adapters off (no reference group), weight syncs of the adapters only (``lora.merge=false``, verl's
default: :mod:`trainer.rollout.adapters`) or of merged weights ``W + (alpha / rank) B A`` (``merge=true``), the
merged weights in the HF export (plus a peft adapter directory), checkpoints with the adapters and their optimizer
state, and a peft adapter as the starting point (``adapter_path``). What is refused, each with its reason: LoRA on
a strategy of the user's own or on the critic, adapter-only sync to an engine or placement that cannot take adapters
(SGLang, HTTP servers), other adapter types, ``post`` dropout, Megatron-Bridge's all-to-all adapter path,
unfrozen base weights and the vision keys.

Pure functions over the loaded config (no torch, no megatron, no engine): the driver and the checks read them; the
actor's strategy gets :meth:`LoRASettings.apply_kwargs` (``megatron_bridge.lora.apply_lora``'s keywords).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

from omegaconf import OmegaConf

from trainer.rollout.registry import capabilities

MEGATRON_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# HF projection names of the older (peft / FSDP) spelling -> the megatron linear that holds them. megatron fuses
# q, k, v into linear_qkv and gate, up into linear_fc1: one adapter covers the fused layer, so its parts come as
# a whole or not at all
HF_PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
            "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
DTYPES = ("float32", "bfloat16", "float16")
# the actor strategies LoRA is built on: megatron (megatron_bridge.lora); deepspeed and fsdp2 (verl's fsdp runs on it)
# through peft (trainer.strategies.hf_lora)
BUILT_ON = ("megatron", "deepspeed", "fsdp2", "fsdp")
NEW, OLD = "actor_rollout_ref.model.lora", "actor_rollout_ref.model"


@dataclass(frozen=True)
class LoRASettings:
    """What the actor's strategy builds. ``target_modules`` / ``exclude_modules`` are megatron patterns
    (``megatron_bridge.lora.is_target``); ``adapter_path``: a peft adapter directory loaded over the init."""

    rank: int
    alpha: float
    dropout: float = 0.0
    dropout_position: str = "pre"
    target_modules: tuple = MEGATRON_LINEARS
    exclude_modules: tuple = ()
    a_init: str = "xavier"
    b_init: str = "zero"
    dtype: Optional[str] = None
    adapter_path: Optional[str] = None
    merge: bool = False  # the engines get merged weights; False: only the adapters travel (trainer.rollout.adapters)

    def __post_init__(self):  # lists (from as_dict, across Ray) back to tuples: equal settings compare equal
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        object.__setattr__(self, "exclude_modules", tuple(self.exclude_modules))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def as_dict(self) -> dict:
        """Plain values (crosses Ray to the worker; ``LoRASettings(**d)`` rebuilds it)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    def apply_kwargs(self) -> dict:
        """``megatron_bridge.lora.apply_lora``'s keywords (the dtype as its name: the strategy maps it)."""
        return dict(rank=self.rank, alpha=self.alpha, dropout=self.dropout, dropout_position=self.dropout_position,
                    target_modules=list(self.target_modules), exclude_modules=list(self.exclude_modules),
                    a_init=self.a_init, b_init=self.b_init)


def megatron_targets(names, key: str) -> list[str]:
    """The older spelling's module names as megatron patterns: ``all-linear`` -> every decoder linear; HF
    projection names -> the megatron linear holding them (all parts of a fused linear, or ValueError);
    megatron names and wildcard patterns unchanged."""
    if names is None:
        return []
    if isinstance(names, str):
        if names == "all-linear":
            return list(MEGATRON_LINEARS)
        names = [names]
    names = [str(n) for n in names]
    parts = {p: lin for lin, ps in HF_PARTS.items() for p in ps}
    out = [n for n in names if n not in parts]
    for lin, ps in HF_PARTS.items():
        given = [p for p in ps if p in names]
        if given and len(given) != len(ps):
            raise ValueError(f"{key}={names}: megatron fuses {' + '.join(ps)} into one {lin} with one adapter; name "
                             f"all of {list(ps)} (or {lin}), or none")
        if given:
            out.append(lin)
    return out


def _on(node, key: str) -> bool:
    v = OmegaConf.select(node, key, default=0)
    return v is not None and v > 0


def lora_settings(cfg) -> Optional[LoRASettings]:
    """The actor's LoRA (None: off) from verl's ``model.lora.*`` or, when only ``model.lora_rank`` is set, the
    older spelling. ValueError where the two spellings are mixed or the older names do not map."""
    m = cfg.actor_rollout_ref.model
    new, old = _on(m, "lora.rank"), _on(m, "lora_rank")
    if new and old:
        raise ValueError(f"{NEW}.rank={m.lora.rank} and {OLD}.lora_rank={m.lora_rank} both ask for LoRA: use one "
                         f"spelling (verl's {NEW}.* for the megatron actor)")
    if new:
        lc = m.lora
        return LoRASettings(rank=int(lc.rank), alpha=float(lc.alpha), dropout=float(lc.dropout),
                            dropout_position=lc.dropout_position, target_modules=tuple(lc.target_modules or ()),
                            exclude_modules=tuple(lc.exclude_modules or ()), a_init=lc.lora_A_init_method,
                            b_init=lc.lora_B_init_method, dtype=lc.dtype, adapter_path=lc.adapter_path,
                            merge=bool(lc.merge))
    if old:
        tm = OmegaConf.to_container(m.target_modules) if OmegaConf.is_config(m.target_modules) else m.target_modules
        ex = OmegaConf.to_container(m.exclude_modules) if OmegaConf.is_config(m.exclude_modules) else m.exclude_modules
        return LoRASettings(rank=int(m.lora_rank), alpha=float(m.lora_alpha),
                            target_modules=tuple(megatron_targets(tm, f"{OLD}.target_modules")),
                            exclude_modules=tuple(megatron_targets(ex, f"{OLD}.exclude_modules")),
                            adapter_path=m.lora_adapter_path, merge=bool(m.lora.merge))
    return None


def peft_adapter_errors(path: str, rank: int, alpha: float, key: str) -> list[str]:
    """A peft adapter directory to start from: its files, and a rank and scale equal to the configured ones (the
    adapter's function is ``(lora_alpha / r) B A``; loaded into another rank or scale it would be another)."""
    cfg_file, weights = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
    missing = [f for f in (cfg_file, weights) if not os.path.isfile(f)]
    if missing:
        return [f"{key}='{path}' is not a peft adapter directory (no {', '.join(os.path.basename(f) for f in missing)}): "
                f"give the directory PeftModel.save_pretrained wrote (adapter_config.json + adapter_model.safetensors)."]
    with open(cfg_file) as f:
        pc = json.load(f)
    errs = []
    if pc.get("peft_type", "LORA") != "LORA" or pc.get("use_dora") or pc.get("use_rslora"):
        errs.append(f"{key}='{path}': a {pc.get('peft_type')} adapter (use_dora={pc.get('use_dora')}, use_rslora="
                    f"{pc.get('use_rslora')}); only plain LoRA (scale lora_alpha / r) loads.")
    if int(pc.get("r", -1)) != rank or float(pc.get("lora_alpha", -1)) != float(alpha):
        errs.append(f"{key}='{path}' holds an adapter of r={pc.get('r')}, lora_alpha={pc.get('lora_alpha')}, but the "
                    f"configured rank / alpha are {rank} / {alpha:g}: set them to the adapter's.")
    return errs


def adapter_sync_errors(cfg) -> list[str]:
    """Adapter-only sync (``lora.merge=false``) reaches an engine that declares ``Capabilities.lora_adapters``,
    in Ray workers or the actor's ranks (hybrid), where :class:`trainer.rollout.adapters.AdapterEngine` merges
    them; not HTTP servers."""
    r = cfg.actor_rollout_ref.rollout
    fix = f"set {NEW}.merge=true (the engines then get merged weights W + (alpha/rank) B A)"
    errs = []
    try:
        takes = capabilities(r.name).lora_adapters
    except ValueError:
        takes = True  # an unloadable engine spec is the rollout check's error, not this one
    if not takes:
        errs.append(f"{NEW}.merge=false syncs only the LoRA adapters, which the engine '{r.name}' does not take "
                    f"(its Capabilities.lora_adapters is false): {fix}.")
    if r.mode in ("server", "async"):
        errs.append(f"{NEW}.merge=false syncs only the LoRA adapters, which the HTTP engine servers of "
                    f"actor_rollout_ref.rollout.mode={r.mode} do not take yet: {fix}, or use rollout.mode=sync.")
    return errs


def lora_errors(cfg) -> list[str]:
    """The LoRA keys: on only where it is built (a megatron or deepspeed actor), each value meaningful."""
    try:
        s = lora_settings(cfg)
    except ValueError as e:
        return [f"{e}."]
    if s is None:
        return []
    m = cfg.actor_rollout_ref.model
    spelled = NEW if _on(m, "lora.rank") else OLD
    rank_key = f"{NEW}.rank" if spelled == NEW else f"{OLD}.lora_rank"
    errs = []
    strategy = cfg.actor_rollout_ref.actor.strategy
    if strategy not in BUILT_ON:
        errs.append(f"LoRA ({rank_key}={s.rank}) is built on the megatron, deepspeed and fsdp / fsdp2 actors, not on "
                    f"actor_rollout_ref.actor.strategy={strategy} (a strategy of your own gets no LoRA settings): use "
                    f"one of those.")
    if strategy in BUILT_ON and strategy != "megatron" and s.dtype is not None:
        errs.append(f"{NEW}.dtype={s.dtype} with actor.strategy={strategy}: peft's adapters take the base weights' "
                    f"dtype there (the strategy's mixed precision applies to them as to the base); set {NEW}.dtype=null.")
    if spelled == NEW:
        lc = m.lora
        if lc.type != "lora":
            errs.append(f"{NEW}.type='{lc.type}' is not built (Megatron-Bridge's canonical_lora / dora / vlm_lora); "
                        f"use {NEW}.type=lora.")
        if s.dtype is not None and s.dtype not in DTYPES:
            errs.append(f"{NEW}.dtype='{s.dtype}' is not one of {list(DTYPES)} (or null: the base weights' dtype).")
    if not s.merge:
        errs += adapter_sync_errors(cfg)
    if s.dropout_position == "post" and s.dropout > 0:
        errs.append(f"{NEW}.dropout_position=post with {NEW}.dropout={s.dropout:g} is not built (dropout on the "
                    f"adapter's output); use {NEW}.dropout_position=pre (verl's default).")
    bad = [t for t in s.target_modules + s.exclude_modules
           if "*" not in t and "." not in t and t not in MEGATRON_LINEARS]
    if bad:
        key = f"{NEW}.target_modules / exclude_modules" if spelled == NEW else f"{OLD}.target_modules / exclude_modules"
        errs.append(f"{key}: {bad} name no megatron linear; use {list(MEGATRON_LINEARS)} or a wildcard pattern of "
                    f"the canonical module name (e.g. '*.layers.0.*')" +
                    (", or HF projection names with the older spelling (q_proj, ..., down_proj)" if spelled == OLD else "") + ".")
    if s.adapter_path:
        key = f"{NEW}.adapter_path" if spelled == NEW else f"{OLD}.lora_adapter_path"
        errs += peft_adapter_errors(s.adapter_path, s.rank, s.alpha, key)
    return errs
