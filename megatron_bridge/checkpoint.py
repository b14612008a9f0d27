"""Sharded checkpoints with megatron ``dist_checkpointing``: model + optimizer + LR scheduler.

Layout-free: every tensor is saved as a ``ShardedTensor`` with its global shape and offsets, so a
checkpoint written at one TP/PP layout loads at another (optimizer state included; the distributed
optimizer's state is saved in its fully-reshardable form).

Atomic: all ranks write into ``.<name>.tmp-<id>`` next to the target; after a barrier rank 0 writes
a ``coxswain_ckpt.json`` marker and renames the directory into place (an existing checkpoint of the
same name is moved aside first and deleted after). A crash mid-save leaves the previous checkpoint
untouched and only a ``.tmp-`` directory, which the next save removes.

Loading never unpickles code: every pickle of the directory is walked first by
:func:`trainer.checkpoint.check_pickles` (only data globals admitted), since torch reads the ``.metadata``
index with plain ``pickle.load``.

The writer's result queue: ``dist_checkpointing`` keeps a module-global result queue served by a
spawned ``multiprocessing.Manager`` process, which outlives the save and is orphaned if the rank is
killed. Saves here are synchronous (the writer runs in the rank's own process), so the queue is a
plain in-process ``queue.Queue`` installed for the duration of one save: no extra process at all.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
import uuid
from contextlib import contextmanager

import torch.distributed as dist

from megatron_bridge import cpu_shims
from trainer.fsutil import replace_dir
from megatron_bridge.model import chunks, unwrap
from trainer.checkpoint import check_pickles

MARKER = "coxswain_ckpt.json"


# ---------------------------------------------------------------------------------------------------
# the writer's result queue


@contextmanager
def _writer_queue():
    """An in-process result queue for dist_checkpointing's writer.

    megatron creates ``ctx.Manager().Queue()`` (a spawned server process) on first use, for the
    async path where the writer runs in another process. A synchronous save runs the writer in the
    calling process (``AsyncRequest.execute_sync``): its forked per-bucket writers report on their
    own fork-context queue, and only this process puts to and reads from the global one. A plain
    ``queue.Queue`` is that contract with no process behind it: nothing to orphan if the rank is
    killed, and no interpreter to start per save (measured: each spawned Manager cost 1-3 CPU-seconds
    re-importing this package, two per save on a TP=2 actor)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    prev, fa._results_queue = fa._results_queue, queue.Queue()
    try:
        yield
    finally:
        fa._results_queue = prev


# ---------------------------------------------------------------------------------------------------
# save / load


def _kept(sd: dict, keep) -> dict:
    return sd if keep is None else {k: v for k, v in sd.items() if keep(k)}


def _state(model, optimizer, scheduler, *, is_loading: bool, keep=None) -> dict:
    """The sharded state. Under virtual pipeline stages the chunks' states sit side by side
    (``model0``, ``model1``, ...); every tensor's key is its global name, so the layout (TP, PP, VPP)
    at load time need not be the one at save time. ``keep(name)``: the model entries to hold (LoRA: the adapters;
    the frozen base is the model's own checkpoint, loaded at start), None: all."""

    cs = [unwrap(c) for c in chunks(model)]
    model_sd = (_kept(cs[0].sharded_state_dict(), keep) if len(cs) == 1
                else {f"model{i}": _kept(c.sharded_state_dict(), keep) for i, c in enumerate(cs)})
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    if scheduler is not None and not is_loading:
        state["scheduler"] = scheduler.state_dict()
    return state


def _broadcast_str(s: str | None) -> str:
    buf = [s]
    dist.broadcast_object_list(buf, src=0)
    return buf[0]


def save_checkpoint(ckpt_dir: str, model, optimizer=None, scheduler=None, *, extra: dict | None = None,
                    keep=None) -> str:
    """Collective: save model (+ optimizer, + scheduler, + small ``extra`` dict) to ``ckpt_dir``; ``keep(name)``:
    only these model entries (see :func:`_state`)."""
    from megatron.core import dist_checkpointing


    cpu_shims.install()
    ckpt_dir = os.path.abspath(ckpt_dir)
    parent, base = os.path.dirname(ckpt_dir), os.path.basename(ckpt_dir)
    tmp = None
    if dist.get_rank() == 0:
        os.makedirs(parent, exist_ok=True)
        for stale in glob.glob(os.path.join(parent, f".{base}.tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)  # left by a crashed save
        tmp = os.path.join(parent, f".{base}.tmp-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)  # dist_checkpointing requires an existing directory
    tmp = _broadcast_str(tmp)
    ok = False
    try:
        state = _state(model, optimizer, scheduler, is_loading=False, keep=keep)
        state["extra"] = dict(extra or {})
        with _writer_queue():
            dist_checkpointing.save(state, tmp)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
                json.dump({"complete": True, "world_size": dist.get_world_size(), "time": time.time()}, f)
            replace_dir(tmp, ckpt_dir)
        ok = True
    finally:
        if not ok and dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    return ckpt_dir


def is_complete(ckpt_dir: str) -> bool:
    return os.path.exists(os.path.join(ckpt_dir, MARKER))


def load_checkpoint(ckpt_dir: str, model, optimizer=None, scheduler=None, *, keep=None) -> dict:
    """Collective: load into ``model`` (+ optimizer, + scheduler) at the current layout; returns ``extra``.
    ``keep``: as saved (only those entries are read; every one of them must be there, and the others keep the
    values the model has)."""
    from megatron.core import dist_checkpointing


    cpu_shims.install()
    if not is_complete(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir} is not a complete checkpoint (no {MARKER})")
    # torch reads .metadata with plain pickle.load and megatron some items with weights_only=False:
    # their globals are checked first (trainer.checkpoint.check_pickles), on every rank that reads them
    check_pickles(ckpt_dir)
    state = _state(model, optimizer, scheduler, is_loading=True, keep=keep)
    state["extra"] = None  # common (non-sharded) entries are read from the checkpoint as saved
    if scheduler is not None:
        state["scheduler"] = None
    loaded = dist_checkpointing.load(state, ckpt_dir)
    cs = [unwrap(c) for c in chunks(model)]
    for i, c in enumerate(cs):
        part = loaded["model"] if len(cs) == 1 else loaded["model"][f"model{i}"]
        res = c.load_state_dict(part, strict=keep is None)
        missing = [k for k in getattr(res, "missing_keys", []) if keep(k)] if keep is not None else []
        if missing or getattr(res, "unexpected_keys", []):
            raise RuntimeError(f"{ckpt_dir}: model entries missing {missing[:4]}, unexpected {res.unexpected_keys[:4]}")
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    return loaded.get("extra") or {}
