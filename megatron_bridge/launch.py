"""Start torch.distributed + megatron parallel state, in Ray actors, local processes or tests.

Two entry points:

* :func:`init_distributed` — called once per rank (a Ray actor, a torchrun process, a spawned
  test worker) with an explicit rank, world size and master address. It picks gloo on CPU and
  nccl on GPU, installs the CPU shims when CUDA is absent, and initialises megatron's
  tensor/pipeline/data-parallel groups. :func:`set_parallel` re-initialises only the megatron groups,
  so one process group can host several TP/PP layouts in turn (tests and checkpoint resharding).
* :func:`spawn` — runs ``fn(*args)`` on ``world_size`` fresh local processes (spawn start method,
  a free TCP port each call), each with torch.distributed already up, and returns the per-rank
  results in rank order. A failure on any rank raises in the caller with that rank's traceback and
  stops the other ranks (they would otherwise wait forever in a collective).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as _queue
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_bridge import cpu_shims
from trainer.net import free_port


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (``trainer.net.free_port``)."""
    return free_port()


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    backend: str | None = None,
    seed: int = 1234,
    local_rank: int | None = None,
    timeout_minutes: int = 30,
) -> None:
    """Initialise the default process group and megatron's parallel state for this rank."""
    cpu_shims.install()
    backend = backend or default_backend()
    if torch.cuda.is_available():
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    set_parallel(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, seed=seed)


def set_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, vpp: int = 1, cp: int = 1, ep: int = 1,
                 etp: int | None = None) -> None:
    """(Re)build megatron's model-parallel groups; data parallel = world / (tp * pp * cp). ``vpp`` > 1:
    each pipeline rank holds ``vpp`` model chunks (megatron's interleaved 1F1B schedule); ``cp`` > 1:
    each sequence is split over ``cp`` ranks (:mod:`megatron_bridge.context_parallel`); ``ep`` / ``etp``:
    mixture-of-experts layers split their experts over ``ep`` ranks and each expert over ``etp``
    (default: ``tp``) ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if vpp > 1 and pp < 2:
        raise ValueError(f"virtual pipeline stages (vpp={vpp}) interleave a pipeline: they need pp >= 2 (got pp={pp})")
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                 context_parallel_size=cp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        # No CUDA RNG to fork: the inference tracker hands out the default generator (dropout is off).
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(seed)


def shutdown() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# local multi-process launcher


def _worker(rank, world_size, port, fn, args, kwargs, results, threads):
    torch.set_num_threads(threads)
    try:
        init_distributed(rank, world_size, "127.0.0.1", port)
        out = fn(*args, **kwargs)
        # by value: through the queue torch would share tensor storages as file descriptors, which
        # the parent can only fetch while this process lives (a rank that exited first made the
        # parent's get fail with FileNotFoundError, seen under load in CI)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - the parent re-raises with this traceback
        results.put((rank, False, traceback.format_exc()))
        return
    try:
        shutdown()
    except Exception:  # noqa: BLE001 - the result is already delivered
        pass


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    timeout_s: float = 600.0,
    threads_per_rank: int | None = None,
    **kwargs,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks; return the results by rank.

    ``fn`` must be importable by name (module level) and its result picklable. Each rank starts
    with torch.distributed initialised and megatron at TP=PP=1; call :func:`set_parallel` inside
    ``fn`` to switch layouts.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs, results, threads), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    error = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size and error is None:
            try:
                rank, ok, val = results.get(timeout=1.0)
            except _queue.Empty:
                if time.monotonic() > deadline:
                    error = f"timed out after {timeout_s:.0f}s with ranks {sorted(out)} done"
                elif any(p.exitcode not in (None, 0) for p in procs):
                    dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    error = f"rank(s) died without a result: {dead}"
                continue
            if ok:
                out[rank] = pickle.loads(val)
            else:
                error = f"rank {rank} failed:\n{val}"
    finally:
        for p in procs:
            p.join(timeout=30 if error is None else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    if error is not None:
        raise RuntimeError(error)
    return [out[r] for r in range(world_size)]


def data_parallel_group():
    """This rank's data-parallel process group (megatron's; callers outside the bridge never import megatron)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def parallel_layout() -> dict:
    """This rank's place in megatron's mesh: data/tensor/pipeline ranks and the data-parallel size
    (so callers outside the bridge never import megatron)."""
    from megatron.core import parallel_state as ps

    return {"dp_rank": ps.get_data_parallel_rank(), "dp_size": ps.get_data_parallel_world_size(),
            "tp_rank": ps.get_tensor_model_parallel_rank(), "tp_size": ps.get_tensor_model_parallel_world_size(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(), "pp_size": ps.get_pipeline_model_parallel_world_size(),
            "vpp_size": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
            "cp_rank": ps.get_context_parallel_rank(), "cp_size": ps.get_context_parallel_world_size(),
            "ep_rank": ps.get_expert_model_parallel_rank(), "ep_size": ps.get_expert_model_parallel_world_size()}
