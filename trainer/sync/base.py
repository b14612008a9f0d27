"""The weight-transport interface: how a sync moves the actor's weights into the rollout engines.

A transport has three parts, all in its own module under ``trainer/sync/``:

* a **sender half** (a class with ``sender(worker)`` as constructor), held once per actor rank by the
  training worker and reached through its one generic entry ``worker.sync_send(transport, op, *args)``;
  it reads the rank's weights through the worker (``_module()``, ``_hf_buckets``, ``_reshard_blocks``);
* a **receiver half** (``receiver(rollout_worker)``), held beside the engine and reached through
  ``rollout_worker.sync_recv(transport, op, *args)``; it writes into the engine;
* a **link** (:class:`Link`), the driver's side, held by the rollout: it sets the transport up for an
  actor (or declines, with a reason: the rollout then tries its next transport), runs one sync,
  verifies it, and returns its metrics.

Verification is part of every link: :func:`check_checksums` is the one rule for checksum-verified syncs
(every actor replica streamed the same weights; every engine holds what its actor streamed); the
shared-memory and group transports check each block on their own and, at their first verified sync
after a set-up, also end to end (:meth:`Link.check_once`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from trainer.rollout.engine import WeightSyncError


def check_checksums(pairs: list[tuple[str, str]]) -> None:
    """``pairs[i]``: (the actor's checksum that engine i was loaded from, engine i's checksum).
    Every actor checksum must equal the first (replicas agree) and every engine's its actor's."""
    want = pairs[0][0]
    diverged = [i for i, (w, _) in enumerate(pairs) if w != want]
    if diverged:
        i = diverged[0]
        raise WeightSyncError(f"weight sync failed: actor rank(s) {diverged} diverged: rank {i}'s weights hash to "
                              f"{pairs[i][0][:12]}... but rank 0's to {want[:12]}...; the data-parallel replicas "
                              f"would give their engines different policies")
    bad = [i for i, (_, got) in enumerate(pairs) if got != want]
    if bad:
        raise WeightSyncError(f"weight sync failed: rollout engine(s) {bad} hold checksum {pairs[bad[0]][1][:12]}... "
                              f"but the actor's weights hash to {want[:12]}...; the engines would sample from "
                              f"stale or corrupted weights")


def sync_metrics(t0: float, nbytes: int, buckets: int, verified: bool = True) -> dict[str, float]:
    """The metrics every sync reports (``sync/verified`` only when it was verified)."""
    dt = time.perf_counter() - t0
    m = {"sync/seconds": dt, "sync/bytes": float(nbytes), "sync/buckets": float(buckets),
         "sync/gbps": nbytes / max(dt, 1e-9) / 1e9}
    if verified:
        m["sync/verified"] = 1.0
    return m


class Link:
    """The driver's side of one transport, held by a rollout (``rollout``: the object that reaches the
    engines through ``_call`` / ``_async`` / ``_get``, with ``size``, ``bucket_bytes``, ``engine_dtype``
    and ``verify``).

    ``ready(actor)`` sets the transport up for ``actor`` when needed and says whether it can run;
    where it cannot, ``reason`` says why and the rollout takes its next transport. ``label`` is what
    the rollout reports as its ``transport`` after a sync through this link."""

    name = ""
    label = ""
    sender: type | None = None
    receiver: type | None = None
    # where it can be chosen (trainer.sync.choose): the engines' placements it serves ("workers": their own
    # Ray workers, "hybrid": in the actor ranks' processes, "server": HTTP servers), the rollout.weight_sync
    # values that select it, and the protocol an engine must declare in capabilities.weight_protocols (None:
    # any engine)
    placements: tuple[str, ...] = ()
    weight_syncs: tuple[str, ...] = ("auto", "distributed_group", "object_store")
    protocol: str | None = None

    def __init__(self, rollout):
        self.rollout = rollout
        self.reason = ""
        self._proven = None  # the set-up whose first verified sync was checked end to end

    def ready(self, actor) -> bool:
        return True

    def sync(self, actor, verify: bool) -> dict[str, float]:
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the set-up: the next sync forms a new one."""

    def close(self) -> None:
        """Leave what the set-up holds on every member (the rollout's shutdown)."""

    def check_once(self, actor, setup) -> None:
        """The first verified sync through a new set-up (a shared file, a weight group) is also checked end
        to end, outside its timing: every engine's full checksum over its own views against the actor's.
        That proves what the per-piece or per-block checks take as given: the writers' views of the
        engines' weights and the engines' own agree."""
        if self._proven is not setup:
            self.rollout.verify(actor)
            self._proven = setup


@contextmanager
def params_resident(worker):
    """The training worker's parameters in device memory for the block (whatever it offloads goes back after)."""
    worker._load_state(("params",))
    try:
        yield
    finally:
        worker._offload_state()


class Half:
    """A sender or receiver half: ``owner`` is the worker it lives in (a training rank or a rollout worker).
    ``resident_ops``: the sender's ops that read the rank's parameters (they run with them in device memory)."""

    resident_ops: frozenset[str] = frozenset()

    def __init__(self, owner):
        self.owner = owner


def reshard_plan(owner) -> tuple[list, dict] | None:
    """An actor rank's blocks of the HF tensors (``megatron_bridge.reshard``, through the training worker's
    ``_reshard_blocks``) and the local parameter each reads from (``_local_param``); None where the strategy cannot plan
    them (the transports that need them decline)."""
    try:
        blocks = owner._reshard_blocks()
    except NotImplementedError:
        return None
    if blocks is None:
        return None
    return blocks, {b.param: owner._local_param(b.param) for b in blocks}


def plan_of(blocks: list) -> list[tuple]:
    """A rank's blocks as the driver and the engines see them: (HF name, HF shape, rows, cols) each."""
    return [(b.hf_name, b.hf_shape, b.rows, b.cols) for b in blocks]

