"""Tests for trainer.algos.advantages.

Three kinds: golden numbers worked by hand (arithmetic in the comments), float64 per-sample /
per-group Python-loop references on random inputs with ragged masks (and holes), and hypothesis
properties.
"""

from __future__ import annotations

import math
import statistics
import sys
import textwrap
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.algos import advantages as A
from trainer.algos.advantages import ADV_ESTIMATORS, compute_advantage, get_adv_estimator

EPS = 1e-6


def full(rows):
    return torch.tensor(rows, dtype=torch.float32)


def outcome(scores, T=3):
    """Token rewards [B, T] with each score on the last token, and an all-ones mask."""
    r = torch.zeros(len(scores), T)
    r[:, -1] = torch.tensor(scores, dtype=torch.float32)
    return r, torch.ones(len(scores), T)


# ------------------------------------------------------------------------------------------------
# golden numbers
# ------------------------------------------------------------------------------------------------


def test_grpo_golden_1010_and_singleton():
    # group 0: R = [1, 0, 1, 0] -> mean 0.5; unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.57735
    #   A = +-0.5 / (0.57735 + 1e-6) = +-0.866024
    # group 1: a single response R = 2 -> mean 0, std 1 -> A = 2 / (1 + 1e-6) = 1.999998
    r, m = outcome([1, 0, 1, 0, 2])
    idx = torch.tensor([0, 0, 0, 0, 1])
    adv, ret = A.compute_grpo_outcome_advantage(token_level_rewards=r, response_mask=m, index=idx)
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    exp = torch.tensor([a, -a, a, -a, 2 / (1 + EPS)])[:, None].expand(5, 3)
    torch.testing.assert_close(adv, exp.float(), rtol=1e-6, atol=1e-6)
    assert abs(a - 0.866024) < 1e-6
    torch.testing.assert_close(ret, adv)


def test_dr_grpo_golden():
    # group 0: R = [3, 1] -> mean 2 -> A = [1, -1] (no std division)
    # group 1: R = [5] alone -> mean 0 -> A = 5
    r, m = outcome([3, 1, 5])
    idx = torch.tensor([7, 7, 9])
    kw = dict(token_level_rewards=r, response_mask=m, index=idx)
    exp = torch.tensor([1.0, -1.0, 5.0])[:, None].expand(3, 3)
    adv, _ = A.compute_dr_grpo_outcome_advantage(**kw, norm_adv_by_std_in_grpo=True)  # flag ignored
    torch.testing.assert_close(adv, exp)
    adv2, _ = A.compute_grpo_outcome_advantage(**kw, norm_adv_by_std_in_grpo=False)  # grpo + flag
    torch.testing.assert_close(adv2, exp)


def test_rloo_golden():
    # group 0: R = [1, 2, 6]: leave-one-out baselines mean(2,6)=4, mean(1,6)=3.5, mean(1,2)=1.5
    #   A = [1-4, 2-3.5, 6-1.5] = [-3, -1.5, 4.5]  ( = 3/2 * (R - 3) )
    # group 1: R = [7] alone -> baseline 0 -> A = 7
    r, m = outcome([1, 2, 6, 7])
    adv, _ = A.compute_rloo_outcome_advantage(token_level_rewards=r, response_mask=m, index=torch.tensor([0, 0, 0, 1]))
    torch.testing.assert_close(adv[:, 0], torch.tensor([-3.0, -1.5, 4.5, 7.0]))


