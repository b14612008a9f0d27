"""The policy losses of issue #20 part 1 (sapo, dro, dppo_tv, dppo_kl, cpgd): golden numbers worked by hand,
a float64 per-token reference (a Python loop, written from the definitions) on ragged masks with holes
for the loss and its gradient, and agreement with verl 0.9.1's own loss functions (value and gradient)
on the same random inputs. Tolerance against verl: 1e-6 absolute on float32 inputs (both sides run in
float32; measured differences are 0), 1e-12 against the float64 reference. Plus the config: each new key
reaches the loss through ``Plan.from_config``, bad values are refused."""

from __future__ import annotations

import math

import pytest
import torch

import verl.trainer.ppo.core_algos as V
from trainer.algos import losses as L
from trainer.algos.losses import LossAgg

F64 = torch.float64
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum", "seq-mean-token-sum-norm")


def _case(seed, dtype=F64, B=7, T=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None])
    mask &= ~((torch.rand(B, T, generator=g) < 0.2) & (torch.arange(T)[None] > 0))  # holes
    mask[:, 0] = True
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.01
    lp = (old + 0.4 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-4)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    adv[0, :3] = 0.0  # some zero advantages
    # garbage where the mask is 0: must reach neither the loss nor the gradient
    lp = torch.where(mask, lp, torch.full_like(lp, float("nan")))
    return old.to(dtype), lp.to(dtype), adv.to(dtype), mask.to(dtype)


def _agg_ref(per_tok, mask, mode, T):
    """float64 aggregation written per sequence."""
    rows = [[per_tok[i][t] for t in range(T) if mask[i, t]] for i in range(len(per_tok))]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "token-sum":
        return sum(sum(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) / T for r in rows) / len(rows)


def _ref_tok(name, old, lp, A, *, tau_pos=1.0, tau_neg=1.05, beta=0.3, dl=0.2, dh=0.28, c=3.0, drift=0.0):
    """Per-token loss as a function of one log-prob x (so that its derivative is the gradient)."""
    def f(x):
        d = max(min(x - old, 20.0), -20.0)
        r = math.exp(d)
        if name == "sapo":
            tau = tau_pos if A > 0 else tau_neg
            return -A * (1 / (1 + math.exp(-tau * (r - 1)))) * 4 / tau
        if name == "dro":
            return -(A * x - 0.5 * beta * d * d)
        if name in ("dppo_tv", "dppo_kl"):
            p, q = math.exp(lp), math.exp(old)  # the keep decision uses the values (no gradient)
            if name == "dppo_tv":
                keep = (p - q <= dh) if A > 0 else (p - q >= -dl)
            else:
                bkl = q * (old - lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
                keep = (bkl <= dh or p <= q) if A > 0 else (bkl <= dl or p >= q)
            w = min(math.exp(max(min(lp - old, 20.0), -20.0)), c)  # stop-gradient weight
            return -A * w * x * keep
        if name == "cpgd":
            hi, lo = math.log(1 + dh), math.log(1 - dl)
            dd = min(d, hi) if A > 0 else (max(d, lo) if A < 0 else d)
            return -A * dd
        raise ValueError(name)
    return f


def _ref(name, old, lp, adv, mask, mode, **kw):
    """(loss, d loss / d log_prob) in float64, by central differences of the per-token function."""
    B, T = mask.shape
    per, grad_tok = [], torch.zeros(B, T, dtype=F64)
    for i in range(B):
        row = []
        for t in range(T):
            if not mask[i, t]:
                row.append(0.0)
                continue
            f = _ref_tok(name, float(old[i, t]), float(lp[i, t]), float(adv[i, t]), **kw)
            x = float(lp[i, t])
            row.append(f(x))
            h = 1e-6
            grad_tok[i, t] = (f(x + h) - f(x - h)) / (2 * h)
        per.append(row)
    loss = _agg_ref(per, mask, mode, T)
    # the gradient of an aggregation is the aggregation's weight per token times the token's derivative
    wts = torch.zeros(B, T, dtype=F64)
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                e = [[0.0] * T for _ in range(B)]
                e[i][t] = 1.0
                wts[i, t] = _agg_ref(e, mask, mode, T)
    return loss, grad_tok * wts


def _ours(name, old, lp, adv, mask, mode, **kw):
    lp = lp.clone().requires_grad_()
    fn = L.get_policy_loss_fn(name)
    loss, metrics = fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, agg=LossAgg(mode=mode), **kw)
    loss.backward()
    return loss.detach(), lp.grad, metrics


