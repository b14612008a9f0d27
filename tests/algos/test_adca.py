"""Tests for trainer.algos.adca (ADCA-GRPO step-level credit assignment).

Three kinds: golden numbers worked by hand on 2 prompts x 3 trajectories (arithmetic in the comments,
the expected values written as the hand formulas), a float64 per-trajectory Python-loop reference
compared on random ragged inputs for both schemes and every option combination, and hypothesis
properties.
"""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction as Fr

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.algos import adca
from trainer.algos.adca import (
    PRM_SCHEMES,
    compute_adca_grpo_advantage,
    compute_step_rewards_allocation,
    compute_step_rewards_decouple,
    get_prm_scheme,
    num_steps_from_step_ids,
    outcome_zscore,
    pad_step_flags,
    prm_active,
    select_judge_samples,
    step_mask_from_num_steps,
    step_rewards_to_token_advantages,
)

# ------------------------------------------------------------------------------------------------
# the hand-worked batch: 2 prompts x 3 trajectories, 1-4 steps each
# ------------------------------------------------------------------------------------------------
#   prompt 0: t0 flags (+,-,+)    R=1     prompt 1: t3 flags (-,-)      R=0
#             t1 flags (-)        R=0               t4 flags (+,+,+)    R=1
#             t2 flags (+,+,-,+)  R=1               t5 flags (-,+,-)    R=0
FLAGS = [[1, -1, 1], [-1], [1, 1, -1, 1], [-1, -1], [1, 1, 1], [-1, 1, -1]]
R = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
IDX = [0, 0, 0, 1, 1, 1]

# Outcome z-score (population std), the same for every scheme:
#   prompt 0: R = (1, 0, 1): mean 2/3, var = (1/9 + 4/9 + 1/9)/3 = 2/9, std = sqrt(2)/3
#     o(R=1) = (1/3) / (sqrt(2)/3) = 1/sqrt(2) = 0.707107 ;  o(R=0) = (-2/3) / (sqrt(2)/3) = -sqrt(2)
#   prompt 1: R = (0, 1, 0): o = (-1/sqrt(2), sqrt(2), -1/sqrt(2))
O_POS, O_NEG = 1 / math.sqrt(2), -math.sqrt(2)  # prompt 0
O1_POS, O1_NEG = math.sqrt(2), -1 / math.sqrt(2)  # prompt 1