def test_gae_golden_with_hole():
    # T = 3, r = [0, 0, 1], V = [0.2, 0.4, 0.6], gamma = 0.9, lam = 0.8 (gamma*lam = 0.72)
    r = full([[0, 0, 1], [0, 0, 1]])
    v = full([[0.2, 0.4, 0.6], [0.2, 0.4, 0.6]])
    m = full([[1, 1, 1], [1, 0, 1]])  # row 1 has an environment token at t=1
    adv, ret = A.compute_gae_advantage_return(token_level_rewards=r, values=v, response_mask=m, gamma=0.9, lam=0.8)
    # row 0: delta2 = 1 - 0.6 = 0.4                 A2 = 0.4
    #        delta1 = 0.9*0.6 - 0.4 = 0.14          A1 = 0.14 + 0.72*0.4   = 0.428
    #        delta0 = 0.9*0.4 - 0.2 = 0.16          A0 = 0.16 + 0.72*0.428 = 0.46816
    #        returns = A + V = [0.66816, 0.828, 1.0]
    # row 1: t=1 is skipped: A2 = 0.4; delta0 = 0.9*V2 - V0 = 0.54 - 0.2 = 0.34
    #        A0 = 0.34 + 0.72*0.4 = 0.628; returns = [0.828, 0, 1.0]
    torch.testing.assert_close(ret, full([[0.66816, 0.828, 1.0], [0.828, 0.0, 1.0]]))
    assert adv[1, 1] == 0.0
    # whitening over the 5 valid raw advantages [0.46816, 0.428, 0.4, 0.628, 0.4]:
    raw = [0.46816, 0.428, 0.4, 0.628, 0.4]
    mu = sum(raw) / 5
    sd = math.sqrt(sum((x - mu) ** 2 for x in raw) / 4 + 1e-8)
    torch.testing.assert_close(adv[m.bool()], torch.tensor([(x - mu) / sd for x in raw]), rtol=1e-5, atol=1e-5)


def test_gae_two_tokens_whiten_to_plus_minus_one_over_sqrt2():
    # mask [1, 0, 1] alone: raw A = [0.628, -, 0.4] (see above); whitening two values a > b gives
    # (a - m) / (|a - b| / sqrt 2) = (|a-b|/2) / (|a-b|/sqrt 2) = 1/sqrt 2 = 0.7071, and -0.7071
    r, v, m = full([[0, 0, 1]]), full([[0.2, 0.4, 0.6]]), full([[1, 0, 1]])
    adv, _ = A.compute_gae_advantage_return(token_level_rewards=r, values=v, response_mask=m, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, full([[1 / math.sqrt(2), 0, -1 / math.sqrt(2)]]), rtol=1e-5, atol=1e-5)


def test_reinforce_pp_golden_returns():
    # gamma = 0.5, r = [0, 0, 1]: G = [0.25, 0.5, 1]
    # with an environment token at t=1 (mask [1, 0, 1]) the hole is not discounted: G = [0.5, 0, 1]
    r = full([[0, 0, 1], [0, 0, 1]])
    m = full([[1, 1, 1], [1, 0, 1]])
    adv, ret = A.compute_reinforce_plus_plus_outcome_advantage(token_level_rewards=r, response_mask=m, gamma=0.5)
    torch.testing.assert_close(ret, full([[0.25, 0.5, 1.0], [0.5, 0.0, 1.0]]))
    # valid returns [0.25, 0.5, 1, 0.5, 1]: mean 0.65, unbiased var = (0.16+0.0225+0.1225*2+0.0225)/4
    vals = [0.25, 0.5, 1.0, 0.5, 1.0]
    mu = 0.65
    var = sum((x - mu) ** 2 for x in vals) / 4
    assert abs(var - 0.1125) < 1e-12  # 0.45 / 4
    exp = [(x - mu) / math.sqrt(var + 1e-8) for x in vals]
    torch.testing.assert_close(adv[m.bool()], torch.tensor(exp), rtol=1e-5, atol=1e-5)
    assert adv[1, 1] == 0.0


