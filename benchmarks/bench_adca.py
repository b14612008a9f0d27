"""ADCA-GRPO against outcome-only GRPO on Towers: what the step judge changes in what is learned.

The task, model and budget are the recipe's (``recipes/cpu/tiny_agent_adca.yaml`` on ``tiny_grpo.yaml``:
``bash recipes/cpu/run_tiny_agent_adca.sh``): Tower of Hanoi from any position (2-3 discs, one move per turn,
``trainer.envs.towers``), the shipped tiny agent (``recipes/cpu/tiny_towers_model``, its greedy move a
habit that makes no progress), 16 tasks x 8 episodes per step. Arms, each over the same seeds
(``trainer.seed`` = ``data.seed`` = the seed):

  * ``grpo``: outcome-only GRPO (``attribution_driven_credit_assignment.enable=false``): the baseline;
  * ``adca-decouple`` / ``adca-allocation``: ADCA-GRPO (Zhai et al. 2025, arXiv:2511.10395) with that
    ``prm_scheme``, the environment's rule judge (GOOD = the move lowered the distance to the goal) served
    over HTTP and asked about every trajectory (``skip_type=none``).

Reported per arm (mean and sample standard deviation over seeds): held-out greedy success (positions never
trained on, ``val-core``) at the start and the end; the first step whose held-out success reaches
``--threshold`` (evaluated every ``--val-every`` steps; a run that never reaches it counts as not reached
and is left out of the mean, the count is shown) and the samples drawn until then; the last step's
training success (sampled); the judge's cost (calls and seconds, summed over the run) and the run's wall
time. Headline: the mean final held-out success of ADCA-decouple over GRPO's.

    python benchmarks/bench_adca.py [--quick] [--json PATH] [--seeds 0,1,2] [--steps 30] [--val-every 5]
                                    [--arms grpo,adca-decouple,adca-allocation] [--threshold 0.5]

``--quick``: one seed, 2 steps of 4 tasks, 16 held-out tasks, GRPO and ADCA-decouple only (what
tests/test_bench_adca.py runs: it checks the benchmark's path and report, not a learning figure).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import ray
from _common import ROOT, machine, table, write_json

from trainer import cpu_bf16
from trainer.config import load_config
from trainer.generation import val_core_acc
from trainer.main import train
from trainer.workers.group import keep_embedded_ray

ARMS = {
    "grpo": ["attribution_driven_credit_assignment.enable=false"],
    "adca-decouple": ["attribution_driven_credit_assignment.adca_grpo.prm_scheme=decouple"],
    "adca-allocation": ["attribution_driven_credit_assignment.adca_grpo.prm_scheme=allocation"],
}
RECIPE = [os.path.join(ROOT, "recipes", "cpu", "tiny_grpo.yaml"), os.path.join(ROOT, "recipes", "cpu", "tiny_agent_adca.yaml")]


def run_one(arm: str, seed: int, steps: int, val_every: int, run_dir: str, extra: list[str]) -> dict:
    cfg = load_config([a for path in RECIPE for a in ("--config", path)] + ARMS[arm] + [
        f"trainer.seed={seed}", f"data.seed={seed}", f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={val_every}", "trainer.val_before_train=true", "trainer.logger=[console]",
        "trainer.save_freq=-1", "trainer.resume_mode=disable", f"trainer.default_local_dir={run_dir}",
        f"trainer.experiment_name=bench_adca_{arm}_{seed}", *extra])
    t0 = time.perf_counter()
    hist = train(cfg)["history"]
    wall = time.perf_counter() - t0
    val = {h["step"]: val_core_acc(h) for h in hist if val_core_acc(h) is not None}
    per_step = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    trained = [h for h in hist if h["step"] >= 1 and "reward/acc" in h]
    return {"arm": arm, "seed": seed, "held_out": val, "train_success": [h["reward/acc"] for h in trained],
            "samples_per_step": per_step, "judge_calls": sum(h.get("adca/judge_calls", 0.0) for h in trained),
            "judge_s": sum(h.get("adca/judge_wall_s", 0.0) for h in trained),
            "good_fraction": [h.get("adca/good_fraction") for h in trained],
            "fallback_fraction": [h.get("adca/judge_fallback_fraction") for h in trained],
            "prm_abs_mean": [h.get("adca/prm_abs_mean") for h in trained], "wall_s": wall}


def first_reaching(held_out: dict[int, float], threshold: float) -> int | None:
    return next((s for s in sorted(held_out) if held_out[s] >= threshold), None)


def mean_sd(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(runs: list[dict], threshold: float) -> dict:
    first = [first_reaching(r["held_out"], threshold) for r in runs]
    reached = [s for s in first if s is not None]
    out = {"n": len(runs), "reached": len(reached)}
    for name, xs in (("held_out_start", [r["held_out"][min(r["held_out"])] for r in runs]),
                     ("held_out_final", [r["held_out"][max(r["held_out"])] for r in runs]),
                     ("steps_to_threshold", [float(s) for s in reached]),
                     ("samples_to_threshold", [float(s * r["samples_per_step"]) for s, r in zip(first, runs) if s is not None]),
                     ("train_success_final", [r["train_success"][-1] for r in runs]),
                     ("judge_calls", [r["judge_calls"] for r in runs]), ("judge_s", [r["judge_s"] for r in runs]),
                     ("wall_s", [r["wall_s"] for r in runs])):
        out[name] = mean_sd(xs)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--val-every", type=int, default=5)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--set", action="append", default=[], help="an extra key=value for every run")
    a = ap.parse_args(argv)
    if a.quick:  # the smallest setting: one seed, two steps of 4 tasks, the baseline and one ADCA arm
        a.seeds, a.steps, a.val_every, a.arms = "0", 2, 2, "grpo,adca-decouple"
        a.set = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.val_max_samples=16",
                 *a.set]
    arms, seeds = a.arms.split(","), [int(s) for s in a.seeds.split(",")]
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; choose from {sorted(ARMS)}")
    # the arms differ in credit, not kernels: on a CPU without bf16 instructions the bf16 products take the fp32
    # path a GPU takes (trainer/cpu_bf16.py; 2.4x faster for --quick on an AVX2 EPYC), unless COXSWAIN_CPU_BF16 says
    kernels = "fp32-accumulate bf16 kernels" if cpu_bf16.enable_where_slow() else "torch's bf16 kernels"
    print(f"machine: {machine()}; {kernels}")
    runs: list[dict] = []
    keep_embedded_ray(True)  # one Ray cluster for every run of the benchmark
    with tempfile.TemporaryDirectory(prefix="bench_adca_") as tmp:
        for seed in seeds:  # seeds outermost: a cut-short benchmark still compares the arms on the same seeds
            for arm in arms:
                runs.append(run_one(arm, seed, a.steps, a.val_every, os.path.join(tmp, f"{arm}_{seed}"), a.set))
                r = runs[-1]
                print(f"{arm} seed {seed}: held-out {r['held_out']}, {r['wall_s']:.0f} s", flush=True)
    keep_embedded_ray(False)
    ray.shutdown()
    stats = {arm: summarize([r for r in runs if r["arm"] == arm], a.threshold) for arm in arms}

    def cell(pair, fmt="{:.3f}"):
        m, sd = pair
        return "-" if m != m else f"{fmt.format(m)} +- {fmt.format(sd)}"

    rows = [[arm, cell(s["held_out_start"]), cell(s["held_out_final"]), f"{s['reached']}/{s['n']}",
             cell(s["steps_to_threshold"], "{:.1f}"), cell(s["samples_to_threshold"], "{:.0f}"),
             cell(s["train_success_final"]), cell(s["judge_calls"], "{:.0f}"), cell(s["judge_s"], "{:.1f}"),
             cell(s["wall_s"], "{:.0f}")] for arm, s in stats.items()]
    print(table(["arm", "held-out start", "held-out final", f"reached {a.threshold:g}", "steps to it",
                 "samples to it", "train success (last)", "judge calls", "judge s", "wall s"], rows))
    result = {"machine": machine(), "bf16_kernels": kernels, "seeds": seeds, "steps": a.steps, "val_every": a.val_every,
              "threshold": a.threshold, "arms": stats, "runs": runs}
    if "grpo" in stats and "adca-decouple" in stats:
        base, adca = stats["grpo"]["held_out_final"][0], stats["adca-decouple"]["held_out_final"][0]
        result["headline"] = adca / base if base > 0 else float("inf") if adca > 0 else float("nan")
        print(f"headline: ADCA-decouple / GRPO final held-out success = {adca:.3f} / {base:.3f} = {result['headline']:.2f}x")
    write_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
