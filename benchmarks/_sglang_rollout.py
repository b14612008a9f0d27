"""The SGLang side of ``bench_rollout.py``, run as a child process in the interpreter that has sglang.

``sglang`` (0.5.21, CPU path) imports only in the SGLang CPU venv (``.venv-sglang-cpu``), not in the
project's interpreter, so ``bench_rollout.py`` runs this file with that venv's python. It reads one JSON
object on stdin::

    {"model_path": DIR, "dtype": "float32", "threads": 1, "max_running_requests": 64,
     "max_total_tokens": 5120, "repeats": 1,
     "jobs": [{"name": "greedy", "batch": 64, "prompts": [[...], ...],
               "params": {"temperature": 0.0, "max_new_tokens": 16, "stop_token_ids": [], "seed": 0},
               "repeats": 1, "return_tokens": true}, ...]}

starts one :class:`trainer.rollout.sglang_engine.SGLangEngine` (``device="cpu"``) on ``model_path``, runs
each job ``repeats`` times (the prefix cache flushed before each run, untimed: the native engine has no
prefix cache, and a repeated prompt would otherwise skip its prefill) and keeps the best wall time and the
best CPU time, and prints one line ``RESULT_MARKER + json`` on stdout.

CPU time is that of the whole SGLang process tree (this process, which runs SGLang's tokenizer manager,
plus the scheduler and detokenizer processes it starts), read with psutil before and after each run: with
one torch thread (``OMP_NUM_THREADS``, inherited by the scheduler) it is the CPU-seconds the engine spent,
comparable with the native engine's process CPU time.
"""

from __future__ import annotations

import json
import os
import sys
import time

RESULT_MARKER = "@@bench_rollout_sglang@@ "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree_cpu_seconds() -> float:
    """user + system CPU seconds of this process and its live descendants."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # exited in between
            pass
    return total


def main() -> None:
    spec = json.load(sys.stdin)
    threads = int(spec.get("threads") or 0)
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the scheduler process inherits it
    sys.path.insert(0, ROOT)
    import torch

    if threads:
        torch.set_num_threads(threads)
    import sglang

    from trainer.rollout.engine import SamplingParams
    from trainer.rollout.sglang_engine import SGLangEngine

    t0 = time.perf_counter()
    engine = SGLangEngine(spec["model_path"], device="cpu", dtype=spec.get("dtype", "float32"), seed=0,
                          engine_kwargs={"max_running_requests": int(spec["max_running_requests"]),
                                         "max_total_tokens": int(spec["max_total_tokens"])})
    startup = time.perf_counter() - t0
    out = dict(sglang_version=sglang.__version__, startup_s=startup, jobs=[])
    try:
        first = spec["jobs"][0]["prompts"][:2]
        engine.generate(first, SamplingParams(temperature=0.0, max_new_tokens=2))  # warm-up
        for job in spec["jobs"]:
            sp = SamplingParams(**job["params"])
            best = dict(wall=float("inf"), cpu=float("inf"))
            for _ in range(int(job.get("repeats", 1))):
                engine.flush_cache()  # no prefix-cache hits from an earlier run of the same prompts
                w0, c0 = time.perf_counter(), tree_cpu_seconds()
                res = engine.generate(job["prompts"], sp)
                w, c = time.perf_counter() - w0, tree_cpu_seconds() - c0
                best = dict(wall=min(best["wall"], w), cpu=min(best["cpu"], c))
            outs = [r[0] for r in res]
            reasons = {}
            for o in outs:
                reasons[o.finish_reason] = reasons.get(o.finish_reason, 0) + 1
            rec = dict(name=job["name"], batch=job["batch"], requests=len(outs), seconds=best,
                       tokens=sum(len(o.token_ids) for o in outs), finish_reasons=reasons)
            if job.get("return_tokens"):
                rec["token_ids"] = [o.token_ids for o in outs]
            out["jobs"].append(rec)
            print(f"sglang {job['name']} batch {job['batch']}: {rec['tokens']} tokens, "
                  f"{best['wall']:.2f}s wall, {best['cpu']:.2f}s cpu", file=sys.stderr, flush=True)
    finally:
        engine.shutdown()
    sys.stdout.write(RESULT_MARKER + json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
