"""benchmarks/bench_adca.py at its smallest setting (--quick), as a user runs it: GRPO and ADCA-decouple on
Towers with the rule judge; the judge's labels must carry information and the JSON must hold what the table
shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_adca_quick(tmp_path):
    out = tmp_path / "adca.json"
    p = subprocess.run([sys.executable, "benchmarks/bench_adca.py", "--quick", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith("machine: ") and lines[-1].startswith("headline: ADCA-decouple / GRPO")
    res = json.loads(out.read_text())
    runs = {r["arm"]: r for r in res["runs"]}
    assert set(runs) == {"grpo", "adca-decouple"}
    for r in runs.values():
        assert sorted(int(s) for s in r["held_out"]) == [0, 2]  # before training and after the last step
        assert all(0.0 <= v <= 1.0 for v in r["held_out"].values()) and len(r["train_success"]) == 2
    grpo, adca = runs["grpo"], runs["adca-decouple"]
    assert grpo["judge_calls"] == 0 and adca["judge_calls"] >= 2 * 4 * 8  # every trajectory (4 tasks x 8) of both steps asked
    # the rule judge answered every trajectory, with labels that differ between steps (GOOD and BAD both seen),
    # and the fusion gave the steps non-zero credit
    assert adca["fallback_fraction"] == [0.0, 0.0]
    assert all(0.0 < g < 1.0 for g in adca["good_fraction"]) and all(m > 0 for m in adca["prm_abs_mean"])
    # both arms start from the same model and held-out tasks
    assert grpo["held_out"]["0"] == adca["held_out"]["0"]
    assert res["arms"]["grpo"]["n"] == 1 and "headline" in res
    # on a CPU without bf16 instructions (and COXSWAIN_CPU_BF16 unset) the bf16 products took the fp32 path
    from trainer.cpu_bf16 import native_bf16

    asked = os.environ.get("COXSWAIN_CPU_BF16", "").lower()
    fp32 = asked == "fp32" or (not asked and not native_bf16())
    assert res["bf16_kernels"] == ("fp32-accumulate bf16 kernels" if fp32 else "torch's bf16 kernels")
    assert res["bf16_kernels"] in lines[0]
