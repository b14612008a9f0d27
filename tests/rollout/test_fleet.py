"""A real fleet: two ``trainer.rollout.native_server`` processes behind the real ``sglang-router`` (0.3.2).

The reference for every answer is the native engine run in this process on the same checkpoint (the
shipped tiny model): what comes back through the router must be what ``NativeEngine.generate``
returns for the same tokens -- greedy, and seeded sampling (module docstring of
``trainer.rollout.fleet`` for how seeds travel). Then the fleet's duties: a server SIGKILLed while it
holds requests loses none of them (retried on the other server, counted, the dead one restarted and
re-registered with the router); a weight push reaches every server and is checked by checksum, and a
corrupted one raises.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from trainer.rollout.engine import SamplingParams, checksum_named_tensors
from trainer.rollout.fleet import Fleet, WeightSyncError, prompt_seed
from trainer.rollout.native import NativeEngine

from .fleet_support import await_restart

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "recipes" / "cpu" / "tiny_model"
EOS = 1
SEQ = 64  # the tiny model's max_position_embeddings: the servers' default --max-seq-len

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(EOS,))
SAMPLED = SamplingParams(n=3, temperature=1.0, top_p=0.9, top_k=8, max_new_tokens=24, stop_token_ids=(EOS,), seed=1234)


def _prompts(k: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 16) for _ in range(rng.randint(1, 8))] for _ in range(k)]


def _auth(key):
    return {"Authorization": f"Bearer {key}"} if key else {}


def _get(url: str, key: str | None = None) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=_auth(key)), timeout=30) as r:
        return json.load(r)


def _post(url: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **_auth(key)})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def live_members(pgids) -> list[str]:
    """Processes (not zombies) in these process groups, from /proc."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except OSError:
            continue
        if int(pgrp) in set(pgids) and state != "Z":
            found.append(pid)
    return found


def assert_same(fleet_out, ref_out, *, tol=1e-5):
    """Same tokens and finish reasons; log-probs equal up to float rounding across batch shapes."""
    assert len(fleet_out) == len(ref_out)
    for i, (fo, ro) in enumerate(zip(fleet_out, ref_out)):
        assert len(fo) == len(ro), f"prompt {i}: {len(fo)} samples, reference {len(ro)}"
        for j, (a, b) in enumerate(zip(fo, ro)):
            assert a.token_ids == b.token_ids, f"prompt {i} sample {j}: {a.token_ids} != {b.token_ids}"
            assert a.finish_reason == b.finish_reason, f"prompt {i} sample {j}"
            assert a.logprobs == pytest.approx(b.logprobs, abs=tol), f"prompt {i} sample {j}"


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return NativeEngine(str(MODEL), max_batch_size=32, max_seq_len=SEQ)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    # A wide batching window (150 ms) on the servers: the concurrent requests of one generate() share
    # engine calls, and a kill lands while the victim still holds its requests.
    # the servers read checkpoints from disk only below the directory of their model (--weights-root's default)
    root = tmp_path_factory.mktemp("weights")
    shutil.copytree(MODEL, root / "base")
    f = Fleet(str(root / "base"), num_servers=2, threads_per_server=1, max_batch_size=32, health_interval_s=0.5,
              server_args=["--batch-wait-ms", "150", "--batch-max-wait-ms", "600"],
              log_dir=str(tmp_path_factory.mktemp("fleet-logs")))
    f.weights_root_dir = root
    f.start()
    yield f
    f.close()


def test_router_serves_both_workers(fleet):
    workers = {w["url"]: w for w in _get(fleet.router_url + "/workers")["workers"]}
    assert set(workers) == set(fleet.server_urls) and all(w["is_healthy"] for w in workers.values())
    info = _get(fleet.server_urls[0] + "/server_info")
    assert info["dp_size"] == 1 and info["skip_tokenizer_init"] is True and info["context_length"] == SEQ


