"""One ``Rollout`` protocol, three transports: engine workers, the hybrid engine, the HTTP fleet.

The loop sees only this interface::

    rollout.generate(prompts, params)      -> list[list[GenerationOutput]]   (n per prompt, prompt order)
    rollout.play(tasks, params, settings)  -> list[Trajectory]               (the multi-turn agent loop)
    with rollout.awake(): ...              # colocated engines give their memory back outside it
    rollout.sync_from(actor)               -> metrics                        (bucketed, checksum-verified)
    rollout.abort()                        # from another thread: the running generate returns early

Implementations, each owning its transport:

* :class:`EngineRollout`: one :class:`~trainer.workers.rollout_worker.RolloutWorker` per engine in its
  own Ray worker. On one node a sync goes through shared memory (trainer/workers/weight_shm.py): the
  engines hold their weights in one shared file, each actor rank writes only its own shards' blocks
  into it, and the engines check every block's digest. Otherwise it streams the actor's HF-named
  buckets through Ray's object store: actor rank 0 yields each bucket as an object reference, every engine reads that same stored
  object (one bucket in flight, the actor's stream at most two ahead), and the driver only passes
  references.
* :class:`HybridRollout` (verl's hybrid engine, ``actor_rollout_ref.hybrid_engine``): the engines live
  inside the actor ranks' processes (:class:`~trainer.workers.hybrid_worker.HybridWorker`); on one
  node the ranks write their shards straight into the engines' shared weights (the driver rings them
  on a doorbell, trainer/workers/doorbell.py, not a Ray call), else every rank loads its engine from
  the (gathered) HF-name iterator with a local copy.
* :class:`FleetRollout` (``rollout.mode=server``): HTTP engine servers behind the real
  ``sglang-router`` (:class:`trainer.rollout.fleet.Fleet`); the actor's stream goes through the
  driver to the fleet client, which drains the servers, pushes every bucket and checks every
  server's checksum before reopening them to traffic.

Verification. A streamed sync is checked against ``trainer.rollout.engine.checksum_named_tensors`` of
the actor's HF-named tensors cast to the engine dtype: :func:`check_checksums` is the one rule (every
actor replica streamed the same weights; every engine holds what its actor streamed) used by the
object-store and hybrid syncs and by ``verify``; the fleet client applies the same comparison per server
inside its drained push (a server must not serve before it is checked). A shared-memory sync compares
every piece the ranks wrote with what they sent, in cache, and its first sync after set-up also runs
``verify`` (both sides' full checksums).
"""

from __future__ import annotations

import asyncio
import os
import time
from contextlib import contextmanager
from typing import Iterator, Protocol

import torch

from trainer.rollout.engine import GenerationOutput, SamplingParams, WeightSyncError
from trainer.workers.doorbell import Doorbell, DoorbellError
from trainer.workers.group import WorkerGroup


def check_checksums(pairs: list[tuple[str, str]]) -> None:
    """``pairs[i]``: (the actor's checksum that engine i was loaded from, engine i's checksum).
    Every actor checksum must equal the first (replicas agree) and every engine's its actor's."""
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


def _sync_metrics(t0: float, nbytes: int, buckets: int) -> dict[str, float]:
    dt = time.perf_counter() - t0
    return {"sync/seconds": dt, "sync/bytes": float(nbytes), "sync/buckets": float(buckets),
            "sync/gbps": nbytes / max(dt, 1e-9) / 1e9, "sync/verified": 1.0}


