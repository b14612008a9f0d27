"""The training step's fast paths give the same results as the plain ones, on a real local Ray cluster
(megatron-core actor, DP=2 over gloo, native engine):

* on-policy update (one mini-batch, one epoch): no separate old-log-prob forward; the workers take
  their update forward's detached log-probs (and compute the rollout-IS weights from them). From the
  same starting weights (checkpoint save / load) it must give the same losses, gradient norm and
  updated policy as the plain path (separate old-log-prob forward, driver-side IS weights), and the
  log-probs it returns must equal the separate forward's, in the batch's order;
* the weight sync hands the engines Ray object refs and verifies against the checksum rank 0
  took while streaming: equal to the full recomputation, and a corrupted engine is still caught;
* the loop switches to the on-policy path by itself and still logs the rollout entropy and the
  rollout-IS metrics.
"""

from pathlib import Path

import pytest
import torch

from tests.support.batches import random_batch
from tests.support.tiny import tiny_config
from trainer.plan import ForwardSettings

FWD = ForwardSettings(micro_batch_size=8)  # old log-probs at temperature 1, packed

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")
pytestmark = pytest.mark.slow

# 8 prompts x 4 responses; one mini-batch of all 32 (on-policy), DP=2 over the default 2 slots
BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=6",
        f"actor_rollout_ref.model.path={TINY}", "trainer.logger=[console]", "data.val_batch_size=64"]

IS_KW = dict(rollout_is_level="token", rollout_is_mode="truncate", rollout_is_threshold=1.5,
             rollout_is_threshold_lower=None, rollout_is_veto_threshold=1e-4, rollout_is=True)


def test_loop_takes_the_on_policy_path(tmp_path):
    """One mini-batch x one epoch: no old-log-prob phase, and the entropy and IS metrics still come
    (in-process workers: the loop's wiring is what is tested here)."""
    from trainer.main import train

    cfg = tiny_config(BASE + [f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=1",
                              "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
                              "trainer.debug.in_process=true", "trainer.n_gpus_per_node=1"])
    h = train(cfg)["history"][-1]
    assert "timing_s/old_log_prob" not in h
    for key in ("actor/entropy", "mismatch/rollout_is_mean", "actor/pg_loss", "actor/grad_norm"):
        assert key in h, key
    assert h["actor/ppo_kl"] == 0.0 and h["sync/verified"] == 1.0
    assert 0 < h["actor/entropy"] < 10  # tiny vocab: entropy is at most log V


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from trainer.main import resolve_model_paths
    from trainer.workers.cluster import Cluster

    cfg = tiny_config(BASE + [f"trainer.default_local_dir={tmp_path_factory.mktemp('c')}"])
    resolve_model_paths(cfg)
    c = Cluster(cfg, total_steps=4)
    yield cfg, c
    c.shutdown()


def _random_batch(n=32, P=6, T=6, seed=0):
    return random_batch(n, P, T, seed)


def _settings(cfg, **kw):
    from dataclasses import replace

    from trainer.plan import Plan

    return replace(Plan.from_config(cfg, total_steps=4).actor_update, **kw)


def test_on_policy_update_equals_the_separate_old_log_prob_path(cluster, tmp_path):
    from trainer.step import apply_rollout_is
    from trainer.plan import RolloutIS
    from trainer.workers.dataplane import StepData

    cfg, c = cluster
    IS = RolloutIS(**IS_KW)
    # shuffle: the returned log-probs must be put back into the batch's order
    settings = _settings(cfg, mini_batch_size=32, epochs=1, shuffle=True, micro_batch_size=8, temperature=1.0)
    dp = c.actor.dp

    def adv(b, data, **more):
        return data.scatter(dp, {"advantages": b.advantages, **more})

    warm = _random_batch(seed=7)  # one step first: a checkpoint of a fresh optimizer holds no Adam state to load
    wd = StepData(warm, c.transport)
    c.actor.update(wd, settings, [adv(warm, wd, old_log_probs=torch.zeros_like(warm.advantages))], seed=3)
    c.save(str(tmp_path))
    batch = _random_batch()
    probe = StepData(batch, c.transport)
    old_sh, ent_plain = c.actor.log_probs_with_entropy(probe, FWD)
    old = old_sh.fetch()["old_log_probs"]
    g = torch.Generator().manual_seed(1)
    # a sampler that disagrees with the trainer by up to ~e^0.6, so some IS weights are truncated at 1.5
    batch.rollout_log_probs = (old + 0.6 * torch.randn(old.shape, generator=g)) * batch.response_mask

    # plain path: separate old-log-prob forward (by reference), IS weights on the driver
    plain = batch.clone()
    plain.old_log_probs = old
    is_plain = apply_rollout_is(plain, IS)
    assert 0 < is_plain["mismatch/rollout_is_clipped_fraction"] < 1  # the weights matter in this test
    pd = StepData(plain, c.transport)
    m_plain = c.actor.update(pd, settings, [old_sh, adv(plain, pd, rollout_is_weights=plain.rollout_is_weights)], seed=3)
    after_plain, _ = c.actor.log_probs_with_entropy(StepData(batch, c.transport), FWD)

    # on-policy path from the same weights and optimizer state
    c.load(str(tmp_path))
    fd = StepData(batch, c.transport, with_rollout_log_probs=True)
    m_fast, out, ent_fast = c.actor.update(fd, settings, [adv(batch, fd)], seed=3, on_policy=True, rollout_is=IS)
    after_fast, _ = c.actor.log_probs_with_entropy(StepData(batch, c.transport), FWD)

    mask = batch.response_mask.bool()
    torch.testing.assert_close(out["old_log_probs"][mask], old[mask], atol=2e-5, rtol=0)
    assert ent_fast["count"] == ent_plain["count"] == float(mask.sum())
    assert ent_fast["sum"] == pytest.approx(ent_plain["sum"], abs=2e-5 * float(mask.sum()))
    batch.old_log_probs = out["old_log_probs"]
    is_fast = apply_rollout_is(batch, IS, weights=False)  # what the loop logs: the same metrics
    for k in ("mismatch/rollout_is_mean", "mismatch/rollout_is_clipped_fraction", "mismatch/mismatch_kl"):
        assert is_fast[k] == pytest.approx(is_plain[k], abs=1e-5), k
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac"):
        assert m_fast[k] == pytest.approx(m_plain[k], rel=1e-4, abs=1e-7), k
    assert m_fast["actor/ppo_kl"] == 0.0  # ratio exactly 1
    a_plain, a_fast = after_plain.fetch()["old_log_probs"], after_fast.fetch()["old_log_probs"]
    assert not torch.allclose(a_plain, old)  # the policy moved...
    torch.testing.assert_close(a_fast, a_plain, atol=2e-5, rtol=0)  # ...the same way


