"""The estimators of issue #20 part 1 (gpg, opo, gdpo, optimal_token_baseline, tir_optimal_token_baseline,
cpgd, and the grpo_vectorized / rloo_vectorized spellings): golden numbers worked by hand, a float64
per-sample reference (a Python loop over samples and groups, written from the definitions) on ragged
masks with holes, and agreement with verl 0.9.1's own functions on the same random inputs.

Tolerances: against verl on float64 inputs 1e-9 absolute (verl's grpo_vectorized / gdpo compute the group
statistics in float32 internally: 1e-6 there); against the float64 references 1e-10."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import verl.trainer.ppo.core_algos as V
from trainer.algos import advantages as A

F64 = torch.float64


def _outcome(lengths, rewards, T=None, holes=()):
    """token_level_rewards / mask [B, T] with reward R_i on the last valid token; ``holes``: (i, t) masked."""
    B = len(lengths)
    T = T or max(lengths)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).to(F64)
    for i, t in holes:
        mask[i, t] = 0.0
    tlr = torch.zeros(B, T, dtype=F64)
    for i, n in enumerate(lengths):
        if n:
            tlr[i, n - 1] = rewards[i]
    return tlr, mask


def _rand_case(seed, B=18, T=11, holes=True, n_per=3, levels=3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(F64)
    if holes:  # environment tokens inside some responses (never the last one, which holds the reward)
        h = (torch.rand(B, T, generator=g) < 0.25) & (torch.arange(T)[None] < (lengths - 1)[:, None])
        mask = mask * (~h).to(F64)
    R = torch.randint(0, levels, (B,), generator=g).to(F64)
    tlr = torch.zeros(B, T, dtype=F64)
    tlr[torch.arange(B), lengths - 1] = R
    index = np.repeat(np.arange(B // n_per), n_per)
    return tlr, mask, index, R


def _seq(tlr, mask):
    return [float((tlr[i] * mask[i]).sum()) for i in range(tlr.shape[0])]


def _groups(index):
    out = {}
    for i, g in enumerate(index):
        out.setdefault(g, []).append(i)
    return out


def _std(xs):  # unbiased
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _bcast(per_sample, mask):
    return torch.tensor(per_sample, dtype=F64)[:, None] * mask


# --------------------------------------------------------------------------------------------------
# golden numbers
# --------------------------------------------------------------------------------------------------


def test_opo_golden():
    # group 0: R = (1, 0, 1), lengths (2, 4, 1): b = (2*1 + 4*0 + 1*1) / (2 + 4 + 1) = 3/7
    #   A = (1 - 3/7, -3/7, 1 - 3/7) = (4/7, -3/7, 4/7)   (a plain mean would give 1/3 and A_0 = 2/3)
    # group 1: a single response R = 2 -> baseline 0, A = 2
    tlr, mask = _outcome([2, 4, 1, 3], [1.0, 0.0, 1.0, 2.0])
    adv, ret = A.compute_opo_outcome_advantage(token_level_rewards=tlr, response_mask=mask, index=[0, 0, 0, 1])
    torch.testing.assert_close(adv[:, 0], torch.tensor([4 / 7, -3 / 7, 4 / 7, 2.0], dtype=F64))
    assert torch.equal(adv, adv * mask) and torch.equal(adv, ret)


def test_gpg_golden_alpha_is_the_papers():
    # B = 6 in 3 groups of 2: (1, 0) mixed, (1, 1) constant, (0, 0) constant -> M = 4 invalid samples,
    # alpha = B / (B - M) = 6 / 2 = 3;  A = 3 * (R - mean) = 3 * (0.5, -0.5) for the mixed group, 0 elsewhere.
    # verl's alpha = B / count_nonzero(R) = 6 / 3 = 2 would give (1, -1).
    tlr, mask = _outcome([2, 3, 1, 2, 2, 1], [1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    adv, _ = A.compute_gpg_outcome_advantage(token_level_rewards=tlr, response_mask=mask, index=[0, 0, 1, 1, 2, 2])
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.5, -1.5, 0, 0, 0, 0], dtype=F64))
    verl_adv, _ = V.compute_gpg_outcome_advantage(token_level_rewards=tlr.clone(), response_mask=mask,
                                                  index=np.array([0, 0, 1, 1, 2, 2]))
    torch.testing.assert_close(verl_adv[:, 0], torch.tensor([1.0, -1.0, 0, 0, 0, 0], dtype=F64))  # the documented gap


def test_gdpo_golden():
    # two groups of 2, components c1 = (1, 0 | 1, 1), c2 = (0, 2 | 2, 0), weights (1, 0.25), eps = 1e-6:
    #   GRPO(c1): group 0 centred (+.5, -.5), std sqrt(.5) -> (+.70711, -.70711); group 1 constant -> (0, 0)
    #   GRPO(c2): group 0 centred (-1, +1), std sqrt(2) -> (-.70711, +.70711); group 1 -> (+.70711, -.70711)
    #   sum = c1 + .25 c2 = (.53033, -.53033, .17678, -.17678)
    # all lengths 1 -> batch whitening over the 4 tokens: mean 0, unbiased var = (2 * .28125 + 2 * .03125) / 3
    #   = .20833 -> A = sum / sqrt(.20833 + 1e-8) = (1.16190, -1.16190, .38730, -.38730)
    a1 = 0.5 / (math.sqrt(0.5) + 1e-6)
    a2 = 1.0 / (math.sqrt(2.0) + 1e-6)
    raw = torch.tensor([a1 - 0.25 * a2, -a1 + 0.25 * a2, 0.25 * a2, -0.25 * a2], dtype=F64)
    want = raw / math.sqrt(float((raw ** 2).sum()) / 3 + 1e-8)
    torch.testing.assert_close(want, torch.tensor([1.16190, -1.16190, 0.38730, -0.38730], dtype=F64), atol=1e-5, rtol=0)
    tlr, mask = _outcome([1, 1, 1, 1], [0.0] * 4)
    adv, _ = A.compute_gdpo_outcome_advantage(
        token_level_rewards=tlr, response_mask=mask, index=[0, 0, 1, 1],
        reward_components={"c1": [1.0, 0.0, 1.0, 1.0], "c2": [0.0, 2.0, 2.0, 0.0]}, gdpo_reward_weights=(1.0, 0.25))
    torch.testing.assert_close(adv[:, 0], want)
    # GRPO on the summed reward c1 + .25 c2 = (1, .5 | 1.5, 1) (what GDPO decouples) gives +-.866 everywhere
    summed, _ = A.compute_grpo_outcome_advantage(token_level_rewards=_outcome([1] * 4, [1.0, 0.5, 1.5, 1.0])[0],
                                                 response_mask=mask, index=[0, 0, 1, 1])
    assert not torch.allclose(summed[:, 0], want, atol=1e-2)
    with pytest.raises(ValueError, match="gdpo_reward_weights"):
        A.compute_gdpo_outcome_advantage(token_level_rewards=tlr, response_mask=mask, index=[0, 0, 1, 1],
                                         reward_components={"c1": [1.0] * 4}, gdpo_reward_weights=(1.0, 2.0))


def test_cpgd_golden_each_weighting():
    # groups (1, 0, 0) and (2, 2, 2): means 1/3 and 2; std of (1, 0, 0) = sqrt(1/3); the second is constant
    tlr, mask = _outcome([1, 2, 3, 1, 2, 3], [1.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    kw = dict(token_level_rewards=tlr, response_mask=mask, index=[0, 0, 0, 1, 1, 1])
    naive, _ = A.compute_cpgd_outcome_advantage(weight_factor_in_cpgd="naive", **kw)
    torch.testing.assert_close(naive[:, 0], torch.tensor([2 / 3, -1 / 3, -1 / 3, 0, 0, 0], dtype=F64))
    std, _ = A.compute_cpgd_outcome_advantage(weight_factor_in_cpgd="STD_weight", **kw)
    s = math.sqrt(1 / 3) + 1e-6
    torch.testing.assert_close(std[:, 0], torch.tensor([2 / 3 / s, -1 / 3 / s, -1 / 3 / s, 0, 0, 0], dtype=F64))
    # clip_filter_like: B = 6 samples / 1 group with non-zero std = 6, capped at 3 -> 3 x naive
    clip, _ = A.compute_cpgd_outcome_advantage(weight_factor_in_cpgd="clip_filter_like_weight", **kw)
    torch.testing.assert_close(clip[:, 0], 3 * naive[:, 0])
    # 4 groups of 1 sample... singletons count as non-zero std: B / G_nz = 4 / 4 = 1 -> A = R (mean 0)
    tlr1, mask1 = _outcome([1, 1, 1, 1], [1.0, 2.0, 0.0, 3.0])
    one, _ = A.compute_cpgd_outcome_advantage(token_level_rewards=tlr1, response_mask=mask1, index=[0, 1, 2, 3],
                                              weight_factor_in_cpgd="clip_filter_like_weight")
    torch.testing.assert_close(one[:, 0], torch.tensor([1.0, 2.0, 0.0, 3.0], dtype=F64))
    with pytest.raises(ValueError, match="weight_factor_in_cpgd"):
        A.compute_cpgd_outcome_advantage(weight_factor_in_cpgd="std", **kw)


def test_otb_golden():
    # one group of two responses of 2 tokens, reward 1 on the last token of response 0, 0 for response 1.
    # pi_t = 0.5 everywhere, sum pi^2 = 0.5 -> w = 1 - 1 + 0.5 = 0.5, W = (0.5, 1.0) for both.
    # G_0 = (1, 1), G_1 = (0, 0) -> B_t = (1*W + 0*W) / (2W) = 0.5 at both positions (eps 0)
    # A_0 = (0.5, 0.5), A_1 = (-0.5, -0.5)
    tlr, mask = _outcome([2, 2], [1.0, 0.0])
    lp = torch.full((2, 2), math.log(0.5), dtype=F64)
    spp = torch.full((2, 2), 0.5, dtype=F64)
    for fn in (A.compute_optimal_token_baseline_advantage, A.compute_tir_optimal_token_baseline_advantage):
        adv, ret = fn(token_level_rewards=tlr, response_mask=mask, index=[0, 0], old_log_probs=lp, sum_pi_squared=spp,
                      epsilon=0.0)
        torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5], [-0.5, -0.5]], dtype=F64))
        torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=F64))
    # the weights matter: make response 0's first step heavier (pi = 0.1: w = 1 - 0.2 + 0.5 = 1.3, W = (1.3, 1.8))
    lp2 = lp.clone()
    lp2[0, 0] = math.log(0.1)
    adv, _ = A.compute_optimal_token_baseline_advantage(token_level_rewards=tlr, response_mask=mask, index=[0, 0],
                                                        old_log_probs=lp2, sum_pi_squared=spp, epsilon=0.0)
    # B_0 = 1.3 / (1.3 + 0.5), B_1 = 1.8 / (1.8 + 1.0)
    torch.testing.assert_close(adv[0], torch.tensor([1 - 1.3 / 1.8, 1 - 1.8 / 2.8], dtype=F64))
    with pytest.raises(ValueError, match="sum_pi_squared"):
        A.compute_optimal_token_baseline_advantage(token_level_rewards=tlr, response_mask=mask, index=[0, 0])


def test_otb_zero_tail_and_tir_alignment():
    # group of 2: lengths 3 and 1, reward 1 / 0. handle_zero_tail: the lone longest response has no peer
    # from position 1 on, so its baseline there is 0 and A = G = 1.
    tlr, mask = _outcome([3, 1], [1.0, 0.0])
    lp = torch.full((2, 3), math.log(0.5), dtype=F64)
    spp = torch.full((2, 3), 0.5, dtype=F64)
    kw = dict(token_level_rewards=tlr, response_mask=mask, index=[0, 0], old_log_probs=lp, sum_pi_squared=spp,
              epsilon=0.0)
    adv, _ = A.compute_optimal_token_baseline_advantage(**kw)
    torch.testing.assert_close(adv[0], torch.tensor([0.5, 1.0, 1.0], dtype=F64))  # B_0 = 0.5, then 0
    adv_nz, _ = A.compute_optimal_token_baseline_advantage(handle_zero_tail=False, **kw)
    torch.testing.assert_close(adv_nz[0], torch.tensor([0.5, 0.0, 0.0], dtype=F64))  # only itself past t=0: B = G
    # TIR: response 0 = (gen, env, gen), response 1 = (gen, gen): its 2nd generated token is compared with
    # response 1's 2nd token (absolute positions would compare it with nothing, response 1's hole... )
    tlr = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
    kw = dict(token_level_rewards=tlr, response_mask=mask, index=[0, 0], old_log_probs=lp, sum_pi_squared=spp,
              epsilon=0.0, handle_zero_tail=False)
    tir, _ = A.compute_tir_optimal_token_baseline_advantage(**kw)
    # k = 0: W = (0.5, 0.5), G = (1, 0) -> B = 0.5;  k = 1: W = (1.0, 1.0), G = (1, 0) -> B = 0.5
    torch.testing.assert_close(tir, torch.tensor([[0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]], dtype=F64))
    pos, _ = A.compute_optimal_token_baseline_advantage(**kw)
    # absolute positions: t = 1 only response 1 is valid (B = its own G = 0), t = 2 only response 0 (B = 1)
    torch.testing.assert_close(pos, torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]], dtype=F64))


# --------------------------------------------------------------------------------------------------
# float64 per-sample references on ragged masks with holes
# --------------------------------------------------------------------------------------------------


def ref_opo(tlr, mask, index):
    R, L = _seq(tlr, mask), [float(mask[i].sum()) for i in range(len(index))]
    out = [0.0] * len(index)
    for members in _groups(index).values():
        den = sum(L[j] for j in members)
        b = sum(L[j] * R[j] for j in members) / den if len(members) > 1 and den > 0 else 0.0
        for i in members:
            out[i] = R[i] - b
    return _bcast(out, mask)


def ref_gpg(tlr, mask, index):
    R = _seq(tlr, mask)
    grp = _groups(index)
    invalid = sum(len(m) for m in grp.values() if len(m) > 1 and len(set(R[j] for j in m)) == 1)
    alpha = len(R) / max(len(R) - invalid, 1)
    out = [0.0] * len(R)
    for members in grp.values():
        mean = sum(R[j] for j in members) / len(members) if len(members) > 1 else 0.0
        for i in members:
            out[i] = alpha * (R[i] - mean)
    return _bcast(out, mask)


def ref_grpo_component(c, index, eps=1e-6, norm=True):
    out = [0.0] * len(c)
    for members in _groups(index).values():
        if len(members) == 1:
            mean, std = 0.0, 1.0
        else:
            xs = [c[j] for j in members]
            mean, std = sum(xs) / len(xs), _std(xs)
        for i in members:
            out[i] = (c[i] - mean) / (std + eps) if norm else c[i] - mean
    return out


def ref_gdpo(mask, index, comps, weights, norm=True):
    tot = [sum(w * a for w, a in zip(weights, col))
           for col in zip(*[ref_grpo_component(c, index, norm=norm) for c in comps])]
    vals = [tot[i] for i in range(len(tot)) for t in range(mask.shape[1]) if mask[i, t]]
    mu = sum(vals) / len(vals)
    var = sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)
    return _bcast([(x - mu) / math.sqrt(var + 1e-8) for x in tot], mask)


def ref_cpgd(tlr, mask, index, mode, eps=1e-6):
    R = _seq(tlr, mask)
    grp = _groups(index)
    if mode == "STD_weight":
        return _bcast(ref_grpo_component(R, index, eps), mask)
    centred = ref_grpo_component(R, index, norm=False)
    if mode == "naive":
        return _bcast(centred, mask)
    g_nz = sum(1 for m in grp.values() if len(m) == 1 or _std([R[j] for j in m]) != 0)
    return _bcast([c * min(len(R) / g_nz, 3.0) for c in centred], mask)


def ref_otb(tlr, mask, index, lp, spp, isw, zero_tail, tir, eps=1e-8):
    """One response at a time: G, W over its valid tokens; the baseline at (absolute or valid-token)
    position k averages G*W over the group's responses that have position k."""
    B, T = mask.shape
    seqs = []
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t]]
        w = [(1 - 2 * math.exp(lp[i, t]) + spp[i, t]) * (float(isw[i, t]) ** 2 if isw is not None else 1.0) for t in valid]
        W = list(np.cumsum(w)) if w else []
        G = [sum(float(tlr[i, s]) for s in valid if s >= t) for t in valid]
        if tir:
            seqs.append({k: (G[k], W[k], valid[k]) for k in range(len(valid))})
        else:
            seqs.append({valid[k]: (G[k], W[k], valid[k]) for k in range(len(valid))})
    adv = torch.zeros(B, T, dtype=F64)
    for members in _groups(index).values():
        if tir:
            members = [i for i in members if seqs[i]]
        lengths = {i: int(mask[i].sum()) for i in members}
        lone, second = None, None
        if zero_tail and len(members) > 1:
            ls = sorted(lengths.values())
            if ls[-1] > ls[-2]:
                lone, second = max(lengths, key=lengths.get), ls[-2]
        for i in members:
            for k, (g, _, t) in seqs[i].items():
                if len(members) == 1 or (i == lone and k >= second):
                    b = 0.0
                else:
                    num = sum(seqs[j][k][0] * seqs[j][k][1] for j in members if k in seqs[j])
                    den = sum(seqs[j][k][1] for j in members if k in seqs[j])
                    b = num / (den + eps)
                adv[i, t] = g - b
    return adv


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("holes", [False, True])
def test_references_ragged(seed, holes):
    tlr, mask, index, _ = _rand_case(seed, holes=holes)
    index = index.copy()
    index[-1] = 99  # a group of one
    kw = dict(token_level_rewards=tlr, response_mask=mask, index=index)
    torch.testing.assert_close(A.ADV_ESTIMATORS["opo"](**kw)[0], ref_opo(tlr, mask, index), atol=1e-10, rtol=0)
    torch.testing.assert_close(A.ADV_ESTIMATORS["gpg"](**kw)[0], ref_gpg(tlr, mask, index), atol=1e-10, rtol=0)
    for mode in ("STD_weight", "naive", "clip_filter_like_weight"):
        torch.testing.assert_close(A.ADV_ESTIMATORS["cpgd"](weight_factor_in_cpgd=mode, **kw)[0],
                                   ref_cpgd(tlr, mask, index, mode), atol=1e-10, rtol=0)
    g = torch.Generator().manual_seed(seed + 100)
    comps = {"fmt": torch.randint(0, 2, (len(index),), generator=g).double().tolist(),
             "acc": torch.rand(len(index), generator=g).double().tolist()}
    for norm in (True, False):
        ours = A.ADV_ESTIMATORS["gdpo"](reward_components=comps, gdpo_reward_weights=[0.3, 1.0],
                                        norm_adv_by_std_in_grpo=norm, **kw)[0]
        torch.testing.assert_close(ours, ref_gdpo(mask, index, list(comps.values()), [0.3, 1.0], norm), atol=1e-10, rtol=0)
    lp = -torch.rand(tlr.shape, generator=g, dtype=F64) * 3
    spp = torch.rand(tlr.shape, generator=g, dtype=F64) * 0.6
    isw = torch.rand(tlr.shape, generator=g, dtype=F64) + 0.5
    for tir in (False, True):
        fn = A.ADV_ESTIMATORS["tir_optimal_token_baseline" if tir else "optimal_token_baseline"]
        for zt in (True, False):
            for w in (None, isw):
                ours, ret = fn(old_log_probs=lp, sum_pi_squared=spp, rollout_is_weights=w, handle_zero_tail=zt, **kw)
                torch.testing.assert_close(ours, ref_otb(tlr, mask, index, lp, spp, w, zt, tir), atol=1e-10, rtol=0)


