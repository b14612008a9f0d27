"""Tests for trainer.algos.correction (rollout IS + rejection + bypass composed in one function).

Parity against verl 0.9.1's own ``compute_rollout_correction_and_rejection_mask`` on random ragged
float64 and float32 batches (all-masked rows, comma-listed rejection options, IcePop thresholds, batch
normalisation), and the hand examples of issue 38: a row rejected by the combination of two options
that each alone would keep part of it, the bypass ``reinforce`` weight on the original mask, and the
GRPO advantages of a group whose first row loses its last token (through the driver's own step)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from trainer.algos.correction import compose_correction, parse_is_threshold
from trainer.algos.rollout_is import compute_rejection_mask
from trainer.verl_compat import parse_rejection
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

ROW = [-1.5, 0.1, 0.1, 0.1]  # issue 38's token log-ratios log pi_train - log pi_rollout


def _is(level="token", threshold=2.0):
    upper, lower = parse_is_threshold(threshold)
    return dict(rollout_is_level=level, rollout_is_mode="truncate" if lower is None else "clip",
                rollout_is_threshold=upper, rollout_is_threshold_lower=lower, rollout_is_veto_threshold=None,
                rollout_is=True)


def _row_batch(dtype=torch.float64):
    roll = torch.tensor([[-1.0, -2.0, -0.5, -1.2], [-0.3, -0.4, -0.5, -0.6]], dtype=dtype)
    old = roll + torch.tensor([ROW, [0.0, 0.0, 0.0, 0.0]], dtype=dtype)
    return old, roll, torch.ones(2, 4, dtype=dtype)


def test_combined_options_reject_the_whole_row():
    old, roll, mask = _row_batch()
    rej = parse_rejection("token_k1,seq_mean_k3", "0.5_2.0,0.05", None)
    c = compose_correction(old, roll, mask, rejection=rej)
    # token_k1 drops token 0 (-log rho = 1.5 > log 2); seq_mean_k3 over the ORIGINAL four tokens is
    # (e^-1.5 + 1.5 - 1 + 3 (e^0.1 - 1.1)) / 4 = 0.1847 > 0.05, so the row goes. Applied one after the
    # other, the second option would see only the three 0.1 tokens (mean k3 0.0052) and keep them.
    assert c.loss_mask.tolist() == [[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    assert c.metrics["mismatch/rollout_rs_token_k1_masked_fraction"] == pytest.approx(1 / 8)
    assert c.metrics["mismatch/rollout_rs_seq_mean_k3_masked_fraction"] == pytest.approx(4 / 8)
    assert c.metrics["mismatch/rollout_rs_masked_fraction"] == pytest.approx(4 / 8)
    assert c.metrics["mismatch/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert c.metrics["mismatch/rollout_rs_seq_rejected_fraction"] == pytest.approx(1 / 2)
    # verl agrees
    _, v_mask, _ = compute_rollout_correction_and_rejection_mask(
        old, roll, mask, rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.5_2.0,0.05")
    assert torch.equal(v_mask, c.loss_mask)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_bypass_reinforce_weight_on_the_original_mask(dtype):
    old, roll, mask = _row_batch(dtype)  # in bypass mode "old" is the current policy's log-probs
    rej = parse_rejection("token_k1", "0.5_2.0", None)
    c = compose_correction(old, roll, mask, rollout_is=_is("sequence"), rejection=rej, bypass="reinforce")
    # the sequence weight is exp(-1.5 + 0.3) = 0.301 over all four sampled tokens (1.35 = e^0.3 if the
    # rejected first token were left out of the product)
    assert c.loss_mask[0].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert c.weights[0].tolist() == pytest.approx([math.exp(-1.2)] * 4, rel=1e-6)
    assert c.weights[0, 1].item() == pytest.approx(0.30, abs=5e-3)
    assert c.weights[1].tolist() == pytest.approx([1.0] * 4)
    # ppo_clip: the ratio is the correction; the metrics are still there
    pc = compose_correction(old, roll, mask, rollout_is=_is("sequence"), rejection=rej, bypass="ppo_clip")
    assert pc.weights is None and torch.equal(pc.loss_mask, c.loss_mask)
    assert pc.metrics["mismatch/rollout_is_mean"] == pytest.approx(c.metrics["mismatch/rollout_is_mean"])


def test_grpo_reads_rewards_as_sampled():
    """Group of two with rewards [1, 0]; the first row's last token fails token_k1. The estimator sees
    the reward on it (advantages +-1/sqrt(2), as in verl) and only the loss mask loses the token."""
    from trainer.config import load_config
    from trainer.plan import Plan
    from trainer.step import driver_math

    ov = ["actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_is_threshold=null",
          "algorithm.adv_estimator=grpo", "algorithm.rollout_correction.rollout_rs=token_k1",
          "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0'"]
    plan = Plan.from_config(load_config(["--config", "recipes/cpu/tiny_grpo.yaml", "--config", "recipes/cpu/fp32.yaml",
                                         *ov]), total_steps=1)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    roll = torch.full((2, 3), -1.0) * mask
    old = roll.clone()
    old[0, 2] = -3.0  # -log rho = 2 > log 2: rejected
    tls = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    batch = SimpleNamespace(old_log_probs=None, rollout_log_probs=roll, response_mask=mask.clone(),
                            rollout_is_weights=None, token_level_scores=tls, token_level_rewards=None, values=None,
                            group_ids=torch.tensor([0, 0]), ref_log_probs=None, num_samples=2, sum_pi_squared=None)
    m = driver_math(plan, batch, old=SimpleNamespace(fetch=lambda: {"old_log_probs": old}), ref=None, values=None,
                    kl_ctrl=None, adca=None, step=1)
    assert batch.response_mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    a = 1 / math.sqrt(2) / (1 + 1e-6 * math.sqrt(2))  # (R - mean) / (std + 1e-6)
    assert batch.advantages.flatten().tolist() == pytest.approx([a, a, 0.0, -a, -a, 0.0], rel=1e-6)
    assert a == pytest.approx(0.707, abs=5e-4)
    assert m["mismatch/rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
    assert m["mismatch/rollout_rs_seq_rejected_fraction"] == 0.0


def test_is_threshold_spellings():
    assert parse_is_threshold(2.0) == (2.0, None)
    assert parse_is_threshold("1.5") == (1.5, None)
    assert parse_is_threshold("0.5_2.0") == (2.0, 0.5)
    for bad in ("2.0_0.5", "a_b", "-1", True, None, "0_2"):
        with pytest.raises((TypeError, ValueError)):
            parse_is_threshold(bad)


def test_icepop_threshold_from_the_config():
    from trainer.config import load_config
    from trainer.plan import Plan

    ov = ["actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_is_threshold=null",
          "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold='0.5_2.0'"]
    p = Plan.from_config(load_config(["--config", "recipes/cpu/tiny_grpo.yaml", *ov]), total_steps=1)
    assert (p.rollout_is.rollout_is_mode, p.rollout_is.rollout_is_threshold, p.rollout_is.rollout_is_threshold_lower) \
        == ("clip", 2.0, 0.5)


def test_empty_mask_and_bad_bypass():
    old, roll, mask = _row_batch()
    c = compose_correction(old, roll, torch.zeros_like(mask), rollout_is=_is(), rejection=parse_rejection("token_k1", 2.0, None))
    assert c.weights is None and c.metrics == {} and not c.loss_mask.any()
    with pytest.raises(ValueError, match="bypass"):
        compose_correction(old, roll, mask, bypass="ppo")


# ------------------------------------------------------------------------------------------------
# parity with verl 0.9.1 on random ragged batches
# ------------------------------------------------------------------------------------------------

CASES = [  # (rollout_is level or None, its threshold, rollout_rs or None, its threshold, normalize)
    ("token", 2.0, None, None, False),
    ("sequence", 2.0, None, None, True),
    ("token", "0.8_1.25", None, None, False),
    ("sequence", "0.3_3.0", None, None, True),
    ("token", 1.5, "token_k1", "0.7_1.3", True),
    ("sequence", 1.5, "token_k1,seq_mean_k3", "0.7_1.4,0.02", True),
    ("token", 2.0, "seq_sum_k2,seq_max_k3,token_k3", "0.4,0.08,0.05", False),
    (None, None, "seq_mean_k1,seq_sum_k3,token_k2", "0.9_1.1,0.3,0.02", False),
    ("token", "0.8_1.25", "token_k1,seq_max_k2", 1.3, True),
]


def _ragged(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 13, 9
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[[3, 8]] = 0  # all-masked rows
    mask = (torch.arange(T)[None] < lengths[:, None]).to(dtype)
    roll = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 2).to(dtype)
    old = (roll.double() + 0.25 * torch.randn(B, T, generator=g, dtype=torch.float64)).to(dtype)
    return old, roll, mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("level,is_th,rs,rs_th,norm", CASES)
def test_parity_with_verl(dtype, level, is_th, rs, rs_th, norm):
    for seed in range(4):
        old, roll, mask = _ragged(dtype, seed)
        c = compose_correction(old, roll, mask, rollout_is=_is(level, is_th) if level else None,
                               rejection=parse_rejection(rs, rs_th, None) if rs else None, batch_normalize=norm)
        v_w, v_mask, v_m = compute_rollout_correction_and_rejection_mask(
            old, roll, mask, rollout_is=level, rollout_is_threshold=is_th, rollout_is_batch_normalize=norm,
            rollout_rs=rs, rollout_rs_threshold=rs_th)
        assert torch.equal(c.loss_mask, v_mask), (seed, (c.loss_mask != v_mask).nonzero())
        valid = mask.bool()
        # float64: verl's masked_mean divides by (count + 1e-8), a 1e-9 relative shift of its row means
        tol = 1e-8 if dtype == torch.float64 else 2e-6
        if level:
            torch.testing.assert_close(c.weights[valid].double(), v_w.batch["rollout_is_weights"][valid].double(),
                                       atol=tol, rtol=tol)
            assert not c.weights[~valid].any()
        else:
            assert c.weights is None
        if norm and level:
            assert c.metrics["rollout_is_batch_norm_factor"] == pytest.approx(
                v_m["rollout_corr/rollout_is_batch_norm_factor"], rel=tol)
        if rs:
            options = rs.split(",")
            assert c.metrics["mismatch/rollout_rs_masked_fraction"] == pytest.approx(
                v_m["rollout_corr/rollout_rs_masked_fraction"], abs=1e-7)
            for opt in options if len(options) > 1 else ():
                assert c.metrics[f"mismatch/rollout_rs_{opt}_masked_fraction"] == pytest.approx(
                    v_m[f"rollout_corr/rollout_rs_{opt}_masked_fraction"], abs=1e-7)
            # verl divides its combined row fraction by every row, the empty ones included
            rows = valid.any(-1)
            assert c.metrics["mismatch/rollout_rs_seq_masked_fraction"] * int(rows.sum()) / len(rows) == pytest.approx(
                v_m["rollout_corr/rollout_rs_seq_masked_fraction"], abs=1e-7)


def test_rejection_mask_dtype_kept():
    old, roll, mask = _ragged(torch.float32, 0)
    rej = parse_rejection("token_k1,seq_sum_k3", "0.7_1.4,0.3", None)
    c_bool = compose_correction(old, roll, mask.bool(), rejection=rej)
    c_f = compose_correction(old, roll, mask, rejection=rej)
    assert c_bool.loss_mask.dtype == torch.bool and c_f.loss_mask.dtype == torch.float32
    assert torch.equal(c_bool.loss_mask, c_f.loss_mask.bool())
    # each option alone, on the original mask, ANDed: the same mask
    want = mask.clone()
    for r in rej:
        want = want * compute_rejection_mask(old, roll, mask, **r)[0]
    assert torch.equal(c_f.loss_mask, want)


def test_inside_the_loss_no_metrics_same_weights():
    old, roll, mask = _ragged(torch.float32, 1)
    rej = parse_rejection("token_k1,seq_mean_k3", "0.7_1.4,0.02", None)
    full = compose_correction(old, roll, mask, rollout_is=_is("sequence"), rejection=rej, bypass="reinforce")
    lean = compose_correction(old, roll, mask, rollout_is=_is("sequence"), rejection=rej, bypass="reinforce",
                              with_metrics=False)
    assert lean.metrics == {} and full.metrics
    assert torch.equal(lean.weights, full.weights) and torch.equal(lean.loss_mask, full.loss_mask)
    pc = compose_correction(old, roll, mask, rollout_is=_is("sequence"), rejection=rej, bypass="ppo_clip",
                            with_metrics=False)
    assert pc.weights is None and torch.equal(pc.loss_mask, full.loss_mask)


def test_bad_is_threshold_is_refused_by_the_config():
    from trainer.config import load_config
    from trainer.config.schema import ConfigError

    ov = ["actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_is_threshold=null",
          "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold='2.0_0.5'"]
    with pytest.raises(ConfigError, match="rollout_is_threshold"):
        load_config(["--config", "recipes/cpu/tiny_grpo.yaml", *ov])
