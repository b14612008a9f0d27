"""Let SGLang 0.5.21's LoRA layers start on a machine without an accelerator (CPU and test support).

``sglang/srt/lora/layers.py`` (its offsets) and ``lora/backend/torch_backend.py`` (each batch's adapter indices,
ranks and scalings) keep pinned host tensors: ``torch.tensor(..., pin_memory=True)`` and ``tensor.pin_memory()``;
``lora/lora.py`` pins each loaded adapter weight. Pinning page-locks host memory so that copies to a device run
asynchronously; with no device there is nothing to copy to, and torch raises ("pin_memory=True requires a CUDA or
other accelerator backend") instead. Only when torch has no usable CUDA device, :func:`install` (through
``coxswain_after_import``):

- gives both modules, once executed, a ``torch`` whose tensor factories drop ``pin_memory``. ``layers.py`` loads
  in every scheduler (``model_runner`` imports the LoRA manager), but its code runs only with ``enable_lora``;
- makes ``Tensor.pin_memory()`` return the tensor once the ``torch_native`` LoRA backend loads, which SGLang
  imports only for an engine started with ``enable_lora`` and that backend.

Without a device every call this changes raises, so no call that worked before behaves differently. On a GPU
nothing here runs: this directory is on the path only for the CPU engine
(:func:`trainer.rollout.sglang_cpu.activate`).
"""

from __future__ import annotations

import functools

from coxswain_after_import import after_import

LAYERS = "sglang.srt.lora.layers"
BACKEND = "sglang.srt.lora.backend.torch_backend"
FACTORIES = frozenset({"tensor", "empty", "zeros", "ones", "full", "arange"})


class UnpinnedTorch:
    """``torch`` as a module sees it, with ``pin_memory`` dropped from the tensor factories."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        attr = getattr(self._torch, name)
        if name in FACTORIES:
            inner = attr

            @functools.wraps(inner)
            def attr(*args, **kwargs):
                kwargs.pop("pin_memory", None)
                return inner(*args, **kwargs)

        setattr(self, name, attr)  # looked up once: __getattr__ is not called again for this name
        return attr


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


def unpin_factories(module) -> None:
    if _no_cuda():
        module.torch = UnpinnedTorch(module.torch)


def unpin_everything(module) -> None:
    if _no_cuda():
        module.torch = UnpinnedTorch(module.torch)
        module.torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


def install() -> None:
    """Hook the two modules' imports (idempotent); nothing is imported here."""
    after_import(LAYERS, unpin_factories)
    after_import(BACKEND, unpin_everything)
