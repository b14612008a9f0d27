"""Weight sync through Ray's object store: the actor's HF-named buckets, one stored object each.

Actor rank 0 yields each bucket of its collective HF-name stream (the training worker's ``weight_buckets``:
TP shards gathered, PP stages brought to rank 0; the other ranks yield None) as an object reference;
every engine reads that same stored object (one bucket in flight, the actor's stream at most two ahead),
and the driver only passes references, never the tensors.

The halves: the sender is the training worker's own weight stream (every strategy streams its weights;
nothing here is particular to this transport), the receiver the engine's own ``update_weights``.

Verification: with ``verify`` rank 0 hashes each bucket after handing it over (while the engines load
it), and after the sync every engine's ``weights_checksum`` must equal the checksum of what was streamed
(:func:`trainer.sync.base.check_checksums`, through the rollout's ``verify``).
"""

from __future__ import annotations

import time

from trainer.sync.base import Link, sync_metrics


class ObjectStore(Link):
    """The driver's side: the fallback that always runs (any engine takes ``update_weights``)."""

    name = label = "object_store"
    placements = ("workers",)

    def sync(self, actor, verify: bool) -> dict[str, float]:
        r = self.rollout
        t0 = time.perf_counter()
        # with verify, actor rank 0 hashes each bucket after handing it over (while the engines load it)
        streams = actor.weight_streams(r.bucket_bytes, r.engine_dtype if verify else None)
        nbytes, buckets, pending = 0, 0, []
        for items in zip(*streams):
            # items[0] is rank 0's bucket as an object ref (the other ranks yield None): the engines resolve
            # it from the object store; the driver never deserialises or re-sends the tensors
            nbytes += sum(r._get(pending))
            pending = r._async("update_weights", [(items[0],)] * r.size)
            buckets += 1
        nbytes += sum(r._get(pending))
        m = sync_metrics(t0, nbytes // max(1, r.size), buckets, verify)
        if verify:
            r.verify(actor, streamed=True)
        return m
