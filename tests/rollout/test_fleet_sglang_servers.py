"""A :class:`~trainer.rollout.fleet.Fleet` of REAL SGLang 0.5.21 servers (``backend="sglang"``): two
``python -m sglang.launch_server --device cpu`` processes behind the real sglang-router, launched and
supervised by the fleet, weights pushed through SGLang's own endpoints by the same :class:`FleetClient`
that drives the native servers. Checked against transformers (greedy tokens and log-probs, before and
after a push), by read-back of pushed rows, /health as liveness (the generating check is the hang check), and
through a SIGKILL mid-batch: no request lost, the server
restarted, given the current weights again and registered with the router.

This process needs no sglang (the trainer speaks HTTP only); the servers run in the interpreter that has
it (``.venv-sglang-cpu``, :func:`trainer.rollout.sglang_cpu.server_python`). One fleet for the module.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from trainer.rollout.engine import SamplingParams, WeightSyncError, checksum_named_tensors

from .fleet_support import await_restart
from .sglang_cpu_support import require_sglang_server
from .test_sglang_engine import gpu_model, gpu_prompts, hf_greedy, hf_logprobs, hf_weights, save_model

pytestmark = pytest.mark.slow


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read() or b"null")


def _post(url: str, body: dict, key: str | None = None):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@pytest.fixture(scope="module")
def sg(tmp_path_factory):
    py = require_sglang_server()
    from trainer.rollout.fleet import Fleet

    d = tmp_path_factory.mktemp("sglang_servers")
    hf_a, hf_b = gpu_model("llama", 0), gpu_model("llama", 7)
    path_a = save_model(hf_a, d / "a")
    fleet = Fleet(path_a, backend="sglang", server_python=py, num_servers=2, threads_per_server=1,
                  startup_timeout_s=300, log_dir=str(d / "logs"), client_kwargs={"bucket_bytes": 300_000})
    fleet.start()
    try:
        yield dict(fleet=fleet, hf_a=hf_a, hf_b=hf_b, path_a=path_a)
    finally:
        fleet.close()


def greedy(n):
    return SamplingParams(temperature=0, max_new_tokens=n)


def test_generate_equals_transformers_and_the_start_checksum_is_the_checkpoints(sg):
    fleet, hf = sg["fleet"], sg["hf_a"]
    prompts = gpu_prompts(3)
    outs = fleet.client.generate(prompts, greedy(10))
    for p, (o,) in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 10)
        _, ref = hf_logprobs(hf, p, o.token_ids, 1.0)
        assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), ref, atol=1e-4)
    want = checksum_named_tensors(hf_weights(hf, tied=False).items(), dtype=torch.float32)
    assert set(fleet.client.checksums().values()) == {want}
    # n samples of one prompt come back as n distinct responses (one seeded request each)
    (samples,) = fleet.client.generate(prompts[:1], SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=3))
    assert len(samples) == 4 and len({tuple(o.token_ids) for o in samples}) > 1
    # the weight endpoints need the fleet's key; generation does not
    status, _ = _post(fleet.server_urls[0] + "/begin_weight_update", {})
    assert status in (401, 403)


def test_health_is_liveness_and_the_hang_check_generates(sg):
    """The router polls /health every second with a time limit: on the fleet's servers it answers from the HTTP
    process (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0), not by waiting for a generation, which SGLang's default
    /health does (at least 1 s: its loop sleeps 1 s; up to 20 s on a busy scheduler), so that a busy server is not
    taken for a dead one. The monitor's hang check is that generation (/health_generate)."""
    fleet = sg["fleet"]
    assert fleet.kind.hang_probe == "/health_generate" and fleet.kind.hang_timeout_s > 20  # past SGLang's own 20 s
    for url in fleet.server_urls:
        t0 = time.monotonic()
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
        live = time.monotonic() - t0
        t0 = time.monotonic()
        with urllib.request.urlopen(url + fleet.kind.hang_probe, timeout=30) as r:
            assert r.status == 200
        generated = time.monotonic() - t0
        assert live < 0.9 <= generated, (url, live, generated)


