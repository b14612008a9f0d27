"""The step's independent forward passes in order versus at the same time (``trainer.parallel_phases``).

What is measured: the wall seconds of the three passes a PPO step with a critic and a KL loss makes
before its advantages (the actor's old log-probs, the reference log-probs, the critic's values) on
one batch, through the loop's own role groups on a real local Ray cluster (megatron-core ranks,
gloo), called by :func:`trainer.pipeline.run_concurrently` one after the other (the baseline:
verl's order) and at the same time. The best of ``--reps`` after one warm-up each, at two layouts:
DP=1 and DP=2, each rank with the loop's CPU share (cores / DP threads), so every pass alone already
fills the machine: what concurrency can win here is the driver's and Ray's per-call overhead and
the idle cores of small kernels, not a second device.

Model: a random Qwen2 (hidden 256, 4 layers, vocab 4096); 128 responses, prompts of 12-24 and
responses of 24-64 tokens. ``--quick``: 2 layers, 64 responses, 2 reps.

    python benchmarks/bench_pipeline.py [--quick] [--json PATH] [--reps 3]

Baseline: the passes in order. Headline (last line): in-order time / concurrent time at DP=1.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from _common import machine, table, write_json  # noqa: E402
from bench_strategies import batch, make_model  # noqa: E402


def measure(model: str, dp: int, n: int, reps: int) -> dict:
    from _common import ROOT
    from trainer.config import load_config
    from trainer.step import run_concurrently
    from trainer.plan import Plan
    from trainer.workers.cluster import Cluster
    from trainer.workers.dataplane import StepData

    cfg = load_config(["--config", os.path.join(ROOT, "recipes", "cpu", "tiny_grpo.yaml"),
        "--config", os.path.join(ROOT, "recipes", "cpu", "fp32.yaml"),  # the figures are fp32
        f"actor_rollout_ref.model.path={model}", f"trainer.n_gpus_per_node={dp}",
                       "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
                       "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
                       "critic.ppo_micro_batch_size_per_gpu=32", "trainer.logger=[console]"])
    plan = Plan.from_config(cfg, total_steps=1, stop_token_ids=[0])
    cluster = Cluster(cfg, 1)
    try:
        data = StepData(batch(n), cluster.transport)
        for g in (cluster.actor, cluster.ref, cluster.critic):
            data.shards(g.dp)
        from trainer.step import _ready

        jobs = {"old_log_prob": lambda: cluster.actor.log_probs_with_entropy(data, plan.actor_log_prob),
                "ref": lambda: cluster.ref.log_probs(data, plan.ref_log_prob),
                "values": lambda: _ready(cluster.critic.values(data, plan.critic_values))}
        out = {}
        for mode, parallel in (("in order", False), ("concurrent", True)):
            walls, parts = [], []
            for _ in range(reps + 1):  # the first is a warm-up
                m = {}
                import time

                t0 = time.perf_counter()
                run_concurrently(jobs, m, parallel=parallel)
                walls.append(time.perf_counter() - t0)
                parts.append(m)
            best = min(range(1, reps + 1), key=lambda i: walls[i])
            out[mode] = {"wall_s": walls[best], **{k.split("/")[1]: v for k, v in parts[best].items()}}
        return out
    finally:
        cluster.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    import ray

    n, reps = (64, 2) if a.quick else (128, a.reps)
    res = {}
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "m")
        make_model(src, a.quick)
        for dp in (1, 2):
            res[f"dp{dp}"] = measure(src, dp, n, reps)
            if ray.is_initialized():
                ray.shutdown()
    rows = []
    for lay, r in res.items():
        base = r["in order"]["wall_s"]
        for mode, x in r.items():
            rows.append([f"{lay} {mode}", x["wall_s"], base / x["wall_s"], x["old_log_prob"], x["ref"], x["values"]])
    print("machine:", machine(f"{n} responses, each rank cores/DP threads (the loop's own CPU share)"))
    print(table(["layout / mode", "wall s", "speed-up", "old log-prob s", "ref s", "values s"], rows))
    head = res["dp1"]["in order"]["wall_s"] / res["dp1"]["concurrent"]["wall_s"]
    head2 = res["dp2"]["in order"]["wall_s"] / res["dp2"]["concurrent"]["wall_s"]
    write_json(a.json, {"machine": machine(), "n": n, "results": res, "headline": head, "dp2": head2})
    print(f"headline: the three forward passes at the same time are {head:.2f}x faster than in order at DP=1 "
          f"({head2:.2f}x at DP=2, where each pass already uses both cores)")


if __name__ == "__main__":
    main()
