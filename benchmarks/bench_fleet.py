"""Rollout throughput of the HTTP fleet (``trainer.rollout.fleet``) against the in-process native engine.

Claim: two single-thread native servers behind the real ``sglang-router`` (0.3.2), fed through
:class:`FleetClient` (one ``/generate`` per prompt, SGLang's protocol), generate at least as many tokens
per second as one in-process ``NativeEngine`` with two torch threads on the same prompts: the HTTP
and router overhead is small next to the decode work, and two processes use two cores better than two
intra-op threads on small matmuls.

Setup: a randomly initialised Qwen2 (hidden 512, 8 layers, 8 query / 4 kv heads, MLP 1408, tied; about
24M parameters) saved with the shipped tiny model's vocabulary size.
Every request is greedy with no stop token (``ignore_eos``), so every side generates exactly
``prompts * n * max_new_tokens`` tokens; the fleet's tokens are checked equal to the engine's. Each side
runs ``--repeats`` times, alternating, and keeps its best time (the machine may be shared).

  in-process   NativeEngine(num_threads=2).generate(prompts, params): one call, continuous batching
  in-process/1 the same call with one torch thread (context: what intra-op threading buys here)
  fleet        Fleet(num_servers=2, threads_per_server=1).client.generate(prompts, params) via the router

Usage: python benchmarks/bench_fleet.py [--prompts 64] [--n 2] [--max-tokens 32] [--repeats 3] [--quick]
       [--json PATH]
The last line is the headline: fleet / in-process generated tokens per second.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine, table, write_json  # noqa: E402


def make_model(path: str, *, hidden: int, layers: int, max_pos: int, seed: int = 0) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=16, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=max_pos,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=2, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="32 prompts x 16 tokens, one repeat: under a minute")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    hidden, layers = 512, 8
    if a.quick:
        a.prompts, a.max_tokens, a.repeats = min(a.prompts, 32), min(a.max_tokens, 16), 1

    import torch

    from trainer.rollout.engine import SamplingParams
    from trainer.rollout.fleet import Fleet
    from trainer.rollout.native import NativeEngine

    torch.set_num_threads(2)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 16) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
    params = SamplingParams(n=a.n, temperature=0.0, max_new_tokens=a.max_tokens, stop_token_ids=())
    samples = a.prompts * a.n
    max_seq_len = a.prompt_len + a.max_tokens
    tmp = tempfile.mkdtemp(prefix="bench_fleet_")
    best = {"in-process": float("inf"), "in-process/1": float("inf"), "fleet": float("inf")}
    try:
        nparams = make_model(tmp, hidden=hidden, layers=layers, max_pos=max_seq_len)
        engine = NativeEngine(tmp, max_batch_size=samples, max_seq_len=max_seq_len, num_threads=2)
        t_start = time.perf_counter()
        with Fleet(tmp, num_servers=2, threads_per_server=1, max_batch_size=samples, max_seq_len=max_seq_len,
                   client_kwargs={"max_concurrency": a.prompts}) as fleet:
            startup = time.perf_counter() - t_start
            engine.generate(prompts[:2], params)  # warm-up both sides
            fleet.client.generate(prompts[:4], params)
            calls = {}
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                ref = engine.generate(prompts, params)
                best["in-process"] = min(best["in-process"], time.perf_counter() - t0)
                torch.set_num_threads(1)
                t0 = time.perf_counter()
                engine.generate(prompts, params)
                best["in-process/1"] = min(best["in-process/1"], time.perf_counter() - t0)
                torch.set_num_threads(2)
                calls["in-process"] = calls["in-process/1"] = 1
                before = [fleet.client.server_info(u)["internal_states"][0]["engine_calls"] for u in fleet.server_urls]
                t0 = time.perf_counter()
                out = fleet.client.generate(prompts, params)
                best["fleet"] = min(best["fleet"], time.perf_counter() - t0)
                after = [fleet.client.server_info(u)["internal_states"][0]["engine_calls"] for u in fleet.server_urls]
                calls["fleet"] = sum(after) - sum(before)
                assert [[o.token_ids for o in x] for x in out] == [[o.token_ids for o in x] for x in ref], \
                    "the fleet's tokens differ from the in-process engine's"
            retries = fleet.stats.retries
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    tokens = samples * a.max_tokens
    rows = {k: {"seconds": round(v, 4), "tokens": tokens, "tokens_per_s": round(tokens / v, 1), "engine_calls": calls[k]}
            for k, v in best.items()}
    ratio = round(best["in-process"] / best["fleet"], 3)
    print(f"machine: {machine()}")
    print(f"model: random Qwen2, {nparams / 1e6:.1f}M params, fp32; {a.prompts} prompts x n={a.n} x {a.max_tokens} "
          f"tokens (greedy, no stop), prompts of {a.prompt_len} tokens; best of {a.repeats}")
    print(f"sides: in-process NativeEngine with 2 torch threads | fleet of 2 native servers x 1 thread behind "
          f"sglang-router 0.3.2 (round_robin); fleet start-up {startup:.1f}s (not timed), retries {retries}")
    print(table(["side", "seconds", "tokens", "tok/s", "engine calls"],
                [[k, r["seconds"], r["tokens"], r["tokens_per_s"], r["engine_calls"]] for k, r in rows.items()]))
    result = {"config": vars(a), "machine": machine(), "params": nparams, "rows": rows,
              "fleet_startup_s": round(startup, 2), "fleet_over_in_process": ratio}
    write_json(a.json, result)
    print(f"fleet / in-process generated tokens/s: {ratio}x")
    return result


if __name__ == "__main__":
    main()