def test_reinforce_pp_baseline_golden():
    # one group R = [1, 0] (one token each): centred [0.5, -0.5]; whitening two values: +-1/sqrt 2
    r, m = full([[1.0], [0.0]]), full([[1.0], [1.0]])
    adv, ret = A.compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_level_rewards=r, response_mask=m, index=torch.tensor([0, 0])
    )
    torch.testing.assert_close(adv, full([[1 / math.sqrt(2)], [-1 / math.sqrt(2)]]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, adv)


def test_remax_golden():
    # r = [0, 1, 2], greedy baseline 1: return-to-go [3, 3, 2], A = [2, 2, 1]
    # second row: length 2 (mask [1,1,0]), r = [1, 1, 5] (the 5 sits on padding and is ignored),
    # baseline 0.5: G = [2, 1, 0], A = [1.5, 0.5, 0]
    r = full([[0, 1, 2], [1, 1, 5]])
    m = full([[1, 1, 1], [1, 1, 0]])
    adv, ret = A.compute_remax_outcome_advantage(
        token_level_rewards=r, response_mask=m, reward_baselines=torch.tensor([1.0, 0.5])
    )
    torch.testing.assert_close(ret, full([[3, 3, 2], [2, 1, 0]]))
    torch.testing.assert_close(adv, full([[2, 2, 1], [1.5, 0.5, 0]]))


def test_grpo_passk_golden():
    # group R = [1, 3, 2, 0]: best is sample 1 (3), second best 2 -> gap 1; others get 0.
    #   with std: mean 1.5, squared deviations 0.25+2.25+0.25+2.25 = 5, var 5/3, std 1.290994
    #   A_best = 1 / (1.290994 + 1e-6) = 0.774596
    # group R = [4, 4]: tie -> the earlier sample is "best", gap 4-4 = 0 -> all zero
    r, m = outcome([1, 3, 2, 0, 4, 4])
    idx = torch.tensor([0, 0, 0, 0, 1, 1])
    kw = dict(token_level_rewards=r, response_mask=m, index=idx)
    adv, _ = A.compute_grpo_passk_outcome_advantage(**kw, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, 1.0, 0, 0, 0, 0]))
    adv, _ = A.compute_grpo_passk_outcome_advantage(**kw, norm_adv_by_std_in_grpo=True)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, 1 / (math.sqrt(5 / 3) + EPS), 0, 0, 0, 0]))
    assert abs(1 / math.sqrt(5 / 3) - 0.774597) < 1e-6


def test_grpo_passk_needs_two_per_group():
    r, m = outcome([1, 3, 2])
    with pytest.raises(ValueError, match="at least 2 responses per group"):
        A.compute_grpo_passk_outcome_advantage(token_level_rewards=r, response_mask=m, index=torch.tensor([0, 0, 1]))


# ------------------------------------------------------------------------------------------------
# float64 per-sample references
# ------------------------------------------------------------------------------------------------


def _valid_positions(mask_row):
    return [t for t, x in enumerate(mask_row) if x]


def _whiten_list(vals):
    n = len(vals)
    mu = sum(vals) / n
    var = sum((x - mu) ** 2 for x in vals) / n
    var = var * n / max(n - 1, 1)
    return [(x - mu) / math.sqrt(var + 1e-8) for x in vals]


def _scatter_whiten(per_token, mask):
    """per_token: dict (b, t) -> value over valid tokens; whiten over all of them."""
    keys = sorted(per_token)
    w = _whiten_list([per_token[k] for k in keys])
    return dict(zip(keys, w))


def _to_tensor(d, B, T):
    out = torch.zeros(B, T, dtype=torch.float64)
    for (b, t), x in d.items():
        out[b, t] = x
    return out


def ref_gae(r, v, m, gamma, lam):
    B, T = r.shape
    raw, ret = {}, {}
    for b in range(B):
        pos = _valid_positions(m[b].tolist())
        a_next, v_next = 0.0, 0.0
        for t in reversed(pos):
            delta = float(r[b, t]) + gamma * v_next - float(v[b, t])
            a_next = delta + gamma * lam * a_next
            v_next = float(v[b, t])
            raw[(b, t)] = a_next
            ret[(b, t)] = a_next + float(v[b, t])
    return _to_tensor(_scatter_whiten(raw, m), B, T), _to_tensor(ret, B, T)


def ref_return_to_go(r, m, gamma):
    B, T = r.shape
    ret = {}
    for b in range(B):
        g = 0.0
        for t in reversed(_valid_positions(m[b].tolist())):
            g = float(r[b, t]) + gamma * g
            ret[(b, t)] = g
    return ret


def ref_reinforce_pp(r, m, gamma):
    B, T = r.shape
    ret = ref_return_to_go(r, m, gamma)
    return _to_tensor(_scatter_whiten(ret, m), B, T), _to_tensor(ret, B, T)


