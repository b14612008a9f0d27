"""``python -m trainer.rollout.sglang_cpu install [--venv DIR]`` / ``check [--python PY]``.

install: a venv (``--system-site-packages``: it sees this environment's torch 2.13.0 CPU build and the
project) holding sglang 0.5.21 for CPU; see :mod:`trainer.rollout.sglang_cpu`. Prints each step's time.
Run from a project that itself lives in a virtual environment, ``python -m venv --system-site-packages``
alone would link the *base* interpreter's packages (the new venv's ``home`` is the base interpreter), not
the project venv's: ray, omegaconf, megatron-core and Coxswain itself would be missing and torch would be
installed a second time. So the new venv also gets a ``.pth`` line that adds this environment's
site-packages (with their own ``.pth`` files, editable installs included) ahead of the base's.
check: in the given interpreter, activate the CPU setup and import SGLang's engine (about 10 s).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import sysconfig
import time

from trainer.rollout import sglang_cpu
from trainer.rollout.sglang_cpu import SGLANG_VERSION


def _run(cmd: list[str], what: str) -> None:
    t = time.monotonic()
    print(f"[sglang-cpu] {what}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True)
    print(f"[sglang-cpu] {what}: {time.monotonic() - t:.0f} s", flush=True)


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def own_site_dirs() -> list[str]:
    """This interpreter's own site-packages when it runs in a virtual environment (else []: the base's
    are what ``--system-site-packages`` links anyway)."""
    if sys.prefix == sys.base_prefix:
        return []
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def make_venv(venv: str) -> str:
    """The venv (made if missing) and its ``.pth`` files; returns its python. Written before any pip run,
    so that pip sees this environment's torch 2.13.0 as installed and does not fetch it again."""
    py = venv_python(venv)
    if not os.path.exists(py):
        _run([sys.executable, "-m", "venv", "--system-site-packages", venv], "venv")
    site_packages = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip()
    # site.py processes the venv's own site-packages (and this file) before the base's, so the project
    # venv's packages come second on the path: after the venv's own (sglang and its pins), before the base's.
    with open(os.path.join(site_packages, "coxswain_project_env.pth"), "w") as f:
        for d in own_site_dirs():
            f.write(f"import site; site.addsitedir({d!r})\n")
    # Every process of this venv gets site/ on its path (the torchvision hook through its sitecustomize, and
    # the sgl_kernel stand-in): transformers imports torchvision before any Coxswain code could run.
    with open(os.path.join(site_packages, "coxswain_sglang_cpu.pth"), "w") as f:
        f.write(sglang_cpu.SITE_DIR + "\n")
    return py


def install(venv: str) -> str:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise SystemExit(f"SGLang on CPU is set up for Linux x86_64 only (this is {sys.platform} {platform.machine()})")
    t0 = time.monotonic()
    py = make_venv(venv)
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run(pip + ["--no-deps", f"sglang=={SGLANG_VERSION}"], "sglang wheel (no deps)")
    _run(pip + ["-r", str(sglang_cpu.REQUIREMENTS), "-c", str(sglang_cpu.CONSTRAINTS)], "CPU requirements")
    out = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], check=True, capture_output=True, text=True)
    if not out.stdout.strip().startswith("2.13.0"):
        raise SystemExit(f"torch moved to {out.stdout.strip()} in {venv}; expected 2.13.0 (CPU)")
    _run([py, "-m", "trainer.rollout.sglang_cpu", "check"], "import check")
    print(f"[sglang-cpu] installed in {time.monotonic() - t0:.0f} s: {py}", flush=True)
    return py


def check() -> None:
    reason = sglang_cpu.missing_reason()
    if reason:
        raise SystemExit(reason)
    sglang_cpu.activate()
    import sglang  # noqa: F401
    from sglang.srt.entrypoints.engine import Engine  # noqa: F401  the scheduler's imports, sgl_kernel included
    from sglang.srt.managers import scheduler  # noqa: F401

    print(f"[sglang-cpu] sglang {sglang.__version__} imports on CPU in {sys.executable}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m trainer.rollout.sglang_cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install")
    p.add_argument("--venv", default=str(sglang_cpu.DEFAULT_VENV))
    sub.add_parser("check")
    a = ap.parse_args(argv)
    if a.cmd == "install":
        install(a.venv)
    else:
        check()


if __name__ == "__main__":
    main()
