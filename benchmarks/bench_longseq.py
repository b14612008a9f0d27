"""Long ragged sequences in the actor update: padded micro-batches against packed sequences, a token
budget and full activation recompute, in one run.

What is timed: ``MegatronWorker.update_actor`` (the product's worker: one PPO step, vanilla policy
loss, token-mean) on 2 data-parallel ranks (gloo, one CPU slot each; the slots may share cores), each
holding a shard of ragged sequences whose lengths are spread evenly from 10% to 100% of ``--max-len``
tokens (prompt 10% of each, response the rest). Variants, each in fresh processes (so the peak
resident memory is its own):

* ``padded``: fixed micro-batches of 2 rows padded to the shard's width (the previous path);
* ``packed``: the same rows as THD packed rows, no pad tokens (``use_remove_padding``);
* ``packed + budget``: micro-batches filled up to ``--budget`` tokens (``use_dynamic_bsz``);
* ``packed + budget + full recompute``: plus ``enable_gradient_checkpointing`` (megatron's full,
  uniform, 1-layer recompute).

Per variant: the median step time over ``--steps`` steps after one warm-up step, trained tokens/s
(real tokens of both ranks / step time), and per rank the activation memory: the peak bytes autograd
holds for the backward, measured in the warm-up step with saved-tensor hooks (``SavedActivations``:
a micro-batch's forward saves, plus, under recompute, one recomputed block at a time; parameters
excluded), and the process's peak RSS for context (it also holds the model, Adam state and the
allocator's cache). Model: random Qwen2, hidden 512, 6 layers, 8 query / 4 kv heads,
SwiGLU 1408, vocab 8192 untied: 26M parameters, fp32 (``--quick``: hidden 256, 4 layers, 5.5M).

    python benchmarks/bench_longseq.py [--quick] [--json PATH] [--max-len 4096] [--rows 6] [--budget 8192]

Baselines and the headline (last line): packed + budget tokens/s / padded tokens/s (target >= 2), and
recompute's activation memory / packed + budget's (target <= 0.5) at its time ratio (target <= 1.4).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time


import torch  # noqa: E402

from _common import ROOT, load_average, machine, table, write_json  # noqa: E402

VARIANTS = {
    "padded": dict(packed=False, budget=False, recompute=False),
    "packed": dict(packed=True, budget=False, recompute=False),
    "packed + budget": dict(packed=True, budget=True, recompute=False),
    "packed + budget + full recompute": dict(packed=True, budget=True, recompute=True),
}


def make_model(path: str, quick: bool) -> int:
    from transformers import AutoModelForCausalLM, Qwen2Config

    kw = (dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=704)
          if quick else dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                             intermediate_size=1408))
    cfg = Qwen2Config(vocab_size=8192, max_position_embeddings=8192, tie_word_embeddings=False, **kw)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).float()
    m.save_pretrained(path)
    return sum(p.numel() for p in m.parameters())


def lengths(rows: int, max_len: int) -> list[int]:
    """``2 * rows`` lengths spread evenly over [10%, 100%] of ``max_len``, interleaved over the ranks."""
    n = 2 * rows
    return [int(max_len * (0.1 + 0.9 * i / (n - 1))) for i in range(n)]


class SavedActivations:
    """Peak bytes of activations held for the backward, from autograd's saved-tensor hooks: a
    micro-batch's forward saves accumulate until its backward starts; a recompute (saves made during
    the backward) adds its block's saves on top of the forward's checkpointed inputs, one block at a
    time. Parameters (leaf tensors that require grad) are not activations and are left out; a
    storage saved twice in one phase counts once."""

    def __init__(self):
        self.fwd = self.blk = self.peak = 0
        self.last, self.seen = "none", set()

    def pack(self, t):
        if not (t.is_leaf and t.requires_grad):
            in_bwd = torch._C._current_graph_task_id() != -1
            phase = "bpack" if in_bwd else "fpack"
            if self.last != phase:
                self.seen = set()
                if in_bwd:
                    self.blk = 0
                elif self.last != "fpack":
                    self.fwd = 0  # a new micro-batch's forward
            st = t.untyped_storage()
            if st.data_ptr() not in self.seen:
                self.seen.add(st.data_ptr())
                if in_bwd:
                    self.blk += st.nbytes()
                else:
                    self.fwd += st.nbytes()
            self.peak = max(self.peak, self.fwd + (self.blk if in_bwd else 0))
            self.last = phase
        return t

    def unpack(self, t):
        self.last = "unpack"
        return t


def rank_job(src: str, variant: dict, lens: list[int], steps: int, budget: int, port: int):
    import torch.distributed as dist

    from trainer.batch import RolloutBatch
    from trainer.config import load_config, recompute_settings
    from trainer.plan import PolicyLoss, UpdateSettings
    from trainer.rollout.single_turn import pad_left, pad_right
    from trainer.workers.dataplane import StepData, Transport
    from trainer.workers.megatron_worker import MegatronWorker

    rank = dist.get_rank()
    mine = lens[rank::2]
    g = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(0, 8192, (max(1, n // 10),), generator=g).tolist() for n in mine]
    resp = [torch.randint(0, 8192, (n - len(p),), generator=g).tolist() for n, p in zip(mine, prompts)]
    p_ids, p_mask = pad_left(prompts, max(map(len, prompts)), 0)
    r_ids, r_mask = pad_right(resp, max(map(len, resp)), 0, torch.long)
    batch = RolloutBatch.from_tokens(p_ids, r_ids, p_mask, r_mask)
    adv = torch.randn(r_ids.shape, generator=g) * r_mask
    cfg = load_config(["--config", os.path.join(ROOT, "recipes", "cpu", "tiny_grpo.yaml"),
        "--config", os.path.join(ROOT, "recipes", "cpu", "fp32.yaml"),  # the figures are fp32
       
                       f"actor_rollout_ref.model.enable_gradient_checkpointing={variant['recompute']}"])
    optim = dict(optimizer="adam", lr=1e-5, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                 adam_eps=1e-8, clip_grad=1.0, lr_schedule="constant", lr_warmup_steps=0, lr_decay_steps=100,
                 use_distributed_optimizer=False)
    w = MegatronWorker(role="actor", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, model_path=src,
                       optim=optim, num_threads=1,
                       recompute=recompute_settings(variant["recompute"], cfg.actor_rollout_ref.actor.megatron))
    data = StepData(batch, Transport(in_process=True))
    shard = data.shards(1)[0]
    extras = data.scatter(1, {"advantages": adv, "old_log_probs": torch.zeros_like(adv)})[0]
    pl = PolicyLoss(loss_mode="vanilla", agg_mode="token-mean", norm_constant=1.0, clip_ratio=0.2, clip_ratio_low=None,
                    clip_ratio_high=None, clip_ratio_c=3.0, entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0,
                    kl_loss_type="kl")
    s = UpdateSettings(mini_batch_size=len(mine), epochs=1, shuffle=False, micro_batch_size=2, policy=pl,
                       packed=variant["packed"], max_token_len=budget if variant["budget"] else None)
    n_tok = float(batch.response_mask.sum()) * 2  # both ranks (equal by construction, near enough)
    counts = [(n_tok, float(2 * len(mine)))]
    saved = SavedActivations()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):  # warm-up, measuring activations
        w.update_actor(shard, [list(range(len(mine)))], extras, settings=s, counts=counts)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        w.update_actor(shard, [list(range(len(mine)))], extras, settings=s, counts=counts)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"times": times, "act_mb": saved.peak / 2**20, "peak_mb": peak / 1024, "tokens": int(batch.attention_mask.sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5.5M model, 1024 tokens, 4 rows per rank, 1 step")
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--rows", type=int, default=None, help="sequences per rank")
    ap.add_argument("--budget", type=int, default=None, help="token budget per micro-batch")
    ap.add_argument("--steps", type=int, default=None)
    a = ap.parse_args()
    max_len = a.max_len or (1024 if a.quick else 4096)
    rows = a.rows or (4 if a.quick else 6)
    budget = a.budget or 2 * max_len
    steps = a.steps or (1 if a.quick else 2)
    from megatron_bridge.launch import find_free_port, spawn

    tmp = tempfile.mkdtemp(prefix="bench_longseq_")
    n_params = make_model(os.path.join(tmp, "m"), a.quick)
    lens = lengths(rows, max_len)
    print(f"machine: {machine('2 DP ranks (gloo), one thread each')}")
    print(f"model: random Qwen2, {n_params / 1e6:.1f}M params, fp32; {rows} sequences per rank, lengths "
          f"{lens[0]}..{lens[-1]} tokens (10%..100% of {max_len}); budget {budget} tokens; median of {steps} step(s)\n")
    res = {}
    for name, v in VARIANTS.items():
        out = spawn(rank_job, 2, os.path.join(tmp, "m"), v, lens, steps, budget, find_free_port(), timeout_s=3600)
        t = statistics.median(max(r["times"][i] for r in out) for i in range(steps))  # a step ends with its slowest rank
        res[name] = {"step_s": t, "tokens_per_s": sum(r["tokens"] for r in out) / t,
                     "act_mb": max(r["act_mb"] for r in out), "peak_mb": max(r["peak_mb"] for r in out)}
        print(f"  ran {name}: {t:.2f} s/step, load avg {load_average():.1f}", flush=True)
    pad, bud, rc = res["padded"], res["packed + budget"], res["packed + budget + full recompute"]
    rows_out = [[k, r["step_s"], r["tokens_per_s"], r["tokens_per_s"] / pad["tokens_per_s"], r["act_mb"], r["peak_mb"]]
                for k, r in res.items()]
    print()
    print(table(["variant", "step s", "tokens/s", "vs padded", "activation MB/rank", "peak RSS MB/rank"], rows_out,
                floatfmt="{:.2f}"))
    speed = bud["tokens_per_s"] / pad["tokens_per_s"]
    mem = rc["act_mb"] / max(bud["act_mb"], 1e-9)
    slow = rc["step_s"] / bud["step_s"]
    write_json(a.json, {"machine": machine(), "params": n_params, "lengths": lens, "budget": budget, "results": res,
                        "speedup_packed_budget": speed, "recompute_memory_ratio": mem, "recompute_time_ratio": slow})
    print(f"\nheadline: packed + budget = {speed:.2f}x padded tokens/s; full recompute = {mem:.2f}x the activation "
          f"memory at {slow:.2f}x the step time")


if __name__ == "__main__":
    main()
