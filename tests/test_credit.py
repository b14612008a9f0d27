"""ADCA-GRPO in the loop (trainer/credit.py): which samples the judge is asked about, what it is shown,
where its flags land, the outcome-only fallback, and 3-step runs with a real judge server.

The judge is a real JudgeClient over HTTP: the scripted OpenAI-compatible server (tests/support/scripted_judge.py,
standing in for the paid API) or ``python -m trainer.serve`` on the shipped tiny model."""

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from tests.support.scripted_judge import ScriptedServer, correct_answer, expected_flags
from trainer.algos.adca import compute_adca_grpo_advantage
from trainer.generation import val_core_acc
from trainer.batch import RolloutBatch
from tests.support.tiny import tiny_config
from trainer.credit import JudgeFallbackError, adca_advantages, steps_from_messages
from trainer.rewards.judge import JudgeClient

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")


def adca_cfg(**over):
    cfg = tiny_config([f"attribution_driven_credit_assignment.{k}={v}" for k, v in over.items()])
    return cfg.attribution_driven_credit_assignment


def judge_for(url, **kw):
    return JudgeClient(url, "judge", api_key_env=None, concurrent=4, api_max_retries=1, request_timeout=10.0,
                       backoff_base=0.05, backoff_max=0.2, **kw)


# Two groups x 3 trajectories with 1-3 assistant steps. Row layout (T = 8): an assistant step's tokens
# carry its step id and mask 1; an environment turn's tokens carry -1 and mask 0.
#   row 0 (g0, score 1): step 0 x2, env x2, step 1 x2          K=2
#   row 1 (g0, score 0): step 0 x3                              K=1
#   row 2 (g0, score 1): step 0, env, step 1, env, step 2 x2    K=3
#   rows 3-5 (g1, score 0 each): one step of 2 tokens           K=1 (a constant group)
STEPS = [[0, 0, -1, -1, 1, 1, -9, -9], [0, 0, 0, -9, -9, -9, -9, -9], [0, -1, 1, -1, 2, 2, -9, -9],
         [0, 0, -9, -9, -9, -9, -9, -9], [0, 0, -9, -9, -9, -9, -9, -9], [0, 0, -9, -9, -9, -9, -9, -9]]
SCORES = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
MESSAGES = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "task A"},
     {"role": "assistant", "content": "a0"}, {"role": "tool", "content": "obs0"}, {"role": "assistant", "content": "a1"}],
    [{"role": "user", "content": "task A"}, {"role": "assistant", "content": "b0"}],
    [{"role": "user", "content": "task A"}, {"role": "assistant", "content": "c0"}, {"role": "user", "content": "o1"},
     {"role": "assistant", "content": "c1"}, {"role": "user", "content": "o2"}, {"role": "assistant", "content": "c2"}],
] + [[{"role": "user", "content": "task B"}, {"role": "assistant", "content": f"d{i}"}] for i in range(3)]


def make_batch():
    sid = torch.tensor(STEPS)  # [6, 8]; -9 marks padding
    att = sid != -9
    loss = sid >= 0
    step_ids = torch.where(loss, sid, -1)
    b = len(STEPS)
    scores = torch.tensor(SCORES)
    last = att.sum(1) - 1
    tlr = torch.zeros(b, 8)
    tlr[torch.arange(b), last] = scores  # the score sits at the last response token (an env token in none here)
    return RolloutBatch.from_tokens(
        torch.ones(b, 2, dtype=torch.long), torch.full((b, 8), 5, dtype=torch.long), torch.ones(b, 2), att,
        response_mask=loss, meta={"messages": MESSAGES}, step_ids=step_ids, token_level_rewards=tlr,
        group_ids=torch.tensor([0, 0, 0, 1, 1, 1]))


