"""``*.megatron.override_transformer_config``: megatron-core ``TransformerConfig`` fields set by the user,
as verl passes them through.

Every field of the dataclass is accepted (an unknown name is refused with the closest ones), except:

* the fields the megatron bridge derives from the checkpoint's config.json or from the role's
  ``megatron`` section (:data:`BRIDGE_SET`): a second value would contradict the weights or the
  layout, so each is refused with the key that sets it;
* ``attention_dropout`` above 0 (the bridge's core attention, torch SDPA over packed rows, has no
  dropout).

Fields whose implementation is a GPU library's kernel (Transformer Engine, apex, CUDA graphs, fused
CUDA kernels) stay in the resolved config and reach ``TransformerConfig`` on GPU. On a CPU run:

* :data:`GPU_KERNEL_FIELDS` are turned off, with one note: each fuses, overlaps or replays the same
  arithmetic in one kernel (bias + activation, bias + dropout + add, masked softmax, RoPE, the
  weight-gradient accumulation into the fp32 main grad, the experts' GEMMs as one grouped GEMM,
  token permutation, DeepEP's token dispatch, communication overlap, CUDA graph replay), so turning
  it off changes no number beyond float rounding order;
* :data:`GPU_PRECISION_FIELDS` (FP8 / FP4 compute) are refused: they change the numbers, and the
  CPU has no such kernels.

The field names are read from megatron-core's source (:func:`transformer_config_fields`), not by
importing it: the import takes seconds, and ``--print-config`` should not pay it.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import os

# set by the bridge (megatron_bridge.hf_config.transformer_config_kwargs) -> the key that sets it instead
_FROM_HF = "the checkpoint's config.json (actor_rollout_ref.model.override_config for the overridable fields)"
BRIDGE_SET: dict[str, str] = {
    **dict.fromkeys(("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "kv_channels", "layernorm_epsilon", "normalization", "gated_linear_unit", "activation_func",
                     "add_bias_linear", "add_qkv_bias", "qk_layernorm", "num_moe_experts", "moe_router_topk",
                     "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                     "moe_router_pre_softmax", "moe_router_score_function"), _FROM_HF),
    "tensor_model_parallel_size": "<role>.megatron.tensor_model_parallel_size",
    "pipeline_model_parallel_size": "<role>.megatron.pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size": "<role>.megatron.virtual_pipeline_model_parallel_size",
    "context_parallel_size": "<role>.megatron.context_parallel_size",
    "expert_model_parallel_size": "<role>.megatron.expert_model_parallel_size",
    "expert_tensor_parallel_size": "<role>.megatron.expert_tensor_parallel_size",
    "sequence_parallel": "<role>.megatron.sequence_parallel",
    "pipeline_model_parallel_layout": "<role>.megatron.pipeline_layer_split",
    "num_layers_in_first_pipeline_stage": "<role>.megatron.pipeline_layer_split",
    "num_layers_in_last_pipeline_stage": "<role>.megatron.pipeline_layer_split",
    **dict.fromkeys(("params_dtype", "pipeline_dtype", "bf16", "fp16"), "<role>.megatron.dtype"),
    "use_cpu_initialization": "the device (CPU initialisation exactly when there is no GPU)",
    "variable_seq_lengths": "the bridge's schedule (set from the virtual pipeline size)",
}

GPU_KERNEL_FIELDS = (
    "apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "persist_layer_norm",
    "gradient_accumulation_fusion", "cross_entropy_loss_fusion", "moe_grouped_gemm", "moe_use_legacy_grouped_gemm",
    "moe_permute_fusion", "moe_router_fusion", "moe_enable_deepep", "tp_comm_overlap", "enable_cuda_graph",
    "external_cuda_graph",
)
GPU_PRECISION_FIELDS = ("fp8", "fp8_param", "fp4", "fp4_param")

# read by Coxswain itself (trainer.verl_compat.recompute_settings / moe_settings), not passed as they are
RECOMPUTE_KEYS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")
MOE_KEYS = ("moe_aux_loss_coeff", "moe_router_load_balancing_type", "moe_z_loss_coeff")
MOE_BALANCING = ("aux_loss", "seq_aux_loss", "none")
NO_EFFECT = ("attention_backend",)  # verl's attention selector: the bridge picks its attention itself


@functools.lru_cache(maxsize=None)
def dataclass_fields(*sources: tuple[tuple[str, ...], str]) -> frozenset[str]:
    """The annotated field names of megatron-core dataclasses, each given as (path parts under ``megatron/core``,
    class name), read from the installed source."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("megatron-core is not installed: pip install megatron-core (Coxswain's trainer needs it)")
    root = spec.submodule_search_locations[0]
    names: set[str] = set()
    for rel, cls in sources:
        with open(os.path.join(root, *rel), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        body = next(n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        names.update(s.target.id for s in body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
    return frozenset(names)


def transformer_config_fields() -> frozenset[str]:
    """The field names of megatron-core's ``TransformerConfig`` (its own and ``ModelParallelConfig``'s)."""
    return dataclass_fields((("transformer", "transformer_config.py"), "TransformerConfig"),
                            (("model_parallel_config.py",), "ModelParallelConfig"))


def switched_on(v) -> bool:
    """A kernel switch that asks for the kernel (True, or a non-empty setting such as fp8="hybrid")."""
    return bool(v) and v not in ("none", "None")


def override_errors(role: str, over: dict, device: str) -> list[str]:
    """What is wrong with ``<role>.megatron.override_transformer_config`` (``over``) on ``device``."""
    errs, key = [], f"{role}.megatron.override_transformer_config"
    fields = transformer_config_fields()
    for name in sorted(over):
        if name in BRIDGE_SET:
            errs.append(f"{key}.{name}: set by Coxswain's megatron bridge from "
                        f"{BRIDGE_SET[name].replace('<role>', role)}; set it there, not here.")
        elif name not in fields and name not in NO_EFFECT:
            near = difflib.get_close_matches(name, sorted(fields), n=3, cutoff=0.7)
            errs.append(f"{key}.{name}: not a field of megatron-core's TransformerConfig"
                        + (f" (closest: {', '.join(near)})." if near else "."))
        elif name in GPU_PRECISION_FIELDS and switched_on(over[name]) and device == "cpu":
            errs.append(f"{key}.{name}={over[name]!r}: FP8 / FP4 compute runs in Transformer Engine's GPU kernels and "
                        f"changes the numbers; a CPU has neither: remove it, or train with trainer.device=cuda.")
    if over.get("moe_token_dispatcher_type") == "flex" and device == "cpu":
        errs.append(f"{key}.moe_token_dispatcher_type='flex' dispatches tokens with DeepEP, a GPU library; on a CPU "
                    f"use 'alltoall' (the same tokens reach the same experts).")
    drop = over.get("attention_dropout")
    if drop is not None and float(drop) > 0:
        errs.append(f"{key}.attention_dropout={drop}: the megatron bridge's attention (torch SDPA over packed rows) "
                    f"has no dropout; remove it (or use strategy=deepspeed with model.override_config.attention_dropout).")
    lb = over.get("moe_router_load_balancing_type")
    if lb is not None and lb not in MOE_BALANCING:
        errs.append(f"{key}.moe_router_load_balancing_type={lb!r}: choose one of {list(MOE_BALANCING)}.")
    return errs


def kernels_turned_off(over: dict) -> list[str]:
    """The GPU-kernel switches of ``over`` that a CPU run turns off."""
    return [k for k in GPU_KERNEL_FIELDS if switched_on(over.get(k))]


def cpu_note(turned_off: list[str]) -> str:
    """The one note a CPU run prints for the switches it turned off."""
    return (f"*.megatron.override_transformer_config: {', '.join(sorted(set(turned_off)))} turned off on this CPU run: "
            f"each fuses, overlaps or replays the same arithmetic in a GPU library's kernel (Transformer Engine, apex, "
            f"CUDA), so no number changes beyond float rounding order; on trainer.device=cuda they apply.")


def passthrough(over: dict, cuda: bool) -> dict:
    """The fields a worker hands to ``TransformerConfig`` as they are: all but Coxswain's own
    (recompute and MoE losses, read by recompute_settings / moe_settings) and the no-effect selectors;
    without a GPU, the kernel switches turned off."""
    own = set(RECOMPUTE_KEYS) | set(MOE_KEYS) | set(NO_EFFECT)
    out = {k: v for k, v in over.items() if k not in own}
    if not cuda:
        out.update({k: False for k in kernels_turned_off(over)})
    return out
