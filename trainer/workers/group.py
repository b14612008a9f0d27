"""Worker groups: N workers of one class as Ray actors (one per rank) or as plain in-process objects.

Placement. On a GPU cluster each rank takes one GPU; on CPU each rank takes one CPU slot. ``colocated``
puts the actor, reference, critic and rollout workers of rank ``i`` into bundle ``i`` of one
placement group (they share the device; the rollout engine sleeps while the actor trains), ``split``
gives the rollout fleet bundles of its own. Ray starts an embedded local cluster (``ray.init()`` with
no address) unless ``RAY_ADDRESS`` names an existing one.

Dead workers: a Ray actor that dies raises ``WorkerDiedError`` naming the group, the rank and what
to check, instead of Ray's generic traceback.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

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
                   "`torch.distributed.all_gather_into_tensor` is deprecated")


def _quiet_warnings_env() -> str:
    own = ",".join(f"ignore:{m}" for m in _QUIET_WARNINGS)
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


def init_ray(num_cpus: int | None = None) -> bool:
    """Start (or join, with ``RAY_ADDRESS``) Ray; True when this call started an embedded cluster."""
    import ray

    if ray.is_initialized():
        return False
    env = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "PYTHONPATH": os.pathsep.join(
        [os.getcwd(), os.environ.get("PYTHONPATH", "")]), "PYTHONWARNINGS": _quiet_warnings_env()}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=env, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=env, log_to_driver=True,
                 configure_logging=True, logging_level="WARNING")
        line = startup_summary()
        if line:
            print(line, flush=True)
        return True
    return False


class Placement:
    """One placement group with ``n_bundles`` slots; ``bundle(i)`` gives scheduling options for slot i."""

    def __init__(self, n_bundles: int, use_gpu: bool):
        import ray
        from ray.util.placement_group import placement_group

        res = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        self.pg = placement_group([dict(res) for _ in range(n_bundles)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"Ray could not place {n_bundles} slots of {res} within 120 s; the cluster has "
                f"{ray.cluster_resources()} ({ray.available_resources()} free). Lower trainer.n_gpus_per_node / "
                f"trainer.nnodes, use trainer.placement=colocated, or add nodes to the Ray cluster.") from None
        self.use_gpu = use_gpu
        self.n = n_bundles

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)

    def options(self, i: int, share: float) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts = {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i % self.n),
                "num_cpus": share}
        if self.use_gpu:
            opts["num_gpus"] = share
        return opts


class WorkerGroup:
    """``call(method, *per_rank_args)`` runs a method on every rank and returns the list of results."""

    def __init__(self, name: str, cls, kwargs_per_rank: Sequence[dict], *, in_process: bool = False,
                 placement: Placement | None = None, bundle_of=lambda i: i, share: float = 0.5):
        self.name = name
        self.in_process = in_process
        self.size = len(kwargs_per_rank)
        if in_process:
            self.workers = [cls(**kw) for kw in kwargs_per_rank]
        else:
            import ray

            remote = ray.remote(cls)
            self.workers = []
            for i, kw in enumerate(kwargs_per_rank):
                opts = placement.options(bundle_of(i), share) if placement is not None else {"num_cpus": share}
                self.workers.append(remote.options(**opts, name=f"{name}-{i}-{os.getpid()}",
                                                   max_concurrency=2).remote(**kw))

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

    def get(self, refs: list) -> list:
        if self.in_process:
            return refs
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(
                f"a worker of group '{self.name}' died ({type(e).__name__}). Check its log above for the cause "
                f"(out of memory, a crash in megatron or the engine).") from e

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
        import ray

        return ray.get(item)

    def shutdown(self) -> None:
        if not self.in_process:
            import ray

            for w in self.workers:
                ray.kill(w)
        self.workers = []
