"""Synchronous against one-step-off and fully async training, on the same resources, with long-tailed response
lengths.

What is timed: ``trainer.main.train`` (the product's loop) for ``--steps`` GRPO steps in three runs:

* ``sync, split``: one engine process (one CPU slot) and one megatron rank (one slot); each step
  generates, then trains, then syncs: one side always waits for the other;
* ``one-step-off, split``: the same placement with ``async_training.mode=one_step_off``: step t+1's batch
  is generated while step t trains (trainer/batch_source.py);
* ``fully-async, split``: the same placement with ``async_training.mode=fully_async`` and verl's defaults
  (``trigger_parameter_sync_step=4``, ``staleness_threshold=0.1``, ``partial_rollout=true``): a rollouter
  thread keeps the engine generating into a queue, weights pushed every 4 steps (trainer/async_rollout.py);
* ``fully-async s=0.5, split``: the same with ``staleness_threshold=0.5``: the rollouter may run half a
  version's prompts ahead (verl's quota), so the first steps after a push do not wait for a fresh call;
* ``sync, colocated``: the synchronous loop's other placement, the engine inside the training rank's
  process (hybrid engine), each phase with both cores' worth of threads available to it.

Model: a random-init Qwen2 (hidden 256, 4 layers, SwiGLU 768) over the shipped tiny tokenizer's 16-token
vocabulary, fp32, with the other tokens' embedding rows scaled by ``EOS_SPREAD`` so that EOS is rare:
response lengths have a long tail (HF sampling, 64 responses, cap 256: median 29, mean 61, max 256), so
each synchronous batch waits for its longest response while the median one finished long before, the
regime of reasoning RL where generation dominates a step. 16 prompts x 4 samples per step, one optimizer
step, ``--max-len`` 512.

Per run, over the steps after the first two (start-up and lazy compilation excluded): response tokens
per second of wall time, the median step time, and the idle time of each side per step: the trainer's
(waiting for a batch or for the engines to finish before a sync; in sync mode the whole generation) and
the engines' (waiting for weights and for the next request; in sync mode the whole training phase).

    python benchmarks/bench_async.py [--quick] [--json PATH] [--steps 8] [--max-len 512]

Baseline: ``sync, split``. Headline (last lines): one-step-off's and fully async's tokens/s over it, and
over the best synchronous placement.

Measured here (AMD EPYC, 2 cores, load 1.6-2.5, 8 steps, cap 512): sync split 1950 tokens/s (step 1.68 s,
0.71 s of it generating); one-step-off 1.51x; fully async 1.41x (verl's staleness 0.1: the queue runs dry
after each push and the trainer waits for a fresh call's tail) and 1.74x with staleness 0.5, which is 1.50x
the best synchronous placement (colocated, 1.16x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from _common import ROOT, load_average, machine, table, write_json  # noqa: E402

# The non-EOS rows of the (tied) embedding are scaled by this: their logits spread, EOS's stays near 0,
# so EOS is drawn less often. Measured with HF sampling on the full model (64 responses, cap 256): mean
# length 61, median 29, max 256 (unscaled: mean 28, max 124).
EOS_SPREAD = 2.0

RUNS = {
    "sync, split": ["trainer.placement=split"],
    "one-step-off, split": ["trainer.placement=split", "async_training.mode=one_step_off"],
    "fully-async, split": ["trainer.placement=split", "async_training.mode=fully_async"],
    "fully-async s=0.5, split": ["trainer.placement=split", "async_training.mode=fully_async",
                                 "async_training.staleness_threshold=0.5"],
    "sync, colocated": ["trainer.placement=colocated"],
}


def make_model(path: str, quick: bool) -> None:
    import json
    import shutil

    from transformers import AutoModelForCausalLM, Qwen2Config

    tiny = os.path.join(ROOT, "recipes", "cpu", "tiny_model")
    base = json.load(open(os.path.join(tiny, "config.json")))
    cfg = Qwen2Config(vocab_size=base["vocab_size"], hidden_size=128 if quick else 256,
                      intermediate_size=384 if quick else 768, num_hidden_layers=2 if quick else 4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=base.get("eos_token_id"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # spread the other tokens' logits (tied embedding): EOS becomes rarer
        w = model.get_input_embeddings().weight
        eos = base.get("eos_token_id")
        keep = w[eos].clone()
        w.mul_(EOS_SPREAD)
        w[eos] = keep
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if os.path.exists(os.path.join(tiny, f)):
            shutil.copy(os.path.join(tiny, f), os.path.join(path, f))


def one_run(model: str, run_dir: str, extra: list[str], steps: int, max_len: int) -> list[dict]:
    from trainer.config import load_config
    from trainer.main import train

    cfg = load_config(["--config", os.path.join(ROOT, "recipes", "cpu", "tiny_grpo.yaml"),
        "--config", os.path.join(ROOT, "recipes", "cpu", "fp32.yaml"),  # the figures are fp32
       
                       f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={run_dir}",
                       f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
                       "trainer.save_freq=-1", "trainer.logger=[console]", "trainer.n_gpus_per_node=1",
                       "data.train_batch_size=16", "actor_rollout_ref.rollout.n=4",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
                       f"data.max_response_length={max_len}", *extra])
    out = train(cfg)
    import ray

    if ray.is_initialized():
        ray.shutdown()
    return out["history"]


def summarize(hist: list[dict], skip: int, batch: int) -> dict:
    rows = [h for h in hist if h["step"] > skip]
    secs = [h["timing_s/step"] for h in rows]
    tokens = [h["response_length/mean"] * batch for h in rows]
    if "async/trainer_idle_s" in rows[0]:  # fully async: the trainer waits for the queue; the engine idles
        t_idle = [h["async/trainer_idle_s"] + h.get("async/pause_s", 0.0) for h in rows]  # ... paused for pushes,
        e_idle = [h["async/engine_idle_s"] for h in rows]  # at its quota, or scoring
    elif "async/staleness" in rows[0]:  # one-step-off: the trainer waits only for a late batch or the sync
        t_idle = [h.get("async/trainer_wait_s", 0.0) + h.get("async/sync_wait_s", 0.0) for h in rows]
        e_idle = [h.get("async/engine_idle_s", 0.0) for h in rows]
    else:  # sync: the trainer idles while the engines generate (and score), and the other way round
        t_idle = [h.get("timing_s/gen", 0.0) + h.get("timing_s/reward", 0.0) for h in rows]
        e_idle = [h["timing_s/step"] - h.get("timing_s/gen", 0.0) for h in rows]
    return dict(tokens_per_s=sum(tokens) / sum(secs), step_s=statistics.median(secs),
                trainer_idle_s=statistics.median(t_idle), engine_idle_s=statistics.median(e_idle),
                mean_len=statistics.mean(h["response_length/mean"] for h in rows),
                max_len=max(h.get("response_length/max", 0.0) for h in rows), steps=len(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=512)
    a = ap.parse_args()
    steps, max_len = (4, 96) if a.quick else (a.steps, a.max_len)
    print(f"machine: {machine('local Ray cluster, 1 training rank + 1 engine')}")
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "m")
        make_model(model, a.quick)
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tmp}/mlflow.db")
        for name, extra in RUNS.items():
            t0 = time.time()
            hist = one_run(model, os.path.join(tmp, name.replace(", ", "_").replace(" ", "").replace("=", "")), extra, steps, max_len)
            res[name] = summarize(hist, skip=2 if steps > 3 else 1, batch=64)
            print(f"  ran {name}: {time.time() - t0:.0f} s, {res[name]['tokens_per_s']:.0f} tokens/s, "
                  f"load avg {load_average():.1f}", flush=True)
    base = res["sync, split"]["tokens_per_s"]
    rows = [[n, r["tokens_per_s"], r["tokens_per_s"] / base, r["step_s"], r["trainer_idle_s"], r["engine_idle_s"],
             r["mean_len"], r["max_len"]] for n, r in res.items()]
    print()
    print(table(["run", "tokens/s", "vs sync split", "step s", "trainer idle s", "engine idle s", "mean len", "max len"],
                rows, floatfmt="{:.3g}"))
    best_sync = max(res["sync, split"]["tokens_per_s"], res["sync, colocated"]["tokens_per_s"])
    off = res["one-step-off, split"]["tokens_per_s"]
    full = res["fully-async, split"]["tokens_per_s"]
    full5 = res["fully-async s=0.5, split"]["tokens_per_s"]
    write_json(a.json, {"machine": machine(), "steps": steps, "max_len": max_len, "results": res,
                        "headline_vs_sync_split": off / base, "headline_vs_best_sync": off / best_sync,
                        "fully_async_vs_sync_split": full / base, "fully_async_vs_best_sync": full / best_sync,
                        "fully_async_s05_vs_sync_split": full5 / base, "fully_async_s05_vs_best_sync": full5 / best_sync})
    print(f"\nheadline: one-step-off = {off / base:.2f}x the synchronous tokens/s on the same split placement, "
          f"{off / best_sync:.2f}x the best synchronous placement")
    print(f"headline: fully async (staleness 0.5) = {full5 / base:.2f}x the synchronous tokens/s on the same split "
          f"placement, {full5 / best_sync:.2f}x the best synchronous placement; verl's default staleness 0.1: "
          f"{full / base:.2f}x")


if __name__ == "__main__":
    main()
