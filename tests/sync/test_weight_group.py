"""The weight sync through a torch.distributed group (trainer/sync/dist_group.py), on a real local
Ray cluster: a TP=2 megatron actor (so its blocks are real column / row blocks) in split placement with
two separate engine workers, joined in one gloo group (world = 2 actor ranks + 2 engines). Every actor
rank sends only its own blocks; each engine must end with exactly the actor's weights in its dtype
(fp32, and bf16 engines from the fp32 actor); a bit flipped in what an engine placed is caught and
named (tensor, block, rank, engine); small buckets give the same weights; the metrics name the path."""

from pathlib import Path

import pytest
import torch

from tests.support.tiny import tiny_config
from trainer.rollout.engine import WeightSyncError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")
pytestmark = pytest.mark.slow

BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=6",
        f"actor_rollout_ref.model.path={TINY}", "trainer.logger=[console]", "data.val_batch_size=64",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "trainer.placement=split",
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.num_engines=2",
        "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.weight_sync=distributed_group"]


def test_sent_digests_are_the_source_blocks_digests_and_buckets_are_cut_alike():
    """In one process (threads, a real gloo group of 1 sender + 1 receiver): the digest a sender takes of
    its packed buffer equals ``tensor_digest(key, Block.src(param), engine_dtype)`` for strided column
    blocks cast fp32 -> bf16, the receiver's buckets match the sender's, and the engine's tensor ends
    up equal to the cast source."""
    import threading

    from megatron_bridge.reshard import Block
    from trainer.rollout.engine import tensor_digest
    from trainer.sync import dist_group as wg

    torch.manual_seed(0)
    param = torch.randn(16, 12)  # the blocks take its last 10 columns: strided [4, 10] views
    full = param[:, 2:]
    blocks = [Block("w", (16, 10), (r0, r0 + 4), (0, 10), "p", r0 * 12 + 2, 12) for r0 in (0, 4, 8, 12)]
    plan = [(b.hf_name, b.hf_shape, b.rows, b.cols) for b in blocks]
    assert [len(b) for b in wg.plan_buckets(plan, 2, 100)] == [1, 1, 1, 1]  # 80 B blocks: one each
    assert [len(b) for b in wg.plan_buckets(plan, 2, 160)] == [2, 2]
    store = wg.host_store("127.0.0.1")
    out, view = {}, {"w": torch.zeros(16, 10, dtype=torch.bfloat16)}

    def sender():
        pg, _ = wg.join("127.0.0.1", store.port, 0, 2, torch.device("cpu"), store)
        out["sent"] = wg.Sender(pg, plan, blocks, torch.bfloat16, 160, "cpu").send([1], lambda n: param, True)

    def receiver():
        pg, _ = wg.join("127.0.0.1", store.port, 1, 2, torch.device("cpu"))
        out["placed"] = wg.Receiver(pg, [plan], torch.bfloat16, 160, "cpu").receive(view, True)

    ts = [threading.Thread(target=sender, daemon=True), threading.Thread(target=receiver, daemon=True)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    for b in blocks:
        assert not b.src(param).is_contiguous() and torch.equal(b.src(param), full[b.rows[0]:b.rows[1]])
        assert out["sent"]["digests"][b.key] == tensor_digest(b.key, b.src(param), torch.bfloat16)
    assert out["sent"]["buckets"] == 2 and out["sent"]["bytes"] == out["placed"]["bytes"] == 16 * 10 * 2
    assert torch.equal(view["w"], full.to(torch.bfloat16))
    wg.compare_digests([out["sent"]["digests"]], [out["placed"]["digests"]])
    bad = dict(out["placed"]["digests"])
    bad[blocks[2].key] = (0, bytes(16))
    with pytest.raises(WeightSyncError, match=r"engine 0 holds block w\[8:12,0:10\] of tensor w \(from actor rank 0\)"):
        wg.compare_digests([out["sent"]["digests"]], [bad])


def test_a_sender_that_fails_mid_sync_drains_so_the_engine_does_not_wait_for_the_timeout():
    import threading
    import time

    from megatron_bridge.reshard import Block
    from trainer.sync import dist_group as wg

    param = torch.randn(16, 10)
    blocks = [Block("w", (16, 10), (r0, r0 + 4), (0, 10), "p", r0 * 10, 10) for r0 in (0, 4, 8, 12)]
    plan = [(b.hf_name, b.hf_shape, b.rows, b.cols) for b in blocks]
    store = wg.host_store("127.0.0.1")
    out, view, calls = {}, {"w": torch.zeros(16, 10)}, []

    def param_of(name):
        calls.append(name)
        if len(calls) == 3:
            raise RuntimeError("pack fault injected by the test")
        return param

    def sender():
        pg, _ = wg.join("127.0.0.1", store.port, 0, 2, torch.device("cpu"), store)
        try:
            wg.Sender(pg, plan, blocks, torch.float32, 160, "cpu").send([1], param_of, True)
        except RuntimeError as e:
            out["error"] = str(e)

    def receiver():
        pg, _ = wg.join("127.0.0.1", store.port, 1, 2, torch.device("cpu"))
        out["placed"] = wg.Receiver(pg, [plan], torch.float32, 160, "cpu").receive(view, True)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=sender, daemon=True), threading.Thread(target=receiver, daemon=True)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    assert not any(t.is_alive() for t in ts) and time.perf_counter() - t0 < 30
    assert out["error"] == "pack fault injected by the test" and out["placed"]["bytes"] == 16 * 10 * 4
    assert torch.equal(view["w"][:8], param[:8])  # the buckets before the fault arrived


