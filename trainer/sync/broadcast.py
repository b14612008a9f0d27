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
  ``broadcast`` from rank 0 of the flat buffer :func:`trainer.rollout.weights.flatten_bucket`
  lays out (SGLang's ``FlattenedTensorBucket``: the tensors' bytes back to back, one dtype), then loads
  the views it cuts from it (``load_weights``: SGLang fuses q/k/v and gate/up and shards for its TP).

So SGLang takes FULL HF tensors from a single source: the sender needs the gathered model. Here that is
actor rank 0, from the same collective stream as the object-store sync
(the training worker's ``_hf_buckets``: TP shards all-gathered, PP stages' layers brought to rank 0); the
funnel is SGLang's API, not a choice (the native engines' group, ``dist_group.py``, takes every
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

The halves: :class:`BroadcastSender` on every actor rank (rank 0 hosts, joins and broadcasts; every rank
drains the collective stream), :class:`BroadcastReceiver` beside every SGLang engine, and
:class:`Broadcast`, the driver's link.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

from trainer.rollout.engine import WeightSyncError, tensor_digest
from trainer.rollout.weights import PROBE_SUFFIXES, flatten_bucket, probe_rows, unflatten_bucket
from trainer.sync.base import Half, Link, sync_metrics
from trainer.sync.dist_group import backend_for

TIMEOUT = datetime.timedelta(minutes=10)  # joining, and each bucket's broadcast
PROBE_ROWS = 4  # rows kept per probe tensor (SGLangEngine reads back at most 4)


def host_store(host: str) -> torch.distributed.TCPStore:
    """The group's store, hosted by the sender on ``host`` at a port the kernel picks (``.port``); the
    engines connect when they join (the rendezvous of ``tcp://host:port``)."""
    return torch.distributed.TCPStore(host, 0, None, True, TIMEOUT, wait_for_workers=False)


def join(store, world: int, group_name: str, backend: str):
    """The sender's handle (rank 0) of the group ``group_name`` of ``world`` members, built as SGLang's
    ``init_custom_process_group`` builds it on the engines (blocks until every member joins)."""
    pg, _ = _new_process_group_helper(world, 0, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=TIMEOUT)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}  # as SGLang does: the group's own numbering
    return pg


def leave(pg) -> None:
    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 (the engines may be gone already)
        pass


def pack(bucket: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, digests: bool) -> tuple[torch.Tensor, dict]:
    """One bucket as sent: the flat buffer (``flatten_bucket``: each tensor cast to ``dtype``, back to back)
    and its description for the engines: ``specs`` ``[(name, shape)]`` in buffer order, ``digests``
    ``{name: tensor_digest of the bytes sent}`` (None without), ``probes`` ``{name: first rows as sent,
    float32}``, ``bytes``."""
    flat, metas = flatten_bucket(list(bucket), dtype)
    views = unflatten_bucket(flat, metas)
    desc = {"specs": [(m.name, list(m.shape)) for m in metas], "bytes": int(flat.numel()),
            "digests": {n: tensor_digest(n, v) for n, v in views} if digests else None,
            "probes": {n: probe_rows(v, PROBE_ROWS, dtype) for n, v in views if n.endswith(PROBE_SUFFIXES)}}
    return flat, desc


def send(pg, flat: torch.Tensor) -> None:
    """Broadcast one packed bucket from rank 0 of the group (every engine's receive joins it)."""
    dist.broadcast(flat, group=pg, group_src=0)


