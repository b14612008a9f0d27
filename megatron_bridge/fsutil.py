"""Filesystem helpers shared by checkpoints and exports (no megatron import: the trainer uses them too)."""

from __future__ import annotations

import os
import shutil


def replace_dir(tmp: str, final: str) -> None:
    """Move the finished directory ``tmp`` to ``final`` so that ``final`` is always either the old
    complete directory or the new one: an existing ``final`` is renamed aside first, then removed."""
    if os.path.exists(final):
        old = f"{tmp}.old"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
