"""A user's own function named in the config as ``pkg.module:function`` (``trainer.hooks.*``,
``trainer.pipeline``): imported when the config is checked, so a typo fails at load and not mid-run."""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Callable


def load_callable(spec: str, key: str) -> Callable:
    """``pkg.module:function`` -> the function; a ``ValueError`` naming ``key`` and the fault otherwise."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.partition(":")[::2]):
        raise ValueError(f"{key}: '{spec}' is not of the form 'pkg.module:function'.")
    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - a user module that fails to import, for any reason
        raise ValueError(f"{key}: cannot import module '{mod_name}' ({type(e).__name__}: {e}); it must be importable "
                         f"from the driver's working directory or PYTHONPATH.") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{key}: module '{mod_name}' has no function '{fn_name}'.")
    return fn


# what the loop passes: trainer.step.run_step calls pipeline(step); trainer.step.Hooks.run calls hook(batch, metrics)
PIPELINE_PARAMS = ("step",)
HOOK_PARAMS = ("batch", "metrics")


def load_step_callable(spec: str, key: str, params: tuple[str, ...]) -> Callable:
    """``load_callable``, then the function must be one written for the loop: a Python function (or callable
    object) outside the standard library that takes exactly the loop's positional arguments ``params``
    (``trainer.pipeline``: ``(step,)``; ``trainer.hooks.*``: ``(batch, metrics)``). Anything else would run with
    arguments it does not expect: ``os:system`` would be handed the Step."""
    fn = load_callable(spec, key)
    shape = f"f({', '.join(params)})"
    mod = (getattr(fn, "__module__", None) or spec.partition(":")[0]).split(".")[0]
    if mod in sys.stdlib_module_names or mod == "builtins":
        raise ValueError(f"{key}={spec!r} is a function of Python's standard library ('{mod}'), not one written for "
                         f"the loop, which calls it as {shape}: name your own function.")
    if inspect.isbuiltin(fn):
        raise ValueError(f"{key}={spec!r} is a built-in (compiled) function; the loop calls a Python function as "
                         f"{shape}: name your own function.")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={spec!r}: its signature cannot be read, so it cannot be checked against the loop's "
                         f"call {shape}: name a Python function.") from None
    try:
        sig.bind(*params)
    except TypeError as e:
        raise ValueError(f"{key}={spec!r} has the signature {sig}, but the loop calls it as {shape} ({e}): give it "
                         f"exactly those positional parameters.") from None
    return fn