def ref_remax(r, m, baselines):
    B, T = r.shape
    ret = ref_return_to_go(r, m, 1.0)
    adv = {k: x - float(baselines[k[0]]) for k, x in ret.items()}
    return _to_tensor(adv, B, T), _to_tensor(ret, B, T)


def _scores_and_groups(r, m, index):
    scores = [sum(float(r[b, t]) for t in _valid_positions(m[b].tolist())) for b in range(r.shape[0])]
    groups = defaultdict(list)
    for b, g in enumerate(index):
        groups[g].append(b)
    return scores, groups


def _broadcast_ref(per_sample, m):
    B, T = m.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in _valid_positions(m[b].tolist()):
            out[b, t] = per_sample[b]
    return out


def ref_grpo(r, m, index, norm):
    scores, groups = _scores_and_groups(r, m, index)
    adv = [0.0] * len(scores)
    for members in groups.values():
        vals = [scores[b] for b in members]
        mu, sd = (0.0, 1.0) if len(vals) == 1 else (statistics.mean(vals), statistics.stdev(vals))
        for b in members:
            adv[b] = (scores[b] - mu) / (sd + EPS) if norm else scores[b] - mu
    return _broadcast_ref(adv, m)


def ref_rloo(r, m, index):
    scores, groups = _scores_and_groups(r, m, index)
    adv = [0.0] * len(scores)
    for members in groups.values():
        for b in members:
            others = [scores[j] for j in members if j != b]
            adv[b] = scores[b] - (sum(others) / len(others) if others else 0.0)
    return _broadcast_ref(adv, m)


def ref_rpp_baseline(r, m, index):
    scores, groups = _scores_and_groups(r, m, index)
    centred = [0.0] * len(scores)
    for members in groups.values():
        mu = statistics.mean(scores[b] for b in members) if len(members) > 1 else 0.0
        for b in members:
            centred[b] = scores[b] - mu
    per_token = {(b, t): centred[b] for b in range(m.shape[0]) for t in _valid_positions(m[b].tolist())}
    return _to_tensor(_scatter_whiten(per_token, m), *m.shape)


def ref_passk(r, m, index, norm):
    scores, groups = _scores_and_groups(r, m, index)
    adv = [0.0] * len(scores)
    for members in groups.values():
        order = sorted(members, key=lambda b: (-scores[b], b))  # best first, earliest on ties
        gap = scores[order[0]] - scores[order[1]]
        if norm:
            gap /= statistics.stdev([scores[b] for b in members]) + EPS
        adv[order[0]] = gap
    return _broadcast_ref(adv, m)