# --------------------------------------------------------------------------------------------------
# golden numbers
# --------------------------------------------------------------------------------------------------


def _one(lp_minus_old, A, old=-1.0):
    old_t = torch.tensor([[old]], dtype=F64)
    return old_t, old_t + lp_minus_old, torch.tensor([[A]], dtype=F64), torch.ones(1, 1, dtype=F64)


def test_sapo_golden():
    # r = e^0.1 = 1.10517, A = 2 > 0 -> tau = tau_pos = 1: gate = sigmoid(0.10517) * 4 = 0.52627 * 4 = 2.10507
    # loss = -A * gate = -4.21015; d/dlogp = -A * r * 4 * s(1 - s) = -2 * 1.10517 * 4 * .52627 * .47373 = -2.20424
    old, lp, A, m = _one(0.1, 2.0)
    loss, grad, met = _ours("sapo", old, lp, A, m, "token-mean")
    s = 1 / (1 + math.exp(-(math.exp(0.1) - 1)))
    assert abs(float(loss) - (-2.0 * s * 4)) < 1e-12 and abs(float(loss) + 4.21015) < 1e-5
    assert abs(float(grad) - (-2.0 * math.exp(0.1) * 4 * s * (1 - s))) < 1e-12 and abs(float(grad) + 2.20424) < 1e-5
    # A = -1 -> tau_neg = 1.05: gate = sigmoid(1.05 * .10517) * 4 / 1.05 = .52758 * 3.80952 = 2.00983 = loss
    old, lp, A, m = _one(0.1, -1.0)
    loss, _, _ = _ours("sapo", old, lp, A, m, "token-mean")
    assert abs(float(loss) - 1 / (1 + math.exp(-1.05 * (math.exp(0.1) - 1))) * 4 / 1.05) < 1e-12
    assert abs(float(loss) - 2.00983) < 1e-5


def test_sapo_is_always_seq_mean_token_mean():
    # two sequences: lengths 1 and 3, A = 1 everywhere, r = 1 -> token loss = -sigmoid(0) * 4 = -2 on every token;
    # seq-mean-token-mean = -2; and so whatever mode is configured (token-sum would give -8)
    old = torch.zeros(2, 3, dtype=F64) - 1
    m = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=F64)
    for mode in MODES:
        loss, _, _ = _ours("sapo", old, old.clone(), torch.ones(2, 3, dtype=F64), m, mode)
        assert abs(float(loss) + 2.0) < 1e-12, mode


def test_dro_golden():
    # logp = -0.7, old = -1.0: Delta = 0.3, A = 2, beta = 0.5: loss = -(2 * -0.7 - .5 * .5 * .09) = 1.4225
    # d/dlogp = -(A - beta * Delta) = -(2 - .15) = -1.85
    old, lp, A, m = _one(0.3, 2.0)
    loss, grad, _ = _ours("dro", old, lp, A, m, "token-mean", dro_beta=0.5)
    assert abs(float(loss) - 1.4225) < 1e-12 and abs(float(grad) + 1.85) < 1e-12
    with pytest.raises(ValueError, match="dro_beta"):
        _ours("dro", old, lp, A, m, "token-mean")