def test_on_policy_refuses_several_mini_batches(cluster):
    from trainer.workers.dataplane import StepData

    cfg, c = cluster
    b = _random_batch()
    with pytest.raises(ValueError, match="one mini-batch"):
        c.actor.update(StepData(b, c.transport), _settings(cfg, mini_batch_size=16, epochs=1, shuffle=False,
                                                           micro_batch_size=8), [], seed=0, on_policy=True)


def test_workers_run_megatron_without_importing_wandb(cluster):
    """Every worker runs Ray's setup hook (``group.worker_setup``) before its first task: megatron is
    loaded and its optional ``import wandb`` found nothing (an import that would cost each worker 0.5
    CPU-seconds and leave two temporary directories behind when Ray kills it)."""
    import ray

    _, c = cluster

    def modules(w):
        import sys

        return "megatron.core" in sys.modules, "wandb" in sys.modules, sys.modules.get("wandb") is None
    assert ray.get([w.__ray_call__.remote(modules) for w in c.actor.group.workers]) == [(True, True, True)] * c.actor.size


def test_streamed_checksum_equals_the_recomputed_one_and_catches_a_bad_engine(cluster):
    from trainer.rollout.engine import WeightSyncError

    cfg, c = cluster
    # the default colocated layout is the hybrid engine: each engine lives in its actor rank's process
    assert c.hybrid and c.rollout.pids() == c.actor.pids()
    full = c.actor.weights_checksum(cfg.actor_rollout_ref.rollout.dtype)
    # one node: the engines hold one shared copy of the weights, each TP rank writes its own shards into
    # it, and the engines check every block's digest (trainer/sync/shared_memory.py)
    m = c.rollout.sync_from(c.actor)
    assert c.rollout.transport == "shared_memory"
    assert m["sync/verified"] == 1.0 and m["sync/bytes"] > 1e6 and m["sync/buckets"] == 1
    assert m["sync/doorbell"] == 1.0  # the driver rang the ranks directly (trainer/sync/doorbell.py)
    assert full == c.rollout.engine_checksums()[0] == c.rollout.engine_checksums()[1]
    # the object-store path: TP gathers, each rank loads from the stream it hashed
    c.rollout.load_bucket([[("model.norm.weight", torch.zeros(96))], []])
    c.rollout.use("hybrid")
    m = c.rollout.sync_from(c.actor)  # verified against the checksum taken while streaming
    assert c.rollout.transport.startswith("object_store") and m["sync/verified"] == 1.0
    streamed = c.actor.stream_checksum()
    assert streamed == full == c.rollout.engine_checksums()[0] == c.rollout.engine_checksums()[1]
    c.rollout.verify(c.actor)  # recomputed from the actor's weights on every rank
    # a load into rank 0's engine shows in both: the engines of the node share their weights' pages
    c.rollout.load_bucket([[("model.norm.weight", torch.zeros(96))], []])
    with pytest.raises(WeightSyncError, match=r"engine\(s\) \[0, 1\] .*stale or corrupted"):
        c.rollout.verify(c.actor)
    with pytest.raises(WeightSyncError, match="stale or corrupted"):
        c.rollout.verify(c.actor, streamed=True)
    # small buckets: many refs in flight one after another, same result
    c.rollout.bucket_bytes = 64 << 10
    m = c.rollout.sync_from(c.actor)
    assert m["sync/buckets"] > 5 and m["sync/verified"] == 1.0
    # and through shared memory again: a corrupted engine is repaired
    c.rollout.load_bucket([[("model.norm.weight", torch.zeros(96))], []])
    c.rollout.use("shared_memory", "hybrid")
    m = c.rollout.sync_from(c.actor)
    assert c.rollout.transport == "shared_memory" and m["sync/verified"] == 1.0
    assert c.rollout.engine_checksums() == [full, full]
    c.rollout.verify(c.actor)
    # a copy that lands wrong (one bit of down_proj's first row, on whichever DP replica writes it): its
    # in-cache check names it
    def lossy_copy(w, on: bool):
        import ctypes

        from trainer.sync import shared_memory as weight_shm

        real = getattr(weight_shm, "_real_memcpy", weight_shm._memcpy)
        weight_shm._real_memcpy = real
        start = w._sync_half("shared_memory").shared.tensor("model.layers.0.mlp.down_proj.weight").data_ptr()

        def lossy(dst, src, n):  # TP=1: whole tensors (or row ranges of big ones), copied by address
            real(dst, src, n)
            if dst <= start < dst + n:
                ctypes.c_ubyte.from_address(start).value ^= 1
        weight_shm._memcpy = lossy if on else real
    import ray

    ray.get([w.__ray_call__.remote(lossy_copy, True) for w in c.actor.group.workers])
    with pytest.raises(WeightSyncError, match=r"rank \d: .*block model.layers.0.mlp.down_proj.weight\[.*differs from what "
                                              r"the actor sent, first at row 0 of"):
        c.rollout.sync_from(c.actor)
    ray.get([w.__ray_call__.remote(lossy_copy, False) for w in c.actor.group.workers])
    c.rollout.sync_from(c.actor)  # the next sync repairs it
    assert c.rollout.engine_checksums() == [full, full]
    # a rank whose sync raises (not a mismatch) fails the sync through the doorbell, naming the rank;
    # the later syncs of this set-up go through Ray
    def broken_writes(w, on: bool):
        from trainer.sync import shared_memory as weight_shm

        real = getattr(weight_shm, "_real_write_blocks", weight_shm.write_blocks)
        weight_shm._real_write_blocks = real

        def boom(*a, **k):
            raise OSError("the shared file went away")
        weight_shm.write_blocks = boom if on and w.rank == 1 else real
    ray.get([w.__ray_call__.remote(broken_writes, True) for w in c.actor.group.workers])
    from trainer.sync.doorbell import DoorbellError

    with pytest.raises(DoorbellError, match=r"(?s)rank 1: sync_engine_shm failed.*OSError: the shared file went away"):
        c.rollout.sync_from(c.actor)
    ray.get([w.__ray_call__.remote(broken_writes, False) for w in c.actor.group.workers])
    m = c.rollout.sync_from(c.actor)
    assert m["sync/doorbell"] == 0.0 and m["sync/verified"] == 1.0 and c.rollout.engine_checksums() == [full, full]
    # the first verified sync through a new set-up (a new file) is also checked end to end, and only that one
    calls = []
    real_verify = c.rollout.verify
    c.rollout.verify = lambda actor, streamed=False: (calls.append(streamed), real_verify(actor, streamed))
    try:
        c.rollout.link("shared_memory").reset()
        ms = [c.rollout.sync_from(c.actor, verify=verify) for verify in (False, True, True)]
    finally:
        del c.rollout.verify
    assert calls == [False] and c.rollout.transport == "shared_memory"
    assert [m["sync/doorbell"] for m in ms] == [1.0] * 3  # a new set-up opens a new doorbell
    assert c.rollout.engine_checksums() == [full, full]
    c.rollout.bucket_bytes = 512 << 20


