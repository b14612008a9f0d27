"""Tests for trainer.algos.kl: estimators (golden numbers, exact expectations, gradients), KL in the
reward (golden + float64 loop reference), and the fixed / adaptive controllers."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trainer.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    kl_penalty,
    make_kl_controller,
)

# ------------------------------------------------------------------------------------------------
# estimators
# ------------------------------------------------------------------------------------------------


def test_estimators_golden():
    # p = 0.5, p_ref = 0.25: log r = log p - log p_ref = ln 2 = 0.693147
    #   k1 = 0.693147, abs = 0.693147, k2 = 0.5 * 0.480453 = 0.240227
    #   k3: q = p_ref / p = 0.5, q - log q - 1 = 0.5 + 0.693147 - 1 = 0.193147
    lp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    ln2 = math.log(2)
    expected = {
        "kl": ln2, "k1": ln2, "abs": ln2,
        "mse": 0.5 * ln2**2, "k2": 0.5 * ln2**2,
        "low_var_kl": 0.5 + ln2 - 1, "k3": 0.5 + ln2 - 1,
    }
    for name, val in expected.items():
        assert abs(float(kl_penalty(lp, ref, name)) - val) < 1e-12, name
    assert abs(0.5 * ln2**2 - 0.240227) < 1e-6 and abs(0.5 + ln2 - 1 - 0.193147) < 1e-6
    # reversed roles: log r = -ln 2: k1 = -0.693147 (k1 can be negative), abs = +0.693147,
    # k3: q = 2, 2 - ln 2 - 1 = 0.306853
    assert abs(float(kl_penalty(ref, lp, "k1")) + ln2) < 1e-12
    assert abs(float(kl_penalty(ref, lp, "abs")) - ln2) < 1e-12
    assert abs(float(kl_penalty(ref, lp, "k3")) - (1 - ln2)) < 1e-12


def test_k3_is_clamped_and_finite():
    # log q = ref - logp = -100 -> clamped to -20: k3 = e^-20 + 20 - 1 = 19.000000002 -> clamped to 10
    # log q = +100 -> clamped to 20: e^20 - 21 = 4.85e8 -> clamped to 10 (and never inf)
    lp = torch.tensor([0.0, -100.0, -1.0])
    ref = torch.tensor([-100.0, 0.0, -1.0])
    out = kl_penalty(lp, ref, "low_var_kl")
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0, 0.0]))


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 100_000), vocab=st.integers(2, 12), scale=st.floats(0.1, 3.0))
def test_k1_and_k3_are_unbiased_exact_expectation(seed, vocab, scale):
    # Enumerate the whole vocabulary: E_{x~p}[k(x)] must equal KL(p || p_ref) exactly for k1 and k3
    # (Schulman 2020), and k2 / k3 are non-negative per token.
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(scale * torch.randn(vocab, generator=g, dtype=torch.float64), -1)
    logq = torch.log_softmax(scale * torch.randn(vocab, generator=g, dtype=torch.float64), -1)
    p = logp.exp()
    lq = logq - logp
    assume(bool(((lq.exp() - lq - 1) < 10).all()))  # the stability clamp at 10 would (rightly) bias k3
    true_kl = float((p * (logp - logq)).sum())
    for name in ("k1", "low_var_kl"):
        est = float((p * kl_penalty(logp, logq, name)).sum())
        assert abs(est - true_kl) < 1e-9, name
    assert (kl_penalty(logp, logq, "k2") >= 0).all() and (kl_penalty(logp, logq, "k3") >= -1e-15).all()


def test_k2_gradient_and_straight_through_suffix():
    # d/dlogp of 0.5 (logp - ref)^2 is (logp - ref); "k3+" has the value of k3 and the gradient of k2
    lp = torch.tensor([-0.3, -2.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-0.5, -1.0, -1.0], dtype=torch.float64)
    for name in ("k3+", "low_var_kl+", "k1+", "abs+"):
        base = name[:-1]
        val = kl_penalty(lp, ref, name)
        torch.testing.assert_close(val.detach(), kl_penalty(lp.detach(), ref, base))
        (grad,) = torch.autograd.grad(val.sum(), lp)
        torch.testing.assert_close(grad, (lp - ref).detach())
    # without the suffix k3's own gradient is 1 - exp(ref - logp) (differs from k2's)
    (g3,) = torch.autograd.grad(kl_penalty(lp, ref, "k3").sum(), lp)
    torch.testing.assert_close(g3, 1 - torch.exp(ref - lp.detach()))


def test_unknown_estimator_and_plugin(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"Did you mean 'low_var_kl'\?"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "low_var_k")
    with pytest.raises(ValueError, match="unknown kl_penalty"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k9+")
    (tmp_path / "my_kl_plugin.py").write_text(
        textwrap.dedent(
            """
            def squared(logprob, ref_logprob):
                return (logprob - ref_logprob) ** 2
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = kl_penalty(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 1.0]), "my_kl_plugin:squared")
    torch.testing.assert_close(out, torch.tensor([1.0, 4.0]))
    sys.modules.pop("my_kl_plugin", None)