def test_dppo_golden():
    # q = e^-1 = .36788; logp = -0.5 -> p = .60653: p - q = .23865; A = 1 > 0
    # TV with delta_h = 0.2: .23865 > .2 -> dropped (loss 0, pg_clipfrac 1); with delta_h = .3 kept:
    #   loss = -A * min(r, c) * logp = -1 * e^.5 * -.5 = .82436 (r = 1.64872 < c = 3); grad = -A * r = -1.64872
    old, lp, A, m = _one(0.5, 1.0)
    loss, grad, met = _ours("dppo_tv", old, lp, A, m, "token-mean", clip_ratio=0.2)
    assert float(loss) == 0.0 and float(grad) == 0.0 and float(met["pg_clipfrac"]) == 1.0
    loss, grad, met = _ours("dppo_tv", old, lp, A, m, "token-mean", clip_ratio=0.3)
    assert abs(float(loss) - 0.5 * math.exp(0.5)) < 1e-12 and abs(float(grad) + math.exp(0.5)) < 1e-12
    assert float(met["pg_clipfrac"]) == 0.0
    # truncation: c = 1.5 < r -> weight 1.5: loss = .75, grad = -1.5, and it counts in pg_clipfrac_lower
    loss, grad, met = _ours("dppo_tv", old, lp, A, m, "token-mean", clip_ratio=0.3, clip_ratio_c=1.5)
    assert abs(float(loss) - 0.75) < 1e-12 and abs(float(grad) + 1.5) < 1e-12 and float(met["pg_clipfrac_lower"]) == 1.0
    # KL: binary KL(q || p) = q ln(q/p) + (1-q) ln((1-q)/(1-p)) = .36788 * -.5 + .63212 * ln(.63212/.39347)
    #   = -.18394 + .29967 = .11573 -> kept at delta_h = .2, dropped at delta_h = .1
    bkl = math.exp(-1) * -0.5 + (1 - math.exp(-1)) * math.log((1 - math.exp(-1) + 1e-8) / (1 - math.exp(-0.5) + 1e-8))
    assert abs(bkl - 0.11573) < 1e-5
    assert float(_ours("dppo_kl", old, lp, A, m, "token-mean", clip_ratio=0.2)[0]) != 0.0
    assert float(_ours("dppo_kl", old, lp, A, m, "token-mean", clip_ratio=0.1)[0]) == 0.0
    # a fall of the probability with A > 0 is always kept under KL (p <= q), never under TV's upper test? it is
    # kept under TV too (p - q < 0 <= delta_h); with A < 0 a large fall is dropped by TV: p - q = -.23865 < -.2
    old2, lp2, A2, m2 = _one(-0.5, -1.0, old=-0.5)  # q = .60653, p = .36788
    assert float(_ours("dppo_tv", old2, lp2, A2, m2, "token-mean", clip_ratio=0.2)[0]) == 0.0
    assert float(_ours("dppo_tv", old2, lp2, A2, m2, "token-mean", clip_ratio=0.3)[0]) != 0.0


def test_cpgd_golden():
    # A = 1, Delta = 0.5 > ln(1.2) = .18232: clipped -> loss = -.18232, no gradient
    old, lp, A, m = _one(0.5, 1.0)
    loss, grad, met = _ours("cpgd", old, lp, A, m, "token-mean", clip_ratio=0.2)
    assert abs(float(loss) + math.log(1.2)) < 1e-12 and float(grad) == 0.0 and float(met["pg_clipfrac"]) == 1.0
    # A = 1, Delta = -0.5 (below ln(.8), but A > 0 is only capped above): loss = .5, grad = -1
    old, lp, A, m = _one(-0.5, 1.0)
    loss, grad, _ = _ours("cpgd", old, lp, A, m, "token-mean", clip_ratio=0.2)
    assert abs(float(loss) - 0.5) < 1e-12 and abs(float(grad) + 1.0) < 1e-12
    # A = -2, Delta = -0.5 < ln(.8) = -.22314: clipped -> loss = -2 * .22314... = -(-2)(-.22314) = -.44629, grad 0
    old, lp, A, m = _one(-0.5, -2.0)
    loss, grad, _ = _ours("cpgd", old, lp, A, m, "token-mean", clip_ratio=0.2)
    assert abs(float(loss) - 2 * math.log(0.8)) < 1e-12 and float(grad) == 0.0
    # drift: Delta = 0.5, r = 1.64872: KL_k3 = r - 1 - Delta = .14872; gradient min(r - 1, 2) = .64872
    # with A = 0 (no policy term) and coefficient 0.1: loss = .014872, grad = .064872
    old, lp, A, m = _one(0.5, 0.0)
    loss, grad, met = _ours("cpgd", old, lp, A, m, "token-mean", policy_drift_coeff=0.1)
    assert abs(float(loss) - 0.1 * (math.exp(0.5) - 1.5)) < 1e-12 and abs(float(grad) - 0.1 * (math.exp(0.5) - 1)) < 1e-12
    assert abs(float(met["policy_drift_kl"]) - (math.exp(0.5) - 1.5)) < 1e-12
    # r = e^1.5 = 4.48: the gradient weight is capped at 2
    old, lp, A, m = _one(1.5, 0.0)
    _, grad, _ = _ours("cpgd", old, lp, A, m, "token-mean", policy_drift_coeff=1.0)
    assert abs(float(grad) - 2.0) < 1e-12


