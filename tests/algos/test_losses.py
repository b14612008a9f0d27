"""Tests for trainer.algos.losses: golden numbers, float64 per-sample loop references, and the
global-aggregation invariance under micro-batch splitting and data-parallel sharding."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.algos import losses as L
from trainer.algos.losses import AGG_MODES, POLICY_LOSSES, LossAgg, agg_loss, batch_norm_counts, get_policy_loss_fn

F64 = torch.float64
ALL_LOSSES = sorted(POLICY_LOSSES)
# losses whose per-token loss depends only on its own sequence, so splitting rows cannot change them
SPLIT_INVARIANT_LOSSES = ["vanilla", "gspo", "gpg", "geo_mean", "cispo"]


def t64(x):
    return torch.tensor(x, dtype=F64)


def close(a, b, tol=1e-10):
    return torch.allclose(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), atol=tol, rtol=tol)


# ================================================================================================
# Golden numbers: aggregation
# ================================================================================================


def test_agg_golden_all_modes():
    loss = t64([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = t64([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # row 3 fully masked: it must neither add nor count
    # valid tokens: 1, 2, 3 | 4  -> 4 tokens, 2 sequences (the 9s and 7s are padding)
    # token-mean: (1+2+3+4)/4 = 2.5
    assert close(agg_loss(loss, mask, LossAgg("token-mean")), 2.5)
    # token-sum: 10
    assert close(agg_loss(loss, mask, LossAgg("token-sum")), 10.0)
    # seq-mean-token-sum: (6 + 4)/2 = 5
    assert close(agg_loss(loss, mask, LossAgg("seq-mean-token-sum")), 5.0)
    # seq-mean-token-mean: (6/3 + 4/1)/2 = (2 + 4)/2 = 3
    assert close(agg_loss(loss, mask, LossAgg("seq-mean-token-mean")), 3.0)
    # seq-mean-token-sum-norm, K = T = 3: (6/3 + 4/3)/2 = 5/3
    assert close(agg_loss(loss, mask, LossAgg("seq-mean-token-sum-norm")), 5.0 / 3.0)
    # ... with K = 10: (0.6 + 0.4)/2 = 0.5
    assert close(agg_loss(loss, mask, LossAgg("seq-mean-token-sum-norm", norm_constant=10)), 0.5)
    # counts: 4 tokens, 2 sequences with a valid token
    n_tok, n_seq = batch_norm_counts(mask, "token-mean")
    assert int(n_tok) == 4 and int(n_seq) == 2


def test_agg_global_counts_and_dp_size_golden():
    loss = t64([[1.0, 2.0], [3.0, 0.0]])
    mask = t64([[1, 1], [1, 0]])
    # this micro-batch holds 3 of 12 global tokens and 2 of 5 global sequences; dp_size 2:
    # token-mean: (1+2+3)/12*2 = 1.0
    assert close(agg_loss(loss, mask, LossAgg("token-mean", global_num_tokens=12, dp_size=2)), 1.0)
    # seq-mean-token-mean: (1.5 + 3)/5*2 = 1.8
    assert close(agg_loss(loss, mask, LossAgg("seq-mean-token-mean", global_num_seqs=5, dp_size=2)), 1.8)
    # seq-mean-token-sum: (3 + 3)/5*2 = 2.4 ; token-sum: 6*2 = 12
    assert close(agg_loss(loss, mask, LossAgg("seq-mean-token-sum", global_num_seqs=t64(5.0), dp_size=2)), 2.4)
    assert close(agg_loss(loss, mask, LossAgg("token-sum", dp_size=2)), 12.0)


def test_agg_nan_padding_and_empty_batch():
    loss = t64([[1.0, float("nan")], [float("inf"), 2.0]])
    mask = torch.tensor([[True, False], [False, True]])
    # padding NaN/inf is selected out, not multiplied: (1 + 2)/2 = 1.5
    assert close(agg_loss(loss, mask, LossAgg("token-mean")), 1.5)
    empty = torch.zeros(2, 2, dtype=torch.bool)
    for mode in AGG_MODES:
        assert close(agg_loss(loss, empty, LossAgg(mode)), 0.0)  # 0 / max(0, 1), not NaN


def test_agg_bf16_reduces_in_float32():
    x = torch.full((4, 1024), 1.0, dtype=torch.bfloat16)
    out = agg_loss(x, torch.ones_like(x), LossAgg("token-sum"))
    # 4096 ones: a bf16 running sum would stall at 256; float32 gives exactly 4096
    assert out.dtype == torch.float32 and out.item() == 4096.0


def test_agg_unknown_mode():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), LossAgg("seq-mean"))


def test_loss_agg_is_frozen_and_gspo_gmpo_default_to_seq_mean_token_mean():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        LossAgg().mode = "token-sum"
    with pytest.raises(TypeError, match="LossAgg"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "token-mean")
    old, lp, adv, mask, _ = random_inputs(seed=4)
    for fn in (L.gspo, L.geo_mean):
        a, _ = fn(old, lp, adv, mask)
        b, _ = fn(old, lp, adv, mask, agg=LossAgg("seq-mean-token-mean"))
        assert close(a, b)


# ================================================================================================
# Golden numbers: policy losses
# ================================================================================================


def _leaf(x):
    return t64(x).requires_grad_(True)


def test_vanilla_golden_clip_high_and_dual_clip():
    # token 0: A = +1, r = 1.5, eps_h = 0.2 -> objective min(1.5*1, 1.2*1) = 1.2 -> loss -1.2 (no grad)
    # token 1: A = -1, r = 5,   c = 3     -> PPO objective min(-5, -1.2) = -5; dual max(-5, -3) = -3
    #                                        -> loss 3 (no grad: the cap is constant)
    # token 2: A = +1, r = 1.1              -> unclipped, loss -1.1, d loss / d logp = -A r = -1.1
    old = t64([[0.0, 0.0, 0.0]])
    lp = _leaf([[math.log(1.5), math.log(5.0), math.log(1.1)]])
    adv = t64([[1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, met = L.vanilla(old, lp, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0, agg=LossAgg("token-sum"))
    assert close(loss, -1.2 + 3.0 - 1.1)
    loss.backward()
    assert close(lp.grad, [[0.0, 0.0, -1.1]])
    # clip fractions over 3 tokens: upper bound clipped at token 0; dual clip at token 1
    assert close(met["pg_clipfrac"], 1 / 3) and close(met["pg_clipfrac_upper_bound"], 1 / 3)
    assert close(met["pg_clipfrac_lower_bound"], 0.0) and close(met["pg_clipfrac_lower"], 1 / 3)
    # ppo_kl = mean(old - logp) = -(ln1.5 + ln5 + ln1.1)/3
    assert close(met["ppo_kl"], -(math.log(1.5) + math.log(5) + math.log(1.1)) / 3)
    assert close(met["is_ratio_max"], 5.0) and close(met["is_ratio_min"], 1.1)
    # unclipped losses -A r: -1.5, +5, -1.1 ; clipped (used) losses: -1.2, 3, -1.1
    assert close(met["pg_loss_unclipped_mean"], (-1.5 + 5 - 1.1) / 3)
    assert close(met["pg_loss_clipped_mean"], (-1.2 + 3 - 1.1) / 3)


def test_vanilla_golden_clip_higher_asymmetry():
    # eps_l = 0.2, eps_h = 0.28 (DAPO clip-higher)
    # t0: A=+1, r=1.5 -> min(1.5, 1.28) = 1.28      -> loss -1.28 (upper bound, no grad)
    # t1: A=-1, r=0.5 -> min(-0.5, -0.8) = -0.8     -> loss  0.8  (lower bound 1-0.2, no grad)
    # t2: A=+1, r=0.5 -> min(0.5, 0.8) = 0.5        -> loss -0.5  (unclipped, grad -A r = -0.5)
    # t3: A=-1, r=1.25-> min(-1.25, -1.25) = -1.25 -> loss 1.25 (1.25 < 1.28: unclipped, grad +1.25)
    old = torch.zeros(1, 4, dtype=F64)
    lp = _leaf([[math.log(1.5), math.log(0.5), math.log(0.5), math.log(1.25)]])
    adv = t64([[1.0, -1.0, 1.0, -1.0]])
    loss, met = L.vanilla(old, lp, adv, torch.ones(1, 4), clip_ratio_low=0.2, clip_ratio_high=0.28)
    # token-mean: (-1.28 + 0.8 - 0.5 + 1.25)/4 = 0.0675
    assert close(loss, 0.0675)
    loss.backward()
    assert close(lp.grad, [[0.0, 0.0, -0.5 / 4, 1.25 / 4]])
    assert close(met["pg_clipfrac_upper_bound"], 0.25) and close(met["pg_clipfrac_lower_bound"], 0.25)
    assert close(met["pg_clipfrac"], 0.5) and close(met["pg_clipfrac_lower"], 0.0)


def test_vanilla_rejects_bad_dual_clip():
    z = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        L.vanilla(z, z, z, torch.ones(1, 1), clip_ratio_c=1.0)


def test_gspo_golden():
    # seq 0: log ratios [ln 2, 0] -> s = exp(ln2/2) = sqrt 2 = 1.41421; A = +1, eps_h = 0.2
    #        objective min(1.414, 1.2) = 1.2 per token -> token-mean within seq -> loss -1.2 (no grad)
    # seq 1: log ratios [ln .9]*3 -> s = 0.9; A = +1 -> min(0.9, clip(0.9)=0.9) = 0.9 -> loss -0.9
    # seq-mean: (-1.2 - 0.9)/2 = -1.05
    # grad seq 1: loss = -(1/2)(1/3) sum_t s_it, d s_it / d logp_t = s = 0.9 -> -0.9/6 = -0.15 each
    old = t64([[-1.0, -1.0, 0.0], [-1.0, -2.0, -3.0]])
    lp = _leaf([[-1.0 + math.log(2.0), -1.0, 5.0], [-1.0 + math.log(0.9), -2.0 + math.log(0.9), -3.0 + math.log(0.9)]])
    adv = t64([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    mask = t64([[1, 1, 0], [1, 1, 1]])
    loss, met = L.gspo(old, lp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert close(loss, -1.05)
    loss.backward()
    assert close(lp.grad, [[0.0, 0.0, 0.0], [-0.15, -0.15, -0.15]])
    # 2 of 5 valid tokens sit in the clipped sequence
    assert close(met["pg_clipfrac"], 2 / 5) and close(met["seq_ratio_max"], math.sqrt(2.0))
    assert close(met["seq_ratio_mean"], (math.sqrt(2.0) + 0.9) / 2)


def test_gspo_default_ranges_are_the_papers():
    # s = exp(3.5e-4) = 1.00035 lies inside (1-3e-4, 1+4e-4): unclipped; at 4.5e-4 it is clipped
    old = torch.zeros(1, 2, dtype=F64)
    adv = torch.ones(1, 2, dtype=F64)
    _, met = L.gspo(old, old + 3.5e-4, adv, torch.ones(1, 2))
    assert close(met["pg_clipfrac"], 0.0)
    _, met = L.gspo(old, old + 4.5e-4, adv, torch.ones(1, 2))
    assert close(met["pg_clipfrac"], 1.0)


def test_cispo_golden():
    # t0: A=+1, r=1.5, eps_h=0.2 -> weight sg(1.2); loss -1.2*1*logp = -1.2*(-0.5) = 0.6; grad -1.2
    #     (PPO would give this token no gradient at all; CISPO keeps it, scaled by the clipped weight)
    # t1: A=+1, r=0.5, eps_l=0.2 -> weight 0.8; logp = -2 -> loss 1.6; grad -0.8
    # t2: A=-2, r=1.0 -> weight 1; logp = -1 -> loss -2*... = -(1)(-2)(-1) = -2; grad +2
    old = t64([[-0.5 - math.log(1.5), -2.0 - math.log(0.5), -1.0]])
    lp = _leaf([[-0.5, -2.0, -1.0]])
    adv = t64([[1.0, 1.0, -2.0]])
    loss, met = L.cispo(old, lp, adv, torch.ones(1, 3), clip_ratio=0.2, agg=LossAgg("token-sum"))
    assert close(loss, 0.6 + 1.6 - 2.0)
    loss.backward()
    assert close(lp.grad, [[-1.2, -0.8, 2.0]])
    assert close(met["pg_clipfrac_upper_bound"], 1 / 3) and close(met["pg_clipfrac_lower_bound"], 1 / 3)


def test_gpg_golden():
    # loss = -A logp: t0: -(2)(-0.3) = 0.6; t1: -(-1)(-1.5) = -1.5; token-mean = (0.6 - 1.5)/2 = -0.45
    # grad: -A/2 -> [-1, 0.5]; old_log_prob does not matter
    lp = _leaf([[-0.3, -1.5]])
    loss, _ = L.gpg(torch.full((1, 2), -9.0, dtype=F64), lp, t64([[2.0, -1.0]]), torch.ones(1, 2))
    assert close(loss, -0.45)
    loss.backward()
    assert close(lp.grad, [[-1.0, 0.5]])


def test_geo_mean_golden():
    # log-space bounds 0.2 / 0.2
    # seq 0, A=+1, log ratios [0.5, -0.1]: A>0 caps from above -> [0.2, -0.1]; mean 0.05
    #        rho = e^0.05 = 1.051271; L0 = -1 * e^0.05
    # seq 1, A=-1, log ratios [-0.5, 0.1]: A<0 caps from below -> [-0.2, 0.1]; mean -0.05
    #        rho = e^-0.05 = 0.951229; L1 = +e^-0.05
    # seq-mean-token-mean: (L0 + L1)/2
    old = torch.zeros(2, 2, dtype=F64)
    lp = _leaf([[0.5, -0.1], [-0.5, 0.1]])
    adv = t64([[1.0, 1.0], [-1.0, -1.0]])
    loss, met = L.geo_mean(old, lp, adv, torch.ones(2, 2), clip_ratio=0.2)
    assert close(loss, (-math.exp(0.05) + math.exp(-0.05)) / 2)
    loss.backward()
    # d L0/d lp = -rho0 * (1/2) on the unclipped token (token 1), 0 on the clipped one; / 2 seqs
    # d L1/d lp = +rho1 * (1/2) on token 1 of seq 1
    assert close(lp.grad, [[0.0, -math.exp(0.05) / 4], [0.0, math.exp(-0.05) / 4]])
    assert close(met["pg_clipfrac_upper_bound"], 0.25) and close(met["pg_clipfrac_lower_bound"], 0.25)


def test_kl_cov_golden():
    # one sequence, A = [1, -1, 1, -1] (mean 0), logp = [-0.5, -3, -2.5, -2] (mean -2)
    # cov = A (logp + 2) = [1*1.5, -1*-1, 1*-0.5, -1*0] = [1.5, 1, -0.5, 0]
    # kl_cov_ratio 0.5 -> k = int(4*0.5) = 2 -> tokens 0 and 1 get + coef |Δ|
    # Δ = logp - old = [0.1, -0.2, 0.3, 0]
    # loss: t0 -e^.1 + .1; t1 +e^-.2 + .2; t2 -e^.3; t3 +1 ; token-mean over 4
    lp = t64([[-0.5, -3.0, -2.5, -2.0]])
    old = lp - t64([[0.1, -0.2, 0.3, 0.0]])
    adv = t64([[1.0, -1.0, 1.0, -1.0]])
    loss, met = L.kl_cov(old, lp, adv, torch.ones(1, 4), kl_cov_ratio=0.5, ppo_kl_coef=1.0)
    expect = (-math.exp(0.1) + 0.1 + math.exp(-0.2) + 0.2 - math.exp(0.3) + 1.0) / 4
    assert close(loss, expect)
    assert close(met["klcov_frac"], 0.5)


# ================================================================================================
# Float64 per-sample Python-loop references
# ================================================================================================


def ref_agg(per_tok, mask, mode, norm=None):
    """per_tok: dict (i, t) -> 0-dim tensor for valid tokens only; mask: list of lists of bool."""
    B, T = len(mask), len(mask[0])
    zero = torch.zeros((), dtype=F64)
    if mode in ("token-mean", "token-sum"):
        total, n = zero, 0
        for i in range(B):
            for t in range(T):
                if mask[i][t]:
                    total = total + per_tok[(i, t)]
                    n += 1
        return total if mode == "token-sum" else total / max(n, 1)
    seq_vals = []
    for i in range(B):
        ts = [t for t in range(T) if mask[i][t]]
        if not ts:
            continue  # a fully masked sequence neither adds nor counts
        s = zero
        for t in ts:
            s = s + per_tok[(i, t)]
        if mode == "seq-mean-token-mean":
            s = s / len(ts)
        elif mode == "seq-mean-token-sum-norm":
            s = s / (T if norm is None else norm)
        seq_vals.append(s)
    if not seq_vals:
        return zero
    total = zero
    for s in seq_vals:
        total = total + s
    return total / len(seq_vals)


def _clampf(x, lo, hi):
    return max(lo, min(hi, x))


def _valid(mask, i):
    return [t for t in range(len(mask[i])) if mask[i][t]]


def ref_tokens(name, old, lp, adv, mask, kw):
    """Per-token losses by the textbook formulas, one token (or one sequence) at a time."""
    B, T = old.shape
    lpd = lp.detach()  # for the plain-float (no-gradient) parts
    eps_l = kw.get("clip_ratio_low", kw.get("clip_ratio"))
    eps_h = kw.get("clip_ratio_high", kw.get("clip_ratio"))
    out = {}
    if name in ("vanilla", "clip_cov"):
        for i in range(B):
            for t in _valid(mask, i):
                a = float(adv[i, t])
                r = torch.exp(torch.clamp(lp[i, t] - old[i, t], -20, 20))
                obj = torch.minimum(r * a, torch.clamp(r, 1 - eps_l, 1 + eps_h) * a)
                if name == "vanilla" and a < 0:
                    obj = torch.maximum(obj, t64(kw["clip_ratio_c"] * a))
                out[(i, t)] = -obj
        if name == "clip_cov":
            # covariance over valid tokens; candidates: not PPO-clipped and lb < cov < ub.
            # The test uses clip_cov_ratio = 1, so every candidate is cut.
            toks = [(i, t) for i in range(B) for t in _valid(mask, i)]
            ma = sum(float(adv[i, t]) for i, t in toks) / len(toks)
            ml = sum(float(lpd[i, t]) for i, t in toks) / len(toks)
            for i, t in toks:
                a = float(adv[i, t])
                r = math.exp(float(lpd[i, t] - old[i, t]))
                ppo_clipped = a * _clampf(r, 1 - eps_l, 1 + eps_h) < a * r
                cov = (a - ma) * (float(lpd[i, t]) - ml)
                if not ppo_clipped and kw["clip_cov_lb"] < cov < kw["clip_cov_ub"]:
                    out[(i, t)] = out[(i, t)] * 0.0
    elif name == "kl_cov":
        toks = [(i, t) for i in range(B) for t in _valid(mask, i)]
        ma = sum(float(adv[i, t]) for i, t in toks) / len(toks)
        ml = sum(float(lpd[i, t]) for i, t in toks) / len(toks)
        covs = sorted(toks, key=lambda it: -(float(adv[it]) - ma) * (float(lpd[it]) - ml))
        top = set(covs[: max(1, int(len(toks) * kw["kl_cov_ratio"]))])
        for i, t in toks:
            d = lp[i, t] - old[i, t]
            loss = -float(adv[i, t]) * torch.exp(d)
            if (i, t) in top:
                loss = loss + kw["ppo_kl_coef"] * torch.abs(d)
            out[(i, t)] = loss
    elif name == "gspo":
        for i in range(B):
            ts = _valid(mask, i)
            if not ts:
                continue
            s = math.exp(sum(float(lpd[i, t] - old[i, t]) for t in ts) / len(ts))
            for t in ts:
                a = float(adv[i, t])
                s_it = s * torch.exp(lp[i, t] - lp[i, t].detach())
                obj = torch.minimum(s_it * a, torch.clamp(s_it, 1 - eps_l, 1 + eps_h) * a)
                out[(i, t)] = -obj
    elif name == "gpg":
        for i in range(B):
            for t in _valid(mask, i):
                out[(i, t)] = -float(adv[i, t]) * lp[i, t]
    elif name == "cispo":
        for i in range(B):
            for t in _valid(mask, i):
                r = math.exp(_clampf(float(lpd[i, t] - old[i, t]), -20, 20))
                w = _clampf(r, 1 - eps_l, 1 + eps_h)  # a plain float: no gradient through it
                out[(i, t)] = -w * float(adv[i, t]) * lp[i, t]
    elif name == "geo_mean":
        for i in range(B):
            ts = _valid(mask, i)
            if not ts:
                continue
            acc = torch.zeros((), dtype=F64)
            for t in ts:
                a = float(adv[i, t])
                d = lp[i, t] - old[i, t]
                dv = float(d.detach())
                if a > 0 and dv > eps_h:
                    d = t64(eps_h)  # capped: a constant
                elif a < 0 and dv < -eps_l:
                    d = t64(-eps_l)
                elif a == 0:
                    d = t64(0.0)
                acc = acc + d
            rho = torch.exp(acc / len(ts))
            abar = sum(float(adv[i, t]) for t in ts) / len(ts)
            for t in ts:
                out[(i, t)] = -abar * rho
    elif name == "sapo":
        for i in range(B):
            for t in _valid(mask, i):
                a = float(adv[i, t])
                tau = kw["tau_pos"] if a > 0 else kw["tau_neg"]
                r = torch.exp(torch.clamp(lp[i, t] - old[i, t], -20, 20))
                out[(i, t)] = -a * torch.sigmoid(tau * (r - 1)) * 4 / tau
    elif name == "dro":
        for i in range(B):
            for t in _valid(mask, i):
                d = torch.clamp(lp[i, t] - old[i, t], -20, 20)
                out[(i, t)] = -(float(adv[i, t]) * lp[i, t] - 0.5 * kw["dro_beta"] * d * d)
    elif name in ("dppo_tv", "dppo_kl"):
        for i in range(B):
            for t in _valid(mask, i):
                a, x, o = float(adv[i, t]), float(lpd[i, t]), float(old[i, t])
                p, q = math.exp(x), math.exp(o)
                if name == "dppo_tv":
                    keep = (p - q <= eps_h) if a > 0 else (p - q >= -eps_l)
                else:
                    # these inputs have some log-probs > 0 (p > 1): the binary KL is then undefined (NaN),
                    # every comparison with it is false, and only the direction test can keep the token
                    bkl = (q * (o - x) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
                           if 1 - p + 1e-8 > 0 else float("nan"))
                    keep = (bkl <= eps_h or p <= q) if a > 0 else (bkl <= eps_l or p >= q)
                w = min(math.exp(_clampf(x - o, -20, 20)), kw["clip_ratio_c"])  # a plain float: no gradient
                out[(i, t)] = -a * w * lp[i, t] * float(keep)
    elif name == "cpgd":
        for i in range(B):
            for t in _valid(mask, i):
                a = float(adv[i, t])
                d = torch.clamp(lp[i, t] - old[i, t], -20, 20)
                if a > 0 and float(d.detach()) > math.log(1 + eps_h):
                    d = t64(math.log(1 + eps_h))  # capped: a constant
                elif a < 0 and float(d.detach()) < math.log(1 - eps_l):
                    d = t64(math.log(1 - eps_l))
                out[(i, t)] = -a * d
    else:
        raise KeyError(name)
    return out


LOSS_KW = dict(
    clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
    clip_cov_ratio=1.0, clip_cov_lb=-0.3, clip_cov_ub=0.3, kl_cov_ratio=0.2, ppo_kl_coef=0.7,
    tau_pos=1.3, tau_neg=1.7, dro_beta=0.4,  # sapo, dro (cpgd's drift term is tested in test_more_losses.py)
)


def random_inputs(B=5, T=7, seed=0, seq_adv=False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3  # log-probs in (-3, 0]
    drift = 0.25 * torch.randn(B, T, generator=g, dtype=F64)
    # a few big jumps so that the dual clip (r > 3) and the lower bound engage
    jump = torch.rand(B, T, generator=g, dtype=F64)
    drift = torch.where(jump < 0.15, drift + 1.5, torch.where(jump > 0.92, drift - 1.0, drift))
    lp = old + drift
    if seq_adv:
        adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T).clone()
    else:
        adv = torch.randn(B, T, generator=g, dtype=F64)
        adv[torch.rand(B, T, generator=g) < 0.1] = 0.0  # exact zeros for adv_nonzero_frac
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[1] = 0  # one fully masked row
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] right padding, ragged
    mask &= torch.rand(B, T, generator=g) > 0.15  # holes (multi-turn: tool tokens masked)
    mask[0, 0] = True
    w = torch.rand(B, T, generator=g, dtype=F64) * 1.5 + 0.2
    return old, lp, adv, mask, w


@pytest.mark.parametrize("with_weights", [False, True], ids=["no_w", "w"])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", ALL_LOSSES)
def test_loss_matches_loop_reference(name, mode, with_weights):
    seed = 10 * ALL_LOSSES.index(name) + AGG_MODES.index(mode)  # deterministic (str hash is salted)
    old, lp0, adv, mask, w = random_inputs(seed=seed, seq_adv=(name == "geo_mean"))
    norm = 11.0 if mode == "seq-mean-token-sum-norm" and with_weights else None

    lp = lp0.clone().requires_grad_(True)
    loss, _ = POLICY_LOSSES[name](
        old, lp, adv, mask, agg=LossAgg(mode, norm_constant=norm), rollout_is_weights=w if with_weights else None,
        **LOSS_KW,
    )
    loss.backward()

    lp_ref = lp0.clone().requires_grad_(True)
    mlist = mask.tolist()
    per_tok = ref_tokens(name, old, lp_ref, adv, mlist, LOSS_KW)
    if with_weights:
        per_tok = {k: v * float(w[k]) for k, v in per_tok.items()}
    # SAPO always aggregates seq-mean-token-mean (the paper's objective; verl does the same)
    ref = ref_agg(per_tok, mlist, "seq-mean-token-mean" if name == "sapo" else mode, norm)
    ref.backward()

    assert close(loss, ref), (float(loss), float(ref))
    assert torch.allclose(lp.grad, lp_ref.grad, atol=1e-10, rtol=1e-10)
    assert lp.grad.abs().sum() > 0  # the comparison is not between two zero gradients


def test_clip_cov_reference_has_both_cut_and_kept_tokens():
    # guard for the reference test above: with these bounds some candidates exist and some tokens
    # keep their PPO loss, so "cut everything" or "cut nothing" would both fail it.
    old, lp, adv, mask, _ = random_inputs(seed=10 * ALL_LOSSES.index("clip_cov") + AGG_MODES.index("token-mean"))
    _, met = L.clip_cov(old, lp, adv, mask, **LOSS_KW)
    assert 0.0 < float(met["clipcov_frac"]) < 0.9


def test_clip_cov_random_subset():
    old, lp, adv, mask, _ = random_inputs(B=16, T=32, seed=3)
    adv = torch.where(adv == 0, torch.full_like(adv, 0.5), adv)  # A = 0 has no gradient to cut
    kw = dict(LOSS_KW, clip_cov_ratio=0.05)
    n_valid = int(mask.sum())
    n_pick = max(int(0.05 * n_valid), 1)
    full, full_met = L.clip_cov(old, lp, adv, mask, **dict(kw, clip_cov_ratio=1.0))
    n_cand = round(float(full_met["clipcov_frac"]) * n_valid)
    assert n_cand > n_pick  # so a subset really has to be drawn
    g1 = torch.Generator().manual_seed(7)
    _, m1 = L.clip_cov(old, lp, adv, mask, generator=g1, **kw)
    assert round(float(m1["clipcov_frac"]) * n_valid) == n_pick
    # the cut tokens are candidates: their loss is 0 and each cut token's gradient is 0
    lpa = lp.clone().requires_grad_(True)
    loss_a, _ = L.clip_cov(old, lpa, adv, mask, generator=torch.Generator().manual_seed(7),
                           agg=LossAgg("token-sum"), **kw)
    loss_a.backward()
    lpv = lp.clone().requires_grad_(True)
    loss_v, _ = L.vanilla(old, lpv, adv, mask, agg=LossAgg("token-sum"),
                          **dict(kw, clip_ratio_c=1e9))  # no dual clip, like Clip-Cov
    loss_v.backward()
    differs = (lpa.grad != lpv.grad) & mask
    assert int(differs.sum()) == n_pick and bool((lpa.grad[differs] == 0).all())
    # same seed, same selection
    lpb = lp.clone().requires_grad_(True)
    loss_b, _ = L.clip_cov(old, lpb, adv, mask, generator=torch.Generator().manual_seed(7),
                           agg=LossAgg("token-sum"), **kw)
    assert close(loss_a, loss_b)


# ================================================================================================
# Metrics
# ================================================================================================


def test_vanilla_metrics_match_loop_reference():
    old, lp, adv, mask, w = random_inputs(B=6, T=9, seed=11)
    _, met = L.vanilla(old, lp, adv, mask, rollout_is_weights=w, **LOSS_KW)
    el, eh, c = LOSS_KW["clip_ratio_low"], LOSS_KW["clip_ratio_high"], LOSS_KW["clip_ratio_c"]
    rows = []
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            if not mask[i, t]:
                continue
            d = float(lp[i, t] - old[i, t])
            r, a = math.exp(d), float(adv[i, t])
            ppo = max(-a * r, -a * _clampf(r, 1 - el, 1 + eh))
            used = min(ppo, -a * c) if a < 0 else ppo
            rows.append(dict(d=d, r=r, a=a, ppo=ppo, used=used, w=float(w[i, t]),
                             up=a > 0 and r > 1 + eh, lo=a < 0 and r < 1 - el, dual=a < 0 and ppo > -a * c))
    n = len(rows)

    def mean(f):
        return sum(f(x) for x in rows) / n

    expect = {
        "pg_clipfrac": mean(lambda x: x["up"] or x["lo"]),
        "pg_clipfrac_upper_bound": mean(lambda x: x["up"]),
        "pg_clipfrac_lower_bound": mean(lambda x: x["lo"]),
        "pg_clipfrac_lower": mean(lambda x: x["dual"]),
        "ppo_kl": mean(lambda x: -x["d"]),
        "log_ratio_abs_mean": mean(lambda x: abs(x["d"])),
        "is_ratio_mean": mean(lambda x: x["r"]),
        "is_ratio_min": min(x["r"] for x in rows),
        "is_ratio_max": max(x["r"] for x in rows),
        "pg_loss_unclipped_mean": mean(lambda x: -x["a"] * x["r"]),
        "pg_loss_clipped_mean": mean(lambda x: x["used"]),
        "adv_abs_mean": mean(lambda x: abs(x["a"])),
        "adv_abs_min": min(abs(x["a"]) for x in rows),
        "adv_abs_max": max(abs(x["a"]) for x in rows),
        "adv_nonzero_frac": mean(lambda x: x["a"] != 0),
        "rollout_is_weight_mean": mean(lambda x: x["w"]),
        "rollout_is_weight_min": min(x["w"] for x in rows),
    }
    assert set(expect) <= set(met)
    for k, v in expect.items():
        assert close(met[k], v), (k, float(met[k]), v)
    # the random inputs really exercise every clip branch
    for k in ("pg_clipfrac_upper_bound", "pg_clipfrac_lower_bound", "pg_clipfrac_lower", "adv_nonzero_frac"):
        assert 0 < expect[k] < 1, k


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_metrics_are_detached_scalars_and_common_keys(name):
    old, lp, adv, mask, w = random_inputs(seed=5)
    lp = lp.clone().requires_grad_(True)
    _, met = POLICY_LOSSES[name](old, lp, adv, mask, rollout_is_weights=w, **LOSS_KW)
    common = {"ppo_kl", "log_ratio_abs_mean", "is_ratio_mean", "is_ratio_min", "is_ratio_max",
              "pg_loss_unclipped_mean", "pg_loss_clipped_mean", "adv_abs_mean", "adv_abs_min", "adv_abs_max",
              "adv_nonzero_frac", "rollout_is_weight_mean", "rollout_is_weight_min"}
    if name != "gpg":
        common |= {"pg_clipfrac", "pg_clipfrac_lower", "pg_clipfrac_upper_bound", "pg_clipfrac_lower_bound"}
    assert common <= set(met), common - set(met)
    for k, v in met.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad, k
        assert torch.isfinite(v), k
    # ppo_kl and the IS weight stats are the same for every loss: mean(old - logp) over valid tokens
    m = mask.to(F64)
    assert close(met["ppo_kl"], ((old - lp.detach()) * m).sum() / m.sum())
    assert close(met["rollout_is_weight_mean"], (w * m).sum() / m.sum())


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_all_masked_batch_is_zero_not_nan(name):
    old, lp, adv, _, _ = random_inputs(seed=2)
    lp = lp.clone().requires_grad_(True)
    mask = torch.zeros_like(old, dtype=torch.bool)
    loss, met = POLICY_LOSSES[name](old, lp, adv, mask, **LOSS_KW)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(lp.grad.abs().sum()) == 0.0
    assert all(float(v) == 0.0 for v in met.values())


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_extreme_log_ratios_stay_finite_in_float32(name):
    # |logp - old| = 100 would overflow exp in float32 (e^100 = inf) and give NaN gradients through
    # the clipped branch (0 * inf); the ±20 clamp keeps everything finite.
    old = torch.zeros(2, 3)
    lp = torch.tensor([[100.0, -100.0, 0.5], [100.0, -100.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, met = POLICY_LOSSES[name](old, lp, adv, torch.ones(2, 3), **LOSS_KW)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in met.values())
    assert close(met["is_ratio_max"], math.exp(20.0), tol=1e-6)  # e^20 = 4.85e8: the clamp bound


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_nonfinite_padding_does_not_leak(name):
    old, lp0, adv, mask, w = random_inputs(seed=8)
    ref_lp = lp0.clone().requires_grad_(True)
    ref, ref_met = POLICY_LOSSES[name](old, ref_lp, adv, mask, rollout_is_weights=w, **LOSS_KW)
    ref.backward()
    # garbage at every padded position: -inf / NaN log-probs, NaN old log-probs, advantages and weights
    pad = ~mask
    lp = lp0.clone()
    lp[pad] = float("-inf")
    lp[1, 0] = float("nan")  # row 1 is fully padded
    lp.requires_grad_(True)
    old_bad = old.clone()
    old_bad[pad] = float("nan")
    adv_bad = adv.clone()
    adv_bad[pad] = float("nan")
    w_bad = w.clone()
    w_bad[pad] = float("inf")
    loss, met = POLICY_LOSSES[name](old_bad, lp, adv_bad, mask, rollout_is_weights=w_bad, **LOSS_KW)
    loss.backward()
    assert close(loss, ref)
    assert torch.equal(torch.where(mask, lp.grad, 0), torch.where(mask, ref_lp.grad, 0))
    assert not lp.grad[pad].isnan().any()
    for k in ref_met:
        assert close(met[k], ref_met[k]), k


# ================================================================================================
# Rollout IS weights
# ================================================================================================


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_is_weights_are_detached(name):
    old, lp0, adv, mask, w0 = random_inputs(seed=9)
    lp = lp0.clone().requires_grad_(True)
    w = w0.clone().requires_grad_(True)
    loss, _ = POLICY_LOSSES[name](old, lp, adv, mask, rollout_is_weights=w, **LOSS_KW)
    loss.backward()
    assert w.grad is None  # nothing flows into the weights
    lp2 = lp0.clone().requires_grad_(True)
    loss2, _ = POLICY_LOSSES[name](old, lp2, adv, mask, rollout_is_weights=w0, **LOSS_KW)
    loss2.backward()
    assert close(loss, loss2) and torch.allclose(lp.grad, lp2.grad)


def test_unit_is_weights_change_nothing():
    old, lp, adv, mask, _ = random_inputs(seed=4)
    for name in ALL_LOSSES:
        a, _ = POLICY_LOSSES[name](old, lp, adv, mask, **LOSS_KW)
        b, _ = POLICY_LOSSES[name](old, lp, adv, mask, rollout_is_weights=torch.ones_like(old), **LOSS_KW)
        assert close(a, b), name


# ================================================================================================
# Global aggregation invariance: micro-batches and data-parallel shards
# ================================================================================================


def _problem(B, T, seed, n_feat=3):
    """A tiny shared 'model': logp = base + 0.3 * feats @ theta, so that every DP rank differentiates
    the same parameters theta, as real ranks do."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(B, T, n_feat, generator=g, dtype=F64)
    base = -torch.rand(B, T, generator=g, dtype=F64) * 2
    old = base + 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mask &= torch.rand(B, T, generator=g) > 0.2
    theta0 = 0.5 * torch.randn(n_feat, generator=g, dtype=F64)
    return feats, base, old, adv, mask, theta0


