"""One short in-process run of the real loop (Ray, megatron-core actor on gloo, the native engine) with a new
estimator and a new loss: GDPO over two reward components of the scorer (``acc``, ``pred``-free keys are
refused elsewhere) and the SAPO loss. Checks that the step trains (finite loss and gradient, the weights
move) and that the GDPO advantages are batch-whitened (mean ~0 over the valid tokens)."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")
pytestmark = pytest.mark.slow

BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=6",
        f"actor_rollout_ref.model.path={TINY}", "trainer.logger=[console]", "data.val_batch_size=64",
        "trainer.val_before_train=false", "trainer.test_freq=0"]


@pytest.fixture(scope="module", autouse=True)
def _ray():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


def test_gdpo_with_sapo_trains_one_step(tmp_path):
    from trainer.config import load_config
    from trainer.main import train

    cfg = load_config(["--config", str(ROOT / "recipes" / "cpu" / "tiny_grpo.yaml"), *BASE,
                       f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.total_training_steps=1",
                       "algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[score,acc]",
                       "algorithm.gdpo_reward_weights=[1.0,0.5]",
                       "actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_pos=1.0",
                       "actor_rollout_ref.actor.tau_neg=1.05"])
    out = train(cfg)
    h = out["history"][-1]
    assert h["step"] == 1
    import math

    for key in ("actor/pg_loss", "actor/grad_norm", "actor/sapo_gate_mean"):
        assert key in h and math.isfinite(h[key]), key
    assert h["actor/grad_norm"] > 0
    # whitened over the batch's valid tokens: mean 0 (unless every advantage is 0)
    assert abs(h["critic/advantages/mean"]) < 1e-4