def _scramble(rollout) -> None:
    """Give every engine other weights, so a sync has to move every byte."""
    import ray

    def scramble(worker):
        with torch.no_grad():
            for v in worker.engine.hf_views().values():
                v.normal_()
        worker.engine.weights_changed()

    ray.get([w.__ray_call__.remote(scramble) for w in rollout.group.workers])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from trainer.main import resolve_model_paths
    from trainer.workers.cluster import Cluster

    cfg = tiny_config(BASE + [f"trainer.default_local_dir={tmp_path_factory.mktemp('c')}"])
    resolve_model_paths(cfg)
    c = Cluster(cfg, total_steps=1)
    assert (c.rollout.shared_memory, c.rollout.distributed_group) == (False, True)  # the key's wiring
    yield cfg, c
    c.shutdown()


def test_group_sync_gives_every_engine_the_actors_weights(cluster):
    cfg, c = cluster
    r = c.rollout
    want = c.actor.weights_checksum("float32")
    _scramble(r)
    assert all(g != want for g in r.engine_checksums())
    m = r.sync_from(c.actor)
    assert r.transport == "distributed_group"
    assert m["sync/group"] == 1.0 and m["sync/verified"] == 1.0 and "sync/shared_memory" not in m
    assert m["sync/verify_seconds"] >= 0.0
    n_params = _engine_numel(r)
    assert m["sync/bytes"] == 4 * n_params  # every element once, fp32 (each rank only its own blocks)
    assert m["sync/buckets"] >= 2  # at least one per actor rank
    assert r.engine_checksums() == [want, want]
    # unverified: the same weights, no digests
    _scramble(r)
    m = r.sync_from(c.actor, verify=False)
    assert "sync/verified" not in m and m["sync/group"] == 1.0
    assert r.engine_checksums() == [want, want]


def _engine_numel(rollout) -> int:
    """Elements of an engine's weights (a tied model holds the embedding once)."""
    import ray

    return ray.get(rollout.group.workers[0].__ray_call__.remote(
        lambda w: sum(v.numel() for v in w.engine.hf_views().values())))


def test_small_buckets_give_the_same_weights(cluster):
    cfg, c = cluster
    r = c.rollout
    want = c.actor.weights_checksum("float32")
    before = r.bucket_bytes
    try:
        r.bucket_bytes = 64 << 10  # many buckets per rank: every receive buffer is reused
        _scramble(r)
        m = r.sync_from(c.actor)
        assert m["sync/buckets"] >= 10 and m["sync/group"] == 1.0
        assert r.engine_checksums() == [want, want]
    finally:
        r.bucket_bytes = before


def test_a_flipped_bit_in_what_an_engine_placed_is_caught_and_named(cluster):
    import ray

    cfg, c = cluster
    r = c.rollout
    name = "model.layers.1.self_attn.o_proj.weight"  # row-parallel: each TP rank sends a column block

    def install(worker):
        from trainer.sync import dist_group as weight_group

        def flip(source, pieces, views):  # rank 1's block of o_proj: one bit of its first element
            for p in pieces:
                if source == 1 and p.block.hf_name == name:
                    p.block.dst(views[name])[0:1, 0:1].view(torch.uint8)[0, 0] ^= 0x01
        weight_group.after_place = flip

    def remove(worker):
        from trainer.sync import dist_group as weight_group

        weight_group.after_place = None

    ray.get(r.group.workers[1].__ray_call__.remote(install))
    try:
        with pytest.raises(WeightSyncError, match=rf"rollout engine 1 holds block {name}\[0:96,48:96\] of tensor "
                                                  rf"{name} \(from actor rank 1\)"):
            r.sync_from(c.actor)
    finally:
        ray.get(r.group.workers[1].__ray_call__.remote(remove))
    m = r.sync_from(c.actor)  # the next sync repairs it
    assert m["sync/verified"] == 1.0
    want = c.actor.weights_checksum("float32")
    assert r.engine_checksums() == [want, want]