def _loss_on(rows, theta, prob, mode, fn, agg_kw):
    feats, base, old, adv, mask, _ = prob
    lp = base[rows] + 0.3 * feats[rows] @ theta  # [b, T]
    if fn is None:  # bare aggregation of a nonlinear per-token loss
        loss_mat = torch.sin(3 * lp) * adv[rows] + (lp - old[rows]) ** 2  # [b, T]
        return agg_loss(loss_mat, mask[rows], LossAgg(mode, **agg_kw))
    return fn(old[rows], lp, adv[rows], mask[rows], agg=LossAgg(mode, **agg_kw),
              clip_ratio_low=0.2, clip_ratio_high=0.3)[0]


def _full_and_sharded(prob, mode, fn, shards):
    """shards: list (one per DP rank) of lists of row-index lists (that rank's micro-batches)."""
    theta0 = prob[-1]
    mask = prob[4]
    th = theta0.clone().requires_grad_(True)
    full = _loss_on(list(range(mask.shape[0])), th, prob, mode, fn, {})
    full.backward()
    full_grad = th.grad.clone()

    # global counts: sum of batch_norm_counts over every micro-batch on every rank (an all-reduce)
    n_tok = n_seq = 0
    for rank in shards:
        for mb in rank:
            a, b = batch_norm_counts(mask[mb], mode)
            n_tok, n_seq = n_tok + a, n_seq + b
    dp = len(shards)
    rank_losses, rank_grads = [], []
    for rank in shards:
        th_r = theta0.clone().requires_grad_(True)
        total = torch.zeros((), dtype=F64)
        for mb in rank:  # gradient accumulation: backward per micro-batch, grads add up
            loss = _loss_on(mb, th_r, prob, mode, fn,
                            dict(global_num_tokens=n_tok, global_num_seqs=n_seq, dp_size=dp))
            loss.backward()
            total = total + loss.detach()
        rank_losses.append(total)
        rank_grads.append(th_r.grad.clone() if th_r.grad is not None else torch.zeros_like(theta0))
    # megatron DDP all-reduce AVERAGES the gradients over the DP ranks
    avg_grad = torch.stack(rank_grads).mean(0)
    # each rank's summed loss is dp_size times its share, so the mean over ranks is the full loss
    avg_loss = torch.stack(rank_losses).mean()
    return full.detach(), full_grad, avg_loss, avg_grad