def token_layout(num_steps, tokens_per_step=2, env_tokens=1, pad=2):
    """step_ids: each step's tokens, then env tokens (-1) between steps, then padding (-1).
    response_mask is 1 on step tokens only."""
    rows = []
    for k in num_steps:
        row = []
        for j in range(k):
            row += [j] * tokens_per_step
            if j < k - 1:
                row += [-1] * env_tokens
        rows.append(row)
    t = max(len(r) for r in rows) + pad
    sid = torch.full((len(rows), t), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        sid[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return sid, (sid >= 0).float()


def suffix(xs):
    return [sum(xs[j:]) for j in range(len(xs))]


def check_tokens(adv, step_adv, sid):
    """Every token of step j carries step_adv[i][j]; every env / pad token is exactly 0."""
    for i in range(adv.shape[0]):
        for t in range(adv.shape[1]):
            s = int(sid[i, t])
            exp = step_adv[i][s] if s >= 0 else 0.0
            assert abs(float(adv[i, t]) - exp) < 1e-6, (i, t, float(adv[i, t]), exp)


def test_golden_decouple_equal_trajectory_weight_last_step():
    # fix_base = 0.2, alpha = 0.1, beta = 1, do_batch_norm, equal_trajectory_weight, last_step.
    # With labels +-c the z-score does not depend on c: write flags as +-1.
    # prompt 0, per-trajectory mean labels: t0 1/3, t1 -1, t2 1/2 -> mu = (1/3 - 1 + 1/2)/3 = -1/18.
    #   Each step has x^2 = 1, so a trajectory's mean (x - mu)^2 = 1 - 2 mu m_i + mu^2 and the
    #   equal-weight average is 1 - 2 mu * mu + mu^2 = 1 - mu^2 = 323/324, sd = sqrt(323)/18.
    #   z(+) = (1 + 1/18) / (sqrt(323)/18) = 19/sqrt(323) = 1.057188
    #   z(-) = (-1 + 1/18) / (sqrt(323)/18) = -17/sqrt(323) = -0.945905
    # prompt 1: means t3 -1, t4 1, t5 -1/3 -> mu = -1/9, var = 1 - 1/81 = 80/81, sd = sqrt(80)/9
    #   z(+) = (10/9)/(sqrt(80)/9) = 10/sqrt(80) = 1.118034 ;  z(-) = -8/sqrt(80) = -0.894427
    # Step rewards r = 0.1 z, plus o on the last step; advantages are suffix sums:
    #   t0: r = (0.105719, -0.094591, 0.105719 + 0.707107 = 0.812826) -> A = (0.823954, 0.718235, 0.812826)
    #   t1: r = (-0.094591 - 1.414214 = -1.508804)                     -> A = (-1.508804)
    #   t2: r = (0.105719, 0.105719, -0.094591, 0.812826)           -> A = (0.929673, 0.823954, 0.718235, 0.812826)
    #   t3: r = (-0.089443, -0.089443 - 0.707107 = -0.796550)      -> A = (-0.885992, -0.796550)
    #   t4: r = (0.111803, 0.111803, 0.111803 + 1.414214 = 1.526017) -> A = (1.749624, 1.637820, 1.526017)
    #   t5: r = (-0.089443, 0.111803, -0.796550)                  -> A = (-0.774189, -0.684746, -0.796550)
    zp0, zn0 = 19 / math.sqrt(323), -17 / math.sqrt(323)
    zp1, zn1 = 10 / math.sqrt(80), -8 / math.sqrt(80)
    a = 0.1
    exp_r = [
        [a * zp0, a * zn0, a * zp0 + O_POS],
        [a * zn0 + O_NEG],
        [a * zp0, a * zp0, a * zn0, a * zp0 + O_POS],
        [a * zn1, a * zn1 + O1_NEG],
        [a * zp1, a * zp1, a * zp1 + O1_POS],
        [a * zn1, a * zp1, a * zn1 + O1_NEG],
    ]
    f, k = pad_step_flags(FLAGS)
    r = compute_step_rewards_decouple(step_flags=f, num_steps=k, outcome_scores=torch.tensor(R),
                                      index=torch.tensor(IDX), fix_base=0.2, alpha=0.1)
    for i, row in enumerate(exp_r):
        torch.testing.assert_close(r[i, : len(row)], torch.tensor(row, dtype=torch.float64), rtol=1e-6, atol=1e-6)
        assert torch.all(r[i, len(row):] == 0)
    step_adv = [suffix(row) for row in exp_r]
    # the hand numbers above, to their 6 printed decimals
    assert abs(step_adv[0][0] - 0.823954) < 1e-6 and abs(step_adv[4][0] - 1.749624) < 1e-6
    assert abs(step_adv[5][0] - (-0.774189)) < 1e-6 and abs(step_adv[2][0] - 0.929673) < 1e-6

    sid, mask = token_layout(k.tolist())
    adv, ret, metrics = compute_adca_grpo_advantage(
        step_flags=FLAGS, index=IDX, step_ids=sid, response_mask=mask, outcome_scores=R,
        prm_scheme="decouple", fix_base=0.2, alpha=0.1, num_skipped=1, num_fallback=2, num_judge_calls=4,
    )
    assert adv.dtype == torch.float32 and adv.shape == sid.shape
    check_tokens(adv, step_adv, sid)
    assert torch.equal(adv, ret)
    # metrics: 9 GOOD of 16 labels (2+0+3+0+3+1 of 3+1+4+2+3+3); mean labels (1/3, -1, 1/2, -1, 1, -1/3) vs R (1, 0, 1, 0, 1, 0)
    assert abs(float(metrics["adca/good_fraction"]) - 9 / 16) < 1e-6
    assert abs(float(metrics["adca/skipped_fraction"]) - 1 / 6) < 1e-6
    assert abs(float(metrics["adca/judge_fallback_fraction"]) - 2 / 6) < 1e-6
    assert float(metrics["adca/judge_calls"]) == 4.0
    assert float(metrics["adca/prm_fraction"]) == 1.0
    assert float(metrics["adca/unknown_step_fraction"]) == 0.0
    x = [1 / 3, -1, 1 / 2, -1, 1, -1 / 3]
    mx, my = sum(x) / 6, sum(R) / 6
    corr = sum((u - mx) * (v - my) for u, v in zip(x, R)) / math.sqrt(
        sum((u - mx) ** 2 for u in x) * sum((v - my) ** 2 for v in R))
    assert abs(float(metrics["adca/flag_outcome_corr"]) - corr) < 1e-6
    # |PRM| per trajectory: sum of 0.1|z| over its steps; |ORM|: |o| once (last_step)
    prm_abs = [a * (2 * zp0 - zn0), -a * zn0, a * (3 * zp0 - zn0), -2 * a * zn1, 3 * a * zp1, a * (zp1 - 2 * zn1)]
    orm_abs = [O_POS, -O_NEG, O_POS, -O1_NEG, O1_POS, -O1_NEG]
    assert abs(float(metrics["adca/prm_abs_mean"]) - sum(prm_abs) / 6) < 1e-6
    assert abs(float(metrics["adca/orm_abs_mean"]) - sum(orm_abs) / 6) < 1e-6
    assert abs(float(metrics["adca/outcome_share"]) - sum(orm_abs) / (sum(orm_abs) + sum(prm_abs))) < 1e-6


def test_golden_decouple_pooled_all_steps_length_norm():
    # equal_trajectory_weight=False (steps pooled), all_steps, enable_length_normalization, alpha=0.1.
    # prompt 0 pools 8 steps: 5 GOOD, 3 BAD -> mu = 2/8 = 1/4, var = 1 - mu^2 = 15/16, sd = sqrt(15)/4
    #   z(+) = (3/4)/(sqrt(15)/4) = 3/sqrt(15) = 0.774597 ;  z(-) = -(5/4)/(sqrt(15)/4) = -1.290994
    # prompt 1 pools 8 steps: 4 GOOD, 4 BAD -> mu = 0, sd = 1, z = +-1
    # r_ij = (0.1 z_ij + o_i) / sqrt(K_i) on every step, e.g. t0 (K=3, o = 0.707107):
    #   r = ((0.077460 + 0.707107)/1.732051, (-0.129099 + 0.707107)/1.732051, ...) = (0.452970, 0.333713, 0.452970)
    #   A = (1.239652, 0.786682, 0.452970)   (sums of the unrounded r)
    zp0, zn0 = 3 / math.sqrt(15), -5 / math.sqrt(15)
    a = 0.1
    raw = [
        [a * zp0 + O_POS, a * zn0 + O_POS, a * zp0 + O_POS],
        [a * zn0 + O_NEG],
        [a * zp0 + O_POS, a * zp0 + O_POS, a * zn0 + O_POS, a * zp0 + O_POS],
        [-a + O1_NEG, -a + O1_NEG],
        [a + O1_POS] * 3,
        [-a + O1_NEG, a + O1_NEG, -a + O1_NEG],
    ]
    exp_r = [[v / math.sqrt(len(row)) for v in row] for row in raw]
    assert abs(suffix(exp_r[0])[0] - 1.239652) < 1e-6 and abs(exp_r[0][1] - 0.333713) < 1e-6
    f, k = pad_step_flags(FLAGS)
    r = compute_step_rewards_decouple(step_flags=f, num_steps=k, outcome_scores=torch.tensor(R),
                                      index=torch.tensor(IDX), alpha=0.1, equal_trajectory_weight=False,
                                      orm_distribution="all_steps", enable_length_normalization=True)
    for i, row in enumerate(exp_r):
        torch.testing.assert_close(r[i, : len(row)], torch.tensor(row, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    sid, mask = token_layout(k.tolist(), tokens_per_step=3, env_tokens=2)
    adv, _, _ = compute_adca_grpo_advantage(
        step_flags=f, num_steps=k, index=IDX, step_ids=sid, response_mask=mask, outcome_scores=R, alpha=0.1,
        equal_trajectory_weight=False, orm_distribution="all_steps", enable_length_normalization=True,
    )
    check_tokens(adv, [suffix(row) for row in exp_r], sid)


def test_golden_allocation_equal_trajectory_weight_last_step():
    # allocation, consistent_scale 1, pos/neg_unconsistent_scale 0.2, success = R > 0.5,
    # alpha = 0.5, beta = 1, do_batch_norm, equal_trajectory_weight, last_step.
    # Raw allocation (each trajectory's steps sum to +1 on success, -1 on failure):
    #   t0 success (+,-,+): w = (1, .2, 1), W = 2.2 -> p = (5/11, 1/11, 5/11)
    #   t1 failure (-):     w = (1)             -> p = (-1)
    #   t2 success (+,+,-,+): w = (1,1,.2,1), W = 3.2 -> p = (5/16, 5/16, 1/16, 5/16)
    #   t3 failure (-,-):   w = (1, 1), W = 2   -> p = (-1/2, -1/2)
    #   t4 success (+,+,+): W = 3               -> p = (1/3, 1/3, 1/3)
    #   t5 failure (-,+,-): w = (1, .2, 1), W = 2.2 -> p = (-5/11, -1/11, -5/11)
    # prompt 0: trajectory means (1/3, -1, 1/4) -> mu = (-5/12)/3 = -5/36
    #   deviations: t0 (235/396, 91/396, 235/396), t1 (-31/36), t2 (65/144 x3, 29/144)
    #   per-trajectory mean squares: t0 (2*235^2 + 91^2)/396^2/3 = 0.252378, t1 (31/36)^2 = 0.741512,
    #   t2 (3*65^2 + 29^2)/144^2/4 = 0.162953 -> var = (0.252378 + 0.741512 + 0.162953)/3 = 0.385615
    #   sd = 0.620979: z = t0 (0.955643, 0.370058, 0.955643), t1 (-1.386700), t2 (0.726899 x2, 0.324309, 0.726899)
    # prompt 1: trajectory means (-1/2, 1/3, -1/3) -> mu = -1/6
    #   deviations: t3 (-1/3, -1/3), t4 (1/2 x3), t5 (-19/66, 5/66, -19/66)
    #   mean squares: 1/9, 1/4, (2*19^2 + 5^2)/66^2/3 = 0.057163 -> var = 0.139425, sd = 0.373396
    # r = 0.5 z, plus o on the last step; e.g. t0: r = (0.477822, 0.185029, 0.477822 + 0.707107)
    #   A(t0) = (1.847779, 1.369957, 1.184929)   (sums of the unrounded r)
    def zs(groups):
        out = []
        for g in groups:
            mu = sum(sum(t) / len(t) for t in g) / len(g)
            var = sum(sum((x - mu) ** 2 for x in t) / len(t) for t in g) / len(g)
            out += [[float(x - mu) / math.sqrt(float(var)) for x in t] for t in g]
        return out

    p = [
        [Fr(5, 11), Fr(1, 11), Fr(5, 11)], [Fr(-1)], [Fr(5, 16), Fr(5, 16), Fr(1, 16), Fr(5, 16)],
        [Fr(-1, 2)] * 2, [Fr(1, 3)] * 3, [Fr(-5, 11), Fr(-1, 11), Fr(-5, 11)],
    ]
    assert [sum(t) for t in p] == [1, -1, 1, -1, 1, -1]
    z = zs([p[:3], p[3:]])
    assert abs(z[0][0] - 0.955643) < 1e-6 and abs(z[1][0] + 1.386700) < 1e-6 and abs(z[2][2] - 0.324309) < 1e-6
    o = [O_POS, O_NEG, O_POS, O1_NEG, O1_POS, O1_NEG]
    exp_r = []
    for zi, oi in zip(z, o):
        row = [0.5 * v for v in zi]
        row[-1] += oi
        exp_r.append(row)
    assert abs(suffix(exp_r[0])[0] - 1.847779) < 1e-6
    f, k = pad_step_flags(FLAGS)
    r = compute_step_rewards_allocation(step_flags=f, num_steps=k, outcome_scores=torch.tensor(R),
                                        index=torch.tensor(IDX), alpha=0.5)
    for i, row in enumerate(exp_r):
        torch.testing.assert_close(r[i, : len(row)], torch.tensor(row, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    sid, mask = token_layout(k.tolist())
    adv, _, _ = compute_adca_grpo_advantage(step_flags=FLAGS, index=IDX, step_ids=sid, response_mask=mask,
                                            outcome_scores=R, prm_scheme="allocation", alpha=0.5)
    check_tokens(adv, [suffix(row) for row in exp_r], sid)
    # allocation ignores fix_base and length normalisation
    r2 = compute_step_rewards_allocation(step_flags=f, num_steps=k, outcome_scores=torch.tensor(R),
                                         index=torch.tensor(IDX), alpha=0.5, fix_base=7.0,
                                         enable_length_normalization=True)
    assert torch.equal(r, r2)


def test_golden_outcome_only_samples():
    # t1 and t4 are marked use_prm=False (skipped / judge fallback). Decouple, ETW, last_step, alpha 0.1.
    # prompt 0 PRM statistics use only t0 (+,-,+) and t2 (+,+,-,+): means 1/3 and 1/2 -> mu = 5/12,
    #   var = 1 - mu^2 = 119/144, sd = sqrt(119)/12: z(+) = (7/12)/(sqrt(119)/12) = 7/sqrt(119),
    #   z(-) = -17/sqrt(119)
    # prompt 1 uses t3 (-,-) and t5 (-,+,-): means -1, -1/3 -> mu = -2/3, var = 5/9, sd = sqrt(5)/3
    #   z(+) = (5/3)/(sqrt(5)/3) = sqrt(5), z(-) = -(1/3)/(sqrt(5)/3) = -1/sqrt(5)
    # The outcome term still uses all three samples: t1 gets o = -sqrt(2) on every token, t4 sqrt(2).
    zp0, zn0 = 7 / math.sqrt(119), -17 / math.sqrt(119)
    zp1, zn1 = math.sqrt(5), -1 / math.sqrt(5)
    a = 0.1
    exp_r = [
        [a * zp0, a * zn0, a * zp0 + O_POS], [O_NEG], [a * zp0, a * zp0, a * zn0, a * zp0 + O_POS],
        [a * zn1, a * zn1 + O1_NEG], [0.0, 0.0, O1_POS], [a * zn1, a * zp1, a * zn1 + O1_NEG],
    ]
    use = torch.tensor([True, False, True, True, False, True])
    sid, mask = token_layout([len(f) for f in FLAGS])
    adv, _, m = compute_adca_grpo_advantage(step_flags=FLAGS, index=IDX, step_ids=sid, response_mask=mask,
                                            outcome_scores=R, use_prm=use, alpha=0.1)
    check_tokens(adv, [suffix(row) for row in exp_r], sid)
    assert abs(float(m["adca/prm_fraction"]) - 4 / 6) < 1e-6
    assert abs(float(m["adca/good_fraction"]) - 6 / 12) < 1e-6  # GOOD: t0 2 of 3, t2 3 of 4, t3 0 of 2, t5 1 of 3


# ------------------------------------------------------------------------------------------------
# float64 per-trajectory Python-loop reference
# ------------------------------------------------------------------------------------------------


def ref_step_rewards(flags, K, R, idx, use, *, scheme, fix_base, alpha, beta, do_batch_norm, etw, dist,
                     length_norm, cs=1.0, pus=0.2, nus=0.2, thr=0.5, eps=1e-8):
    """Straightforward per-trajectory / per-group loops, lists of floats."""
    B = len(K)
    groups = {}
    for i in range(B):
        groups.setdefault(idx[i], []).append(i)
    lab = [[use[i] and j < len(flags[i]) and flags[i][j] != 0 for j in range(K[i])] for i in range(B)]
    # raw PRM
    p = []
    for i in range(B):
        row = [0.0] * K[i]
        if scheme == "decouple":
            for j in range(K[i]):
                if lab[i][j]:
                    row[j] = fix_base * flags[i][j]
        else:
            succ = R[i] > thr
            wg, wb = (cs, pus) if succ else (abs(nus), cs)
            ws = [(wg if flags[i][j] > 0 else wb) if lab[i][j] else 0.0 for j in range(K[i])]
            tot = sum(ws)
            for j in range(K[i]):
                row[j] = ((1.0 if succ else -1.0) * ws[j] / tot) if tot > eps else 0.0
        p.append(row)
    # z-score
    z = [[0.0] * K[i] for i in range(B)]
    for g, members in groups.items():
        if not do_batch_norm:
            for i in members:
                z[i] = [p[i][j] if lab[i][j] else 0.0 for j in range(K[i])]
            continue
        if etw:
            trajs = [i for i in members if any(lab[i])]
            if not trajs:
                continue
            means = [sum(p[i][j] for j in range(K[i]) if lab[i][j]) / sum(lab[i]) for i in trajs]
            mu = sum(means) / len(trajs)
            var = sum(sum((p[i][j] - mu) ** 2 for j in range(K[i]) if lab[i][j]) / sum(lab[i]) for i in trajs) / len(trajs)
        else:
            vals = [p[i][j] for i in members for j in range(K[i]) if lab[i][j]]
            if not vals:
                continue
            mu = sum(vals) / len(vals)
            var = sum((v - mu) ** 2 for v in vals) / len(vals)
        sd = math.sqrt(var + eps)
        for i in members:
            z[i] = [(p[i][j] - mu) / sd if lab[i][j] else 0.0 for j in range(K[i])]
    # outcome z-score
    o = [0.0] * B
    for g, members in groups.items():
        vals = [R[i] for i in members]
        m = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - m) ** 2 for v in vals) / len(vals))
        for i in members:
            o[i] = (R[i] - m) / sd if sd > eps else R[i] - m
    # fuse
    out = []
    for i in range(B):
        row = []
        for j in range(K[i]):
            v = alpha * z[i][j]
            if dist == "all_steps" or j == K[i] - 1:
                v += beta * o[i]
            if scheme == "decouple" and length_norm:
                v /= math.sqrt(K[i])
            row.append(v)
        out.append(row)
    return out


def ref_tokens(step_r, sid, mask):
    B, T = len(sid), len(sid[0])
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        A = suffix(step_r[i])
        for t in range(T):
            if sid[i][t] >= 0 and mask[i][t]:
                out[i][t] = A[sid[i][t]]
    return out


def random_batch(rng: random.Random, continuous: bool):
    B = rng.randint(1, 10)
    n_groups = rng.randint(1, 4)
    idx = [rng.randrange(n_groups) * 7 + 3 for _ in range(B)]  # non-dense ids
    K = [rng.choice([0, 1, 1, 2, 3, 4, 5]) for _ in range(B)]
    flags = [[rng.choice([-1, -1, 0, 1, 1]) for _ in range(k)] for k in K]
    R = [rng.uniform(-1, 2) if continuous else float(rng.random() < 0.5) for _ in range(B)]
    use = [rng.random() < 0.75 for _ in range(B)]
    rows, rmask = [], []
    for k in K:
        row, mrow = [], []
        for j in range(k):
            for _ in range(rng.randint(1, 3)):
                row.append(j)
                mrow.append(rng.random() < 0.9)  # a few step tokens masked out (must become 0)
            for _ in range(rng.randint(0, 2)):
                row.append(rng.choice([-1, -1, -100]))  # env tokens; any negative id means "no step"
                mrow.append(rng.random() < 0.3)  # env tokens, sometimes under a stray mask bit
        rows.append(row)
        rmask.append(mrow)
    T = max([len(r) for r in rows] + [1]) + rng.randint(0, 2)
    sid = [r + [-1] * (T - len(r)) for r in rows]
    msk = [m + [False] * (T - len(m)) for m in rmask]
    return flags, K, R, idx, use, sid, msk


OPTION_GRID = list(itertools.product(["decouple", "allocation"], [True, False], [True, False],
                                     ["last_step", "all_steps"], [False, True]))


@pytest.mark.parametrize("scheme,do_bn,etw,dist,ln", OPTION_GRID)
def test_matches_loop_reference(scheme, do_bn, etw, dist, ln):
    rng = random.Random(hash((scheme, do_bn, etw, dist, ln)) & 0xFFFF)
    for trial in range(12):
        flags, K, R, idx, use, sid, msk = random_batch(rng, continuous=trial % 2 == 1)
        alpha, beta, fix_base = rng.uniform(0, 1), rng.uniform(0.2, 1.5), rng.uniform(0.05, 1.0)
        kw = dict(fix_base=fix_base, alpha=alpha, beta=beta, do_batch_norm=do_bn, equal_trajectory_weight=etw,
                  orm_distribution=dist, enable_length_normalization=ln)
        exp_r = ref_step_rewards(flags, K, R, idx, use, scheme=scheme, fix_base=fix_base, alpha=alpha, beta=beta,
                                 do_batch_norm=do_bn, etw=etw, dist=dist, length_norm=ln)
        f, k = pad_step_flags(flags)
        fn = PRM_SCHEMES[scheme]
        got = fn(step_flags=f, num_steps=k, outcome_scores=torch.tensor(R, dtype=torch.float64),
                 index=torch.tensor(idx), use_prm=torch.tensor(use), **kw)
        assert got.dtype == torch.float64
        for i in range(len(K)):
            assert torch.allclose(got[i, : K[i]], torch.tensor(exp_r[i], dtype=torch.float64), rtol=1e-9, atol=1e-9)
            assert torch.all(got[i, K[i]:] == 0)
        sid_t = torch.tensor(sid, dtype=torch.int64)
        msk_t = torch.tensor(msk)
        adv, ret, metrics = compute_adca_grpo_advantage(
            step_flags=flags, num_steps=K, index=idx, step_ids=sid_t, response_mask=msk_t, outcome_scores=R,
            use_prm=use, prm_scheme=scheme, dtype=torch.float64, **kw)
        exp_t = torch.tensor(ref_tokens(exp_r, sid, msk), dtype=torch.float64)
        assert torch.allclose(adv, exp_t, rtol=1e-9, atol=1e-9)
        assert all(torch.isfinite(v) for v in metrics.values())


def test_step_rewards_from_ragged_lists_and_bools():
    # bool labels (AgentEvolver style) and None for unknown give the same as +-1 / 0
    flags_b = [[True, False, None], [False], [True, True]]
    flags_i = [[1, -1, 0], [-1], [1, 1]]
    fb, kb = pad_step_flags(flags_b)
    fi, ki = pad_step_flags(flags_i)
    assert torch.equal(fb, fi) and kb.tolist() == [3, 1, 2]
    f, k = pad_step_flags(flags_i, num_steps=[4, 1, 3])  # missing labels become unknown
    assert f.shape == (3, 4) and k.tolist() == [4, 1, 3] and f[2, 2] == 0 and f[0, 3] == 0


# ------------------------------------------------------------------------------------------------
# hypothesis properties
# ------------------------------------------------------------------------------------------------


@st.composite
def batches(draw, min_steps=0):
    seed = draw(st.integers(0, 2**31 - 1))
    rng = random.Random(seed)
    flags, K, R, idx, use, sid, msk = random_batch(rng, continuous=draw(st.booleans()))
    if min_steps:
        K = [max(k, min_steps) for k in K]
        flags = [f + [rng.choice([-1, 1]) for _ in range(k - len(f))] for f, k in zip(flags, K)]
        sid = None  # rebuilt by the caller
    return flags, K, R, idx, use, sid, msk


@settings(max_examples=60, deadline=None)
@given(batches(min_steps=1), st.sampled_from(["decouple", "allocation"]), st.floats(0.1, 2.0),
       st.booleans(), st.booleans())
def test_alpha_zero_last_step_is_grpo_outcome_times_beta(batch, scheme, beta, do_bn, etw):
    flags, K, R, idx, use, _, _ = batch
    sid, mask = token_layout(K)
    adv, _, _ = compute_adca_grpo_advantage(step_flags=flags, num_steps=K, index=idx, step_ids=sid,
                                            response_mask=mask, outcome_scores=R, use_prm=use, prm_scheme=scheme,
                                            alpha=0.0, beta=beta, do_batch_norm=do_bn, equal_trajectory_weight=etw,
                                            dtype=torch.float64)
    # independent GRPO outcome advantage with the population std
    o = []
    for i in range(len(R)):
        g = [R[j] for j in range(len(R)) if idx[j] == idx[i]]
        m = sum(g) / len(g)
        sd = math.sqrt(sum((v - m) ** 2 for v in g) / len(g))
        o.append((R[i] - m) / sd if sd > 1e-8 else R[i] - m)
    exp = torch.tensor(o, dtype=torch.float64)[:, None] * beta * mask.double()
    assert torch.allclose(adv, exp, atol=1e-9)
    # and relative to trainer's GRPO estimator (Bessel std): o = grpo * sqrt(n / (n - 1))
    from trainer.algos.advantages import compute_grpo_outcome_advantage
    tl = torch.zeros(len(R), 1, dtype=torch.float64)
    tl[:, 0] = torch.tensor(R, dtype=torch.float64)
    g_adv, _ = compute_grpo_outcome_advantage(token_level_rewards=tl, response_mask=torch.ones_like(tl),
                                              index=torch.tensor(idx), epsilon=0.0)
    for i in range(len(R)):
        n = sum(1 for j in idx if j == idx[i])
        if n >= 2 and abs(o[i]) > 1e-6:
            assert abs(o[i] - float(g_adv[i, 0]) * math.sqrt(n / (n - 1))) < 1e-6


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(["decouple", "allocation"]), st.sampled_from(["last_step", "all_steps"]),
       st.booleans())
def test_env_and_masked_tokens_are_zero_and_step_tokens_share_a_value(batch, scheme, dist, ln):
    flags, K, R, idx, use, sid, msk = batch
    sid_t, msk_t = torch.tensor(sid, dtype=torch.int64), torch.tensor(msk)
    adv, _, _ = compute_adca_grpo_advantage(step_flags=flags, num_steps=K, index=idx, step_ids=sid_t,
                                            response_mask=msk_t, outcome_scores=R, use_prm=use, prm_scheme=scheme,
                                            orm_distribution=dist, enable_length_normalization=ln, alpha=0.7)
    off = (sid_t < 0) | ~msk_t
    assert torch.all(adv[off] == 0)
    for i in range(len(K)):
        for j in range(K[i]):
            v = adv[i][(sid_t[i] == j) & msk_t[i]]
            if v.numel():
                assert torch.all(v == v[0])


@settings(max_examples=60, deadline=None)
@given(batches(min_steps=1), st.sampled_from(["decouple", "allocation"]), st.booleans(), st.booleans(),
       st.sampled_from(["last_step", "all_steps"]))
def test_outcome_only_sample_ignores_its_flags(batch, scheme, do_bn, etw, dist):
    # flipping the labels of a use_prm=False sample changes nothing anywhere in the batch
    flags, K, R, idx, use, _, _ = batch
    use = list(use)
    use[0] = False
    flags2 = [list(f) for f in flags]
    flags2[0] = [-v if v else 1 for v in flags2[0]]
    kw = dict(num_steps=K, outcome_scores=torch.tensor(R), index=torch.tensor(idx), use_prm=torch.tensor(use),
              do_batch_norm=do_bn, equal_trajectory_weight=etw, orm_distribution=dist, alpha=0.6)
    fn = PRM_SCHEMES[scheme]
    a = fn(step_flags=pad_step_flags(flags, K)[0], **kw)
    b = fn(step_flags=pad_step_flags(flags2, K)[0], **kw)
    assert torch.equal(a, b)
    # and its step rewards are the outcome term only (beta = 1)
    o = outcome_zscore(torch.tensor(R), torch.tensor(idx))
    if dist == "last_step":
        exp = [0.0] * (K[0] - 1) + [float(o[0])]
    else:
        exp = [float(o[0])] * K[0]
    assert torch.allclose(a[0, : K[0]], torch.tensor(exp, dtype=torch.float64), atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(batches(min_steps=1), st.sampled_from(["decouple", "allocation"]), st.booleans())
def test_step_zscore_has_zero_weighted_mean_unit_variance(batch, scheme, etw):
    # alpha = 1, beta = 0: step rewards are the z-scores themselves
    flags, K, R, idx, use, _, _ = batch
    f, k = pad_step_flags(flags, K)
    z = PRM_SCHEMES[scheme](step_flags=f, num_steps=k, outcome_scores=torch.tensor(R), index=torch.tensor(idx),
                            use_prm=torch.tensor(use), alpha=1.0, beta=0.0, equal_trajectory_weight=etw)
    for g in set(idx):
        vals, ws = [], []
        for i in range(len(K)):
            lab = [j for j in range(K[i]) if use[i] and flags[i][j] != 0] if idx[i] == g else []
            for j in lab:
                vals.append(float(z[i, j]))
                ws.append(1.0 / len(lab) if etw else 1.0)
        if not vals:
            continue
        wsum = sum(ws)
        mean = sum(w * v for w, v in zip(ws, vals)) / wsum
        var = sum(w * (v - mean) ** 2 for w, v in zip(ws, vals)) / wsum
        assert abs(mean) < 1e-6
        assert abs(var - 1) < 1e-3 or var < 1e-3  # var ~ 0 when every labelled step is the same


@settings(max_examples=60, deadline=None)
@given(batches(min_steps=1))
def test_allocation_raw_shares_sum_to_outcome_sign(batch):
    # without the z-score, alpha = 1, beta = 0: the first step's advantage is the trajectory's raw total,
    # +1 on success (R > 0.5), -1 on failure, 0 without any usable label
    flags, K, R, idx, use, _, _ = batch
    f, k = pad_step_flags(flags, K)
    r = compute_step_rewards_allocation(step_flags=f, num_steps=k, outcome_scores=torch.tensor(R),
                                        index=torch.tensor(idx), use_prm=torch.tensor(use), alpha=1.0, beta=0.0,
                                        do_batch_norm=False)
    tot = r.sum(-1)
    for i in range(len(K)):
        has = use[i] and any(v != 0 for v in flags[i][: K[i]])
        exp = (1.0 if R[i] > 0.5 else -1.0) if has else 0.0
        assert abs(float(tot[i]) - exp) < 1e-12


@settings(max_examples=40, deadline=None)
@given(batches(min_steps=1), st.floats(0.01, 5.0))
def test_decouple_fix_base_cancels_under_batch_norm_and_length_norm_scales(batch, c):
    flags, K, R, idx, use, _, _ = batch
    f, k = pad_step_flags(flags, K)
    kw = dict(step_flags=f, num_steps=k, outcome_scores=torch.tensor(R), index=torch.tensor(idx),
              use_prm=torch.tensor(use))
    a = compute_step_rewards_decouple(fix_base=1.0, alpha=0.5, **kw)
    b = compute_step_rewards_decouple(fix_base=c, alpha=0.5, **kw)
    assert torch.allclose(a, b, atol=1e-3)  # equal up to the eps inside sqrt(var + eps)
    ln = compute_step_rewards_decouple(fix_base=1.0, alpha=0.5, enable_length_normalization=True, **kw)
    assert torch.allclose(ln, a / torch.sqrt(k.double())[:, None], atol=1e-12)
    raw = compute_step_rewards_decouple(fix_base=c, do_batch_norm=False, beta=0.0, alpha=1.0, **kw)
    lab = step_mask_from_num_steps(k, f.shape[1]) & (f != 0) & torch.tensor(use)[:, None]
    assert torch.allclose(raw, c * f.double() * lab, atol=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(-3, 3), st.sampled_from([-1.0, 0.0, 0.5, 1.0])), min_size=1, max_size=12),
       st.floats(1e-9, 1e-2))
def test_select_judge_samples_rules(rows, eps):
    adv = torch.tensor([a for a, _ in rows], dtype=torch.float64)
    r = torch.tensor([s for _, s in rows], dtype=torch.float64)
    small = select_judge_samples(adv, r, "skip_small_adv", eps=eps)
    neg = select_judge_samples(adv, r, "skip_all_neg")
    none = select_judge_samples(adv, r, "none")
    for i, (a, s) in enumerate(rows):
        assert bool(small[i]) == (abs(a) >= eps)
        assert bool(neg[i]) == (s > 0)
    assert none.dtype == torch.bool and bool(none.all())
    with pytest.raises(ValueError, match="skip_type"):
        select_judge_samples(adv, r, "skip_everything")


def test_select_judge_samples_small_adv_skips_uniform_groups():
    # a group that all succeeded has outcome advantage 0 everywhere: nobody in it is sent to the judge
    R_ = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    idx = torch.tensor([0, 0, 0, 1, 1, 1])
    ask = select_judge_samples(outcome_zscore(R_, idx), R_, "skip_small_adv")
    assert ask.tolist() == [False, False, False, True, True, True]


def test_prm_active():
    assert prm_active(0, 20) and prm_active(19, 20)
    assert not prm_active(20, 20) and not prm_active(21, 20)
    assert prm_active(10_000, None)
    assert not prm_active(0, 0)


# ------------------------------------------------------------------------------------------------
# plumbing and errors
# ------------------------------------------------------------------------------------------------


def test_defaults_from_token_rewards_and_step_ids():
    # outcome from token_level_rewards (last token), num_steps from max(step_ids) + 1, dtype follows rewards
    f, k = pad_step_flags(FLAGS)
    sid, mask = token_layout(k.tolist())
    tl = torch.zeros(sid.shape, dtype=torch.bfloat16)
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()
    tl[last] = torch.tensor(R, dtype=torch.bfloat16)
    assert num_steps_from_step_ids(sid).tolist() == k.tolist()
    adv, _, _ = compute_adca_grpo_advantage(step_flags=f, index=IDX, step_ids=sid, response_mask=mask,
                                            token_level_rewards=tl)
    ref, _, _ = compute_adca_grpo_advantage(step_flags=f, num_steps=k, index=IDX, step_ids=sid, response_mask=mask,
                                            outcome_scores=R)
    assert adv.dtype == torch.bfloat16
    assert torch.allclose(adv.float(), ref, atol=2e-2)


def test_string_group_ids_and_user_scheme():
    f, k = pad_step_flags(FLAGS)
    sid, mask = token_layout(k.tolist())
    a, _, _ = compute_adca_grpo_advantage(step_flags=f, num_steps=k, index=["u0"] * 3 + ["u1"] * 3,
                                          step_ids=sid, response_mask=mask, outcome_scores=R)
    b, _, _ = compute_adca_grpo_advantage(step_flags=f, num_steps=k, index=IDX, step_ids=sid, response_mask=mask,
                                          outcome_scores=R)
    assert torch.equal(a, b)
    # a user scheme returning only step rewards: the contribution metrics are left out
    m = compute_adca_grpo_advantage(step_flags=f, num_steps=k, index=IDX, step_ids=sid, response_mask=mask,
                                    outcome_scores=R, prm_scheme=lambda **kw: torch.ones(6, 4, dtype=torch.float64))
    assert torch.allclose(m[0][0, sid[0] >= 0], torch.tensor([3.0, 3, 2, 2, 1, 1]))
    assert "adca/prm_abs_mean" not in m[2]
    assert get_prm_scheme("decouple") is compute_step_rewards_decouple
    with pytest.raises(ValueError, match="decouple"):
        get_prm_scheme("decoupled")


def test_errors():
    f, k = pad_step_flags(FLAGS)
    sid, mask = token_layout(k.tolist())
    with pytest.raises(ValueError, match="orm_distribution"):
        compute_adca_grpo_advantage(step_flags=f, num_steps=k, index=IDX, step_ids=sid, response_mask=mask,
                                    outcome_scores=R, orm_distribution="first_step")
    bad_k = k.clone()
    bad_k[2] = 2  # t2's tokens name steps 2 and 3
    with pytest.raises(ValueError, match="step_ids"):
        compute_adca_grpo_advantage(step_flags=f, num_steps=bad_k, index=IDX, step_ids=sid, response_mask=mask,
                                    outcome_scores=R)
    with pytest.raises(ValueError, match="outcome_scores"):
        compute_adca_grpo_advantage(step_flags=f, num_steps=k, index=IDX, step_ids=sid, response_mask=mask)


def test_empty_and_stepless_rows():
    # a trajectory with no assistant step (K = 0) gets all-zero advantages and does not break the stats
    flags = [[1, -1], [], [-1]]
    sid = torch.tensor([[0, -1, 1, -1], [-1, -1, -1, -1], [0, 0, -1, -1]])
    mask = sid >= 0
    adv, _, m = compute_adca_grpo_advantage(step_flags=flags, index=[0, 0, 0], step_ids=sid, response_mask=mask,
                                            outcome_scores=[1.0, 0.0, 0.0])
    assert torch.all(adv[1] == 0)
    assert all(torch.isfinite(v) for v in m.values())
    tok = step_rewards_to_token_advantages(torch.zeros(2, 0, dtype=torch.float64), torch.zeros(2, 0, dtype=torch.bool),
                                           torch.full((2, 3), -1), torch.ones(2, 3))
    assert tok.shape == (2, 3) and torch.all(tok == 0)


def test_vectorised_path_scales():
    # 4096 trajectories x up to 16 steps x 1024 tokens runs in one pass (no per-trajectory loop)
    import time
    g = torch.Generator().manual_seed(0)
    B, S, T = 4096, 16, 1024
    k = torch.randint(1, S + 1, (B,), generator=g)
    flags = torch.randint(-1, 2, (B, S), generator=g).to(torch.int8)
    sid = (torch.arange(T)[None, :] * k[:, None] // T)  # tokens spread over the K_i steps
    sid[:, ::7] = -1  # env tokens
    R_ = torch.randint(0, 2, (B,), generator=g).float()
    idx = torch.arange(B) // 8
    t0 = time.perf_counter()
    adv, _, _ = compute_adca_grpo_advantage(step_flags=flags, num_steps=k, index=idx, step_ids=sid,
                                            response_mask=torch.ones(B, T), outcome_scores=R_)
    dt = time.perf_counter() - t0
    assert adv.shape == (B, T) and torch.isfinite(adv).all()
    assert dt < 10.0, dt