def test_greedy_through_router_equals_engine(fleet, engine):
    prompts = _prompts(12, seed=0)
    before = [_get(u + "/server_info")["internal_states"][0]["requests"] for u in fleet.server_urls]
    out = fleet.client.generate(prompts, GREEDY)
    assert_same(out, engine.generate(prompts, GREEDY))
    after = [_get(u + "/server_info")["internal_states"][0]["requests"] for u in fleet.server_urls]
    # round_robin: the 12 requests were split between the two servers
    assert [a - b for a, b in zip(after, before)] == [6, 6]
    assert any(o[0].finish_reason == "stop" for o in out)
    # No stop ids: sent as ignore_eos, so every response runs to max_new_tokens (past the EOS it samples).
    no_stop = replace(GREEDY, stop_token_ids=())
    out = fleet.client.generate(prompts, no_stop)
    assert_same(out, engine.generate(prompts, no_stop))
    assert all(o[0].finish_reason == "length" and len(o[0].token_ids) == 12 for o in out)
    assert any(EOS in o[0].token_ids for o in out)


def test_seeded_sampling_through_router_equals_engine(fleet, engine):
    prompts = _prompts(8, seed=1)
    # One params object: prompt i travels with prompt_seed(seed, i).
    out = fleet.client.generate(prompts, SAMPLED)
    ref = engine.generate(prompts, [replace(SAMPLED, seed=prompt_seed(SAMPLED.seed, i)) for i in range(len(prompts))])
    assert_same(out, ref)
    # A per-prompt list: each seed as is, so the fleet equals the engine called with the same list.
    plist = [replace(SAMPLED, seed=100 + i, n=2) for i in range(len(prompts))]
    assert_same(fleet.client.generate(prompts, plist), engine.generate(prompts, plist))
    # The agent loop's path: one prompt, awaited from a foreign event loop.
    got = asyncio.run(fleet.client.agenerate(prompts[3], plist[3]))
    assert_same([got], engine.generate([prompts[3]], [plist[3]]))
    # For real SGLang servers: each sample its own n=1 request, sample j seeded with prompt_seed(seed, j).
    from trainer.rollout.fleet import FleetClient

    split = FleetClient(fleet.router_url, fleet.server_urls, per_sample_requests=True)
    try:
        got = split.generate(prompts[:2], plist[:2])
    finally:
        split.close()
    for p, sp, outs in zip(prompts[:2], plist[:2], got):
        ref = engine.generate([p] * sp.n, [replace(sp, n=1, seed=prompt_seed(sp.seed, j)) for j in range(sp.n)])
        assert_same([outs], [[r[0] for r in ref]])
    # Teeth: seeds matter (another seed changes some sample; the n samples of a prompt are not copies).
    other = fleet.client.generate(prompts, replace(SAMPLED, seed=99))
    assert any(a.token_ids != b.token_ids for x, y in zip(out, other) for a, b in zip(x, y))
    assert any(len({tuple(o.token_ids) for o in outs}) > 1 for outs in out)


def test_sigkill_mid_batch_loses_nothing_and_restarts(fleet, engine):
    prompts = _prompts(16, seed=2)
    ref = engine.generate(prompts, GREEDY)
    victim = fleet.servers[0]
    old_url, old_pid = victim.url, victim.proc.pid
    seen = _get(old_url + "/server_info")["internal_states"][0]["requests"]
    retries0, restarts0 = fleet.stats.retries, fleet.stats.restarts
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(fleet.client.generate, prompts, GREEDY)
        # Kill once the victim holds requests (they wait in its 150 ms batching window).
        deadline = time.monotonic() + 30
        while _get(old_url + "/server_info")["internal_states"][0]["requests"] == seen:
            assert time.monotonic() < deadline, "the victim never received a request"
            time.sleep(0.005)
        os.killpg(old_pid, signal.SIGKILL)
        out = fut.result(timeout=120)
    assert_same(out, ref)  # every request came back, and right
    assert fleet.stats.retries > retries0 and fleet.stats.failures == 0
    new_url = await_restart(fleet, restarts0, old_url, timeout_s=90)
    assert live_members([old_pid]) == []  # the old process group is gone
    assert sorted(fleet.client.worker_urls) == sorted(fleet.server_urls)
    # The restarted server answers right, directly and through the router.
    status, body = _post(new_url + "/generate", {"input_ids": prompts[0], "return_logprob": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "stop_token_ids": [EOS]}})
    assert status == 200 and body["output_ids"] == ref[0][0].token_ids
    assert_same(fleet.client.generate(prompts[:4], GREEDY), ref[:4])


