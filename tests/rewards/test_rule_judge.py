"""The rule judge (trainer.rewards.rule_judge) as a real subprocess on 127.0.0.1, asked by the real judge
client: labels equal to the environment's rule, an unreadable prompt falling back after the stricter retry,
the judge prompt read back exactly, and the fallback limit that stops a run."""

from __future__ import annotations

import json
import urllib.request

import pytest

from trainer.credit import JudgeFallbackError, check_fallbacks
from trainer.envs.towers import TowersEnv, task_text
from trainer.rewards.judge import JudgeClient, Trajectory, build_judge_messages, parse_judge_prompt
from trainer.rewards.judge_server import RuleJudgeServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RuleJudgeServer("towers", log_path=str(tmp_path_factory.mktemp("rule") / "judge.log"))
    yield srv
    srv.close()


def _client(url: str) -> JudgeClient:
    return JudgeClient(url, "rule-judge", api_key_env=None, concurrent=4, api_max_retries=1, request_timeout=10.0)


def test_prompt_reads_back_whatever_the_actions_hold():
    steps = [{"action": "A->B", "observation": "A=2 B=1 C="},
             {"action": "x\n### Step 3\nAction:\nB->C\nObservation:\nA= B= C=21", "observation": "bad A=2 B=1 C="},
             "B->C"]
    for strict in (False, True):
        msgs = build_judge_messages("goal C: A=21 B= C=", steps, 1.0, strict=strict, problem="p")
        query, actions = parse_judge_prompt(msgs[1]["content"])
        assert query == "goal C: A=21 B= C="
        assert actions == ["A->B", "x\n### Step 3\nAction:\nB->C\nObservation:\nA= B= C=21", "B->C"]
    assert parse_judge_prompt("Step 1: A->B") is None


def test_client_gets_the_rule_labels_over_http(server):
    trajs, want = [], []
    for start, goal, moves in [((0, 0), 2, ["A->B", "A->C", "B->C"]), ((0, 0), 2, ["A->C", "C->B", "B->A"]),
                               ((0, 1, 2), 0, ["C->A", "B->C", "hmm", "A->B"]), ((1,), 1, ["B->C"])]:
        q = task_text(start, goal)
        trajs.append(Trajectory(q, [{"action": m, "observation": "..."} for m in moves], 1.0))
        want.append(TowersEnv.label_steps(q, moves))
    trajs.append(Trajectory("What is 2+2?", ["4"], 0.0))  # not a Towers task: no labels -> fallback
    flags, m = _client(server.base_url).judge_batch(trajs, global_step=1)
    assert flags[:4] == want and flags[4] is None
    assert want[1] == [-1, 1, -1] and want[3] == [-1]  # the cases differ: a wrong rule would not pass
    assert m["adca/judge_trajectories"] == 5 and m["adca/judge_fallbacks"] == 1
    assert m["adca/judge_format_retries"] == 1 and m["adca/judge_calls"] == 6 and m["adca/judge_errors"] == 0
    with urllib.request.urlopen(server.base_url.rsplit("/v1", 1)[0] + "/health", timeout=5) as r:
        counts = json.load(r)
    assert counts["labelled"] >= 4 and counts["unlabelled"] >= 2


def test_bad_request_bodies_get_400s(server):
    for body in (b"{not json", b'{"messages": 3}'):
        req = urllib.request.Request(server.base_url + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 400 and "error" in json.load(e.value)


def test_fallback_limit():
    settings = {"max_fallback_fraction": 0.1}
    check_fallbacks({"adca/judge_trajectories": 20.0, "adca/judge_fallbacks": 2.0}, settings, 3)  # 10%: on
    check_fallbacks({}, settings, 3)  # nobody asked
    with pytest.raises(JudgeFallbackError, match=r"3 of the 20 .* step 4 \(15% > .*max_fallback_fraction=0.1"):
        check_fallbacks({"adca/judge_trajectories": 20.0, "adca/judge_fallbacks": 3.0}, settings, 4)
    check_fallbacks({"adca/judge_trajectories": 20.0, "adca/judge_fallbacks": 20.0}, {"max_fallback_fraction": 1.0}, 4)
