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
* the MoE all-to-all token dispatcher copies its split sizes to the host on a side CUDA stream and
  waits on an event: ``torch.cuda.Stream()`` / ``current_stream()`` return one CPU stand-in stream
  (so the copy runs inline, "on the current stream"), ``torch.cuda.stream(s)`` is a null context,
  and the stand-in's ``record_event()`` gives an event whose ``synchronize()`` returns at once.
* that dispatcher's split sizes stay CPU tensors (on GPU they become host numpy arrays), which
  ``all_to_all_single``'s binding refuses: a wrapper converts them to lists (process-wide, since the
  dispatcher's backward runs where the thread's function mode is not active).
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
_all_to_all_single = torch.distributed.all_to_all_single


class _CpuEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """The one stand-in CUDA stream of a CPU process: work on it is the host's, in order."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _CpuEvent()

    def synchronize(self) -> None:
        pass


_STREAM = _CpuStream()


class _StreamType(_CpuStream):
    """``torch.cuda.Stream``'s stand-in: a class, so annotations such as ``torch.cuda.Stream | None``
    (transformers evaluates them at import) still work, whose constructor returns the one stream."""

    def __new__(cls, *a, **k):
        return _STREAM


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
        torch.cuda.Stream = _StreamType
        torch.cuda.current_stream = lambda *a, **k: _STREAM
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
            tolist = lambda v: v.tolist() if hasattr(v, "tolist") else v  # noqa: E731
            return _all_to_all_single(output, input, tolist(output_split_sizes), tolist(input_split_sizes), *a, **k)

        torch.distributed.all_to_all_single = all_to_all_single
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


def fix_moe_without_te() -> None:
    """megatron-core 0.16.1's router gating function names ``te_general_gemm`` even when Transformer
    Engine is absent (its import is guarded, the name is not): define it as None so the torch path runs."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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
