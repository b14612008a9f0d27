"""What the code sandbox's containment costs per scored sample.

What is measured: wall time per sample to score an MBPP-style answer (a function and three
``assert f(...) == ...`` tests), a HumanEval-style ``check(candidate)`` test, and an APPS-style stdin /
stdout program with five cases:

* ``sandbox``: ``trainer.rewards.sandbox.run_code`` with every layer this host gives (private root,
  uid nobody, seccomp, namespaces, pids cgroup, rlimits, audit hook) and the separate referee process;
* ``bare``: the baseline, the cheapest way to run the same code and tests in a fresh process at all:
  ``python -I -c "<code + tests>"`` (io: one process per case), no containment, no referee.

Samples run one after another, as one reward worker scores them (``reward_model.num_workers`` scale
it). Headline (last line): sandbox time / bare time for the MBPP case.

    python benchmarks/bench_sandbox.py [--quick] [--json PATH] [--n 30]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from _common import machine, table, write_json  # noqa: E402

MBPP = ("def f(xs):\n    return sorted(set(xs))[:3]\n",
        ["assert f([3, 1, 2, 3]) == [1, 2, 3]", "assert f([5]) == [5]", "assert f([]) == []"])
HUMANEVAL = ("def add(a, b):\n    return a + b\n",
             ["def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\ncheck(add)\n"])
APPS = ("n = int(input())\nprint(sum(range(n)))\n", [f"{i}\n" for i in range(5)], [str(sum(range(i))) for i in range(5)])


def bare_assert(code, tests):
    p = subprocess.run([sys.executable, "-I", "-c", code + "\n" + "\n".join(tests)], capture_output=True, timeout=30)
    return p.returncode == 0


def bare_io(code, inputs, outputs):
    ok = True
    for i, o in zip(inputs, outputs):
        p = subprocess.run([sys.executable, "-I", "-c", code], input=i.encode(), capture_output=True, timeout=30)
        ok &= p.stdout.decode().split() == o.split()
    return ok


def per_sample(fn, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        ok = fn()
        times.append(time.perf_counter() - t0)
        assert ok, "a correct answer must pass"
    return statistics.median(times), min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--n", type=int, default=30)
    a = ap.parse_args()
    n = 8 if a.quick else a.n
    from trainer.rewards.sandbox import SandboxLimits, probe, run_code

    lim = SandboxLimits(cpu_s=4, wall_s=10.0)
    layers = probe()["layers"]
    cases = {
        "mbpp (3 asserts)": (lambda: run_code(MBPP[0], tests=MBPP[1], limits=lim).status == "passed",
                             lambda: bare_assert(*MBPP)),
        "humaneval (check)": (lambda: run_code(HUMANEVAL[0], tests=HUMANEVAL[1], limits=lim).status == "passed",
                              lambda: bare_assert(*HUMANEVAL)),
        "apps (5 io cases)": (lambda: run_code(APPS[0], mode="io", inputs=APPS[1], outputs=APPS[2], limits=lim).status == "passed",
                              lambda: bare_io(*APPS)),
    }
    rows, result = [], {"machine": machine(), "layers": layers, "n": n, "cases": {}}
    for name, (sb, bare) in cases.items():
        sb(), bare()  # warm the page cache
        s_med, s_min = per_sample(sb, n)
        b_med, b_min = per_sample(bare, n)
        rows.append([name, s_med * 1e3, b_med * 1e3, s_med / b_med])
        result["cases"][name] = {"sandbox_ms": s_med * 1e3, "bare_ms": b_med * 1e3, "ratio": s_med / b_med,
                                 "sandbox_min_ms": s_min * 1e3, "bare_min_ms": b_min * 1e3}
    print("machine:", result["machine"])
    print("layers:", ", ".join(layers))
    print(table(["case", "sandbox ms/sample", "bare ms/sample", "sandbox / bare"], rows, "{:.1f}"))
    head = result["cases"]["mbpp (3 asserts)"]["ratio"]
    result["headline"] = head
    write_json(a.json, result)
    print(f"headline: the contained sandbox costs {head:.2f}x a bare python process per MBPP sample")


if __name__ == "__main__":
    main()