# --------------------------------------------------------------------------------------------------
# float64 reference on ragged masks with holes (loss and gradient)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["sapo", "dro", "dppo_tv", "dppo_kl", "cpgd"])
def test_reference_ragged(name, mode, seed):
    old, lp, adv, mask = _case(seed)
    kw = dict(tau_pos=1.3, tau_neg=1.7, dro_beta=0.3, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
              clip_ratio_c=2.0)
    loss, grad, metrics = _ours(name, old, lp, adv, mask, mode, **kw)
    ref_mode = "seq-mean-token-mean" if name == "sapo" else mode
    want, want_grad = _ref(name, old, lp, adv, mask.bool(), ref_mode, tau_pos=1.3, tau_neg=1.7, beta=0.3, dl=0.2,
                           dh=0.28, c=2.0)
    assert abs(float(loss) - want) < 1e-12 * max(1.0, abs(want))
    torch.testing.assert_close(grad, want_grad, atol=1e-7, rtol=1e-6)  # central differences: ~1e-9
    assert torch.isfinite(grad).all() and all(torch.isfinite(v).all() for v in metrics.values())
    # rollout IS weights multiply every token's loss before aggregation
    w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.5
    lw, _, _ = _ours(name, old, lp, adv, mask, mode, rollout_is_weights=w, **kw)
    if name not in ("cpgd",):
        assert abs(float(lw) - float(loss)) > 1e-6


# --------------------------------------------------------------------------------------------------
# agreement with verl 0.9.1
# --------------------------------------------------------------------------------------------------


def _verl_cfg(**kw):
    from verl.workers.config import ActorConfig, PolicyLossConfig

    pl = PolicyLossConfig(dro_beta=kw.pop("dro_beta", None))
    return ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, ppo_mini_batch_size=1,
                       policy_loss=pl, **kw)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"])
@pytest.mark.parametrize("name", ["sapo", "dro", "dppo_tv", "dppo_kl"])
def test_agrees_with_verl(name, mode, seed):
    old, lp, adv, mask = _case(seed, dtype=torch.float32)
    lp = torch.where(mask.bool(), lp, old)  # verl multiplies by the mask: no NaN in its padding
    hp = dict(tau_pos=1.3, tau_neg=1.7, clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=2.5)
    cfg = _verl_cfg(dro_beta=0.3, **hp)
    v_lp = lp.clone().requires_grad_()
    fn = {"sapo": V.compute_policy_loss_sapo, "dro": V.compute_policy_loss_dro, "dppo_tv": V.compute_policy_loss_dppo_tv,
          "dppo_kl": V.compute_policy_loss_dppo_kl}[name]
    v_loss, v_metrics = fn(old, v_lp, adv, mask, loss_agg_mode=mode, config=cfg)
    v_loss.backward()
    loss, grad, metrics = _ours(name, old, lp, adv, mask, mode, dro_beta=0.3, **hp)
    v_loss = float(v_loss.detach())
    assert abs(float(loss) - v_loss) <= 1e-6 * max(1.0, abs(v_loss))
    torch.testing.assert_close(grad, v_lp.grad, atol=1e-6, rtol=1e-5)
    if name.startswith("dppo"):
        assert abs(float(metrics["pg_clipfrac"]) - v_metrics["actor/pg_clipfrac"]) < 1e-6
        assert abs(float(metrics["pg_clipfrac_lower"]) - v_metrics["actor/pg_clipfrac_lower"]) < 1e-6
    assert abs(float(metrics["ppo_kl"]) - v_metrics["actor/ppo_kl"]) < 1e-5


def test_cpgd_gradient_is_siirls():
    """siiRL's CPGD loss (``-A * clamp(logp, ...)``, drift ``clamp(r - 1, max=2) * logp``) is not importable; its
    formula, written out here in float64, must give the same gradient as ours (the values differ by design)."""
    old, lp, adv, mask = _case(3)
    lp = torch.where(mask.bool(), lp, old)
    eps_l, eps_h, coef = 0.2, 0.28, 0.05
    x = lp.clone().requires_grad_()
    clipped = torch.where(adv > 0, torch.clamp(x, max=math.log(1 + eps_h) + old), torch.clamp(x, min=math.log(1 - eps_l) + old))
    m = mask
    pg = (-clipped * adv * m).sum() / m.sum()
    drift = (((x.detach() - old).exp() - 1.0).clamp(max=2.0) * x * m).sum() / m.sum()
    (pg + coef * drift).backward()
    _, grad, _ = _ours("cpgd", old, lp, adv, mask, "token-mean", clip_ratio_low=eps_l, clip_ratio_high=eps_h,
                       policy_drift_coeff=coef)
    torch.testing.assert_close(grad, x.grad, atol=1e-12, rtol=0)
    assert float(x.grad.abs().max()) > 0


# --------------------------------------------------------------------------------------------------
# config: the keys reach the loss; bad values are refused
# --------------------------------------------------------------------------------------------------


