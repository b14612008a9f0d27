"""RewardManager: last-token placement, failure accounting, timeouts, crashed workers, plug-ins."""

import logging
import random
import textwrap
import time

import psutil
import pytest
import torch

from trainer.orphans import REAPER
from trainer.rewards.manager import RewardManager, load_custom_fn

CUSTOM = textwrap.dedent(
    """
    import math, os, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "raise":
            raise RuntimeError("scorer exploded")
        if solution_str == "sleep":
            time.sleep(120)
        if solution_str == "die":
            os._exit(3)
        if solution_str == "nan":
            return math.nan
        if solution_str == "nodict":
            return {"acc": 1.0}
        ok = solution_str == ground_truth
        return {"score": 2.0 if ok else -1.0, "acc": float(ok), "pred": solution_str}

    def as_float(data_source, solution_str, ground_truth, extra_info=None):
        return len(solution_str) / 10.0
    """
)


@pytest.fixture
def custom(tmp_path):
    p = tmp_path / "my_reward.py"
    p.write_text(CUSTOM)
    return str(p)


def sandbox_processes() -> list[int]:
    """Live processes running the code-sandbox harness."""
    pids = []
    for c in psutil.process_iter(["cmdline", "status"]):
        if c.info["status"] != psutil.STATUS_ZOMBIE and "_sandbox_harness.py" in " ".join(c.info["cmdline"] or []):
            pids.append(c.pid)
    return pids


def ones(b, t=4):
    return torch.ones(b, t)


# ---------------------------------------------------------------------------------------------
# placement (in-process: num_workers=0)
# ---------------------------------------------------------------------------------------------
def test_score_lands_on_the_last_valid_token(custom):
    m = RewardManager(num_workers=0, custom_path=custom, custom_name="as_float")
    mask = torch.tensor(
        [
            [1, 1, 1, 0, 0, 0],  # right padding: last valid index 2
            [1, 1, 0, 0, 1, 1],  # multi-turn, env tokens masked in the middle: last valid index 5
            [0, 0, 1, 1, 1, 0],  # left offset: last valid index 4
            [0, 0, 0, 0, 0, 0],  # empty: nothing placed, counted
            [1, 0, 0, 0, 0, 0],  # one token: index 0
        ]
    )
    resp = ["abc", "abcdef", "ab", "", "a"]  # as_float scores len/10: 0.3, 0.6, 0.2, 0.0, 0.1
    tls, metrics, extras = m.score(resp, ["x"] * 5, ["s"] * 5, None, mask)
    expected = torch.zeros(5, 6)
    expected[0, 2], expected[1, 5], expected[2, 4], expected[4, 0] = 0.3, 0.6, 0.2, 0.1
    torch.testing.assert_close(tls, expected)
    assert metrics["reward/empty_responses"] == 1.0
    torch.testing.assert_close(extras["scores"], torch.tensor([0.3, 0.6, 0.2, 0.0, 0.1]))
    torch.testing.assert_close(extras["acc"], extras["scores"])  # a bare number: acc = score


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_placement_matches_a_per_sample_loop(custom, seed):
    """Random ragged masks with holes; reference: a float64 Python loop over positions."""
    rng = random.Random(seed)
    b, t = 17, 13
    mask = torch.tensor([[float(rng.random() < 0.6) for _ in range(t)] for _ in range(b)])
    resp = ["x" * rng.randint(0, 20) for _ in range(b)]
    m = RewardManager(num_workers=0, custom_path=custom, custom_name="as_float")
    tls, _, _ = m.score(resp, [""] * b, ["s"] * b, [{}] * b, mask)
    ref = [[0.0] * t for _ in range(b)]
    for i in range(b):
        last = None
        for j in range(t):
            if mask[i, j] == 1:
                last = j
        if last is not None:
            ref[i][last] = len(resp[i]) / 10.0
    torch.testing.assert_close(tls.double(), torch.tensor(ref, dtype=torch.float64), atol=1e-6, rtol=0)


