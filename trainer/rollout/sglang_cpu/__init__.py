"""SGLang on CPU: what the pinned ``sglang==0.5.21`` needs to run its own engine and server without a GPU.

CPU and test support: CI runs the SGLang adapter, the HTTP fleet of real SGLang servers and the training
loop with ``rollout.name=sglang`` on CPU with this. On a GPU nothing here is used; the adapter
(:mod:`trainer.rollout.sglang_engine`) is the same code, only the engine ARGUMENTS differ
(:func:`cpu_engine_args`, chosen by the device).

Install (a second venv that sees the project's environment, whether that is the system's Python, a conda env
or a venv of its own; torch stays the project's 2.13.0 CPU build and is never installed twice)::

    python -m trainer.rollout.sglang_cpu install            # -> .venv-sglang-cpu/

Measured: 1.8-3.1 GB on disk, 4.7 min with a cold pip cache on a 2-core machine, about 1 min with a warm one.
    .venv-sglang-cpu/bin/python -m pytest tests/rollout/test_sglang_engine.py

It installs the sglang 0.5.21 wheel WITHOUT its dependencies (they include CUDA-only packages and
``torch==2.13.0`` CUDA builds) plus ``requirements-sglang-cpu.txt`` (its ``Requires-Dist`` minus the CUDA-only
and torch-family packages) under ``constraints-sglang-cpu.txt`` (``torch==2.13.0``). A second venv because
sglang's requirements move packages the project's tests hold at other versions (numba pins numpy < 2.4).

What :func:`activate` does, and why:

- ``SGLANG_USE_CPU_ENGINE=1``: sglang's ``is_cpu()`` (srt/utils/common.py ~218) reads it; every CPU code path
  keys on it.
- ``SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS=0``: otherwise every scheduler crash waits 60 s before the
  process tree is killed.
- ``site/`` prepended to ``PYTHONPATH`` (inherited by SGLang's subprocesses and servers), holding
  ``sgl_kernel/``: a pure-torch stand-in for the few compiled helpers the CPU path imports
  (``assign_req_to_token_pool_cpu`` runs on every step); with no kernel op registered SGLang finds no AMX and
  runs each layer's plain torch forward. ``sitecustomize.py`` + ``coxswain_torchvision_hook.py``: the
  registry's torchvision is a CUDA build whose import dies on ``torchvision::nms`` being undefined; the hook
  defines the ``nms`` / ``qnms`` schemas first when its ``_C`` does not load. The installer also puts
  ``site/`` on the venv's path with a ``.pth`` file, since transformers imports torchvision before any
  Coxswain code runs. ``coxswain_sglang_host_alloc.py``: routing replay's host cache of routed experts is
  pinned with ``cudaHostRegister``; without CUDA it is allocated as plain memory. ``coxswain_sglang_no_pin.py``:
  the LoRA layers (``enable_lora``) pin small host tensors, which raises without an accelerator; there pinning is
  a no-op. Both patch a module as it is imported, through ``coxswain_after_import.py``.

Not used: SGLang's compiled Intel-AMX CPU kernels (they need SGLang's source tree, and with AMX weight
packing ``update_weights_from_tensor`` fails in 0.5.21 on ``'Parameter' object has no attribute 'weight_loader'``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SITE_DIR = str(Path(__file__).resolve().parent / "site")
REPO_ROOT = Path(__file__).resolve().parents[3]
REQUIREMENTS = REPO_ROOT / "requirements-sglang-cpu.txt"
CONSTRAINTS = REPO_ROOT / "constraints-sglang-cpu.txt"
DEFAULT_VENV = REPO_ROOT / ".venv-sglang-cpu"
SGLANG_VERSION = "0.5.21"  # the pinned release (setup.py's sglang extra); the engine adapter reads it here
INSTALL_COMMAND = "python -m trainer.rollout.sglang_cpu install  (then run with .venv-sglang-cpu/bin/python)"

ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS": "0",
}


def cpu_engine_args(max_total_tokens: int = 4096) -> dict:
    """``sglang.Engine`` / ``ServerArgs`` fields for the CPU engine: plain torch layers in fp32-capable
    attention (``torch_native``), no CUDA graphs, no overlap scheduler, no memory saver (it needs CUDA).
    ``max_total_tokens`` bounds the KV cache (CPU memory is not profiled the way GPU memory is)."""
    return {
        "device": "cpu",
        "attention_backend": "torch_native",
        "sampling_backend": "pytorch",
        "disable_cuda_graph": True,
        "disable_overlap_schedule": True,
        "enable_memory_saver": False,
        "max_total_tokens": int(max_total_tokens),
    }


def activate(environ: dict | None = None) -> dict:
    """Set up this process (and, through the environment, its children) to run SGLang on CPU.
    Idempotent. Returns the environment variables it set (also applied to ``environ`` when given, e.g. a
    subprocess's env)."""
    env = os.environ if environ is None else environ
    for k, v in ENV.items():
        env[k] = v
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if SITE_DIR not in parts:
        env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *parts])
    if environ is None:
        if SITE_DIR not in sys.path:
            sys.path.insert(0, SITE_DIR)
        import coxswain_torchvision_hook

        coxswain_torchvision_hook.install()
    return {**ENV, "PYTHONPATH": env["PYTHONPATH"]}


def missing_reason() -> str | None:
    """None when sglang (the pinned version) is importable in THIS interpreter, else why not, with the
    install command."""
    import importlib.metadata as md

    try:
        v = md.version("sglang")
    except md.PackageNotFoundError:
        return f"sglang is not installed in {sys.executable}: {INSTALL_COMMAND}"
    if v != SGLANG_VERSION:
        return f"sglang {v} is installed in {sys.executable}; Coxswain's adapter needs sglang=={SGLANG_VERSION}"
    return None


def server_python() -> str | None:
    """The interpreter that runs ``python -m sglang.launch_server`` for a fleet of SGLang servers: this one
    when sglang (the pinned version) imports here (a GPU machine with the ``sglang`` extra), else
    ``COXSWAIN_SGLANG_PYTHON``, else the CPU install's venv (:data:`DEFAULT_VENV`); None when there is none.
    The trainer itself needs no sglang for a fleet: it only speaks HTTP to the servers."""
    if missing_reason() is None:
        return sys.executable
    py = os.environ.get("COXSWAIN_SGLANG_PYTHON") or str(DEFAULT_VENV / "bin" / "python")
    return py if os.path.exists(py) else None
