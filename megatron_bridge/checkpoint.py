"""Sharded checkpoints with megatron ``dist_checkpointing``: model + optimizer + LR scheduler.

Layout-free: every tensor is saved as a ``ShardedTensor`` with its global shape and offsets, so a
checkpoint written at one TP/PP layout loads at another (optimizer state included; the distributed
optimizer's state is saved in its fully-reshardable form).

Atomic: all ranks write into ``.<name>.tmp-<id>`` next to the target; after a barrier rank 0 writes
a ``coxswain_ckpt.json`` marker and renames the directory into place (an existing checkpoint of the
same name is moved aside first and deleted after). A crash mid-save leaves the previous checkpoint
untouched and only a ``.tmp-`` directory, which the next save removes.

The writer's ``multiprocessing.Manager``: ``dist_checkpointing`` keeps a module-global result queue
served by a spawned Manager process, which outlives the save and is orphaned if the rank is killed.
Here the Manager is started by us for the duration of one save, with an initializer that makes it
exit when its parent dies (``PR_SET_PDEATHSIG`` plus a parent-pid watchdog), and it is shut down in
a ``finally`` — on success and on failure.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import threading
import time
import uuid

import torch
import torch.distributed as dist

from megatron_bridge.fsutil import replace_dir

MARKER = "coxswain_ckpt.json"


# ---------------------------------------------------------------------------------------------------
# the writer's Manager process


def _die_with_parent(parent_pid: int) -> None:
    """Manager-process initializer: exit as soon as the rank that started it is gone."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - non-Linux: the watchdog below still works
        pass

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(0.5)

    if os.getppid() != parent_pid:
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


class _WriterManager:
    """Context manager installing a parent-bound Manager queue for dist_checkpointing's writer."""

    def __enter__(self):
        import multiprocessing as mp
        from multiprocessing.managers import SyncManager

        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

        self.fa = fa
        self.prev = fa._results_queue
        self.mgr = SyncManager(ctx=mp.get_context("spawn"))
        self.mgr.start(initializer=_die_with_parent, initargs=(os.getpid(),))
        fa._results_queue = self.mgr.Queue()
        return self

    @property
    def pid(self) -> int:
        return self.mgr._process.pid

    def __exit__(self, *exc):
        self.fa._results_queue = self.prev
        try:
            self.mgr.shutdown()
        finally:
            proc = getattr(self.mgr, "_process", None)
            if proc is not None and proc.is_alive():
                proc.kill()
                proc.join(5)
        return False


# ---------------------------------------------------------------------------------------------------
# save / load


def _state(model, optimizer, scheduler, *, is_loading: bool) -> dict:
    """The sharded state. Under virtual pipeline stages the chunks' states sit side by side
    (``model0``, ``model1``, ...); every tensor's key is its global name, so the layout (TP, PP, VPP)
    at load time need not be the one at save time."""
    from megatron_bridge.model import chunks, unwrap

    cs = [unwrap(c) for c in chunks(model)]
    model_sd = cs[0].sharded_state_dict() if len(cs) == 1 else {f"model{i}": c.sharded_state_dict() for i, c in enumerate(cs)}
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


def save_checkpoint(ckpt_dir: str, model, optimizer=None, scheduler=None, *, extra: dict | None = None) -> str:
    """Collective: save model (+ optimizer, + scheduler, + small ``extra`` dict) to ``ckpt_dir``."""
    from megatron.core import dist_checkpointing

    from megatron_bridge import cpu_shims

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
        state = _state(model, optimizer, scheduler, is_loading=False)
        state["extra"] = dict(extra or {})
        with _WriterManager():
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


def load_checkpoint(ckpt_dir: str, model, optimizer=None, scheduler=None) -> dict:
    """Collective: load into ``model`` (+ optimizer, + scheduler) at the current layout; returns ``extra``."""
    from megatron.core import dist_checkpointing

    from megatron_bridge import cpu_shims
    from megatron_bridge.model import chunks, unwrap

    cpu_shims.install()
    if not is_complete(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir} is not a complete checkpoint (no {MARKER})")
    state = _state(model, optimizer, scheduler, is_loading=True)
    state["extra"] = None  # common (non-sharded) entries are read from the checkpoint as saved
    if scheduler is not None:
        state["scheduler"] = None
    loaded = dist_checkpointing.load(state, ckpt_dir)
    cs = [unwrap(c) for c in chunks(model)]
    if len(cs) == 1:
        cs[0].load_state_dict(loaded["model"], strict=True)
    else:
        for i, c in enumerate(cs):
            c.load_state_dict(loaded["model"][f"model{i}"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    return loaded.get("extra") or {}
