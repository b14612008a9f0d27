"""Hybrid engine: an actor rank and its colocated rollout engine in ONE process (verl's hybrid engine,
``actor_rollout_ref.hybrid_engine=true`` with a colocated placement and one engine per actor rank).

Why: with the engine in its own process, every sync ships the full model through Ray's object store
(a put, one get per engine, a few round trips) and hashes it on both sides; in the actor's process the
engine can take the weights straight from the rank: through the engines' shared weights on one node
(trainer/sync/shared_memory.py, rung on a doorbell) or a local copy from the gathered HF-name stream
(trainer/sync/hybrid_copy.py). Both are the transports' own; this worker only hosts the engine.

The engine half is the same :class:`RolloutWorker` as in the separate-process fleet, reached through
``engine(method, ...)``; :class:`trainer.workers.rollouts.HybridRollout` is the driver's side.
"""

from __future__ import annotations

import torch

from megatron_bridge import cpu_shims
from trainer.workers.rollout_worker import RolloutWorker
from trainer.workers.train_worker import TrainWorker


class HybridMixin:
    """The engine half of a hybrid rank, on top of a training worker (Megatron or DeepSpeed) that
    provides ``_hf_buckets`` / ``_hf_params`` (full HF-named tensors on every rank)."""

    def __init__(self, *, rollout: dict, **trainer_kwargs):
        super().__init__(**trainer_kwargs)
        threads = torch.get_num_threads()
        self.engine_worker = RolloutWorker(**{**rollout, "num_threads": threads})
        torch.set_num_threads(threads)  # the megatron rank's share of the cores, as without the engine

    def engine(self, method: str, *args, **kwargs):
        """Run a :class:`RolloutWorker` method on this rank's engine, outside megatron's CPU
        device shim (``megatron_bridge.cpu_shims``): the engine needs none, and under it each of
        the decode loop's ~4.6k torch calls per generate would pass through Python."""
        with cpu_shims.suspended():
            return getattr(self.engine_worker, method)(*args, **kwargs)


class HybridWorker(HybridMixin, TrainWorker):
    """An actor rank on any strategy with its colocated engine (on DeepSpeed ZeRO-3 the weight copy gathers
    each parameter)."""
