"""Let the registry's torchvision import on a CPU-only torch (CPU and test support only).

The registry's torchvision 0.28.0 is a CUDA build: its ``_C`` extension does not load against
``torch==2.13.0+cpu``, and ``torchvision/_meta_registrations.py`` then registers fake kernels for
``torchvision::nms`` / ``torchvision::qnms`` unconditionally and dies on "operator torchvision::nms does
not exist". SGLang imports torchvision at start (through transformers' image utils and its own
multimodal configs), never calls those ops on the text-only rollout path.

:func:`install` puts a finder in front of ``sys.meta_path`` that, when ``torchvision`` is first imported,
tries to load torchvision's own ``_C`` (so a matching build keeps its real ops), and otherwise defines
the two operator SCHEMAS (no kernels: calling them raises torch's "no kernel" error).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_LIB = None  # the torch.library.Library holding the schemas; must stay alive


def define_schemas_unless_loadable(package_dir: str) -> str:
    """Returns "C" when torchvision's own extension loaded, "schemas" when we defined them, "present" when
    the ops already existed."""
    global _LIB
    if _op_exists():
        return "present"
    try:
        import torch

        torch.ops.load_library(os.path.join(package_dir, "_C.so"))
        return "C"
    except (OSError, ImportError, RuntimeError):
        pass
    import torch

    _LIB = torch.library.Library("torchvision", "DEF")
    _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return "schemas"


def _op_exists() -> bool:
    import torch

    try:
        torch.ops.torchvision.nms.default  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


class _Finder(importlib.abc.MetaPathFinder):
    done = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision" or _Finder.done:
            return None
        _Finder.done = True
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.submodule_search_locations:
            define_schemas_unless_loadable(list(spec.submodule_search_locations)[0])
        return spec


def install() -> None:
    if "torchvision" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