def groups_of_three(B, seed):
    """Group ids with every group of size 3, shuffled over the batch (pass@k needs >= 2 per group)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.arange(B) // 3)[torch.randperm(B, generator=g)] * 7 + 1


def random_batch(seed, B=24, T=12, n_groups=7, holes=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = 0  # one empty response: must get zero everywhere and not poison statistics
    m = (torch.arange(T)[None, :] < lengths[:, None]).to(dtype)  # [B, T] right-padded, ragged
    if holes:
        env = torch.rand(B, T, generator=g) < 0.25  # environment tokens inside the response
        m = m * (~env).to(dtype)
    r = torch.randn(B, T, generator=g, dtype=dtype)  # dense rewards, also on padding (must be ignored)
    v = torch.randn(B, T, generator=g, dtype=dtype)
    index = torch.randint(0, n_groups, (B,), generator=g) * 10 + 3  # sparse, non-dense ids
    index[-1] = 999  # a singleton group
    base = torch.randn(B, generator=g, dtype=dtype)
    return r, v, m, index, base


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_reference(seed, holes):
    r, v, m, _, _ = random_batch(seed, holes=holes, dtype=torch.float64)
    adv, ret = A.compute_gae_advantage_return(token_level_rewards=r, values=v, response_mask=m, gamma=0.95, lam=0.9)
    ref_adv, ref_ret = ref_gae(r, v, m, 0.95, 0.9)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_reference(seed, holes, gamma):
    r, _, m, _, _ = random_batch(seed, holes=holes, dtype=torch.float64)
    adv, ret = A.compute_reinforce_plus_plus_outcome_advantage(token_level_rewards=r, response_mask=m, gamma=gamma)
    ref_adv, ref_ret = ref_reinforce_pp(r, m, gamma)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("holes", [False, True])
def test_remax_matches_reference(seed, holes):
    r, _, m, _, base = random_batch(seed, holes=holes, dtype=torch.float64)
    adv, ret = A.compute_remax_outcome_advantage(token_level_rewards=r, response_mask=m, reward_baselines=base)
    ref_adv, ref_ret = ref_remax(r, m, base)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-10, atol=1e-10)


OUTCOME_REFS = {
    "grpo": lambda r, m, i: ref_grpo(r, m, i, True),
    "dr_grpo": lambda r, m, i: ref_grpo(r, m, i, False),
    "rloo": ref_rloo,
    "reinforce_plus_plus_baseline": ref_rpp_baseline,
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", sorted(OUTCOME_REFS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_group_estimators_match_reference(seed, name, dtype):
    r, _, m, index, _ = random_batch(seed, holes=seed % 2 == 1, dtype=dtype)
    adv, ret = ADV_ESTIMATORS[name](token_level_rewards=r, response_mask=m, index=index)
    assert adv.dtype == dtype
    ref = OUTCOME_REFS[name](r.double(), m.double(), index.tolist())
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(adv.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(ret, adv)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("norm", [True, False])
def test_passk_matches_reference(seed, norm):
    r, _, m, index, _ = random_batch(seed, dtype=torch.float64)
    index = groups_of_three(r.shape[0], seed)
    # make ties for the best likely in some groups: round the rewards
    r = torch.round(r)
    adv, _ = A.compute_grpo_passk_outcome_advantage(
        token_level_rewards=r, response_mask=m, index=index, norm_adv_by_std_in_grpo=norm
    )
    torch.testing.assert_close(adv, ref_passk(r, m, index.tolist(), norm), rtol=1e-9, atol=1e-9)


def test_string_and_numpy_index_equal_tensor_index():
    r, _, m, index, _ = random_batch(0, dtype=torch.float64)
    uids = [f"uid-{int(i)}" for i in index]  # verl passes string uids in a numpy object array
    for name in ["grpo", "rloo", "dr_grpo", "reinforce_plus_plus_baseline"]:
        fn = ADV_ESTIMATORS[name]
        a_t, _ = fn(token_level_rewards=r, response_mask=m, index=index)
        a_s, _ = fn(token_level_rewards=r, response_mask=m, index=np.array(uids, dtype=object))
        a_l, _ = fn(token_level_rewards=r, response_mask=m, index=uids)
        a_n, _ = fn(token_level_rewards=r, response_mask=m, index=index.numpy())
        for other in (a_s, a_l, a_n):
            torch.testing.assert_close(other, a_t)


# every estimator, called with the SAME keyword set (as the controller does)
@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_uniform_kwargs_and_zero_outside_mask(name):
    r, v, m, index, base = random_batch(1, holes=True)
    index = groups_of_three(r.shape[0], 1)  # grpo_passk needs no singletons
    kw = dict(
        token_level_rewards=r,
        response_mask=m,
        index=index,
        values=v,
        gamma=0.99,
        lam=0.95,
        norm_adv_by_std_in_grpo=True,
        reward_baselines=base,
        epsilon=1e-6,
        some_future_key="ignored",
        # the optimal token baselines' inputs (log pi of the sampled token, sum_v pi(v)^2)
        old_log_probs=-torch.rand_like(r) * 2,
        sum_pi_squared=torch.rand_like(r) * 0.5,
    )
    adv, ret = get_adv_estimator(name)(**kw)
    assert adv.shape == ret.shape == r.shape
    assert adv.dtype == ret.dtype == r.dtype
    outside = ~m.bool()
    assert torch.all(adv[outside] == 0) and torch.all(ret[outside] == 0)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert adv[m.bool()].abs().sum() > 0  # something non-trivial was computed on the valid tokens


def test_missing_inputs_raise_clear_errors():
    r, m = outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="needs `values`"):
        A.compute_gae_advantage_return(token_level_rewards=r, response_mask=m, values=None)
    with pytest.raises(ValueError, match="reward_baselines"):
        A.compute_remax_outcome_advantage(token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="index"):
        A.compute_grpo_outcome_advantage(token_level_rewards=r, response_mask=m, index=None)


def test_no_grad_flows():
    r, m = outcome([1.0, 0.0])
    r.requires_grad_(True)
    adv, _ = A.compute_grpo_outcome_advantage(token_level_rewards=r, response_mask=m, index=torch.tensor([0, 0]))
    assert not adv.requires_grad


# ------------------------------------------------------------------------------------------------
# dispatch and metrics
# ------------------------------------------------------------------------------------------------


def test_unknown_name_suggests_closest():
    with pytest.raises(ValueError, match=r"Did you mean 'grpo'\?"):
        get_adv_estimator("grop")
    with pytest.raises(ValueError, match="pkg.module:function"):
        get_adv_estimator("no_such_estimator_xyz")


def test_plugin_path(tmp_path, monkeypatch):
    # a user's estimator in their own module, loaded by "module:function"
    (tmp_path / "my_adv_plugin.py").write_text(
        textwrap.dedent(
            """
            import torch
            def constant_adv(*, token_level_rewards, response_mask, **kwargs):
                out = 2.0 * response_mask.to(token_level_rewards.dtype)
                return out, out
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    r, m = outcome([1.0, 0.0])
    m[1, 2] = 0
    adv, ret, metrics = compute_advantage("my_adv_plugin:constant_adv", token_level_rewards=r, response_mask=m, index=[0, 0])
    torch.testing.assert_close(adv, 2.0 * m)
    assert float(metrics["critic/advantages/mean"]) == 2.0
    assert get_adv_estimator("trainer.algos.advantages:compute_rloo_outcome_advantage") is A.compute_rloo_outcome_advantage
    with pytest.raises(ValueError, match="has no function"):
        get_adv_estimator("trainer.algos.advantages:nope")
    with pytest.raises(ValueError, match="cannot import"):
        get_adv_estimator("no_such_pkg_xyz.mod:fn")
    sys.modules.pop("my_adv_plugin", None)


