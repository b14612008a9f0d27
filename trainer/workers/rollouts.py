"""One ``Rollout`` protocol over three placements of the engines: engine workers, the hybrid engine, the HTTP fleet.

The loop sees only this interface::

    rollout.generate(prompts, params)      -> list[list[GenerationOutput]]   (n per prompt, prompt order)
    rollout.play(tasks, params, settings)  -> list[Trajectory]               (the multi-turn agent loop)
    with rollout.awake(): ...              # colocated engines give their memory back outside it
    rollout.sync_from(actor)               -> metrics                        (bucketed, verified)
    rollout.abort()                        # from another thread: the running generate returns early

Implementations:

* :class:`EngineRollout`: one :class:`~trainer.workers.rollout_worker.RolloutWorker` per engine in its
  own Ray worker;
* :class:`HybridRollout` (verl's hybrid engine, ``actor_rollout_ref.hybrid_engine``): the engines live
  inside the actor ranks' processes (:class:`~trainer.workers.hybrid_worker.HybridWorker`);
* :class:`FleetRollout` (``rollout.mode=server``): HTTP engine servers behind the real
  ``sglang-router`` (:class:`trainer.rollout.fleet.Fleet`).

How the weights move is not decided here: each rollout is built with the weight transports it tries, in
order (``trainer.sync.choose``: from what the engine declares, where it runs and ``rollout.weight_sync``),
and each sync takes the first that can run for the actor (:mod:`trainer.sync`: shared memory, object
store, distributed group, SGLang broadcast, hybrid copy, HTTP push; each verifies its own syncs).
``transport`` says which the last sync took, and why a preferred one could not.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import contextmanager
from typing import Iterator, Protocol

from trainer.rollout.engine import GenerationOutput, SamplingParams, WeightSyncError
from trainer.rollout.fleet import Fleet
from trainer.rollout.multi_turn import loop_kwargs, rollout_trajectories
from trainer.sync import TRANSPORTS
from trainer.sync.base import Link, check_checksums
from trainer.sync.hybrid_copy import verify_hybrid
from trainer.workers.group import WorkerGroup

__all__ = ["EngineRollout", "FleetRollout", "HybridRollout", "Rollout", "check_checksums"]


class Rollout(Protocol):
    def generate(self, prompts: list[list[int]], params: dict) -> list[list[GenerationOutput]]: ...

    def play(self, tasks: list[dict], params: dict, settings: dict) -> list: ...

    def awake(self): ...

    def sync_from(self, actor) -> dict[str, float]: ...

    def verify(self, actor, streamed: bool = False) -> None: ...

    def engine_checksums(self) -> list[str]: ...

    def pids(self) -> list[int]: ...

    def metrics(self) -> dict[str, float]: ...

    def shutdown(self) -> None: ...


class _EngineCalls:
    """Generation over engines reached through a group (prompts in contiguous chunks, one per engine), and
    the weight syncs through the rollout's transports (``transports``: names of :data:`trainer.sync.TRANSPORTS`,
    tried in order; ``transport``: the one the last sync took, and why a preferred one could not)."""

    concurrent_calls = 1  # generate calls that may overlap (see EngineRollout)
    adapters = False  # the syncs move LoRA adapters, which the engines merge (trainer.rollout.adapters)
    _base_checked = False
    in_actor = False  # the engines live in the actor ranks' processes (the hybrid engine)
    transport = "object_store"
    size: int
    free_cache: bool
    bucket_bytes: int
    engine_dtype: str
    links: list[Link]

    def _call(self, method: str, args_per_engine=None, **kw) -> list:
        return self._get(self._async(method, args_per_engine, **kw))

    # ---- weight sync ---------------------------------------------------------------------------------
    def use(self, *transports: str) -> None:
        """Sync through ``transports`` from now on, the first that can run for an actor at each sync (the
        choice is made at construction; tests and benchmarks switch here). A transport used before keeps
        its set-up; all are closed at shutdown."""
        made = self.__dict__.setdefault("_made", {})
        for t in transports:
            if t not in made:
                made[t] = TRANSPORTS[t](self)
        self.transports = tuple(transports)
        self.links = [made[t] for t in self.transports]

    def link(self, name: str) -> Link:
        return next(x for x in self.links if x.name == name)

    @property
    def shared_memory(self) -> bool:
        return "shared_memory" in self.transports

    @property
    def distributed_group(self) -> bool:
        return "dist_group" in self.transports or "broadcast" in self.transports

    def sync_from(self, actor, verify: bool = True) -> dict[str, float]:
        declined = []
        for link in self.links:
            if link.ready(actor):
                self.transport = link.label + (f" ({declined[0]})" if declined else "")
                m = link.sync(actor, verify)
                if verify and self.adapters and not self._base_checked:
                    self.check_base(actor)
                return m
            declined.append(link.reason)
        raise WeightSyncError(f"no weight transport of {self.transports} can run here: {'; '.join(declined)}")

    def check_base(self, actor) -> None:
        """Adapter-only syncs (``adapters``): once, that every engine merges the adapters over the actor's own base
        weights (the syncs verify the adapters; this, what they are added to)."""
        want = actor.base_checksum(self.engine_dtype)
        bad = [i for i, got in enumerate(self._call("base_checksum")) if got != want]
        if bad:
            raise WeightSyncError(f"weight sync failed: rollout engine(s) {bad} merge the LoRA adapters over base "
                                  f"weights that differ from the actor's (checksum {want[:12]}...): the engines "
                                  f"loaded another checkpoint than actor_rollout_ref.model.path")
        self._base_checked = True

    def recv_async(self, transport: str, op: str, args_per_engine: list[tuple]) -> list:
        """Start ``op`` of every engine's receiver half of ``transport`` (``args_per_engine``: one tuple each)."""
        return self._async("sync_recv", [(transport, op, *a) for a in args_per_engine])

    def recv_call(self, transport: str, op: str, *args) -> list:
        """``op(*args)`` on every engine's receiver half of ``transport``; the results in engine order."""
        return self._get(self.recv_async(transport, op, [args] * self.size))

    def close_links(self) -> None:
        for link in self._made.values():
            link.close()

    # ---- generation ----------------------------------------------------------------------------------
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

    def metrics(self) -> dict[str, float]:
        """Running counters of the rollout (an HTTP fleet's retries, restarts, drops); engine workers have none."""
        return {}

    def pids(self) -> list[int]:
        return self._call("ping")