def setup_shared_memory(actor, engines) -> tuple:
    """Set up a shared-memory sync (trainer/workers/weight_shm.py) from ``actor`` to the engines that
    ``engines`` (an ``_EngineCalls``) reaches: every engine's weights move into one shared file that
    every actor rank maps. Returns ``(layout, transport)``; the layout is None where it cannot run, and
    ``transport`` then says why."""
    from trainer.workers.weight_shm import create_buffer, plan_layout

    plans = actor.group.call("shm_plan")
    if any(p is None for p in plans):
        return None, "object_store (the actor's strategy has no direct reshard plan)"
    layouts = engines._call("shm_layout")
    if any(x is None for x in layouts):
        return None, "object_store (the rollout engine cannot hold its weights in shared memory)"
    if any(x != layouts[0] for x in layouts):
        return None, "object_store (the rollout engines lay their weights out differently)"
    layout = plan_layout(layouts[0], plans)
    try:
        path, token = create_buffer(layout.file_bytes)
    except OSError as e:
        return None, f"object_store (no room for the {layout.file_bytes >> 20} MiB weight-sync file in /dev/shm: {e})"
    try:
        # the actor ranks first: an engine that joins moves its weights into the file, so join only
        # where the writers can reach it
        ok = actor.group.call("shm_attach", [(path, token, layout)] * actor.size)
        if all(ok):
            ok = engines._call("shm_attach", [(path, token, layout)] * engines.size)
    finally:
        os.unlink(path)  # every process that joined keeps its mapping; nothing outlives them
    if not all(ok):
        return None, "object_store (the actor and the engines do not share a node's /dev/shm)"
    return layout, "shared_memory"


class Rollout(Protocol):
    def generate(self, prompts: list[list[int]], params: dict) -> list[list[GenerationOutput]]: ...

    def play(self, tasks: list[dict], params: dict, settings: dict) -> list: ...

    def awake(self): ...

    def sync_from(self, actor) -> dict[str, float]: ...

    def verify(self, actor, streamed: bool = False) -> None: ...

    def engine_checksums(self) -> list[str]: ...

    def pids(self) -> list[int]: ...

    def shutdown(self) -> None: ...


