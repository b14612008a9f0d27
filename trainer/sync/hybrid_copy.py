"""Hybrid engine sync without shared memory: every actor rank loads the engine in its own process from the
HF-name stream with a local ``copy_`` (verl's hybrid engine, ``actor_rollout_ref.hybrid_engine``).

Every rank of the stream (``_hf_buckets``) already sees the full tensors (gathered over TP, broadcast over
PP), so each rank loads its own engine, cast to the engine's dtype: no transport at all, and the extra
memory is one bucket's TP/PP gather.

Verification stays exact and per rank: each rank hashes what it streamed (``tensor_digest`` cast to the
engine's dtype, the same rounding as the engine's ``copy_``) and its engine's own checksum of what it holds
(``checksum_named_tensors`` over the engine's tensors); the link requires the two to match on every rank,
and all ranks' streams to match each other (:func:`~trainer.sync.base.check_checksums`: replicas that
diverged would otherwise sample from different policies).

The halves: :class:`CopySender` on every hybrid actor rank (the engine half lives in the same process,
``worker.engine_worker``), and :class:`HybridCopy`, the driver's link. Reported as ``object_store`` (the
name this path had before it had its own module: the same bucket stream, loaded in process).
"""

from __future__ import annotations

import threading
import time

import torch

from megatron_bridge import cpu_shims
from trainer.rollout.engine import checksum_named_tensors, tensor_digest
from trainer.rollout.weights import combine_digests
from trainer.sync.base import Half, Link, check_checksums, sync_metrics


class CopySender(Half):
    """A hybrid actor rank's half: loads its engine from the stream and hashes both sides."""

    resident_ops = frozenset({"copy", "verify"})

    def copy(self, bucket_bytes: int, digest_dtype: str | None) -> dict:
        """Load this rank's engine from the HF-name weight stream (collective over the model-parallel
        group). With ``digest_dtype`` (``"none"`` = as is) also hash the stream and the engine's result.
        Returns ``{"bytes", "buckets", "stream", "engine"}`` (checksums None without it). The stream's
        digests also make the worker's ``stream_checksum``."""
        w = self.owner
        hashing = digest_dtype is not None
        dt = getattr(torch, digest_dtype) if hashing and digest_dtype != "none" else None
        digests: dict[str, bytes] = {}
        nbytes = buckets = 0
        w._stream_done = threading.Event()
        with torch.no_grad():
            for bucket in w._hf_buckets(bucket_bytes):
                # the iterator (megatron's gathers) runs under the CPU device shim; loading and
                # hashing need none (a third of the sync's time went to the shim's dispatch)
                with cpu_shims.suspended():
                    pairs = [(n, t.detach()) for n, t in bucket]  # views of live params: copied by the engine
                    nbytes += w.engine_worker.update_weights(pairs)
                    buckets += 1
                    if hashing:
                        for n, t in pairs:
                            if n in digests:
                                raise ValueError(f"tensor {n!r} appears twice in the weight stream")
                            digests[n] = tensor_digest(n, t, dt)
        w._stream_digests = digests
        w._stream_done.set()
        stream = combine_digests(digests) if hashing else None
        engine = w.engine("weights_checksum") if hashing else None
        return {"bytes": nbytes, "buckets": buckets, "stream": stream, "engine": engine}

    def stream_checksum(self, timeout: float = 600.0) -> str | None:
        """This rank's checksum of its last :meth:`copy` stream (every rank streamed, unlike rank 0 alone in
        the object-store stream)."""
        w = self.owner
        done = getattr(w, "_stream_done", None)
        if done is None or not done.wait(timeout):
            raise RuntimeError("stream_checksum: no finished sync_engine stream with digests")
        return combine_digests(w._stream_digests) if w._stream_digests else None

    def verify(self, dtype: str | None) -> tuple[str, str]:
        """(this rank's checksum of the actor's weights cast to ``dtype``, its engine's checksum);
        collective: every rank gathers the full tensors."""
        dt = getattr(torch, dtype) if dtype else None
        want = checksum_named_tensors(((n, t.detach().cpu()) for n, t in self.owner._hf_params()), dtype=dt)
        return want, self.owner.engine("weights_checksum")


class HybridCopy(Link):
    """The driver's side: every rank loads its own engine; checked per rank and across ranks."""

    name, label = "hybrid", "object_store"
    sender = CopySender
    placements, weight_syncs, protocol = ("hybrid",), ("auto", "object_store"), "hybrid"

    def sync(self, actor, verify: bool) -> dict[str, float]:
        r = self.rollout
        t0 = time.perf_counter()
        digest_dtype = r.engine_dtype if verify else None
        res = actor.group.call("sync_send", [("hybrid", "copy", r.bucket_bytes, digest_dtype)] * actor.size)
        m = sync_metrics(t0, res[0]["bytes"], res[0]["buckets"], verify)
        if verify:
            check_checksums([(x["stream"], x["engine"]) for x in res])
        return m


def verify_hybrid(rollout, actor, streamed: bool) -> None:
    """A hybrid rollout's check: against every rank's stream of its last copy (``streamed``), or recomputed
    from the actor's weights on every rank; each rank's engine must hold what its rank has, and every rank
    the same (:func:`~trainer.sync.base.check_checksums`)."""
    if streamed:
        sums = actor.group.call("sync_send", [("hybrid", "stream_checksum")] * actor.size)
        check_checksums(list(zip(sums, rollout.engine_checksums())))
    else:
        check_checksums(actor.group.call("sync_send", [("hybrid", "verify", rollout.engine_dtype)] * actor.size))
