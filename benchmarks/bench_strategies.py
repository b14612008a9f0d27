"""The three training strategies side by side: one actor update (PPO loss, AdamW step) per strategy, on the
same model and the same batch, in one run.

Rows, each on two ranks (gloo, one thread each, a fresh pair of processes per row):

* Megatron with data parallelism 2 (the default strategy, packed THD rows) -- the baseline -- and Megatron TP=2;
* DeepSpeed ZeRO-1, -2 and -3 with data parallelism 2 (HF model, padded rows);
* FSDP2 (``strategy=fsdp2``, HF model, fp32 compute: ``param_dtype=fp32``) with data parallelism 2, packed rows,
  and FSDP2 with Ulysses sequence parallelism 2 (one data-parallel shard split over the pair), packed rows.

What is measured, per row:

* ``update s``: wall seconds per ``update_actor`` call (one mini-batch of 32 responses, micro-batches of 8,
  token-mean loss, gradient clipping), the best of ``--steps`` after one warm-up step, the slower rank's;
* ``tokens/s``: the batch's real tokens (prompt + response, ``attention_mask.sum()``; padding not counted) over
  ``update s``: the two ranks together, the same token count for every row;
* ``log-prob fwd s``: one log-prob forward of the whole batch (the first call, so it includes warm-up);
* ``peak RSS GB``: each rank's resident set high-water mark over its whole life (model load, the forward, the
  updates): ``VmHWM`` of ``/proc/self/status``, the larger of the two ranks. Not ``getrusage``'s ``ru_maxrss``:
  a rank starts by fork + exec from this script, and Linux carries the parent's peak into the child's
  ``ru_maxrss`` across both (measured: a child spawned by an 800 MB parent reports 835 MB there, 16 MB in
  ``VmHWM``). Elsewhere than Linux it falls back to ``ru_maxrss`` and the JSON says so.

Model: a random Qwen2 (hidden 256, 4 layers, 8 heads / 2 KV heads, vocab 4096), prompts of 12-24 and
responses of 24-64 tokens. ``--quick``: 2 layers, 16 responses, one timed step.

    python benchmarks/bench_strategies.py [--quick] [--json PATH] [--steps 3]

Baseline: Megatron DP=2 (the ``vs megatron dp2`` column: update time / the baseline's). Headline (last line):
FSDP2 DP=2 update time / Megatron DP=2 update time.
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


def peak_rss() -> tuple[float, str]:
    """This process's resident set high-water mark in GB, and where it was read (see the module docstring)."""
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e9, "VmHWM"
    except OSError:
        pass
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
    return r * (1 if sys.platform == "darwin" else 1024) / 1e9, "ru_maxrss"


def job(kind: str, src: str, port: int, n: int, steps: int):
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
    packed = kind.startswith(("megatron", "fsdp2"))
    if kind.startswith("megatron"):
        from trainer.workers.megatron_worker import MegatronWorker

        w = MegatronWorker(tp=2 if kind == "megatron_tp2" else 1, **common)
    elif kind.startswith("fsdp2"):
        from megatron_bridge import cpu_shims

        from trainer.workers.train_worker import TrainWorker

        cpu_shims.uninstall_mode()  # the spawn helper set megatron up; an FSDP rank runs plain torch
        w = TrainWorker(strategy="fsdp2", param_dtype="fp32", packed=True, sp=2 if kind == "fsdp2_sp2" else 1,
                        **common)
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
    peak_gb, how = peak_rss()
    return {"update_s": min(times[1:]), "forward_s": t_fwd, "peak_rss_gb": peak_gb, "peak_rss_source": how,
            "tokens": int(b.attention_mask.sum()),
            "layout": {k: w.layout()[k] for k in ("dp_size", "tp_size", "cp_size")}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    from megatron_bridge.launch import find_free_port, spawn

    n = 16 if a.quick else 32
    steps = 1 if a.quick else a.steps
    kinds = ["megatron_dp2", "megatron_tp2", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3", "fsdp2_dp2",
             "fsdp2_sp2"]
    res = {}
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "m")
        make_model(src, a.quick)
        for k in kinds:
            out = spawn(job, 2, k, src, find_free_port(), n, steps, threads_per_rank=1)
            upd = max(o["update_s"] for o in out)
            res[k] = {"update_s": upd, "tokens": out[0]["tokens"], "tokens_per_s": out[0]["tokens"] / upd,
                      "forward_s": max(o["forward_s"] for o in out),
                      "peak_rss_gb": max(o["peak_rss_gb"] for o in out),
                      "peak_rss_gb_per_rank": [o["peak_rss_gb"] for o in out],
                      "peak_rss_source": out[0]["peak_rss_source"], "layout": out[0]["layout"]}
    base = res["megatron_dp2"]["update_s"]
    rows = [[k, r["update_s"], r["update_s"] / base, f"{r['tokens_per_s']:,.0f}", r["forward_s"], r["peak_rss_gb"]]
            for k, r in res.items()]
    tokens = res["megatron_dp2"]["tokens"]
    print("machine:", machine(f"2 ranks x 1 thread, {n} responses ({tokens} real tokens) per update"))
    print(table(["strategy", "update s", "vs megatron dp2", "tokens/s", "log-prob fwd s", "peak RSS GB"], rows))
    head = res["fsdp2_dp2"]["update_s"] / base
    write_json(a.json, {"machine": machine(), "n": n, "steps": steps, "tokens": tokens, "results": res,
                        "baseline": "megatron_dp2", "headline": head,
                        "headline_def": "fsdp2_dp2 update_s / megatron_dp2 update_s"})
    print(f"headline: an FSDP2 DP=2 update takes {head:.2f}x the time of a Megatron DP=2 update")


if __name__ == "__main__":
    main()
