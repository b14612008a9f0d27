"""Weight transports by name, and the choice of one for a rollout.

Each transport is one module here (its sender half on the actor ranks, its receiver half beside the
engine, the driver's link, its verification and its metrics; the interface is :mod:`trainer.sync.base`).
:data:`TRANSPORTS` maps a name to its link class; a new transport is its module plus one line here, and
each link class declares where it applies (``placements``, ``weight_syncs``, the ``protocol`` an engine must
declare in its ``capabilities.weight_protocols``, :mod:`trainer.rollout.registry`).

:func:`choose` makes the choice once, when the rollout is built, from what the engine accepts, where the
engines run and ``actor_rollout_ref.rollout.weight_sync``: an ordered tuple of transports, the first
that can run for an actor taking each sync (shared memory declines where the actor and the engines share
no ``/dev/shm``, for instance, and the next one runs).

The transports: ``shared_memory``, ``object_store``, ``dist_group``, ``broadcast`` (SGLang's), ``hybrid_copy``,
``http_push``. Shared by them: ``base`` (the halves' interface), ``endpoints`` (the workers' one generic entry on
each side) and ``doorbell`` (a same-node call without a Ray round trip, for the shared-memory write).
"""

from __future__ import annotations

from trainer.sync.base import Link
from trainer.sync.broadcast import Broadcast
from trainer.sync.dist_group import DistributedGroup
from trainer.sync.http_push import HttpPush
from trainer.sync.hybrid_copy import HybridCopy
from trainer.sync.object_store import ObjectStore
from trainer.sync.shared_memory import SharedMemory

# in the order of preference: a rollout tries the transports that apply to it in this order
TRANSPORTS: dict[str, type[Link]] = {
    "shared_memory": SharedMemory,  # one node: the actor ranks write their shards into the engines' shared weights
    "broadcast": Broadcast,  # SGLang's distributed update: full tensors broadcast from actor rank 0
    "dist_group": DistributedGroup,  # every actor rank's own blocks over a gloo/NCCL group to every engine
    "hybrid": HybridCopy,  # the engine in the actor rank's process: a local copy from the gathered stream
    "object_store": ObjectStore,  # HF buckets through Ray's object store (every engine takes it)
    "http_push": HttpPush,  # HTTP engine servers: the fleet client's drained, checked push
}

PLACEMENTS = ("workers", "hybrid", "server")  # engines in their own Ray workers, in the actor ranks, HTTP servers


def choose(protocols: tuple[str, ...], placement: str, weight_sync: str) -> tuple[str, ...]:
    """The transports a rollout tries, in order, for engines that accept ``protocols``
    (``capabilities.weight_protocols``) placed as ``placement`` (one of :data:`PLACEMENTS`), with
    ``weight_sync`` = auto | distributed_group | object_store: every registered transport that declares
    it serves them (``placements``, ``weight_syncs``, ``protocol``), in the order of :data:`TRANSPORTS`."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown rollout placement {placement!r}; one of {PLACEMENTS}")
    known = {link.protocol for link in TRANSPORTS.values() if link.protocol is not None} | set(TRANSPORTS)
    unknown = sorted(set(protocols) - known)
    if unknown:
        raise ValueError(f"the rollout engine declares weight protocol(s) {unknown} that no registered transport "
                         f"serves (capabilities.weight_protocols; known: {sorted(known)}): register the transport in "
                         f"trainer.sync.TRANSPORTS or correct the engine's capabilities")
    return tuple(name for name, link in TRANSPORTS.items()
                 if placement in link.placements and weight_sync in link.weight_syncs
                 and (link.protocol is None or link.protocol in protocols))
