"""Rollout throughput: the native engine against ``transformers`` ``generate``, same model, same run.

Claim: on CPU, the native engine generates at least 3x the tokens/s of ``transformers``' ``generate``
at batch 64 on ragged (stop-token) rollouts, for a Llama-style model of about 50M parameters, and about
2x when sampling fixed lengths. The quick run (4 layers, 16 new tokens; 2-core AMD EPYC, load 1.1,
2026-11-26) measured 3.09x ragged, 2.03x sample, 1.00x greedy in bf16: greedy decoding of a
bandwidth-bound model gains little (see below).

Setup (identical for both sides): one randomly initialised Llama model (hidden 512, 8 layers (4 with
``--quick``: 43.8M parameters), 8 query / 4 kv heads, SwiGLU 1280, vocab 32000 untied: 54.8M parameters),
built locally; the same weights
are loaded into both. Prompts of ``--prompt-len`` random tokens. Same dtype, same torch thread count.
Each fixed-length measurement alternates the two sides ``--repeats`` times and keeps each side's best
time (the machine may be shared). Three scenarios:

* ``greedy``: greedy decoding, ``--new-tokens`` per response, no stop token. Both sides generate
  exactly batch * new_tokens tokens, so this isolates the forward pass + KV cache. ``match`` is the
  fraction of responses equal token for token (greedy paths part at near-ties once rounding differs,
  often in bf16, where many logits tie exactly).
* ``sample``: the same at temperature 1 (no top-k/top-p): what RL rollouts run. Adds the sampler:
  ``transformers`` draws with ``torch.multinomial`` (one exponential variate per vocabulary entry per
  row on CPU); the native engine draws one uniform per row (inverse CDF, :mod:`trainer.rollout.native`).
* ``ragged``: the rollout shape continuous batching is for: 4 * batch requests (2 * batch in
  --quick), temperature 1, a set of stop tokens that ends a response with probability ~1/48 per
  token (lengths vary), at most 3 * new_tokens. ``transformers`` runs them in batches of ``batch``,
  each until its longest row ends; the native engine keeps ``batch`` rows busy. Tokens/s counts
  generated tokens (stop token included) only.

What bounds each scenario (measured on a 2-core Xeon with AMX, one thread): a decode step of this
model reads every weight once (110 MB in bf16) plus the KV cache, so at batch <= 64 it is
memory-bandwidth bound and ``greedy`` gains only what the native engine saves over ``generate``:
oneDNN-prepacked bf16 matmuls, no per-step KV ``torch.cat`` copies, a vectorised argmax. The
``sample`` and ``ragged`` gains come on top, from the sampler and from continuous batching.

SGLang rows (a second table): the real ``sglang.Engine`` 0.5.21 on its CPU path
(:class:`trainer.rollout.sglang_engine.SGLangEngine` with ``device="cpu"``, ``dtype="float32"``:
``torch_native`` attention, plain torch layers, no compiled SGLang kernels) against the native engine in
float32, measured in the same run on the same jobs. Same weights (the float32 model every table is built
from, the bf16 tables use its cast), saved with ``save_pretrained`` (no EOS id, as on the other sides);
same prompts and sampling parameters; ``max_running_requests`` = the native engine's ``max_batch_size``;
one torch thread in SGLang's scheduler when ``--threads 1``. sglang imports only in the SGLang CPU venv,
so that side runs as a child process (``benchmarks/_sglang_rollout.py``) in the interpreter
:func:`trainer.rollout.sglang_cpu.server_python` finds; its tok/s are by the CPU time of SGLang's whole
process tree (wall in ``(wall)``), its ~10-25 s engine start is not timed, and the prefix cache is
flushed before every timed run (the native engine has none). Without an install the table says
"not installed (python -m trainer.rollout.sglang_cpu install)"; ``--no-sglang`` leaves it out, saying so.
--quick runs each scenario once at batch 64.

Usage: python benchmarks/bench_rollout.py [--quick] [--json PATH] [--dtype bfloat16|float32|both] [--no-sglang]
The last line printed is the headline: the ratios at batch 64 in the first dtype, ``sample`` first,
then SGLang / native at batch 64 in float32 (or why there is no SGLang figure).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.rollout.engine import SamplingParams  # noqa: E402
from trainer.rollout.hf_model import CausalLM, ModelConfig  # noqa: E402
from trainer.rollout.native import NativeEngine  # noqa: E402
from benchmarks._common import ROOT, cpu_model  # noqa: E402

VOCAB = 32000


def machine() -> str:
    cpu = cpu_model()
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
        flags = ",".join(x for x in ("avx512f", "avx512_bf16", "amx_bf16") if x in text)
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu} ({flags}); {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}; "
            f"load avg {load:.1f}; torch {torch.__version__}")


def build_models(dtype: torch.dtype, max_len: int, quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1280, num_hidden_layers=8 if not quick else 4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=max_len, tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(cfg).eval().to(dtype)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ours = CausalLM(ModelConfig.from_hf_dict(cfg.to_dict()), dtype=dtype, max_len=max_len)
    ours.load_hf_tensors(hf.state_dict().items())
    n_params = sum(p.numel() for p in hf.parameters())
    return hf, ours, n_params


def hf_generate(hf, prompts: torch.Tensor, **kw) -> torch.Tensor:
    with torch.inference_mode():
        return hf.generate(prompts, attention_mask=torch.ones_like(prompts), **kw)


class Clock:
    """Wall time and this process's CPU time of one call.

    The dev machines are shared: wall time also counts the turns other processes take on our core.
    With one torch thread, the process's CPU time is the time our work actually ran, so tokens per
    CPU-second is the throughput of a dedicated core, and much less noisy. Both are recorded; the
    table's tok/s and ratio use CPU time when --threads is 1 and wall time otherwise.
    """

    def __init__(self, use_cpu: bool):
        self.use_cpu = use_cpu

    def __call__(self, fn):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        return dict(wall=time.perf_counter() - w0, cpu=time.process_time() - c0), out

    def key(self) -> str:
        return "cpu" if self.use_cpu else "wall"


def fixed_prompts(batch: int, prompt_len: int) -> torch.Tensor:
    """The ``greedy`` / ``sample`` prompts of one batch size: [batch, prompt_len] token ids (every side gets these)."""
    return torch.randint(3, VOCAB, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))


def ragged_prompts(batch: int, prompt_len: int, waves: int) -> torch.Tensor:
    """The ``ragged`` prompts: [waves * batch, prompt_len]."""
    return torch.randint(3, VOCAB, (waves * batch, prompt_len), generator=torch.Generator().manual_seed(1000 + batch))


RAGGED_STOP = list(range(3, 3 + VOCAB // 48))  # ~1/48 of a near-uniform random model's mass


def bench_fixed(hf, engine: NativeEngine, clock: Clock, batch: int, prompt_len: int, new: int, repeats: int,
                sample: bool) -> dict:
    prompts = fixed_prompts(batch, prompt_len)
    plist = prompts.tolist()
    sp = SamplingParams(temperature=1.0 if sample else 0.0, max_new_tokens=new, seed=0)
    hf_kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    engine.generate(plist[:2], SamplingParams(temperature=0.0, max_new_tokens=2))  # warm-up
    hf_generate(hf, prompts[:2], max_new_tokens=2, **hf_kw)
    best = {side: dict(wall=float("inf"), cpu=float("inf")) for side in ("native", "hf")}
    for _ in range(repeats):  # alternate the sides, keep each side's best
        t, ours_out = clock(lambda: engine.generate(plist, sp))
        best["native"] = {k: min(best["native"][k], t[k]) for k in t}
        t, hf_out = clock(lambda: hf_generate(hf, prompts, max_new_tokens=new, **hf_kw))
        best["hf"] = {k: min(best["hf"][k], t[k]) for k in t}
    tokens = batch * new
    assert all(len(o[0].token_ids) == new for o in ours_out) and hf_out.shape[1] == prompt_len + new
    match = sum(hf_out[i, prompt_len:].tolist() == ours_out[i][0].token_ids for i in range(batch)) / batch
    k = clock.key()
    return dict(batch=batch, tokens=tokens, seconds=best,
                native_tok_s=tokens / best["native"][k], hf_tok_s=tokens / best["hf"][k],
                ratio=best["hf"][k] / best["native"][k], ratio_wall=best["hf"]["wall"] / best["native"]["wall"],
                match=None if sample else match)


def bench_ragged(hf, engine: NativeEngine, clock: Clock, batch: int, prompt_len: int, new: int, waves: int) -> dict:
    n_req = waves * batch
    prompts = ragged_prompts(batch, prompt_len, waves)
    stop = RAGGED_STOP
    max_new = 3 * new
    t_ours, outs = clock(lambda: engine.generate(prompts.tolist(), SamplingParams(
        temperature=1.0, max_new_tokens=max_new, stop_token_ids=stop, seed=0)))
    ours_tokens = sum(len(o[0].token_ids) for o in outs)

    def run_hf():
        n_tok = 0
        for s in range(0, n_req, batch):
            out = hf_generate(hf, prompts[s : s + batch], do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=max_new, eos_token_id=stop, pad_token_id=0)
            for row in out[:, prompt_len:].tolist():  # count up to and including the first stop token
                n_tok += next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        return n_tok

    t_hf, hf_tokens = clock(run_hf)
    k = clock.key()
    return dict(batch=batch, requests=n_req, native_tokens=ours_tokens, hf_tokens=hf_tokens,
                seconds=dict(native=t_ours, hf=t_hf),
                native_tok_s=ours_tokens / t_ours[k], hf_tok_s=hf_tokens / t_hf[k],
                ratio=(ours_tokens / t_ours[k]) / (hf_tokens / t_hf[k]),
                ratio_wall=(ours_tokens / t_ours["wall"]) / (hf_tokens / t_hf["wall"]))


# --------------------------------------------------------------------------------------------------
# SGLang: the real sglang 0.5.21 engine on CPU, in a child process (sglang imports only in its venv)
# --------------------------------------------------------------------------------------------------
SGLANG_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sglang_rollout.py")
SGLANG_NOT_INSTALLED = "not installed (python -m trainer.rollout.sglang_cpu install)"


def sglang_jobs(scenarios, batches, sample_batches, ragged_batches, prompt_len: int, new: int, repeats: int,
                waves: int) -> list[dict]:
    """The SGLang workloads: the same prompts and sampling parameters as the native / transformers rows."""
    jobs = []
    for sc in scenarios:
        for b in {"greedy": batches, "sample": sample_batches, "ragged": ragged_batches}[sc]:
            if sc == "ragged":
                params = dict(temperature=1.0, max_new_tokens=3 * new, stop_token_ids=RAGGED_STOP, seed=0)
                prompts, reps = ragged_prompts(b, prompt_len, waves), 1  # the ragged rows run once
            else:
                params = dict(temperature=1.0 if sc == "sample" else 0.0, max_new_tokens=new, stop_token_ids=[], seed=0)
                prompts, reps = fixed_prompts(b, prompt_len), repeats
            jobs.append(dict(name=sc, batch=b, prompts=prompts.tolist(), params=params, repeats=reps,
                             return_tokens=sc == "greedy"))
    return jobs


def run_sglang_child(python: str, spec: dict, timeout_s: float) -> dict:
    """Run :mod:`benchmarks._sglang_rollout` in ``python``; its result dict, or RuntimeError with the log's tail."""
    import subprocess

    from benchmarks._sglang_rollout import RESULT_MARKER

    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as log:
        try:
            proc = subprocess.run([python, SGLANG_CHILD], input=json.dumps(spec), stdout=subprocess.PIPE,
                                  stderr=log, text=True, timeout=timeout_s, cwd=ROOT)
            rc = proc.returncode
            stdout = proc.stdout
        except subprocess.TimeoutExpired as e:
            rc, stdout = f"timeout after {timeout_s:.0f}s", e.stdout or ""
            stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        for line in stdout.splitlines():
            if line.startswith(RESULT_MARKER) and rc == 0:
                return json.loads(line[len(RESULT_MARKER):])
        log.seek(0)
        tail = [ln for ln in log.read().splitlines() if ln.strip()][-6:]
    raise RuntimeError(f"SGLang child ({python}) exited with {rc}: " + " | ".join(tail))


