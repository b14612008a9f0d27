"""Weight transports by name, and the choice of one for a rollout.

Each transport is one module here (its sender half on the actor ranks, its receiver half beside the
engine, the driver's link, its verification and its metrics; the interface is :mod:`trainer.sync.base`).
:data:`TRANSPORTS` maps a name to its link class; a new transport is its module plus one line here, and
the engines that accept it name it in their ``capabilities.weight_protocols``
(:mod:`trainer.rollout.registry`).

:func:`choose` makes the choice once, when the rollout is built, from what the engine accepts, where the
engines run and ``actor_rollout_ref.rollout.weight_sync``: an ordered tuple of transports, the first
that can run for an actor taking each sync (shared memory declines where the actor and the engines share
no ``/dev/shm``, for instance, and the next one runs).
"""

from __future__ import annotations

from trainer.sync.base import Link
from trainer.sync.broadcast import Broadcast
from trainer.sync.dist_group import DistributedGroup
from trainer.sync.http_push import HttpPush
from trainer.sync.hybrid_copy import HybridCopy
from trainer.sync.object_store import ObjectStore
from trainer.sync.shared_memory import SharedMemory

TRANSPORTS: dict[str, type[Link]] = {
    "shared_memory": SharedMemory,  # one node: the actor ranks write their shards into the engines' shared weights
    "object_store": ObjectStore,  # HF buckets through Ray's object store (every engine takes it)
    "dist_group": DistributedGroup,  # every actor rank's own blocks over a gloo/NCCL group to every engine
    "broadcast": Broadcast,  # SGLang's distributed update: full tensors broadcast from actor rank 0
    "hybrid": HybridCopy,  # the engine in the actor rank's process: a local copy from the gathered stream
    "http_push": HttpPush,  # HTTP engine servers: the fleet client's drained, checked push
}

PLACEMENTS = ("workers", "hybrid", "server")  # engines in their own Ray workers, in the actor ranks, HTTP servers


def choose(protocols: tuple[str, ...], placement: str, weight_sync: str) -> tuple[str, ...]:
    """The transports a rollout tries, in order, for engines that accept ``protocols``
    (``capabilities.weight_protocols``) placed as ``placement`` (one of :data:`PLACEMENTS`), with
    ``weight_sync`` = auto | distributed_group | object_store."""
    if placement == "server":
        return ("http_push",)
    shm = ("shared_memory",) if weight_sync == "auto" and "shared_memory" in protocols else ()
    if placement == "hybrid":
        return shm + ("hybrid",)
    if placement != "workers":
        raise ValueError(f"unknown rollout placement {placement!r}; one of {PLACEMENTS}")
    if weight_sync == "distributed_group":
        if "broadcast" in protocols:  # SGLang takes full tensors from one sender, and nothing else over a group
            return ("broadcast",)
        if "dist_group" in protocols:
            return ("dist_group", "object_store")
    return shm + ("object_store",)