def test_steps_from_messages():
    q, steps = steps_from_messages(MESSAGES[0], 2)
    assert q == "task A"  # the system prompt is not the task; the user's first message is
    assert steps == [{"action": "a0", "observation": "[tool] obs0"}, {"action": "a1", "observation": ""}]
    q, steps = steps_from_messages(MESSAGES[2], 3)
    assert [s["observation"] for s in steps] == ["o1", "o2", ""]
    # a budget-cut trajectory: step ids name 2 steps, the judge is asked about exactly those 2
    assert len(steps_from_messages(MESSAGES[2], 2)[1]) == 2


def test_flags_land_on_the_asked_rows_and_tokens():
    srv = ScriptedServer(lambda i, body: ("reply", correct_answer(body), 0))
    try:
        batch = make_batch()
        adv, ret, m = adca_advantages(batch, None, judge_for(srv.url), adca_cfg(), global_step=1)
    finally:
        srv.close()
    # skip_small_adv: group 1 has constant scores (outcome advantage 0): only rows 0-2 are asked
    assert len(srv.requests) == 3
    shown = sorted(r["body"]["messages"][-1]["content"] for r in srv.requests)
    assert all("task A" in s for s in shown)
    assert any("a0" in s and "obs0" in s and "a1" in s for s in shown)  # the action and what the tool answered
    # reference: the fusion called directly with the flags the scripted judge gives (odd steps GOOD)
    k = [2, 1, 3, 1, 1, 1]
    flags = [expected_flags(k[i]) if i < 3 else [] for i in range(6)]
    ref_adv, _, _ = compute_adca_grpo_advantage(
        step_flags=flags, index=batch.group_ids, step_ids=batch.step_ids, response_mask=batch.response_mask,
        outcome_scores=torch.tensor(SCORES, dtype=torch.float64), num_steps=torch.tensor(k),
        use_prm=torch.tensor([True, True, True, False, False, False]), fix_base=0.2, alpha=0.1, beta=1.0)
    torch.testing.assert_close(adv, ref_adv.float(), rtol=0, atol=1e-6)
    assert torch.equal(adv, ret)
    assert (adv[~batch.response_mask.bool()] == 0).all()  # env tokens and padding get no credit
    assert (adv[3:] == 0).all()  # the constant group: outcome term 0, not asked
    # step rewards differ within row 2 (GOOD, BAD, GOOD): the per-step advantages are not all equal
    assert len({round(float(x), 6) for x in adv[2][batch.response_mask[2].bool()]}) == 3
    assert m["adca/skipped_fraction"] == pytest.approx(0.5)
    assert m["adca/judge_fallback_fraction"] == 0.0
    assert m["adca/good_fraction"] == pytest.approx(4 / 6)  # flags [G,B], [G], [G,B,G]


def test_unusable_judge_falls_back_to_outcome_only_credit():
    srv = ScriptedServer(lambda i, body: ("reply", "I cannot decide.", 0))
    try:
        adv, _, m = adca_advantages(make_batch(), None, judge_for(srv.url), adca_cfg(max_fallback_fraction=1),
                                    global_step=1)
        # by default (max_fallback_fraction=0.1) a judge that labels nothing stops the run, naming the counts
        with pytest.raises(JudgeFallbackError, match=r"3 of the 3 trajectories .* at step 5 \(100% > "):
            adca_advantages(make_batch(), None, judge_for(srv.url), adca_cfg(), global_step=5)
    finally:
        srv.close()
    assert len(srv.requests) == 12  # each of the 3 asked rows, twice: the first prompt and the stricter retry
    # group 0 scores [1, 0, 1]: mean 2/3, population std sqrt(2/9) -> o = [1/sqrt2, -sqrt2, 1/sqrt2];
    # outcome-only credit under last_step gives every token of the row beta * o_i (beta = 1)
    o = [1 / math.sqrt(2), -math.sqrt(2), 1 / math.sqrt(2)]
    mask = make_batch().response_mask.bool()
    for i in range(3):
        assert torch.allclose(adv[i][mask[i]], torch.full_like(adv[i][mask[i]], o[i]), atol=1e-5)
    assert m["adca/judge_fallback_fraction"] == 1.0 and m["adca/judge_fallbacks"] == 3.0
    assert m["adca/prm_fraction"] == 0.0


