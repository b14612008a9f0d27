"""Resharding manager: stream the actor's TP/PP shards into the rollout engines after every update.

The actor ranks walk megatron_bridge's bucketed HF-name iterator together (each parameter is gathered
over TP and broadcast over PP one at a time), global rank 0 hands each full bucket to every engine's
``update_weights``, and the next bucket is only produced once the engines have taken this one, so
the extra memory is about one bucket (``actor_rollout_ref.rollout.update_weights_bucket_megabytes``)
plus the streaming window, never the whole model. On CPU the bytes travel through Ray's object store;
on GPU colocated engines would take CUDA IPC handles and split ones an NCCL broadcast (GPU-only).

Every sync is checked: the engines' ``weights_checksum`` must equal the actor's checksum of the same
HF-named tensors (``trainer.rollout.engine.checksum_named_tensors``). A mismatch raises.
"""

from __future__ import annotations

import time


class WeightSyncError(RuntimeError):
    pass


class Resharder:
    def __init__(self, actor, rollout, bucket_bytes: int = 512 << 20, engine_dtype: str | None = None):
        self.actor, self.rollout = actor, rollout
        self.bucket_bytes = int(bucket_bytes)
        self.engine_dtype = engine_dtype

    def sync(self, verify: bool = True) -> dict[str, float]:
        t0 = time.perf_counter()
        streams = self.actor.streams("weight_buckets", self.bucket_bytes)
        nbytes, buckets = 0, 0
        for items in zip(*streams):
            bucket = self.actor.stream_get(items[0])
            for other in items[1:]:
                self.actor.stream_get(other)  # drain: the other ranks took part in the gathers
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            buckets += 1
            self.rollout.call("update_weights", [(bucket,)] * self.rollout.size)
        dt = time.perf_counter() - t0
        metrics = {"sync/seconds": dt, "sync/bytes": float(nbytes), "sync/buckets": float(buckets),
                   "sync/gbps": nbytes / max(dt, 1e-9) / 1e9}
        if verify:
            self.verify()
            metrics["sync/verified"] = 1.0
        return metrics

    def verify(self) -> None:
        """Raise ``WeightSyncError`` unless every engine holds exactly the actor's weights."""
        want = next(c for c in self.actor.call("weights_checksum", dtype=self.engine_dtype) if c is not None)
        got = self.rollout.call("weights_checksum")
        bad = [i for i, c in enumerate(got) if c != want]
        if bad:
            raise WeightSyncError(f"weight sync failed: rollout engine(s) {bad} hold checksum {got[bad[0]][:12]}... "
                                  f"but the actor's weights hash to {want[:12]}...; the engines would sample "
                                  f"from stale or corrupted weights")