def bench_sglang(a, clock: Clock, scenarios, batches, sample_batches, ragged_batches, new: int, repeats: int,
                 waves: int, max_len: int) -> dict:
    """The SGLang rows: sglang.Engine (CPU path, float32) against the native engine (float32, measured here),
    same weights (the float32 model every run is built from) and prompts. Never silently skipped: the
    result's ``status`` says why there are no figures."""
    from trainer.rollout import sglang_cpu
    from trainer.rollout.sglang_engine import SGLANG_VERSION

    out = dict(engine=f"sglang=={SGLANG_VERSION}", path="CPU: torch_native attention, plain torch layers",
               dtype="float32", timing=clock.key(), rows=[])
    if a.no_sglang:
        return dict(out, status="skipped (--no-sglang)")
    python = sglang_cpu.server_python()
    if python is None:
        return dict(out, status=SGLANG_NOT_INSTALLED)
    out["python"] = python
    hf, ours, n_params = build_models(torch.float32, max_len, a.quick)
    out["params"] = n_params
    jobs = sglang_jobs(scenarios, batches, sample_batches, ragged_batches, a.prompt_len, new, repeats, waves)
    max_batch = max(batches)
    with tempfile.TemporaryDirectory(prefix="bench_rollout_sglang_") as model_dir:
        # No EOS in config.json / generation_config.json: SGLang also stops on those ids (the native and
        # transformers sides run without one), so every greedy / sample response is new_tokens long.
        hf.config.eos_token_id = None
        hf.config.bos_token_id = None
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf.save_pretrained(model_dir, safe_serialization=True)
        del hf
        spec = dict(model_path=model_dir, dtype="float32", threads=torch.get_num_threads(),
                    max_running_requests=max_batch, max_total_tokens=max_batch * max_len, jobs=jobs)
        try:
            res = run_sglang_child(python, spec, timeout_s=a.sglang_timeout)
        except RuntimeError as e:
            return dict(out, status=f"failed: {e}")
    out.update(status="ok", version=res["sglang_version"], startup_s=res["startup_s"])
    # The native engine on the same jobs, float32 (the float32 table above, if any, is a separate run).
    engine = NativeEngine(ours, max_batch_size=max_batch, max_seq_len=max_len)
    engine.generate(jobs[0]["prompts"][:2], SamplingParams(temperature=0.0, max_new_tokens=2))  # warm-up
    k = clock.key()
    for job, sg in zip(jobs, res["jobs"]):
        sp = SamplingParams(**{**job["params"], "stop_token_ids": tuple(job["params"]["stop_token_ids"])})
        best = dict(wall=float("inf"), cpu=float("inf"))
        for _ in range(job["repeats"]):
            t, native_out = clock(lambda: engine.generate(job["prompts"], sp))
            best = {x: min(best[x], t[x]) for x in best}
        native_tokens = sum(len(o[0].token_ids) for o in native_out)
        row = dict(scenario=job["name"], batch=job["batch"], requests=len(job["prompts"]),
                   native_tokens=native_tokens, sglang_tokens=sg["tokens"], sglang_finish=sg["finish_reasons"],
                   seconds=dict(native=best, sglang=sg["seconds"]),
                   native_tok_s=native_tokens / best[k], sglang_tok_s=sg["tokens"] / sg["seconds"][k])
        row["ratio"] = row["sglang_tok_s"] / row["native_tok_s"]
        row["ratio_wall"] = (sg["tokens"] / sg["seconds"]["wall"]) / (native_tokens / best["wall"])
        row["match"] = None
        if job["name"] != "ragged" and sg["tokens"] != native_tokens:  # counted as generated, but said
            row["note"] = f"SGLang generated {sg['tokens']} tokens, the native engine {native_tokens}"
        if "token_ids" in sg:
            row["match"] = sum(s == o[0].token_ids for s, o in zip(sg["token_ids"], native_out)) / len(native_out)
        out["rows"].append(row)
    return out


