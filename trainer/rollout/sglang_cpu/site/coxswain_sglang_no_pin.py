"""Let SGLang 0.5.21's LoRA layers start on a machine without an accelerator (CPU and test support).

``sglang/srt/lora/layers.py`` (its offsets) and ``lora/backend/torch_backend.py`` (each batch's adapter indices,
ranks and scalings) keep pinned host tensors: ``torch.tensor(..., pin_memory=True)`` and ``tensor.pin_memory()``.
Pinning page-locks host memory so that copies to a device run asynchronously; with no device there is nothing to
copy to, and torch raises ("pin_memory=True requires a CUDA or other accelerator backend") instead.
:func:`install` hooks the import of those modules (:data:`MODULES`); once one has executed, and only when torch
has no usable CUDA device, it:

- gives the module a ``torch`` whose tensor factories drop ``pin_memory``;
- makes ``Tensor.pin_memory()`` return the tensor (``lora.py`` pins each loaded adapter weight). Without a device
  every such call raises, so no call that worked before behaves differently.

On a GPU nothing here runs: this directory is on the path only for the CPU engine
(:func:`trainer.rollout.sglang_cpu.activate`).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

MODULES = frozenset({"sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend"})
FACTORIES = frozenset({"tensor", "empty", "zeros", "ones", "full", "arange"})


class UnpinnedTorch:
    """``torch`` as the module sees it, with ``pin_memory`` dropped from the tensor factories."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        attr = getattr(self._torch, name)
        if name not in FACTORIES:
            return attr

        @functools.wraps(attr)
        def unpinned(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return attr(*args, **kwargs)

        return unpinned


def _unpinned_tensor(self, *args, **kwargs):
    return self


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        if _no_cuda():
            module.torch = UnpinnedTorch(module.torch)
            module.torch.Tensor.pin_memory = _unpinned_tensor


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Put the finder in front of ``sys.meta_path`` (idempotent). It imports nothing: torch is looked at only when
    one of :data:`MODULES` loads, which happens only with ``enable_lora``."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