# ------------------------------------------------------------------------------------------------
# KL in the reward
# ------------------------------------------------------------------------------------------------


def test_apply_kl_in_reward_golden():
    # k1 kl = logp - ref = [[.1, .2, .3], [.4, .5, .6]], coef 0.5, second row has 2 valid tokens
    # rewards = scores - 0.5 * kl * mask = [[-.05, -.1, 1 - .15], [-.2, 1 - .25, 0 (masked: kept)]]
    # per-sequence token-mean kl: (.1+.2+.3)/3 = .2 and (.4+.5)/2 = .45 -> batch mean .325
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    ref = torch.zeros(2, 3, dtype=torch.float64)
    lp = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, metrics = apply_kl_in_reward(scores, lp, ref, mask, kl_coef=0.5, kl_penalty="kl")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 0.75, 0.0]], dtype=torch.float64))
    assert abs(float(metrics["actor/reward_kl_penalty"]) - 0.325) < 1e-6
    assert float(metrics["actor/reward_kl_penalty_coeff"]) == 0.5
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())


def _ref_kl(lp, rf, name):
    d = lp - rf
    if name in ("kl", "k1"):
        return d
    if name == "abs":
        return abs(d)
    if name in ("mse", "k2"):
        return 0.5 * d * d
    lq = min(max(rf - lp, -20.0), 20.0)
    return min(max(math.exp(lq) - lq - 1.0, -10.0), 10.0)


