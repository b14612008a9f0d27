"""Worker groups: N workers of one class as Ray actors (one per rank) or as plain in-process objects.

Placement. On a GPU cluster each rank takes one GPU; on CPU each rank takes one CPU slot. ``colocated``
puts the actor, reference, critic and rollout workers of rank ``i`` into bundle ``i`` (they share the
device; the rollout engine sleeps while the actor trains), ``split`` gives the rollout engines bundles
of their own. Ray starts an embedded local cluster (``ray.init()`` with no address) unless
``RAY_ADDRESS`` names an existing one.

On one node the bundles are one placement group. On a cluster of ``trainer.nnodes`` > 1 nodes (verl's
layout) each node gets one ``STRICT_PACK`` group of ``n_gpus_per_node`` bundles, pinned to that node by
its ``ray.io/node-id`` label; rank ``i`` is bundle ``i % n_gpus_per_node`` of node ``i //
n_gpus_per_node``, the driver's node first when it has the slots. Megatron orders ranks TP-innermost,
so a TP group (whose size divides ``n_gpus_per_node``) never leaves its node, data parallelism spans
the nodes, and a colocated engine shares its actor rank's bundle, hence its node. torch.distributed's
rendezvous is on rank 0's node (its IP, a port free there). ``split`` engines get a group of their own.

Dead workers and lost nodes: every wait on a group's results watches the group. A Ray actor that dies
raises ``WorkerDiedError`` naming the group and the rank; when the reason is a node that left the
cluster (its raylet killed, the machine gone) the error names the node (IP and Ray node id) and the
ranks that were on it, within Ray's node-failure detection time (about 15 s by default) rather than a
hang of the surviving ranks in a collective.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

from trainer.orphans import start_reaper

# Torch tensors cross Ray without pickling (numpy-backed, zero copy) in the driver too; Ray reads the
# flag when it is first imported, so it is set at import time of this module.
os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")

# Start-up notices, summarised in one line (``startup_summary``) instead of a wall: megatron-core warns
# once per module that Apex / TransformerEngine are missing (every worker, ~20 lines on CPU), and Ray
# logs its token-authentication notice. Filtered in the driver (warnings filters, a logging filter) and
# in every Ray worker (PYTHONWARNINGS in the runtime env; literal message prefixes).
_QUIET_WARNINGS = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                   "full scope is deprecated",
                   # megatron's sequence-parallel layers: a CUDA launch hint, and torch's renamed collectives
                   "When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
                   "`torch.distributed.reduce_scatter_tensor` is deprecated",
                   "`torch.distributed.all_gather_into_tensor` is deprecated",
                   # megatron_bridge on gloo (CPU): said once by the driver's config notes, not once per worker
                   # (a prefix without its comma: PYTHONWARNINGS splits its filters at commas)
                   "distributed optimizer needs reduce-scatter")
# Ray's zero-copy tensors (turned on above, on purpose): Ray warns that they are safe only for tensors
# nobody writes, and its deserializer's torch.from_numpy over the read-only buffer makes torch warn the
# same. A batch shard is read and never written in place (trainer.batch copies read-only arrays unless
# told the tensor is only read), so both are noise. The torch warning is silenced only when raised from
# Ray's deserializer; Ray installs its own "once" filter at import, so these go in after it.
_ZERO_COPY_NOTE = "Zero-copy tensor serialization is enabled"
_READ_ONLY_NOTE = "The given NumPy array is not writable"
_RAY_TENSORS = "ray._private.tensor_serialization_utils"


def _quiet_warnings_env() -> str:
    own = ",".join([f"ignore:{m}" for m in _QUIET_WARNINGS] + [f"ignore:{_READ_ONLY_NOTE}::{_RAY_TENSORS}"])
    return ",".join(x for x in (os.environ.get("PYTHONWARNINGS", ""), own) if x)


class _RayTokenNotice:
    """A logging filter holding back Ray's token-authentication notice (its first sentence is kept)."""

    seen: str | None = None

    def filter(self, record) -> bool:
        msg = record.getMessage()
        if msg.startswith("Token authentication is"):
            _RayTokenNotice.seen = msg.split(". ")[0]
            return False
        return True


def quiet_ray_tensors() -> None:
    """Silence Ray's zero-copy notes (see ``_ZERO_COPY_NOTE``) in this process; called after Ray is imported,
    so that these filters come before the one Ray adds at its import."""
    import re
    import warnings

    import ray._private.tensor_serialization_utils  # noqa: F401 - its import adds Ray's filter, which ours must follow

    warnings.filterwarnings("ignore", message=re.escape(_ZERO_COPY_NOTE))
    warnings.filterwarnings("ignore", message=re.escape(_READ_ONLY_NOTE), module=re.escape(_RAY_TENSORS))


