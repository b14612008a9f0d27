"""The step's data plane: the object store between the driver and the ranks, and a rank's side.

The step's batch is sharded once per DP size and put once (:class:`trainer.step_data.StepData`,
re-exported here); this module is what moves the shards: ``Transport`` is Ray's object store, or
(``trainer.debug.in_process``) the identity, and counts the bytes of the training side that pass
through the driver in each direction (``dataplane/*`` metrics, ``benchmarks/bench_dataplane.py``).
Generation outputs are not in them: the driver scores the rollouts, so they come to it by design.
On a rank, :func:`shard_batch` turns a shard (and the per-token extras sent with it) back into a
``RolloutBatch``.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from trainer.batch import RolloutBatch
from trainer.step_data import MODEL_FIELDS, Partition, Sharded, StepData

__all__ = ["MODEL_FIELDS", "Partition", "Sharded", "StepData", "Transport", "shard_batch"]  # the first four re-exported


def _nbytes(obj) -> int:
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


class Transport:
    """``put`` / ``get`` through Ray's object store (or in-process identity), with byte counters of
    what enters (``put``) and leaves (``get``) the driver process."""

    def __init__(self, in_process: bool):
        self.in_process = in_process
        self.bytes_out = 0  # driver -> object store
        self.bytes_in = 0  # object store -> driver

    def put(self, obj):
        self.bytes_out += _nbytes(obj)
        if self.in_process:
            return obj
        import ray  # heavy (about a second); in-process runs (trainer.debug.in_process) never import it

        return ray.put(obj)

    def get(self, refs: list) -> list:
        if self.in_process:
            out = list(refs)
        else:
            import ray  # heavy; see put

            out = ray.get(list(refs))
        self.bytes_in += _nbytes(out)
        return out

    def take_metrics(self) -> dict[str, float]:
        m = {"dataplane/driver_bytes_out": float(self.bytes_out), "dataplane/driver_bytes_in": float(self.bytes_in)}
        self.bytes_out = self.bytes_in = 0
        return m


def shard_batch(shard: dict, *extras: Optional[dict]) -> RolloutBatch:
    """On a rank: the shard's model inputs plus per-token extras as one ``RolloutBatch``."""
    t = {k: torch.from_numpy(np.array(v)) for k, v in shard.items()}
    for k in ("prompts", "responses"):
        t[k] = t[k].long()
    P = t["prompts"].shape[1]
    am = t["attention_mask"].bool()
    batch = RolloutBatch.from_tokens(t["prompts"], t["responses"], am[:, :P], am[:, P:], t["response_mask"].bool(),
                                     rollout_log_probs=t.get("rollout_log_probs"),
                                     routed_experts=t.get("routed_experts"))
    for ex in extras:
        for k, v in (ex or {}).items():
            setattr(batch, k, torch.from_numpy(np.array(v)))
    return batch
