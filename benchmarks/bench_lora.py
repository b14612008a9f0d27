"""LoRA against full fine-tuning on the same model, in one run: bytes and seconds per weight sync, checkpoint size
and step time.

The model is a random Qwen2 of ``--hidden`` / ``--ffn`` / ``--layers`` (default 512 / 1408 / 4, GQA 8:2, about 11M
parameters; the tiny model's 16-symbol tokenizer, so the embedding is small and the ratio below is the
conservative one: a real vocabulary adds full-sync bytes only), trained by the tiny GRPO recipe's loop (fp32,
colocated hybrid engine, 2 actor ranks) for ``--steps`` steps in three arms:

  * ``full``: full fine-tuning (the engines get every weight, by the shared-memory transport);
  * ``lora-merged``: LoRA of ``--rank`` on every decoder linear, ``lora.merge=true`` (merged weights synced);
  * ``lora-adapters``: the same LoRA, ``lora.merge=false`` (verl's default: only the adapters move,
    :mod:`trainer.rollout.adapters` merges them beside each engine).

Reported per arm (steps 2 on, medians): ``sync/bytes`` and ``sync/seconds`` (the sync after each update), the
step time, and the size of the last checkpoint's ``actor/`` directory (LoRA's holds the adapters and their Adam
state; full fine-tuning's the model and its Adam state). Headline: sync bytes of ``lora-adapters`` over
``full`` (the issue's target at rank 8: at most 1/20).

    python benchmarks/bench_lora.py [--quick] [--json PATH] [--steps 4] [--rank 8] [--hidden 512] [--ffn 1408] [--layers 4]

``--quick``: a 0.2M-parameter model (hidden 64, ffn 176, 2 layers), 2 steps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import ray
from _common import ROOT, machine, table, write_json

from trainer.config import load_config
from trainer.main import train
from trainer.workers.group import keep_embedded_ray

TINY = os.path.join(ROOT, "recipes", "cpu", "tiny_model")
RECIPE = ["--config", os.path.join(ROOT, "recipes", "cpu", "tiny_grpo.yaml"),
          "--config", os.path.join(ROOT, "recipes", "cpu", "fp32.yaml")]


def arms(rank: int) -> dict[str, list[str]]:
    lora = [f"actor_rollout_ref.model.lora.rank={rank}", f"actor_rollout_ref.model.lora.alpha={2 * rank}"]
    return {"full": [], "lora-merged": lora + ["actor_rollout_ref.model.lora.merge=true"],
            "lora-adapters": lora + ["actor_rollout_ref.model.lora.merge=false"]}


def build_model(out_dir: str, hidden: int, ffn: int, layers: int) -> int:
    """A random Qwen2 with the tiny model's tokenizer in ``out_dir``; returns its parameter count."""
    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM

    cfg = AutoConfig.from_pretrained(TINY)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = hidden, ffn, layers
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 8, 2, hidden // 8
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [cfg.layer_types[0]] * layers
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float()
    model.save_pretrained(out_dir)
    for f in os.listdir(TINY):
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(TINY, f), out_dir)
    return sum(p.numel() for p in model.parameters())


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run_arm(name: str, extra: list[str], model: str, steps: int, work: str) -> dict:
    run_dir = os.path.join(work, name)
    cfg = load_config(RECIPE + extra + [
        f"actor_rollout_ref.model.path={model}", f"trainer.total_training_steps={steps}", f"trainer.save_freq={steps}",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[console]",
        "trainer.resume_mode=disable", f"trainer.default_local_dir={run_dir}", f"trainer.experiment_name=bench_lora_{name}"])
    t0 = time.perf_counter()
    hist = [h for h in train(cfg)["history"] if h.get("step", 0) >= 2]
    wall = time.perf_counter() - t0

    def med(key):
        return statistics.median(h[key] for h in hist)

    return {"arm": name, "sync_bytes": med("sync/bytes"), "sync_s": med("sync/seconds"), "step_s": med("timing_s/step"),
            "verified": min(h.get("sync/verified", 0.0) for h in hist),
            "ckpt_bytes": dir_bytes(os.path.join(run_dir, f"global_step_{steps}", "actor")), "wall_s": wall}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.hidden, a.ffn, a.layers = 2, 64, 176, 2
    print(machine(), flush=True)
    keep_embedded_ray(True)  # one Ray start for the three arms
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as work:
        model = os.path.join(work, "model")
        params = build_model(model, a.hidden, a.ffn, a.layers)
        try:
            for name, extra in arms(a.rank).items():
                rows.append(run_arm(name, extra, model, a.steps, work))
        finally:
            keep_embedded_ray(False)
            ray.shutdown()
    full = rows[0]
    print(f"model: random Qwen2, hidden {a.hidden}, ffn {a.ffn}, {a.layers} layers, {params / 1e6:.2f}M parameters; "
          f"LoRA rank {a.rank} on every decoder linear; {a.steps} steps, medians of steps 2-{a.steps}")
    print(table(["arm", "sync bytes", "x full", "sync s", "step s", "ckpt bytes", "x full", "verified"],
                [[r["arm"], f"{r['sync_bytes']:,.0f}", r["sync_bytes"] / full["sync_bytes"], r["sync_s"], r["step_s"],
                  f"{r['ckpt_bytes']:,}", r["ckpt_bytes"] / full["ckpt_bytes"], r["verified"]] for r in rows]))
    ratio = rows[2]["sync_bytes"] / full["sync_bytes"]
    result = {"machine": machine(), "params": params, "rank": a.rank, "steps": a.steps, "rows": rows,
              "headline_sync_bytes_ratio": ratio}
    write_json(a.json, result)
    print(f"headline: adapter-only sync moves {ratio:.4f} of full fine-tuning's bytes (1/{1 / ratio:.0f}) at rank {a.rank}")
    return result


if __name__ == "__main__":
    main()