# --------------------------------------------------------------------------------------------------
# agreement with verl 0.9.1's functions
# --------------------------------------------------------------------------------------------------


def _verl_kw(tlr, mask, index):
    return dict(token_level_rewards=tlr.clone(), response_mask=mask.clone(), index=np.asarray(index))


@pytest.mark.parametrize("seed", range(4))
def test_agrees_with_verl(seed):
    # right-padded responses (verl's group estimators sum token rewards over the whole row: no holes here)
    tlr, mask, index, R = _rand_case(seed, holes=False)
    kw = dict(token_level_rewards=tlr, response_mask=mask, index=index)
    ours = A.ADV_ESTIMATORS["opo"](**kw)[0]
    torch.testing.assert_close(ours, V.compute_opo_outcome_advantage(**_verl_kw(tlr, mask, index))[0], atol=1e-9, rtol=0)
    ours = A.ADV_ESTIMATORS["grpo_vectorized"](**kw)[0]  # verl: float32 statistics
    torch.testing.assert_close(ours, V.compute_grpo_vectorized_outcome_advantage(**_verl_kw(tlr, mask, index))[0],
                               atol=1e-6, rtol=0)
    ours = A.ADV_ESTIMATORS["rloo_vectorized"](**kw)[0]
    torch.testing.assert_close(ours, V.compute_rloo_vectorized_outcome_advantage(**_verl_kw(tlr, mask, index))[0],
                               atol=1e-9, rtol=0)
    # gdpo without components: verl's fallback (one component = the outcome score)
    ours = A.ADV_ESTIMATORS["gdpo"](**kw)[0]
    torch.testing.assert_close(ours, V.compute_gdpo_outcome_advantage(**_verl_kw(tlr, mask, index))[0], atol=1e-6, rtol=0)
    # the optimal token baselines, with holes too (verl's functions mask the rewards themselves)
    for holes in (False, True):
        tlr_h, mask_h, index_h, _ = _rand_case(seed + 10, holes=holes)
        g = torch.Generator().manual_seed(seed)
        lp = -torch.rand(tlr_h.shape, generator=g, dtype=F64) * 3
        spp = torch.rand(tlr_h.shape, generator=g, dtype=F64) * 0.6
        isw = torch.rand(tlr_h.shape, generator=g, dtype=F64) + 0.5
        for name, vf in (("optimal_token_baseline", V.compute_optimal_token_baseline_advantage),
                         ("tir_optimal_token_baseline", V.compute_multi_turn_optimal_token_baseline_advantage)):
            for zt in (True, False):
                for w in (None, isw):
                    extra = dict(old_log_probs=lp, sum_pi_squared=spp, rollout_is_weights=w, handle_zero_tail=zt)
                    a, ra = A.ADV_ESTIMATORS[name](token_level_rewards=tlr_h, response_mask=mask_h, index=index_h, **extra)
                    b, rb = vf(**_verl_kw(tlr_h, mask_h, index_h), **extra)
                    torch.testing.assert_close(a, b, atol=1e-9, rtol=0)
                    torch.testing.assert_close(ra * mask_h, rb * mask_h, atol=1e-9, rtol=0)