def _random_weights(engine, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (1.0 + 0.2 * torch.randn(t.shape, generator=g)) if "norm" in n else 0.3 * torch.randn(t.shape, generator=g)
            for n, t in engine.model.hf_tensors()}


def _checkpoint(tmp_path: Path, weights: dict) -> str:
    from safetensors.torch import save_file

    for f in ("config.json", "generation_config.json"):
        shutil.copy(MODEL / f, tmp_path / f)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_push_drains_in_flight_requests_first(fleet, engine):
    prompts = _prompts(8, seed=5)
    ref_old = engine.generate(prompts, GREEDY)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(fleet.client.generate, prompts, GREEDY)
        deadline = time.monotonic() + 30
        while fleet.client._inflight < len(prompts):  # all admitted (they sit in the servers' batch window)
            assert time.monotonic() < deadline
            time.sleep(0.002)
        fleet.client.update_weights(iter(_random_weights(engine, seed=5).items()))
        # The push waited for them: every one was generated with the old weights.
        assert_same(fut.result(timeout=60), ref_old)
    assert any(a[0].token_ids != b[0].token_ids for a, b in zip(fleet.client.generate(prompts, GREEDY), ref_old))


def test_weight_push_reaches_every_server(fleet, engine, tmp_path):
    new = _random_weights(engine, seed=7)
    fleet.client.bucket_bytes = 64 << 10  # several buckets for this 1.6 MB model
    pushes0 = fleet.stats.weight_pushes
    names = fleet.client.update_weights(iter(new.items()), weight_version="step-1")
    assert sorted(names) == sorted(new) and fleet.stats.weight_pushes == pushes0 + 1
    expected = checksum_named_tensors(new.items())
    for u in fleet.server_urls:
        got = _get(u + "/weights_checksum", fleet.api_key)
        assert got == {"checksum": expected, "weight_version": "step-1"}
        with pytest.raises(urllib.error.HTTPError, match="401"):  # the fleet's key guards its weights
            _get(u + "/weights_checksum")
    assert fleet.client.weights_checksum() == expected
    # The fleet now answers as a fresh engine built from those weights (and no longer as the old one).
    fresh = NativeEngine(_checkpoint(tmp_path, new), max_batch_size=32, max_seq_len=SEQ)
    assert fresh.weights_checksum() == expected
    prompts = _prompts(8, seed=3)
    out = fleet.client.generate(prompts, GREEDY)
    assert_same(out, fresh.generate(prompts, GREEDY), tol=1e-4)  # larger weights: larger rounding across batch shapes
    assert any(a[0].token_ids != b[0].token_ids for a, b in zip(out, engine.generate(prompts, GREEDY)))
    # /update_weights_from_disk: the old checkpoint on server 0 is caught by the check, the new one passes.
    url, key = fleet.server_urls[0] + "/update_weights_from_disk", fleet.api_key
    assert _post(url, {"model_path": fleet.model})[0] == 401  # no key: refused before anything is read
    status, body = _post(url, {"model_path": fleet.model}, key)
    assert status == 200 and body["success"] is True
    with pytest.raises(WeightSyncError, match=fleet.server_urls[0]):
        fleet.client.verify_weights(expected)
    # paths are confined to the allowed root; the answer does not say whether a path outside exists
    for outside in ("/etc", "/no/such/dir", str(fleet.weights_root_dir / ".." / ".." / "etc")):
        status, body = _post(url, {"model_path": outside}, key)
        assert status == 403 and "outside the allowed root" in body["message"], (outside, body)
    inside = fleet.weights_root_dir / "step-1"
    inside.mkdir()
    status, body = _post(url, {"model_path": _checkpoint(inside, new)}, key)
    assert status == 200 and body["success"] is True
    fleet.client.verify_weights(expected)