def test_compute_advantage_metrics():
    # R = [1, 0] in one group (3 tokens each), second row masked to 2 tokens:
    # A = [+0.7071, -0.7071] per sequence (mean 0.5, std 0.7071); valid tokens: 3 positive, 2 negative
    # mean over tokens = (3 - 2) * 0.707106 / 5 = 0.141421
    r, m = outcome([1.0, 0.0])
    m[1, 2] = 0
    adv, ret, metrics = compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=torch.tensor([4, 4]))
    a = 0.5 / (math.sqrt(0.5) + EPS)
    assert all(isinstance(x, torch.Tensor) and x.dim() == 0 and not x.requires_grad for x in metrics.values())
    assert abs(float(metrics["critic/advantages/mean"]) - a / 5) < 1e-6
    assert abs(float(metrics["critic/advantages/max"]) - a) < 1e-6
    assert abs(float(metrics["critic/advantages/min"]) + a) < 1e-6
    assert abs(float(metrics["critic/returns/mean"]) - a / 5) < 1e-6
    # an empty mask gives zeros, not NaN / inf
    _, _, em = compute_advantage("grpo", token_level_rewards=r, response_mask=torch.zeros_like(m), index=[0, 0])
    assert all(float(x) == 0.0 for x in em.values())


# ------------------------------------------------------------------------------------------------
# hypothesis properties
# ------------------------------------------------------------------------------------------------

group_sizes = st.lists(st.integers(1, 6), min_size=1, max_size=6)


def _build(sizes, draw_scores):
    idx = torch.tensor([g for g, n in enumerate(sizes) for _ in range(n)])
    scores = torch.tensor(draw_scores, dtype=torch.float64)
    r = torch.zeros(len(scores), 4, dtype=torch.float64)
    r[:, -1] = scores
    return r, torch.ones_like(r), idx