# B = 9 rows: rank 0 gets rows 0..4 as micro-batches of 1, 3, 1; rank 1 gets rows 5..8 as 3, 1
UNEVEN_SHARDS = [[[0], [1, 2, 3], [4]], [[5, 6, 7], [8]]]


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_global_invariance_microbatch_and_dp(mode):
    prob = _problem(9, 6, seed=1)
    full, g_full, avg_loss, avg_grad = _full_and_sharded(prob, mode, None, UNEVEN_SHARDS)
    assert close(avg_loss, full) and torch.allclose(avg_grad, g_full, atol=1e-12, rtol=1e-10)
    assert g_full.abs().sum() > 0
    # single rank, gradient accumulation only (dp_size 1): the plain sum of micro-batch losses
    one_rank = [[mb for rank in UNEVEN_SHARDS for mb in rank]]
    full1, g1, sum1, gsum1 = _full_and_sharded(prob, mode, None, one_rank)
    assert close(sum1, full1) and torch.allclose(gsum1, g1, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", SPLIT_INVARIANT_LOSSES)
def test_policy_loss_global_invariance(name, mode):
    prob = _problem(9, 6, seed=2)
    full, g_full, avg_loss, avg_grad = _full_and_sharded(prob, mode, POLICY_LOSSES[name], UNEVEN_SHARDS)
    assert close(avg_loss, full) and torch.allclose(avg_grad, g_full, atol=1e-12, rtol=1e-10)
    assert g_full.abs().sum() > 0


def test_local_normalisation_would_not_be_invariant():
    # the control: normalising each micro-batch by its own token count and averaging the micro-batch
    # losses (the naive recipe) gives a different loss on uneven micro-batches; the test above can fail.
    feats, base, old, adv, mask, theta = _problem(9, 6, seed=1)
    lp = base + 0.3 * feats @ theta
    loss_mat = torch.sin(3 * lp) * adv
    full = agg_loss(loss_mat, mask, LossAgg("token-mean"))
    mbs = [mb for rank in UNEVEN_SHARDS for mb in rank]
    naive = sum(agg_loss(loss_mat[mb], mask[mb], LossAgg("token-mean")) for mb in mbs) / len(mbs)
    assert not close(naive, full, tol=1e-3)


@st.composite
def split_problems(draw):
    B = draw(st.integers(2, 9))
    T = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 10_000))
    dp = draw(st.integers(1, min(3, B)))
    # each rank gets a contiguous block of rows (>= 1), cut into micro-batches of >= 1 row
    cuts = sorted(draw(st.sets(st.integers(1, B - 1), min_size=dp - 1, max_size=dp - 1))) if dp > 1 else []
    bounds = [0, *cuts, B]
    shards = []
    for r in range(dp):
        rows = list(range(bounds[r], bounds[r + 1]))
        inner = sorted(draw(st.sets(st.integers(1, len(rows) - 1), max_size=len(rows) - 1))) if len(rows) > 1 else []
        ib = [0, *inner, len(rows)]
        shards.append([rows[ib[k]:ib[k + 1]] for k in range(len(ib) - 1)])
    mode = draw(st.sampled_from(AGG_MODES))
    name = draw(st.sampled_from([None, *SPLIT_INVARIANT_LOSSES]))
    return B, T, seed, shards, mode, name