class EngineRollout(_EngineCalls):
    def __init__(self, group: WorkerGroup, *, free_cache: bool, bucket_bytes: int, engine_dtype: str,
                 transports: tuple[str, ...] = ("shared_memory", "object_store"), concurrent_calls: int = 1,
                 adapters: bool = False):
        self.group, self.size, self.free_cache, self.adapters = group, group.size, free_cache, adapters
        # generate calls that may run at once (the fully-async rollouter keeps this many in flight): the
        # native engine admits a second call into its running loop; the workers' Ray concurrency must
        # leave a thread for abort beside them
        self.concurrent_calls = concurrent_calls
        self.bucket_bytes, self.engine_dtype = int(bucket_bytes), engine_dtype
        self.use(*transports)

    def _async(self, method, args=None, **kw):
        return self.group.async_call(method, args, **kw)

    def _get(self, refs):
        return self.group.get(refs)

    def verify(self, actor, streamed: bool = False) -> None:
        """Raise ``WeightSyncError`` unless every engine holds exactly the actor's weights:
        against the checksum rank 0 took of the sync it just streamed, or recomputed."""
        got = self._async("weights_checksum")
        want = actor.stream_checksum() if streamed else actor.weights_checksum(self.engine_dtype)
        check_checksums([(want, g) for g in self._get(got)])

    def shutdown(self) -> None:
        self.close_links()
        self.group.shutdown()


class HybridRollout(_EngineCalls):
    """The engines inside the actor ranks' processes, reached through the actor's own group: every actor
    rank loads its own engine (through the engines' shared weights when the ranks can map them, else a
    local copy from the gathered stream)."""

    in_actor = True

    def __init__(self, actor, *, free_cache: bool, bucket_bytes: int, engine_dtype: str,
                 transports: tuple[str, ...] = ("shared_memory", "hybrid"), adapters: bool = False):
        self.actor_group, self.size, self.free_cache, self.adapters = actor.group, actor.size, free_cache, adapters
        self.bucket_bytes, self.engine_dtype = int(bucket_bytes), engine_dtype
        self.use(*transports)

    def _async(self, method, args=None, **kw):
        args = args or [()] * self.size
        return self.actor_group.async_call("engine", [(method, *a) for a in args], **kw)

    def _get(self, refs):
        return self.actor_group.get(refs)

    def sync_from(self, actor, verify: bool = True) -> dict[str, float]:
        if actor.group is not self.actor_group:
            raise ValueError("a hybrid rollout syncs only from the actor group that hosts its engines")
        return super().sync_from(actor, verify)

    def verify(self, actor, streamed: bool = False) -> None:
        # a shared-memory sync checked its blocks already: its end-to-end check recomputes
        verify_hybrid(self, actor, streamed and self.transport != "shared_memory")

    def shutdown(self) -> None:  # the actor group owns the processes
        self.close_links()