@settings(max_examples=60, deadline=None)
@given(sizes=group_sizes, const=st.floats(-5, 5, allow_nan=False), data=st.data())
def test_constant_groups_get_zero_advantage(sizes, const, data):
    sizes = [max(n, 2) for n in sizes]  # a group of one is not "constant": it keeps R
    r, m, idx = _build(sizes, [const] * sum(sizes))
    for name in ["grpo", "dr_grpo", "rloo"]:
        adv, _ = ADV_ESTIMATORS[name](token_level_rewards=r, response_mask=m, index=idx)
        assert adv.abs().max() < 1e-9, name


@settings(max_examples=60, deadline=None)
@given(sizes=group_sizes, data=st.data())
def test_grpo_and_rloo_sum_to_zero_per_group(sizes, data):
    sizes = [max(n, 2) for n in sizes]
    scores = data.draw(st.lists(st.floats(-10, 10, allow_nan=False), min_size=sum(sizes), max_size=sum(sizes)))
    r, m, idx = _build(sizes, scores)
    for name in ["grpo", "dr_grpo", "rloo"]:
        adv, _ = ADV_ESTIMATORS[name](token_level_rewards=r, response_mask=m, index=idx)
        per_group = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, idx, adv[:, 0])
        assert per_group.abs().max() < 1e-7, name


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), perm_seed=st.integers(0, 10_000))
def test_permuting_samples_permutes_advantages(seed, perm_seed):
    r, v, m, index, base = random_batch(seed, B=12, T=6, n_groups=3, holes=True, dtype=torch.float64)
    index = groups_of_three(r.shape[0], seed)  # no singleton for pass@k
    perm = torch.randperm(r.shape[0], generator=torch.Generator().manual_seed(perm_seed))
    kw = dict(gamma=0.9, lam=0.8, norm_adv_by_std_in_grpo=True)
    g = torch.Generator().manual_seed(seed)
    lp_old = -torch.rand(r.shape, generator=g, dtype=r.dtype) * 2  # the optimal token baselines' inputs
    spp = torch.rand(r.shape, generator=g, dtype=r.dtype) * 0.5
    for name, fn in ADV_ESTIMATORS.items():
        a, ret = fn(token_level_rewards=r, response_mask=m, index=index, values=v, reward_baselines=base,
                    old_log_probs=lp_old, sum_pi_squared=spp, **kw)
        ap, retp = fn(
            token_level_rewards=r[perm], response_mask=m[perm], index=index[perm], values=v[perm],
            reward_baselines=base[perm], old_log_probs=lp_old[perm], sum_pi_squared=spp[perm], **kw,
        )
        torch.testing.assert_close(ap, a[perm], rtol=1e-9, atol=1e-9, msg=name)
        torch.testing.assert_close(retp, ret[perm], rtol=1e-9, atol=1e-9, msg=name)


