"""Rollout-vs-trainer mismatch of a mixture-of-experts policy with and without R3 routing replay.

What is measured: the native engine samples in bf16 (the rollout side, as on a GPU fleet) with
``return_routed_experts``; the product's megatron worker (``MegatronWorker.log_probs``, fp32, packed rows)
recomputes the same responses' log-probs twice: routing freely (its own fp32 top-k) and replaying the
engine's experts (``routing_replay=True``, megatron_bridge.routing_replay). From each, the mismatch
metrics the driver logs (``trainer.algos.rollout_is.compute_mismatch_metrics``): k1 and k3 KL between
the sampler and the trainer, the mean |delta log-prob| per token and its maximum; also the share of
(token, layer) routing decisions on which an fp32 forward picks another expert set than the engine did
(the native fp32 forward, which equals transformers'), and the forward time of each pass (the
replay's cost: building the per-router targets).

Model: random Qwen3-MoE, hidden 256, 4 layers, 64 experts top-8 (Qwen3-30B-A3B's ratio is 128 / 8),
moe_intermediate 128, vocab 2048, transformers' default init (router std 0.02, which gives the
near-ties a real router has many of); ``--quick``: 2 layers, 32 experts. 32 prompts x 2 samples of up to
``--tokens`` new tokens.

    python benchmarks/bench_routing_replay.py [--quick] [--json PATH] [--tokens 48]

Baseline: the same worker routing freely. Headline (last line): k3 mismatch KL without replay / with it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from _common import load_average, machine, table, write_json  # noqa: E402


def make_model(path: str, quick: bool) -> dict:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         num_experts=32 if quick else 64, num_experts_per_tok=8, norm_topk_prob=True,
                         num_hidden_layers=2 if quick else 4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)
    return dict(layers=cfg.num_hidden_layers, experts=cfg.num_experts, k=cfg.num_experts_per_tok)


def worker_job(path: str, shard: dict, port: int):
    """One rank: the product's worker, without and with replay, on the same shard."""
    from trainer.plan import ForwardSettings
    from trainer.workers.megatron_worker import MegatronWorker

    settings = ForwardSettings(micro_batch_size=16, packed=True, temperature=1.0)
    out = {}
    for name, replay in (("free", False), ("R3", True)):
        w = MegatronWorker(role="actor", rank=0, world_size=1, master_addr="127.0.0.1", master_port=port,
                           model_path=path, routing_replay=replay, num_threads=torch.get_num_threads())
        s = shard if replay else {k: v for k, v in shard.items() if k != "routed_experts"}
        w.log_probs(s, settings=settings)  # warm-up
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            lp, _ = w.log_probs(s, settings=settings)
            times.append(time.perf_counter() - t0)
        out[name] = (lp["log_probs"], min(times))
        port += 1
        from megatron.core import parallel_state as ps
        import torch.distributed as dist

        ps.destroy_model_parallel()
        dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()

    from megatron_bridge.launch import find_free_port, spawn
    from trainer.algos.rollout_is import compute_mismatch_metrics
    from trainer.rollout.engine import SamplingParams
    from trainer.rollout.hf_model import CausalLM
    from trainer.rollout.native import NativeEngine
    from trainer.rollout.single_turn import outputs_to_batch

    tokens = 16 if a.quick else a.tokens
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m")
        shape = make_model(path, a.quick)
        print(f"machine: {machine('one rank (gloo)')}")
        print(f"model: random Qwen3-MoE, {shape['layers']} layers, {shape['experts']} experts top-{shape['k']}; "
              f"engine bf16, trainer fp32")
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 2048, (int(n),), generator=g).tolist()
                   for n in torch.randint(8, 33, (8 if a.quick else 32,), generator=g)]
        eng = NativeEngine(path, max_batch_size=64, max_seq_len=64 + tokens, dtype=torch.bfloat16)
        outs = eng.generate(prompts, SamplingParams(n=2, max_new_tokens=tokens, seed=1, return_routed_experts=True))
        batch = outputs_to_batch(prompts, outs, [i for i in range(len(prompts))], max_prompt_length=64,
                                 max_response_length=tokens, pad_id=0)
        # routing decisions an fp32 forward makes differently from the bf16 engine
        fp = CausalLM.from_pretrained(path)
        flips = total = 0
        for p, per in zip(prompts, outs):
            for o in per:
                fp.record_routing(True)
                fp.forward(torch.tensor([p + o.token_ids]))
                own = torch.stack([m.routes for m in fp.moe_layers()], -2)[0, :-1].sort(-1).values  # [n, R, k]
                fp.record_routing(False)
                flips += int((own != o.routed_experts.long().sort(-1).values).any(-1).sum())
                total += own.shape[0] * own.shape[1]
        shard = {k: getattr(batch, k).numpy() for k in ("prompts", "responses", "attention_mask", "response_mask",
                                                        "routed_experts")}
        res = spawn(worker_job, 1, path, shard, find_free_port(), timeout_s=3600)[0]
    mask = batch.response_mask.bool()
    rows, result = [], {}
    for name in ("free", "R3"):
        lp, t = res[name]
        lp = torch.from_numpy(lp)
        m = compute_mismatch_metrics(lp, batch.rollout_log_probs, mask)
        d = (lp - batch.rollout_log_probs).abs()[mask]
        result[name] = dict(k1=m["mismatch/mismatch_kl"], k3=m["mismatch/mismatch_k3_kl"], abs_mean=float(d.mean()), abs_max=float(d.max()),
                            forward_s=t)
        rows.append([name, m["mismatch/mismatch_kl"], m["mismatch/mismatch_k3_kl"], float(d.mean()), float(d.max()), t])
    print(f"\nrouting decisions (token x layer) where fp32 picks another expert set than the bf16 engine: "
          f"{flips} of {total} ({100 * flips / total:.2f}%); {int(mask.sum())} response tokens; load avg "
          f"{load_average():.1f}\n")
    print(table(["trainer routing", "mismatch_kl (k1)", "k3 KL", "mean |dlogp|", "max |dlogp|", "forward s"], rows,
                floatfmt="{:.3g}"))
    ratio = result["free"]["k3"] / max(result["R3"]["k3"], 1e-30)
    write_json(a.json, {"machine": machine(), "shape": shape, "flips": flips, "decisions": total, "results": result,
                        "headline_k3_ratio": ratio})
    print(f"\nheadline: routing replay cuts the k3 mismatch KL {ratio:.1f}x (max |dlogp| "
          f"{result['free']['abs_max']:.3g} -> {result['R3']['abs_max']:.3g}) at "
          f"{result['R3']['forward_s'] / result['free']['forward_s']:.2f}x the forward time")


if __name__ == "__main__":
    main()