@settings(max_examples=60, deadline=None)
@given(split_problems())
def test_property_global_aggregation_invariant_to_splitting(p):
    B, T, seed, shards, mode, name = p
    prob = _problem(B, T, seed)
    fn = None if name is None else POLICY_LOSSES[name]
    full, g_full, avg_loss, avg_grad = _full_and_sharded(prob, mode, fn, shards)
    assert close(avg_loss, full, tol=1e-9)
    assert torch.allclose(avg_grad, g_full, atol=1e-10, rtol=1e-9)


# ================================================================================================
# Dispatch and call-site compatibility
# ================================================================================================


def test_get_policy_loss_fn():
    for name in ALL_LOSSES:
        assert get_policy_loss_fn(name) is POLICY_LOSSES[name]
    assert get_policy_loss_fn("trainer.algos.losses:cispo") is L.cispo
    assert get_policy_loss_fn(L.gpg) is L.gpg
    with pytest.raises(ValueError, match="Did you mean 'vanilla'"):
        get_policy_loss_fn("vanila")


def test_one_call_site_fits_all_losses():
    # the worker passes every knob the loss family has; each loss takes what it needs and ignores the rest of
    # the family's keywords, but refuses one outside it by name (issue 37: verl's loss_agg_mode= was swallowed)
    old, lp, adv, mask, w = random_inputs(seed=1)
    n_tok, n_seq = batch_norm_counts(mask, "token-mean")
    agg = LossAgg("token-mean", global_num_tokens=n_tok, global_num_seqs=n_seq, dp_size=1, norm_constant=None)
    kw = dict(LOSS_KW, agg=agg, rollout_is_weights=w, generator=torch.Generator().manual_seed(0))
    for name in ALL_LOSSES:
        loss, met = get_policy_loss_fn(name)(old, lp, adv, mask, **kw)
        assert loss.dim() == 0 and torch.isfinite(loss) and isinstance(met, dict)
        for bad in ({"some_future_knob": 123}, {"loss_agg_mode": "seq-mean-token-sum"}):
            with pytest.raises(TypeError, match=next(iter(bad))):
                get_policy_loss_fn(name)(old, lp, adv, mask, **kw, **bad)