def test_bf16_engines_from_an_fp32_actor(cluster):
    """A second rollout on the same actor (its own group): two bf16 engines."""
    from trainer.workers.group import WorkerGroup
    from trainer.workers.rollout_worker import RolloutWorker
    from trainer.workers.rollouts import EngineRollout

    cfg, c = cluster
    kw = dict(model_path=cfg.actor_rollout_ref.model.path, name="native", max_batch_size=4, max_seq_len=32,
              dtype="bfloat16")
    r16 = EngineRollout(WorkerGroup("rollout_bf16", RolloutWorker, [kw] * 2, share=0), free_cache=False,
                        bucket_bytes=c.rollout.bucket_bytes, engine_dtype="bfloat16",
                        transports=("dist_group", "object_store"))
    try:
        _scramble(r16)
        m = r16.sync_from(c.actor)
        assert r16.transport == "distributed_group" and m["sync/group"] == 1.0 and m["sync/verified"] == 1.0
        want = c.actor.weights_checksum("bfloat16")
        assert r16.engine_checksums() == [want, want]
        # the first rollout's group still works beside it
        assert c.rollout.sync_from(c.actor)["sync/group"] == 1.0
    finally:
        r16.shutdown()


def test_an_engine_that_fails_mid_sync_fails_the_sync_at_once_and_the_next_sync_works(cluster):
    import time

    import ray

    cfg, c = cluster
    r = c.rollout

    def install(worker):
        from trainer.sync import dist_group as weight_group

        def fail(source, pieces, views):
            raise RuntimeError("engine fault injected by the test")
        weight_group.after_place = fail

    def remove(worker):
        from trainer.sync import dist_group as weight_group

        weight_group.after_place = None

    ray.get(r.group.workers[0].__ray_call__.remote(install))
    t0 = time.perf_counter()
    try:
        with pytest.raises(Exception, match="engine fault injected"):
            r.sync_from(c.actor)
    finally:
        ray.get(r.group.workers[0].__ray_call__.remote(remove))
    assert time.perf_counter() - t0 < 60  # not the group's timeout
    _scramble(r)
    m = r.sync_from(c.actor)  # a new group
    assert m["sync/group"] == 1.0 and r.transport == "distributed_group"
    want = c.actor.weights_checksum("float32")
    assert r.engine_checksums() == [want, want]


def test_separate_engine_workers_through_shared_memory_catch_a_lossy_copy(cluster):
    """The same split placement with weight_sync=auto (last here: the engines then keep their weights in
    the shared file): the engines share one copy, each TP rank writes its own blocks, and a byte copy
    that lands wrong on an actor rank is named at its block and row (trainer/sync/shared_memory.py)."""
    import ray

    from trainer.rollout.engine import WeightSyncError

    cfg, c = cluster
    r = c.rollout
    r.use("shared_memory", "object_store")
    want = c.actor.weights_checksum("float32")
    _scramble(r)
    m = r.sync_from(c.actor)  # the first one after set-up also checks the full checksums
    assert r.transport == "shared_memory" and m["sync/shared_memory"] == 1.0 and m["sync/verified"] == 1.0
    assert r.engine_checksums() == [want, want]

    def lossy(w, on: bool):
        import ctypes

        from trainer.sync import shared_memory as weight_shm

        real = getattr(weight_shm, "_real_memcpy", weight_shm._memcpy)
        weight_shm._real_memcpy = real
        start = w._sync_half("shared_memory").shared.tensor("model.layers.0.mlp.gate_proj.weight").data_ptr()  # TP rank 0's rows

        def copy(dst, src, n):
            real(dst, src, n)
            if dst <= start < dst + n:
                ctypes.c_ubyte.from_address(start).value ^= 1
        weight_shm._memcpy = copy if on else real

    ray.get([w.__ray_call__.remote(lossy, True) for w in c.actor.group.workers])
    try:
        with pytest.raises(WeightSyncError, match=r"block model.layers.0.mlp.gate_proj.weight\[0:\d+,0:\d+\] .*differs "
                                                  r"from what the actor sent, first at row 0 of"):
            r.sync_from(c.actor)
    finally:
        ray.get([w.__ray_call__.remote(lossy, False) for w in c.actor.group.workers])
    r.sync_from(c.actor)  # the next sync repairs the engines
    assert r.engine_checksums() == [want, want]
