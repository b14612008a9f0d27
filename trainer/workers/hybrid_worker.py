"""Hybrid engine: an actor rank and its colocated rollout engine in ONE process (verl's hybrid engine,
``actor_rollout_ref.hybrid_engine=true`` with a colocated placement and one engine per actor rank).

Why: with the engine in its own process, every sync ships the full model through Ray's object store
(a put, one get per engine, a few round trips) and hashes it on both sides; in the actor's process the
engine can take the weights straight from megatron_bridge's HF-name iterator. Every rank of the
iterator already sees the full tensors (gathered over TP, broadcast over PP), so each rank loads its
own engine with a local ``copy_`` (cast to the engine's dtype): no transport at all, and the extra
memory is one bucket's TP/PP gather, as before.

Verification stays exact and per rank: each rank hashes what it streamed (``tensor_digest`` cast to
the engine's dtype, the same rounding as the engine's ``copy_``) and its engine's own checksum of
what it holds (``checksum_named_tensors`` over the engine's tensors); ``HybridRollout.sync_from`` requires
the two to match on every rank, and all ranks' streams to match each other (replicas that diverged
would otherwise sample from different policies).

The engine half is the same :class:`RolloutWorker` as in the separate-process fleet, reached through
``engine(method, ...)``; :class:`trainer.workers.rollouts.HybridRollout` is the driver's side.
"""

from __future__ import annotations

import threading

import torch

from trainer.workers.deepspeed_worker import DeepSpeedWorker
from trainer.workers.megatron_worker import MegatronWorker, combine_digests, resident
from trainer.workers.rollout_worker import RolloutWorker


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
        from megatron_bridge import cpu_shims

        with cpu_shims.suspended():
            return getattr(self.engine_worker, method)(*args, **kwargs)

    @resident("params")
    def sync_engine(self, bucket_bytes: int, digest_dtype: str | None) -> dict:
        """Load this rank's engine from the HF-name weight stream (collective over the model-parallel
        group). With ``digest_dtype`` (``"none"`` = as is) also hash the stream and the engine's
        result. Returns ``{"bytes", "buckets", "stream", "engine"}`` (checksums None without it)."""
        from megatron_bridge import cpu_shims

        from trainer.rollout.engine import tensor_digest

        hashing = digest_dtype is not None
        dt = getattr(torch, digest_dtype) if hashing and digest_dtype != "none" else None
        digests: dict[str, bytes] = {}
        nbytes = buckets = 0
        self._stream_done = threading.Event()
        with torch.no_grad():
            for bucket in self._hf_buckets(bucket_bytes):
                # the iterator (megatron's gathers) runs under the CPU device shim; loading and
                # hashing need none (a third of the sync's time went to the shim's dispatch)
                with cpu_shims.suspended():
                    pairs = [(n, t.detach()) for n, t in bucket]  # views of live params: copied by the engine
                    nbytes += self.engine_worker.update_weights(pairs)
                    buckets += 1
                    if hashing:
                        for n, t in pairs:
                            if n in digests:
                                raise ValueError(f"tensor {n!r} appears twice in the weight stream")
                            digests[n] = tensor_digest(n, t, dt)
        self._stream_digests = digests
        self._stream_done.set()
        stream = combine_digests(digests) if hashing else None
        engine = self.engine("weights_checksum") if hashing else None
        return {"bytes": nbytes, "buckets": buckets, "stream": stream, "engine": engine}

    @resident("params")
    def sync_engine_shm(self, verify: bool) -> dict:
        """Write this rank's blocks into the engines' shared weights (trainer/workers/weight_shm.py; every
        actor rank, each hosting one engine of the node), each piece compared in cache with what was
        sent when ``verify``. No barrier: the engine re-derives what it computes from its weights at its
        next pass, which starts after the driver has every rank's result. A mismatch is returned, so
        the driver names the rank. Returns ``{"bytes", "buckets", "error"}``."""
        from megatron_bridge import cpu_shims

        from trainer.rollout.engine import WeightSyncError
        from trainer.workers.weight_shm import write_blocks

        error = None
        with cpu_shims.suspended():
            try:
                write_blocks(self._shm, self._shm_writes, self._shm_params.__getitem__, verify)
            except WeightSyncError as e:
                error = str(e)
            nbytes = self.engine_worker.take_shared_weights()
        return {"bytes": nbytes, "buckets": 1, "error": error}

    def doorbell_open(self) -> tuple[str, bytes]:
        """Serve :meth:`sync_engine_shm` on a doorbell (trainer/workers/doorbell.py): the driver rings it
        without a Ray round trip. Returns (address, token); a second call replaces the first doorbell."""
        from trainer.workers.doorbell import serve

        self._doorbell = serve(self, ("sync_engine_shm",), getattr(self, "_doorbell", None))
        return self._doorbell.address, self._doorbell.token

    def stream_checksum(self, timeout: float = 600.0) -> str | None:
        done = getattr(self, "_stream_done", None)
        if done is None or not done.wait(timeout):
            raise RuntimeError("stream_checksum: no finished sync_engine stream with digests")
        return combine_digests(self._stream_digests) if self._stream_digests else None

    @resident("params")
    def verify_engine(self, dtype: str | None) -> tuple[str, str]:
        """(this rank's checksum of the actor's weights cast to ``dtype``, its engine's checksum);
        collective: every rank gathers the full tensors."""
        from trainer.rollout.engine import checksum_named_tensors

        dt = getattr(torch, dtype) if dtype else None
        want = checksum_named_tensors(((n, t.detach().cpu()) for n, t in self._hf_params()), dtype=dt)
        return want, self.engine("weights_checksum")


class HybridWorker(HybridMixin, MegatronWorker):
    """A megatron actor rank with its colocated engine."""


class DeepSpeedHybridWorker(HybridMixin, DeepSpeedWorker):
    """A DeepSpeed actor rank with its colocated engine (ZeRO-3 gathers each parameter for the copy)."""
