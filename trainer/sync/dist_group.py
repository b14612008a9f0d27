"""Weight sync through a torch.distributed group: for rollout engines that share no node (no
``/dev/shm``) with the actor's ranks. Every actor rank sends only the blocks it owns; every engine
receives every rank's blocks and places them into its own weights. No gather, no funnel through rank 0,
no metadata on the wire. (SGLang engines take full tensors from one sender instead: their protocol is
``trainer/sync/broadcast.py``.)

What moves where. The group's world is the actor's ranks (group ranks ``0..A-1``, in actor rank order)
and then the engine workers (``A..A+E-1``). It is a group of its own, next to megatron's default
process group (which spans only the actor ranks): one ``torch.distributed.TCPStore`` that actor rank 0
hosts on its node's IP (on a port the kernel picks, so no race for a free port), under a
``PrefixStore``, and a ``ProcessGroupGloo`` (tensors on CPU) or ``ProcessGroupNCCL`` (tensors on a GPU)
built on it and used directly through its ``send`` / ``recv`` methods (torch.distributed's c10d
backend API, https://pytorch.org/docs/stable/distributed.html: point-to-point ``send``/``recv`` with a
tag, each returning a ``Work`` to ``wait`` on). The backend follows the device of the tensors; the code
is the same.

* the plan: each actor rank's blocks (``megatron_bridge.reshard.local_blocks``, as planned for the
  shared-memory sync, ``trainer.sync.base.reshard_plan``) are ``(HF name, HF shape, rows, cols)``. The
  driver gathers every rank's plan and hands all of them to every engine at set-up; both sides cut a
  rank's blocks, in plan order, into the same buckets (:func:`plan_buckets`: consecutive blocks up to
  ``bucket_bytes`` in the engine dtype; a lone bigger block is a bucket of its own). So the receiver
  knows what each incoming bucket holds, and only the weights' bytes travel;
* a sync: each rank packs bucket ``b`` into one of two send buffers (a strided copy of each block out of
  its local parameter, cast to the engine dtype with round-to-nearest-even, as ``copy_`` does), posts
  one ``send`` of the buffer's bytes to every engine (tag ``b``), then packs bucket ``b + 1`` into the
  other buffer while those sends run. Each engine keeps two receives posted per actor rank, and places
  each bucket that arrives (``Block.dst(view).copy_``: one strided copy per block into its HF-named
  views, ``NativeEngine.hf_views``), reposting into the buffer it just emptied, so the next buckets
  arrive while it places this one. Then ``weights_changed`` re-derives the engine's packed copies.

Verification (every sync, unless the caller turns it off). Per block ``k`` with key ``Block.key`` (HF
name and bounds): the sender computes ``s_k = H(key, dtype, shape, bytes of the block as sent)`` over
its packed buffer (the buffer holds the block cast to the engine dtype, so ``s_k`` equals
``tensor_digest(key, src_block, engine_dtype)``), while the sends run; every engine computes
``r_k = H(key, dtype, shape, bytes read back from its own weight)`` right after placing it
(``tensor_digest(key, Block.dst(view))``). ``H`` is XXH3-128 (``trainer.rollout.engine``). The driver
compares ``r_k == s_k`` for every block of every rank on every engine (:func:`compare_digests`); any
difference, or a block missing, is a ``WeightSyncError`` that names the tensor, the block, the sending
rank and the engine. A flipped bit anywhere between the sender's buffer and the engine's weight (the
wire, a receive buffer, a placement into the wrong place) changes ``r_k`` except with probability
``2^-128`` per block. The blocks partition every tensor (the first verified sync after set-up is also
checked end to end with the full checksums, which proves it), so equal digests for all blocks mean the
engine holds exactly the actor's weights in the engine dtype.

Cost per byte of the model. Sender: one strided read of the parameter and one write of the buffer (the
cast), the transport's read, and with verification one XXH3 pass over the buffer (about 30 GB/s per
core, while the sends run). Each rank sends its own ``1/A`` of the model to each of the ``E`` engines
(gloo's point-to-point is a direct TCP stream per pair). Engine: the transport's write into a receive
buffer, one strided copy into its weights, and with verification one XXH3 pass reading the placed block
back (from cache for a small block, from memory for a big one). Memory: two buffers of at most
``bucket_bytes`` per actor rank, and two per actor rank on every engine. Measured
(benchmarks/bench_weight_group.py, 2-core shared CPU machine, TP=2 actor -> 2 engine workers, 75 MB fp32
model over loopback gloo, two runs, best of 5 per bucket size of 8/64/512 MiB): 38-44 ms a sync
unverified, 50-57 ms verified (+23-37% on the medians; the slowest process hashed for 6-17 ms), 1.9-2.6x
faster than the verified object-store path; on this machine the four processes share two cores, so the
hashing adds to the transfer instead of hiding behind it.

Failure: a member whose sync fails (an exception while packing, placing or hashing) first drains its
part of the exchange (a sender sends its remaining buckets, whatever its buffer holds; an engine receives
and drops the buckets still to come), so its peers' sends and receives complete instead of waiting for
the group's timeout (gloo's pending operations do not end when a group is shut down, only when a peer's
connection closes or ``TIMEOUT`` passes). The driver waits on every member's call together, so the
first error fails the sync at once; it then lets the others finish, every member leaves the group, and
a new one is formed at the next sync. ``TIMEOUT`` bounds joining and each send or receive.

The halves: :class:`GroupSender` on every actor rank (hosts the store on rank 0, joins, sends),
:class:`GroupReceiver` beside every engine (joins, receives and places), and :class:`DistributedGroup`,
the driver's link (forms the group, runs a sync, compares the digests).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from trainer.rollout.engine import WeightSyncError, tensor_digest
from trainer.sync.base import Half, Link, plan_of, reshard_plan, sync_metrics

PREFIX = "coxswain/weight_group"  # the store's keys for this group (PrefixStore)
TIMEOUT = datetime.timedelta(minutes=5)  # joining, and each send / receive (a bucket)

# tests: called on an engine as ``after_place(source_rank, pieces, views)`` right after a bucket's
# blocks (``pieces``) were placed and before they are read back for the check (a test flips a bit here)
after_place: Callable[[int, list, dict], None] | None = None


@dataclass(frozen=True)
class Piece:
    """One block of a bucket: elements ``[offset, offset + numel)`` of the bucket, in the engine dtype."""

    block: object  # megatron_bridge.reshard.Block
    offset: int

    @property
    def numel(self) -> int:
        r, c = self.block.shape
        return r * c


def plan_buckets(plan: list, esize: int, bucket_bytes: int) -> list[list[Piece]]:
    """A rank's plan (``(hf_name, hf_shape, rows, cols)`` per block, in its order) cut into buckets of
    consecutive blocks of at most ``bucket_bytes`` (``esize``: the engine dtype's element size); a lone
    bigger block forms its own bucket. Pure: the sender and every engine compute the same buckets."""
    from megatron_bridge.reshard import Block  # heavy: megatron-core, loaded only where a group sync runs

    out, cur, size = [], [], 0
    for hf_name, hf_shape, rows, cols in plan:
        b = Block(hf_name, tuple(hf_shape), tuple(rows), tuple(cols), "", 0, 0)
        n = b.shape[0] * b.shape[1]
        if cur and (size + n) * esize > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(Piece(b, size))
        size += n
    if cur:
        out.append(cur)
    return out


def bucket_numel(bucket: list[Piece]) -> int:
    return bucket[-1].offset + bucket[-1].numel if bucket else 0


def backend_for(device: torch.device) -> str:
    """NCCL for tensors on a GPU, gloo for CPU tensors."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def host_store(host: str) -> torch.distributed.TCPStore:
    """The group's store, hosted by actor rank 0 on ``host`` at a port the kernel picks (``.port``);
    it does not wait for the others here: they connect when they join."""
    return torch.distributed.TCPStore(host, 0, None, True, TIMEOUT, wait_for_workers=False)


def join(host: str, port: int, rank: int, world: int, device: torch.device, store=None):
    """This process's handle of the weight group (blocks until all ``world`` members join). ``store``:
    the hosted store on actor rank 0; the others connect to ``host:port``."""
    if store is None:
        store = dist.TCPStore(host, port, None, False, TIMEOUT)
    prefixed = dist.PrefixStore(PREFIX, store)
    if backend_for(device) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        pg = dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, world, TIMEOUT)
    return pg, store


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor (what travels: every backend moves uint8)."""
    return t.view(torch.uint8)


class Sender:
    """An actor rank's side: its blocks, bucketed, sent to every engine."""

    def __init__(self, pg, plan: list, blocks: list, dtype: torch.dtype, bucket_bytes: int,
                 device: torch.device):
        self.pg, self.dtype, self.device = pg, dtype, torch.device(device)
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.plan, self.all_blocks, self.bucket_bytes = plan, blocks, None
        self.rebucket(bucket_bytes)

    def rebucket(self, bucket_bytes: int) -> None:
        """Cut the plan into buckets of ``bucket_bytes`` (the engines do the same) and size the buffers."""
        if bucket_bytes == self.bucket_bytes:
            return
        self.bucket_bytes = bucket_bytes
        self.buckets = plan_buckets(self.plan, self.esize, bucket_bytes)
        it = iter(self.all_blocks)  # the plan is the blocks' bounds, in the same order
        self.blocks = [[next(it) for _ in bucket] for bucket in self.buckets]
        self.bufs = [torch.empty(max((bucket_numel(b) for b in self.buckets), default=0), dtype=self.dtype,
                                 device=self.device) for _ in range(min(2, len(self.buckets)))]

    def send(self, engines: list[int], param_of: Callable[[str], torch.Tensor], verify: bool) -> dict:
        """Send every bucket to every engine (group ranks ``engines``), packing the next while the
        last goes out. Returns ``{"digests": {key: XXH3-128 of the block as sent} (with verify),
        "bytes", "buckets", "hash_s", "seconds"}``."""
        t0 = time.perf_counter()
        digests, hash_s, nbytes, unsent = {}, 0.0, 0, 0
        works: list[list] = [[] for _ in self.bufs]
        try:
            with torch.no_grad():
                for b, (pieces, blocks) in enumerate(zip(self.buckets, self.blocks)):
                    i = b % len(self.bufs)
                    for w in works[i]:  # the buffer's last sends are done with it
                        w.wait()
                    works[i] = []  # a gloo send's Work must be waited once: a second wait waits for another send
                    buf = self.bufs[i]
                    for p, blk in zip(pieces, blocks):
                        buf[p.offset:p.offset + p.numel].view(blk.shape).copy_(blk.src(param_of(blk.param)))
                    n = bucket_numel(pieces)
                    works[i] = [self.pg.send([_bytes(buf[:n])], e, b) for e in engines]
                    unsent = b + 1
                    nbytes += n * self.esize
                    if verify:  # the bytes just handed to the sends, while they run
                        h0 = time.perf_counter()
                        for p in pieces:
                            digests[p.block.key] = tensor_digest(p.block.key, buf[p.offset:p.offset + p.numel]
                                                                 .view(p.block.shape))
                        hash_s += time.perf_counter() - h0
                while works:
                    for w in works.pop():
                        w.wait()
        except BaseException:
            self._drain(engines, works, unsent)
            raise
        return {"digests": digests, "bytes": nbytes, "buckets": len(self.buckets), "hash_s": hash_s,
                "seconds": time.perf_counter() - t0}

    def _drain(self, engines: list[int], works: list[list], unsent: int) -> None:
        """After a failure mid-sync: finish the sends in flight and send the buckets from ``unsent`` on
        (whatever the buffer holds: the sync has failed), so that the engines' receives complete and
        nobody waits for the group's timeout; stops at the first transport error (a peer gone)."""
        try:
            for ws in works:
                for w in ws:
                    w.wait()
            for b in range(unsent, len(self.buckets)):
                wire = _bytes(self.bufs[0][:bucket_numel(self.buckets[b])])
                for w in [self.pg.send([wire], e, b) for e in engines]:
                    w.wait()
        except Exception:  # noqa: BLE001 (the original error is what the caller sees)
            pass


