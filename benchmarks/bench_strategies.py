"""The two training strategies side by side: one actor update (PPO loss, AdamW step) per strategy.

What is measured: wall seconds per ``update_actor`` call (one mini-batch of 32 responses, micro-batches
of 8, token-mean loss, gradient clipping), the best of ``--steps`` after one warm-up step, on two
ranks (gloo, one thread each): Megatron with data parallelism 2 (the default strategy, packed THD rows),
Megatron TP=2, and DeepSpeed ZeRO-1, -2 and -3 with data parallelism 2 (HF model, padded rows). Also the
log-prob forward of the same batch, and each rank's resident memory after the steps.

Model: a random Qwen2 (hidden 256, 4 layers, 8 heads / 2 KV heads, vocab 4096), prompts of 12-24 and
responses of 24-64 tokens. ``--quick``: 2 layers, 16 responses.

    python benchmarks/bench_strategies.py [--quick] [--json PATH] [--steps 3]

Baseline: Megatron DP=2. Headline (last line): DeepSpeed ZeRO-2 update time / Megatron DP=2 update time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import transformers.models.qwen2.modeling_qwen2  # noqa: F401  (before megatron's CPU shims, see the parity test)

from _common import machine, table, write_json  # noqa: E402


def make_model(path: str, quick: bool) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=2 if quick else 4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def batch(n: int):
    from trainer.batch import RolloutBatch
    from trainer.rollout.single_turn import pad_left, pad_right

    g = torch.Generator().manual_seed(1)
    lp = torch.randint(12, 25, (n,), generator=g).tolist()
    lr = torch.randint(24, 65, (n,), generator=g).tolist()
    prompts = [torch.randint(2, 4096, (k,), generator=g).tolist() for k in lp]
    resps = [torch.randint(2, 4096, (k,), generator=g).tolist() for k in lr]
    p_ids, p_mask = pad_left(prompts, max(lp), 0)
    r_ids, r_mask = pad_right(resps, max(lr), 0, torch.long)
    b = RolloutBatch.from_tokens(p_ids, r_ids, p_mask, r_mask)
    b.advantages = torch.randn(r_ids.shape, generator=g) * r_mask
    return b


def job(kind: str, src: str, port: int, n: int, steps: int):
    import psutil
    import torch.distributed as dist

    from trainer.algos.losses import batch_norm_counts
    from trainer.plan import ForwardSettings, PolicyLoss, UpdateSettings
    from trainer.workers.dataplane import StepData, Transport

    rank, world = dist.get_rank(), dist.get_world_size()
    optim = dict(optimizer="adam", lr=1e-5, min_lr=0.0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
                 adam_eps=1e-8, clip_grad=1.0, lr_schedule="constant", lr_warmup_steps=0, lr_decay_steps=100,
                 use_distributed_optimizer=False)
    common = dict(role="actor", rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                  model_path=src, optim=optim, num_threads=1)
    packed = kind.startswith("megatron")
    if packed:
        from trainer.workers.megatron_worker import MegatronWorker

        w = MegatronWorker(tp=2 if kind == "megatron_tp2" else 1, **common)
    else:
        from megatron_bridge import cpu_shims

        from trainer.workers.deepspeed_worker import DeepSpeedWorker

        cpu_shims.uninstall_mode()
        w = DeepSpeedWorker(zero_stage=int(kind[-1]), **common)
    b = batch(n)
    data = StepData(b, Transport(in_process=True))
    dp = w.layout()["dp_size"]
    fwd = ForwardSettings(micro_batch_size=8, packed=packed)
    pl = PolicyLoss(loss_mode="vanilla", agg_mode="token-mean", norm_constant=64.0, clip_ratio=0.2, clip_ratio_low=None,
                    clip_ratio_high=None, clip_ratio_c=3.0, entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0,
                    kl_loss_type="kl")
    upd = UpdateSettings(mini_batch_size=n, epochs=1, shuffle=False, micro_batch_size=8, policy=pl, packed=packed)
    shard = data.shards(dp)[w.layout()["dp_rank"]]
    t0 = time.perf_counter()
    old = torch.as_tensor(w.log_probs(data.shards(1)[0], settings=fwd, key="lp")[0]["lp"])
    t_fwd = time.perf_counter() - t0
    counts = [tuple(float(c) for c in batch_norm_counts(b.response_mask, "token-mean"))]
    part = data.partition(dp)
    extras = data.scatter(dp, {"advantages": b.advantages, "old_log_probs": old})[w.layout()["dp_rank"]]
    rows = [list(range(len(part.rows[w.layout()["dp_rank"]])))]
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        w.update_actor(shard, rows, extras, settings=upd, counts=counts)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {"update_s": min(times[1:]), "forward_s": t_fwd, "rss_gb": psutil.Process().memory_info().rss / 1e9}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    from megatron_bridge.launch import find_free_port, spawn

    n = 16 if a.quick else 32
    steps = 1 if a.quick else a.steps
    kinds = ["megatron_dp2", "megatron_tp2", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"]
    res = {}
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "m")
        make_model(src, a.quick)
        for k in kinds:
            out = spawn(job, 2, k, src, find_free_port(), n, steps, threads_per_rank=1)
            res[k] = {"update_s": max(o["update_s"] for o in out), "forward_s": max(o["forward_s"] for o in out),
                      "rss_gb": max(o["rss_gb"] for o in out)}
    base = res["megatron_dp2"]["update_s"]
    rows = [[k, r["update_s"], r["update_s"] / base, r["forward_s"], r["rss_gb"]] for k, r in res.items()]
    print("machine:", machine(f"2 ranks x 1 thread, {n} responses per update"))
    print(table(["strategy", "update s", "vs megatron dp2", "log-prob fwd s", "max rank RSS GB"], rows))
    head = res["deepspeed_zero2"]["update_s"] / base
    write_json(a.json, {"machine": machine(), "n": n, "results": res, "headline": head})
    print(f"headline: a DeepSpeed ZeRO-2 update takes {head:.2f}x the time of a Megatron DP=2 update")


if __name__ == "__main__":
    main()
