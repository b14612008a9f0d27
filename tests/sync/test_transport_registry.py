"""The weight-transport seam (trainer/sync/): the choice of transports from what an engine declares, and
that a new transport is one module plus its registration.

The plug-in below (``from_disk``: the engines load the checkpoint a path names) lives only in this file;
registered by name, it runs through an :class:`~trainer.workers.rollouts.EngineRollout` of real native
engines (in-process workers) with no core file changed: the rollout's one receive entry reaches its
receiver half, and its link verifies the sync against a checksum computed here from the file."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from trainer.hf_io import SafetensorsDir
from trainer.rollout.engine import WeightSyncError, checksum_named_tensors
from trainer.rollout.registry import capabilities
from trainer.sync import TRANSPORTS, choose
from trainer.sync.base import Half, Link, check_checksums, sync_metrics
from trainer.workers.group import WorkerGroup
from trainer.workers.rollout_worker import RolloutWorker
from trainer.workers.rollouts import EngineRollout

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "cpu" / "tiny_model")


def test_the_choice_follows_the_engines_protocols_the_placement_and_weight_sync():
    native, sglang = capabilities("native").weight_protocols, capabilities("sglang").weight_protocols
    # engine workers: shared memory first where the engine takes it, the object store behind it
    assert choose(native, "workers", "auto") == ("shared_memory", "object_store")
    assert choose(sglang, "workers", "auto") == ("object_store",)  # SGLang holds no flat storage to share
    assert choose(native, "workers", "object_store") == ("object_store",)
    # weight_sync=distributed_group: the native engines take every rank's blocks, SGLang a broadcast from rank 0
    assert choose(native, "workers", "distributed_group") == ("dist_group", "object_store")
    assert choose(sglang, "workers", "distributed_group") == ("broadcast", "object_store")
    assert choose(("object_store",), "workers", "distributed_group") == ("object_store",)
    # the hybrid engine: shared memory, else a local copy; HTTP servers: the push
    assert choose(native, "hybrid", "auto") == ("shared_memory", "hybrid")
    assert choose(native, "hybrid", "object_store") == ("hybrid",)
    assert choose(sglang, "server", "auto") == choose(native, "server", "distributed_group") == ("http_push",)
    with pytest.raises(ValueError, match="unknown rollout placement"):
        choose(native, "elsewhere", "auto")
    # every name the choice can give is registered
    assert {"shared_memory", "object_store", "dist_group", "broadcast", "hybrid", "http_push"} <= set(TRANSPORTS)


class DiskReceiver(Half):
    """The receiver half: the engine beside it loads the checkpoint at ``path``."""

    def load(self, path: str) -> int:
        ck = SafetensorsDir(path)
        named = [(n, ck.get(n)) for n in ck.keys()]
        self.owner.engine.update_weights(named)
        return sum(t.numel() * t.element_size() for _, t in named)


class FromDisk(Link):
    """The driver's side: every engine loads the file; verified against the file's own checksum."""

    name = label = "from_disk"
    receiver = DiskReceiver
    placements, weight_syncs, protocol = ("workers",), ("auto",), "from_disk"  # engines that declare "from_disk"

    def sync(self, path, verify: bool) -> dict[str, float]:
        t0 = time.perf_counter()
        nbytes = self.rollout.recv_call("from_disk", "load", path)[0]
        if verify:
            ck = SafetensorsDir(path)
            want = checksum_named_tensors(((n, ck.get(n)) for n in ck.keys()), dtype=torch.float32)
            check_checksums([(want, got) for got in self.rollout.engine_checksums()])
        return sync_metrics(t0, nbytes, 1, verify)


class Never(Link):
    """A transport that always declines (as shared memory does across nodes)."""

    name = label = "never"

    def ready(self, actor) -> bool:
        self.reason = "no such hardware here"
        return False


def test_a_registered_transport_is_enough_to_sync_real_engines(monkeypatch):
    monkeypatch.setitem(TRANSPORTS, "from_disk", FromDisk)
    monkeypatch.setitem(TRANSPORTS, "never", Never)
    # the registration alone makes it a choice, where it says it applies and only for engines that accept it
    assert choose(("object_store", "from_disk"), "workers", "auto") == ("object_store", "from_disk")
    assert choose(("object_store", "from_disk"), "workers", "object_store") == ("object_store",)
    assert choose(("object_store",), "workers", "auto") == ("object_store",)
    group = WorkerGroup("rollout", RolloutWorker, [dict(model_path=TINY, max_seq_len=64)] * 2, in_process=True)
    r = EngineRollout(group, free_cache=False, bucket_bytes=1 << 20, engine_dtype="float32",
                      transports=("never", "from_disk"))
    try:
        ck = SafetensorsDir(TINY)
        want = checksum_named_tensors(((n, ck.get(n)) for n in ck.keys()), dtype=torch.float32)
        # the tiny Qwen2 (hidden 96, 4 heads of 24, 2 KV heads, MLP 256, 4 layers, vocab 16, tied embeddings), fp32:
        # a layer = q 96*96+96 + k 48*96+48 + v 48*96+48 + o 96*96 + gate/up/down 3*256*96 + 2 norms 2*96 = 101760
        # elements; 4 layers + embedding 16*96 + final norm 96 = 408672 elements = 1634688 bytes
        nbytes = 1634688
        r.load_bucket([[("model.norm.weight", torch.zeros(96))], []])  # engine 0 corrupted
        assert r.engine_checksums()[0] != want
        with pytest.raises(WeightSyncError, match=r"engine\(s\) \[0\]"):
            check_checksums([(want, g) for g in r.engine_checksums()])
        m = r.sync_from(TINY)
        assert r.transport == "from_disk (no such hardware here)"  # the declined one says why
        assert m["sync/verified"] == 1.0 and m["sync/bytes"] == nbytes
        assert r.engine_checksums() == [want, want]
    finally:
        r.shutdown()
