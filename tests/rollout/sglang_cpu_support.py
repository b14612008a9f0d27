"""Where the real SGLang (CPU) runs in the tests.

SGLang 0.5.21 for CPU lives in a second venv (``python -m trainer.rollout.sglang_cpu install`` ->
``.venv-sglang-cpu``; ``COXSWAIN_SGLANG_PYTHON`` names another interpreter). Tests that drive the real
engine or server in-process run in THAT interpreter: ``tests/rollout/test_sglang_cpu_suite.py`` runs
their modules there, in their own process (a SGLang scheduler crash kills its caller), from the
project's ordinary test run. In an interpreter without sglang they skip, naming that route.
Under CI (``CI=true``) a missing CPU install is a failure, never a skip.
"""

from __future__ import annotations

import os

import pytest

from trainer.rollout import sglang_cpu

# The modules that need sglang importable in the interpreter that runs them.
SGLANG_MODULES = ("tests/rollout/test_sglang_engine.py", "tests/rollout/test_sglang_loop.py",
                  "tests/rollout/test_sglang_routes.py", "tests/rollout/test_sglang_lora.py")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def sglang_python() -> str | None:
    """The interpreter that has the SGLang CPU install, or None."""
    py = os.environ.get("COXSWAIN_SGLANG_PYTHON") or str(sglang_cpu.DEFAULT_VENV / "bin" / "python")
    return py if os.path.exists(py) else None


def require_sglang_server() -> str:
    """The interpreter that launches SGLang servers (:func:`sglang_cpu.server_python`); a failure under CI
    when there is none, else a skip naming the install command."""
    py = sglang_cpu.server_python()
    if py is None:
        why = f"no SGLang install to launch servers with ({sglang_cpu.INSTALL_COMMAND})"
        if in_ci():
            pytest.fail(f"CI runs the real SGLang servers, but there is {why}; .ci/run installs it")
        pytest.skip(why)
    return py


def require_sglang_here() -> None:
    """Skip (with the route that does run it) unless sglang 0.5.21 is importable in this interpreter."""
    reason = sglang_cpu.missing_reason()
    if reason is None:
        return
    if sglang_python() is not None:
        pytest.skip(f"{reason}; these tests run in {sglang_python()} through tests/rollout/test_sglang_cpu_suite.py")
    if in_ci():
        pytest.fail(f"CI runs the real SGLang tests, but {reason}. .ci/run installs it ({sglang_cpu.INSTALL_COMMAND})")
    pytest.skip(reason)
