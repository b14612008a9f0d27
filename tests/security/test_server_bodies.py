"""Large valid bodies are served, bad values are the request's fault. Against real servers on 127.0.0.1
(one of each per module): completion requests of 50 KB, 1 MB and 5 MB (under a 6 MiB cap, sent with a
Content-Length and chunked) get the same completion as the small request they pad; one over the cap is
refused with 413 however it is sent. ``chat_template_kwargs`` that steer the renderer
(``{"return_tensors": "pt"}``) and a ``model_path`` with a NUL byte get a 400 naming the field, never a
500; a ``--model`` that is not a directory is one argparse line.
"""

import http.client
import json
import subprocess
import sys
from urllib.parse import urlsplit

import pytest

from tests.security.test_server_fuzz import KEY, MODEL, REPO, _start, _stop

pytestmark = pytest.mark.slow
CAP_MB = 6
CAP = CAP_MB << 20


def post(url, path, body: bytes, chunked=False, chunk=256 << 10):
    """(status, parsed JSON body) of a POST; ``chunked`` sends no Content-Length, the body in pieces."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Authorization", f"Bearer {KEY}")
        if chunked:
            conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            for i in range(0, len(body), chunk):
                piece = body[i:i + chunk]
                conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
            conn.send(b"0\r\n\r\n")
        else:
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders()
            conn.send(body)
        r = conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw else None
    except (BrokenPipeError, ConnectionResetError):  # the server answered early and closed: read what it said
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def openai_url():
    p, url = _start("trainer.serve", "coxswain-serve: listening on", "--max-seq-len", "64", "--max-request-mb", str(CAP_MB))
    yield url
    _stop(p)


@pytest.fixture(scope="module")
def native_url():
    p, url = _start("trainer.rollout.native_server", "coxswain-native-server: listening on", "--skip-tokenizer-init",
                    "--max-seq-len", "64", "--max-request-mb", str(CAP_MB))
    yield url
    _stop(p)


def completion(size: int) -> bytes:
    """A greedy completion request padded to ``size`` bytes with the OpenAI ``user`` field (ignored)."""
    base = {"model": "tiny_model", "prompt": "12+34=", "max_tokens": 4, "temperature": 0}
    pad = size - len(json.dumps({**base, "user": ""}))
    body = json.dumps({**base, "user": "u" * max(pad, 0)}).encode()
    assert size == 0 or len(body) == size
    return body


@pytest.mark.parametrize("size", [50_000, 1_000_000, 5_000_000])
@pytest.mark.parametrize("chunked", [False, True])
def test_bodies_under_the_cap_are_served_whole(openai_url, size, chunked):
    status, small = post(openai_url, "/v1/completions", json.dumps(
        {"model": "tiny_model", "prompt": "12+34=", "max_tokens": 4, "temperature": 0}).encode())
    assert status == 200
    status, big = post(openai_url, "/v1/completions", completion(size), chunked=chunked)
    assert status == 200, big
    assert big["choices"][0]["text"] == small["choices"][0]["text"]
    assert big["usage"] == small["usage"]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_cap_is_413(openai_url, chunked):
    status, body = post(openai_url, "/v1/completions", completion(CAP + 1), chunked=chunked)
    assert status == 413, body
    assert f"limit of {CAP} bytes" in body["error"]["message"]
    status, _ = post(openai_url, "/v1/completions", completion(CAP - 1000), chunked=chunked)  # the cap itself is fine
    assert status == 200


@pytest.mark.parametrize("kwargs", [{"return_tensors": "pt"}, {"tokenize": False}, {"return_dict": True}])
def test_renderer_arguments_in_chat_template_kwargs_are_400(openai_url, kwargs):
    body = {"model": "tiny_model", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2,
            "chat_template_kwargs": kwargs}
    status, out = post(openai_url, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, out
    assert out["error"]["param"] == "chat_template_kwargs" and list(kwargs)[0] in out["error"]["message"]
    # template variables still reach the template
    body["chat_template_kwargs"] = {"enable_thinking": False}
    assert post(openai_url, "/v1/chat/completions", json.dumps(body).encode())[0] == 200


def test_native_server_reads_large_bodies_and_refuses_a_nul_model_path(native_url):
    gen = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    status, small = post(native_url, "/generate", json.dumps(gen).encode())
    assert status == 200
    padded = json.dumps({**gen, "rid": "r" * 1_000_000}).encode()
    status, big = post(native_url, "/generate", padded, chunked=True)
    assert status == 200, big
    assert big["output_ids"] == small["output_ids"]
    for path in (str(MODEL) + "\x00/etc", "\x00"):
        status, out = post(native_url, "/update_weights_from_disk", json.dumps({"model_path": path}).encode())
        assert status == 400 and out["success"] is False and "model_path" in out["message"] and "NUL" in out["message"], out


@pytest.mark.parametrize("module", ["trainer.serve", "trainer.rollout.native_server"])
def test_a_model_flag_that_is_not_a_directory_is_one_line(tmp_path, module):
    p = subprocess.run([sys.executable, "-m", module, "--model", str(tmp_path / "missing")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].endswith(f"argument --model: '{tmp_path / 'missing'}' is not a directory")
    assert "Traceback" not in p.stderr
