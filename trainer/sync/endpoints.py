"""The workers' ends of a sync: one generic entry on each side.

A training rank (:class:`SenderEndpoints`, mixed into the training worker) answers
``sync_send(transport, op, *args)`` (and ``sync_stream`` for an op that yields: Ray streams only from a
generator method) by running ``op`` on its sender half of ``transport``; a rollout worker
(:class:`ReceiverEndpoints`) answers ``sync_recv(transport, op, *args)`` with its receiver half. Each half
is made at its first use, one per transport per worker, from :data:`trainer.sync.TRANSPORTS`; the driver's
links (``trainer/sync/<transport>.py``) name the ops.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import torch

from trainer.orphans import fault_hold
from trainer.rollout.engine import checksum_named_tensors, tensor_digest
from trainer.rollout.weights import combine_digests
from trainer.sync import TRANSPORTS
from trainer.sync.base import params_resident


class SenderEndpoints:
    """What the driver calls on a training rank during a sync, for a worker that provides ``rank``,
    ``_module``, ``_hf_buckets``, ``_hf_params``, ``_reshard_blocks``, ``_local_param``, ``_load_state`` and ``_offload_state``
    (``trainer.workers.train_worker.TrainWorker``).

    ``sync_send(transport, op, *args)`` runs ``op`` on this rank's sender half of ``transport`` (made at
    its first use, one per transport); ``sync_stream`` is the same for an op that yields (Ray streams
    only from a generator method). The rank's own weight stream (``weight_buckets``) and checksums serve
    every transport that moves whole HF tensors (object store, HTTP push) and every check."""

    def _sync_half(self, transport: str):
        halves = self.__dict__.setdefault("_sync_halves", {})
        if transport not in halves:
            halves[transport] = TRANSPORTS[transport].sender(self)
        return halves[transport]

    def sync_send(self, transport: str, op: str, *args) -> Any:
        fault_hold("sync")
        half = self._sync_half(transport)
        if op in half.resident_ops:
            with params_resident(self):
                return getattr(half, op)(*args)
        return getattr(half, op)(*args)

    def sync_stream(self, transport: str, op: str, *args) -> Iterator[Any]:
        half = self._sync_half(transport)
        if op in half.resident_ops:
            with params_resident(self):
                yield from getattr(half, op)(*args)
        else:
            yield from getattr(half, op)(*args)

    def weight_buckets(self, bucket_bytes: int, digest_dtype: str | None = None) -> Iterator[Any]:
        """Collective generator over HF-named weight buckets. Every rank must drain it; only global
        rank 0 yields the tensors (others yield None, so nothing is shipped twice).

        No copy is made here: Ray serialises a yielded bucket into its object store before the
        generator resumes (views of live parameters are fine: no optimizer step runs during a sync).
        With ``digest_dtype`` (``"none"`` = as is) rank 0 then hashes the bucket it just handed
        over, while the engines load it, and ``stream_checksum`` returns the checksum of everything
        streamed: verification without a second gather pass over the model."""
        hashing = digest_dtype is not None and self.rank == 0
        dt = getattr(torch, digest_dtype) if hashing and digest_dtype != "none" else None
        self._stream_digests, self._stream_done = {}, threading.Event()
        with params_resident(self):
            try:
                for bucket in self._hf_buckets(bucket_bytes):
                    if self.rank != 0:
                        yield None
                        continue
                    pairs = [(n, t.detach().cpu()) for n, t in bucket]
                    yield pairs
                    if hashing:
                        self._add_stream_digests((n, tensor_digest(n, t, dt)) for n, t in pairs)
            finally:
                self._stream_done.set()

    def _add_stream_digests(self, digests) -> None:
        """Record ``(name, digest)`` pairs of the stream in progress (``stream_checksum``); a name twice is an error."""
        for n, d in digests:
            if n in self._stream_digests:
                raise ValueError(f"tensor {n!r} appears twice in the weight stream")
            self._stream_digests[n] = d

    def stream_checksum(self, timeout: float = 600.0) -> str | None:
        """Checksum of the last stream (rank 0; others None), equal to ``checksum_named_tensors`` of the
        same tensors. Waits for the stream's last digest."""
        if self.rank != 0:
            return None
        done = getattr(self, "_stream_done", None)
        if done is None or not done.wait(timeout):
            raise RuntimeError("stream_checksum: no finished weight_buckets stream with digests")
        return combine_digests(self._stream_digests)

    def weights_checksum(self, dtype: str | None = None, base: bool = False) -> str | None:
        """Rank 0: ``checksum_named_tensors`` of the actor's HF-named weights cast to ``dtype`` (``base``: of the
        base weights under LoRA's adapters, which an adapter-only sync's engines merge over); the others take
        part in the gathers and return None."""
        dt = getattr(torch, dtype) if dtype else None
        with params_resident(self):
            pairs = ((n, t.detach().cpu()) for n, t in (self._base_params() if base else self._hf_params()))
            if self.rank == 0:
                return checksum_named_tensors(pairs, dtype=dt)
            for _ in pairs:  # collective: still take part in every gather
                pass
            return None


class ReceiverEndpoints:
    """What the driver calls beside an engine during a sync, for a worker that holds ``engine``
    (``trainer.workers.rollout_worker.RolloutWorker``)."""

    def sync_recv(self, transport: str, op: str, *args) -> Any:
        halves = self.__dict__.setdefault("_sync_halves", {})
        if transport not in halves:
            halves[transport] = TRANSPORTS[transport].receiver(self)
        return getattr(halves[transport], op)(*args)