def _quiet_driver() -> None:
    import logging
    import re
    import warnings

    for m in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(m))
    lg = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _RayTokenNotice) for f in lg.filters):
        lg.addFilter(_RayTokenNotice())


def startup_summary() -> str:
    """The one line that replaces the start-up wall."""
    import importlib.util

    parts = []
    missing = [n for n, mod in (("Apex", "apex"), ("TransformerEngine", "transformer_engine"))
               if importlib.util.find_spec(mod) is None]
    if missing:
        parts.append(f"megatron-core without {' / '.join(missing)}: torch fallbacks for fused optimizer, norms and "
                     f"multi-tensor ops (expected on CPU)")
    if _RayTokenNotice.seen:
        seen = _RayTokenNotice.seen
        parts.append(f"Ray: {seen[0].lower() + seen[1:]}"
                     + (" (RAY_AUTH_MODE=disabled opts out)" if " enabled" in seen else ""))
    return "start-up: " + "; ".join(parts) if parts else ""


_quiet_driver()


class WorkerDiedError(RuntimeError):
    pass


def worker_setup() -> None:
    """Ray's ``worker_process_setup_hook``: runs in every worker process before its first task.

    Workers never log to wandb (the driver's tracker does), but ``import megatron.core`` imports wandb
    whenever it is installed (an optional import in its inference context). That costs each worker
    about 0.5 CPU-seconds at start-up and makes two temporary directories that only a normal
    interpreter exit removes; Ray ends its workers with a kill, so every worker left two empty
    ``tmp*wandb-media`` / ``tmp*wandb-artifacts`` directories in ``/tmp`` (about 500 per test-suite
    run here). Marking the module absent sends megatron's optional import down its ImportError path."""
    sys.modules.setdefault("wandb", None)
    quiet_ray_tensors()


# The embedded cluster this process started (its GCS address), and whether a run's end leaves it up for the
# next run in this process (:func:`keep_embedded_ray`): a notebook or a test module that trains several times
# then pays Ray's start and stop (about 5 s of a 10 s tiny run here) once.
_embedded_gcs: str | None = None
_embedded_faults: dict[str, str] = {}
_keep_embedded = False
FAULT_PREFIX = "COXSWAIN_FAULT_"  # fault injection for tests (a slow engine, a worker held mid-call)


def _fault_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FAULT_PREFIX)}


def keep_embedded_ray(keep: bool = True) -> None:
    """Leave the embedded Ray cluster up when a run ends (``keep``), for the next run in this process; whoever
    keeps it stops it (``ray.shutdown()``). A cluster joined through ``RAY_ADDRESS`` is never stopped by a run."""
    global _keep_embedded
    _keep_embedded = bool(keep)


def embedded_ray_kept() -> bool:
    return _keep_embedded


def embedded_ray() -> bool:
    """Whether this process is connected to an embedded cluster it started (not one joined, nor a user's own)."""
    import ray

    return (_embedded_gcs is not None and ray.is_initialized()
            and ray.get_runtime_context().gcs_address == _embedded_gcs)


def init_ray(num_cpus: int | None = None) -> bool:
    """Start (or join, with ``RAY_ADDRESS``) Ray; True when this call started an embedded cluster. A kept
    embedded cluster (:func:`keep_embedded_ray`) is used again, or restarted when it has fewer than
    ``num_cpus`` CPUs, or when this process's ``COXSWAIN_FAULT_*`` variables differ from those it started
    with (its workers inherit the environment of the cluster's start: a test's slow engine would otherwise
    reach only the runs of the test that started the cluster, and every later run in it)."""
    import ray

    global _embedded_gcs, _embedded_faults
    quiet_ray_tensors()
    if ray.is_initialized():
        if not embedded_ray():
            return False
        small = bool(num_cpus) and ray.cluster_resources().get("CPU", 0) < num_cpus
        if not small and _fault_env() == _embedded_faults:
            return False
        ray.shutdown()  # the kept cluster is too small for this run's slots, or has other faults: a new one
    env = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "PYTHONPATH": os.pathsep.join(
        [os.getcwd(), os.environ.get("PYTHONPATH", "")]), "PYTHONWARNINGS": _quiet_warnings_env()},
           "worker_process_setup_hook": "trainer.workers.group.worker_setup"}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=env, log_to_driver=True)
    else:
        start_reaper()  # the embedded cluster's daemons inherit the run's marker and end with this driver
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=env, log_to_driver=True,
                 configure_logging=True, logging_level="WARNING")
        _embedded_gcs = ray.get_runtime_context().gcs_address
        _embedded_faults = _fault_env()
        line = startup_summary()
        if line:
            print(line, flush=True)
        return True
    return False


