"""Runs the real-SGLang test modules (:data:`sglang_cpu_support.SGLANG_MODULES`) in the interpreter that
has the SGLang CPU install, a child pytest process per module, each with its own time limit (the loop
module's trainer runs take minutes each, and a loaded machine runs them twice as slow). SGLang needs its
own venv here (its requirements move packages this environment holds at other versions), and a scheduler
crash SIGKILLs its caller, so it must not be this process. The child's report tail is shown on failure."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from trainer.rollout import sglang_cpu

from .sglang_cpu_support import SGLANG_MODULES, in_ci, sglang_python

ROOT = str(sglang_cpu.REPO_ROOT)


# seconds a child module may take (a hang guard): the loop module took 893 s under `-n 2` on a 2-core AVX2 EPYC
# without bf16 instructions (the engine module 81 s), about twice an AMX Xeon's time; CI machines are of both kinds
CHILD_LIMIT_S = 1500


@pytest.mark.slow
@pytest.mark.timeout(CHILD_LIMIT_S + 60)
@pytest.mark.parametrize("module", SGLANG_MODULES)
def test_real_sglang_modules_in_the_sglang_venv(module):
    if sglang_cpu.missing_reason() is None:
        pytest.skip("sglang is importable in this interpreter: the real-SGLang modules run directly in this session")
    py = sglang_python()
    if py is None:
        why = f"no SGLang CPU install ({sglang_cpu.INSTALL_COMMAND})"
        if in_ci():
            pytest.fail(f"CI runs the real SGLang tests, but there is {why}; .ci/run installs it")
        pytest.skip(why)
    assert os.path.exists(os.path.join(ROOT, module)), f"SGLANG_MODULES names a test module that does not exist: {module}"
    t = time.monotonic()
    proc = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", module], cwd=ROOT,
                          capture_output=True, text=True, timeout=CHILD_LIMIT_S)
    out = proc.stdout + proc.stderr
    sys.stdout.write(f"\n[{py}: {time.monotonic() - t:.0f} s]\n" + out[-3000:])
    assert proc.returncode == 0, f"real-SGLang tests failed in {py} (rc {proc.returncode}):\n{out[-12000:]}"
    assert " passed" in out, out[-3000:]
    # The only skips allowed in the child: the GPU variants (no CUDA here).
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert all("CUDA GPU" in line for line in skips), "\n".join(skips)