def print_sglang(sg: dict, new: int) -> None:
    if sg["status"] != "ok":
        print(f"\n[float32] SGLang: {sg['status']}")
        return
    print(f"\n[float32] SGLang {sg['version']} ({sg['path']}) vs the native engine: "
          f"Llama {sg['params'] / 1e6:.1f}M params, the same weights and prompts, {new} new (ragged: up to {3 * new}); "
          f"SGLang tok/s by {sg['timing']} time of its whole process tree; engine start {sg['startup_s']:.1f}s (not timed)")
    print(f"{'scenario':>8} {'batch':>6} {'native tok/s':>13} {'sglang tok/s':>13} {'sglang/native':>14} {'(wall)':>7} {'match':>6}")
    for r in sg["rows"]:
        m = "" if r["match"] is None else f"{r['match']:.2f}"
        print(f"{r['scenario']:>8} {r['batch']:>6} {r['native_tok_s']:>13.1f} {r['sglang_tok_s']:>13.1f} "
              f"{r['ratio']:>13.2f}x {r['ratio_wall']:>6.2f}x {m:>6}" + (f"  ({r['note']})" if "note" in r else ""),
              flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, about a minute with the SGLang rows")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "both"])
    ap.add_argument("--batches", default=None, help="comma list (default 1,16,64,256; quick 1,16,64)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64; quick 16")
    ap.add_argument("--repeats", type=int, default=None, help="default 2; quick 1")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both sides (default 1: on a shared machine more threads mostly wait at barriers)")
    ap.add_argument("--scenarios", default="greedy,sample,ragged", help="comma list of greedy, sample, ragged")
    ap.add_argument("--no-sglang", action="store_true", help="leave out the SGLang rows (said so in the output)")
    ap.add_argument("--sglang-timeout", type=float, default=None,
                    help="seconds for the SGLang child, start included (default 1800; quick 300)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    batches = [int(b) for b in (a.batches or ("1,16,64" if a.quick else "1,16,64,256")).split(",")]
    new = a.new_tokens or (16 if a.quick else 64)
    repeats = a.repeats or (1 if a.quick else 2)
    scenarios = [x for x in a.scenarios.split(",") if x]
    clock = Clock(use_cpu=torch.get_num_threads() == 1)
    # --quick keeps the sampled and ragged runs to the headline batch; ragged stops at 64 (transformers
    # needs minutes for 4 x 256 sampled requests).
    sample_batches = ([b for b in batches if b == 64] or batches[-1:]) if a.quick else [b for b in batches if b > 1]
    ragged_batches = [b for b in sample_batches if b <= 64]
    waves = 2 if a.quick else 4
    # SGLang rows: quick runs each scenario at the headline batch only (its engine start, 10-25 s, comes on top).
    sg_batches = sample_batches if a.quick else batches
    if a.sglang_timeout is None:
        a.sglang_timeout = 300.0 if a.quick else 1800.0
    dtypes = ["bfloat16", "float32"] if a.dtype == "both" else [a.dtype]
    max_len = a.prompt_len + 3 * new + 8
    result = dict(machine=machine(), prompt_len=a.prompt_len, new_tokens=new, repeats=repeats, quick=a.quick,
                  timing=clock.key(), runs={})
    print(f"machine: {result['machine']}")
    headline = None
    for dt_name in dtypes:
        dt = getattr(torch, dt_name)
        hf, ours, n_params = build_models(dt, max_len, a.quick)
        engine = NativeEngine(ours, max_batch_size=max(batches), max_seq_len=max_len)
        run = dict(params=n_params)
        print(f"\n[{dt_name}] Llama {n_params / 1e6:.1f}M params, prompt {a.prompt_len} tokens, {new} new "
              f"(ragged: up to {3 * new}); tok/s by {clock.key()} time")
        print(f"{'scenario':>8} {'batch':>6} {'native tok/s':>13} {'hf tok/s':>10} {'ratio':>7} {'(wall)':>7} {'match':>6}")
        for sc in scenarios:
            rows = []
            for b in {"greedy": batches, "sample": sample_batches, "ragged": ragged_batches}[sc]:
                if sc == "ragged":
                    r = bench_ragged(hf, engine, clock, b, a.prompt_len, new, waves=waves)
                else:
                    r = bench_fixed(hf, engine, clock, b, a.prompt_len, new, repeats, sample=sc == "sample")
                rows.append(r)
                m = "" if r.get("match") is None else f"{r['match']:.2f}"
                print(f"{sc:>8} {b:>6} {r['native_tok_s']:>13.1f} {r['hf_tok_s']:>10.1f} {r['ratio']:>6.2f}x "
                      f"{r['ratio_wall']:>6.2f}x {m:>6}", flush=True)
            run[sc] = rows
        result["runs"][dt_name] = run
        if headline is None:
            headline = {"dtype": dt_name}
            for sc in ("sample", "greedy", "ragged"):
                hit = [r for r in run.get(sc, []) if r["batch"] == 64]
                if hit:
                    headline[sc] = hit[0]["ratio"]
        del engine, hf, ours
    sg = bench_sglang(a, clock, scenarios, sg_batches, sample_batches, ragged_batches, new, repeats, waves, max_len)
    result["sglang"] = sg
    print_sglang(sg, new)
    headline["sglang"] = sg["status"]
    if sg["status"] == "ok":
        for sc in ("sample", "greedy", "ragged"):
            hit = [r for r in sg["rows"] if r["scenario"] == sc and r["batch"] == 64]
            if hit:
                headline[f"sglang_{sc}"] = hit[0]["ratio"]
    result["headline"] = headline
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    parts = [f"{headline[sc]:.2f}x {sc}" for sc in ("sample", "greedy", "ragged") if sc in headline]
    line = f"\nheadline: native / transformers generate, batch 64, {headline['dtype']}: " + " | ".join(parts)
    sg_parts = [f"{headline['sglang_' + sc]:.2f}x {sc}" for sc in ("sample", "greedy", "ragged") if "sglang_" + sc in headline]
    if sg_parts:
        line += f"; SGLang {sg['version']} (CPU) / native, batch 64, float32: " + " | ".join(sg_parts)
    elif sg["status"] != "ok":
        line += "; SGLang: " + ("failed (see above)" if sg["status"].startswith("failed") else sg["status"])
    print(line)
    return result


if __name__ == "__main__":
    main()