def _cfg(*ov):
    from trainer.config import load_config

    return load_config(["--config", "recipes/cpu/tiny_grpo.yaml", "--config", "recipes/cpu/fp32.yaml", *ov])


def _plan(*ov):
    from trainer.plan import Plan

    return Plan.from_config(_cfg(*ov), total_steps=1)


def _call_like_the_worker(plan):
    """The loss call of trainer/workers/megatron_worker.update_actor, with the plan's settings."""
    pl = plan.actor_update.policy
    old, lp, adv, mask = _case(0)
    lp = torch.where(mask.bool(), lp, old)
    fn = L.get_policy_loss_fn(pl.loss_mode)
    return fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
              agg=pl.agg(global_num_tokens=float(mask.sum()), global_num_seqs=float(mask.any(-1).sum()), dp_size=1),
              rollout_is_weights=None, clip_ratio=pl.clip_ratio, clip_ratio_low=pl.clip_ratio_low,
              clip_ratio_high=pl.clip_ratio_high, clip_ratio_c=pl.clip_ratio_c, **pl.variant_kwargs)[0]


def test_config_keys_reach_the_loss():
    base = _call_like_the_worker(_plan("actor_rollout_ref.actor.policy_loss.loss_mode=sapo"))
    hot = _call_like_the_worker(_plan("actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
                                      "actor_rollout_ref.actor.tau_pos=3.0", "actor_rollout_ref.actor.tau_neg=4.0"))
    assert abs(float(base) - float(hot)) > 1e-4
    d1 = _call_like_the_worker(_plan("actor_rollout_ref.actor.policy_loss.loss_mode=dro",
                                     "actor_rollout_ref.actor.policy_loss.dro_beta=0.1"))
    d2 = _call_like_the_worker(_plan("actor_rollout_ref.actor.policy_loss.loss_mode=dro",
                                     "actor_rollout_ref.actor.policy_loss.dro_beta=5.0"))
    assert float(d2) > float(d1)
    for name in ("dppo_tv", "dppo_kl"):
        a = _call_like_the_worker(_plan(f"actor_rollout_ref.actor.policy_loss.loss_mode={name}"))
        b = _call_like_the_worker(_plan(f"actor_rollout_ref.actor.policy_loss.loss_mode={name}",
                                        "actor_rollout_ref.actor.clip_ratio_low=0.01", "actor_rollout_ref.actor.clip_ratio_high=0.01"))
        assert abs(float(a) - float(b)) > 1e-6, name
    c0 = _call_like_the_worker(_plan("actor_rollout_ref.actor.policy_loss.loss_mode=cpgd"))
    c1 = _call_like_the_worker(_plan("actor_rollout_ref.actor.policy_loss.loss_mode=cpgd",
                                     "actor_rollout_ref.actor.policy_drift_coeff=1.0"))
    assert float(c1) > float(c0)  # the drift KL estimate is >= 0
    # verl's "bypass_mode" loss name: accepted with the mode it names, which runs vanilla PPO around the sampler's log-probs
    p = _plan("actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode", "algorithm.rollout_correction.bypass_mode=true",
              "actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_is_threshold=null")
    assert p.actor_update.policy.loss_mode == "vanilla" and p.bypass == "ppo_clip"


@pytest.mark.parametrize("overrides,message", [
    (["actor_rollout_ref.actor.policy_loss.loss_mode=dro"], "dro_beta > 0"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=dro", "actor_rollout_ref.actor.policy_loss.dro_beta=-1"], r"dro_beta=-1.0 is out of range: allowed \(0, inf\)"),
    (["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"], "read by loss_mode=dro only"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_neg=0"], r"tau_neg=0.0 is out of range: allowed \(0, inf\)"),
    (["actor_rollout_ref.actor.tau_pos=2.0"], "read by loss_mode=sapo only"),
    (["actor_rollout_ref.actor.policy_drift_coeff=0.01"], "set actor_rollout_ref.actor.policy_loss.loss_mode=cpgd"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=cpgd", "actor_rollout_ref.actor.policy_drift_coeff=-1"], r"policy_drift_coeff=-1.0 is out of range: allowed \[0, inf\)"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=cpgd", "actor_rollout_ref.actor.clip_ratio_low=1.0"], "must be < 1"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"], "rollout_correction.bypass_mode=true"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=sapoo"], "Did you mean 'sapo'"),
])
def test_bad_loss_settings_refused(overrides, message):
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _cfg(*overrides)
