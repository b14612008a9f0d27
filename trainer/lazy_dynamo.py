"""tensordict, imported without importing ``torch._dynamo``: every process of a run starts about 1.5 s sooner.

Why. tensordict (0.15) marks a few of its functorch wrappers with ``torch.compiler.allow_in_graph`` and one helper
with ``torch.compiler.assume_constant_result`` when it is imported, and both of those import ``torch._dynamo``
(with sympy and the FX symbolic-shapes machinery) on their first call. Measured on a 2-core AMD EPYC: ``import
tensordict`` after torch 1.7 s, of which 1.5 s is that import; ``import trainer.main`` 5.0 s -> 2.5 s;
``import trainer.workers.rollout_worker`` 4.8 s -> 2.2 s. Every Ray worker, driver, HTTP server and CLI process
pays it, and on a CPU host of a few cores those start-ups are most of a short run's time. Processes that compile
(megatron-core's fused kernels are ``torch.compile``-decorated at import) load dynamo anyway and gain nothing,
lose nothing.

What it does. Both decorators return the function unchanged (torch 2.13, ``torch/_dynamo/decorators.py``):
``assume_constant_result`` only sets ``fn._dynamo_marked_constant = True``, and ``allow_in_graph`` adds
``id(fn)`` to dynamo's allow-list (a weak reference removes it again). So tensordict is imported with the two
replaced by recorders; the attribute is set at once, exactly as the real decorator sets it; the allow-list
entries are handed to ``torch._dynamo.allow_in_graph`` by a post-import hook (``wrapt``) the moment anything
imports ``torch._dynamo``, which is before anything can be traced. Where ``torch._dynamo`` is already loaded
(a megatron worker imports megatron-core first), tensordict is imported as it is.
"""

from __future__ import annotations

import sys

import torch
import torch.compiler
import wrapt

_DEFERRED: list = []  # functions tensordict asked dynamo to keep in the graph, until dynamo is loaded


def _record_allow_in_graph(fn):
    # tensordict.utils holds this function under its own name from now on: a later call, once dynamo is
    # loaded, goes straight to dynamo
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and not _DEFERRED:
        return dynamo.allow_in_graph(fn)
    _DEFERRED.append(fn)
    return fn  # what torch._dynamo.allow_in_graph returns


def _assume_constant_result(fn):
    fn._dynamo_marked_constant = True  # all that torch._dynamo.assume_constant_result does
    return fn


def _register_deferred(dynamo) -> None:
    while _DEFERRED:
        dynamo.allow_in_graph(_DEFERRED.pop())


def _import_tensordict() -> None:
    if "torch._dynamo" in sys.modules or "tensordict" in sys.modules:
        import tensordict  # noqa: F401  (nothing to save: dynamo, or tensordict, is already loaded)

        return
    tc = torch.compiler
    saved = tc.allow_in_graph, tc.assume_constant_result
    tc.allow_in_graph, tc.assume_constant_result = _record_allow_in_graph, _assume_constant_result
    try:
        import tensordict  # noqa: F401
    finally:
        tc.allow_in_graph, tc.assume_constant_result = saved
    wrapt.register_post_import_hook(_register_deferred, "torch._dynamo")  # runs at once if dynamo got loaded


_import_tensordict()
