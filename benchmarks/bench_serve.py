"""Serving throughput of ``python -m trainer.serve``: concurrent requests batched into engine calls.

Claim: N concurrent chat requests (the judge's load) are served at several times the throughput of the
same requests sent one at a time, and close to one offline ``NativeEngine.generate`` call over the
same prompts (the ceiling: no HTTP, no tokenization, no batching window).

Setup: a randomly initialised Qwen2 (hidden 512, 8 layers, 8 query / 4 kv heads, MLP 1408, tied;
about 24M parameters) saved with the shipped tiny model's character tokenizer (digits and + - * =),
so that prompts are text and the server's whole path (chat template, tokenizer, detokenizer) runs.
The server is a subprocess (``--threads`` torch threads, loopback HTTP); the offline engine runs in
this process with the same thread count. Every request is greedy with ``ignore_eos`` and the same
``max_tokens``, so every side generates exactly N * max_tokens tokens. Each side runs ``--repeats``
times, alternating, and keeps its best time (the machine may be shared).

  offline      one engine.generate over the N prompts (in-process)
  concurrent   N requests in flight at once (aiohttp client), the server batching them
  sequential   the N requests one after another (what a server without batching would manage)

Usage: python benchmarks/bench_serve.py [--n 64] [--max-tokens 32] [--threads 1] [--json PATH]
The last line is the headline: concurrent / sequential and concurrent / offline throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
TINY = os.path.join(REPO, "recipes", "cpu", "tiny_model")


def make_model(path: str, seed: int = 0) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=16, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(TINY, f), os.path.join(path, f))
    return sum(p.numel() for p in model.parameters())


def start_server(model: str, threads: int, max_batch: int, max_seq_len: int):
    cmd = [sys.executable, "-m", "trainer.serve", "--model", model, "--port", "0", "--threads", str(threads),
           "--max-batch-size", str(max_batch), "--max-seq-len", str(max_seq_len), "--api-key-env", "BENCH_NO_KEY"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("BENCH_NO_KEY", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.startswith("coxswain-serve: listening on "):
            return proc, line.split()[3]
    proc.kill()
    raise RuntimeError("the server did not start")


def health(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url.rsplit("/v1", 1)[0] + "/health", timeout=30) as r:
        return json.load(r)


async def run_requests(url: str, prompts: list[str], max_tokens: int, concurrent: bool) -> tuple[float, int, list[str]]:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(p):
            body = {"messages": [{"role": "user", "content": p}], "temperature": 0, "max_tokens": max_tokens,
                    "ignore_eos": True}
            async with s.post(url + "/chat/completions", json=body) as r:
                out = await r.json()
                return out["usage"]["completion_tokens"], out["choices"][0]["message"]["content"]

        t0 = time.perf_counter()
        if concurrent:
            res = await asyncio.gather(*(one(p) for p in prompts))
        else:
            res = [await one(p) for p in prompts]
        dt = time.perf_counter() - t0
    return dt, sum(r[0] for r in res), [r[1] for r in res]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=64, help="requests")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import torch

    from trainer.rollout.engine import SamplingParams
    from trainer.rollout.native import NativeEngine

    torch.set_num_threads(a.threads)
    rng = random.Random(0)
    prompts = ["".join(rng.choice("0123456789+-*=") for _ in range(a.prompt_len)) for _ in range(a.n)]
    tmp = tempfile.mkdtemp(prefix="bench_serve_")
    max_seq_len = a.prompt_len + a.max_tokens + 8
    try:
        params = make_model(tmp)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tmp)
        ids = [list(tok(p)["input_ids"]) for p in prompts]
        engine = NativeEngine(tmp, max_batch_size=a.n, max_seq_len=max_seq_len)
        sp = SamplingParams(temperature=0.0, max_new_tokens=a.max_tokens)
        engine.generate(ids[:2], sp)  # warm-up
        proc, url = start_server(tmp, a.threads, a.n, max_seq_len)
        try:
            asyncio.run(run_requests(url, prompts[:4], 4, True))  # warm-up
            best = {"offline": float("inf"), "concurrent": float("inf"), "sequential": float("inf")}
            tokens = {}
            engine_calls = {"offline": 1}
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                outs = engine.generate(ids, sp)
                best["offline"] = min(best["offline"], time.perf_counter() - t0)
                tokens["offline"] = sum(len(o[0].token_ids) for o in outs)
                offline_text = [tok.decode(o[0].token_ids, skip_special_tokens=True) for o in outs]
                for mode in ("concurrent", "sequential"):
                    calls0 = health(url)["engine_calls"]
                    dt, ntok, texts = asyncio.run(run_requests(url, prompts, a.max_tokens, mode == "concurrent"))
                    engine_calls[mode] = health(url)["engine_calls"] - calls0
                    best[mode] = min(best[mode], dt)
                    tokens[mode] = ntok
                    assert texts == offline_text, f"{mode}: server text differs from the engine's"
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    rows = {m: {"seconds": round(best[m], 4), "requests_per_s": round(a.n / best[m], 2),
                "tokens_per_s": round(tokens[m] / best[m], 1), "tokens": tokens[m],
                "engine_calls": engine_calls[m]} for m in best}
    print(f"model: random Qwen2, {params / 1e6:.1f}M params, fp32, {a.threads} torch thread(s); "
          f"{a.n} requests x {a.max_tokens} tokens, prompts of {a.prompt_len} characters")
    print(f"{'mode':<12}{'seconds':>10}{'req/s':>10}{'tok/s':>10}{'engine calls':>14}")
    for m, r in rows.items():
        print(f"{m:<12}{r['seconds']:>10.3f}{r['requests_per_s']:>10.1f}{r['tokens_per_s']:>10.1f}{r['engine_calls']:>14}")
    result = {"config": vars(a), "params": params, "rows": rows,
              "concurrent_over_sequential": round(best["sequential"] / best["concurrent"], 2),
              "concurrent_over_offline": round(best["offline"] / best["concurrent"], 3)}
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    print(f"concurrent/sequential throughput: {result['concurrent_over_sequential']}x; "
          f"concurrent/offline: {result['concurrent_over_offline']}x")
    return result


if __name__ == "__main__":
    main()
