"""Shared tensor primitives for the algorithm core: masked reductions and segment (group) statistics.

Everything here is a pure function over tensors. Group statistics are computed with
``index_add_`` over dense group ids (one pass, O(N)), never with a Python loop per group, so the
advantage estimators and the DAPO filter scale to tens of thousands of sequences.

Conventions used across ``trainer.algos``:
  * ``mask`` / ``response_mask``: ``[B, T]``, bool or {0, 1} float; 1 marks a token that counts.
  * ``index``: ``[B]`` int64 (or any hashable-valued tensor) group id per sample; samples with the
    same id are responses to the same prompt.
  * Functions return tensors plus, where useful, a ``dict[str, float]`` of metrics.
"""

from __future__ import annotations

import difflib
import importlib
import math
import os
import warnings
from typing import Callable, Optional

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None, eps: float = 0.0) -> torch.Tensor:
    """Mean of ``x`` over the set entries of ``mask``. An all-zero mask gives 0, not NaN."""
    m = mask.to(x.dtype)
    num = (x * m).sum() if dim is None else (x * m).sum(dim)
    den = m.sum() if dim is None else m.sum(dim)
    return num / den.clamp_min(1.0) if eps == 0.0 else num / (den + eps)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries (Bessel-corrected when ``unbiased``)."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp_min(1.0)
    var = (((x - mean) ** 2) * m).sum() / n.clamp_min(1.0)
    if unbiased:
        var = var * n / (n - 1).clamp_min(1.0)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries; the mean is added back when not ``shift_mean``."""
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean


def dense_group_ids(index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids ``[B]`` to dense ids ``0..G-1`` (first-appearance order is not kept;
    ids are sorted). Returns ``(dense [B] int64, G)``."""
    uniq, inv = torch.unique(index, return_inverse=True)
    return inv, int(uniq.numel())


def group_stats(values: torch.Tensor, index: torch.Tensor, unbiased: bool = True):
    """Per-sample group mean, std and size of a ``[B]`` score vector grouped by ``index``.

    Returns ``(mean [B], std [B], count [B])``, each gathered back to the sample. The std is the
    unbiased (Bessel-corrected) one when ``unbiased``; a group of one has std 0 here (callers decide
    how to treat singletons). Computed in float64 so that large groups of similar values do not lose
    the variance to cancellation.
    """
    gid, g = dense_group_ids(index)
    v = values.to(torch.float64)
    cnt = torch.zeros(g, dtype=torch.float64, device=v.device).index_add_(0, gid, torch.ones_like(v))
    s1 = torch.zeros(g, dtype=torch.float64, device=v.device).index_add_(0, gid, v)
    mean_g = s1 / cnt
    dev = v - mean_g[gid]
    s2 = torch.zeros(g, dtype=torch.float64, device=v.device).index_add_(0, gid, dev * dev)
    denom = (cnt - 1).clamp_min(1.0) if unbiased else cnt
    std_g = torch.sqrt(s2 / denom)
    std_g = torch.where(cnt > 1, std_g, torch.zeros_like(std_g))
    return mean_g[gid].to(values.dtype), std_g[gid].to(values.dtype), cnt[gid].to(values.dtype)


def group_constant(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-sample flag ``[B]``: every value of the sample's group equals every other, compared exactly
    (group max == group min). A floating-point std misses it: ``[0.7, 0.7, 0.7]`` in float64 has a
    computed std of 1.4e-16, not 0."""
    gid, g = dense_group_ids(index)
    hi = torch.full((g,), -math.inf, dtype=values.dtype, device=values.device).scatter_reduce(0, gid, values, "amax")
    lo = torch.full((g,), math.inf, dtype=values.dtype, device=values.device).scatter_reduce(0, gid, values, "amin")
    return (hi == lo)[gid]


def load_fn(spec: str | Callable, table: dict[str, Callable], kind: str) -> Callable:
    """Resolve ``spec`` to a function: a key of ``table``, a callable, or ``"pkg.module:function"``.

    Unknown names raise ``ValueError`` listing the valid names and the plug-in syntax.
    """
    if callable(spec):
        return spec
    if spec in table:
        return table[spec]
    if isinstance(spec, str) and ":" in spec:
        mod_name, _, fn_name = spec.partition(":")
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            raise ValueError(f"{kind} '{spec}': cannot import module '{mod_name}' ({e})") from e
        fn = getattr(mod, fn_name, None)
        if fn is None or not callable(fn):
            raise ValueError(f"{kind} '{spec}': module '{mod_name}' has no function '{fn_name}'")
        return fn
    close = difflib.get_close_matches(str(spec), list(table), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ValueError(
        f"unknown {kind} '{spec}'.{hint} Valid: {sorted(table)}; or give your own as 'pkg.module:function'."
    )


# --------------------------------------------------------------------------------------------------
# torch.compile for the big [B, T] passes
# --------------------------------------------------------------------------------------------------

COMPILE_MIN_NUMEL = 1 << 22  # below ~4M elements the eager (chunked) passes are already fast
_compiled: dict[Callable, Callable] = {}
_compile_broken = False


def compile_wanted(numel: int) -> bool:
    """Whether a pass over ``numel`` elements should go through ``torch.compile``: ``COXSWAIN_COMPILE``
    = 0/off never, 1/on always, unset ("auto") from ``COMPILE_MIN_NUMEL`` on; never after a failure."""
    flag = os.environ.get("COXSWAIN_COMPILE", "auto").lower()
    if _compile_broken or flag in ("0", "false", "off", "no"):
        return False
    return flag in ("1", "true", "on", "yes") or numel >= COMPILE_MIN_NUMEL


def compile_broken() -> bool:
    """True once a compile failed in this process (every later pass runs eagerly)."""
    return _compile_broken


def run_compiled(fn: Callable, *args, options: Optional[dict] = None, **kw):
    """``fn(*args, **kw)`` through ``torch.compile(fn, dynamic=True)`` (compiled once per function,
    dynamic shapes so a new batch size or length does not recompile). Returns None if compiling
    failed (no C++ compiler, ...): that is warned about once and turns compilation off for the
    process, so the caller runs its eager path. ``fn`` itself must not return None."""
    global _compile_broken
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True, options=options)
    try:
        return _compiled[fn](*args, **kw)
    except Exception as e:  # no C++ compiler / triton: fall back, once, loudly
        _compile_broken = True
        warnings.warn(f"trainer.algos: torch.compile failed ({type(e).__name__}: {e}); using the eager passes")
        return None
