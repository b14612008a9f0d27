"""megatron-core imported without loading ``torch._dynamo`` and inductor: a megatron process starts ~2 s sooner.

Why. megatron-core decorates its fused kernels at import (``megatron.core.jit.jit_fuser``, which is
``torch.compile`` on torch >= 2.2, over ``fused_bias_geglu``, ``fused_bias_gelu``, ...), and ``torch.compile(fn)``
imports dynamo and inductor's ``compile_fx`` before it returns, although it compiles nothing until the first call.
Measured on a 2-core AMD EPYC: ``import megatron.core, megatron.core.models.gpt`` after torch and tensordict
4.2 s -> 1.9 s. Every actor, critic and reference rank of a run pays it at start-up; the CPU recipes never call
those kernels (the fusions are off without CUDA), and a GPU run that does compiles them on first call as before.

What it does. While a ``megatron.*`` module's body runs, ``torch.compile`` is a deferring decorator: it returns a
function that calls ``torch.compile(fn, **kwargs)`` (the real one) on its first call and the compiled function from
then on, which is when the real ``torch.compile`` does its work too. ``jit_fuser`` keeps the deferring decorator
for megatron's own later uses; an ``nn.Module`` is handed to the real ``torch.compile`` at once (its wrapper is a
module). Installed by ``megatron_bridge/__init__.py`` as an import hook (a ``sys.meta_path`` finder that wraps
the loader of ``megatron`` modules), so it is in place whichever bridge module imports megatron first.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading

# megatron module bodies being executed, in any thread, and torch.compile as it was before the first of them:
# the deferring decorator stays in place until the last one ends (a per-thread count would let two threads
# importing at once restore each other's patch)
_LOCK = threading.Lock()
_STATE = {"depth": 0, "real": None}


def deferred(real_compile):
    """A ``torch.compile`` that compiles on the first call (see the module docstring)."""

    def compile_later(model=None, **kwargs):
        if model is None:  # @torch.compile(dynamic=..., ...)
            return lambda fn: compile_later(fn, **kwargs)
        import torch

        if isinstance(model, torch.nn.Module):
            return real_compile(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **kwargs)
            return compiled(*args, **kw)

        call.__wrapped_compile_kwargs__ = kwargs
        return call

    compile_later.__deferred_torch_compile__ = True
    return compile_later


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        import torch

        with _LOCK:
            if _STATE["depth"] == 0:
                _STATE["real"] = torch.compile
                torch.compile = deferred(_STATE["real"])
            _STATE["depth"] += 1
        try:
            self._loader.exec_module(module)
        finally:
            with _LOCK:
                _STATE["depth"] -= 1
                if _STATE["depth"] == 0:
                    torch.compile = _STATE["real"]

    def __getattr__(self, name):  # get_code, get_source, is_package, ... as the wrapped loader has them
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "megatron" and not fullname.startswith("megatron."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Idempotent; must run before megatron is imported to save anything."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