class Receiver:
    """An engine's side: every actor rank's buckets, placed into the engine's weights as they come."""

    def __init__(self, pg, plans: list[list], dtype: torch.dtype, bucket_bytes: int, device: torch.device):
        self.pg, self.dtype, self.device = pg, dtype, torch.device(device)
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.plans, self.bucket_bytes = plans, None
        self.rebucket(bucket_bytes)

    def rebucket(self, bucket_bytes: int) -> None:
        """Cut every rank's plan into buckets of ``bucket_bytes`` (as the senders do); size the buffers."""
        if bucket_bytes == self.bucket_bytes:
            return
        self.bucket_bytes = bucket_bytes
        self.buckets = [plan_buckets(p, self.esize, bucket_bytes) for p in self.plans]
        self.bufs = [[torch.empty(max((bucket_numel(b) for b in bk), default=0), dtype=self.dtype, device=self.device)
                      for _ in range(min(2, len(bk)))] for bk in self.buckets]

    def receive(self, views: dict[str, torch.Tensor], verify: bool) -> dict:
        """Receive and place every rank's buckets; returns ``{"digests": {key: (source rank, XXH3-128 of
        the block read back from the engine's weight)} (with verify), "bytes", "hash_s", "seconds"}``."""
        t0 = time.perf_counter()
        pending: dict[tuple[int, int], tuple] = {}

        def post(s: int, b: int) -> None:
            buf = self.bufs[s][b % len(self.bufs[s])][:bucket_numel(self.buckets[s][b])]
            pending[(s, b)] = (self.pg.recv([_bytes(buf)], s, b), buf)

        for s, bk in enumerate(self.buckets):
            for b in range(len(self.bufs[s])):
                post(s, b)
        order = [(s, b) for b in range(max((len(bk) for bk in self.buckets), default=0))
                 for s in range(len(self.buckets)) if b < len(self.buckets[s])]
        digests: dict = {}
        try:
            hash_s, nbytes = self._place(order, pending, post, views, verify, digests)
        except BaseException:
            self._drain(order, pending)
            raise
        return {"digests": digests, "bytes": nbytes, "hash_s": hash_s, "seconds": time.perf_counter() - t0}

    def _place(self, order: list, pending: dict, post, views: dict, verify: bool, digests: dict) -> tuple:
        """Wait for the buckets in ``order`` (taking each off it), place them, repost; returns (seconds
        spent hashing, bytes received)."""
        hash_s, nbytes = 0.0, 0
        with torch.no_grad():
            while order:
                s, b = order[0]
                work, buf = pending.pop((s, b))
                order.pop(0)
                work.wait()
                pieces = self.buckets[s][b]
                for p in pieces:
                    p.block.dst(views[p.block.hf_name]).copy_(buf[p.offset:p.offset + p.numel].view(p.block.shape))
                nbytes += buf.numel() * self.esize
                if after_place is not None:
                    after_place(s, pieces, views)
                if b + len(self.bufs[s]) < len(self.buckets[s]):  # the buffer is free again: the next one
                    post(s, b + len(self.bufs[s]))
                if verify:  # read back from the engine's own weights, while the next buckets arrive
                    h0 = time.perf_counter()
                    for p in pieces:
                        digests[p.block.key] = (s, tensor_digest(p.block.key, p.block.dst(views[p.block.hf_name])))
                    hash_s += time.perf_counter() - h0
        return hash_s, nbytes

    def _drain(self, order: list, pending: dict) -> None:
        """After a failure mid-sync: complete the receives posted and receive (and drop) every bucket
        still to come, so that the senders' sends complete and nobody waits for the group's timeout;
        stops at the first transport error (a peer gone)."""
        try:
            for work, _ in pending.values():
                work.wait()
            done = set(pending)
            for s, b in order:
                if (s, b) not in done:
                    buf = self.bufs[s][0][:bucket_numel(self.buckets[s][b])]
                    self.pg.recv([_bytes(buf)], s, b).wait()
        except Exception:  # noqa: BLE001 (the original error is what the caller sees)
            pass


