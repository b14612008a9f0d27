"""LoRA adapters on the bridge's megatron-core ``GPTModel``: tensor-parallel, sequence-parallel and MoE aware.

Math (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685). A frozen
linear layer ``h = W x`` (``W [out, in]``) gains a trainable low-rank update::

    h = W x + (alpha / r) * B A dropout(x)          A [r, in], B [out, r], r << min(in, out)

``A`` starts random and ``B`` at zero (verl's and Megatron-Bridge's defaults ``lora_A_init_method="xavier"``,
``lora_B_init_method="zero"``), so training starts exactly at the base model. ``alpha / r`` is the scale of
verl's ``actor_rollout_ref.model.lora.{rank, alpha}`` (default alpha 32); peft's ``lora_alpha`` means the same
(``use_rslora=False``). "LoRA Without Regret" (Schulman and Thinking Machines Lab, 2025) found that for
reinforcement learning even a rank-1 LoRA matches full fine-tuning (a policy-gradient episode carries few
bits), that LoRA must cover the MLP layers too (attention-only underperforms: hence the defaults, every linear
of the decoder), and that with the ``1 / r`` scale the best learning rate hardly depends on the rank (about
ten times full fine-tuning's).

Where the adapters go. The local layer spec's linears (``ColumnParallelLinear`` for ``linear_qkv`` and
``linear_fc1``, ``RowParallelLinear`` for ``linear_proj`` and ``linear_fc2``; the same classes in MoE experts,
``SequentialMLP``'s ``local_experts.{e}``, and in the shared expert) are switched in place to the subclasses
below (``module.__class__``): every base parameter keeps its name, so the converter, exporter and checkpoints
see the base model unchanged, and the adapters appear beside it as ``<linear>.lora_A.weight`` and
``<linear>.lora_B.weight``. Their *canonical* names (:func:`megatron_bridge.convert.canonical_name`: global
layer and expert index) are the stable names of :func:`adapter_state_dict`.

Tensor parallelism (TP ranks ``t = 0..T-1``; communication on the rank-``r`` intermediate ``u = A x``, never on
a hidden-sized tensor):

* column-parallel base (``W`` split by output rows, ``W_t [out/T, in]``): ``A`` replicated, ``B_t`` the rows of
  ``B`` that rank ``t``'s ``W_t`` holds (fused layouts included: ``linear_fc1``'s rank ``t`` holds
  ``[B_gate_t; B_up_t]``, exactly as :func:`megatron_bridge.convert.tp_shard` splits ``W``). ``h_t += s B_t u``
  with ``u = A x`` replicated; its backward all-reduces ``du`` over TP (megatron's
  ``copy_to_tensor_model_parallel_region``), the partial ``B_t^T dh_t`` of each rank, as the base all-reduces
  its ``dx``. Under sequence parallelism megatron all-gathers the sequence for the base; the LoRA path
  gathers ``u`` instead (``gather_from_sequence_parallel_region``, reduce-scatter backward), so it sees the
  same gathered input, and ``A``'s gradient, a partial sum over this rank's tokens, is all-reduced over TP.
* row-parallel base (``W`` split by input columns, ``W_t [out, in/T]``): ``A_t`` the columns of ``A`` that
  match ``W_t``'s input slice, ``B`` replicated. ``u_t = A_t x_t`` is a partial sum, reduced over TP exactly
  where the base output is (all-reduce, or reduce-scatter along the sequence under sequence parallelism),
  then ``h += s B u``. Under sequence parallelism ``B``'s gradient (this rank's tokens) is all-reduced.
* MoE experts with expert tensor/expert parallelism: megatron leaves the reduction to the token dispatcher
  (its inputs arrive gathered, its outputs leave as partial sums), so the LoRA path adds its own partial
  terms to the base's partial output, and only the replicated factor's gradient is all-reduced over the
  expert-TP group.

The gradient all-reduces above run inside the backward (megatron's ``copy_to_tensor_model_parallel_region``
applied to the factor), so ``.grad`` is complete when the backward returns, without relying on
``finalize_model_grads`` (which covers only the TP group, not the expert-TP group). Each is an all-reduce of
an ``r x in`` or ``out x r`` matrix per micro-batch.

Initialisation is TP- and PP-invariant: the full ``A`` and ``B`` of a layer are drawn on the CPU from a
generator seeded by ``seed`` and the layer's canonical name, then this rank's shard is taken, so any layout
holds the same adapter.

HF peft layout (:func:`lora_state_to_peft`): megatron fuses ``q, k, v`` (interleaved per query group) and
``gate, up``; a LoRA on a fused layer has one ``A`` shared by the parts and one ``B`` whose rows split like
the fused weight. peft has one adapter per part: each part gets a copy of ``A`` and its rows of ``B``, split
by the same :func:`megatron_bridge.convert.canonical_to_hf` that splits ``W``; the result is exactly the same
function. The converse (:func:`peft_to_lora_state`) needs equal ``A`` across the parts (a peft adapter trained
with independent ``A_q, A_k, A_v`` has no fused equivalent and is refused); a part without an adapter gets
zero rows of ``B``.

Deviations, named: ``target_modules`` and ``exclude_modules`` may be given together (Megatron-Bridge refuses
the pair; here the excludes are taken out of the targets), and an empty ``target_modules`` means every
decoder linear (Megatron-Bridge also wraps the output layer); wildcards (``*``) match any characters, dots
are literal. ``dropout_position="post"`` with a non-zero dropout is refused (verl's default is ``"pre"``).
Transformer Engine's fused linears (the GPU spec) are refused: build the model with ``use_te=False``.
Dropout masks depend on the TP layout (as megatron's own dropout does); TP parity holds at ``dropout=0``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import zlib
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from safetensors.torch import load_file, save_file
from torch import nn

from trainer.fsutil import staged_dir

from megatron_bridge.convert import (
    canonical_name,
    canonical_names,
    canonical_to_hf,
    hf_names_for,
    hf_to_canonical,
    tp_kind,
    tp_merge,
    tp_shard,
)
from megatron_bridge.hf_config import HFModelConfig
from megatron_bridge.model import chunks, unwrap

DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # verl's lora.target_modules
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # the decoder's linears, by last name
_DECODER_LINEAR = re.compile(r"^decoder\.layers\.\d+\.(?:.+\.)?(?:" + "|".join(_LINEARS) + r")$")


def _init_xavier(t: torch.Tensor, g: torch.Generator) -> None:
    nn.init.xavier_normal_(t, generator=g)


def _init_normal(t: torch.Tensor, g: torch.Generator) -> None:
    nn.init.normal_(t, 0.0, 0.2, generator=g)  # Megatron-Bridge's "normal": N(0, 0.2)


def _init_kaiming(t: torch.Tensor, g: torch.Generator) -> None:
    nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)  # torch Linear's (and peft's A) default


def _init_zero(t: torch.Tensor, g: torch.Generator) -> None:
    nn.init.zeros_(t)


# verl's lora_A_init_method / lora_B_init_method names (Megatron-Bridge's ParallelLinearAdapter's meanings)
INIT_METHODS = {"xavier": _init_xavier, "normal": _init_normal, "kaiming": _init_kaiming, "zero": _init_zero}


class _Factor(nn.Module):
    """Holds one LoRA factor as ``.weight``, so the parameter is named ``lora_A.weight`` as in peft."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        # a contiguous copy of its own: a row-parallel layer's A is a column slice of the full A (a strided view
        # of the whole matrix), and torch's fused Adam walks a parameter and its gradient (megatron's contiguous
        # main_grad buffer) as flat arrays of the same length, so on a strided view it paired elements with other
        # elements' gradients (TP=2 stepped about two thirds of the row-parallel A against the wrong sign)
        self.weight = nn.Parameter(weight.contiguous().clone())


