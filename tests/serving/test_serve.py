"""``python -m trainer.serve`` with the shipped tiny model, started as a real subprocess on 127.0.0.1.

The reference for every answer is the native engine run in this process on the same checkpoint: the
server must return exactly what ``NativeEngine.generate`` returns for the same tokens (greedy, and
seeded sampling), whatever else it is batching at the time. Queried with plain HTTP (aiohttp) and
with the judge client (``trainer/rewards/judge.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import aiohttp

from trainer.rewards.judge import ChatClient, JudgeClient, Trajectory, build_judge_messages

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "recipes" / "cpu" / "tiny_model"
KEY_ENV = "COXSWAIN_TEST_SERVE_KEY"
KEY = "serve-test-key-31415"
MAX_SEQ_LEN = 128  # the judge prompt's digits and signs need more than the model's 64 positions
EOS = 1


@pytest.fixture(scope="module")
def server():
    env = dict(os.environ, **{KEY_ENV: KEY, "PYTHONUNBUFFERED": "1"})
    cmd = [sys.executable, "-m", "trainer.serve", "--model", str(MODEL), "--port", "0", "--threads", "1",
           "--api-key-env", KEY_ENV, "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch-size", "32",
           "--batch-wait-ms", "50"]  # a wide window: concurrent test requests share engine calls
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, lines = None, []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("coxswain-serve: listening on "):
            url = line.split()[3]
            break
    if url is None:
        proc.kill()
        raise RuntimeError("server did not start:\n" + "".join(lines))
    yield url
    proc.terminate()
    try:
        assert proc.wait(30) == 0, "the server did not exit cleanly on SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def engine():
    from trainer.rollout.native import NativeEngine

    return NativeEngine(str(MODEL), max_batch_size=8, max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL))


def ids_of(tok, text):
    return list(tok(text, add_special_tokens=True)["input_ids"])


def reference(engine, tok, prompt_ids, *, max_new_tokens, temperature=0.0, n=1, seed=None):
    """(texts, finish_reasons, logprobs of the text tokens) from the engine, as the server should answer."""
    from trainer.rollout.engine import SamplingParams

    outs = engine.generate([prompt_ids], SamplingParams(n=n, temperature=temperature, seed=seed,
                                                        max_new_tokens=max_new_tokens, stop_token_ids=(EOS,)))[0]
    texts, finishes, lps = [], [], []
    for o in outs:
        ids, lp = o.token_ids, o.logprobs
        if o.finish_reason == "stop":
            ids, lp = ids[:-1], lp[:-1]  # the EOS ended it: not text
        texts.append(tok.decode(ids, skip_special_tokens=True))
        finishes.append(o.finish_reason)
        lps.append(lp)
    return texts, finishes, lps


def post(url, path, body, key=KEY):
    async def run():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with aiohttp.ClientSession() as s:
            async with s.post(url + path, json=body, headers=headers) as r:
                return r.status, await r.json()

    return asyncio.run(run())


def get(url, path, key=KEY):
    async def run():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with aiohttp.ClientSession() as s:
            async with s.get(url + path, headers=headers) as r:
                return r.status, await r.json()

    return asyncio.run(run())


PROMPTS = ["12+34=", "7*8=", "99-5=", "3+3=", "45+67=", "8*9=", "100-1=", "5*5="]


# --------------------------------------------------------------------------------------------------
def test_health_and_models(server):
    status, h = get(server, "/../health", key=None)  # no key needed
    assert status == 200 and h["status"] == "ok" and h["model"] == "tiny_model"
    status, m = get(server, "/models")
    assert status == 200 and [d["id"] for d in m["data"]] == ["tiny_model"] and m["data"][0]["max_model_len"] == MAX_SEQ_LEN


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_key_required(server, key):
    msgs = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}
    for path, body in (("/chat/completions", msgs), ("/completions", {"prompt": "1+1=", "max_tokens": 2})):
        status, err = post(server, path, body, key=key)
        assert status == 401 and err["error"]["type"] == "authentication_error"
    assert get(server, "/models", key=key)[0] == 401


def test_chat_greedy_equals_engine(server, engine, tok):
    for prompt in PROMPTS[:4]:
        # the tiny model's chat template concatenates the contents, so the prompt ids are the plain ones
        want, fin, lps = reference(engine, tok, ids_of(tok, prompt), max_new_tokens=10)
        status, r = post(server, "/chat/completions", {"model": "tiny_model", "messages": [{"role": "user", "content": prompt}],
                                                       "temperature": 0, "max_tokens": 10, "logprobs": True})
        assert status == 200, r
        c = r["choices"][0]
        assert c["message"] == {"role": "assistant", "content": want[0]}
        assert c["finish_reason"] == fin[0]
        got_lp = [e["logprob"] for e in c["logprobs"]["content"]]
        assert "".join(e["token"] for e in c["logprobs"]["content"]) == want[0]
        assert got_lp == pytest.approx(lps[0], abs=1e-5)
        n_gen = len(lps[0]) + (fin[0] == "stop")
        assert r["usage"] == {"prompt_tokens": len(ids_of(tok, prompt)), "completion_tokens": n_gen,
                              "total_tokens": len(ids_of(tok, prompt)) + n_gen}


def test_chat_via_judge_transport(server, engine, tok):
    # The judge's ChatClient (key from the env var, retries, ...) against the real server.
    os.environ[KEY_ENV] = KEY
    want, _, _ = reference(engine, tok, ids_of(tok, "45+67="), max_new_tokens=6)

    async def run():
        async with ChatClient(server, "tiny_model", api_key_env=KEY_ENV, max_retries=0) as c:
            return await c.chat([{"role": "user", "content": "45+67="}], temperature=0, max_tokens=6)

    r = asyncio.run(run())
    assert r.ok and r.status == 200 and r.text == want[0]


def test_completions_forms_and_seeded_sampling(server, engine, tok):
    # text prompt, token-id prompt, and a list of both: one choice per (prompt, sample), in order
    ids = ids_of(tok, "8*9=")
    want_a, fin_a, _ = reference(engine, tok, ids_of(tok, "12+34="), max_new_tokens=8)
    want_b, fin_b, lps_b = reference(engine, tok, ids, max_new_tokens=8)
    status, r = post(server, "/completions", {"prompt": ["12+34=", ids], "temperature": 0, "max_tokens": 8, "logprobs": 0})
    assert status == 200, r
    assert [c["text"] for c in r["choices"]] == [want_a[0], want_b[0]]
    assert [c["finish_reason"] for c in r["choices"]] == [fin_a[0], fin_b[0]]
    lp = r["choices"][1]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx(lps_b[0], abs=1e-5)
    assert lp["text_offset"] == list(range(len(want_b[0])))  # one character per token in this vocabulary
    status, r1 = post(server, "/completions", {"prompt": ids, "temperature": 0, "max_tokens": 8})
    assert r1["choices"][0]["text"] == want_b[0]

    # seeded sampling: n=3 samples equal the engine's seeded samples of this prompt alone
    want_s, _, _ = reference(engine, tok, ids, max_new_tokens=8, temperature=1.0, n=3, seed=123)
    status, r = post(server, "/completions", {"prompt": "8*9=", "temperature": 1.0, "n": 3, "seed": 123, "max_tokens": 8})
    assert [c["text"] for c in r["choices"]] == want_s


def test_stop_strings(server, engine, tok):
    # Pick a prompt whose greedy answer has >= 2 characters and stop at its second character.
    for prompt in PROMPTS:
        want, _, _ = reference(engine, tok, ids_of(tok, prompt), max_new_tokens=10)
        if len(want[0]) >= 2:
            break
    else:
        pytest.fail("no prompt with a 2-character answer")
    stop = want[0][1]
    status, r = post(server, "/chat/completions", {"messages": [{"role": "user", "content": prompt}], "temperature": 0,
                                                   "max_tokens": 10, "stop": [stop, "never-there"], "logprobs": True})
    c = r["choices"][0]
    assert c["message"]["content"] == want[0][: want[0].index(stop)] and c["finish_reason"] == "stop"
    assert len(c["logprobs"]["content"]) == want[0].index(stop)


def test_concurrent_requests_batched_and_exact(server, engine, tok):
    """24 concurrent requests (greedy, two seeded-sampling ones among them): each answer equals the
    engine's answer for that prompt alone, and the server served them in fewer engine calls."""
    from trainer.rollout.engine import SamplingParams

    want = {p: reference(engine, tok, ids_of(tok, p), max_new_tokens=12)[0][0] for p in PROMPTS}
    want_s = {s: reference(engine, tok, ids_of(tok, "12+34="), max_new_tokens=12, temperature=2.0, n=2, seed=s)[0]
              for s in (5, 6)}
    # Precondition that gives the seeded check its teeth: with one params object for a call (the
    # positional key), the same seed at another position draws different samples; with per-prompt
    # params (what the batcher passes) the engine keys a request by its own seed, at any position.
    moved, listed = {}, {}
    for s in (5, 6):
        sp = SamplingParams(n=2, temperature=2.0, seed=s, max_new_tokens=12, stop_token_ids=(EOS,))
        greedy = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(EOS,))
        outs = engine.generate([ids_of(tok, "12+34=")] * 6, sp)[5]
        moved[s] = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
        outs = engine.generate([ids_of(tok, "7*8=")] * 5 + [ids_of(tok, "12+34=")], [greedy] * 5 + [sp])[5]
        listed[s] = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    assert moved != want_s and listed == want_s
    _, h0 = get(server, "/../health", key=None)

    async def run():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            async def one(body, path="/chat/completions"):
                async with s.post(server + path, json=body) as r:
                    assert r.status == 200
                    return await r.json()

            greedy = [one({"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "temperature": 0,
                           "max_tokens": 12}) for i in range(22)]
            seeded = [one({"prompt": "12+34=", "n": 2, "seed": s, "temperature": 2.0, "max_tokens": 12}, "/completions")
                      for s in (5, 6)]
            return await asyncio.gather(*greedy), await asyncio.gather(*seeded)

    t0 = time.perf_counter()
    greedy, seeded = asyncio.run(run())
    wall = time.perf_counter() - t0
    for i, r in enumerate(greedy):
        assert r["choices"][0]["message"]["content"] == want[PROMPTS[i % len(PROMPTS)]]
    assert [[c["text"] for c in r["choices"]] for r in seeded] == [want_s[5], want_s[6]]
    _, h1 = get(server, "/../health", key=None)
    calls = h1["engine_calls"] - h0["engine_calls"]
    assert h1["requests"] - h0["requests"] == 24
    assert calls < 24 and h1["max_batch_prompts"] > 1, (calls, h1)
    print(f"24 concurrent requests in {wall:.2f}s over {calls} engine calls")