def compare_digests(sent: list[dict], placed: list[dict]) -> None:
    """``sent[r]``: actor rank r's ``{key: digest}``; ``placed[e]``: engine e's ``{key: (rank, digest)}``.
    Raise ``WeightSyncError`` naming the first block (tensor, bounds, rank, engine) whose digest differs
    or that is missing."""
    want = {k: (r, d) for r, ds in enumerate(sent) for k, d in ds.items()}
    for e, got in enumerate(placed):
        for key, (r, d) in want.items():
            g = got.get(key)
            name = key.split("[", 1)[0]
            if g is None:
                raise WeightSyncError(f"weight sync (distributed group) failed: rollout engine {e} did not place "
                                      f"block {key} of tensor {name} that actor rank {r} sent")
            if g[1] != d:
                raise WeightSyncError(f"weight sync (distributed group) failed: rollout engine {e} holds block {key} "
                                      f"of tensor {name} (from actor rank {r}) with digest {g[1].hex()[:12]}... but "
                                      f"rank {r} sent {d.hex()[:12]}...; the engine would sample from corrupted "
                                      f"weights")
        extra = set(got) - set(want)
        if extra:
            raise WeightSyncError(f"weight sync (distributed group) failed: rollout engine {e} placed block(s) no "
                                  f"actor rank sent, e.g. {sorted(extra)[0]}")