class _LoRAMixin:
    """State and helpers shared by the two LoRA linears (set by :func:`_attach`)."""

    lora_A: _Factor
    lora_B: _Factor
    lora_rank: int
    lora_alpha: float
    lora_scale: float
    lora_dropout: float
    lora_enabled: bool
    lora_name: str  # canonical module name, e.g. decoder.layers.3.self_attention.linear_qkv
    lora_sharded: str  # which factor is split over the TP group: "B" (column base) or "A" (row base)

    def _dropout(self, x: torch.Tensor, tp_distinct: bool) -> torch.Tensor:
        if not (self.training and self.lora_dropout > 0):
            return x
        # an input that differs across TP ranks draws from megatron's model-parallel RNG stream (its own
        # choice for dropout inside sequence-parallel regions); a replicated input draws the same mask on
        # every TP rank from the default stream
        ctx = tensor_parallel.get_cuda_rng_tracker().fork() if tp_distinct else contextlib.nullcontext()
        with ctx:
            return F.dropout(x, self.lora_dropout, training=True)

    def _reduce_grad(self, factor: torch.Tensor) -> torch.Tensor:
        """``factor`` whose gradient is all-reduced over this layer's TP group in the backward (identity
        forward): for a replicated factor whose per-rank gradient is a partial sum."""
        if self.tp_group.size() == 1:
            return factor
        return copy_to_tensor_model_parallel_region(factor, group=self.tp_group)

    def _lora_sharded_state_dict(self, prefix: str, sharded_offsets, metadata) -> dict:
        # megatron's own sharded_state_dict would save the adapters as TP-replicated tensors; the split
        # factor is sharded like the base weight (dim 0 of B / dim 1 of A), linear_fc1's B as gate/up halves
        state = {"lora_A.weight": self.lora_A.weight, "lora_B.weight": self.lora_B.weight}
        axis = {"lora_B.weight": 0} if self.lora_sharded == "B" else {"lora_A.weight": 1}
        dp_cp = (metadata or {}).get("dp_cp_group") or ps.get_data_parallel_group(with_context_parallel=True)
        out = make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets, tp_group=self.tp_group,
                                                  dp_cp_group=dp_cp)
        if self.lora_sharded == "B" and tp_kind(self.lora_name + ".weight") == "glu" \
                and self.config.gated_linear_unit:
            key = f"{prefix}lora_B.weight"
            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets)
        return out

    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of ``W + (alpha / r) B A`` (see :func:`merged_weight`)."""
        return merged_weight(self.weight, self.lora_A.weight, self.lora_B.weight, self.lora_scale)


class LoRAColumnParallelLinear(_LoRAMixin, ColumnParallelLinear):
    """megatron's ``ColumnParallelLinear`` plus ``(alpha/r) B_t A x`` (``A`` replicated, ``B_t`` sharded)."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        out, bias = super().forward(input_, weight, runtime_gather_output)
        if self.lora_enabled:
            out = out + self._lora(input_).to(out.dtype)
        return out, bias

    def _lora(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A.weight, self.lora_B.weight
        explicit = self.explicit_expert_comm  # an expert: the dispatcher gathered x and reduces dx
        sp = self.sequence_parallel and not explicit  # megatron's own condition for its all-gather
        x = self._dropout(x, tp_distinct=sp)
        if explicit or sp:
            a = self._reduce_grad(a)  # dA on each rank: its tokens (SP) or its rows of B (expert)
        u = F.linear(x.to(a.dtype), a)  # [S(/T), B, r] or [tokens, r]
        if sp:
            u = gather_from_sequence_parallel_region(u, tensor_parallel_output_grad=True, group=self.tp_group)
        elif not explicit and self.tp_group.size() > 1:
            u = copy_to_tensor_model_parallel_region(u, group=self.tp_group)  # backward: sum B_t^T dh_t
        return F.linear(u, b) * self.lora_scale  # [S, B, out/T]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        sd.update(self._lora_sharded_state_dict(prefix, sharded_offsets, metadata))
        return sd


class LoRARowParallelLinear(_LoRAMixin, RowParallelLinear):
    """megatron's ``RowParallelLinear`` plus ``(alpha/r) B sum_t A_t x_t`` (``A_t`` sharded, ``B`` replicated)."""

    def forward(self, input_):
        out, bias = super().forward(input_)
        if self.lora_enabled:
            out = out + self._lora(input_).to(out.dtype)
        return out, bias

    def _lora(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A.weight, self.lora_B.weight
        x = self._dropout(x, tp_distinct=self.tp_group.size() > 1)
        u = F.linear(x.to(a.dtype), a)  # [S, B, r]: this rank's partial sum over its input columns
        if self.explicit_expert_comm:
            b = self._reduce_grad(b)  # the output stays partial (the dispatcher reduces it): so does dB
        elif self.sequence_parallel:
            u = reduce_scatter_to_sequence_parallel_region(u, group=self.tp_group)  # [S/T, B, r]
            b = self._reduce_grad(b)  # dB from this rank's tokens only
        elif self.tp_group.size() > 1:
            u = reduce_from_tensor_model_parallel_region(u, group=self.tp_group)
        return F.linear(u, b) * self.lora_scale  # [S(/T), B, out]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        sd.update(self._lora_sharded_state_dict(prefix, sharded_offsets, metadata))
        return sd


_LORA_CLASS = {ColumnParallelLinear: LoRAColumnParallelLinear, RowParallelLinear: LoRARowParallelLinear}
LoRALinear = (LoRAColumnParallelLinear, LoRARowParallelLinear)


# ---------------------------------------------------------------------------------------------------
# matching


def wildcard_match(pattern: str, name: str) -> bool:
    """``*`` matches any characters (dots included), everything else literally; the whole name must match."""
    return re.fullmatch(".*".join(re.escape(p) for p in pattern.split("*")), name) is not None


def _matches(pattern: str, name: str) -> bool:
    """Megatron-Bridge's rule: the module's last name component equals the pattern, or the full (canonical)
    module name matches it as a wildcard pattern (``*.layers.0.*.linear_qkv``)."""
    return name.rsplit(".", 1)[-1] == pattern or wildcard_match(pattern, name)


def is_target(name: str, target_modules: Iterable[str], exclude_modules: Iterable[str] = ()) -> bool:
    """Whether the decoder linear with canonical module name ``name`` gets an adapter."""
    if not _DECODER_LINEAR.match(name):
        return False
    targets = list(target_modules)
    if targets and not any(_matches(p, name) for p in targets):
        return False
    return not any(_matches(p, name) for p in exclude_modules)


def adaptable_modules(hf: HFModelConfig) -> list[str]:
    """Canonical names of every decoder linear of the whole model (all layers and experts)."""
    return [n[: -len(".weight")] for n in canonical_names(hf, pre=False, post=False)
            if n.endswith(".weight") and _DECODER_LINEAR.match(n[: -len(".weight")])]


# ---------------------------------------------------------------------------------------------------
# applying


def _module_seed(seed: int, name: str) -> int:
    # zlib.crc32, not hash(): Python salts str hashes per process, and every rank must draw the same adapter
    return (int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)


def full_factors(name: str, in_features: int, out_features: int, rank: int, a_init: str, b_init: str,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole ``A [rank, in]`` and ``B [out, rank]`` of the linear with canonical name ``name``, drawn on the CPU
    from ``seed`` and the name: the same at every layout (each rank takes its shard), and for the peft adapters of
    the HF-model strategies (trainer.strategies.hf_lora splits them into peft's parts)."""
    g = torch.Generator().manual_seed(_module_seed(seed, name))
    a = torch.empty(rank, in_features, dtype=torch.float32)  # [r, in]
    b = torch.empty(out_features, rank, dtype=torch.float32)  # [out, r]
    INIT_METHODS[a_init](a, g)
    INIT_METHODS[b_init](b, g)
    return a, b


def _attach(module, name: str, *, rank: int, alpha: float, dropout: float, a_init: str, b_init: str, seed: int,
            dtype: torch.dtype | None) -> None:
    base_cls = type(module)
    if base_cls is ColumnParallelLinear and module.gather_output:
        raise NotImplementedError(f"{name}: LoRA on a column-parallel linear that gathers its output")
    if base_cls is RowParallelLinear and not module.input_is_parallel:
        raise NotImplementedError(f"{name}: LoRA on a row-parallel linear whose input is not split")
    if module.weight is None:
        raise NotImplementedError(f"{name}: LoRA on a linear without its own weight")
    tp, r = module.tp_group.size(), module.tp_group.rank()
    a_full, b_full = full_factors(name, module.input_size, module.output_size, rank, a_init, b_init, seed)
    sharded = "B" if base_cls is ColumnParallelLinear else "A"
    can = name + ".lora_A.weight", name + ".lora_B.weight"
    a, b = shard_adapter(can[0], a_full, tp, r), shard_adapter(can[1], b_full, tp, r)
    dt, dev = dtype or module.weight.dtype, module.weight.device
    module.__class__ = _LORA_CLASS[base_cls]
    module.lora_A = _Factor(a.to(device=dev, dtype=dt))
    module.lora_B = _Factor(b.to(device=dev, dtype=dt))
    for factor, split in ((module.lora_A.weight, sharded == "A"), (module.lora_B.weight, sharded == "B")):
        # megatron's bookkeeping: the grad-norm counts a TP-split parameter on every rank and a replicated one
        # once; expert parameters go to the expert-data-parallel buffers (``allreduce`` False), as the base's
        set_tensor_model_parallel_attributes(factor, split, 1 if sharded == "A" else 0, 1)
        factor.allreduce = getattr(module.weight, "allreduce", True)
    module.lora_rank, module.lora_alpha = rank, float(alpha)
    module.lora_scale = float(alpha) / rank
    module.lora_dropout = float(dropout)
    module.lora_enabled = True
    module.lora_name = name
    module.lora_sharded = sharded


def _require_input_grad(module, args, output):
    # every base parameter is frozen, so the embedding output does not require grad; megatron's activation
    # recompute (a reentrant autograd Function) then returns outputs that do not either, and the adapters
    # inside a recomputed block get no gradient; a first pipeline stage whose layers hold no adapter would
    # send a tensor without grad. Marking the embedding output (HF's enable_input_require_grads) fixes both.
    if torch.is_grad_enabled() and torch.is_tensor(output) and not output.requires_grad:
        return output.detach().requires_grad_(True)
    return output


def apply_lora(model, *, rank: int, alpha: float = 32, dropout: float = 0.0, dropout_position: str = "pre",
               target_modules: Iterable[str] = DEFAULT_TARGETS, exclude_modules: Iterable[str] = (),
               a_init: str = "xavier", b_init: str = "zero", seed: int = 0, dtype: torch.dtype | None = None):
    """Add LoRA adapters to this rank's model chunk(s) in place, freeze every base parameter, return ``model``.

    ``target_modules`` / ``exclude_modules``: a pattern matches a decoder linear whose last name component
    equals it (``linear_qkv``) or whose canonical name (global layer index) matches it with ``*`` wildcards
    (``*.layers.0.*``); empty ``target_modules``: every decoder linear. Every target pattern must match some
    linear of the whole model (not necessarily of this pipeline stage). Defaults are verl's
    (``actor_rollout_ref.model.lora.*``) except ``rank``, which must be > 0.
    """
    target_modules, exclude_modules = list(target_modules or ()), list(exclude_modules or ())
    if rank <= 0:
        raise ValueError(f"LoRA rank must be > 0 (got {rank}; verl's rank 0 means no LoRA: do not call apply_lora)")
    for which, method in (("a_init", a_init), ("b_init", b_init)):
        if method not in INIT_METHODS:
            raise ValueError(f"{which}={method!r}: expected one of {sorted(INIT_METHODS)}")
    if dropout_position not in ("pre", "post"):
        raise ValueError(f"dropout_position={dropout_position!r}: expected 'pre' or 'post'")
    if dropout_position == "post" and dropout > 0:
        raise NotImplementedError("LoRA dropout_position='post' is not implemented; use 'pre' (verl's default)")
    cs = [unwrap(c) for c in chunks(model)]
    everything = adaptable_modules(cs[0].hf_config)
    unmatched = [p for p in target_modules if not any(_matches(p, n) for n in everything)]
    if unmatched:
        raise ValueError(f"LoRA target_modules {unmatched} match no linear of the model "
                         f"(its linears: {sorted({n.rsplit('.', 1)[-1] for n in everything})})")
    if any(isinstance(module, LoRALinear) for m in cs for module in m.modules()):
        raise ValueError("the model already holds LoRA adapters")
    for m in cs:
        for p in m.parameters():
            p.requires_grad_(False)
        for local, module in list(m.named_modules()):
            name = canonical_name(local + ".weight", m.layer_offset, getattr(m, "expert_offset", 0))[:-len(".weight")]
            if not is_target(name, target_modules, exclude_modules):
                continue
            if type(module) not in _LORA_CLASS:
                raise NotImplementedError(
                    f"{local}: LoRA on {type(module).__name__} is not implemented (the local layer spec's "
                    f"ColumnParallelLinear / RowParallelLinear are; build the model with use_te=False)")
            _attach(module, name, rank=rank, alpha=alpha, dropout=dropout, a_init=a_init, b_init=b_init, seed=seed,
                    dtype=dtype)
        if m.pre_process and not getattr(m, "_lora_input_hook", None):
            m._lora_input_hook = m.embedding.register_forward_hook(_require_input_grad)
    # a stage may hold no adapter (``*.layers.0.*`` under pipeline parallelism): only the whole model is checked
    return model


# ---------------------------------------------------------------------------------------------------
# the adapters of a live model


def lora_modules(model) -> Iterator[tuple[str, _LoRAMixin]]:
    """``(canonical module name, module)`` of every LoRA linear of this rank's chunk(s), in model order."""
    for c in chunks(model):
        for module in unwrap(c).modules():
            if isinstance(module, LoRALinear):
                yield module.lora_name, module


def lora_parameters(model) -> list[nn.Parameter]:
    """The trainable parameters: every adapter factor of this rank (for the optimizer)."""
    return [p for _, m in lora_modules(model) for p in (m.lora_A.weight, m.lora_B.weight)]


def adapter_named_parameters(model) -> Iterator[tuple[str, nn.Parameter]]:
    """``(canonical name, parameter)``: ``decoder.layers.{i}.<...>.linear_qkv.lora_A.weight`` etc."""
    for name, m in lora_modules(model):
        yield name + ".lora_A.weight", m.lora_A.weight
        yield name + ".lora_B.weight", m.lora_B.weight


def _by_name(model, tensor_of, full: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in lora_modules(model):
        for which in ("lora_A", "lora_B"):
            key = f"{name}.{which}.weight"
            t = tensor_of(getattr(m, which).weight)
            if full and adapter_tp_kind(key) != "rep" and m.tp_group.size() > 1:
                shards = [torch.empty_like(t) for _ in range(m.tp_group.size())]
                dist.all_gather(shards, t.contiguous(), group=m.tp_group)
                t = merge_adapter_shards(key, shards)
            out[key] = t.clone() if full else t
    return out


def adapter_state_dict(model, *, full: bool = False) -> dict[str, torch.Tensor]:
    """The adapters only, by canonical name: this rank's shards (detached views of the parameters), or
    (``full``; collective over each layer's TP group) copies of the whole tensors, as a TP=1 model holds them."""
    return _by_name(model, lambda p: p.detach(), full)


def adapter_grads(model, *, full: bool = False) -> dict[str, torch.Tensor]:
    """The adapters' ``.grad`` by canonical name (zeros where there is none); ``full`` as in
    :func:`adapter_state_dict`."""
    return _by_name(model, lambda p: torch.zeros_like(p) if p.grad is None else p.grad.detach(), full)


@torch.no_grad()
def load_adapter_state(model, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy full (TP=1) adapter tensors ``{canonical name: tensor}`` into this rank's shards. ``strict``: every
    adapter of this rank must be in ``state`` (names of other pipeline stages' adapters are ignored)."""
    for name, m in lora_modules(model):
        for which in ("lora_A", "lora_B"):
            key = f"{name}.{which}.weight"
            p = getattr(m, which).weight
            if key not in state:
                if strict:
                    raise KeyError(f"adapter state has no {key}")
                continue
            shard = shard_adapter(key, state[key], m.tp_group.size(), m.tp_group.rank())
            if shard.shape != p.shape:
                raise ValueError(f"{key}: shard {tuple(shard.shape)} != parameter {tuple(p.shape)}")
            p.copy_(shard)


def training_report(model, optimizer) -> dict[str, float]:
    """What this rank trains, after an optimizer step (megatron's optimizer, a chain of them included):
    ``adapters`` (LoRA linears), ``adapter_params`` (their factors' elements), ``optimizer_params`` (elements of
    the parameters the optimizer steps: equal to ``adapter_params`` when only the adapters train),
    ``optimizer_state`` (elements of its per-parameter state, e.g. Adam's two moments: 2 x ``adapter_params``)
    and ``frozen_with_grad`` (base parameters holding a gradient: 0)."""
    adapters = {id(p) for p in lora_parameters(model)}
    n_opt = n_state = 0
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(o, "is_stub_optimizer", False):
            continue
        n_opt += sum(p.numel() for p in o.get_parameters())
        inner = getattr(o, "optimizer", o)
        n_state += sum(v.numel() for st in inner.state.values() for v in st.values()
                       if torch.is_tensor(v) and v.dim() > 0)  # Adam's scalar step counter is no per-element state
    frozen = 0
    for c in chunks(model):
        for p in unwrap(c).parameters():
            if id(p) not in adapters and (p.grad is not None or getattr(p, "main_grad", None) is not None):
                frozen += 1
    return {"adapters": float(sum(1 for _ in lora_modules(model))),
            "adapter_params": float(sum(p.numel() for p in lora_parameters(model))),
            "optimizer_params": float(n_opt), "optimizer_state": float(n_state), "frozen_with_grad": float(frozen)}


def set_adapters_enabled(model, enabled: bool) -> None:
    """Switch every adapter of this rank on or off; off, the forward is the base model's, bit for bit (the LoRA
    branch is skipped, not multiplied by zero)."""
    for _, m in lora_modules(model):
        m.lora_enabled = bool(enabled)


@contextlib.contextmanager
def adapters_disabled(model):
    """``with adapters_disabled(model):`` the base model (e.g. the reference policy's log-probs from the actor)."""
    mods = [m for _, m in lora_modules(model)]
    before = [m.lora_enabled for m in mods]
    try:
        for m in mods:
            m.lora_enabled = False
        yield model
    finally:
        for m, b in zip(mods, before):
            m.lora_enabled = b


def merged_weight(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B @ A`` (accumulated in float32, returned in ``W``'s dtype). Valid on full tensors and on
    matching TP shards alike: a column-parallel shard ``W_t`` pairs with ``B_t`` and the whole ``A``, a
    row-parallel ``W_t`` with the whole ``B`` and ``A_t``."""
    delta = lora_B.float() @ lora_A.float()  # [out(/T), in(/T)]
    return (weight.float() + scale * delta).to(weight.dtype)


def merged_local_weights(model) -> dict[str, torch.Tensor]:
    """``{canonical base weight name: this rank's merged shard}`` for every LoRA linear (merged export / sync)."""
    return {name + ".weight": m.merged_weight() for name, m in lora_modules(model)}


# ---------------------------------------------------------------------------------------------------
# pure tensor transforms: TP shards and the HF peft layout


def _base_module_name(adapter_name: str) -> str:
    for s in ADAPTER_SUFFIXES:
        if adapter_name.endswith(s):
            return adapter_name[: -len(s)]
    raise ValueError(f"{adapter_name!r} is not a LoRA adapter name (ends in {' or '.join(ADAPTER_SUFFIXES)})")


def is_adapter_key(name: str) -> bool:
    """Whether a model state entry (a ``state_dict`` / ``sharded_state_dict`` key) is an adapter factor."""
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_tp_kind(adapter_name: str) -> str:
    """How an adapter tensor splits over TP, in :func:`megatron_bridge.convert.tp_kind`'s terms: ``B`` of a
    column-parallel base like the base weight (``row``, or ``glu`` for ``linear_fc1``), ``A`` of a row-parallel
    base like the base weight (``col``), the other factor replicated (``rep``)."""
    base = tp_kind(_base_module_name(adapter_name) + ".weight")
    is_a = adapter_name.endswith(ADAPTER_SUFFIXES[0])
    if base == "col":
        return "col" if is_a else "rep"
    return "rep" if is_a else base


def shard_adapter(adapter_name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s shard of a full adapter tensor (the base weight's own split, :func:`convert.tp_shard`)."""
    if adapter_tp_kind(adapter_name) == "rep":
        return full
    return tp_shard(_base_module_name(adapter_name) + ".weight", full, tp, rank)


def merge_adapter_shards(adapter_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`shard_adapter` over all TP ranks' shards."""
    if adapter_tp_kind(adapter_name) == "rep":
        return shards[0]
    return tp_merge(_base_module_name(adapter_name) + ".weight", shards)


PEFT_PREFIX = "base_model.model."  # peft's PeftModelForCausalLM wraps the HF model twice


def _peft_key(hf_weight_name: str, which: str, prefix: str) -> str:
    return f"{prefix}{hf_weight_name[: -len('.weight')]}.{which}.weight"


def lora_state_to_peft(state: dict[str, torch.Tensor], hf: HFModelConfig, *, prefix: str = PEFT_PREFIX
                       ) -> dict[str, torch.Tensor]:
    """Full (TP-merged) adapter tensors by canonical name -> HF peft's names and layout.

    ``A`` of a fused layer is copied to every part (q/k/v, gate/up); ``B``'s rows split exactly as the base
    weight's (:func:`megatron_bridge.convert.canonical_to_hf`), so the peft model computes the same function.
    """
    out = {}
    for name, t in state.items():
        base = _base_module_name(name) + ".weight"
        if name.endswith(ADAPTER_SUFFIXES[0]):
            parts = [(n, t.clone()) for n in hf_names_for(base, hf)]  # clones: safetensors refuses shared storage
        else:
            parts = canonical_to_hf(base, t, hf)
        which = "lora_A" if name.endswith(ADAPTER_SUFFIXES[0]) else "lora_B"
        for n, v in parts:
            out[_peft_key(n, which, prefix)] = v.contiguous()
    return out


def peft_to_lora_state(peft_state: dict[str, torch.Tensor], hf: HFModelConfig, *, prefix: str = PEFT_PREFIX,
                       combine_a: str = "equal") -> dict[str, torch.Tensor]:
    """HF peft adapter tensors -> full adapter tensors by canonical name (inverse of :func:`lora_state_to_peft`).

    ``combine_a``: ``"equal"`` (adapters) requires the parts of a fused layer to share one ``A`` and refuses
    anything else (independent ``A_q, A_k, A_v`` have no fused equivalent); ``"sum"`` (gradients) adds them,
    since the fused layer's ``A`` feeds every part. A part without an adapter gets zero rows of ``B``.
    """
    if combine_a not in ("equal", "sum"):
        raise ValueError(f"combine_a={combine_a!r}: expected 'equal' or 'sum'")
    stripped = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in peft_state.items()}
    stripped = {re.sub(r"\.lora_([AB])\.[^.]+\.weight$", r".lora_\1.weight", k): v for k, v in stripped.items()}
    out, used = {}, set()
    for module in adaptable_modules(hf):
        base = module + ".weight"
        names = hf_names_for(base, hf)
        a_keys = [_peft_key(n, "lora_A", "") for n in names]
        b_keys = [_peft_key(n, "lora_B", "") for n in names]
        present = [i for i, k in enumerate(a_keys) if k in stripped]
        if not present:
            continue
        a_parts = [stripped[a_keys[i]] for i in present]
        if combine_a == "sum":
            a = torch.stack(a_parts).sum(0)
        else:
            if any(not torch.equal(p, a_parts[0]) for p in a_parts[1:]):
                raise ValueError(f"{[names[i] for i in present]}: the peft adapter has a different lora_A per part; "
                                 f"a fused megatron layer ({module}) shares one A and cannot represent it")
            a = a_parts[0]
        r = a.shape[0]

        def get_b(n, _names=names, _b=b_keys, _present=present):
            i = _names.index(n)
            if i in _present:
                return stripped[_b[i]]
            # a part without an adapter: its rows of B are zero (its output is the base's); its height is
            # the base weight's, read from the config through the converter's own fusion of a zero weight
            return torch.zeros(_part_rows(n, hf), r, dtype=a.dtype)

        out[module + ".lora_A.weight"] = a.clone()
        out[module + ".lora_B.weight"] = hf_to_canonical(base, get_b, hf, padded_vocab=0)
        used.update(a_keys[i] for i in present)
        used.update(b_keys[i] for i in present)
    extra = sorted(set(stripped) - used)
    if extra:
        raise KeyError(f"peft tensors with no megatron adapter: {extra[:4]}")
    return out


def _part_rows(hf_weight_name: str, hf: HFModelConfig) -> int:
    """Output rows of one HF projection (q/k/v/o, gate/up/down, experts' and shared expert's)."""
    leaf = hf_weight_name.rsplit(".", 2)[-2]
    if leaf == "q_proj":
        return hf.num_heads * hf.head_dim
    if leaf in ("k_proj", "v_proj"):
        return hf.num_kv_heads * hf.head_dim
    if leaf == "o_proj" or leaf == "down_proj":
        return hf.hidden_size
    if ".shared_expert." in hf_weight_name:
        return hf.shared_expert_intermediate_size
    if ".experts." in hf_weight_name:
        return hf.moe_intermediate_size
    return hf.intermediate_size


def peft_target_modules(state: Iterable[str], hf: HFModelConfig) -> list[str] | str:
    """peft's ``target_modules`` for the adapters named in ``state``: the list of HF leaf names (``q_proj``,
    ...) when they cover every such projection of the model, else a regex of exactly the adapted modules
    (peft full-matches a string against each module name)."""
    targets = set()
    for name in state:
        for n in hf_names_for(_base_module_name(name) + ".weight", hf):
            targets.add(n[: -len(".weight")])
    every = {n[: -len(".weight")] for m in adaptable_modules(hf) for n in hf_names_for(m + ".weight", hf)}
    leaves = {t.rsplit(".", 1)[-1] for t in targets}
    if targets == {n for n in every if n.rsplit(".", 1)[-1] in leaves}:
        return sorted(leaves)
    return "(" + "|".join(re.escape(t) for t in sorted(targets)) + ")"


def peft_adapter_config(state: Iterable[str], hf: HFModelConfig, *, rank: int, alpha: float, dropout: float = 0.0,
                        base_model_name_or_path: str | None = None) -> dict:
    """The ``adapter_config.json`` of peft's ``LoraConfig`` for :func:`lora_state_to_peft`'s tensors."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(rank),
        "lora_alpha": alpha,
        "lora_dropout": float(dropout),
        "target_modules": peft_target_modules(state, hf),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,  # scale alpha / r, as here
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


# ---------------------------------------------------------------------------------------------------
# peft adapter directories (PeftModel.save_pretrained's layout)

PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def read_peft_adapter(path: str, hf: HFModelConfig) -> dict[str, torch.Tensor]:
    """A peft LoRA adapter directory as full adapter tensors by canonical name (:func:`peft_to_lora_state`;
    float32). The caller checks its ``r`` / ``lora_alpha`` against the model's adapters."""
    state = {k: v.float() for k, v in load_file(os.path.join(path, PEFT_WEIGHTS)).items()}
    return peft_to_lora_state(state, hf)


def gather_adapter_state(model) -> dict[str, torch.Tensor] | None:
    """Every adapter of the whole model as full (TP=1) tensors on global rank 0 (None elsewhere). Collective over
    the world: each layer's TP group merges its shards, then every rank's adapters (other pipeline stages, other
    experts; data-parallel replicas hold the same ones) go to rank 0 as objects (the adapters are small)."""
    full = {k: v.detach().cpu() for k, v in adapter_state_dict(model, full=True).items()}
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(full, parts, dst=0)
    if dist.get_rank() != 0:
        return None
    out: dict[str, torch.Tensor] = {}
    for p in parts:
        for k, v in p.items():
            out.setdefault(k, v)
    return dict(sorted(out.items()))


def iter_adapter_hf(model) -> Iterator[tuple[str, torch.Tensor]]:
    """``(peft name without the wrapper prefix, full tensor)`` of every adapter of the whole model, on every rank:
    the tensors an adapter-only weight sync moves (``model.layers.0.self_attn.q_proj.lora_A.weight`` ...;
    :func:`lora_state_to_peft`, so an engine adds ``scale * B @ A`` to the HF weight of the same name). Collective
    over the world, like the full-weight stream it stands in for: each layer's TP group merges its shards, then
    (with PP or EP) every rank's adapters (other pipeline stages, other experts) go to every rank as objects (the
    adapters are small; data-parallel replicas hold the same ones). In name order."""
    full = {k: v.detach().cpu() for k, v in adapter_state_dict(model, full=True).items()}
    state: dict[str, torch.Tensor] = full
    if ps.get_pipeline_model_parallel_world_size() > 1 or ps.get_expert_model_parallel_world_size() > 1:
        # other stages' layers, other ranks' experts (without PP and EP a TP group holds every adapter already)
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, full)
        state = {}
        for p in parts:
            for k, v in p.items():
                state.setdefault(k, v)
    hf = unwrap(chunks(model)[0]).hf_config
    yield from sorted(lora_state_to_peft(state, hf, prefix="").items())


def export_peft_adapter(model, out_dir: str, *, rank: int, alpha: float, base_model_name_or_path: str | None,
                        dropout: float = 0.0) -> str | None:
    """Write the model's adapters as a peft adapter directory (``adapter_model.safetensors`` +
    ``adapter_config.json``) that ``peft.PeftModel.from_pretrained(<base HF model>, out_dir)`` loads: the same
    function as the megatron model's (:func:`lora_state_to_peft`). Collective (every rank calls); rank 0 writes
    into a temporary directory renamed into place. Returns the path on rank 0."""
    state = gather_adapter_state(model)
    if dist.get_rank() == 0:
        hf = unwrap(chunks(model)[0]).hf_config
        with staged_dir(out_dir) as tmp:
            save_file(lora_state_to_peft(state, hf), os.path.join(tmp, PEFT_WEIGHTS), metadata={"format": "pt"})
            cfg = peft_adapter_config(state, hf, rank=rank, alpha=alpha, dropout=dropout,
                                      base_model_name_or_path=base_model_name_or_path)
            with open(os.path.join(tmp, PEFT_CONFIG), "w", encoding="utf-8") as f:
                json.dump(cfg, f, indent=2, sort_keys=True)
    dist.barrier()
    return out_dir if dist.get_rank() == 0 else None