def test_bad_requests(server):
    chat = lambda **kw: {"messages": [{"role": "user", "content": "1+1="}], **kw}  # noqa: E731
    cases = [
        ("/chat/completions", chat(model="other-model"), 404),
        ("/chat/completions", chat(temperature=-1), 400),
        ("/chat/completions", chat(top_logprobs=3, logprobs=True), 400),
        ("/chat/completions", chat(presence_penalty=0.5), 400),
        ("/chat/completions", chat(n=0), 400),
        ("/chat/completions", {"messages": []}, 400),
        ("/completions", {"prompt": "1" * MAX_SEQ_LEN}, 400),  # no room for a response
        ("/completions", {"prompt": [[1, 2, 99]]}, 400),  # token id outside the vocabulary
        ("/completions", {"prompt": "1+1=", "echo": True}, 400),
    ]
    for path, body, code in cases:
        status, r = post(server, path, body)
        assert status == code and r["error"]["message"], (body, status, r)

    async def not_json():
        async with aiohttp.ClientSession() as s:
            async with s.post(server + "/chat/completions", data=b"{nope",
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                return r.status

    assert asyncio.run(not_json()) == 400
    assert get(server, "/../health", key=None)[1]["status"] == "ok"  # still up


def test_stream(server, engine, tok):
    want, fin, _ = reference(engine, tok, ids_of(tok, "7*8="), max_new_tokens=8)

    async def run():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            async with s.post(server + "/chat/completions", json={
                    "messages": [{"role": "user", "content": "7*8="}], "temperature": 0, "max_tokens": 8, "stream": True}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                return (await r.read()).decode()

    events = [e[len("data: "):] for e in asyncio.run(run()).split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want[0]
    assert chunks[-1]["choices"][0]["finish_reason"] == fin[0]


def test_judge_end_to_end_on_the_tiny_model(server, engine, tok, tmp_path):
    """The ADCA judge path against trainer.serve. The tiny model answers digits, never GOOD/BAD, so each
    trajectory gets its stricter retry and then falls back; every answer in the log equals the engine's
    greedy answer for the templated judge prompt."""
    os.environ[KEY_ENV] = KEY
    trajs = [Trajectory("12+34=?", ["12+34=46"], 1.0), Trajectory("7*8=?", ["7*8=54", "7*8=56"], 0.0),
             Trajectory("9-5=?", ["9-5=4"], 1.0)]
    judge = JudgeClient(server, "tiny_model", api_key_env=KEY_ENV, concurrent=4, api_max_retries=1, request_timeout=60,
                        llm_evaluation_log_dir=str(tmp_path), max_tokens=8)
    flags, m = judge.judge_batch(trajs, global_step=0)
    assert flags == [None, None, None]
    assert m["adca/judge_calls"] == 6 and m["adca/judge_format_retries"] == 3 and m["adca/judge_errors"] == 0
    assert m["adca/judge_http_requests"] == 6 and m["adca/judge_fallback_fraction"] == 1.0
    recs = [json.loads(line) for line in open(judge.log_path, encoding="utf-8")]
    reqs = [r for r in recs if r["event"] == "request"]
    assert len(reqs) == 6 and all(r["status"] == 200 for r in reqs)
    assert KEY not in open(judge.log_path, encoding="utf-8").read()
    for r in reqs:
        t = trajs[r["trajectory"]]
        if r["kind"] == "judge":
            assert r["request"]["messages"] == build_judge_messages(t.query, t.steps, t.score)
        else:
            assert f"EXACTLY {len(t.steps)} lines" in r["request"]["messages"][-1]["content"]
        enc = tok.apply_chat_template(r["request"]["messages"], add_generation_prompt=True, tokenize=True)
        ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        want, _, _ = reference(engine, tok, ids, max_new_tokens=8)
        assert r["response"]["choices"][0]["message"]["content"] == want[0]


def test_batcher_composition_in_process(engine, tok):
    """The batcher on the real engine, with the queue filled before it starts so the batches are
    deterministic: a seeded sampled item goes to position 0 (a second one waits for the next call),
    the sample cap splits batches, and every result equals the item's solo engine call."""
    from trainer.rollout.engine import SamplingParams
    from trainer.rollout.async_engine import Batcher, EngineStats as ServerStats

    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(EOS,))
    seeded = {s: SamplingParams(n=2, temperature=2.0, seed=s, max_new_tokens=10, stop_token_ids=(EOS,)) for s in (5, 6)}
    g_ids = [ids_of(tok, p) for p in PROMPTS[:5]]
    s_ids = ids_of(tok, "12+34=")
    solo = [engine.generate([i], greedy)[0] for i in g_ids] + [engine.generate([s_ids], seeded[s])[0] for s in (5, 6)]
    # teeth: at position 5 of a call with one params object (positional key), seed 5 draws other
    # samples than alone; the Recording wrapper below has no `request_keyed_seeds`, so the batcher
    # treats it as such a positional engine and must place a seeded item at position 0.
    at5 = engine.generate([s_ids] * 6, seeded[5])[5]
    assert [o.token_ids for o in at5] != [o.token_ids for o in solo[5]]

    calls = []

    class Recording:  # the real engine; only its calls are recorded
        def generate(self, prompts, params):
            calls.append([(sp.seed, sp.n) for sp in params])
            return engine.generate(prompts, params)

        def abort(self):
            engine.abort()

    async def run(cap):
        b = Batcher(Recording(), max_batch_samples=cap, wait_s=0.0, stats=ServerStats())
        items = [(i, greedy) for i in g_ids] + [(s_ids, seeded[5]), (s_ids, seeded[6])]
        futs = [asyncio.ensure_future(b.submit(i, sp)) for i, sp in items]
        await asyncio.sleep(0)  # every submit has enqueued its item
        b.start()
        res = await asyncio.gather(*futs)
        await b.stop()
        return res

    res = asyncio.run(run(32))
    assert calls == [[(5, 2)] + [(None, 1)] * 5, [(6, 2)]]
    assert [[o.token_ids for o in r] for r in res] == [[o.token_ids for o in s] for s in solo]
    calls.clear()
    res = asyncio.run(run(4))  # at most 4 samples per call, oldest first (a seeded item takes 2)
    assert calls == [[(None, 1)] * 4, [(5, 2), (None, 1)], [(6, 2)]]
    assert [[o.token_ids for o in r] for r in res] == [[o.token_ids for o in s] for s in solo]


def test_batcher_drops_cancelled_items(engine, tok):
    # A request whose client went away (its handler cancelled) never reaches the engine.
    from trainer.rollout.engine import SamplingParams
    from trainer.rollout.async_engine import Batcher, EngineStats as ServerStats

    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=(EOS,))
    seen = []

    class Recording:
        def generate(self, prompts, params):
            seen.append([list(p) for p in prompts])
            return engine.generate(prompts, params)

        def abort(self):
            engine.abort()

    async def run():
        b = Batcher(Recording(), max_batch_samples=32, wait_s=0.0, stats=ServerStats())
        a = [ids_of(tok, p) for p in PROMPTS[:3]]
        futs = [asyncio.ensure_future(b.submit(i, greedy)) for i in a]
        await asyncio.sleep(0)
        futs[1].cancel()
        b.start()
        done = await asyncio.gather(futs[0], futs[2])
        await b.stop()
        return a, done

    a, done = asyncio.run(run())
    assert seen == [[a[0], a[2]]]
    assert [d[0].token_ids for d in done] == [engine.generate([a[i]], greedy)[0][0].token_ids for i in (0, 2)]


def raw_post(url, path, data: bytes, key=KEY):
    async def run():
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        async with aiohttp.ClientSession() as s:
            async with s.post(url + path, data=data, headers=headers) as r:
                return r.status, await r.json(content_type=None)

    return asyncio.run(run())


def test_hostile_requests_get_4xx_and_the_server_keeps_answering(server):
    """A chat template sent with the request is refused (it would run on the server); NaN, a JSON array
    body and more samples than the cap get 4xx, never 500; /health answers throughout."""
    msgs = [{"role": "user", "content": "1+1="}]
    status, err = post(server, "/chat/completions", {"messages": msgs, "max_tokens": 2,
                                                     "chat_template_kwargs": {"chat_template": "{% for x in range(9) %}{% endfor %}"}})
    assert status == 403 and "chat template" in err["error"]["message"]
    status, err = post(server, "/chat/completions", {"messages": msgs, "chat_template": "{{ 1 }}"})
    assert status == 403
    status, err = raw_post(server, "/completions", b'{"prompt": "1+1=", "max_tokens": 2, "temperature": NaN}')
    assert status == 400 and "finite" in err["error"]["message"]
    status, err = raw_post(server, "/completions", b'[{"prompt": "1+1="}]')
    assert status == 400 and "JSON object" in err["error"]["message"]
    status, err = post(server, "/completions", {"prompt": ["1+1="] * 17, "n": 256, "max_tokens": 1})
    assert status == 413 and "4352 samples" in err["error"]["message"]
    assert get(server, "/../health", key=None)[0] == 200
    status, out = post(server, "/completions", {"prompt": "1+1=", "max_tokens": 2, "temperature": 0})
    assert status == 200


def test_free_ports_lie_outside_the_ephemeral_range():
    """Ports picked for a later bind (worker rendezvous) come from below the kernel's ephemeral range, where
    no bind(port 0) by another process can take them in between, and they are free."""
    import socket

    from trainer.net import _ephemeral_low, free_port

    low = _ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert 20000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
