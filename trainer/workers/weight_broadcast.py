"""The trainer's side of SGLang's distributed weight update (``update_weights_from_distributed``): for
SGLang engines on other nodes or GPUs than the actor (``trainer.placement=split``,
``actor_rollout_ref.rollout.weight_sync=distributed_group``, ``rollout.name=sglang``).

SGLang's protocol (0.5.21: ``entrypoints/engine.py`` ``init_weights_update_group`` ~1522 and
``update_weights_from_distributed`` ~1570; ``model_executor/model_runner_components/weight_updater.py``
``init_weights_update_group`` and ``_receive_bucketed_weights_from_distributed``;
``utils/common.py`` ``init_custom_process_group``):

* a group of its own next to the engines' tensor-parallel group. Each engine's TP rank ``t`` joins as
  rank ``rank_offset + t``; the sender is rank 0 and hosts the store at ``tcp://host:port``. Every member
  builds the group the same way: the rendezvous' ``TCPStore``, a ``PrefixStore(group_name, store)``,
  then torch's ``_new_process_group_helper(world, rank, [], backend, store, group_name=...)``
  (:func:`join`: the trainer's rank 0 runs exactly that sequence, with the store it hosts, so both ends
  derive the same keys; gloo on CPU, NCCL on GPU, same code);
* per bucket, every engine is told ``(names, dtypes, shapes)`` in buffer order and receives ONE
  ``broadcast`` from rank 0 of the flat buffer :func:`trainer.rollout.sglang_engine.flatten_bucket`
  lays out (SGLang's ``FlattenedTensorBucket``: the tensors' bytes back to back, one dtype), then loads
  the views it cuts from it (``load_weights``: SGLang fuses q/k/v and gate/up and shards for its TP).

So SGLang takes FULL HF tensors from a single source: the sender needs the gathered model. Here that is
actor rank 0, from the same collective stream as the object-store sync
(``MegatronWorker._hf_buckets``: TP shards all-gathered, PP stages' layers brought to rank 0); the
funnel is SGLang's API, not a choice (the native engines' group, ``weight_group.py``, takes every
rank's own shards instead). What is saved against the object store: no serialisation, no copy into
and out of Ray's store, one stream per engine straight from rank 0's buffer.

Pipelining: the sender's stream is a Ray streaming generator that runs ahead. It yields bucket ``b``'s
description (names, shapes, digests, probe rows) to the driver, then broadcasts ``b`` while the driver
hands the description to the engines (whose receive joins that broadcast), then gathers and packs
``b + 1``.

Verification. The sender hashes each tensor as sent (``tensor_digest`` of its view in the flat buffer
cast to the engine dtype, XXH3-128) and keeps the first rows of the probe tensors
(``fleet_client.PROBE_SUFFIXES``); both travel to the engines with the bucket's description. An
engine's ``weights_checksum`` is then the checksum of exactly the bytes broadcast to it, compared with
the actor's own checksum of what it streamed: every tensor, shape and dtype of the model went out in
this sync and SGLang accepted every bucket. SGLang holds the weights in its own fused, sharded layout and
hashes them only in that layout (``check_weights``), so no full read-back is possible; where the model
class implements ``get_weights_by_name`` (Llama-family in 0.5.21) the probe rows are read back from the
engine after every verified sync and must be equal (:meth:`SGLangEngine.verify_weights_on_gpu`).

Failure: a failed sync closes the group on both sides; the next sync forms a new one.
"""

from __future__ import annotations

import datetime
from typing import Iterable

import torch

TIMEOUT = datetime.timedelta(minutes=10)  # joining, and each bucket's broadcast
PROBE_ROWS = 4  # rows kept per probe tensor (SGLangEngine reads back at most 4)


def host_store(host: str) -> torch.distributed.TCPStore:
    """The group's store, hosted by the sender on ``host`` at a port the kernel picks (``.port``); the
    engines connect when they join (the rendezvous of ``tcp://host:port``)."""
    return torch.distributed.TCPStore(host, 0, None, True, TIMEOUT, wait_for_workers=False)


def join(store, world: int, group_name: str, backend: str):
    """The sender's handle (rank 0) of the group ``group_name`` of ``world`` members, built as SGLang's
    ``init_custom_process_group`` builds it on the engines (blocks until every member joins)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    pg, _ = _new_process_group_helper(world, 0, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=TIMEOUT)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}  # as SGLang does: the group's own numbering
    return pg


def leave(pg) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 (the engines may be gone already)
        pass


def pack(bucket: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, digests: bool) -> tuple[torch.Tensor, dict]:
    """One bucket as sent: the flat buffer (``flatten_bucket``: each tensor cast to ``dtype``, back to back)
    and its description for the engines: ``specs`` ``[(name, shape)]`` in buffer order, ``digests``
    ``{name: tensor_digest of the bytes sent}`` (None without), ``probes`` ``{name: first rows as sent,
    float32}``, ``bytes``."""
    from trainer.rollout.engine import tensor_digest
    from trainer.rollout.fleet_client import PROBE_SUFFIXES
    from trainer.rollout.sglang_engine import flatten_bucket, probe_rows, unflatten_bucket

    flat, metas = flatten_bucket(list(bucket), dtype)
    views = unflatten_bucket(flat, metas)
    desc = {"specs": [(m.name, list(m.shape)) for m in metas], "bytes": int(flat.numel()),
            "digests": {n: tensor_digest(n, v) for n, v in views} if digests else None,
            "probes": {n: probe_rows(v, PROBE_ROWS, dtype) for n, v in views if n.endswith(PROBE_SUFFIXES)}}
    return flat, desc


def send(pg, flat: torch.Tensor) -> None:
    """Broadcast one packed bucket from rank 0 of the group (every engine's receive joins it)."""
    import torch.distributed as dist

    dist.broadcast(flat, group=pg, group_src=0)