def test_skip_types_and_prm_steps():
    srv = ScriptedServer(lambda i, body: ("reply", correct_answer(body), 0))
    try:
        _, _, m = adca_advantages(make_batch(), None, judge_for(srv.url), adca_cfg(skip_type="none"), global_step=1)
        assert len(srv.requests) == 6 and m["adca/skipped_fraction"] == 0.0
        _, _, m = adca_advantages(make_batch(), None, judge_for(srv.url), adca_cfg(skip_type="skip_all_neg"),
                                  global_step=1)
        assert len(srv.requests) == 6 + 2  # only the two positive-score rows
        n = len(srv.requests)
        adv, _, m = adca_advantages(make_batch(), None, judge_for(srv.url),
                                    adca_cfg(skip_type="none", **{"adca_grpo.prm_steps": 3}), global_step=3)
        assert len(srv.requests) == n and m["adca/prm_fraction"] == 0.0  # attribution is off from step 3 on
        # the seed's epoch gate (adca_grpo.prm_epoch): on in data epochs < prm_epoch, off from then on
        cfg2 = adca_cfg(skip_type="none", **{"adca_grpo.prm_epoch": 2})
        adca_advantages(make_batch(), None, judge_for(srv.url), cfg2, global_step=5, epoch=2)
        assert len(srv.requests) == n
        adca_advantages(make_batch(), None, judge_for(srv.url), cfg2, global_step=5, epoch=1)
        assert len(srv.requests) == n + 6
    finally:
        srv.close()


def _shown_scores(requests) -> list[float]:
    return sorted(float(re.search(r"Outcome score: ([-+][0-9.]+)", r["body"]["messages"][-1]["content"]).group(1))
                  for r in requests)


def test_overall_score_source():
    """The seed's overall_score_source: the judge sees the outcome (token_level_rewards, the seed
    trainer's choice) or verl's GRPO advantage (advantages): group 0's scores [1, 0, 1] have mean 2/3 and
    unbiased std sqrt(1/3), so A = (1/3 | -2/3) / sqrt(1/3); the constant group 1 is 0."""
    srv = ScriptedServer(lambda i, body: ("reply", correct_answer(body), 0))
    try:
        adca_advantages(make_batch(), None, judge_for(srv.url), adca_cfg(skip_type="none"), global_step=1)
        assert _shown_scores(srv.requests) == sorted(SCORES)
        n = len(srv.requests)
        adca_advantages(make_batch(), None, judge_for(srv.url),
                        adca_cfg(skip_type="none", overall_score_source="advantages"), global_step=1)
        s = math.sqrt(1 / 3)
        want = sorted([(1 / 3) / s, -(2 / 3) / s, (1 / 3) / s, 0.0, 0.0, 0.0])
        assert _shown_scores(srv.requests[n:]) == pytest.approx(want, abs=2e-4)
    finally:
        srv.close()


def test_single_turn_batch_is_one_step_per_response():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    prompt = tok("12+3=", return_tensors="pt").input_ids
    resp = tok("15", return_tensors="pt").input_ids
    b = 4
    batch = RolloutBatch.from_tokens(prompt.repeat(b, 1), resp.repeat(b, 1), torch.ones(b, prompt.shape[1]),
                                     torch.ones(b, resp.shape[1]), group_ids=torch.tensor([0, 0, 1, 1]),
                                     token_level_rewards=torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    srv = ScriptedServer(lambda i, body: ("reply", correct_answer(body), 0))
    try:
        adv, _, m = adca_advantages(batch, tok, judge_for(srv.url), adca_cfg(), global_step=1)
    finally:
        srv.close()
    assert len(srv.requests) == 4
    body = srv.requests[0]["body"]["messages"][-1]["content"]
    assert "12+3=" in body and "(1 in total)" in body and "15" in body
    assert batch.step_ids.tolist() == [[0, 0]] * 4
    assert m["adca/good_fraction"] == 1.0  # one step each, step 1 is GOOD in the script


# --------------------------------------------------------------------------------------------------
# in the loop
# --------------------------------------------------------------------------------------------------
BASE = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_response_length=6", f"actor_rollout_ref.model.path={TINY}", "trainer.logger=[console]",
        "trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "attribution_driven_credit_assignment.enable=true", "attribution_driven_credit_assignment.skip_type=none",
        "attribution_driven_credit_assignment.judge_max_tokens=12"]