def test_a_server_lost_before_a_push_is_left_out_then_restarted_with_the_pushed_weights(fleet, engine):
    """A server that dies between two steps (its node lost, say) must not fail the next weight push: the push
    leaves it out (the others are pushed and verified) and hands it to the fleet, whose restarted server copies
    the pushed weights from a live peer. (The multi-node test's run failed at that push with 'Cannot connect'.)"""
    new = _random_weights(engine, seed=11)
    victim, expected = fleet.servers[0], checksum_named_tensors(new.items())
    old_url, restarts0 = victim.url, fleet.stats.restarts
    with fleet._lock:  # the fleet's monitor cannot restart the server before the push has met it dead
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        names = fleet.client.update_weights(iter(new.items()))
        assert sorted(names) == sorted(new) and fleet.client.expected_checksum == expected
        assert _get(fleet.servers[1].url + "/weights_checksum", fleet.api_key)["checksum"] == expected
    new_url = await_restart(fleet, restarts0, old_url, timeout_s=90)
    assert _get(new_url + "/weights_checksum", fleet.api_key)["checksum"] == expected  # copied from its peer
    fleet.client.update_weights(engine.model.hf_tensors())  # back to the fixture's weights for the tests after this one


def test_sglang_weight_protocol_drives_native_servers_too(fleet, engine, tmp_path):
    """One client, two kinds of server: the push a fleet of real SGLang servers gets (begin / flattened
    buckets in shared memory / end / flush, read back through /get_weights_by_name) lands in the native
    servers, whose own checksum then equals the stream's."""
    from trainer.rollout.fleet import FleetClient
    from trainer.wire import ProtocolError, flattened_bucket_to_tensors

    new = _random_weights(engine, seed=9)
    sg = FleetClient(fleet.router_url, fleet.server_urls, api_key=fleet.api_key, weight_protocol="sglang",
                     model_dir=fleet.model, bucket_bytes=64 << 10)
    try:
        names = sg.update_weights(iter(new.items()))
        assert sorted(names) == sorted(new) and len(sg._last_push) > 1  # several buckets
        expected = checksum_named_tensors(new.items())
        assert fleet.client.checksums() == {u: expected for u in fleet.server_urls}  # the servers' own hash
        assert set(sg.checksums().values()) == {expected}
        assert all(sg._call(sg._read_back(u)) == len(sg._probes) > 0 for u in fleet.server_urls)
        fresh = NativeEngine(_checkpoint(tmp_path, new), max_batch_size=32, max_seq_len=SEQ)
        prompts = _prompts(4, seed=6)
        assert_same(fleet.client.generate(prompts, GREEDY), fresh.generate(prompts, GREEDY), tol=1e-4)
    finally:
        sg.close()
    # the server's unpickler admits only what a weight bucket holds
    import base64
    import pickle

    with pytest.raises(ProtocolError, match="posix.system"):  # os.system pickles as posix.system
        flattened_bucket_to_tensors(pickle.dumps({"flattened_tensor": __import__("os").system}))
    # (a module function: Ray swaps builtins.print for its own once a cluster runs in this process)
    status, body = _post(fleet.server_urls[0] + "/update_weights_from_tensor", {
        "serialized_named_tensors": [base64.b64encode(pickle.dumps(shutil.rmtree)).decode()],
        "load_format": "flattened_bucket"}, fleet.api_key)
    assert status == 400 and "shutil.rmtree" in json.dumps(body)
    fleet.client.update_weights(engine.model.hf_tensors())  # back to the fixture's weights for the tests after this one


