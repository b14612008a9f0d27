"""Let SGLang 0.5.21 allocate its routed-experts host cache on a machine without CUDA (CPU and test support).

With ``enable_return_routed_experts`` SGLang keeps every token's routed experts in a host buffer
(``sglang/srt/state_capturer/base.py``, ``BaseHostCache``) allocated through
``sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS[device]``, which with ``pin_memory=True`` pins it
with ``cudaHostRegister`` (the "cpu" device falls to that default) and dies without a CUDA runtime. Pinning
only speeds the GPU-to-host copy; on a CPU engine the buffer is ordinary memory either way.

:func:`install` hooks that module's import (``coxswain_after_import``): once it has executed, it maps the
"cpu" device to a plain allocation, only when torch has no usable CUDA device. On a GPU nothing here runs:
this directory is on the path only for the CPU engine (:func:`trainer.rollout.sglang_cpu.activate`).
"""

from __future__ import annotations

from coxswain_after_import import after_import

MODULE = "sglang.srt.mem_cache.pool_host.common"


def plain_host_alloc(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """The allocator SGLang calls, minus the CUDA host registration (``pin_memory`` is ignored on purpose)."""
    del pin_memory, registration_granularity_bytes
    return allocator.allocate(dims, dtype=dtype, device=device)


def patch(module) -> bool:
    """Map the "cpu" device of ``module.ALLOC_MEMORY_FUNCS`` to :func:`plain_host_alloc` when CUDA is absent.
    Returns whether it did."""
    import torch

    if torch.cuda.is_available():
        return False
    module.ALLOC_MEMORY_FUNCS["cpu"] = plain_host_alloc
    return True


def install() -> None:
    after_import(MODULE, patch)
