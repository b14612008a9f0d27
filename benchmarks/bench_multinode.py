"""The driver's per-step cost on a cluster of 1, 2 and 3 Ray nodes: what grows with the node count?

A real Ray cluster of three nodes on this machine (``tests/support/ray_nodes.py``: separate raylets, 2 CPU slots
each, distinct IPs); the driver on the head node. For k = 1, 2, 3 nodes the run's ranks are laid out as a
real run lays them out (``trainer.workers.group.Placement``: one ``STRICT_PACK`` placement group per node,
``2 k`` ranks, DP = ``2 k``), and one training step's driver work is done for a FIXED batch:

* ``gen in``: the rollout's outputs coming to the driver (it scores them): ``2 k`` engines (``NullEngine``)
  each return their share of the batch's ``GenerationOutput`` lists (token ids and log-probs as Python
  lists, as the native engine returns them);
* ``data plane``: the product's step (``data_plane_step``: ``StepData`` shards put once,
  old / reference log-probs by reference, rollout IS and GRPO advantages on the driver, the update's
  fields scattered), through the real role groups (``ActorGroup``, ``RefGroup``) and their watched waits;
* ``watch``: one liveness check of the cluster's nodes (``ray.nodes()``), what a wait on a group runs every
  2 s while it waits.

Workers do no model compute (``NullWorker``), so what is timed is the driver. Per step: driver MB (arrays
out + in, ``dataplane/*``), the pickled MB of the generation outputs, driver CPU seconds
(``time.process_time()``, all threads, the driver's own math excluded) and wall seconds, and the Ray calls
the driver submits. The baseline is the same step on 1 node in the same run.

    python benchmarks/bench_multinode.py [--quick] [--json PATH] [--repeats N]

The last line is the headline: driver CPU per step at 3 nodes / at 1 node.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pickle
import time

import numpy as np  # noqa: E402

from _common import ROOT, load_average, machine, summary, table, write_json  # noqa: E402
from bench_dataplane import MATH_CPU, NullWorker, driver_math, make_batch, own_width  # noqa: E402


class NullRank(NullWorker):
    """A rank with the full mesh and the update's reply shape (partial metrics) of today's workers."""

    def layout(self) -> dict:
        return {"rank": self.rank, "dp_rank": self.rank, "dp_size": self.dp, "tp_rank": 0, "tp_size": 1, "pp_rank": 0,
                "pp_size": 1, "cp_rank": 0, "cp_size": 1}

    def update_actor(self, shard, mini_batches, *extras, settings, counts, **_):
        assert all(e is None or all(v.shape[0] == shard["responses"].shape[0] for v in e.values()) for e in extras)
        return {"metrics": [{"actor/pg_loss": ("mean", 0.0, 1.0)}] * len(mini_batches), "log_probs": None,
                "entropy": None}


def data_plane_step(actor, ref, transport, batch, settings) -> int:
    """One step's driver work through the product's data plane, as ``trainer/main.py`` runs it (off-policy
    path: old and reference log-probs by reference, the old ones fetched for rollout IS, the loss fields
    scattered). Returns the bytes through the driver."""
    from trainer.step import loss_fields
    from trainer.plan import ForwardSettings
    from trainer.workers.dataplane import StepData

    transport.take_metrics()
    data = StepData(batch, transport)
    fwd = ForwardSettings(micro_batch_size=8)
    old, _ = actor.log_probs_with_entropy(data, fwd)
    ref_lp = ref.log_probs(data, fwd)
    batch.old_log_probs = old.fetch()["old_log_probs"]  # rollout IS reads them on the driver
    driver_math(batch)

    class _P:  # loss_fields reads whether rejection sampling and bypass mode are on
        rejection = bypass = None

    actor.update(data, settings, [old, ref_lp, data.scatter(actor.dp, loss_fields(batch, _P))], seed=1)
    m = transport.take_metrics()
    return int(m["dataplane/driver_bytes_out"] + m["dataplane/driver_bytes_in"])


def _ray_nodes_module():
    spec = importlib.util.spec_from_file_location("coxswain_ray_nodes", os.path.join(ROOT, "tests", "support", "ray_nodes.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class NullEngine:
    """A rollout engine that returns fixed-length generations (no model): the driver's receiving cost."""

    def __init__(self, lengths: list[int]):
        self.lengths = lengths

    def generate(self, start: int, stop: int, n: int):
        from trainer.rollout.engine import GenerationOutput

        g = np.random.default_rng(start)
        return [[GenerationOutput(g.integers(2, 30000, L).tolist(), (-g.random(L)).tolist(), "stop")
                 for L in self.lengths[i * n:(i + 1) * n]] for i in range(start, stop)]


