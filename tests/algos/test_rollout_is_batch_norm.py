"""``algorithm.rollout_correction.rollout_is_batch_normalize`` against verl 0.9.1's
``compute_rollout_correction_and_rejection_mask``: the weights (token and sequence level, truncated, then
divided by their batch mean) and the rejection mask, through the driver's own step
(``trainer.step.driver_math``) built from the config. verl computes the weights and their mean on the
mask BEFORE rejection; a version that normalised over the kept tokens only fails the comparison below
(checked: with token_k1 rejection the means over the kept tokens are 1.059 / 1.167 where verl has 0.983 / 0.888, token / sequence level). Tolerance 1e-6 (float32)."""

from types import SimpleNamespace

import pytest
import torch

from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask


def _plan(level, rs):
    from trainer.config import load_config
    from trainer.plan import Plan

    ov = ["actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_is_threshold=null",
          f"algorithm.rollout_correction.rollout_is={level}", "algorithm.rollout_correction.rollout_is_threshold=1.5",
          "algorithm.rollout_correction.rollout_is_batch_normalize=true"]
    if rs:
        ov += [f"algorithm.rollout_correction.rollout_rs={rs}", "algorithm.rollout_correction.rollout_rs_threshold='0.7_1.3'"]
    return Plan.from_config(load_config(["--config", "recipes/cpu/tiny_grpo.yaml", "--config", "recipes/cpu/fp32.yaml", *ov]), total_steps=1)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("rs", [None, "token_k1"])
def test_batch_normalize_equals_verls(level, rs):
    from trainer.step import driver_math

    g = torch.Generator().manual_seed(0)
    B, T = 8, 7
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    roll = -torch.rand(B, T, generator=g) * 2
    old = roll + 0.3 * torch.randn(B, T, generator=g)
    tls = torch.zeros(B, T)
    tls[torch.arange(B), lengths - 1] = torch.randint(0, 2, (B,), generator=g).float()
    batch = SimpleNamespace(old_log_probs=None, rollout_log_probs=roll, response_mask=mask.clone(),
                            rollout_is_weights=None, token_level_scores=tls, token_level_rewards=None, values=None,
                            group_ids=torch.arange(B) // 4, ref_log_probs=None, num_samples=B)
    plan = _plan(level, rs)
    fetched = SimpleNamespace(fetch=lambda: {"old_log_probs": old})
    m = driver_math(plan, batch, old=fetched, ref=None, values=None, kl_ctrl=None, adca=None, step=1)
    w_proto, v_mask, v_m = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=roll, response_mask=mask, rollout_is=level, rollout_is_threshold=1.5,
        rollout_is_batch_normalize=True, rollout_rs=rs, rollout_rs_threshold="0.7_1.3" if rs else None)
    v_w = w_proto.batch["rollout_is_weights"]
    assert torch.equal(batch.response_mask.bool(), v_mask.bool())
    keep = v_mask.bool()
    torch.testing.assert_close(batch.rollout_is_weights[keep], v_w[keep], atol=1e-6, rtol=1e-6)
    norm = [v for k, v in m.items() if k.endswith("rollout_is_batch_norm_factor")]
    assert norm and abs(norm[0] - v_m["rollout_corr/rollout_is_batch_norm_factor"]) < 1e-6
    if rs:  # rejection removed tokens: the mean over the kept tokens only is a different number
        assert bool((~keep & mask.bool()).any())