def test_gpg_agrees_with_verl_where_the_paper_and_verl_coincide():
    # every sample of a mixed group has a non-zero reward, every constant group has reward 0: then verl's
    # count_nonzero(R) = B - M and the two alphas are the same
    R = [1.0, 2.0, 2.0, 0.0, 0.0, 0.0, 3.0, 1.0, 1.0]
    tlr, mask = _outcome([3, 1, 2, 2, 3, 1, 2, 2, 1], R)
    index = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    ours = A.compute_gpg_outcome_advantage(token_level_rewards=tlr, response_mask=mask, index=index)[0]
    theirs = V.compute_gpg_outcome_advantage(**_verl_kw(tlr, mask, index))[0]
    torch.testing.assert_close(ours, theirs, atol=1e-9, rtol=0)
    assert float(ours.abs().max()) > 0


def test_vectorized_spellings_are_grpo_and_rloo():
    tlr, mask, index, _ = _rand_case(5, holes=True)
    kw = dict(token_level_rewards=tlr, response_mask=mask, index=index, norm_adv_by_std_in_grpo=False)
    assert torch.equal(A.ADV_ESTIMATORS["grpo_vectorized"](**kw)[0], A.ADV_ESTIMATORS["grpo"](**kw)[0])
    assert torch.equal(A.ADV_ESTIMATORS["rloo_vectorized"](**kw)[0], A.ADV_ESTIMATORS["rloo"](**kw)[0])
    # the flag is honoured (verl's dispatch drops it for grpo_vectorized)
    assert not torch.equal(A.ADV_ESTIMATORS["grpo_vectorized"](**{**kw, "norm_adv_by_std_in_grpo": True})[0],
                           A.ADV_ESTIMATORS["grpo_vectorized"](**kw)[0])