@pytest.mark.parametrize("name", ["kl", "abs", "mse", "low_var_kl", "k3+"])
@pytest.mark.parametrize("seed", range(3))
def test_apply_kl_in_reward_matches_loop_reference(name, seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 9, 11
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()  # [B, T] ragged, one may be empty
    scores = torch.randn(B, T, generator=g, dtype=torch.float64)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    rf = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    coef = 0.05
    rewards, metrics = apply_kl_in_reward(scores, lp, rf, mask, kl_coef=coef, kl_penalty=name)
    base = name.rstrip("+")
    ref_rewards = scores.clone()
    seq_kls = []
    for b in range(B):
        n = int(lengths[b])
        kls = [_ref_kl(float(lp[b, t]), float(rf[b, t]), base) for t in range(n)]
        for t in range(n):
            ref_rewards[b, t] = float(scores[b, t]) - coef * kls[t]
        seq_kls.append(sum(kls) / n if n else 0.0)
    torch.testing.assert_close(rewards, ref_rewards, rtol=1e-12, atol=1e-12)
    assert abs(float(metrics["actor/reward_kl_penalty"]) - sum(seq_kls) / B) < 1e-6
    assert not rewards.requires_grad


# ------------------------------------------------------------------------------------------------
# controllers
# ------------------------------------------------------------------------------------------------


def test_adaptive_controller_golden():
    # init 0.1, target 1.0, horizon 100
    # KL 1.5: error = clip(1.5/1 - 1, -0.2, 0.2) = 0.2 -> mult = 1 + 0.2 * 10/100 = 1.02 -> 0.102
    # KL 0.9: error = -0.1 -> mult = 1 - 0.1 * 10/100 = 0.99 -> 0.102 * 0.99 = 0.10098
    # KL 1.0: error 0 -> unchanged
    c = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    c.update(1.5, n_steps=10)
    assert abs(c.value - 0.102) < 1e-15
    c.update(torch.tensor(0.9, dtype=torch.float64), n_steps=10)  # a 0-dim tensor works too
    assert abs(c.value - 0.10098) < 1e-15
    c.update(1.0, n_steps=10)
    assert abs(c.value - 0.10098) < 1e-15


def test_fixed_controller_and_factory():
    c = make_kl_controller(type="fixed", kl_coef=0.02)
    assert isinstance(c, FixedKLController)
    c.update(123.0, n_steps=1000)
    assert c.value == 0.02
    a = make_kl_controller(type="adaptive", kl_coef=0.2, target_kl=6.0, horizon=10000)
    assert isinstance(a, AdaptiveKLController) and a.value == 0.2
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        make_kl_controller(type="pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller(type="adaptive", kl_coef=0.1, target_kl=None, horizon=100)
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller(type="adaptive", kl_coef=0.1, target_kl=1.0, horizon=0)


def test_controller_state_roundtrip():
    a = AdaptiveKLController(0.1, 1.0, 100)
    for kl in (2.0, 3.0, 0.1):
        a.update(kl, n_steps=8)
    b = AdaptiveKLController(0.1, 1.0, 100)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value
    a.update(1.7, 8)
    b.update(1.7, 8)
    assert b.value == a.value  # resumed controller continues identically
    f = FixedKLController(0.3)
    f2 = FixedKLController(0.0)
    f2.load_state_dict(f.state_dict())
    assert f2.value == 0.3
    with pytest.raises(ValueError, match="'adaptive' controller"):
        f2.load_state_dict(a.state_dict())


@settings(max_examples=100, deadline=None)
@given(
    init=st.floats(1e-4, 1.0),
    target=st.floats(1e-3, 10.0),
    kl=st.floats(0.0, 100.0),
    n=st.integers(1, 512),
    horizon=st.floats(1000.0, 1e5),
)
def test_adaptive_coef_moves_toward_target(init, target, kl, n, horizon):
    c = AdaptiveKLController(init, target, horizon)
    c.update(kl, n_steps=n)
    if kl > target * (1 + 1e-9):
        assert c.value > init  # too much KL -> stronger penalty
    elif kl < target * (1 - 1e-9):
        assert c.value < init  # too little -> weaker penalty
    # the clipped error bounds the step: |mult - 1| <= 0.2 n / horizon
    assert abs(c.value / init - 1) <= 0.2 * n / horizon + 1e-12


@pytest.mark.parametrize("name", ["kl", "abs", "mse", "low_var_kl", "k3+", "k2"])
def test_the_chunked_no_grad_path_equals_verl_and_the_autograd_path(name):
    """A whole-batch no-grad call (more than one row chunk, a ragged last chunk) takes the cache-sized
    row-chunk path: its values equal verl 0.9.1's ``kl_penalty`` and this function's own autograd path
    bit for bit."""
    from verl.trainer.ppo.core_algos import kl_penalty as verl_kl

    from trainer.algos.kl import _CHUNK_NUMEL

    g = torch.Generator().manual_seed(3)
    B, T = 3 * (_CHUNK_NUMEL // 1000) + 7, 1000  # > 3 chunks, the last one partial
    lp = -torch.rand(B, T, generator=g) * 4
    ref = lp + 0.3 * torch.randn(B, T, generator=g)
    ref[0, 0] = lp[0, 0] + 40.0  # past the clamps
    fast = kl_penalty(lp, ref, name)
    slow = kl_penalty(lp.clone().requires_grad_(), ref, name).detach()  # the plain (autograd) path
    assert torch.equal(fast, slow)
    assert torch.equal(fast, verl_kl(lp, ref, name))