# ---- the halves and the driver's link ---------------------------------------------------------------------
class BroadcastSender(Half):
    """An actor rank's half: rank 0 hosts and joins every broadcast group it sends to (one per rollout, by
    key ``ip:port``); every rank drains the collective stream."""

    def __init__(self, owner):
        super().__init__(owner)
        self.groups: dict[str, tuple] = {}  # key -> (store, process group or None while hosting)

    def host(self) -> tuple[str, int, str] | None:
        """Rank 0: host the group's store on this node's IP at a port the kernel picks; returns (ip, port,
        backend: NCCL where the weights are on a GPU, else gloo). The other ranks: None."""
        if self.owner.rank != 0:
            return None
        m = self.owner._module()
        device = next(p for c in (m if isinstance(m, (list, tuple)) else [m]) for p in c.parameters()).device
        import ray  # a Ray job only: trainer.sync imports without Ray (benchmarks/gpu_check.py)

        ip = ray.util.get_node_ip_address()
        store = host_store(ip)
        self.groups[f"{ip}:{store.port}"] = (store, None)
        return ip, store.port, backend_for(device)

    def join(self, key: str, world: int, group_name: str, backend: str) -> None:
        """Rank 0 joins group ``key`` as its rank 0 (blocks until every engine rank has)."""
        if self.owner.rank != 0:
            return
        store = self.groups[key][0]
        self.groups[key] = (store, join(store, world, group_name, backend))

    def send(self, key: str, bucket_bytes: int, dtype: str, verify: bool) -> Iterator[Any]:
        """Collective over the model group (every rank drains it; the gathers need them all): rank 0 packs
        each HF bucket into a flat buffer in ``dtype``, yields its description (:func:`pack`) to the driver,
        which hands it to the engines, then broadcasts the buffer to them. The other ranks yield None. With
        ``verify`` the digests also make the worker's ``stream_checksum``."""
        w, dt = self.owner, getattr(torch, dtype)
        w._stream_digests, w._stream_done = {}, threading.Event()
        try:
            for bucket in w._hf_buckets(bucket_bytes):
                if w.rank != 0:
                    yield None
                    continue
                flat, desc = pack(bucket, dt, digests=verify)
                w._add_stream_digests((desc["digests"] or {}).items())
                yield desc  # the engines' receive joins the broadcast below
                send(self.groups[key][1], flat)
        finally:
            w._stream_done.set()

    def close(self, key: str) -> None:
        """Leave group ``key``."""
        entry = self.groups.pop(key, None)
        if entry is not None and entry[1] is not None:
            leave(entry[1])


class BroadcastReceiver(Half):
    """An SGLang engine's half: its TP ranks join the trainer's group and take each broadcast bucket."""

    group_name: str | None = None

    def ranks(self) -> int:
        """How many ranks this engine brings to the group (its tensor-parallel size); 0 when the engine
        takes no broadcast (only SGLang does)."""
        engine = self.owner.engine
        return int(engine.tp_size) if hasattr(engine, "update_weights_broadcast") else 0

    def join(self, host: str, port: int, rank_offset: int, world: int, group_name: str, backend: str) -> None:
        """Join the trainer's group: this engine's TP ranks become ranks ``rank_offset ..``."""
        self.owner.engine.init_weight_sync_group(host, port, rank_offset, world, group_name=group_name,
                                                 backend=backend)
        self.group_name = group_name

    def recv(self, desc: dict) -> int:
        """Receive one bucket the trainer's rank 0 broadcasts (``desc``: :func:`pack`'s description);
        returns its bytes."""
        self.owner.engine.update_weights_broadcast(desc["specs"], group_name=self.group_name,
                                                   digests=desc["digests"], probes=desc["probes"])
        return desc["bytes"]

    def read_back(self) -> dict:
        """``{name: max |engine - sent|}`` over the probe rows the sender kept, read back from the engine
        (None where the model class cannot be read back)."""
        return self.owner.engine.verify_weights_on_gpu()

    def close(self, key: str = "") -> None:
        group, self.group_name = self.group_name, None
        if group is not None:
            try:
                self.owner.engine.destroy_weight_sync_group(group)
            except Exception:  # noqa: BLE001 (the engine may be gone already)
                pass