class FleetRollout:
    """HTTP engine servers behind ``sglang-router`` (disaggregated rollout, ``rollout.mode=server``).
    The router balances requests, so this is one "engine" to the loop: every prompt of a batch
    goes to the router at once (a server that dies mid-batch costs a retry on another, counted in
    ``fleet/retries``); the multi-turn agent loop runs on the driver, its turns sent through the
    router (``concurrency`` episodes in flight). The servers own their devices: nothing to free.
    ``hosts`` (a joined Ray cluster): Ray options per server, so each runs on its slot's node; a server
    whose node leaves the cluster is dropped and the others serve on (``fleet/dropped``).
    ``backend="sglang"`` (``rollout.name=sglang``): the servers are real ``sglang.launch_server`` processes on
    this host, the weights pushed through SGLang's own endpoints (:class:`~trainer.rollout.fleet.Fleet`).
    A sync goes through ``transports`` (the HTTP push: trainer/sync/http_push.py)."""

    concurrent_calls = 1  # a server's batcher runs one engine call at a time
    size = 1

    def __init__(self, model_path: str, *, num_servers: int, threads_per_server: int, max_batch_size: int,
                 max_seq_len: int, dtype: str, tokenizer_path: str | None, log_dir: str, bucket_bytes: int = 512 << 20,
                 hosts: list[dict] | None = None, backend: str = "native", device: str = "cpu",
                 transports: tuple[str, ...] = ("http_push",), routed_experts: bool = False):
        self.tokenizer_path, self.tokenizer = tokenizer_path or model_path, None
        self.dtype, self.bucket_bytes = dtype, int(bucket_bytes)
        self.engine_dtype = dtype
        os.makedirs(log_dir, exist_ok=True)
        self.fleet = Fleet(model_path, num_servers=num_servers, threads_per_server=threads_per_server,
                           max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=dtype,
                           log_dir=log_dir, hosts=hosts, backend=backend, device=device, routed_experts=routed_experts,
                           # SGLang on CPU sizes its KV cache by tokens: room for every sequence of a full batch
                           max_total_tokens=max(4096, max_batch_size * max_seq_len)).start()
        self.client = self.fleet.client
        self.transports = tuple(transports)
        self.links = [TRANSPORTS[t](self) for t in self.transports]  # the push: nothing to set up or close
        self.transport = self.links[0].label

    def generate(self, prompts: list[list[int]], params: dict | list[dict]) -> list[list[GenerationOutput]]:
        if isinstance(params, list):  # one params dict per prompt (a resumed partial rollout), seeds sent as they are
            return self.client.generate(prompts, [SamplingParams(**p) for p in params])
        return self.client.generate(prompts, SamplingParams(**params))

    def abort(self) -> None:
        """Abort every server's requests in flight (they return with ``finish_reason == "abort"``)."""
        self.client.abort()

    def play(self, tasks: list[dict], params: dict, settings: dict) -> list:
        if self.tokenizer is None:
            from transformers import AutoTokenizer  # heavy: only the multi-turn loop on the driver needs it

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        return asyncio.run(rollout_trajectories(
            self.client.agenerate, self.tokenizer, settings["environment"], tasks,
            SamplingParams(**{**params, "n": 1}), params["n"], **loop_kwargs(settings)))

    @contextmanager
    def awake(self) -> Iterator[None]:
        yield

    def sync_from(self, actor, verify: bool = True) -> dict[str, float]:
        """The actor's stream through the fleet client's drained push, every server's checksum checked
        against the stream's inside it (verified whatever ``verify`` says: a server must not serve
        unchecked weights)."""
        return self.links[0].sync(actor, verify)

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
