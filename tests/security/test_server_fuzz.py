"""Fuzz both servers' request bodies: the SGLang-protocol native server and the OpenAI-compatible
``trainer.serve``. Random JSON built from each endpoint's own field names (wrong types, huge and
negative numbers, deep nesting, unknown keys), raw bytes that are not JSON or not UTF-8, empty bodies
and wrong methods: every answer is a 2xx or a 4xx, never a 5xx, and the server still answers
``/health`` quickly afterwards. Requests carry the run's key, so the fuzz reaches the handlers behind
authentication (weight pushes and control endpoints included).
"""

import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "recipes" / "cpu" / "tiny_model"
KEY_ENV, KEY = "COXSWAIN_FUZZ_KEY", "fuzz-key-27182818"

pytestmark = pytest.mark.slow


def _start(module, ready_prefix, *args):
    env = dict(os.environ, **{KEY_ENV: KEY, "PYTHONUNBUFFERED": "1"})
    p = subprocess.Popen([sys.executable, "-m", module, "--model", str(MODEL), "--port", "0", "--threads", "1",
                          "--api-key-env", KEY_ENV, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(ready_prefix):
            url = line.split()[3].rstrip(",")
            return p, url[: -len("/v1")] if url.endswith("/v1") else url
    p.kill()
    raise RuntimeError("server did not start:\n" + "".join(lines))


def _stop(p):
    p.terminate()
    try:
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()


def send(url, path, body: bytes | None, method="POST", ctype="application/json", timeout=60):
    req = urllib.request.Request(url + path, data=body, method=method,
                                 headers={"Content-Type": ctype, "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        send.last_error = e.read()[:300]
        return e.code


SCALARS = [None, True, False, 0, 1, 2, -1, -(10 ** 12), 10 ** 30, 0.5, -0.0, 1e308, "", "x", "é🚀", "\u0000",
           "a" * 2000, "NaN", "-1", [], {}]


def rand_value(rng, fields, depth=0):
    r = rng.random()
    if depth > 3 or r < 0.55:
        return rng.choice(SCALARS)
    if r < 0.75:
        return [rand_value(rng, fields, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = rng.sample(fields, min(len(fields), rng.randint(0, 4))) + (["zz_unknown"] if rng.random() < 0.2 else [])
    return {k: rand_value(rng, fields, depth + 1) for k in keys}


def rand_body(rng, fields, base: dict) -> bytes:
    kind = rng.random()
    if kind < 0.08:  # not JSON / not UTF-8 / truncated / empty / deep
        return rng.choice([b"", b"{", b"\xff\xfe\x00", b"[" * 5000 + b"]" * 5000, b'{"a": NaN}', b"null", b"42",
                           json.dumps(base).encode()[:-3], b'{"input_ids": [1, 2' + b", 3" * 10])
    body = dict(base)
    for k in rng.sample(fields, rng.randint(1, min(4, len(fields)))):
        body[k] = rand_value(rng, fields)
    if rng.random() < 0.3:
        sub = {f: rand_value(rng, fields, 2) for f in rng.sample(SAMPLING, rng.randint(1, 4))}
        body["sampling_params"] = sub
    return json.dumps(body, allow_nan=rng.random() < 0.1).encode()


SAMPLING = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids", "ignore_eos",
            "skip_special_tokens", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens"]
NATIVE = {
    "/generate": (["input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                   "rid", "stream", "return_text_in_logprobs"], {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}}),
    "/update_weights_from_tensor": (["serialized_named_tensors", "load_format", "flush_cache", "weight_version",
                                     "abort_all_requests"], {}),
    "/update_weights_from_disk": (["model_path", "load_format", "weight_version", "abort_all_requests"], {}),
    "/abort_request": (["rid", "abort_all"], {}),
    "/flush_cache": (["x"], {}),
    "/get_weights_by_name": (["name", "truncate_size"], {"name": "model.norm.weight"}),
    "/begin_weight_update": (["x"], {}),
    "/end_weight_update": (["x"], {}),
}
OPENAI = {
    "/v1/chat/completions": (["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                              "n", "stop", "seed", "logprobs", "top_logprobs", "stream", "user", "chat_template",
                              "response_format", "tools"],
                             {"model": "tiny_model", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}),
    "/v1/completions": (["model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs",
                         "echo", "suffix", "best_of", "stream"], {"model": "tiny_model", "prompt": "1+1=", "max_tokens": 2}),
}


def fuzz(url, endpoints, rng, n):
    statuses, bad = {}, []
    paths = sorted(endpoints)
    for i in range(n):
        path = rng.choice(paths)
        fields, base = endpoints[path]
        body = rand_body(rng, fields, base)
        method, ctype = "POST", "application/json"
        if rng.random() < 0.05:
            method = rng.choice(["PUT", "DELETE", "PATCH"])
        if rng.random() < 0.05:
            ctype = rng.choice(["text/plain", "application/x-www-form-urlencoded", ""])
        st = send(url, path, body, method, ctype)
        statuses[st] = statuses.get(st, 0) + 1
        if st >= 500:
            bad.append((path, st, send.last_error, body[:300]))
        if path == "/generate" and i % 25 == 0:
            send(url, "/continue_generation", b"{}")  # a fuzzed pause must not stall the rest of the fuzz
    t0 = time.monotonic()
    assert send(url, "/health", None, method="GET") == 200 and time.monotonic() - t0 < 2.0
    return statuses, bad


def test_native_server_fuzz_never_answers_5xx():
    p, url = _start("trainer.rollout.native_server", "coxswain-native-server: listening on", "--skip-tokenizer-init",
                    "--max-seq-len", "64", "--max-samples-per-request", "64")
    try:
        statuses, bad = fuzz(url, NATIVE, random.Random(7), 220)
    finally:
        _stop(p)
    assert bad == [], bad[:5]
    assert sum(v for k, v in statuses.items() if 400 <= k < 500) > 100 and statuses.get(200, 0) > 5, statuses


def test_openai_server_fuzz_never_answers_5xx():
    p, url = _start("trainer.serve", "coxswain-serve: listening on", "--max-seq-len", "64", "--max-batch-size", "8",
                    "--max-samples-per-request", "64")
    try:
        statuses, bad = fuzz(url, OPENAI, random.Random(11), 160)
    finally:
        _stop(p)
    assert bad == [], bad[:5]
    assert sum(v for k, v in statuses.items() if 400 <= k < 500) > 60 and statuses.get(200, 0) > 5, statuses