def test_in_process_errors_are_caught_and_counted(custom, caplog):
    m = RewardManager(num_workers=0, custom_path=custom)
    with caplog.at_level(logging.WARNING, logger="trainer.rewards.manager"):
        tls, metrics, extras = m.score(["a", "raise", "nan", "nodict", "b"], ["a", "a", "a", "a", "x"], ["s"] * 5, None, ones(5))
    # "a"==a -> 2.0; raise / nan / missing 'score' -> errors scored 0; "b"!="x" -> -1.0
    assert extras["scores"].tolist() == [2.0, 0.0, 0.0, 0.0, -1.0]
    assert extras["acc"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert metrics["reward/errors"] == 3.0 and metrics["reward/timeouts"] == 0.0
    assert [d["reward_status"] for d in extras["per_sample"]] == ["ok", "error", "error", "error", "ok"]
    assert extras["per_sample"][1] == {"pred": None, "reward_status": "error"}  # same keys in every dict
    # the first traceback is logged once, with the user's message in it
    assert caplog.text.count("Traceback") == 1 and "scorer exploded" in caplog.text


def test_builtin_dispatch_in_process():
    m = RewardManager(num_workers=0)
    tls, metrics, extras = m.score(
        ["46", "#### 7", "no"], ["46", "7", "3"], ["coxswain/arith", "openai/gsm8k", "coxswain/arith"], None, ones(3)
    )
    assert extras["scores"].tolist() == [1.0, 1.0, 0.0]
    assert metrics["reward/acc/coxswain/arith"] == 0.5 and metrics["reward/acc/openai/gsm8k"] == 1.0


def test_custom_function_errors_are_clear(tmp_path, custom):
    with pytest.raises(FileNotFoundError, match="no such file"):
        RewardManager(num_workers=0, custom_path=str(tmp_path / "nope.py"))
    with pytest.raises(AttributeError, match=r"has no function 'missing'.*'as_float', 'compute_score'"):
        RewardManager(num_workers=0, custom_path=custom, custom_name="missing")
    assert load_custom_fn(custom, "as_float")(data_source="", solution_str="abcd", ground_truth="") == 0.4


def test_batch_size_mismatch_is_an_error(custom):
    with pytest.raises(ValueError, match="batch sizes differ"):
        RewardManager(num_workers=0, custom_path=custom).score(["a"], ["a", "b"], ["s"], None, ones(1))


# ---------------------------------------------------------------------------------------------
# the process pool
# ---------------------------------------------------------------------------------------------
def test_pool_survives_raise_timeout_and_dead_worker(custom, caplog):
    """One batch with a raising, a hanging (past the 1 s timeout) and a worker-killing scorer among
    good samples: each bad one scores 0 and is counted, the good ones are scored correctly, nothing
    hangs, and the next batch runs on a replaced pool."""
    # children this process already had (under pytest-xdist a worker runs other modules first: wandb's
    # service process outlives its run, Ray's or a driver's reaper): the manager is judged only on its own
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    m = RewardManager(num_workers=2, timeout=1.0, custom_path=custom)
    try:
        resp = ["a", "raise", "b", "sleep", "c", "die", "d", "e"]
        gts = ["a", "a", "x", "a", "c", "a", "d", "q"]
        mask = ones(8, 5)
        mask[2, 3:] = 0  # last valid token of sample 2 is index 2
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="trainer.rewards.manager"):
            tls, metrics, extras = m.score(resp, gts, ["s"] * 8, None, mask)
        elapsed = time.monotonic() - t0
        # a: 2.0 | raise: 0 | b vs x: -1.0 | sleep: 0 (timeout) | c: 2.0 | die: 0 | d: 2.0 | e vs q: -1.0
        assert extras["scores"].tolist() == [2.0, 0.0, -1.0, 0.0, 2.0, 0.0, 2.0, -1.0]
        assert [d["reward_status"] for d in extras["per_sample"]] == ["ok", "error", "ok", "timeout", "ok", "error", "ok", "ok"]
        assert metrics["reward/errors"] == 3.0 and metrics["reward/timeouts"] == 1.0
        assert metrics["reward/worker_restarts"] >= 2.0  # one for the hang, one for the dead worker
        assert tls[2, 2] == -1.0 and tls[2].abs().sum() == 1.0
        assert "scorer exploded" in caplog.text and "timed out after 1.0 s" in caplog.text
        assert elapsed < 25, f"the batch took {elapsed:.1f} s"
        # the manager keeps working afterwards
        _, metrics2, extras2 = m.score(["a", "b", "c"], ["a", "b", "x"], ["s"] * 3, None, ones(3))
        assert extras2["scores"].tolist() == [2.0, 2.0, -1.0] and metrics2["reward/errors"] == 0.0
        procs = list(m._pool._processes.values())
    finally:
        m.close()
    for p in procs:
        p.join(timeout=5)
        assert not p.is_alive()
    # every worker ever started (including the killed ones) is gone; only multiprocessing's own
    # fork server and resource tracker remain (and torch's shared-memory manager, a daemon of this process
    # once any test shared a tensor between processes)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        kids = [c for c in psutil.Process().children(recursive=True) if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        # (and the run reaper an earlier test's driver set-up left watching this process: it ends with the suite)
        strays = [c for c in kids if c.pid not in before
                  and not any(k in " ".join(c.cmdline()) for k in ("forkserver", "resource_tracker", "torch_shm_manager"))
                  and REAPER not in c.cmdline()]
        if not strays:
            break
        time.sleep(0.1)
    assert strays == [], [c.cmdline() for c in strays]


def test_pool_builtin_scorers_match_in_process():
    resp = ["46", " 12 apples", "so #### 1,000", "\\boxed{0.5}", "<answer>(1+2)*3</answer>"]
    gts = ["46", "13", "1000", "\\frac{1}{2}", {"target": 9, "numbers": [1, 2, 3]}]
    ds = ["coxswain/arith", "coxswain/arith", "openai/gsm8k", "lighteval/MATH", "countdown"]
    with RewardManager(num_workers=2, timeout=30.0) as pooled:
        _, _, a = pooled.score(resp, gts, ds, None, ones(5))
    _, _, b = RewardManager(num_workers=0).score(resp, gts, ds, None, ones(5))
    # 46 ok | 12 != 13 | 1000 ok | 0.5 == 1/2 | (1+2)*3 = 9
    assert a["scores"].tolist() == b["scores"].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert a["per_sample"] == b["per_sample"]


def test_killed_worker_takes_its_code_sandbox_with_it():
    """The manager's timeout (1 s) fires before the sandbox's own wall clock (8 s): the worker is
    killed, and the parent-death signal / PID namespace take the sandboxed candidate down too."""
    hung = "```python\nimport time\ntime.sleep(300)\n```"
    with RewardManager(num_workers=1, timeout=1.0) as m:  # (a good sample too: an all-failed batch stops the run)
        _, metrics, extras = m.score([hung, "46"], [{"test_list": ["assert True"]}, "46"], ["mbpp", "coxswain/arith"],
                                     None, ones(2))
    assert metrics["reward/timeouts"] == 1.0 and extras["scores"].tolist() == [0.0, 1.0]
    deadline = time.monotonic() + 5
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sandbox_processes() == []
