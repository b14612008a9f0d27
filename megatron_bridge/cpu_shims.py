"""CPU shims that let megatron-core 0.16.1 run on a CPU-only torch with the gloo backend.

megatron-core assumes CUDA in a handful of places. Four small patches cover every one that the
bridge reaches (found by ``/work/shared/probes/megatron_cpu_check.py`` and by this package's tests):

* ``torch.cuda.current_device()`` is used as a ``device=`` argument when allocating buffers
  (tensor-parallel layers, p2p shape exchange, the global memory buffer). It returns ``cpu``.
* ``torch.cuda.synchronize()`` is called by the pipeline p2p batch path and by dist_checkpointing's
  save. It becomes a no-op.
* activation recompute (``CheckpointFunction``) saves and restores the CUDA RNG state around each
  recomputed block: with no CUDA device there is none, so the get / set become no-ops (megatron
  saves and restores the CPU generator itself).
* a few places pass a literal ``device="cuda"`` (the schedules' token counter, optimizer scalars)
  or call ``tensor.cuda()`` (tied embeddings under pipeline parallelism, before their all-reduce).
  A ``TorchFunctionMode`` rewrites any ``device="cuda..."`` keyword to ``"cpu"`` and turns
  ``Tensor.cuda()`` into the identity.

A fourth, scoped shim, :func:`cuda_type_names`, is used only while megatron's optimizer is built:
its mixed-precision wrapper (``Float16OptimizerWithFloat16Params``) sorts parameters by
``param.type()`` and accepts only the ``torch.cuda.*Tensor`` names, so bf16 training on CPU needs
the CPU names reported as their CUDA twins for the duration of that call.

Everything here is a no-op when CUDA is available: on a GPU machine megatron runs unpatched.
``install()`` is idempotent and is called by :func:`megatron_bridge.launch.init_distributed`.
The mode is pushed on the calling thread only (torch keeps the function-mode stack per thread).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_state = threading.local()
_patched = False


class CudaToCpu(TorchFunctionMode):
    """Rewrite ``device="cuda[:N]"`` keyword arguments to ``"cpu"`` on every torch call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        if kwargs:
            dev = kwargs.get("device")
            if dev is not None and str(dev).startswith("cuda"):
                kwargs = dict(kwargs)
                kwargs["device"] = "cpu"
        return func(*args, **(kwargs or {}))


def needed() -> bool:
    """True when the shims are required (no usable CUDA device)."""
    return not torch.cuda.is_available()


def install() -> bool:
    """Apply the shims on this thread if CUDA is absent. Returns whether they are active."""
    global _patched
    if not needed():
        return False
    if not _patched:
        torch.cuda.current_device = lambda: torch.device("cpu")
        torch.cuda.synchronize = lambda *a, **k: None
        # activation recompute saves and restores the CUDA RNG state around each recomputed block;
        # with no CUDA there is none (the CPU state, which megatron saves too, is the one dropout uses)
        from megatron.core.tensor_parallel import random as mp_random

        mp_random._get_cuda_rng_state = lambda *a, **k: None
        mp_random._set_cuda_rng_state = lambda *a, **k: None
        _patched = True
    if getattr(_state, "mode", None) is None:
        _state.mode = CudaToCpu()
        _state.mode.__enter__()
    return True


def uninstall_mode() -> None:
    """Pop the device-rewriting mode from this thread (benchmarks use it to time plain torch)."""
    mode = getattr(_state, "mode", None)
    if mode is not None:
        mode.__exit__(None, None, None)
        _state.mode = None


def active() -> bool:
    return getattr(_state, "mode", None) is not None


@contextlib.contextmanager
def suspended():
    """Run a block without the device-rewriting mode on this thread (restored afterwards). For code
    that shares a process with megatron but never reaches its CUDA assumptions, such as a hybrid
    engine's decode loop: under the mode every torch call, including those a compiled graph makes,
    goes through a Python ``__torch_function__``."""
    was = active()
    if was:
        uninstall_mode()
    try:
        yield
    finally:
        if was:
            install()


@contextlib.contextmanager
def cuda_type_names():
    """While active, ``tensor.type()`` (no arguments) of a CPU tensor returns the ``torch.cuda.``
    name (``torch.BFloat16Tensor`` -> ``torch.cuda.BFloat16Tensor``). Process-wide, so keep the
    block short: it wraps megatron's optimizer construction only. A no-op with CUDA."""
    if not needed():
        yield
        return
    orig = torch.Tensor.type

    def cuda_named(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            name = orig(self)  # may already be renamed: the function mode re-enters this wrapper
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return orig(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = cuda_named
    try:
        yield
    finally:
        torch.Tensor.type = orig