def test_float32_inputs_work_and_match_float64():
    old, lp, adv, mask, w = random_inputs(seed=6)
    for name in ALL_LOSSES:
        a, _ = POLICY_LOSSES[name](old, lp, adv, mask, rollout_is_weights=w, **LOSS_KW)
        b, _ = POLICY_LOSSES[name](old.float(), lp.float(), adv.float(), mask, rollout_is_weights=w.float(),
                                   **LOSS_KW)
        assert b.dtype == torch.float32
        a, b = float(a.detach()), float(b.detach())
        assert abs(a - b) < 1e-4 * (1 + abs(a)), name


def test_value_loss_clipfrac_counts_no_token_inside_the_clip_range():
    """verl clips the prediction itself (``clip_by_value(vpreds, values - c, values + c)``); the
    form ``values + clamp(vpreds - values)`` rounds some in-range predictions by one ulp in float32,
    and such a token used to count as clipped. Reference: float64, verl's formula."""
    from trainer.algos.losses import value_loss

    g = torch.Generator().manual_seed(0)
    vp = torch.randn(64, 32, generator=g) * 3
    old = vp + (torch.rand(64, 32, generator=g) - 0.5) * 0.9  # |V - V_old| < 0.45 < c: nothing clipped
    ret = torch.randn(64, 32, generator=g) * 3
    mask = torch.ones(64, 32)
    c = 0.5
    # the old formula's rounding makes tokens "clipped" on this data (the test bites)
    legacy = old + (vp - old).clamp(-c, c)
    assert bool((((legacy - ret) ** 2) > ((vp - ret) ** 2)).any())
    _, m = value_loss(vp, old, ret, mask, cliprange_value=c)
    assert float(m["vf_clipfrac"]) == 0.0
    # out-of-range predictions too: against verl's formula in float64
    old2 = vp + (torch.rand(64, 32, generator=g) - 0.5) * 3
    mask2 = (torch.rand(64, 32, generator=g) > 0.2).float()
    loss, m = value_loss(vp, old2, ret, mask2, cliprange_value=c)
    v, o, r = vp.double(), old2.double(), ret.double()
    vclip = torch.max(torch.min(v, o + c), o - c)
    l1, l2 = (v - r) ** 2, (vclip - r) ** 2
    want_frac = float(((l2 > l1).double() * mask2).sum() / mask2.sum())
    want_loss = float((0.5 * torch.max(l1, l2) * mask2).sum() / mask2.sum())
    assert float(m["vf_clipfrac"]) == pytest.approx(want_frac, abs=1e-6)  # one token in ~1600 is 6e-4
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)


def test_value_loss_golden_and_clipfrac():
    from trainer.algos.losses import value_loss

    # token 1: V=1.0, V_old=0.0, R=1.0, c=0.5 -> V_clip=0.5: max((1-1)^2, (0.5-1)^2)=0.25 -> 0.125 (clipped term wins)
    # token 2: V=0.2, V_old=0.0, R=0.0 -> V_clip=0.2: max(0.04, 0.04)=0.04 -> 0.02 (tie: not counted as clipped)
    # token 3: masked out
    vp = torch.tensor([[1.0, 0.2, 9.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    ret = torch.tensor([[1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, m = value_loss(vp, old, ret, mask, cliprange_value=0.5)
    assert torch.allclose(loss, torch.tensor((0.125 + 0.02) / 2))
    assert float(m["vf_clipfrac"]) == 0.5
    loss.backward()
    # d/dV of token 1 is 0 (the clipped branch is constant in V); token 2: 0.5*2*0.2/2 = 0.1
    assert torch.allclose(vp.grad, torch.tensor([[0.0, 0.1, 0.0]]))