@settings(max_examples=40, deadline=None)
@given(sizes=group_sizes, data=st.data())
def test_grpo_is_scale_invariant_and_dr_grpo_is_shift_invariant(sizes, data):
    sizes = [max(n, 2) for n in sizes]
    scores = data.draw(st.lists(st.floats(-10, 10, allow_nan=False), min_size=sum(sizes), max_size=sum(sizes)))
    shift = data.draw(st.floats(-100, 100, allow_nan=False))
    r, m, idx = _build(sizes, scores)
    a, _ = A.compute_dr_grpo_outcome_advantage(token_level_rewards=r, response_mask=m, index=idx)
    a2, _ = A.compute_dr_grpo_outcome_advantage(token_level_rewards=r + shift * (torch.arange(4) == 3), response_mask=m, index=idx)
    torch.testing.assert_close(a2, a, rtol=1e-7, atol=1e-7)
    # GRPO with eps=0: multiplying rewards by 3 leaves A unchanged where the group std is not 0
    g, _ = A.compute_grpo_outcome_advantage(token_level_rewards=r, response_mask=m, index=idx, epsilon=0.0)
    g3, _ = A.compute_grpo_outcome_advantage(token_level_rewards=3 * r, response_mask=m, index=idx, epsilon=0.0)
    # compare only groups whose spread is clearly non-zero (a zero std gives 0/0 = nan by design)
    spread = torch.tensor([statistics.stdev(scores[i] for i in range(len(scores)) if idx[i] == k) for k in idx.tolist()])
    ok = spread > 1e-3  # [B]
    torch.testing.assert_close(g3[ok], g[ok], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# the compiled passes (big inputs) against the eager ones and the float64 reference
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_grpo_matches_eager_and_reference(monkeypatch, holes, dtype):
    # COXSWAIN_COMPILE=1 sends a small batch through the compiled score sum and broadcast that big
    # batches take (one torch.compile each, a few seconds on a cold cache)
    from trainer.algos.utils import compile_broken

    r, _, m, index, _ = random_batch(5, B=40, T=33, holes=holes, dtype=dtype)
    m = m.bool()  # the compiled score sum takes the trainer's bool mask
    r[3, -1], r[7, -2] = math.inf, math.nan  # non-finite rewards on padding: ignored, as where() ignores them
    m[3, -1] = m[7, -2] = False
    ref = ref_grpo(r, m.to(dtype), index.tolist(), True)
    monkeypatch.setenv("COXSWAIN_COMPILE", "0")
    eager, _ = A.compute_grpo_outcome_advantage(token_level_rewards=r, response_mask=m, index=index)
    monkeypatch.setenv("COXSWAIN_COMPILE", "1")
    comp, _ = A.compute_grpo_outcome_advantage(token_level_rewards=r, response_mask=m, index=index)
    assert not compile_broken(), "torch.compile failed on this machine"
    assert comp.dtype == eager.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(comp.double(), ref, **tol)
    torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6)
    assert torch.equal(comp != 0, eager != 0)
    assert not torch.signbit(comp[~m]).any()  # padding is +0, as where() writes it (no -0 from a product)
    # scores: exact on the rows with a non-finite padding reward, float-sum-order close elsewhere
    monkeypatch.setenv("COXSWAIN_COMPILE", "0")
    s_e = A._sequence_scores(r, m)
    monkeypatch.setenv("COXSWAIN_COMPILE", "1")
    s_c = A._sequence_scores(r, m)
    assert torch.isfinite(s_c).all()
    torch.testing.assert_close(s_c, s_e, rtol=1e-6, atol=1e-6)


def test_compiled_score_sum_keeps_non_finite_valid_rewards(monkeypatch):
    # a non-finite reward on a VALID token stays in its row's score (inf / nan), as eagerly
    r = torch.randn(6, 10)
    m = torch.arange(10)[None, :] < torch.tensor([10, 4, 7, 0, 1, 9])[:, None]
    r[1, 2], r[2, 6], r[2, 8] = math.inf, math.nan, math.inf  # row 2: the inf is on padding
    monkeypatch.setenv("COXSWAIN_COMPILE", "0")
    s_e = A._sequence_scores(r, m)
    monkeypatch.setenv("COXSWAIN_COMPILE", "1")
    s_c = A._sequence_scores(r, m)
    assert s_c[1] == math.inf and math.isnan(s_c[2]) and s_c[3] == 0
    torch.testing.assert_close(s_c, s_e, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_float_mask_takes_the_eager_score_sum(monkeypatch):
    # a float mask is not known to be {0, 1} (the compiled sum multiplies by it): nonzero entries count
    # whole, exactly as eagerly; only bool masks go through the compiled sum
    r = torch.randn(5, 8, dtype=torch.float64)
    m = torch.tensor([[1.0] * 8, [0.5] * 4 + [0.0] * 4, [2.0] + [0.0] * 7, [0.0] * 8, [1.0, 0.0] * 4], dtype=torch.float64)
    monkeypatch.setenv("COXSWAIN_COMPILE", "1")
    s = A._sequence_scores(r, m)
    torch.testing.assert_close(s, torch.where(m != 0, r, 0.0).sum(-1), rtol=0, atol=1e-12)
    adv = A._broadcast(torch.arange(5.0), m, torch.float32)
    assert torch.equal(adv, torch.where(m != 0, torch.arange(5.0)[:, None], 0.0).float())