@pytest.fixture(scope="module", autouse=True)
def _ray(shared_ray):
    yield  # one embedded Ray cluster for the module's runs (tests/conftest.py: shared_ray)


@pytest.mark.slow
def test_three_step_adca_run_with_an_api_judge(tmp_path, monkeypatch):
    """evaluation_type=api against an OpenAI-compatible endpoint with a key from the environment."""
    from trainer.main import train

    monkeypatch.setenv("COXSWAIN_TEST_JUDGE_KEY", "sk-judge-test")
    srv = ScriptedServer(lambda i, body: ("reply", correct_answer(body), 0))
    try:
        cfg = tiny_config(BASE + [f"trainer.default_local_dir={tmp_path / 'run'}",
                                  f"attribution_driven_credit_assignment.base_url={srv.url}",
                                  "attribution_driven_credit_assignment.api_key_env=COXSWAIN_TEST_JUDGE_KEY"])
        hist = train(cfg)["history"]
    finally:
        srv.close()
    assert len(srv.requests) == 3 * 16
    assert all(r["headers"]["Authorization"] == "Bearer sk-judge-test" for r in srv.requests)
    for h in hist:
        assert h["adca/judge_fallback_fraction"] == 0.0 and h["adca/good_fraction"] == 1.0
    # the key never reaches the run directory (config, metrics)
    run_dir = Path(cfg.trainer.default_local_dir)
    for p in run_dir.rglob("*"):
        if p.is_file() and p.suffix in (".yaml", ".json", ".jsonl", ".txt", ".log"):
            assert "sk-judge-test" not in p.read_text(errors="ignore"), p


@pytest.mark.slow
def test_a_judge_that_labels_nothing_stops_the_run(tmp_path):
    """max_fallback_fraction (0.1) in the loop: a judge whose every answer is unusable stops the run at its first
    step with JudgeFallbackError (the CLI's anticipated failures print its message alone)."""
    from trainer.main import _anticipated, train

    srv = ScriptedServer(lambda i, body: ("reply", "I would rather not say.", 0))
    try:
        cfg = tiny_config(BASE + [f"trainer.default_local_dir={tmp_path / 'run'}",
                                  f"attribution_driven_credit_assignment.base_url={srv.url}",
                                  "attribution_driven_credit_assignment.api_key_env=COXSWAIN_UNSET_KEY"])
        with pytest.raises(JudgeFallbackError, match=r"16 of the 16 trajectories .* at step 1 ") as e:
            train(cfg)
    finally:
        srv.close()
    assert isinstance(e.value, _anticipated()) and len(srv.requests) == 32


# --------------------------------------------------------------------------------------------------
# multi-turn: the agent loop in the controller, with ADCA
# --------------------------------------------------------------------------------------------------
AGENT = str(ROOT / "recipes" / "cpu" / "tiny_agent_model")
MT = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
      f"actor_rollout_ref.model.path={AGENT}", "trainer.logger=[console]", "trainer.total_training_steps=3",
      "trainer.test_freq=3", "trainer.val_before_train=false", "data.val_batch_size=8",
      "data.max_prompt_length=384", "data.max_response_length=192",
      "actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
      "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=24",
      "attribution_driven_credit_assignment.enable=true", "attribution_driven_credit_assignment.skip_type=none",
      "attribution_driven_credit_assignment.judge_max_tokens=12"]


