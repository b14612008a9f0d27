"""The optimal token baseline end to end on the driver (issue #20): the config key
``actor_rollout_ref.actor.calculate_sum_pi_squared`` with verl's meaning, the Plan it resolves to, the
driver's step (``trainer.step.driver_math``) feeding the estimator as verl's ``compute_advantage``
does, and verl's ``variance_proxy/*`` metrics.

References are verl 0.9.1's own functions on the same inputs: ``core_algos.get_adv_estimator_fn(name)``
called with the keywords verl's ``ray_trainer.compute_advantage`` passes for these estimators
(ray_trainer.py ~line 264: ``sum_pi_squared``, ``old_log_probs``, ``rollout_is_weights``; the module itself
cannot be imported here, it needs torchdata), its IS weights from
``compute_rollout_correction_and_rejection_mask`` and ``metric_utils.compute_variance_proxy_metrics``.
Inputs are float32 like the loop's; tolerance 1e-6 (float32 rounding of weights up to 2)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import verl.trainer.ppo.core_algos as V
from verl import DataProto
from verl.trainer.ppo.metric_utils import compute_variance_proxy_metrics
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

OTB = ["algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared=true"]


def _cfg(*ov):
    from trainer.config import load_config

    return load_config(["--config", "recipes/cpu/tiny_grpo.yaml", "--config", "recipes/cpu/fp32.yaml", *ov])


def _plan(*ov):
    from trainer.plan import Plan

    return Plan.from_config(_cfg(*ov), total_steps=1)


def _inputs(seed=0, B=12, T=9):
    """Ragged responses in groups of 4 with mixed rewards (outcome on the last token), the old and the
    sampler's log-probs, and sum pi^2 in its range [exp(lp)^2, 1]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()  # [B, T]
    old = -torch.rand(B, T, generator=g) * 3 * mask  # [B, T]
    roll = old + 0.4 * torch.randn(B, T, generator=g) * mask  # some weights truncated at 2
    pi = old.exp()
    spp = (pi**2 + (1 - pi**2) * torch.rand(B, T, generator=g) ** 2) * mask  # [B, T]
    tls = torch.zeros(B, T)
    tls[torch.arange(B), lengths - 1] = torch.tensor([1.0, 0.0, 0.5, 0.0] * (B // 4))
    return mask, old, roll, spp, tls, torch.arange(B) // 4


def _batch(mask, roll, tls, gid):
    from trainer.batch import RolloutBatch

    B, T = mask.shape
    prompts = torch.full((B, 3), 5, dtype=torch.long)
    return RolloutBatch.from_tokens(prompts, (torch.arange(T) + 2).repeat(B, 1) * mask.long(),
                                    torch.ones(B, 3, dtype=torch.bool), mask.bool(), mask.bool(),
                                    rollout_log_probs=roll, group_ids=gid, token_level_scores=tls)


# --------------------------------------------------------------------------------------------------
# config and plan
# --------------------------------------------------------------------------------------------------


def test_otb_needs_the_key_and_the_key_resolves_into_the_plan():
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"set actor_rollout_ref\.actor\.calculate_sum_pi_squared=true"):
        _cfg("algorithm.adv_estimator=tir_optimal_token_baseline")
    # one mini-batch x one epoch (ppo_mini_batch_size = the batch): on-policy without the key ...
    one = ["actor_rollout_ref.actor.ppo_mini_batch_size=16"]
    assert _plan(*one).on_policy(128, 1)
    for extra in (OTB, ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"]):  # OTB, or the key alone
        p = _plan(*one, *extra)
        # ... but with it the separate old-log-prob pass runs (it returns sum pi^2, which the advantages read)
        assert p.sum_pi_squared and p.actor_log_prob.with_sum_pi_squared and not p.on_policy(128, 1)
        assert p.driver_needs_old_log_probs()
        assert not p.ref_log_prob.with_sum_pi_squared and not p.critic_values.with_sum_pi_squared
    assert not _plan().actor_log_prob.with_sum_pi_squared


def test_bypass_mode_refuses_the_key():
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"bypass mode skips the actor's old-log-prob pass"):
        _cfg(*OTB, "algorithm.rollout_is_threshold=null", "algorithm.rollout_correction.bypass_mode=true")


# --------------------------------------------------------------------------------------------------
# the driver's step against verl's compute_advantage
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("is_on", [True, False])
def test_driver_math_feeds_the_estimator_as_verl_does(name, is_on):
    from trainer.step import driver_math

    mask, old, roll, spp, tls, gid = _inputs(seed=1 + is_on)
    ov = [f"algorithm.adv_estimator={name}", "actor_rollout_ref.actor.calculate_sum_pi_squared=true"]
    if not is_on:
        ov += ["algorithm.rollout_is_threshold=null", "actor_rollout_ref.rollout.calculate_log_probs=false"]
    plan = _plan(*ov)
    batch = _batch(mask, roll, tls, gid)
    fetched = SimpleNamespace(fetch=lambda: {"old_log_probs": old, "sum_pi_squared": spp})  # the actor's pass
    driver_math(plan, batch, old=fetched, ref=None, values=None, kl_ctrl=None, adca=None, step=1)
    assert torch.equal(batch.sum_pi_squared, spp) and torch.equal(batch.old_log_probs, old)
    w = None
    if is_on:  # tiny_grpo.yaml: token-level IS truncated at 2 (flat keys) = verl's rollout_is=token, threshold 2
        proto, _, _ = compute_rollout_correction_and_rejection_mask(
            old_log_prob=old, rollout_log_prob=roll, response_mask=mask, rollout_is="token", rollout_is_threshold=2.0)
        w = proto.batch["rollout_is_weights"]
        assert bool((w[mask.bool()] == 2.0).any())  # truncation binds: the weights are not all 1
        torch.testing.assert_close(batch.rollout_is_weights * mask, w * mask, atol=1e-6, rtol=0)
    # verl's compute_advantage, its branch for these two estimators
    adv, ret = V.get_adv_estimator_fn(name)(
        token_level_rewards=tls, response_mask=mask, index=np.asarray(gid), config=None,
        sum_pi_squared=spp, old_log_probs=old, rollout_is_weights=w)
    torch.testing.assert_close(batch.advantages, adv, atol=1e-6, rtol=0)
    torch.testing.assert_close(batch.returns * mask, ret * mask, atol=1e-6, rtol=0)
    # the weights matter here: the same batch with another sum pi^2 trains on other advantages
    other = V.get_adv_estimator_fn(name)(token_level_rewards=tls, response_mask=mask, index=np.asarray(gid),
                                         config=None, sum_pi_squared=spp * 0.5, old_log_probs=old,
                                         rollout_is_weights=w)[0]
    assert (batch.advantages - other).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------------
# verl's variance_proxy/* metrics
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_is", [True, False])
@pytest.mark.parametrize("grad_norm", [None, 0.37])
def test_variance_proxy_metrics_equal_verls(with_is, grad_norm):
    from trainer.algos.advantages import variance_proxy_metrics

    mask, old, roll, spp, _, _ = _inputs(seed=5)
    mask[3] = 0.0  # an empty response (aborted): verl's masked means give it 0
    g = torch.Generator().manual_seed(6)
    adv = torch.randn(mask.shape, generator=g) * mask
    w = (torch.rand(mask.shape, generator=g) * 2) * mask if with_is else None
    if with_is:
        w[0, 0] = 0.0  # a vetoed token
    ours = variance_proxy_metrics(old_log_probs=old, sum_pi_squared=spp, advantages=adv, response_mask=mask,
                                  rollout_is_weights=w, grad_norm=grad_norm)
    fields = {"old_log_probs": old, "sum_pi_squared": spp, "advantages": adv, "response_mask": mask}
    if with_is:
        fields["rollout_is_weights"] = w
    want = compute_variance_proxy_metrics(DataProto.from_dict(tensors=fields), gradient_norm=grad_norm)
    # verl logs the two proxies that need the gradient norm as 0 without it; they are left out here
    skip = {"variance_proxy/proxy1_signal_strength", "variance_proxy/proxy3_pure_noise"} if grad_norm is None else set()
    assert set(ours) == set(want) - skip
    for k, v in ours.items():
        assert v == pytest.approx(float(want[k]), rel=1e-5, abs=1e-7), k
    assert ours["variance_proxy/expected_w"] > 0


def test_batch_metrics_log_the_variance_proxy_when_the_batch_has_sum_pi_squared():
    from trainer.algos.advantages import variance_proxy_metrics
    from trainer.step import batch_metrics

    mask, old, roll, spp, tls, gid = _inputs(seed=7)
    b = _batch(mask, roll, tls, gid)
    b.token_level_rewards, b.scores, b.acc = tls, tls.sum(-1), (tls.sum(-1) > 0).float()
    b.advantages, b.returns, b.old_log_probs = tls * 0.5, tls * 0.5, old
    plan = SimpleNamespace(response_width=9, max_prompt_length=3, actor_update=None)
    assert not any(k.startswith("variance_proxy/") for k in batch_metrics(b, plan, kl_coef=0.0))
    b.sum_pi_squared = spp
    m = batch_metrics(b, plan, kl_coef=0.0, grad_norm=0.5)
    want = variance_proxy_metrics(old_log_probs=old, sum_pi_squared=spp, advantages=b.advantages,
                                  response_mask=mask, grad_norm=0.5)
    assert {k: v for k, v in m.items() if k.startswith("variance_proxy/")} == want
    assert want["variance_proxy/proxy1_signal_strength"] == pytest.approx(0.25)