def test_corrupted_push_raises(fleet, engine, monkeypatch):
    from safetensors.torch import load, save

    new = _random_weights(engine, seed=8)
    victim = fleet.server_urls[1]
    real = type(fleet.client)._post_blob

    async def corrupting(self, url, blob, weight_version):
        if url == victim:  # one bit of one tensor flips on the way to one server
            tensors = load(blob)
            name = sorted(tensors)[0]
            flat = tensors[name].view(-1).view(torch.int32)
            flat[0] ^= 1
            blob = save(tensors)
        return await real(self, url, blob, weight_version)

    monkeypatch.setattr(type(fleet.client), "_post_blob", corrupting)
    with pytest.raises(WeightSyncError, match=victim):
        fleet.client.update_weights(iter(new.items()))
    monkeypatch.undo()
    # An unknown name is refused by the servers, and the push raises too.
    with pytest.raises(WeightSyncError, match="not_a_weight"):
        fleet.client.update_weights(iter([("not_a_weight", torch.zeros(3))]))
    # The fleet still serves after failed pushes (the drain gate reopened).
    assert len(fleet.client.generate(_prompts(2, seed=4), GREEDY)) == 2


def test_close_leaves_no_process(fleet):
    pgids = [p.pid for p in fleet._pending]
    assert len(pgids) >= 4  # 2 servers + router + the restarted server
    assert len(live_members(pgids)) >= 6  # each: a supervisor and its server / router
    t0 = time.monotonic()
    fleet.close()
    assert live_members(pgids) == [] and time.monotonic() - t0 < 15


def _hand_started(*args: str):
    """A native_server started by hand (no fleet, no key unless given), and its URL."""
    from trainer.net import SGLANG_NATIVE_READY_PREFIX, ready_url

    p = subprocess.Popen([sys.executable, "-m", "trainer.rollout.native_server", "--model", str(MODEL), "--port", "0",
                          "--skip-tokenizer-init", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    lines = []
    for line in p.stdout:
        lines.append(line)
        url = ready_url(line, SGLANG_NATIVE_READY_PREFIX)
        if url:
            return p, url, lines
    raise AssertionError("".join(lines))


def test_a_server_started_without_a_key_serves_generation_only():
    """Started by hand without --api-key-env: it says so, generates, and refuses every weight and control
    endpoint (403) unless the operator opens them with --allow-unauthenticated-control."""
    p, url, lines = _hand_started()
    try:
        assert any("no API key" in line and "generation only" in line for line in lines), lines
        status, body = _post(url + "/generate", {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2,
                                                                                             "temperature": 0}})
        assert status == 200 and len(body["output_ids"]) == 2
        for path, body in (("/update_weights_from_tensor", {"serialized_named_tensors": []}),
                           ("/update_weights_from_disk", {"model_path": str(MODEL)}), ("/pause_generation", {}),
                           ("/abort_request", {"rid": "x"})):
            status, reply = _post(url + path, body)
            assert status == 403 and "without an API key" in reply["message"], (path, reply)
        for path in ("/weights_safetensors", "/weights_checksum"):
            with pytest.raises(urllib.error.HTTPError, match="403"):
                _get(url + path)
    finally:
        p.terminate()
        p.wait(30)
    p, url, lines = _hand_started("--allow-unauthenticated-control", "--max-request-mb", "1",
                                  "--max-samples-per-request", "8")
    try:
        assert any("OPEN to anyone" in line for line in lines), lines
        assert "checksum" in _get(url + "/weights_checksum")
        # caps, and bad values as 4xx, never 500
        status, body = _post(url + "/generate", {"input_ids": [3] * 10, "pad": "x" * (2 << 20)})
        assert status == 413, body
        status, body = _post(url + "/generate", {"input_ids": [[3, 4]] * 3, "sampling_params": {"n": 3}})
        assert status == 413 and "9 samples" in body["error"]["message"], body
        req = urllib.request.Request(url + "/generate", data=b'{"input_ids": [3], "sampling_params": {"temperature": NaN}}',
                                     method="POST", headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError, match="400"):
            urllib.request.urlopen(req, timeout=30)
        status, body = _post(url + "/generate", [{"input_ids": [3]}])
        assert status == 400, body
    finally:
        p.terminate()
        p.wait(30)