class _EngineCalls:
    """Generation over engines reached through a group: prompts in contiguous chunks, one per engine."""

    concurrent_calls = 1  # generate calls that may overlap (see EngineRollout)
    # shared-memory syncs when the actor and the engines share a node (weight_shm.py), the object-store
    # path otherwise; ``transport`` says which the last sync took, and why
    shared_memory = True
    transport = "object_store"
    _shm: tuple | None = None  # (actor group, Layout or None, reason)
    _proven: tuple | None = None  # the set-up (``_shm``, ``_wg``) whose first verified sync was checked end to end

    def _check_once(self, actor, setup: tuple) -> None:
        """The first verified sync through a new set-up (a shared file, a weight group) is also checked end
        to end, outside its timing: every engine's full checksum over its own views against the actor's.
        That proves what the per-piece or per-block checks take as given: the writers' views of the
        engines' weights and the engines' own agree."""
        if self._proven is not setup:
            self.verify(actor)
            self._proven = setup

    def _shared_layout(self, actor):
        """The shared-memory sync's layout for this actor (set up at its first sync), or None where it
        cannot run; sets ``transport``."""
        if not self.shared_memory:
            self.transport = "object_store (shared memory off)"
            return None
        if self._shm is None or self._shm[0] is not actor.group:
            self._shm = (actor.group, *setup_shared_memory(actor, self))
        self.transport = self._shm[2]
        return self._shm[1]

    def _shm_metrics(self, actor, t0: float, nbytes: int, verify: bool) -> dict[str, float]:
        """A shared-memory sync's metrics (and, the first verified time, :meth:`_check_once`)."""
        m = _sync_metrics(t0, nbytes, 1)
        m["sync/shared_memory"] = 1.0
        if not verify:
            m.pop("sync/verified")
        else:
            self._check_once(actor, self._shm)
        return m

    def _shm_buffer_bytes(self) -> int:
        """The shared-memory sync's file (the engines' weights, one copy for the node, instead of one
        per engine), 0 when not set up."""
        layout = self._shm[1] if self._shm is not None else None
        return layout.file_bytes if layout is not None else 0

    size: int
    free_cache: bool

    def _call(self, method: str, args_per_engine=None, **kw) -> list:
        return self._get(self._async(method, args_per_engine, **kw))

    def generate(self, prompts: list[list[int]], params: dict | list[dict]) -> list[list[GenerationOutput]]:
        k = self.size
        bounds = [i * len(prompts) // k for i in range(k + 1)]
        per = isinstance(params, list)  # one params dict per prompt (a resumed partial rollout)
        args = [(prompts[a:b], params[a:b] if per else params) for a, b in zip(bounds, bounds[1:])]
        return [per_prompt for per_engine in self._call("generate", args) for per_prompt in per_engine]

    def abort(self) -> None:
        """End every engine's running ``generate`` (from another driver thread): its unfinished
        responses return with ``finish_reason == "abort"`` (fully-async partial rollout)."""
        self._call("abort")

    def play(self, tasks: list[dict], params: dict, settings: dict) -> list:
        k = self.size
        bounds = [i * len(tasks) // k for i in range(k + 1)]
        res = self._call("generate_multi_turn", [(tasks[bounds[e]:bounds[e + 1]], params, settings) for e in range(k)])
        trajs = []
        for e, per_engine in enumerate(res):
            for t in per_engine:
                t.task_index += bounds[e]  # chunk-local -> batch-local
                trajs.append(t)
        return trajs

    @contextmanager
    def awake(self) -> Iterator[None]:
        """Colocated engines hold their KV cache only inside this block (``free_cache_engine``)."""
        if self.free_cache:
            self._call("wake")
        try:
            yield
        finally:
            if self.free_cache:
                self._call("sleep")

    def engine_checksums(self) -> list[str]:
        return self._call("weights_checksum")

    def load_bucket(self, buckets_per_engine: list) -> None:
        """Load ``(name, tensor)`` lists into the engines as they are, unverified (tests corrupt one)."""
        self._call("update_weights", [(b,) for b in buckets_per_engine])

    def pids(self) -> list[int]:
        return self._call("ping")


class EngineRollout(_EngineCalls):
    def __init__(self, group: WorkerGroup, *, free_cache: bool, bucket_bytes: int, engine_dtype: str,
                 shared_memory: bool = True, concurrent_calls: int = 1):
        self.group, self.size, self.free_cache = group, group.size, free_cache
        # generate calls that may run at once (the fully-async rollouter keeps this many in flight): the
        # native engine admits a second call into its running loop; the workers' Ray concurrency must
        # leave a thread for abort beside them
        self.concurrent_calls = concurrent_calls
        self.bucket_bytes, self.engine_dtype = int(bucket_bytes), engine_dtype
        self.shared_memory = shared_memory

    # ``actor_rollout_ref.rollout.weight_sync=distributed_group``: sync through a torch.distributed group of
    # the actor ranks and the engines (trainer/workers/weight_group.py) instead of the object store
    distributed_group = False
    _wg: tuple | None = None  # (actor group, the engines' group ranks or None, reason, group key)
    # SGLang engines: their own protocol, a broadcast of full tensors from actor rank 0 (weight_broadcast.py)
    broadcast = False
    _bc: tuple | None = None  # (actor group, group key)

    def _async(self, method, args=None, **kw):
        return self.group.async_call(method, args, **kw)

    def _get(self, refs):
        return self.group.get(refs)

    def _sync_shared_memory(self, actor, verify: bool) -> dict[str, float]:
        """Every actor rank writes its blocks into the engines' shared weights (checking each chunk in
        cache); then (Ray resolves the ranks' results first) every engine re-derives its packed weights."""
        t0 = time.perf_counter()
        writes = actor.group.async_call("shm_write", [(verify,)] * actor.size)
        nbytes = self._get(self._async("shm_load", [tuple(writes)] * self.size))[0]
        return self._shm_metrics(actor, t0, nbytes, verify)

    def sync_from(self, actor, verify: bool = True) -> dict[str, float]:
        if self._shared_layout(actor) is not None:
            return self._sync_shared_memory(actor, verify)
        if self.distributed_group and self.broadcast:
            return self._sync_broadcast(actor, verify)
        if self.distributed_group and self._weight_group(actor) is not None:
            return self._sync_group(actor, verify)
        t0 = time.perf_counter()
        # with verify, actor rank 0 hashes each bucket after handing it over (while the engines load it)
        streams = actor.weight_streams(self.bucket_bytes, self.engine_dtype if verify else None)
        nbytes, buckets, pending = 0, 0, []
        for items in zip(*streams):
            # items[0] is rank 0's bucket as an object ref (the other ranks yield None): the engines resolve
            # it from the object store; the driver never deserialises or re-sends the tensors
            nbytes += sum(self._get(pending))
            pending = self._async("update_weights", [(items[0],)] * self.size)
            buckets += 1
        nbytes += sum(self._get(pending))
        m = _sync_metrics(t0, nbytes // max(1, self.size), buckets)
        if verify:
            self.verify(actor, streamed=True)
        else:
            m.pop("sync/verified")
        return m

    def verify(self, actor, streamed: bool = False) -> None:
        """Raise ``WeightSyncError`` unless every engine holds exactly the actor's weights:
        against the checksum rank 0 took of the sync it just streamed, or recomputed."""
        got = self._async("weights_checksum")
        want = actor.stream_checksum() if streamed else actor.weights_checksum(self.engine_dtype)
        check_checksums([(want, g) for g in self._get(got)])

    def shutdown(self) -> None:
        self._close_group()
        self._close_broadcast()
        self.group.shutdown()

    # ---- SGLang's distributed weight update (trainer/workers/weight_broadcast.py) ----------------------
    def _setup_broadcast(self, actor) -> str:
        """Form the broadcast group: actor rank 0 hosts its store and is rank 0; each engine's TP ranks
        follow, in engine order. Returns the group's key (``ip:port``)."""
        if self.group.in_process or actor.group.in_process:
            raise ValueError("weight_sync=distributed_group needs the engines and the actor in their own processes")
        host, port, backend = next(h for h in actor.group.call("bc_host") if h is not None)
        key, name = f"{host}:{port}", f"coxswain_weights_{port}"
        ranks = self.group.call("bc_ranks")
        if not all(ranks):
            actor.group.call("bc_close", [(key,)] * actor.size)
            raise ValueError("weight_sync=distributed_group: a rollout engine takes no broadcast (SGLang engines do)")
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        world = 1 + sum(ranks)
        joins = actor.group.async_call("bc_join", [(key, world, name, backend)] * actor.size)
        joins += self._async("bc_join", [(host, port, off, world, name, backend) for off in offsets])
        self._bc = (actor.group, key)
        try:  # together: the members block in the join until all are in
            self._get(joins)
        except Exception:
            self._close_broadcast()
            raise
        return key

    def _sync_broadcast(self, actor, verify: bool) -> dict[str, float]:
        """Actor rank 0 broadcasts each flat bucket (gathered, cast, packed) to every SGLang engine,
        which receives it through ``update_weights_from_distributed``; rank 0 packs the next bucket
        meanwhile. With ``verify``: every engine's checksum of what it was given equals the actor's of
        what it streamed, and the probe rows read back from every engine (where its model class allows)
        equal what was sent; the first verified sync also against the actor's full checksum."""
        if self._bc is None or self._bc[0] is not actor.group:
            self._close_broadcast()
            self._setup_broadcast(actor)
        self.transport = "distributed_group"
        key = self._bc[1]
        t0 = time.perf_counter()
        streams = actor.group.streams("bc_send", key, self.bucket_bytes, self.engine_dtype, verify)
        nbytes = buckets = 0
        try:
            for items in zip(*streams):
                desc = actor.group.stream_get(items[0])  # rank 0's description (the others yield None)
                nbytes += self._get(self._async("bc_recv", [(desc,)] * self.size))[0]
                buckets += 1
        except Exception:
            self._close_broadcast()  # a new group at the next sync
            raise
        m = _sync_metrics(t0, nbytes, buckets)
        m["sync/group"] = 1.0
        if not verify:
            m.pop("sync/verified")
            return m
        self.verify(actor, streamed=True)
        for e, diffs in enumerate(self._get(self._async("bc_read_back"))):
            bad = {n: d for n, d in diffs.items() if d is not None and d != 0.0}
            if bad:
                raise WeightSyncError(f"weight sync (broadcast) failed: rollout engine {e} holds {sorted(bad)[0]} "
                                      f"with first rows differing from what actor rank 0 sent (max |diff| "
                                      f"{bad[sorted(bad)[0]]}); the engine would sample from corrupted weights")
        self._check_once(actor, self._bc)
        return m

    def _close_broadcast(self) -> None:
        bc, self._bc = self._bc, None
        if bc is None:
            return
        for g, args in ((self.group, None), (bc[0], [(bc[1],)] * bc[0].size)):
            try:
                g.call("bc_close", args)
            except Exception:  # noqa: BLE001 (a group already shut down: nothing left to close)
                pass

    # ---- weight sync through a torch.distributed group (trainer/workers/weight_group.py) ---------------
    def _weight_group(self, actor) -> list[int] | None:
        """The engines' ranks in the weight group with ``actor`` (set up at its first sync), or None
        where it cannot run; sets ``transport``."""
        if self._wg is None or self._wg[0] is not actor.group:
            self._close_group()
            self._wg = (actor.group, *self._setup_group(actor))
        self.transport = self._wg[2]
        return self._wg[1]

    def _setup_group(self, actor) -> tuple:
        """Form the weight group: actor rank 0 hosts its store, every actor rank and every engine join
        (world = actor ranks, then engines); every engine gets every rank's plan. Returns (the engines'
        group ranks or None, transport)."""
        if self.group.in_process or actor.group.in_process:
            return None, "object_store (the distributed-group sync needs the engines in their own processes)"
        plans = actor.group.call("shm_plan")
        if any(p is None for p in plans):
            return None, "object_store (the actor's strategy has no direct reshard plan)"
        host, port = next(h for h in actor.group.call("wg_host") if h is not None)
        world = actor.size + self.size
        senders = actor.group.async_call("wg_join", [(host, port, world, self.engine_dtype, self.bucket_bytes)]
                                         * actor.size)
        receivers = self._async("wg_join", [(host, port, actor.size + i, world, plans, self.engine_dtype,
                                             self.bucket_bytes) for i in range(self.size)])
        try:  # together: the first failure raises at once (the others would wait in the join for it)
            ok = self._get(senders + receivers)
        except Exception:
            self._close_group(actor.group, f"{host}:{port}")
            raise
        if not all(ok):
            self._close_group(actor.group, f"{host}:{port}")
            return None, "object_store (a rollout engine cannot place blocks into its weights)"
        return list(range(actor.size, world)), "distributed_group", f"{host}:{port}"

    def _sync_group(self, actor, verify: bool) -> dict[str, float]:
        """Every actor rank sends its blocks (bucketed, pipelined) to every engine through the group;
        every engine places them into its weights. With ``verify`` the engines' read-back digests of every
        block are compared with the senders' (``weight_group.compare_digests``); the first verified sync
        after set-up is also checked end to end (full checksums), outside its timing."""
        from trainer.workers.weight_group import compare_digests

        t0 = time.perf_counter()
        sends = actor.group.async_call("wg_send", [(self._wg[3], self._wg[1], verify, self.bucket_bytes)]
                                       * actor.size)
        recvs = self._async("wg_recv", [(verify, self.bucket_bytes)] * self.size)
        try:  # together: the first failure on either side raises at once
            res = self._get(sends + recvs)
        except Exception:
            # a member failed mid-sync (it drained its part of the exchange, so its peers finish): let them
            # finish, leave this group and form a new one at the next sync
            import ray

            from trainer.workers.weight_group import TIMEOUT

            ray.wait(sends + recvs, num_returns=len(sends + recvs), timeout=TIMEOUT.total_seconds(),
                     fetch_local=False)
            self._close_group()
            raise
        sent, placed = res[:actor.size], res[actor.size:]
        if verify:
            compare_digests([s["digests"] for s in sent], [p["digests"] for p in placed])
        m = _sync_metrics(t0, sum(s["bytes"] for s in sent), sum(s["buckets"] for s in sent))
        m["sync/group"] = 1.0
        if not verify:
            m.pop("sync/verified")
            return m
        # the hashing's share: the slowest process's time in XXH3 (senders hash while their sends run)
        m["sync/verify_seconds"] = max(r["hash_s"] for r in sent + placed)
        self._check_once(actor, self._wg)
        return m

    def _close_group(self, actor_group=None, key: str | None = None) -> None:
        """Leave the weight group on every member (at shutdown, or before forming one for another actor)."""
        if actor_group is None and self._wg is not None and len(self._wg) > 3:
            actor_group, key = self._wg[0], self._wg[3]
        self._wg = None
        if actor_group is None:
            return
        for g in (self.group, actor_group):
            try:
                g.call("wg_close", [(key,)] * g.size)
            except Exception:  # noqa: BLE001 (a group already shut down: nothing left to close)
                pass


class HybridRollout(_EngineCalls):
    """The engines inside the actor ranks' processes, reached through the actor's own group."""

    def __init__(self, actor, *, free_cache: bool, bucket_bytes: int, engine_dtype: str, shared_memory: bool = True):
        self.actor_group, self.size, self.free_cache = actor.group, actor.size, free_cache
        self.bucket_bytes, self.engine_dtype = int(bucket_bytes), engine_dtype
        self.shared_memory = shared_memory

    def _async(self, method, args=None, **kw):
        args = args or [()] * self.size
        return self.actor_group.async_call("engine", [(method, *a) for a in args], **kw)

    def _get(self, refs):
        return self.actor_group.get(refs)

    def sync_from(self, actor, verify: bool = True) -> dict[str, float]:
        """Every actor rank loads its own engine from the weight stream; checked per rank (stream
        == engine) and across ranks (every rank streamed the same weights). Through the engines' shared
        weights when the ranks can map them (one node): each rank writes only its own shards."""
        if actor.group is not self.actor_group:
            raise ValueError("a hybrid rollout syncs only from the actor group that hosts its engines")
        t0 = time.perf_counter()
        if self._shared_layout(actor) is not None:
            bell = self._doorbell()
            if bell is not None:
                try:
                    res = bell.call("sync_engine_shm", [(verify,)] * self.size)
                except DoorbellError:
                    self._bell = (self._shm, None)  # later syncs go through Ray
                    self.actor_group.call("ping")  # a lost worker or node raises here, named by the group
                    raise
            else:
                res = self.actor_group.call("sync_engine_shm", [(verify,)] * self.size)
            errors = [(i, r["error"]) for i, r in enumerate(res) if r["error"]]
            if errors:  # every rank compared what it wrote with what it sent
                raise WeightSyncError(f"rank {errors[0][0]}: {errors[0][1]}")
            m = self._shm_metrics(actor, t0, res[0]["bytes"], verify)
            m["sync/doorbell"] = float(bell is not None)
            return m
        res = self.actor_group.call("sync_engine", [(self.bucket_bytes, self.engine_dtype if verify else None)]
                                    * self.size)
        m = _sync_metrics(t0, res[0]["bytes"], res[0]["buckets"])
        if verify:
            check_checksums([(r["stream"], r["engine"]) for r in res])
        else:
            m.pop("sync/verified")
        return m

    _bell: tuple | None = None  # (the ``_shm`` set-up it serves, Doorbell or None)

    def _doorbell(self):
        """The doorbell to the actor ranks for shared-memory syncs (trainer/workers/doorbell.py), opened
        with each shared-memory set-up; None in-process or where the driver cannot reach them (another
        node): Ray calls then."""
        if self._bell is None or self._bell[0] is not self._shm:
            if self._bell is not None and self._bell[1] is not None:
                self._bell[1].close()
            bell = None
            if not self.actor_group.in_process:
                bell = Doorbell.connect(self.actor_group.call("doorbell_open"))
            self._bell = (self._shm, bell)
        return self._bell[1]

    def verify(self, actor, streamed: bool = False) -> None:
        if streamed and self.transport != "shared_memory":  # a shared-memory sync checked its blocks already
            check_checksums(list(zip(self.actor_group.call("stream_checksum"), self.engine_checksums())))
        else:
            check_checksums(self.actor_group.call("verify_engine", dtype=self.engine_dtype))

    def shutdown(self) -> None:  # the actor group owns the processes
        if self._bell is not None and self._bell[1] is not None:
            self._bell[1].close()
        self._bell = None


class FleetRollout:
    """HTTP engine servers behind ``sglang-router`` (disaggregated rollout, ``rollout.mode=server``).
    The router balances requests, so this is one "engine" to the loop: every prompt of a batch
    goes to the router at once (a server that dies mid-batch costs a retry on another, counted in
    ``fleet/retries``); the multi-turn agent loop runs on the driver, its turns sent through the
    router (``concurrency`` episodes in flight). The servers own their devices: nothing to free.
    ``hosts`` (a joined Ray cluster): Ray options per server, so each runs on its slot's node; a server
    whose node leaves the cluster is dropped and the others serve on (``fleet/dropped``).
    ``backend="sglang"`` (``rollout.name=sglang``): the servers are real ``sglang.launch_server`` processes on
    this host, the weights pushed through SGLang's own endpoints (:class:`~trainer.rollout.fleet.Fleet`)."""

    concurrent_calls = 1  # a server's batcher runs one engine call at a time
    size = 1

    def __init__(self, model_path: str, *, num_servers: int, threads_per_server: int, max_batch_size: int,
                 max_seq_len: int, dtype: str, tokenizer_path: str | None, log_dir: str, bucket_bytes: int = 512 << 20,
                 hosts: list[dict] | None = None, backend: str = "native", device: str = "cpu"):
        from trainer.rollout.fleet import Fleet

        self.tokenizer_path, self.tokenizer = tokenizer_path or model_path, None
        self.dtype, self.bucket_bytes = dtype, int(bucket_bytes)
        os.makedirs(log_dir, exist_ok=True)
        self.fleet = Fleet(model_path, num_servers=num_servers, threads_per_server=threads_per_server,
                           max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=dtype,
                           log_dir=log_dir, hosts=hosts, backend=backend, device=device,
                           # SGLang on CPU sizes its KV cache by tokens: room for every sequence of a full batch
                           max_total_tokens=max(4096, max_batch_size * max_seq_len)).start()
        self.client = self.fleet.client

    def generate(self, prompts: list[list[int]], params: dict | list[dict]) -> list[list[GenerationOutput]]:
        if isinstance(params, list):  # one params dict per prompt (a resumed partial rollout), seeds sent as they are
            return self.client.generate(prompts, [SamplingParams(**p) for p in params])
        return self.client.generate(prompts, SamplingParams(**params))

    def abort(self) -> None:
        """Abort every server's requests in flight (they return with ``finish_reason == "abort"``)."""
        self.client.abort()

    def play(self, tasks: list[dict], params: dict, settings: dict) -> list:
        from trainer.rollout.multi_turn import loop_kwargs, rollout_trajectories

        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        return asyncio.run(rollout_trajectories(
            self.client.agenerate, self.tokenizer, settings["environment"], tasks,
            SamplingParams(**{**params, "n": 1}), params["n"], **loop_kwargs(settings)))

    @contextmanager
    def awake(self) -> Iterator[None]:
        yield

    def sync_from(self, actor, verify: bool = True) -> dict[str, float]:
        """The actor's stream through the driver into the fleet client: drained servers, every
        bucket pushed to each, every server's checksum checked against the stream's."""
        t0 = time.perf_counter()
        streams = actor.weight_streams(self.bucket_bytes, None)
        nbytes = buckets = 0

        def named():
            nonlocal buckets, nbytes
            for items in zip(*streams):  # rank 0's bucket; the other ranks yield None
                buckets += 1
                for name, t in actor.stream_get(items[0]):
                    nbytes += t.numel() * t.element_size()
                    yield name, t

        self.client.update_weights(named(), dtype=getattr(torch, self.dtype))
        return _sync_metrics(t0, nbytes, buckets)

    def verify(self, actor, streamed: bool = False) -> None:
        want = actor.weights_checksum(self.dtype)
        check_checksums([(want, s) for s in self.engine_checksums()])

    def engine_checksums(self) -> list[str]:
        return list(self.client.checksums().values())

    def metrics(self) -> dict[str, float]:
        return self.fleet.stats.as_metrics()

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.fleet.servers]

    def shutdown(self) -> None:
        self.fleet.close()
