"""A user's own function named in the config as ``pkg.module:function`` (``trainer.hooks.*``,
``trainer.pipeline``): imported when the config is checked, so a typo fails at load and not mid-run."""

from __future__ import annotations

import importlib
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
