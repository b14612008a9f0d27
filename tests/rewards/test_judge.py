"""The LLM-judge client against real HTTP servers on 127.0.0.1 (no mocks of the client).

A small aiohttp app, run in a thread, is scripted per request: 429 with Retry-After, 500, a hang past
the client's timeout, a malformed body, answers with the wrong number of labels, slow answers. The
server records when each request arrived, its headers and its JSON, so the tests assert the retries,
the waits between attempts (against the backoff formula, with generous upper tolerances for a loaded
machine; the lower bounds are exact because a sleep never ends early), the stricter-prompt retry, the
fallbacks, the log, and that nothing raises.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from email.utils import format_datetime
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.rewards.judge import (
    ChatClient,
    JudgeClient,
    TokenBucket,
    Trajectory,
    backoff_delay,
    build_judge_messages,
    parse_retry_after,
    parse_step_flags,
)

KEY_ENV = "COXSWAIN_TEST_JUDGE_KEY"
SECRET = "sk-test-9f8e7d6c5b4a"
SLACK = 2.0  # upper tolerance (s) for waits on a loaded 2-core machine


# --------------------------------------------------------------------------------------------------
# a scripted server
# --------------------------------------------------------------------------------------------------
from tests.support.scripted_judge import ScriptedServer, _completion, correct_answer, expected_flags


@pytest.fixture
def server_factory():
    made = []

    def make(script):
        s = ScriptedServer(script)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)


def _judge(url, **kw) -> JudgeClient:
    args = dict(api_key_env=KEY_ENV, concurrent=4, api_max_retries=4, request_timeout=5.0, backoff_base=0.1,
                backoff_max=2.0, retry_after_max=5.0, seed=0)
    args.update(kw)
    return JudgeClient(url, "judge-model", **args)


TRAJ3 = Trajectory("What is 12+34? Use the calculator.", [
    "I will call the calculator.",
    {"action": "calc(12+34)", "observation": "46"},
    "The answer is 46.",
], 1.0)


# --------------------------------------------------------------------------------------------------
# pure parts
# --------------------------------------------------------------------------------------------------
def test_backoff_delay_golden():
    # retry 3, base 0.5: b = min(30, 0.5 * 2^3) = 4; jitter 0.5, u = 0.5: d = 4 * (1 - 0.25) = 3.0
    assert backoff_delay(3, base=0.5, cap=30.0, jitter=0.5, u=0.5) == pytest.approx(3.0)
    # retry 10: b = min(30, 512) = 30; u = 0: d = 30
    assert backoff_delay(10, base=0.5, cap=30.0, jitter=0.5, u=0.0) == pytest.approx(30.0)
    # Retry-After 10 capped at 6 beats d = 3.0: wait 6
    assert backoff_delay(3, base=0.5, cap=30.0, jitter=0.5, u=0.5, retry_after=10, retry_after_max=6) == pytest.approx(6.0)
    # Retry-After 1 is below d = 3.0: the backoff stands
    assert backoff_delay(3, base=0.5, cap=30.0, jitter=0.5, u=0.5, retry_after=1, retry_after_max=6) == pytest.approx(3.0)


@settings(max_examples=300, deadline=None)
@given(retry=st.integers(0, 200), base=st.floats(1e-3, 5), cap=st.floats(1e-3, 100), jitter=st.floats(0, 1),
       u=st.floats(0, 1, exclude_max=True), ra=st.one_of(st.none(), st.floats(0, 1e5)), ra_max=st.floats(0, 100))
def test_backoff_delay_bounds(retry, base, cap, jitter, u, ra, ra_max):
    d = backoff_delay(retry, base=base, cap=cap, jitter=jitter, u=u, retry_after=ra, retry_after_max=ra_max)
    b = min(cap, base * 2.0 ** min(retry, 60))
    assert d <= max(cap, ra_max) + 1e-9  # bounded whatever the server asks
    assert d >= b * (1 - jitter) - 1e-9  # never below the jittered backoff
    assert d <= max(b, min(ra or 0.0, ra_max)) + 1e-9
    if ra is not None and ra > 0:
        assert d >= min(ra, ra_max) - 1e-9  # Retry-After honoured up to its cap


def test_parse_retry_after():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 1.5 ") == 1.5
    assert parse_retry_after("-4") == 0.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    now = datetime(2030, 1, 1, tzinfo=timezone.utc)
    date = format_datetime(now + timedelta(seconds=10), usegmt=True)
    assert parse_retry_after(date, now=now.timestamp()) == pytest.approx(10.0)
    assert parse_retry_after(format_datetime(now - timedelta(seconds=10), usegmt=True), now=now.timestamp()) == 0.0


@pytest.mark.parametrize("text,k,flags", [
    ("Step 1: GOOD\nStep 2: BAD\nStep 3: GOOD", 3, [1, -1, 1]),
    ("reasoning ...\n**Step 1 Judgment:** **BAD**\nStep 2 judgment: good", 2, [-1, 1]),  # markdown, any case
    ("Step 0: GOOD\nStep 1: BAD", 2, [1, -1]),  # AgentEvolver-style 0-based numbering
    ("Step 1: BAD\nStep 2: BAD\nFinal:\nStep 1: GOOD\nStep 2: BAD", 2, [1, -1]),  # restated: last wins
    ("GOOD\nBAD\nBAD", 3, [1, -1, -1]),  # bare labels, in order
    ("Step 1 Analysis: looked GOOD.\nStep 1: BAD", 1, [-1]),  # "Analysis:" prose is not a label
])
def test_parse_step_flags_ok(text, k, flags):
    assert parse_step_flags(text, k) == (flags, None)


@pytest.mark.parametrize("text,k", [
    ("Step 1: GOOD\nStep 2: BAD", 3),  # a step missing
    ("Step 1: GOOD\nStep 2: BAD\nStep 3: GOOD", 2),  # one too many
    ("Step 2: GOOD\nStep 3: BAD", 2),  # wrong numbering
    ("GOOD GOOD", 3),  # too few bare labels
    ("the steps were good", 1),  # lower-case prose is not a label
    ("", 2),
    (None, 2),
])
def test_parse_step_flags_rejects(text, k):
    flags, problem = parse_step_flags(text, k)
    assert flags is None and problem


def test_prompt_numbers_steps_and_states_outcome():
    sys_msg, user = build_judge_messages(TRAJ3.query, TRAJ3.steps, TRAJ3.score)
    assert sys_msg["role"] == "system" and user["role"] == "user"
    u = user["content"]
    assert "(3 in total)" in u and "### Step 1" in u and "### Step 3" in u and "### Step 4" not in u
    assert "Observation:\n46" in u and "+1.0000 (successful)" in u
    assert "EXACTLY" not in u
    strict = build_judge_messages(TRAJ3.query, TRAJ3.steps, -0.5, strict=True, problem="it had 2 labels")[1]["content"]
    assert "EXACTLY 3 lines" in strict and "it had 2 labels" in strict and "(failed)" in strict
    long = build_judge_messages("q", ["x" * 100], 0.0, max_step_chars=10)[1]["content"]
    assert "x" * 10 + "\n[... 90 more characters cut]" in long and "x" * 11 not in long


def test_token_bucket_spacing():
    # 6 acquires at 20/s with burst 1: the first is immediate, then 5 gaps of >= 1/20 s.
    async def run():
        b = TokenBucket(20.0, burst=1)
        times = []
        for _ in range(6):
            await b.acquire()
            times.append(time.monotonic())
        return times

    times = asyncio.run(run())
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= 0.05 - 1e-3
    assert times[-1] - times[0] >= 0.25 - 1e-3


# --------------------------------------------------------------------------------------------------
# against the scripted server
# --------------------------------------------------------------------------------------------------
def test_misbehaving_sequence(server_factory, tmp_path):
    """429 (Retry-After 1) -> 500 (body echoing the key) -> hang -> malformed JSON -> 2 labels for 3 steps
    -> the stricter prompt -> 2 labels again: 4 transport retries, 1 stricter retry, fallback."""
    script = [
        ("json", 429, {"error": {"message": "slow down"}}, {"Retry-After": "1"}),
        ("json", 500, {"error": {"message": f"internal; your key was {SECRET}"}}, None),
        ("hang", 30.0),
        ("raw", 200, '{"choices": [ {"message": '),
        ("reply", "Step 1: GOOD\nStep 2: BAD", 0),
        ("reply", "Step 1: GOOD\nStep 2: GOOD", 0),
    ]
    srv = server_factory(lambda i, body: script[i])
    judge = _judge(srv.url, concurrent=1, request_timeout=0.6, llm_evaluation_log_dir=str(tmp_path))
    t0 = time.monotonic()
    flags, m = judge.judge_batch([TRAJ3], global_step=7)
    elapsed = time.monotonic() - t0

    assert flags == [None]
    assert len(srv.requests) == 6
    assert m["adca/judge_http_requests"] == 6
    assert m["adca/judge_retries"] == 4  # attempts 2..5 of the first call
    assert m["adca/judge_calls"] == 2  # the first prompt and the stricter one
    assert m["adca/judge_format_retries"] == 1
    assert m["adca/judge_errors"] == 0  # both calls got an answer; it was unusable
    assert m["adca/judge_fallbacks"] == 1 and m["adca/judge_fallback_fraction"] == 1.0
    assert m["adca/judge_trajectories"] == 1

    # waits between arrivals (base 0.1, cap 2, jitter 0.5: retry r waits in [0.1 * 2^r / 2, 0.1 * 2^r]):
    g = srv.gaps()
    assert 1.0 <= g[0] <= 1.0 + SLACK  # 429: Retry-After 1 s beats the backoff of [0.05, 0.1]
    assert 0.1 <= g[1] <= 0.2 + SLACK  # 500: retry 1 -> [0.1, 0.2]
    assert 0.6 + 0.2 <= g[2] <= 0.6 + 0.4 + SLACK  # hang: the 0.6 s timeout, then retry 2 -> [0.2, 0.4]
    assert 0.4 <= g[3] <= 0.8 + SLACK  # malformed: retry 3 -> [0.4, 0.8]
    assert g[4] <= SLACK  # the stricter prompt goes out at once (no backoff for a format retry)
    assert elapsed <= 1.0 + 0.2 + 1.0 + 0.8 + 4 * SLACK

    # the first five requests carry the same (normal) prompt; only the sixth is the stricter one
    prompts = [r["body"]["messages"][-1]["content"] for r in srv.requests]
    assert all(p == prompts[0] for p in prompts[:5])
    assert "EXACTLY" not in prompts[0]
    assert "EXACTLY 3 lines" in prompts[5] and "labelled steps [1, 2]" in prompts[5]
    assert all(r["headers"].get("Authorization") == f"Bearer {SECRET}" for r in srv.requests)
    assert all(r["body"]["model"] == "judge-model" and r["body"]["temperature"] == 0.0 for r in srv.requests)

    # the log: one line per attempt (request, status, response / error) and one per parse; never the key
    text = open(judge.log_path, encoding="utf-8").read()
    assert SECRET not in text and "***" in text  # the 500 body echoed the key: scrubbed
    recs = [json.loads(line) for line in text.splitlines()]
    reqs = [r for r in recs if r["event"] == "request"]
    parsed = [r for r in recs if r["event"] == "parsed"]
    assert len(reqs) == 6 and len(parsed) == 2
    assert [r.get("status") for r in reqs] == [429, 500, None, 200, 200, 200]
    assert "timeout" in reqs[2]["error"] and "malformed" in reqs[3]["error"]
    assert reqs[0]["retry_after_s"] == 1.0 and reqs[0]["retry_in_s"] >= 1.0
    assert reqs[3]["response"] == '{"choices": [ {"message": '  # the raw body when it is not JSON
    assert reqs[4]["response"]["choices"][0]["message"]["content"] == "Step 1: GOOD\nStep 2: BAD"
    assert all(r["request"]["messages"] == srv.requests[i]["body"]["messages"] for i, r in enumerate(reqs))
    assert [r["kind"] for r in reqs] == ["judge"] * 5 + ["judge_strict"]
    assert all(r["global_step"] == 7 and r["trajectory"] == 0 for r in recs)
    assert parsed[0]["flags"] is None and parsed[1]["flags"] is None


def test_stricter_prompt_recovers(server_factory):
    # First answer has no labels; the stricter prompt gets a clean answer: no fallback.
    def script(i, body):
        return ("reply", "I think it went fine.", 0) if i == 0 else ("reply", correct_answer(body), 0)

    srv = server_factory(script)
    flags, m = _judge(srv.url).judge_batch([TRAJ3])
    assert flags == [expected_flags(3)]
    assert m["adca/judge_calls"] == 2 and m["adca/judge_format_retries"] == 1
    assert m["adca/judge_fallbacks"] == 0 and m["adca/judge_fallback_fraction"] == 0.0
    assert m["adca/judge_retries"] == 0 and m["adca/judge_errors"] == 0
    assert "no GOOD/BAD labels" in srv.requests[1]["body"]["messages"][-1]["content"]


def test_retries_exhausted_is_an_error_not_an_exception(server_factory):
    srv = server_factory(lambda i, body: ("json", 503, {"error": {"message": "down"}}, None))
    flags, m = _judge(srv.url, api_max_retries=2, backoff_base=0.01).judge_batch([TRAJ3, TRAJ3])
    assert flags == [None, None]
    assert len(srv.requests) == 2 * 3  # 1 + api_max_retries attempts each; no stricter prompt
    assert m["adca/judge_retries"] == 4 and m["adca/judge_errors"] == 2 and m["adca/judge_format_retries"] == 0
    assert m["adca/judge_calls"] == 2 and m["adca/judge_fallback_fraction"] == 1.0


def test_client_errors_are_not_retried(server_factory):
    srv = server_factory(lambda i, body: ("json", 400, {"error": {"message": "bad model"}}, None))
    judge = _judge(srv.url)
    flags, m = judge.judge_batch([TRAJ3])
    assert flags == [None] and len(srv.requests) == 1
    assert m["adca/judge_retries"] == 0 and m["adca/judge_errors"] == 1 and m["adca/judge_fallbacks"] == 1


def test_retry_after_is_capped(server_factory):
    # The server asks for 100 s; retry_after_max=0.3 bounds the wait.
    def script(i, body):
        return ("json", 429, {}, {"Retry-After": "100"}) if i == 0 else ("reply", correct_answer(body), 0)

    srv = server_factory(script)
    flags, m = _judge(srv.url, retry_after_max=0.3, backoff_base=0.01).judge_batch([TRAJ3])
    assert flags == [expected_flags(3)] and m["adca/judge_retries"] == 1
    assert 0.3 <= srv.gaps()[0] <= 0.3 + SLACK


def test_connection_refused_is_retried_then_counted():
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = _judge(f"http://127.0.0.1:{port}/v1", api_max_retries=2, backoff_base=0.01)
    flags, m = judge.judge_batch([TRAJ3])
    assert flags == [None]
    assert m["adca/judge_http_requests"] == 3 and m["adca/judge_retries"] == 2
    assert m["adca/judge_errors"] == 1 and m["adca/judge_fallbacks"] == 1


def test_concurrency_limit_and_results(server_factory):
    # 9 trajectories of 1..9 steps, concurrent=3, each answer takes 0.25 s: never more than 3 in flight,
    # and every trajectory gets its own flags back in order.
    srv = server_factory(lambda i, body: ("reply", correct_answer(body), 0.25))
    trajs = [Trajectory(f"task {k}", [f"step {j}" for j in range(k)], float(k % 2)) for k in range(1, 10)]
    t0 = time.monotonic()
    flags, m = _judge(srv.url, concurrent=3).judge_batch(trajs)
    elapsed = time.monotonic() - t0
    assert flags == [expected_flags(k) for k in range(1, 10)]
    assert srv.max_in_flight == 3
    assert elapsed >= 3 * 0.25  # 9 requests, 3 at a time, 0.25 s each
    assert m["adca/judge_calls"] == 9 and m["adca/judge_fallback_fraction"] == 0.0
    assert 0.25 <= m["adca/judge_latency_mean_s"] <= m["adca/judge_latency_max_s"] <= elapsed


def test_rate_limit_spaces_requests(server_factory):
    # 5 requests at 10/s (burst 1) with 5 allowed in flight: arrivals at least ~0.1 s apart.
    srv = server_factory(lambda i, body: ("reply", correct_answer(body), 0))
    flags, _ = _judge(srv.url, concurrent=5, rate_limit_per_s=10.0).judge_batch([TRAJ3] * 5)
    assert flags == [expected_flags(3)] * 5
    ts = sorted(r["t"] for r in srv.requests)
    assert ts[-1] - ts[0] >= 0.4 - 0.02  # 4 gaps of 0.1 s (server clock vs client clock: small slack)
    assert min(b - a for a, b in zip(ts, ts[1:])) >= 0.1 - 0.02


def test_bad_inputs_never_raise(server_factory):
    srv = server_factory(lambda i, body: ("reply", correct_answer(body), 0))
    trajs = [
        TRAJ3,
        Trajectory("no steps", [], 1.0),  # nothing to judge: [] and no call
        {"query": "a mapping", "steps": ["one", "two"], "score": -1.0},
        {"query": "no steps key", "score": 1.0},  # unreadable
        42,  # not a trajectory at all
    ]
    flags, m = _judge(srv.url).judge_batch(trajs)
    assert flags == [expected_flags(3), [], expected_flags(2), None, None]
    assert len(srv.requests) == 2
    assert m["adca/judge_trajectories"] == 4 and m["adca/judge_errors"] == 2 and m["adca/judge_fallbacks"] == 2
    assert m["adca/judge_fallback_fraction"] == 0.5


def test_judge_batch_inside_a_running_loop(server_factory):
    # A caller that is itself async (an async Ray actor) can use the sync wrapper.
    srv = server_factory(lambda i, body: ("reply", correct_answer(body), 0))

    async def caller():
        return _judge(srv.url).judge_batch([TRAJ3])

    flags, m = asyncio.run(caller())
    assert flags == [expected_flags(3)] and m["adca/judge_calls"] == 1


def test_no_key_env_sends_no_header(server_factory, monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    srv = server_factory(lambda i, body: ("reply", correct_answer(body), 0))
    flags, _ = _judge(srv.url).judge_batch([TRAJ3])
    assert flags == [expected_flags(3)] and "Authorization" not in srv.requests[0]["headers"]


def test_chat_client_direct(server_factory):
    # The transport alone, with per-call parameters merged over the defaults.
    srv = server_factory(lambda i, body: ("reply", f"echo {body['max_tokens']}", 0))

    async def run():
        async with ChatClient(srv.url, "m", api_key_env=KEY_ENV, default_params={"temperature": 0.5}) as c:
            return await c.chat([{"role": "user", "content": "hi"}], max_tokens=7)

    r = asyncio.run(run())
    assert r.ok and r.text == "echo 7" and r.status == 200 and r.attempts == 1
    assert srv.requests[0]["body"] == {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                       "temperature": 0.5, "max_tokens": 7}


def test_from_config_reads_the_adca_section(tmp_path):
    from trainer.config import AdcaConfig

    cfg = AdcaConfig(model="qwen-max", base_url="http://127.0.0.1:1/v1", api_key_env=KEY_ENV, concurrent=3,
                     api_max_retries=2, request_timeout=9.0, rate_limit_per_s=4.0, llm_evaluation_log_dir=str(tmp_path))
    j = JudgeClient.from_config(cfg)
    c = j.client
    assert (c.url, c.model, c.concurrent, c.max_retries, c.request_timeout, c.rate_limit_per_s) == (
        "http://127.0.0.1:1/v1/chat/completions", "qwen-max", 3, 2, 9.0, 4.0)
    assert os.path.dirname(j.log_path) == str(tmp_path)
    # the AgentEvolver recipe's variable name is the default
    assert AdcaConfig().api_key_env == "DASHSCOPE_API_KEY"
    assert JudgeClient.from_config({"base_url": "http://x/v1", "model": "m"}).client.api_key_env == "DASHSCOPE_API_KEY"