# ---- the halves and the driver's link ---------------------------------------------------------------------
class GroupSender(Half):
    """An actor rank's half: its blocks, and its handle of every weight group it is in (one per rollout),
    by key ``ip:port``."""

    resident_ops = frozenset({"send"})

    def __init__(self, owner):
        super().__init__(owner)
        self.groups: dict[str, tuple] = {}  # key -> (store, process group, Sender); (store, None) while hosting

    def plan(self) -> list[tuple] | None:
        """This rank's blocks, (HF name, HF shape, rows, cols) each; None where the strategy cannot plan."""
        planned = reshard_plan(self.owner)
        if planned is None:
            return None
        self.blocks, self.params = planned
        return plan_of(self.blocks)

    def host(self) -> tuple[str, int] | None:
        """Rank 0: host a weight group's store on this node's IP, at a port the kernel picks; returns
        (ip, port), which also names the group. The other ranks: None."""
        if self.owner.rank != 0:
            return None
        import ray  # a Ray job only: trainer.sync imports without Ray (benchmarks/gpu_check.py)

        ip = ray.util.get_node_ip_address()
        store = host_store(ip)
        self.groups[f"{ip}:{store.port}"] = (store, None)
        return ip, store.port

    def join(self, host: str, port: int, world: int, dtype: str, bucket_bytes: int) -> bool:
        """Join weight group ``host:port`` as its rank ``owner.rank`` (the engines join beside; this blocks
        until all have), and bucket this rank's blocks (:meth:`plan` planned them) for sending in ``dtype``."""
        key = f"{host}:{port}"
        store = self.groups.pop(key, (None, None))[0]
        device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
        pg, store = join(host, port, self.owner.rank, world, device, store)
        self.groups[key] = (store, pg, Sender(pg, plan_of(self.blocks), self.blocks, getattr(torch, dtype),
                                              bucket_bytes, device))
        return True

    def send(self, key: str, engines: list[int], verify: bool, bucket_bytes: int) -> dict:
        """Send this rank's blocks to the engines (group ranks ``engines``) of weight group ``key``; with
        ``verify`` the digest of every block as sent (:meth:`Sender.send`)."""
        sender = self.groups[key][2]
        sender.rebucket(bucket_bytes)
        return sender.send(engines, self.params.__getitem__, verify)

    def close(self, key: str) -> None:
        """Leave weight group ``key`` (its rollout's shutdown)."""
        entry = self.groups.pop(key, None)
        if entry is not None and entry[1] is not None:
            try:
                entry[1].shutdown()
            except Exception:  # noqa: BLE001 (the engines may be gone already)
                pass