class Broadcast(Link):
    """The driver's side: forms the group at the first sync from an actor, then per bucket hands rank 0's
    description to every engine while rank 0 broadcasts it. Reported as ``distributed_group`` (the
    ``weight_sync`` value that selects it)."""

    name, label = "broadcast", "distributed_group"
    sender, receiver = BroadcastSender, BroadcastReceiver
    placements, weight_syncs, protocol = ("workers",), ("distributed_group",), "broadcast"

    def __init__(self, rollout):
        super().__init__(rollout)
        self.setup: tuple | None = None  # (actor group, group key)

    def ready(self, actor) -> bool:
        if self.setup is None or self.setup[0] is not actor.group:
            self.close()
            self._set_up(actor)
        return True

    def _set_up(self, actor) -> None:
        """Form the group: actor rank 0 hosts its store and is rank 0; each engine's TP ranks follow, in
        engine order."""
        r = self.rollout
        if r.group.in_process or actor.group.in_process:
            raise ValueError("weight_sync=distributed_group needs the engines and the actor in their own processes")
        host, port, backend = next(h for h in actor.group.call("sync_send", [("broadcast", "host")] * actor.size)
                                   if h is not None)
        key, name = f"{host}:{port}", f"coxswain_weights_{port}"
        ranks = r.recv_call("broadcast", "ranks")
        if not all(ranks):
            actor.group.call("sync_send", [("broadcast", "close", key)] * actor.size)
            raise ValueError("weight_sync=distributed_group: a rollout engine takes no broadcast (SGLang engines do)")
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        world = 1 + sum(ranks)
        joins = actor.group.async_call("sync_send", [("broadcast", "join", key, world, name, backend)] * actor.size)
        joins += r.recv_async("broadcast", "join", [(host, port, off, world, name, backend) for off in offsets])
        self.setup = (actor.group, key)
        try:  # together: the members block in the join until all are in
            r._get(joins)
        except Exception:
            self.close()
            raise

    def sync(self, actor, verify: bool) -> dict[str, float]:
        """Actor rank 0 broadcasts each flat bucket (gathered, cast, packed) to every SGLang engine, which
        receives it through ``update_weights_from_distributed``; rank 0 packs the next bucket meanwhile.
        With ``verify``: every engine's checksum of what it was given equals the actor's of what it
        streamed, and the probe rows read back from every engine (where its model class allows) equal what
        was sent; the first verified sync also against the actor's full checksum."""
        r, key = self.rollout, self.setup[1]
        t0 = time.perf_counter()
        streams = actor.group.streams("sync_stream", "broadcast", "send", key, r.bucket_bytes, r.engine_dtype, verify)
        nbytes = buckets = 0
        try:
            for items in zip(*streams):
                desc = actor.group.stream_get(items[0])  # rank 0's description (the others yield None)
                nbytes += r.recv_call("broadcast", "recv", desc)[0]
                buckets += 1
        except Exception:
            self.close()  # a new group at the next sync
            raise
        m = sync_metrics(t0, nbytes, buckets, verify)
        m["sync/group"] = 1.0
        if not verify:
            return m
        r.verify(actor, streamed=True)
        for e, diffs in enumerate(r.recv_call("broadcast", "read_back")):
            bad = {n: d for n, d in diffs.items() if d is not None and d != 0.0}
            if bad:
                raise WeightSyncError(f"weight sync (broadcast) failed: rollout engine {e} holds {sorted(bad)[0]} "
                                      f"with first rows differing from what actor rank 0 sent (max |diff| "
                                      f"{bad[sorted(bad)[0]]}); the engine would sample from corrupted weights")
        self.check_once(actor, self.setup)
        return m

    def close(self) -> None:
        setup, self.setup = self.setup, None
        if setup is None:
            return
        for g, method, args in ((self.rollout.group, "sync_recv", ("broadcast", "close")),
                                (setup[0], "sync_send", ("broadcast", "close", setup[1]))):
            try:
                g.call(method, [args] * g.size)
            except Exception:  # noqa: BLE001 (a group already shut down: nothing left to close)
                pass

    def reset(self) -> None:
        self.close()