def test_weight_check_names_a_bad_engine_and_diverged_replicas():
    from trainer.rollout.engine import WeightSyncError
    from trainer.workers.rollouts import check_checksums

    ok = [("a" * 64, "a" * 64)] * 3
    check_checksums(ok)
    with pytest.raises(WeightSyncError, match=r"engine\(s\) \[2\] hold checksum bbbbbbbbbbbb.*stale"):
        check_checksums(ok[:2] + [("a" * 64, "b" * 64)])
    with pytest.raises(WeightSyncError, match=r"actor rank\(s\) \[1\] diverged: rank 1's weights hash to cccccccccccc"):
        check_checksums([ok[0], ("c" * 64, "c" * 64), ok[0]])


def test_combine_digests_is_checksum_named_tensors():
    from trainer.rollout.engine import checksum_named_tensors, tensor_digest
    from trainer.rollout.weights import combine_digests

    g = torch.Generator().manual_seed(0)
    pairs = [(f"w{i}", torch.randn(3, i + 1, generator=g)) for i in range(5)]
    want = checksum_named_tensors(reversed(pairs), dtype=torch.bfloat16)
    assert combine_digests({n: tensor_digest(n, t, torch.bfloat16) for n, t in pairs}) == want
    assert combine_digests({n: tensor_digest(n, t, None) for n, t in pairs}) != want  # the dtype is in the hash