def step_cost(k: int, per_node: int, batch, n: int, repeats: int) -> dict:
    import ray

    from trainer.plan import PolicyLoss, UpdateSettings
    from trainer.workers.dataplane import Transport
    from trainer.workers.group import Placement, WorkerGroup
    from trainer.workers.roles import ActorGroup, RefGroup

    ranks = k * per_node
    placement = Placement(ranks, use_gpu=False, nnodes=k, per_node=per_node)
    transport = Transport(in_process=False)
    groups = {name: WorkerGroup(name, NullRank, [dict(rank=i, dp=ranks) for i in range(ranks)],
                                placement=placement, share=0.25) for name in ("actor", "ref")}
    lengths = batch.response_length.tolist()
    prompts = batch.num_samples // n
    engines = WorkerGroup("rollout", NullEngine, [dict(lengths=lengths)] * ranks, placement=placement, share=0.25)
    actor, ref = ActorGroup(groups["actor"], transport), RefGroup(groups["ref"], transport)
    T = batch.response_width
    pl = PolicyLoss(loss_mode="vanilla", agg_mode="token-mean", norm_constant=float(T), clip_ratio=0.2,
                    clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, entropy_coeff=0.0, use_kl_loss=True,
                    kl_loss_coef=0.001, kl_loss_type="low_var_kl")
    settings = UpdateSettings(mini_batch_size=batch.num_samples // 4, epochs=1, shuffle=False, micro_batch_size=8,
                              policy=pl)
    nodes = {placement.node_of(i).node_id for i in range(ranks)}
    assert len(nodes) == k, (k, nodes)
    out = {"gen_cpu": [], "gen_wall": [], "gen_mb": 0.0, "dp_cpu": [], "dp_wall": [], "dp_mb": 0.0, "watch_ms": [],
           "calls": 0}
    bounds = [i * prompts // ranks for i in range(ranks + 1)]
    counter = {"n": 0}  # tasks the driver submits: every group call starts one per rank
    real_async = WorkerGroup.async_call

    def counting(self, *a, **kw):
        counter["n"] += self.size
        return real_async(self, *a, **kw)

    WorkerGroup.async_call = counting
    try:
        for rep in range(repeats + 1):  # the first is a warm-up (worker imports, first transfers)
            c0, w0 = time.process_time(), time.perf_counter()
            gen = engines.call("generate", [(bounds[e], bounds[e + 1], n) for e in range(ranks)])
            gen_cpu, gen_wall = time.process_time() - c0, time.perf_counter() - w0
            counter["n"] = 0
            b = own_width(batch.clone())
            c0, w0 = time.process_time(), time.perf_counter()
            nbytes = data_plane_step(actor, ref, transport, b, settings)
            dp_cpu, dp_wall = time.process_time() - c0 - MATH_CPU[-1], time.perf_counter() - w0
            t0 = time.perf_counter()
            ray.nodes()
            watch = (time.perf_counter() - t0) * 1e3
            if rep == 0:
                out["gen_mb"] = len(pickle.dumps(gen, protocol=5)) / 1e6
                out["dp_mb"] = nbytes / 1e6
                out["calls"] = counter["n"] + ranks  # the data plane's tasks + one generate per engine
                continue
            for key, v in (("gen_cpu", gen_cpu), ("gen_wall", gen_wall), ("dp_cpu", dp_cpu), ("dp_wall", dp_wall),
                           ("watch_ms", watch)):
                out[key].append(v)
    finally:
        WorkerGroup.async_call = real_async
        for g in (*groups.values(), engines):
            g.shutdown()
        placement.remove()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="144 x (256 + 768) tokens, 2 repeats")
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    B, P, T = (144, 256, 768) if args.quick else (576, 512, 2048)  # B / 4 mini-batches divides over 2, 4, 6 ranks
    n, per_node = 8, 2
    repeats = args.repeats or (2 if args.quick else 3)
    rn = _ray_nodes_module()
    cluster = rn.RayNodes(workers=2, cpus=per_node).start()
    try:
        os.environ.update({k: v for k, v in cluster.env().items() if k.startswith("RAY_")})
        import ray

        from trainer.workers.group import init_ray

        init_ray()
        batch = make_batch(B, P, T)
        tokens = int(batch.num_tokens.sum())  # prompt + response tokens: what the data plane ships
        resp_tokens = int(batch.response_length.sum())  # what the engines return
        print(f"machine: {machine(f'3 Ray nodes on this machine ({per_node} CPU slots each), driver on the head')}")
        print(f"step: {B} sequences ({B // n} prompts x {n}), {P} + {T} tokens max, {tokens} tokens "
              f"({resp_tokens} response); "
              f"GRPO + KL loss + token TIS, 4 mini-batches; NullWorker ranks (no model compute)\n")
        res = {k: step_cost(k, per_node, batch, n, repeats) for k in (1, 2, 3)}
        rows = []
        for k, r in res.items():
            rows.append([f"{k} node{'s' if k > 1 else ''}", k * per_node, r["calls"], r["gen_mb"],
                         summary(r["gen_cpu"])["best"], r["dp_mb"], summary(r["dp_cpu"])["best"],
                         summary(r["dp_wall"])["best"], summary(r["watch_ms"])["best"]])
        print(table(["cluster", "ranks", "Ray tasks", "gen in MB", "gen in CPU s", "data plane MB",
                     "data plane CPU s", "wall s", "watch ms"], rows))
        per_tok = {"gen_bytes": res[1]["gen_mb"] * 1e6 / resp_tokens, "dp_bytes": res[1]["dp_mb"] * 1e6 / tokens,
                   "gen_cpu_s": summary(res[1]["gen_cpu"])["best"] / resp_tokens,
                   "dp_cpu_s": summary(res[1]["dp_cpu"])["best"] / tokens,
                   "task_cpu_s": (summary(res[3]["dp_cpu"])["best"] - summary(res[1]["dp_cpu"])["best"])
                   / max(1, res[3]["calls"] - res[1]["calls"])}
        print(f"\n1 node: generation outputs in {per_tok['gen_bytes']:.1f} B and {per_tok['gen_cpu_s'] * 1e9:.0f} ns CPU per "
              f"response token; data plane {per_tok['dp_bytes']:.1f} B and {per_tok['dp_cpu_s'] * 1e9:.0f} ns CPU per token; "
              f"each extra Ray task (1 -> 3 nodes) {per_tok['task_cpu_s'] * 1e3:.2f} ms driver CPU")
        cpu = {k: summary(r["gen_cpu"])["best"] + summary(r["dp_cpu"])["best"] for k, r in res.items()}
        ratio = cpu[3] / cpu[1]
        write_json(args.json, {"machine": machine(), "B": B, "P": P, "T": T, "tokens": tokens,
                               "response_tokens": resp_tokens, "per_node": per_node,
                               "results": {str(k): v for k, v in res.items()}, "per_token": per_tok,
                               "driver_cpu": {str(k): v for k, v in cpu.items()}, "ratio_3_over_1": ratio,
                               "load_average_end": load_average()})
        ray.shutdown()
    except BaseException:
        import traceback

        traceback.print_exc()  # before the cluster goes: Ray ends this process soon after its GCS is gone
        import ray

        ray.shutdown()
        raise
    finally:
        cluster.stop()
    print(f"headline: driver CPU per step (generation outputs in + data plane), 3 nodes / 1 node (baseline) = "
          f"{ratio:.2f}x")


if __name__ == "__main__":
    main()