class GroupReceiver(Half):
    """An engine's half: its handle of the weight group (an engine is in one) and the receiving side."""

    pg = None
    receiver: Receiver | None = None

    def join(self, host: str, port: int, rank: int, world: int, plans: list, dtype: str, bucket_bytes: int) -> bool:
        """Join the weight group as its rank ``rank`` (blocks until every actor rank and engine has);
        ``plans``: every actor rank's blocks, which this engine will receive in buckets. False when
        this engine cannot place blocks into its weights (no ``hf_views``)."""
        engine = self.owner.engine
        views = engine.hf_views() if hasattr(engine, "hf_views") else {}
        device = next(iter(views.values())).device if views else torch.device("cpu")
        self.pg, _ = join(host, port, rank, world, device)
        if not views or not hasattr(engine, "weights_changed"):
            return False
        held = {str(v.dtype).removeprefix("torch.") for v in views.values()}
        if held != {dtype}:
            raise ValueError(f"the engine holds its weights in {sorted(held)}, but the sync sends {dtype}")
        self.receiver = Receiver(self.pg, plans, getattr(torch, dtype), bucket_bytes, device)
        return True

    def recv(self, verify: bool, bucket_bytes: int) -> dict:
        """Receive every actor rank's blocks into this engine's weights, then re-derive what the engine
        computes from them; with ``verify`` the digest of every block read back from the weights."""
        self.receiver.rebucket(bucket_bytes)
        res = self.receiver.receive(self.owner.engine.hf_views(), verify)
        self.owner.engine.weights_changed()
        return res

    def close(self, key: str = "") -> None:
        """Leave the weight group."""
        pg, self.pg, self.receiver = self.pg, None, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 (the actor ranks may be gone already)
                pass


