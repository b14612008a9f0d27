"""benchmarks/gpu_check.py, the one-GPU check, rehearsed on CPU (``--cpu-rehearsal``) as a real subprocess: every
stage reports, with figures that are computed, not placeholders (each assertion fails on a stage that skipped its
work or compared a thing with itself), and a stage that overruns its timeout is killed and reported as timed out
while the run goes on."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support.house import ROOT

pytestmark = pytest.mark.slow  # about 45 s on a 2-core machine: eight stage processes
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
STAGES = ["env", "gpu_tests", "parity", "mfu", "decode", "sync", "offload", "grpo"]


def run(tmp_path, *flags, timeout=170):
    out = tmp_path / "gpu_check.json"
    p = subprocess.run([sys.executable, SCRIPT, "--json", str(out), *flags], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    return p, json.loads(out.read_text())


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    p, res = run(tmp_path_factory.mktemp("gpu_check"), "--cpu-rehearsal")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return p.stdout, res


def test_every_stage_runs_and_passes(rehearsal):
    out, res = rehearsal
    st = res["stages"]
    assert list(st) == STAGES
    assert {n: r["status"] for n, r in st.items()} == dict.fromkeys(STAGES, "pass"), {n: r.get("reason") for n, r in st.items()}
    assert res["cpu_rehearsal"] is True and res["elapsed_s"] < res["budget_s"]
    assert st["env"]["cuda_available"] is False and st["env"]["missing_required"] == []
    # the table and the headline are printed last
    assert "stage" in out and "gpu_check on CPU rehearsal: 8/8 stages pass" in out.strip().splitlines()[-1]


def test_gpu_tests_are_found_and_skipped_for_their_reason(rehearsal):
    g = rehearsal[1]["stages"]["gpu_tests"]
    assert "tests/test_batch.py" in g["files"] and "tests/megatron_bridge/test_bridge_gpu.py" in g["files"]
    assert g["passed"] == 0 and g["failed"] == 0 and g["skipped"] >= 10
    assert sum(g["skip_reasons"].values()) == g["skipped"]
    assert all("CUDA" in reason for reason in g["skip_reasons"])


def test_bridge_parity_is_close_and_its_control_is_not(rehearsal):
    rows = rehearsal[1]["stages"]["parity"]["rows"]
    assert sorted((r["model"], r["dtype"]) for r in rows) == [("dense_qwen2", "bfloat16"), ("dense_qwen2", "float32"),
                                                              ("moe_qwen3", "bfloat16"), ("moe_qwen3", "float32")]
    for r in rows:
        assert 0 <= r["max_abs_diff"] < r["tolerance"], r
        if r["dtype"] == "float32":
            assert r["tolerance"] == 1e-4
        else:  # bf16: judged against transformers' own bf16 rounding, which is not zero
            assert 0 < r["hf_bf16_diff"] and r["tolerance"] == pytest.approx(2 * r["hf_bf16_diff"] + 1e-2)
        # a perturbed weight (the final norm x1.5) fails the same check
        assert r["control_detected"] is True and r["control_diff"] > r["tolerance"] > r["max_abs_diff"]


def test_figures_are_measured(rehearsal):
    st = rehearsal[1]["stages"]
    m, d, s, o = st["mfu"], st["decode"], st["sync"], st["offload"]
    assert 0 < m["mfu_train"] <= 1 and 0 < m["mfu_forward"] <= 1 and m["peak_tflops"] > 0
    assert "measured" in m["peak_source"] and m["train_step_s"] > 0 and m["params"] > 0
    assert d["batch"] == 64 and d["tokens"] == 64 * d["new_tokens"] and d["decode_tokens_per_s"] > 0
    assert d["generate_s"] > d["prefill_s"] > 0
    # the sync moved the whole bf16 model (tied embeddings: no separate lm_head), verified three ways
    assert s["bytes"] == 2 * m["params"] and s["copy_gbps"] > 0 and s["verified_gbps"] > 0
    assert s["digest_verified"] is s["engine_changed"] is s["actor_matches_engine"] is s["control_detected"] is True
    # offload: bf16 params, the fp32 gradient buffer, Adam's fp32 master weights and two moments, back bit for bit
    assert o["bytes_offloaded"] == {"params": 2 * m["params"], "grads": 4 * m["params"], "optimizer": 12 * m["params"]}
    assert o["round_trip_exact"] is True and o["all_offloaded"] is True and o["offload_s"] > 0 and o["reload_s"] > 0
    g = st["grpo"]
    assert g["steps"] == 2 and g["returncode"] == 0 and g["s_per_step"] > 0


def test_mfu_profile_and_digest_split_are_reported(rehearsal):
    """The mfu stage's profile (CPU activities in the rehearsal: the code path a GPU run takes, without its
    kernels) and the sync stage's split of the digest time, recomputed to the sync's own checksums."""
    out, res = rehearsal
    st = res["stages"]
    prof = st["mfu"]["profile"]
    assert "error" not in prof, prof
    for part in ("train_step", "forward"):
        p = prof[part]
        ops = p["top_cpu_ops"]
        assert len(ops) >= 1 and p["wall_ms"] > 0 and p["basis_ms"] > 0
        selfs = [o["self_ms"] for o in ops]
        assert selfs == sorted(selfs, reverse=True)
        pcts = [o["pct"] for o in ops] + list(p["kinds_pct"].values()) + list(p["phases_pct"].values())
        assert all(0 <= x <= 100 for x in pcts), p
        assert sum(p["kinds_pct"].values()) == pytest.approx(100, abs=0.1)  # exclusive kinds cover the basis
        assert p["phases_pct"]["vocab"] > 0  # the output layer's range and the log-probs are found
    assert prof["train_step"]["phases_pct"]["optimizer"] > 0 and prof["forward"]["phases_pct"]["optimizer"] == 0
    assert "profiled; top op:" in out
    d = st["sync"]["digest_split"]
    assert d["matches_sync"] is True and d["host_bytes"] == 0  # a CPU run moves nothing to a host
    assert d["hashed_bytes"] == 2 * st["sync"]["bytes"] and d["hash_s"] > 0


def test_a_stage_over_its_timeout_is_killed_and_reported(tmp_path):
    t0 = time.monotonic()
    p, res = run(tmp_path, "--cpu-rehearsal", "--only", "env,mfu", "--cap", "mfu=1", timeout=60)
    wall = time.monotonic() - t0
    st = res["stages"]
    assert list(st) == ["env", "mfu"] and st["env"]["status"] == "pass"
    assert st["mfu"]["status"] == "timeout" and 1 <= st["mfu"]["seconds"] < 5, st["mfu"]
    assert p.returncode == 1 and wall < 30
    assert "1 timed out" in p.stdout.strip().splitlines()[-1]


def test_no_stage_starts_without_budget_left(tmp_path):
    p, res = run(tmp_path, "--cpu-rehearsal", "--only", "env,parity", "--budget-s", "1", timeout=60)
    st = res["stages"]
    assert st["env"]["status"] == "skipped" and "budget exhausted" in st["env"]["reason"]
    assert st["parity"]["status"] == "skipped" and "environment check failed" in st["parity"]["reason"]
    assert p.returncode == 1 and res["elapsed_s"] < 1  # nothing proven
