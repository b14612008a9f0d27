"""Runs the real-SGLang test modules (:data:`sglang_cpu_support.SGLANG_MODULES`) in the interpreter that
has the SGLang CPU install, as one child pytest process: SGLang needs its own venv here (its requirements
move packages this environment holds at other versions), and a scheduler crash SIGKILLs its caller, so
it must not be this process. The child's report tail is shown on failure."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from trainer.rollout import sglang_cpu

from .sglang_cpu_support import SGLANG_MODULES, in_ci, sglang_python

ROOT = str(sglang_cpu.REPO_ROOT)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_sglang_modules_in_the_sglang_venv():
    if sglang_cpu.missing_reason() is None:
        pytest.skip("sglang is importable in this interpreter: the real-SGLang modules run directly in this session")
    py = sglang_python()
    if py is None:
        why = f"no SGLang CPU install ({sglang_cpu.INSTALL_COMMAND})"
        if in_ci():
            pytest.fail(f"CI runs the real SGLang tests, but there is {why}; .ci/run installs it")
        pytest.skip(why)
    modules = list(SGLANG_MODULES)
    gone = [m for m in modules if not os.path.exists(os.path.join(ROOT, m))]
    assert not gone, f"SGLANG_MODULES names test modules that do not exist: {gone}"
    t = time.monotonic()
    proc = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *modules], cwd=ROOT,
                          capture_output=True, text=True, timeout=870)
    out = proc.stdout + proc.stderr
    sys.stdout.write(f"\n[{py}: {time.monotonic() - t:.0f} s]\n" + out[-3000:])
    assert proc.returncode == 0, f"real-SGLang tests failed in {py} (rc {proc.returncode}):\n{out[-12000:]}"
    assert " passed" in out, out[-3000:]
    # The only skips allowed in the child: the GPU variants (no CUDA here).
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert all("CUDA GPU" in line for line in skips), "\n".join(skips)