class DistributedGroup(Link):
    """The driver's side: the group is formed at the first sync from an actor (actor rank 0 hosts its
    store; world = actor ranks, then engines), then every sync sends every rank's blocks to every engine."""

    name, label = "dist_group", "distributed_group"
    sender, receiver = GroupSender, GroupReceiver
    placements, weight_syncs, protocol = ("workers",), ("distributed_group",), "dist_group"

    def __init__(self, rollout):
        super().__init__(rollout)
        self.setup: tuple | None = None  # (actor group, the engines' group ranks or None, reason, group key)

    def ready(self, actor) -> bool:
        if self.setup is None or self.setup[0] is not actor.group:
            self.close()
            self.setup = (actor.group, *self._set_up(actor))
        self.reason = self.setup[2]
        return self.setup[1] is not None

    def _set_up(self, actor) -> tuple:
        """Form the weight group; every engine gets every rank's plan. Returns (the engines' group ranks or
        None, reason, key)."""
        r = self.rollout
        if r.group.in_process or actor.group.in_process:
            return None, "the distributed-group sync needs the engines in their own processes", None
        plans = actor.group.call("sync_send", [("dist_group", "plan")] * actor.size)
        if any(p is None for p in plans):
            return None, "the actor's strategy has no direct reshard plan", None
        host, port = next(h for h in actor.group.call("sync_send", [("dist_group", "host")] * actor.size)
                          if h is not None)
        key, world = f"{host}:{port}", actor.size + r.size
        senders = actor.group.async_call("sync_send", [("dist_group", "join", host, port, world,
                                                        r.engine_dtype, r.bucket_bytes)] * actor.size)
        receivers = r.recv_async("dist_group", "join", [
            (host, port, actor.size + i, world, plans, r.engine_dtype, r.bucket_bytes) for i in range(r.size)])
        try:  # together: the first failure raises at once (the others would wait in the join for it)
            ok = r._get(senders + receivers)
        except Exception:
            self._leave(actor.group, key)
            raise
        if not all(ok):
            self._leave(actor.group, key)
            return None, "a rollout engine cannot place blocks into its weights", None
        return list(range(actor.size, world)), "", key

    def sync(self, actor, verify: bool) -> dict[str, float]:
        """Every actor rank sends its blocks (bucketed, pipelined) to every engine through the group;
        every engine places them into its weights. With ``verify`` the engines' read-back digests of every
        block are compared with the senders' (:func:`compare_digests`); the first verified sync after
        set-up is also checked end to end (full checksums), outside its timing."""
        r, (_, engines, _, key) = self.rollout, self.setup
        t0 = time.perf_counter()
        sends = actor.group.async_call("sync_send", [("dist_group", "send", key, engines, verify,
                                                      r.bucket_bytes)] * actor.size)
        recvs = r.recv_async("dist_group", "recv", [(verify, r.bucket_bytes)] * r.size)
        try:  # together: the first failure on either side raises at once
            res = r._get(sends + recvs)
        except Exception:
            # a member failed mid-sync (it drained its part of the exchange, so its peers finish): let them
            # finish, leave this group and form a new one at the next sync
            import ray  # a Ray job only: trainer.sync imports without Ray (benchmarks/gpu_check.py)

            ray.wait(sends + recvs, num_returns=len(sends + recvs), timeout=TIMEOUT.total_seconds(),
                     fetch_local=False)
            self.close()
            raise
        sent, placed = res[:actor.size], res[actor.size:]
        if verify:
            compare_digests([s["digests"] for s in sent], [p["digests"] for p in placed])
        m = sync_metrics(t0, sum(s["bytes"] for s in sent), sum(s["buckets"] for s in sent), verify)
        m["sync/group"] = 1.0
        if verify:
            # the hashing's share: the slowest process's time in XXH3 (senders hash while their sends run)
            m["sync/verify_seconds"] = max(x["hash_s"] for x in sent + placed)
            self.check_once(actor, self.setup)
        return m

    def close(self) -> None:
        """Leave the weight group on every member (at shutdown, or before forming one for another actor)."""
        setup, self.setup = self.setup, None
        if setup is not None and setup[3] is not None:
            self._leave(setup[0], setup[3])

    def reset(self) -> None:
        self.close()

    def _leave(self, actor_group, key: str) -> None:
        for g, half in ((self.rollout.group, "sync_recv"), (actor_group, "sync_send")):
            try:
                g.call(half, [("dist_group", "close", key)] * g.size)
            except Exception:  # noqa: BLE001 (a group already shut down: nothing left to close)
                pass
