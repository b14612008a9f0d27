"""Run a patch on a module right after it first executes: the import hook the site's SGLang patches share
(``coxswain_sglang_host_alloc``, ``coxswain_sglang_no_pin``). CPU and test support only."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Callable


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, patch: Callable):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self.patch)
        return spec


def after_import(name: str, patch: Callable) -> None:
    """``patch(module)`` once module ``name`` has executed (at once if it already has); idempotent per pair."""
    if name in sys.modules:
        patch(sys.modules[name])
        return
    if not any(isinstance(f, _Finder) and (f.name, f.patch) == (name, patch) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(name, patch))
