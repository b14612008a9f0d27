"""Atomic checkpoints and exact resume for the driver.

Layout under ``trainer.default_local_dir/checkpoints``::

    global_step_12/            a complete checkpoint (only ever appears by rename)
        actor/ critic/         sharded model + optimizer + scheduler (megatron dist_checkpointing)
        driver_state.pt        step, dataloader position, RNG states, KL controller, DAPO carry-over
        COMPLETE               marker written last inside the temp dir, before the rename
    latest                     text file naming the newest complete checkpoint, replaced atomically
    .tmp-global_step_13-<pid>/ a save in progress (removed on the next start)

A save writes everything into a temporary sibling directory, fsyncs it, renames it into place and only
then rewrites ``latest`` (write to a temp file + ``os.replace``). A crash at any point leaves either the
old checkpoint or the new one, never half of one. ``find_latest`` trusts ``latest`` only after checking
the ``COMPLETE`` marker and otherwise scans for the newest complete directory.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from typing import Any, Callable, Optional

import numpy as np
import torch

from megatron_bridge.fsutil import replace_dir

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
MARKER = "COMPLETE"
DRIVER_STATE = "driver_state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it and what to do."""


def capture_rng() -> dict[str, Any]:
    """Every RNG the driver (or a worker) draws from."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            except OSError:
                pass


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointManager:
    def __init__(self, root: str, max_to_keep: Optional[int] = None):
        self.root = root
        self.max_to_keep = max_to_keep
        os.makedirs(root, exist_ok=True)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"global_step_{step}")

    def clean_stale(self) -> list[str]:
        """Remove temp dirs left by a save that was killed; returns what was removed."""
        removed = []
        for name in os.listdir(self.root):
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                removed.append(name)
        return removed

    def save(self, step: int, driver_state: dict[str, Any],
             write_workers: Optional[Callable[[str], None]] = None) -> str:
        """Write a checkpoint atomically. ``write_workers(tmp_dir)`` saves the worker states (actor,
        critic, ...) into the temporary directory before the driver state and the marker."""
        final = self.step_dir(step)
        tmp = os.path.join(self.root, f".tmp-global_step_{step}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            if write_workers is not None:
                write_workers(tmp)
            torch.save({"step": step, **driver_state}, os.path.join(tmp, DRIVER_STATE))
            with open(os.path.join(tmp, MARKER), "w") as f:
                f.write(str(step))
            _fsync_tree(tmp)
            replace_dir(tmp, final)  # re-saving the same step (after a resume) replaces it whole
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _atomic_write_text(os.path.join(self.root, "latest"), os.path.basename(final))
        self._prune()
        return final

    def _complete_steps(self) -> list[int]:
        steps = []
        for name in os.listdir(self.root):
            m = _STEP_DIR.match(name)
            if m and os.path.isfile(os.path.join(self.root, name, MARKER)):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def _prune(self) -> None:
        if not self.max_to_keep:
            return
        for s in self._complete_steps()[: -self.max_to_keep]:
            shutil.rmtree(self.step_dir(s), ignore_errors=True)

    def find_latest(self) -> Optional[str]:
        pointer = os.path.join(self.root, "latest")
        if os.path.isfile(pointer):
            name = open(pointer).read().strip()
            path = os.path.join(self.root, name)
            if os.path.isfile(os.path.join(path, MARKER)):
                return path
        steps = self._complete_steps()
        return self.step_dir(steps[-1]) if steps else None


def load_driver_state(path: str) -> dict[str, Any]:
    """Load and check a checkpoint's driver state; a bad checkpoint is a clear error."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint '{path}' does not exist; check trainer.resume_from_path.")
    if not os.path.isfile(os.path.join(path, MARKER)):
        raise CheckpointError(
            f"checkpoint '{path}' is incomplete (no {MARKER} marker: its save was interrupted). "
            f"Delete it, or set trainer.resume_from_path to an earlier global_step_* directory.")
    f = os.path.join(path, DRIVER_STATE)
    try:
        state = torch.load(f, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or foreign file
        raise CheckpointError(f"checkpoint '{path}': cannot read {DRIVER_STATE} ({type(e).__name__}: {e}). "
                              f"The file is corrupt; resume from an earlier checkpoint.") from e
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"checkpoint '{path}': {DRIVER_STATE} is not a Coxswain driver state (no 'step').")
    return state
