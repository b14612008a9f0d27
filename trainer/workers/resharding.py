"""Resharding manager: stream the actor's TP/PP shards into the rollout engines after every update.

The actor ranks walk megatron_bridge's bucketed HF-name iterator together (each parameter is gathered
over TP and broadcast over PP one at a time), global rank 0 yields each full bucket into Ray's object
store (one copy), and every engine's ``update_weights`` gets the bucket's object ref: the engines read
the same stored object and copy it into their weights; the driver only passes refs. One bucket is in
flight to the engines at a time and the actor's stream runs at most two buckets ahead, so the extra
memory is a few buckets (``actor_rollout_ref.rollout.update_weights_bucket_megabytes``), never the
whole model. On GPU colocated engines would take CUDA IPC handles and split ones an NCCL broadcast
(GPU-only).

Every sync is checked: the engines' ``weights_checksum`` must equal the actor's checksum of the same
HF-named tensors (``trainer.rollout.engine.checksum_named_tensors``). A mismatch raises. During a sync
rank 0 hashes each bucket right after handing it over, while the engines load it, so the check costs
the engines' own hash (run concurrently with fetching the actor's) and no second pass over the actor.

Hybrid engine (``actor_rollout_ref.hybrid_engine``, colocated native engines inside the actor ranks'
processes, :mod:`trainer.workers.hybrid_worker`): no transport at all. Every rank loads its own
engine from the same iterator (which already gives every rank the full tensors) and hashes what it
streamed; the check is per rank (stream == engine) and across ranks (every rank streamed the same).
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
        if hasattr(self.rollout, "update_weights_stream"):
            return self._sync_fleet(t0)
        if getattr(self.rollout, "hybrid", False):
            return self._sync_hybrid(t0, verify)
        # with verify, rank 0 hashes each bucket after handing it over (in parallel with the engines' load)
        streams = self.actor.streams("weight_buckets", self.bucket_bytes, (self.engine_dtype or "none") if verify else None)
        nbytes, buckets, pending = 0, 0, []
        for items in zip(*streams):
            # items[0] is rank 0's bucket as a Ray object ref (the other ranks yield None): the engines
            # resolve it straight from the object store, shared by all of them; the driver never
            # deserialises or re-sends the tensors. One bucket in flight, so memory stays ~one bucket.
            nbytes += sum(self.rollout.get(pending))
            pending = self.rollout.async_call("update_weights", [(items[0],)] * self.rollout.size)
            buckets += 1
        nbytes += sum(self.rollout.get(pending))
        nbytes //= max(1, self.rollout.size)
        dt = time.perf_counter() - t0
        metrics = {"sync/seconds": dt, "sync/bytes": float(nbytes), "sync/buckets": float(buckets),
                   "sync/gbps": nbytes / max(dt, 1e-9) / 1e9}
        if verify:
            self.verify(streamed=True)
            metrics["sync/verified"] = 1.0
        return metrics

    def _sync_hybrid(self, t0: float, verify: bool) -> dict[str, float]:
        """Hybrid engine (``trainer.workers.hybrid_worker``): every actor rank loads the engine in its
        own process from the weight stream; checked per rank (stream digest == engine checksum) and
        across ranks (every rank streamed the same weights)."""
        res = self.actor.call("sync_engine", [(self.bucket_bytes, (self.engine_dtype or "none") if verify else None)]
                              * self.actor.size)
        dt = time.perf_counter() - t0
        nbytes = res[0]["bytes"]
        metrics = {"sync/seconds": dt, "sync/bytes": float(nbytes), "sync/buckets": float(res[0]["buckets"]),
                   "sync/gbps": nbytes / max(dt, 1e-9) / 1e9}
        if verify:
            self._check([(r["stream"], r["engine"]) for r in res])
            metrics["sync/verified"] = 1.0
        return metrics

    @staticmethod
    def _check(pairs: list[tuple[str, str]]) -> None:
        """``pairs[i]``: (the actor's checksum seen by engine i, engine i's checksum). Every actor
        checksum must equal the first (replicas agree) and every engine's its actor's."""
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

    def _sync_fleet(self, t0: float) -> dict[str, float]:
        """An HTTP fleet (``rollout.mode=server``): the actor's stream goes through the driver to the
        fleet client, which drains the servers, pushes each bucket to every one and checks every
        server's checksum against the stream's (raising ``WeightSyncError`` naming the server)."""
        streams = self.actor.streams("weight_buckets", self.bucket_bytes, None)
        buckets = 0

        def named():
            nonlocal buckets
            for items in zip(*streams):  # rank 0's bucket; the other ranks yield None
                buckets += 1
                yield from self.actor.stream_get(items[0])

        nbytes = self.rollout.update_weights_stream(named())
        dt = time.perf_counter() - t0
        return {"sync/seconds": dt, "sync/bytes": float(nbytes), "sync/buckets": float(buckets),
                "sync/gbps": nbytes / max(dt, 1e-9) / 1e9, "sync/verified": 1.0}

    def verify(self, streamed: bool = False) -> None:
        """Raise ``WeightSyncError`` unless every engine holds exactly the actor's weights.

        ``streamed``: compare with the checksum rank 0 took of the sync it just streamed (no second
        pass over the actor's model); otherwise the actor recomputes it. The actor's and the engines'
        checksums run concurrently."""
        if getattr(self.rollout, "hybrid", False):
            if streamed:
                got = self.rollout.call("weights_checksum")
                self._check(list(zip(self.actor.call("stream_checksum"), got)))
            else:
                self._check(self.actor.call("verify_engine", dtype=self.engine_dtype))
            return
        want_refs = (self.actor.async_call("stream_checksum") if streamed
                     else self.actor.async_call("weights_checksum", dtype=self.engine_dtype))
        got_refs = self.rollout.async_call("weights_checksum")
        want = next(c for c in self.actor.get(want_refs) if c is not None)
        self._check([(want, got) for got in self.rollout.get(got_refs)])
