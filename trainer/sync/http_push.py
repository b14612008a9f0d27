"""Weight sync to HTTP engine servers (``rollout.mode=server``): the actor's stream through the driver into
the fleet client (:class:`trainer.rollout.fleet_client.FleetClient`), which drains the servers, pushes every
bucket to each and checks every server's checksum against the stream's before reopening them to traffic.

The halves: the sender is the training worker's own weight stream (rank 0's buckets; the other ranks
yield None), the receiver the fleet client's push (its wire format, retries and per-server checks are
its own). Verification happens inside the push (a server must not serve before it is checked), so
every sync through this link is verified.
"""

from __future__ import annotations

import time

import torch

from trainer.sync.base import Link, sync_metrics


class HttpPush(Link):
    """The driver's side: the rollout's ``client`` receives the named tensors as the actor streams them."""

    name = label = "http_push"
    placements = ("server",)

    def sync(self, actor, verify: bool) -> dict[str, float]:
        r = self.rollout
        t0 = time.perf_counter()
        streams = actor.weight_streams(r.bucket_bytes, None)
        nbytes = buckets = 0

        def named():
            nonlocal buckets, nbytes
            for items in zip(*streams):  # rank 0's bucket; the other ranks yield None
                buckets += 1
                for name, t in actor.stream_get(items[0]):
                    nbytes += t.numel() * t.element_size()
                    yield name, t

        r.client.update_weights(named(), dtype=getattr(torch, r.engine_dtype))
        return sync_metrics(t0, nbytes, buckets)