# --------------------------------------------------------------------------------------------------
# config: each name is accepted and reaches its function through the plan; bad settings are refused
# --------------------------------------------------------------------------------------------------


def _cfg(*ov):
    from trainer.config import load_config

    return load_config(["--config", "recipes/cpu/tiny_grpo.yaml", "--config", "recipes/cpu/fp32.yaml", *ov])


@pytest.mark.parametrize("name,extra", [
    ("opo", []), ("gpg", []), ("grpo_vectorized", []), ("rloo_vectorized", []),
    ("gdpo", ["algorithm.gdpo_reward_keys=[fmt,acc]", "algorithm.gdpo_reward_weights=[0.3,1.0]"]),
    ("cpgd", ["algorithm.weight_factor_in_cpgd=clip_filter_like_weight"]),
])
def test_config_names_reach_the_estimator(name, extra):
    from trainer.algos.advantages import compute_advantage
    from trainer.plan import Plan

    plan = Plan.from_config(_cfg(f"algorithm.adv_estimator={name}", *extra), total_steps=1)
    tlr, mask, index, _ = _rand_case(7, holes=False)
    comps = {"fmt": [float(i % 2) for i in range(len(index))], "acc": [float(i % 3) for i in range(len(index))]}
    # the driver's call (trainer/step.driver_math)
    kw = dict(token_level_rewards=tlr, response_mask=mask, index=torch.as_tensor(index), values=None, gamma=plan.gamma,
              lam=plan.lam, norm_adv_by_std_in_grpo=plan.norm_adv_by_std_in_grpo, **plan.adv_kwargs)
    if plan.reward_keys:
        kw["reward_components"] = {k: torch.tensor(comps[k], dtype=F64) for k in plan.reward_keys}
    adv, _, _ = compute_advantage(plan.adv_estimator, **kw)
    direct = {"opo": lambda: ref_opo(tlr, mask, index), "gpg": lambda: ref_gpg(tlr, mask, index),
              "grpo_vectorized": lambda: A.compute_grpo_outcome_advantage(token_level_rewards=tlr, response_mask=mask,
                                                                           index=index)[0],
              "rloo_vectorized": lambda: A.compute_rloo_outcome_advantage(token_level_rewards=tlr, response_mask=mask,
                                                                           index=index)[0],
              "gdpo": lambda: ref_gdpo(mask, index, [comps["fmt"], comps["acc"]], [0.3, 1.0]),
              "cpgd": lambda: ref_cpgd(tlr, mask, index, "clip_filter_like_weight")}[name]()
    torch.testing.assert_close(adv, direct, atol=1e-10, rtol=0)


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.adv_estimator=gdpo"], "set algorithm.gdpo_reward_keys"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]", "algorithm.gdpo_reward_weights=[1.0]"],
     "one weight per key"),
    (["algorithm.gdpo_reward_keys=[a]"], "read by adv_estimator=gdpo only"),
    (["algorithm.adv_estimator=cpgd", "algorithm.weight_factor_in_cpgd=std"], "is not one of"),
    (["algorithm.weight_factor_in_cpgd=naive"], "read by adv_estimator=cpgd only"),
    # verl's rule: the optimal token baseline reads sum pi^2, which the actor returns only when asked
    (["algorithm.adv_estimator=optimal_token_baseline"], r"sum_v pi\(v\)\^2 .* set actor_rollout_ref\.actor\."
                                                         r"calculate_sum_pi_squared=true"),
    (["algorithm.adv_estimator=tir_optimal_token_baseline"], r"set actor_rollout_ref\.actor\.calculate_sum_pi_squared=true"),
    (["algorithm.adv_estimator=opo", "actor_rollout_ref.rollout.n=1"], "compares responses within a group"),
    (["algorithm.adv_estimator=gpgg"], "Did you mean 'gpg'"),
])
def test_bad_estimator_settings_refused(overrides, message):
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _cfg(*overrides)
