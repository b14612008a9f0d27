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
def _ray(shared_ray):
    yield  # one embedded Ray cluster for the module's runs (tests/conftest.py: shared_ray)


def test_gdpo_with_sapo_trains_one_step(tmp_path):
    from trainer.config import load_config
    from trainer.main import train

    cfg = load_config(["--config", str(ROOT / "recipes" / "cpu" / "tiny_grpo.yaml"),
                       "--config", str(ROOT / "recipes" / "cpu" / "fp32.yaml"), *BASE,
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


def test_optimal_token_baseline_trains_on_the_estimator_of_recomputed_inputs(tmp_path):
    """adv_estimator=optimal_token_baseline with actor.calculate_sum_pi_squared, one step of the real loop
    (megatron actor, two DP ranks, token-level rollout IS from tiny_grpo.yaml). One mini-batch x one epoch,
    the on-policy shape: the separate old-log-prob pass must still run (it returns sum pi^2). The batch the
    step trained on is dumped; its old log-probs and sum pi^2 are recomputed independently (transformers,
    float64, the initial weights = the start-of-step policy), with the IS weights (verl's helper) and verl's
    estimator, and the loop's advantage and variance-proxy metrics must equal what they give. A wrong sum
    pi^2 moves variance_proxy/expected_w (the batch mean of sum_t (1 - 2 pi + sum pi^2) rho^2) and the
    advantages' extremes (the per-position baselines are weighted by it). Tolerance 1e-4 (float32 loop)."""
    import math

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from verl.trainer.ppo import core_algos as V
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    from trainer.config import load_config
    from trainer.debug import dumped_steps, load_batch
    from trainer.main import train

    dump = tmp_path / "dump"
    cfg = load_config(["--config", str(ROOT / "recipes" / "cpu" / "tiny_grpo.yaml"),
                       "--config", str(ROOT / "recipes" / "cpu" / "fp32.yaml"), *BASE,
                       f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.total_training_steps=1",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=8",  # the whole batch: one mini-batch
                       "algorithm.adv_estimator=optimal_token_baseline",
                       "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
                       f"custom_reward_function.path={ROOT / 'tests' / 'algos' / 'otb_scorer.py'}",
                       f"trainer.debug.dump_batch_path={dump}"])
    h = train(cfg)["history"][-1]
    assert h["step"] == 1 and math.isfinite(h["actor/pg_loss"]) and h["actor/grad_norm"] > 0
    assert "timing_s/old_log_prob" in h  # the separate pass ran, although one mini-batch x one epoch

    b = load_batch(dumped_steps(str(dump))[0])
    mask = b.response_mask.bool()  # [B, T]
    P = b.prompt_width
    model = AutoModelForCausalLM.from_pretrained(TINY).double().eval()
    old = torch.zeros(mask.shape, dtype=torch.float64)
    spp = torch.zeros(mask.shape, dtype=torch.float64)
    with torch.no_grad():
        for i in range(b.num_samples):
            am = b.attention_mask[i].bool()
            ids = b.input_ids[i][am]  # the sequence alone: prompt then response, no padding
            n_p = int(am[:P].sum())
            logp = torch.log_softmax(model(ids[None]).logits[0] / cfg.actor_rollout_ref.rollout.temperature, -1)
            rows = torch.arange(n_p - 1, len(ids) - 1)  # the positions that chose the response tokens
            old[i, :len(rows)] = logp[rows].gather(-1, ids[n_p:, None])[:, 0]
            spp[i, :len(rows)] = (2.0 * logp[rows]).exp().sum(-1)
    old, spp = old * mask, spp * mask
    m = mask.double()
    w = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=b.rollout_log_probs.double(), response_mask=m, rollout_is="token",
        rollout_is_threshold=2.0)[0].batch["rollout_is_weights"]  # tiny_grpo.yaml's token-level IS at 2
    adv, ret = V.get_adv_estimator_fn("optimal_token_baseline")(
        token_level_rewards=b.token_level_scores.double(), response_mask=m, index=np.asarray(b.group_ids),
        old_log_probs=old, sum_pi_squared=spp, rollout_is_weights=w, config=None)
    rewards = (b.token_level_scores * mask).sum(-1)
    groups = b.group_ids.unique()
    assert sum(int(rewards[b.group_ids == g].unique().numel() > 1) for g in groups) >= len(groups) // 2  # mixed groups
    assert adv[mask].abs().max() > 0.1  # the advantages are not all 0: the check below can fail
    half = V.get_adv_estimator_fn("optimal_token_baseline")(  # the estimator on a wrong sum pi^2
        token_level_rewards=b.token_level_scores.double(), response_mask=m, index=np.asarray(b.group_ids),
        old_log_probs=old, sum_pi_squared=spp * 0.5, rollout_is_weights=w, config=None)[0]
    assert max(abs(float(half[mask].max() - adv[mask].max())), abs(float(half[mask].min() - adv[mask].min()))) > 1e-3
    for name, x in (("advantages", adv), ("returns", ret)):
        for stat, v in (("mean", x[mask].mean()), ("max", x[mask].max()), ("min", x[mask].min())):
            assert h[f"critic/{name}/{stat}"] == pytest.approx(float(v), abs=1e-4), (name, stat)
    a = (adv * m).sum(-1) / (m.sum(-1) + 1e-8)  # verl's compute_variance_proxy_metrics, by hand
    W = ((1 - 2 * old.exp() + spp) * w**2 * m).sum(-1)
    assert h["variance_proxy/expected_w"] == pytest.approx(float(W.mean()), rel=1e-4)
    assert h["variance_proxy/expected_a_squared"] == pytest.approx(float((a**2).mean()), rel=1e-4)
    # without sum pi^2 (say it were 0) expected_w would be visibly different
    assert abs(float(((1 - 2 * old.exp()) * w**2 * m).sum(-1).mean()) - h["variance_proxy/expected_w"]) > 1e-2