def test_push_reaches_every_server_and_reads_back(sg):
    fleet, hf_b = sg["fleet"], sg["hf_b"]
    w_b = hf_weights(hf_b, tied=False)
    prompts = gpu_prompts(4, lens=(5, 1, 9, 3, 7, 2))
    fleet.client.update_weights(list(w_b.items()))
    want = checksum_named_tensors(w_b.items(), dtype=torch.float32)
    assert set(fleet.client.checksums().values()) == {want} and len(fleet.client.checksums()) == 2
    assert len(fleet.client._probes) == 4 and len(fleet.client._last_push) > 1  # several buckets, retained
    for url in fleet.server_urls:  # each server, directly: B's greedy tokens
        status, body = _post(url + "/generate", {"input_ids": prompts[0], "sampling_params": {
            "temperature": 0, "max_new_tokens": 10, "ignore_eos": True}})
        assert status == 200 and body["output_ids"] == hf_greedy(hf_b, prompts[0], 10)
        assert fleet.client._call(fleet.client._read_back(url)) == 4  # Llama reports its rows
    for p, (o,) in zip(prompts, fleet.client.generate(prompts, greedy(10))):
        assert o.token_ids == hf_greedy(hf_b, p, 10)


def test_sigkill_mid_batch_loses_nothing_restarts_and_resyncs(sg):
    fleet, hf_b = sg["fleet"], sg["hf_b"]
    prompts = gpu_prompts(11, lens=(3, 4, 5, 6))
    sp = greedy(1800)  # ~500 tokens/s for two prompts per server here: ~3.5 s of decoding
    ref = fleet.client.generate(prompts, sp)  # B's weights (pushed above); greedy: the same on any server
    victim = fleet.servers[0]
    old_url, old_pid = victim.url, victim.proc.pid
    retries0, restarts0 = fleet.stats.retries, fleet.stats.restarts
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(fleet.client.generate, prompts, sp)
        time.sleep(0.5)
        assert fleet.client._inflight > 0, "the batch finished before the kill: make it longer"
        os.killpg(old_pid, signal.SIGKILL)
        out = fut.result(timeout=300)
    assert [[o.token_ids for o in s] for s in out] == [[o.token_ids for o in s] for s in ref]  # nothing lost
    assert fleet.stats.retries > retries0 and fleet.stats.failures == 0
    new_url = await_restart(fleet, restarts0, old_url, timeout_s=240)
    # the restarted server loaded A from disk; the fleet replayed the last push: it holds B
    want = checksum_named_tensors(hf_weights(hf_b, tied=False).items(), dtype=torch.float32)
    assert fleet.client.checksums()[new_url] == want
    status, body = _post(new_url + "/generate", {"input_ids": prompts[0], "sampling_params": {
        "temperature": 0, "max_new_tokens": 10, "ignore_eos": True}})
    assert status == 200 and body["output_ids"] == hf_greedy(hf_b, prompts[0], 10)


def test_a_checkpoint_from_disk_reads_back_wrong_until_the_last_push_is_replayed(sg):
    """``sglang_http.push_from_disk`` (with the fleet's key) loads checkpoint A into server 1; the read-back
    of the fleet's probes (B's rows, as pushed) then fails, and the greedy tokens are A's. Replaying the
    retained push (what a restart does) gives B back: the read-back passes and the tokens are B's."""
    from trainer.rollout import sglang_http

    fleet, hf_a, hf_b = sg["fleet"], sg["hf_a"], sg["hf_b"]
    client, url = fleet.client, fleet.server_urls[1]
    prompt = gpu_prompts(12)[0]

    def greedy_here():
        status, body = _post(url + "/generate", {"input_ids": prompt, "sampling_params": {
            "temperature": 0, "max_new_tokens": 10, "ignore_eos": True}})
        assert status == 200
        return body["output_ids"]

    assert greedy_here() == hf_greedy(hf_b, prompt, 10)  # B since the pushes above
    with pytest.raises(sglang_http.SGLangServerError):  # without the fleet's key: refused
        sglang_http.push_from_disk([url], sg["path_a"])
    sglang_http.push_from_disk([url], sg["path_a"], key=fleet.api_key)
    with pytest.raises(WeightSyncError, match="reads back different values"):
        client._call(client._read_back(url))
    assert greedy_here() == hf_greedy(hf_a, prompt, 10)
    assert client.replay_last_push(url) is True
    assert client._call(client._read_back(url)) == 4
    assert greedy_here() == hf_greedy(hf_b, prompt, 10)
