"""Filesystem and stream helpers shared by checkpoints and exports (the trainer's, the megatron bridge's, the strategies'):
``replace_dir`` (an atomic directory swap), ``tmp_dir_beside`` (a temp directory on the same filesystem as its
target), ``staged_dir`` (the two together) and ``bucketed`` (named tensors in size-bounded buckets). No megatron import."""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch


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


def tmp_dir_beside(final: str) -> str:
    """A new empty directory next to ``final`` (same filesystem, so :func:`replace_dir` is a rename), hidden
    by a leading dot and unique to this writer."""
    parent = os.path.dirname(os.path.abspath(final)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    return tmp


@contextmanager
def staged_dir(final: str) -> Iterator[str]:
    """A directory to write ``final``'s new contents into (:func:`tmp_dir_beside`): swapped into place
    (:func:`replace_dir`) when the block ends normally, removed when it raises, so ``final`` is never half written."""
    tmp = tmp_dir_beside(final)
    try:
        yield tmp
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bucketed(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``(name, tensor)`` pairs grouped into buckets of at least ``bucket_bytes`` (the last may be smaller; a
    tensor larger than ``bucket_bytes`` is a bucket by itself), each tensor made contiguous."""
    bucket, size = [], 0
    for name, t in named:
        bucket.append((name, t.contiguous()))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
