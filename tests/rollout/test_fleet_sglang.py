"""The HTTP fleet's client against a REAL SGLang 0.5.21 server (``python -m sglang.launch_server --device cpu``)
behind the real sglang-router, and weight pushes through SGLang's own endpoints
(:mod:`trainer.rollout.sglang_http`), verified by outputs equal to transformers and by read-back.

One server and one router for the module; runs in the SGLang CPU venv (sglang_cpu_support.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
import torch

from trainer.rollout import sglang_cpu
from trainer.rollout.engine import SamplingParams, checksum_named_tensors
from trainer.serving.net import free_port

from .sglang_cpu_support import require_sglang_here
from .test_sglang_engine import gpu_model, gpu_prompts, hf_greedy, hf_logprobs, hf_weights, save_model

HOST = "127.0.0.1"


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _wait(pred, what: str, proc: subprocess.Popen, log: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n{open(log).read()[-4000:]}")
        try:
            if pred():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s:\n{open(log).read()[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.fixture(scope="module")
def sglang_fleet(tmp_path_factory):
    require_sglang_here()
    from trainer.rollout.fleet import FleetClient

    d = tmp_path_factory.mktemp("sglang_fleet")
    hf_a = gpu_model("llama", 0)
    path_a = save_model(hf_a, d / "a")
    env = dict(os.environ)
    sglang_cpu.activate(env)
    port = free_port(HOST)
    server_log = str(d / "server.log")
    server = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", path_a, "--host", HOST, "--port", str(port),
         "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--dtype", "float32",
         "--disable-cuda-graph", "--disable-overlap-schedule", "--max-total-tokens", "4096", "--skip-tokenizer-init",
         "--skip-server-warmup", "--random-seed", "0", "--log-level", "warning"],
        env=env, stdout=open(server_log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    procs = [server]
    client = None
    try:
        url = f"http://{HOST}:{port}"
        _wait(lambda: _get(url + "/model_info") is not None, "sglang.launch_server", server, server_log)
        rport = free_port(HOST)
        router_log = str(d / "router.log")
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", url, "--host", HOST, "--port", str(rport),
             "--prometheus-host", HOST, "--prometheus-port", str(free_port(HOST)), "--disable-retries", "--log-level", "warn"],
            stdout=open(router_log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(router)
        router_url = f"http://{HOST}:{rport}"
        _wait(lambda: any(w.get("is_healthy", True) for w in _get(router_url + "/workers").get("workers", [])),
              "sglang-router", router, router_log)
        client = FleetClient(router_url, [url], per_sample_requests=True)
        yield dict(client=client, url=url, router_url=router_url, hf_a=hf_a, path_a=path_a, dir=d)
    finally:
        if client is not None:
            client.close()
        for p in reversed(procs):
            _stop(p)


@pytest.mark.slow
def test_generate_through_the_router_equals_transformers(sglang_fleet):
    client, hf = sglang_fleet["client"], sglang_fleet["hf_a"]
    prompts = gpu_prompts(5)
    outs = client.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12))
    for p, (o,) in zip(prompts, outs):
        assert o.finish_reason == "length" and o.token_ids == hf_greedy(hf, p, 12)
        _, ref = hf_logprobs(hf, p, o.token_ids, 1.0)
        assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), ref, atol=1e-4)
    outs = client.generate(prompts[:2], SamplingParams(n=3, temperature=0.7, max_new_tokens=8))
    for p, samples in zip(prompts[:2], outs):
        assert len(samples) == 3
        for o in samples:
            _, ref = hf_logprobs(hf, p, o.token_ids, 0.7)
            assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), ref, atol=1e-4)


@pytest.mark.slow
def test_push_tensors_then_disk_through_sglang_endpoints(sglang_fleet):
    from trainer.rollout import sglang_http

    client, url, hf_a = sglang_fleet["client"], sglang_fleet["url"], sglang_fleet["hf_a"]
    hf_b = gpu_model("llama", 7)
    w_b = hf_weights(hf_b, tied=False)
    prompts = gpu_prompts(6)
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    before = client.generate(prompts, greedy)
    # From tensors (same host), in several flattened buckets: the server then generates as transformers with B.
    checksum = sglang_http.push_tensors([url], list(w_b.items()), dtype=torch.float32, bucket_bytes=300_000)
    assert checksum == checksum_named_tensors(w_b.items(), dtype=torch.float32)
    probes = {n: w_b[n] for n in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                  "model.layers.1.mlp.down_proj.weight", "model.norm.weight")}
    assert set(sglang_http.read_back(url, probes, torch.float32).values()) == {0.0}
    after = client.generate(prompts, greedy)
    for p, (o,) in zip(prompts, after):
        assert o.token_ids == hf_greedy(hf_b, p, 10)
    assert [o.token_ids for (o,) in after] != [o.token_ids for (o,) in before]
    # From disk: back to A's checkpoint, outputs exactly as before the pushes.
    sglang_http.push_from_disk([url], sglang_fleet["path_a"])
    assert set(sglang_http.read_back(url, {n: hf_weights(hf_a, False)[n] for n in probes}, torch.float32).values()) == {0.0}
    restored = client.generate(prompts, greedy)
    assert [o.token_ids for (o,) in restored] == [o.token_ids for (o,) in before]
    # the same weights again: the same tokens, and log-probs equal up to float32 reduction order (the
    # engine's batch and cache state differ from the first call's; measured differences ~1e-6)
    for (o,), (b,) in zip(restored, before):
        assert o.logprobs == pytest.approx(b.logprobs, abs=1e-4)
