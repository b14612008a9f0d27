"""Worker metrics over ALL data-parallel ranks: a DP=2 actor update (megatron-core on gloo, Ray) whose
metrics must equal the values over the whole mini-batch, computed here in float64 from the batch
alone. The old log-probs are the policy's own plus a known offset per token, so every ratio of the
update's first mini-batch is known exactly: ``r = exp(-offset)``."""

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.support.batches import random_batch
from tests.support.tiny import tiny_config
from trainer.plan import ForwardSettings

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from trainer.main import resolve_model_paths
    from trainer.workers.cluster import Cluster

    cfg = tiny_config([f"actor_rollout_ref.model.path={TINY}", "trainer.n_gpus_per_node=2",
                       "trainer.nnodes=1", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                       "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
                       "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
                       "actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.actor.clip_ratio=0.2",
                       "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.2",
                       "actor_rollout_ref.actor.clip_ratio_c=3.0", "actor_rollout_ref.actor.entropy_coeff=0",
                       "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
                       f"trainer.default_local_dir={tmp_path_factory.mktemp('dp2')}"])
    resolve_model_paths(cfg)
    c = Cluster(cfg, total_steps=1)
    yield cfg, c
    c.shutdown()
    import ray

    if ray.is_initialized():
        ray.shutdown()


def test_dp2_actor_metrics_are_whole_batch_values(cluster):
    from trainer.plan import Plan
    from trainer.workers.dataplane import StepData

    cfg, c = cluster
    assert c.actor.dp == 2
    batch = random_batch(16, 6, 6, seed=7)
    data = StepData(batch, c.transport)
    lp = c.actor.log_probs_with_entropy(data, ForwardSettings(micro_batch_size=8))[0].fetch()["old_log_probs"]
    g = torch.Generator().manual_seed(3)
    choices = torch.tensor([-0.5, -0.1, 0.1, 0.5])
    offset = choices[torch.randint(0, 4, lp.shape, generator=g)]  # ratios exp(-offset): far from the clip bounds
    old = lp + offset
    # one mini-batch of all 16 rows; 8 rows per rank in micro-batches of 3, 3, 2 rows (unequal token counts)
    settings = replace(Plan.from_config(cfg, total_steps=1).actor_update, mini_batch_size=16, epochs=1,
                       shuffle=False, micro_batch_size=3, max_token_len=None, temperature=1.0)
    rows = c.actor.update(data, settings, [data.scatter(c.actor.dp, {"old_log_probs": old, "advantages": batch.advantages})],
                          seed=0, per_mini_batch=True)
    assert len(rows) == 1
    m = rows[0]

    # float64 references over the whole batch (verl's compute_policy_loss_vanilla, token-mean)
    mask = batch.response_mask.bool()
    A = batch.advantages.double()[mask]
    r = torch.exp(-offset.double())[mask]
    clipped = ((A > 0) & (r > 1.2)) | ((A < 0) & (r < 0.8))
    l1, l2 = -A * r, -A * r.clamp(0.8, 1.2)
    loss = torch.maximum(l1, l2)
    loss = torch.where(A < 0, torch.minimum(loss, -A * 3.0), loss)
    want = {"actor/pg_clipfrac": float(clipped.double().mean()), "actor/ppo_kl": float(offset.double()[mask].mean()),
            "actor/pg_loss": float(loss.mean()), "actor/adv_abs_mean": float(A.abs().mean()),
            "actor/adv_abs_max": float(A.abs().max()), "actor/is_ratio_max": float(r.max())}
    for k, v in want.items():
        assert m[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k

    # the test bites: DP rank 0's shard alone (what was logged before) gives other values
    rows0 = data.partition(2).rows[0]
    m0 = mask[rows0]
    frac0 = float((((batch.advantages[rows0][m0] > 0) & (torch.exp(-offset[rows0][m0]) > 1.2))
                   | ((batch.advantages[rows0][m0] < 0) & (torch.exp(-offset[rows0][m0]) < 0.8))).double().mean())
    assert abs(frac0 - want["actor/pg_clipfrac"]) > 1e-3
    assert abs(float(offset[rows0][m0].mean()) - want["actor/ppo_kl"]) > 1e-3
