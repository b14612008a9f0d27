"""The scorer-process side of the reward manager: deliberately light (no torch, no trainer imports
beyond the scorers), because every pool worker imports this module when it starts, and a worker
replaced after a timeout should be ready in milliseconds, not after a torch import.

``_score_one`` never raises: it returns ``("ok", score, acc, extra)`` or ``("error", traceback)``.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import time
import traceback
from typing import Any, Callable

_FN: Callable | None = None  # the scorer, set in each worker by _init_worker


def load_custom_fn(path: str, name: str = "compute_score") -> Callable:
    """Load ``name`` from a python file ``path`` (or an importable module name). Clear errors."""
    if path.endswith(".py") or os.path.sep in path:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"custom_reward_function.path={path!r}: no such file. Give the path of a .py file that defines {name}()."
            )
        mod_name = "coxswain_custom_reward_" + str(abs(hash(os.path.abspath(path))))
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    fn = getattr(module, name, None)
    if not callable(fn):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"custom_reward_function: {path!r} has no function {name!r} (it defines {public}); "
            f"set custom_reward_function.name to one of them."
        )
    return fn


def make_scorer(custom_path: str | None, custom_name: str = "compute_score", kwargs: dict | None = None) -> Callable:
    """The scorer the manager calls: the user's function (or the built-in dispatcher) with ``kwargs``
    bound. As in verl's ``_call_with_kwargs``, the bound keywords win over the call's own."""
    if custom_path:
        fn = load_custom_fn(custom_path, custom_name)
    else:
        from trainer.rewards.scorers import compute_score

        fn = compute_score
    if not kwargs:
        return fn
    bound = dict(kwargs)

    def scorer(*args, **call_kwargs):
        return fn(*args, **{**call_kwargs, **bound})

    scorer.__wrapped__ = fn
    return scorer


def _init_worker(custom_path: str | None, custom_name: str, kwargs: dict | None = None) -> None:
    global _FN
    from trainer.orphans import watch_parent

    watch_parent()  # a SIGKILLed driver (or fork server) takes its scorer workers with it
    _FN = make_scorer(custom_path, custom_name, kwargs)


def _ping(delay: float = 0.0) -> int:
    time.sleep(delay)
    return os.getpid()


def _normalize(result: Any) -> tuple[float, float, dict]:
    """(score, acc, extra) from a scorer's return value; raises on a malformed one."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"scorer returned a dict without 'score' (keys: {sorted(result)})")
        score = float(result["score"])
        acc = float(result["acc"]) if result.get("acc") is not None else score
        extra = {k: _plain(v) for k, v in result.items() if k not in ("score", "acc")}
    else:
        score = float(result)  # numbers, bools, 0-d tensors / numpy scalars
        acc, extra = score, {}
    if not (math.isfinite(score) and math.isfinite(acc)):
        raise ValueError(f"scorer returned a non-finite value (score={score}, acc={acc})")
    return score, acc, extra


def _plain(v: Any) -> Any:
    """Make extra values cheap to pickle and log (numpy / torch scalars -> python)."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    item = getattr(v, "item", None)
    if callable(item):
        try:
            return item()
        except (ValueError, RuntimeError):
            pass
    return str(v)[:500]


def _score_one(fn: Callable | None, data_source, solution_str, ground_truth, extra_info) -> tuple:
    """Run one scorer call; never raises. Returns ("ok", score, acc, extra) or ("error", traceback)."""
    try:
        fn = fn or _FN
        result = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)
        return ("ok",) + _normalize(result)
    except BaseException:  # noqa: BLE001 - a user scorer may raise anything, SystemExit included
        return ("error", traceback.format_exc(limit=20))


def _score_batch(fn: Callable | None, data_sources, solution_strs, ground_truths, extra_infos) -> tuple:
    """verl's batch reward manager: ONE call with lists (``fn(data_sources=, solution_strs=,
    ground_truths=, extra_infos=)``) returning one number or dict per response. Never raises:
    ``("ok", [outcome per response])`` where each outcome is as ``_score_one``'s (a malformed item
    fails alone), or ``("error", traceback)`` when the call raises or returns the wrong number of items."""
    try:
        fn = fn or _FN
        result = fn(data_sources=list(data_sources), solution_strs=list(solution_strs),
                    ground_truths=list(ground_truths), extra_infos=list(extra_infos))
        if hasattr(result, "tolist") and not isinstance(result, (list, tuple)):
            result = result.tolist()  # a tensor / numpy array of scores
        if not isinstance(result, (list, tuple)) or len(result) != len(solution_strs):
            got = f"{type(result).__name__} of length {len(result)}" if isinstance(result, (list, tuple)) else type(result).__name__
            raise ValueError(f"a batch scorer must return one score (or dict with 'score') per response: "
                             f"expected a list of {len(solution_strs)}, got {got}")
    except BaseException:  # noqa: BLE001
        return ("error", traceback.format_exc(limit=20))
    out = []
    for i, r in enumerate(result):
        try:
            out.append(("ok",) + _normalize(r))
        except BaseException:  # noqa: BLE001
            out.append(("error", f"item {i} of the batch scorer's result: " + traceback.format_exc(limit=3)))
    return ("ok", out)