def alive_nodes() -> list[dict]:
    """The cluster's live nodes, as ``ray.nodes()`` lists them."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def node_status(node_ids) -> dict[str, bool]:
    """Ray's view (the GCS's) of whether each node is alive."""
    import ray

    want = set(node_ids)
    return {n["NodeID"]: bool(n.get("Alive")) for n in ray.nodes() if n["NodeID"] in want}


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str

    def __str__(self) -> str:
        return f"{self.ip} (Ray node {self.node_id[:12]})"


class Placement:
    """The run's slots: ``n_bundles`` of ``{"CPU": 1}`` (``{"GPU": 1, "CPU": 1}`` on GPU);
    ``options(i, share)`` gives scheduling options for slot i, ``node_of(i)`` its :class:`Node`.

    On a cluster joined with ``RAY_ADDRESS`` (``joined``; or ``nnodes`` > 1): the first ``nnodes * per_node``
    slots are one ``STRICT_PACK`` placement group per node, each pinned to a distinct node (one node's
    ranks never straddle two nodes: their rendezvous is on loopback); the rest (split placement's engines
    or servers) one ``SPREAD`` group. Otherwise (an embedded cluster: one node) one ``PACK`` group holds
    every slot."""

    def __init__(self, n_bundles: int, use_gpu: bool, *, nnodes: int = 1, per_node: int | None = None,
                 joined: bool = False, timeout_s: float = 120.0):
        import ray
        from ray.util.placement_group import placement_group

        res = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        self.use_gpu, self.n, self.nnodes = use_gpu, n_bundles, max(1, nnodes)
        self.per_node = per_node or n_bundles
        if self.nnodes == 1 and not joined:
            self.pgs = [placement_group([dict(res) for _ in range(n_bundles)], strategy="PACK")]
            self._slot = [(0, i) for i in range(n_bundles)]
        else:
            world = self.nnodes * self.per_node
            if world > n_bundles:
                raise ValueError(f"{n_bundles} slots cannot hold {self.nnodes} nodes x {self.per_node}")
            chosen = self.pick_nodes(self.nnodes, self.per_node, use_gpu)
            self.pgs = [placement_group([dict(res) for _ in range(self.per_node)], strategy="STRICT_PACK",
                                        bundle_label_selector=[{"ray.io/node-id": n.node_id}] * self.per_node)
                        for n in chosen]
            self._slot = [(i // self.per_node, i % self.per_node) for i in range(world)]
            if n_bundles > world:  # split placement: the engines' own slots, spread over the nodes that have room
                self.pgs.append(placement_group([dict(res) for _ in range(n_bundles - world)], strategy="SPREAD"))
                self._slot += [(self.nnodes, j) for j in range(n_bundles - world)]
        try:
            ray.get([pg.ready() for pg in self.pgs], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.remove()
            raise RuntimeError(
                f"Ray could not place {n_bundles} slots of {res} within {timeout_s:.0f} s"
                + (f" ({self.nnodes} nodes x {self.per_node})" if self.nnodes > 1 else "")
                + f"; the cluster has {ray.cluster_resources()} ({ray.available_resources()} free). Lower "
                f"trainer.n_gpus_per_node / trainer.nnodes, use trainer.placement=colocated, or add nodes to the Ray "
                f"cluster.") from None
        from ray.util.placement_group import placement_group_table

        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        tables = [placement_group_table(pg)["bundles_to_node_id"] for pg in self.pgs]
        self.nodes = [Node(tables[g][b], ips.get(tables[g][b], "?")) for g, b in self._slot]

    @staticmethod
    def pick_nodes(nnodes: int, per_node: int, use_gpu: bool) -> list[Node]:
        """``nnodes`` live nodes with ``per_node`` devices each: the driver's node first (when it has
        them: rank 0 and the rendezvous sit next to the driver), then by IP. Fails at once, listing the
        cluster's nodes, when there are not enough (instead of waiting for a placement that cannot happen)."""
        import ray

        kind = "GPU" if use_gpu else "CPU"
        here = ray.get_runtime_context().get_node_id()
        nodes = alive_nodes()
        fit = [n for n in nodes if n["Resources"].get(kind, 0) >= per_node]
        fit.sort(key=lambda n: (n["NodeID"] != here, n["NodeManagerAddress"], n["NodeID"]))
        if len(fit) < nnodes:
            from trainer.config import ConfigError

            have = "; ".join(f"{n['NodeManagerAddress']} ({kind} {n['Resources'].get(kind, 0):g})" for n in nodes)
            raise ConfigError(
                f"trainer.nnodes={nnodes} x trainer.n_gpus_per_node={per_node} needs {nnodes} Ray nodes with {per_node} "
                f"{kind} each; the cluster has {len(fit)} such node(s) among {len(nodes)}: {have}. Start the missing "
                f"nodes (ray start --address=HEAD:PORT --num-{kind.lower()}s={per_node}) or lower trainer.nnodes.")
        return [Node(n["NodeID"], n["NodeManagerAddress"]) for n in fit[:nnodes]]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - a group on a lost node: Ray reclaims it
                pass

    def node_of(self, i: int) -> Node:
        return self.nodes[i % self.n]

    def rendezvous(self) -> tuple[str, int]:
        """torch.distributed's master address and port for ranks 0..: rank 0's node IP (loopback when
        every rank shares one node) and a port free on that node."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from megatron_bridge.launch import find_free_port

        node = self.node_of(0)
        if self.nnodes == 1 and node.node_id == ray.get_runtime_context().get_node_id():
            return "127.0.0.1", find_free_port()
        port = ray.get(ray.remote(find_free_port).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote())
        return ("127.0.0.1" if self.nnodes == 1 else node.ip), int(port)

    def options(self, i: int, share: float) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        g, b = self._slot[i % self.n]
        opts = {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pgs[g], placement_group_bundle_index=b),
                "num_cpus": share}
        if self.use_gpu:
            opts["num_gpus"] = share
        return opts


class WorkerGroup:
    """``call(method, *per_rank_args)`` runs a method on every rank and returns the list of results."""

    # how often a wait on the group checks Ray's view of the group's nodes, and how long a failure waits for
    # Ray to declare a silent node dead (its default detection: 5 missed health checks, 3 s apart)
    watch_interval_s: float = 2.0
    node_grace_s: float = 30.0

    def __init__(self, name: str, cls, kwargs_per_rank: Sequence[dict], *, in_process: bool = False,
                 placement: Placement | None = None, bundle_of=lambda i: i, share: float = 0.5,
                 max_concurrency: int = 2):
        self.name = name
        self.in_process = in_process
        self.size = len(kwargs_per_rank)
        self.placement = placement
        self.bundles = [bundle_of(i) for i in range(self.size)]
        if in_process:
            self.workers = [cls(**kw) for kw in kwargs_per_rank]
        else:
            import ray

            remote = ray.remote(cls)
            self.workers = []
            for i, kw in enumerate(kwargs_per_rank):
                opts = placement.options(self.bundles[i], share) if placement is not None else {"num_cpus": share}
                self.workers.append(remote.options(**opts, name=f"{name}-{i}-{os.getpid()}",
                                                   max_concurrency=max_concurrency).remote(**kw))

    def async_call(self, method: str, args_per_rank: Sequence[tuple] | None = None, *, num_returns: int = 1,
                   **kwargs) -> list:
        """Start ``method`` on every rank; Ray refs (or finished results in-process). With
        ``num_returns=k`` a method returning a k-tuple gives k refs per rank, so the caller can
        fetch one part and pass the others on by reference."""
        args_per_rank = args_per_rank or [()] * self.size
        if self.in_process:
            return [getattr(w, method)(*a, **kwargs) for w, a in zip(self.workers, args_per_rank)]
        return [getattr(w, method).options(num_returns=num_returns).remote(*a, **kwargs) if num_returns != 1
                else getattr(w, method).remote(*a, **kwargs) for w, a in zip(self.workers, args_per_rank)]

    # ---- where the ranks are, and what is lost -----------------------------------------------------------
    def node_of(self, rank: int) -> Node | None:
        """The node rank ``rank``'s bundle was placed on (None without a placement)."""
        return self.placement.node_of(self.bundles[rank]) if self.placement is not None else None

    def where(self) -> list[str]:
        """Each rank's Ray node id, as the worker itself reports it."""
        if self.in_process:
            return [""] * self.size
        import ray

        return ray.get([w.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id())
                        for w in self.workers])

    def _lost_nodes(self) -> dict[Node, list[int]]:
        """The group's nodes that Ray has declared dead, with the ranks that were on them."""
        nodes = {r: self.node_of(r) for r in range(self.size)}
        alive = node_status({n.node_id for n in nodes.values() if n is not None})
        lost: dict[Node, list[int]] = {}
        for r, n in nodes.items():
            if n is not None and alive.get(n.node_id) is False:
                lost.setdefault(n, []).append(r)
        return lost

    def _unreachable(self, timeout_s: float = 5.0) -> list[int]:
        """Ranks whose actor Ray reports dead or unavailable (a busy rank is not counted)."""
        import ray

        refs = [w.__ray_call__.remote(lambda _self: 0) for w in self.workers]
        out = []
        for r, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=timeout_s)
            except ray.exceptions.RayActorError:
                out.append(r)
            except ray.exceptions.GetTimeoutError:
                pass
        return out

    def _node_lost_error(self, lost: dict[Node, list[int]], cause: str) -> WorkerDiedError:
        what = "; ".join(f"node {n} left the Ray cluster with rank(s) {', '.join(map(str, rs))} of group '{self.name}'"
                         for n, rs in lost.items())
        return WorkerDiedError(
            f"{what} ({cause}). The run stops; it can resume (trainer.resume_mode=auto) once the cluster again has "
            f"trainer.nnodes nodes with trainer.n_gpus_per_node slots each.")

    def _diagnose(self, e: BaseException) -> BaseException:
        """A failure of a wait on this group, named: a lost node (waiting up to ``node_grace_s`` for Ray to
        declare a rank's silent node dead), a dead worker, or the error itself."""
        import ray

        actor_died = isinstance(e, ray.exceptions.RayActorError)
        cause = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if self.placement is not None:
            lost = self._lost_nodes()
            gone = [] if lost else self._unreachable()
            if gone and not lost:  # ranks that do not answer: is their node gone? Ray decides within its detection time
                deadline = time.monotonic() + self.node_grace_s
                while not lost and time.monotonic() < deadline:
                    time.sleep(1.0)
                    lost = self._lost_nodes()
            if lost:
                return self._node_lost_error(lost, cause)
            if gone:
                where = "; ".join(f"rank {r} on node {self.node_of(r)}" for r in gone)
                return WorkerDiedError(f"worker(s) of group '{self.name}' died ({where}; {cause}). Check their log "
                                       f"above for the cause (out of memory, a crash in megatron or the engine).")
        if actor_died:
            return WorkerDiedError(
                f"a worker of group '{self.name}' died ({type(e).__name__}). Check its log above for the cause "
                f"(out of memory, a crash in megatron or the engine).")
        return e

    def _wait(self, refs: list) -> list:
        """``ray.get(refs)``, except that the first failure among them raises at once (not after the other
        ranks, which may wait for the failed one in a collective forever), and that a node of the group
        which Ray declares dead stops the wait."""
        import ray

        out: dict = {}
        pending = list(dict.fromkeys(refs))  # ray.wait takes each ref once
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=self.watch_interval_s,
                                      fetch_local=False)
            if ready:  # one call for what is done (an error among them raises here)
                out.update(zip(ready, ray.get(ready)))
            if pending and not ready and self.placement is not None and self.placement.nnodes > 1:
                lost = self._lost_nodes()
                if lost:
                    raise self._node_lost_error(lost, "Ray declared the node dead")
        return [out[r] for r in refs]

    def get(self, refs: list) -> list:
        if self.in_process:
            return refs
        try:
            return self._wait(refs)
        except WorkerDiedError:
            raise
        except Exception as e:  # noqa: BLE001 - named when it is a lost worker or node, re-raised otherwise
            err = self._diagnose(e)
            if err is e:
                raise
            raise err from e

    def call(self, method: str, args_per_rank: Sequence[tuple] | None = None, **kwargs) -> list:
        return self.get(self.async_call(method, args_per_rank, **kwargs))

    def streams(self, method: str, *args, backpressure: int = 2) -> list:
        """Start a generator method on every rank: a list of iterators (Ray streaming generators,
        with at most ``backpressure`` unconsumed items each, so memory stays bounded)."""
        if self.in_process:
            return [getattr(w, method)(*args) for w in self.workers]
        return [getattr(w, method).options(num_returns="streaming", _generator_backpressure_num_objects=backpressure)
                .remote(*args) for w in self.workers]

    def stream_get(self, item) -> Any:
        if self.in_process:
            return item
        return self.get([item])[0]

    def shutdown(self) -> None:
        if not self.in_process:
            import ray

            for w in self.workers:
                try:
                    ray.kill(w)
                except Exception:  # noqa: BLE001 - an actor on a lost node is gone already
                    pass
        self.workers = []