@pytest.mark.slow
def test_multi_turn_adca_run_on_hanoi_with_an_api_judge(tmp_path):
    """3 ADCA-GRPO steps of the Tower-of-Hanoi environment through the agent loop; the judge labels odd
    steps GOOD, so the fusion's GOOD fraction and the per-step advantages are predictable."""
    from trainer.main import train

    srv = ScriptedServer(lambda i, body: ("reply", correct_answer(body), 0))
    try:
        cfg = tiny_config(MT + [f"trainer.default_local_dir={tmp_path / 'run'}",
                                "actor_rollout_ref.rollout.multi_turn.environment=hanoi",
                                f"attribution_driven_credit_assignment.base_url={srv.url}",
                                "attribution_driven_credit_assignment.api_key_env=COXSWAIN_UNSET_KEY"])
        hist = train(cfg)["history"]
    finally:
        srv.close()
    assert [h["step"] for h in hist] == [1, 2, 3] and val_core_acc(hist[-1]) is not None
    steps_asked = 0
    for h in hist:
        assert h["multi_turn/turns_mean"] > 1.0  # real multi-turn episodes
        assert 0.0 < h["multi_turn/context_token_fraction"] < 1.0  # environment turns sit in the response, unmasked
        assert h["adca/judge_trajectories"] == 16 and h["adca/judge_fallback_fraction"] == 0.0
        # odd steps GOOD: with K steps, ceil(K/2) of K are GOOD, so the fraction is in [1/2, 1]
        assert 0.5 <= h["adca/good_fraction"] <= 1.0 and h["adca/mean_steps"] > 1.0
        assert math.isfinite(h["actor/pg_loss"]) and h["sync/verified"] == 1.0
    # what the judge saw: the Hanoi task and numbered steps, each with the environment's feedback
    for r in srv.requests:
        text = r["body"]["messages"][-1]["content"]
        k = int(re.search(r"\((\d+) in total\)", text).group(1))
        steps_asked += k
        assert "Tower of Hanoi" in text
    assert steps_asked > 16 * 3  # more than one step per trajectory on average


@pytest.mark.slow
def test_multi_turn_adca_run_on_the_calculator_with_the_local_judge(tmp_path):
    """The calculator-tool environment with the local trainer.serve judge (the agent model itself), 3 steps:
    the whole path runs; whatever the tiny judge answers, each trajectory gets flags or falls back, and every
    request and answer is in the judge's JSONL log. (The single-turn run with the local judge that was its own
    test repeated this one's judge path: the suite's time.)"""
    from trainer.main import train

    log_dir = tmp_path / "judge_log"
    cfg = tiny_config(MT + [f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.test_freq=-1",
                            "data.max_prompt_length=640", "actor_rollout_ref.rollout.multi_turn.environment=calculator",
                            "attribution_driven_credit_assignment.evaluation_type=local",
                            "attribution_driven_credit_assignment.max_fallback_fraction=1",  # the tiny judge rambles
                            f"attribution_driven_credit_assignment.llm_evaluation_log_dir={log_dir}"])
    hist = train(cfg)["history"]
    assert [h["step"] for h in hist] == [1, 2, 3]
    for h in hist:
        # every one of the 16 responses was put to the judge (skip_type=none), each once or twice
        assert h["adca/judge_trajectories"] == 16 and 16 <= h["adca/judge_calls"] <= 32
        assert h["adca/judge_fallbacks"] + round(h["adca/prm_fraction"] * 16) == 16
        assert 0.0 <= h["adca/judge_fallback_fraction"] <= 1.0 and math.isfinite(h["actor/pg_loss"])
    # every request and response is in the JSONL log, with the local server's answers
    recs = [json.loads(line) for f in os.listdir(log_dir) for line in open(log_dir / f)]
    assert sum(r.get("event") == "parsed" for r in recs) == sum(h["adca/judge_calls"] for h in hist)
    assert (Path(cfg.trainer.default_local_dir) / "judge_server.log").exists()
