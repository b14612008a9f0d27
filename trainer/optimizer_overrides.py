"""``<role>.optim.override_optimizer_config``: megatron-core ``OptimizerConfig`` fields set by the user, as
verl's megatron workers pass them through (verl updates the ``OptimizerConfig`` it builds with them).

Every field of the dataclass is accepted on the megatron strategy (an unknown name is refused with the
closest ones), except the fields Coxswain sets from the role's own keys (:data:`OPTIM_SET`): a second value
would contradict them, so each is refused with the key that sets it. The DeepSpeed and FSDP strategies
build their own ``torch.optim.AdamW``: there the key is refused.

On a GPU every field reaches ``OptimizerConfig`` as given. On a CPU run:

* :data:`HOST_OFFLOAD_FIELDS` (megatron's ``HybridDeviceOptimizer``: the optimizer state and step moved
  from GPU memory to the host) are turned off, with one note: on a CPU the state already lives in host
  memory and the step already runs there, and the same fp32 Adam update is computed;
* ``use_precision_aware_optimizer`` (Transformer Engine's ``FusedAdam``, a GPU kernel) with fp32 main
  parameters, gradients and moments (its defaults) is turned off with the same note: the arithmetic is
  the fp32 Adam update either way. With a lower-precision state (:data:`PRECISION_DTYPES` set to bf16,
  fp16 or fp8) it is refused: that changes the numbers, and the CPU has no such kernel.

Dtype fields are written as verl users write them (``bf16``, ``float32``, ...) and handed to megatron as
``torch`` dtypes. Field names are read from megatron-core's source (the import takes seconds).
"""

from __future__ import annotations

import difflib

import torch

from trainer.transformer_overrides import dataclass_fields, switched_on

OPTIM_SET: dict[str, str] = {
    "optimizer": "<role>.optim.optimizer", "lr": "<role>.optim.lr", "min_lr": "<role>.optim.min_lr",
    "weight_decay": "<role>.optim.weight_decay", "adam_beta1": "<role>.optim.betas",
    "adam_beta2": "<role>.optim.betas", "adam_eps": "<role>.optim.eps",
    "clip_grad": "<role>.optim.clip_grad (the actor: actor_rollout_ref.actor.grad_clip); Coxswain clips itself",
    **dict.fromkeys(("bf16", "fp16", "params_dtype"), "<role>.megatron.dtype"),
    "use_distributed_optimizer": "<role>.megatron.use_distributed_optimizer",
}
HOST_OFFLOAD_FIELDS = ("optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
                       "use_torch_optimizer_for_cpu_offload", "pin_cpu_grads", "pin_cpu_params")
PRECISION_AWARE_FIELDS = ("use_precision_aware_optimizer", "store_param_remainders")
PRECISION_DTYPES = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "float": "float32", "torch.float32": "float32",
               "bf16": "bfloat16", "bfloat16": "bfloat16", "torch.bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16", "half": "float16", "torch.float16": "float16",
               "fp8": "uint8", "uint8": "uint8", "torch.uint8": "uint8"}  # megatron stores fp8 moments as uint8


def optimizer_config_fields() -> frozenset[str]:
    """The field names of megatron-core's ``OptimizerConfig``, from the installed source."""
    return dataclass_fields((("optimizer", "optimizer_config.py"), "OptimizerConfig"))


def _dtype_name(v) -> str | None:
    return DTYPE_NAMES.get(str(v).strip().lower()) if v is not None else None


def _fp32_state(over: dict) -> bool:
    return all(_dtype_name(over.get(k, "fp32")) == "float32" for k in PRECISION_DTYPES)


def override_errors(role: str, over: dict, *, strategy: str, device: str) -> list[str]:
    """What is wrong with ``<role>.optim.override_optimizer_config`` (``over``) for this strategy and device."""
    key = f"{role}.optim.override_optimizer_config"
    if not over:
        return []
    if strategy != "megatron":
        return [f"{key}: megatron-core OptimizerConfig fields, read by strategy=megatron only; strategy={strategy} "
                f"builds its own AdamW from {role}.optim: remove the lines, or use strategy=megatron."]
    errs, fields = [], optimizer_config_fields()
    for name in sorted(over):
        if name in OPTIM_SET:
            errs.append(f"{key}.{name}: set by Coxswain from {OPTIM_SET[name].replace('<role>', role)}; set it there.")
        elif name not in fields:
            near = difflib.get_close_matches(name, sorted(fields), n=3, cutoff=0.7)
            errs.append(f"{key}.{name}: not a field of megatron-core's OptimizerConfig"
                        + (f" (closest: {', '.join(near)})." if near else "."))
        elif name in PRECISION_DTYPES and _dtype_name(over[name]) is None:
            errs.append(f"{key}.{name}={over[name]!r}: not a dtype; use fp32, bf16, fp16 or fp8.")
    if not _fp32_state(over) and not switched_on(over.get("use_precision_aware_optimizer")):
        errs.append(f"{key}: {', '.join(k for k in PRECISION_DTYPES if k in over)} below fp32 need "
                    f"use_precision_aware_optimizer=True (megatron-core keeps the optimizer state in fp32 otherwise).")
    elif not _fp32_state(over) and device == "cpu":
        errs.append(f"{key}: a bf16 / fp16 / fp8 optimizer state runs in Transformer Engine's FusedAdam (a GPU kernel) "
                    f"and changes the numbers; on a CPU keep {', '.join(PRECISION_DTYPES)} at fp32, or train with "
                    f"trainer.device=cuda.")
    return errs


def turned_off(over: dict) -> list[str]:
    """The switches of ``over`` that a CPU run turns off (valid ``over`` only)."""
    return [k for k in (*HOST_OFFLOAD_FIELDS, *PRECISION_AWARE_FIELDS) if switched_on(over.get(k))]


def cpu_note(names: list[str]) -> str:
    """The one note a CPU run prints for the switches it turned off."""
    return (f"*.optim.override_optimizer_config: {', '.join(sorted(set(names)))} turned off on this CPU run: they move "
            f"the optimizer's state and step from GPU memory to the host, or run the fp32 Adam step in Transformer "
            f"Engine's FusedAdam; on a CPU the state is in host memory already and the same fp32 update runs. On "
            f"trainer.device=cuda they apply.")


def passthrough(over: dict, cuda: bool) -> dict:
    """The ``OptimizerConfig`` keywords of ``over``: dtypes as torch dtypes; without a GPU, the host-offload and
    precision-aware switches (and the dtypes that go with the latter, all fp32 here) left at megatron's defaults."""
    out = {k: (getattr(torch, _dtype_name(v)) if k in PRECISION_DTYPES else v) for k, v in over.items()}
    if not cuda:
        for k in (*HOST_OFFLOAD_FIELDS, *PRECISION_AWARE_FIELDS, *PRECISION_DTYPES):
            out.pop(k, None)
    return out
