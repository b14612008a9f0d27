"""Tests for trainer.algos.rollout_is: golden numbers, a float64 per-sample (Python loop) reference
for every level x mode x veto combination and every metric, the exact-percentile machinery for large
inputs (sampled brackets, ties, fallback), the compiled path, and hypothesis properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.algos import rollout_is as R
from trainer.algos.rollout_is import compute_mismatch_metrics, compute_rejection_mask, compute_rollout_is_weights
from trainer.algos.utils import compile_broken

LN3 = math.log(3.0)

# ------------------------------------------------------------------------------------------------
# float64 per-sample reference (written from the definitions, one row at a time)
# ------------------------------------------------------------------------------------------------


def ref_rollout_is(old, roll, mask, level, mode, upper, lower, veto):
    """Returns (weights [B, T] float64, metrics without prefix)."""
    lower = 1.0 / upper if lower is None else lower
    B, T = old.shape
    W = torch.zeros(B, T, dtype=torch.float64)
    all_w, all_c, seq_means, row_vetoed, n_cat, n_changed, row_changed, n_hi, n_lo = [], [], [], [], 0, 0, [], 0, 0
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        if not idx:
            continue
        d = [float(old[i, t]) - float(roll[i, t]) for t in idx]
        dc = [min(max(x, -20.0), 20.0) for x in d]
        if level == "token":
            w = [math.exp(x) for x in dc]
        elif level == "sequence":
            w = [math.exp(min(max(sum(d), -20.0), 20.0))] * len(idx)
        else:
            w = [math.exp(min(max(sum(d) / len(d), -20.0), 20.0))] * len(idx)
        cat = [veto is not None and x < math.log(veto) for x in d]
        vetoed = any(cat)
        if mode == "truncate":
            w2 = [min(x, upper) for x in w]
            chg = [x > upper for x in w]
        else:
            w2 = [x if lower <= x <= upper else 0.0 for x in w]
            chg = [not (lower <= x <= upper) for x in w]
        for t, v in zip(idx, w2):
            W[i, t] = 0.0 if vetoed else v
        all_w += w
        all_c += [min(max(x, lower), upper) for x in w]
        seq_means.append(sum(w) / len(w))
        row_vetoed.append(vetoed)
        n_cat += sum(cat)
        n_changed += sum(chg)
        row_changed.append(any(chg))
        n_hi += sum(x > upper for x in w)
        n_lo += sum(x < lower for x in w)
    n = len(all_w)
    mc = sum(all_c) / n
    m2 = sum(c * c for c in all_c) / n
    sm = np.array(seq_means)
    met = {
        "rollout_is_mean": sum(all_w) / n,
        "rollout_is_std": math.sqrt(max(m2 - mc * mc, 0.0)),
        "rollout_is_min": min(all_w),
        "rollout_is_max": max(all_w),
        "rollout_is_eff_sample_size": 1.0 / (sum((c / mc) ** 2 for c in all_c) / n),
        "rollout_is_veto_fraction": sum(row_vetoed) / len(row_vetoed),
        "rollout_is_catastrophic_token_fraction": n_cat / n,
        "rollout_is_clipped_fraction": n_changed / n,
        "rollout_is_seq_clipped_fraction": sum(row_changed) / len(row_changed),
        "rollout_is_ratio_fraction_high": n_hi / n,
        "rollout_is_ratio_fraction_low": n_lo / n,
        "rollout_is_seq_mean": sm.mean(),
        "rollout_is_seq_std": sm.std(ddof=1) if len(sm) > 1 else 0.0,
        "rollout_is_seq_max": sm.max(),
        "rollout_is_seq_min": sm.min(),
        "rollout_is_seq_max_deviation": np.abs(sm - 1).max(),
        "rollout_is_seq_fraction_high": float((sm > upper).mean()),
        "rollout_is_seq_fraction_low": float((sm < lower).mean()),
    }
    for q in (25, 50, 75, 95, 99):
        met[f"rollout_is_p{q}"] = float(np.percentile(np.array(all_w), q))  # numpy default: "linear"
    met.update(ref_mismatch(old, roll, mask))
    return W, met


def ref_mismatch(old, roll, mask):
    B, T = old.shape
    xs, ys, kl, k3, chi, pd, tppl, rppl, tlog, rlog, lpd, chi_seq = [], [], [], [], [], [], [], [], [], [], [], []
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        if not idx:
            continue
        x = [float(old[i, t]) for t in idx]
        y = [float(roll[i, t]) for t in idx]
        xs += x
        ys += y
        for a, b in zip(x, y):
            lr = min(max(a - b, -20.0), 20.0)
            kl.append(b - a)
            k3.append(math.exp(lr) - lr - 1.0)
            chi.append(math.exp(lr) ** 2)
            pd.append(abs(math.exp(b) - math.exp(a)))
        mx, my = sum(x) / len(x), sum(y) / len(y)
        tppl.append(math.exp(-mx))
        rppl.append(math.exp(-my))
        tlog.append(-mx)
        rlog.append(-my)
        lpd.append(my - mx)
        chi_seq.append(math.exp(2 * min(max(sum(x) - sum(y), -20.0), 20.0)))
    return {
        "mismatch_kl": np.mean(kl),
        "mismatch_k3_kl": np.mean(k3),
        "mismatch_training_ppl": np.mean(tppl),
        "mismatch_training_log_ppl": np.mean(tlog),
        "mismatch_rollout_ppl": np.mean(rppl),
        "mismatch_rollout_log_ppl": np.mean(rlog),
        "mismatch_log_ppl_diff": np.mean(lpd),
        "mismatch_log_ppl_abs_diff": np.mean(np.abs(lpd)),
        "mismatch_log_ppl_diff_max": max(lpd),
        "mismatch_log_ppl_diff_min": min(lpd),
        "mismatch_ppl_ratio": np.mean(np.exp(lpd)),
        "mismatch_chi2_token": np.mean(chi) - 1.0,
        "mismatch_chi2_seq": np.mean(chi_seq) - 1.0,
        "mismatch_prob_diff": np.mean(pd),
        "mismatch_prob_diff_max": max(pd),
        "mismatch_pearson": float(np.corrcoef(np.array(xs), np.array(ys))[0, 1]),
    }


def random_batch(B, T, seed, scale=0.3, dtype=torch.float32, empty_rows=True):
    g = torch.Generator().manual_seed(seed)
    old = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).to(dtype)  # log-probs in (-3, 0]
    roll = (old.double() + torch.randn(B, T, generator=g, dtype=torch.float64) * scale).to(dtype)
    lens = torch.randint(0 if empty_rows else 1, T + 1, (B,), generator=g)
    lens[0] = T  # at least one full row
    mask = torch.arange(T)[None, :] < lens[:, None]
    return old, roll, mask


def assert_metrics_close(got: dict, want: dict, rtol, atol, prefix="mismatch/"):
    missing = [k for k in want if prefix + k not in got]
    assert not missing, f"metrics missing: {missing}"
    for k, v in want.items():
        g = got[prefix + k]
        assert math.isclose(g, float(v), rel_tol=rtol, abs_tol=atol), f"{k}: got {g}, want {v}"


# ------------------------------------------------------------------------------------------------
# golden numbers
# ------------------------------------------------------------------------------------------------


def _golden_row(extra=()):
    # old - rollout = [0.1, -0.2, ln 3] (+ extra), rollout log-probs all -1
    d = torch.tensor([[0.1, -0.2, LN3, *extra]], dtype=torch.float64)
    roll = torch.full_like(d, -1.0)
    return roll + d, roll, torch.ones_like(d, dtype=torch.bool)


def test_golden_token_truncate_and_clip():
    old, roll, mask = _golden_row()
    # rho = [e^0.1, e^-0.2, 3] = [1.105171, 0.818731, 3.0]
    r = [math.exp(0.1), math.exp(-0.2), 3.0]
    # truncate at 2: [1.105171, 0.818731, 2.0]
    w, _, met = compute_rollout_is_weights(old, roll, mask, rollout_is_level="token", rollout_is_mode="truncate")
    torch.testing.assert_close(w, torch.tensor([[r[0], r[1], 2.0]], dtype=torch.float64))
    # clip to [1/2, 2]: 3 is outside -> 0
    w, _, met_c = compute_rollout_is_weights(old, roll, mask, rollout_is_level="token", rollout_is_mode="clip")
    torch.testing.assert_close(w, torch.tensor([[r[0], r[1], 0.0]], dtype=torch.float64))
    # metrics on the pre-threshold weights: mean = (1.105171 + 0.818731 + 3) / 3 = 1.641301
    assert met["mismatch/rollout_is_mean"] == pytest.approx(sum(r) / 3, rel=1e-12)
    assert met["mismatch/rollout_is_max"] == pytest.approx(3.0, rel=1e-12)
    assert met["mismatch/rollout_is_min"] == pytest.approx(r[1], rel=1e-12)
    # one of three tokens above 2: truncated (truncate) / zeroed (clip); none below 0.5
    assert met["mismatch/rollout_is_clipped_fraction"] == pytest.approx(1 / 3)
    assert met_c["mismatch/rollout_is_clipped_fraction"] == pytest.approx(1 / 3)
    assert met["mismatch/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert met["mismatch/rollout_is_ratio_fraction_low"] == 0.0
    # std / ESS on clamp(w, 0.5, 2) = [1.105171, 0.818731, 2]: mean c = 1.307967,
    # E[c^2] = (1.221403 + 0.670320 + 4) / 3 = 1.963908, var = 1.963908 - 1.307967^2 = 0.253129,
    # std = 0.503120; ESS = mean(c)^2 / E[c^2] = 1.710778 / 1.963908 = 0.871109
    c = [r[0], r[1], 2.0]
    mc, m2 = sum(c) / 3, sum(x * x for x in c) / 3
    assert met["mismatch/rollout_is_std"] == pytest.approx(math.sqrt(m2 - mc * mc), rel=1e-9)
    assert met["mismatch/rollout_is_std"] == pytest.approx(0.503120, abs=1e-6)
    assert met["mismatch/rollout_is_eff_sample_size"] == pytest.approx(0.871109, abs=1e-6)
    # percentiles, linear interpolation over the sorted [0.818731, 1.105171, 3]:
    # p25: pos 0.5 -> 0.818731 + 0.5 * 0.286440 = 0.961951;  p50 = 1.105171
    # p75: pos 1.5 -> 1.105171 + 0.5 * 1.894829 = 2.052585;  p95: pos 1.9 -> 2.810517;  p99: pos 1.98 -> 2.962104
    s = sorted(r)
    for q, want in [(25, 0.961951), (50, 1.105171), (75, 2.052585), (95, 2.810517), (99, 2.962104)]:
        pos = q / 100 * 2
        lo = int(pos)
        exact = s[lo] + (s[min(lo + 1, 2)] - s[lo]) * (pos - lo)
        assert met[f"mismatch/rollout_is_p{q}"] == pytest.approx(exact, rel=1e-12)
        assert met[f"mismatch/rollout_is_p{q}"] == pytest.approx(want, abs=1e-6)
    # one row: its mean weight is the token mean; it has a truncated token
    assert met["mismatch/rollout_is_seq_mean"] == pytest.approx(sum(r) / 3)
    assert met["mismatch/rollout_is_seq_clipped_fraction"] == 1.0
    assert met["mismatch/rollout_is_veto_fraction"] == 0.0


def test_golden_sequence_and_geometric():
    old, roll, mask = _golden_row()
    # sum log rho = 0.1 - 0.2 + ln 3 = 0.998612 -> rho_seq = 3 e^-0.1 = 2.714512
    rho_seq = 3 * math.exp(-0.1)
    w, _, met = compute_rollout_is_weights(old, roll, mask, rollout_is_level="sequence", rollout_is_mode="truncate")
    torch.testing.assert_close(w, torch.full((1, 3), 2.0, dtype=torch.float64))  # min(2.714512, 2)
    assert met["mismatch/rollout_is_mean"] == pytest.approx(rho_seq, rel=1e-12)
    assert met["mismatch/rollout_is_clipped_fraction"] == 1.0
    w, _, _ = compute_rollout_is_weights(old, roll, mask, rollout_is_level="sequence", rollout_is_mode="clip")
    torch.testing.assert_close(w, torch.zeros(1, 3, dtype=torch.float64))  # 2.714512 > 2 -> 0
    # geometric: exp(0.998612 / 3) = 2.714512^(1/3) = 1.394967, inside [0.5, 2]: kept by both modes
    geo = rho_seq ** (1 / 3)
    for mode in ("truncate", "clip"):
        w, _, met = compute_rollout_is_weights(old, roll, mask, rollout_is_level="geometric", rollout_is_mode=mode)
        torch.testing.assert_close(w, torch.full((1, 3), geo, dtype=torch.float64))
        assert met["mismatch/rollout_is_clipped_fraction"] == 0.0
        assert met["mismatch/rollout_is_p50"] == pytest.approx(geo, rel=1e-12)
    assert geo == pytest.approx(1.394967, abs=1e-6)


def test_golden_veto():
    # add a token with rho = 1e-5 < 1e-4: the whole row is vetoed (all weights 0), at every level
    old, roll, mask = _golden_row(extra=(math.log(1e-5),))
    for level in ("token", "sequence", "geometric"):
        w, _, met = compute_rollout_is_weights(old, roll, mask, rollout_is_level=level)
        assert torch.equal(w, torch.zeros_like(w))
        assert met["mismatch/rollout_is_veto_fraction"] == 1.0
        assert met["mismatch/rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 4)
    # veto disabled: token weights [1.105171, 0.818731, 2, 1e-5]
    w, _, met = compute_rollout_is_weights(old, roll, mask, rollout_is_veto_threshold=None)
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.1), math.exp(-0.2), 2.0, 1e-5]], dtype=torch.float64))
    assert met["mismatch/rollout_is_veto_fraction"] == 0.0
    assert met["mismatch/rollout_is_catastrophic_token_fraction"] == 0.0
    # a looser veto (1e-6) lets the 1e-5 token through
    w, _, _ = compute_rollout_is_weights(old, roll, mask, rollout_is_veto_threshold=1e-6)
    assert float(w.sum()) == pytest.approx(math.exp(0.1) + math.exp(-0.2) + 2.0 + 1e-5, rel=1e-12)


def test_golden_mismatch_metrics():
    old, roll, mask = _golden_row()
    r = [math.exp(0.1), math.exp(-0.2), 3.0]
    met = compute_mismatch_metrics(old, roll, mask)
    # kl = mean(rollout - old) = -(0.1 - 0.2 + ln 3) / 3 = -0.332871
    assert met["mismatch/mismatch_kl"] == pytest.approx(-(0.1 - 0.2 + LN3) / 3, rel=1e-12)
    # k3 = mean(rho - log rho - 1) = (0.005171 + 0.018731 + 0.901388) / 3 = 0.308430
    assert met["mismatch/mismatch_k3_kl"] == pytest.approx(0.308430, abs=1e-6)
    # chi2_token = mean(rho^2) - 1 = (1.221403 + 0.670320 + 9) / 3 - 1 = 2.630574
    assert met["mismatch/mismatch_chi2_token"] == pytest.approx(sum(x * x for x in r) / 3 - 1, rel=1e-12)
    assert met["mismatch/mismatch_chi2_token"] == pytest.approx(2.630574, abs=1e-6)
    # chi2_seq = (3 e^-0.1)^2 - 1 = 7.368577 - 1 = 6.368577
    assert met["mismatch/mismatch_chi2_seq"] == pytest.approx(6.368577, abs=1e-6)
    # rollout logp = -1 everywhere: rollout ppl = e^1 = 2.718282, log ppl 1
    assert met["mismatch/mismatch_rollout_ppl"] == pytest.approx(math.e, rel=1e-12)
    assert met["mismatch/mismatch_rollout_log_ppl"] == pytest.approx(1.0, rel=1e-12)
    # training mean logp = -1 + 0.332871 -> ppl = e^0.667129 = 1.948635; log_ppl_diff = -0.332871
    assert met["mismatch/mismatch_training_ppl"] == pytest.approx(math.exp(1 - (0.1 - 0.2 + LN3) / 3), rel=1e-12)
    assert met["mismatch/mismatch_log_ppl_diff"] == pytest.approx(-(0.1 - 0.2 + LN3) / 3, rel=1e-12)
    assert met["mismatch/mismatch_ppl_ratio"] == pytest.approx(math.exp(-(0.1 - 0.2 + LN3) / 3), rel=1e-12)
    # prob diff: p_rollout = e^-1 = 0.367879, p_train = 0.367879 * rho -> |diff| = 0.367879 |rho - 1|
    # = 0.367879 * (0.105171 + 0.181269 + 2) / 3 = 0.280378
    assert met["mismatch/mismatch_prob_diff"] == pytest.approx(math.exp(-1) * (r[0] - 1 + 1 - r[1] + 2) / 3, rel=1e-12)
    assert met["mismatch/mismatch_prob_diff_max"] == pytest.approx(2 * math.exp(-1), rel=1e-12)
    # rollout logp is constant -> its variance is 0 and the Pearson correlation is undefined
    assert math.isnan(met["mismatch/mismatch_pearson"])


def test_metric_names_are_the_published_ones():
    old, roll, mask = random_batch(4, 5, seed=2)
    for level in ("token", "sequence"):
        _, _, met = compute_rollout_is_weights(old, roll, mask, rollout_is_level=level)
        assert set(met) == {"mismatch/" + k for k in R.IS_METRICS + R.MISMATCH_METRICS}
    assert set(compute_mismatch_metrics(old, roll, mask)) == {"mismatch/" + k for k in R.MISMATCH_METRICS}


def test_disabled_and_metrics_only():
    old, roll, mask = random_batch(5, 7, seed=1)
    w, m, met = compute_rollout_is_weights(old, roll, mask, rollout_is_threshold=None)
    assert w is None and m is mask and met == {}
    w1, _, met1 = compute_rollout_is_weights(old, roll, mask)
    w0, m0, met0 = compute_rollout_is_weights(old, roll, mask, rollout_is=False)
    assert w0 is None and m0 is mask and w1 is not None
    assert met0 == met1


def test_errors_name_the_options():
    old, roll, mask = random_batch(2, 3, seed=0)
    with pytest.raises(ValueError, match="rollout_is_level"):
        compute_rollout_is_weights(old, roll, mask, rollout_is_level="tokens")
    with pytest.raises(ValueError, match="rollout_is_mode.*Did you mean 'clip'"):
        compute_rollout_is_weights(old, roll, mask, rollout_is_mode="clipp")
    with pytest.raises(ValueError, match="rollout_is_threshold_lower.*rollout_is_threshold"):
        compute_rollout_is_weights(old, roll, mask, rollout_is_threshold=2.0, rollout_is_threshold_lower=3.0)
    with pytest.raises(ValueError, match="shape"):
        compute_rollout_is_weights(old, roll[:, :2], mask)
    with pytest.raises(ValueError, match="no valid token"):
        compute_rollout_is_weights(old, roll, torch.zeros_like(mask))


def _cap_at_1_2(w, lower, upper):  # a user mode: (w, lower, upper) -> (w', changed)
    return w.clamp(max=1.2), w > 1.2


def test_user_mode_plugin():
    old, roll, mask = random_batch(4, 6, seed=3, scale=1.0)
    # the "pkg.module:function" form resolves like the built-in name
    w_user, _, met_user = compute_rollout_is_weights(old, roll, mask, rollout_is_mode="trainer.algos.rollout_is:_clip")
    w_clip, _, met_clip = compute_rollout_is_weights(old, roll, mask, rollout_is_mode="clip")
    assert torch.equal(w_user, w_clip) and met_user == met_clip
    # a user function: weights min(rho, 1.2) (no veto here), "clipped" = the tokens it capped
    for level in ("token", "sequence"):
        w, _, met = compute_rollout_is_weights(old, roll, mask, rollout_is_level=level, rollout_is_mode=_cap_at_1_2,
                                               rollout_is_veto_threshold=None)  # fmt: skip
        W, _ = ref_rollout_is(old, roll, mask, level, "truncate", 1.2, None, None)
        torch.testing.assert_close(w.double(), W, rtol=2e-6, atol=1e-7)
        _, want = ref_rollout_is(old, roll, mask, level, "truncate", 1.2, None, None)
        assert met["mismatch/rollout_is_clipped_fraction"] == pytest.approx(want["rollout_is_clipped_fraction"])


# ------------------------------------------------------------------------------------------------
# float64 loop reference, every level x mode x veto, every metric
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "clip"])
@pytest.mark.parametrize("veto", [1e-4, 0.3, None])
def test_matches_reference(level, mode, veto):
    # scale 0.6 so that truncation, clipping on both sides and (with veto 0.3) vetoes all happen
    seed = ["token", "sequence", "geometric"].index(level) * 10 + ["truncate", "clip"].index(mode) * 3 + [1e-4, 0.3, None].index(veto)
    old, roll, mask = random_batch(9, 13, seed=seed, scale=0.6 if level == "token" else 0.25)
    upper, lower = (1.5, 0.6) if mode == "clip" else (1.5, None)
    w, m, met = compute_rollout_is_weights(
        old, roll, mask, rollout_is_level=level, rollout_is_mode=mode, rollout_is_threshold=upper,
        rollout_is_threshold_lower=lower, rollout_is_veto_threshold=veto,
    )  # fmt: skip
    W, want = ref_rollout_is(old, roll, mask, level, mode, upper, lower, veto)
    assert m is mask
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.double(), W, rtol=2e-6, atol=1e-7)
    assert_metrics_close(met, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_matches_reference_float64_inputs(level, monkeypatch):
    # float64 inputs run the whole pass in float64: agreement to ~1e-12; tiny chunks exercise the
    # eager row chunking
    monkeypatch.setattr(R, "_EAGER_CHUNK_NUMEL", 20)
    old, roll, mask = random_batch(11, 8, seed=7, scale=0.5, dtype=torch.float64)
    w, _, met = compute_rollout_is_weights(old, roll, mask, rollout_is_level=level, rollout_is_mode="clip")
    W, want = ref_rollout_is(old, roll, mask, level, "clip", 2.0, None, 1e-4)
    assert w.dtype == torch.float64
    torch.testing.assert_close(w, W, rtol=1e-12, atol=1e-14)
    assert_metrics_close(met, want, rtol=1e-9, atol=1e-12)


def test_mismatch_metrics_match_reference():
    old, roll, mask = random_batch(10, 12, seed=11, scale=0.4)
    assert_metrics_close(compute_mismatch_metrics(old, roll, mask), ref_mismatch(old, roll, mask), rtol=2e-5, atol=2e-6)
    # also with a float {0,1} mask, and the main function carries the same numbers
    met = compute_mismatch_metrics(old, roll, mask.float())
    _, _, full = compute_rollout_is_weights(old, roll, mask)
    for k, v in met.items():
        assert full[k] == v


def test_small_mismatch_is_not_lost_to_cancellation():
    # |log rho| ~ 1e-4: k3 ~ 5e-9 and chi2 ~ 2e-8 per token would vanish in exp(x) - 1 - x in float32
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(64, 256, generator=g, dtype=torch.float64) * 3
    roll = old + torch.randn(64, 256, generator=g, dtype=torch.float64) * 1e-4
    mask = torch.ones(64, 256, dtype=torch.bool)
    want = ref_mismatch(old.float(), roll.float(), mask)
    got = compute_mismatch_metrics(old.float(), roll.float(), mask)
    assert got["mismatch/mismatch_k3_kl"] == pytest.approx(want["mismatch_k3_kl"], rel=1e-3)
    assert got["mismatch/mismatch_chi2_token"] == pytest.approx(want["mismatch_chi2_token"], rel=1e-3, abs=1e-9)
    assert got["mismatch/mismatch_pearson"] == pytest.approx(want["mismatch_pearson"], abs=1e-9)


# ------------------------------------------------------------------------------------------------
# exact percentiles on large inputs (sample-bracketed selection)
# ------------------------------------------------------------------------------------------------


def _np_percentiles(old, roll, mask):
    d = (old.float() - roll.float()).clamp(-20, 20)[mask].double().exp().numpy()  # the same float32 log rho
    return [float(np.percentile(d, q)) for q in R.PERCENTILES]


@pytest.mark.parametrize("ties", [False, True])
def test_bracketed_percentiles_are_exact(monkeypatch, ties):
    monkeypatch.setattr(R, "_EXACT_SORT_MAX", 0)  # force the bracket path
    monkeypatch.setattr(R, "_SAMPLE_SIZE", 2048)
    old, roll, mask = random_batch(64, 700, seed=21, scale=0.2)
    if ties:  # atoms: 60% of the tokens have old == rollout exactly (log rho = 0), 10% log rho = 0.05
        g = torch.Generator().manual_seed(0)
        u = torch.rand(old.shape, generator=g)
        roll = torch.where(u < 0.6, old, roll)
        roll = torch.where((u >= 0.6) & (u < 0.7), old - 0.05, roll)
    calls = []
    real = R._valid_log_weights
    monkeypatch.setattr(R, "_valid_log_weights", lambda *a: calls.append(1) or real(*a))
    _, _, met = compute_rollout_is_weights(old, roll, mask)
    assert calls == []  # no fallback needed: the brackets held every rank
    for q, want in zip(R.PERCENTILES, _np_percentiles(old, roll, mask)):
        assert met[f"mismatch/rollout_is_p{q}"] == pytest.approx(want, rel=1e-12)


def test_bracket_miss_falls_back_exactly(monkeypatch):
    monkeypatch.setattr(R, "_EXACT_SORT_MAX", 0)
    monkeypatch.setattr(R, "_SAMPLE_SIZE", 1024)
    monkeypatch.setattr(R, "_BRACKET_SIGMAS", -3.0)  # brackets deliberately too narrow (inverted)
    old, roll, mask = random_batch(32, 500, seed=4, scale=0.2)
    calls = []
    real = R._valid_log_weights
    monkeypatch.setattr(R, "_valid_log_weights", lambda *a: calls.append(1) or real(*a))
    _, _, met = compute_rollout_is_weights(old, roll, mask)
    assert calls, "the fallback was expected to run"
    for q, want in zip(R.PERCENTILES, _np_percentiles(old, roll, mask)):
        assert met[f"mismatch/rollout_is_p{q}"] == pytest.approx(want, rel=1e-12)


def test_sampled_percentiles_are_close_and_change_nothing_else():
    # percentile_sample_size: estimates from ~n sampled tokens; everything else is unchanged.
    old, roll, mask = random_batch(128, 600, seed=8, scale=0.2)
    _, _, exact = compute_rollout_is_weights(old, roll, mask)
    _, _, est = compute_rollout_is_weights(old, roll, mask, percentile_sample_size=8192)
    v = np.sort((old.float() - roll.float()).clamp(-20, 20)[mask].double().exp().numpy())
    n = v.size
    for q in R.PERCENTILES:
        k = f"mismatch/rollout_is_p{q}"
        assert est[k] != exact[k]  # it is an estimate (a sample of ~8k of ~38k tokens)
        # within 5 binomial standard deviations of the sample rank (~8k sampled tokens)
        half = 5 * math.sqrt(q / 100 * (1 - q / 100) / 8000) * n + 1
        lo, hi = v[max(int(q / 100 * (n - 1) - half), 0)], v[min(int(q / 100 * (n - 1) + half), n - 1)]
        assert lo <= est[k] <= hi, (q, lo, est[k], hi)
    assert {k: v for k, v in est.items() if "_p" not in k} == {k: v for k, v in exact.items() if "_p" not in k}
    # small batches (<= 2n positions) stay exact
    _, _, small = compute_rollout_is_weights(old, roll, mask, percentile_sample_size=10**6)
    assert small == exact


@pytest.mark.slow  # one torch.compile of the fused pass: ~30 s of C++ compilation on a cold cache
def test_compiled_path_matches_eager(monkeypatch):
    # the torch.compile'd fused pass (used on big inputs) against the eager one, brackets included
    old, roll, mask = random_batch(48, 300, seed=9, scale=0.4)
    monkeypatch.setattr(R, "_EXACT_SORT_MAX", 0)
    monkeypatch.setattr(R, "_SAMPLE_SIZE", 2048)
    monkeypatch.setenv("COXSWAIN_COMPILE", "0")
    w_e, _, met_e = compute_rollout_is_weights(old, roll, mask, rollout_is_veto_threshold=0.5)
    monkeypatch.setenv("COXSWAIN_COMPILE", "1")
    w_c, _, met_c = compute_rollout_is_weights(old, roll, mask, rollout_is_veto_threshold=0.5)
    assert not compile_broken(), "torch.compile failed on this machine"
    torch.testing.assert_close(w_c, w_e, rtol=2e-6, atol=1e-7)
    assert met_c.keys() == met_e.keys()
    for k in met_e:
        assert math.isclose(met_c[k], met_e[k], rel_tol=1e-5, abs_tol=1e-6), k


# ------------------------------------------------------------------------------------------------
# rejection sampling
# ------------------------------------------------------------------------------------------------


def test_rejection_golden():
    old, roll, mask = _golden_row()
    # k2 = (log rho)^2 / 2 = [0.005, 0.02, 0.603474]; token agg, upper 0.1 -> the ln 3 token goes
    new, met = compute_rejection_mask(old, roll, mask.float(), divergence="k2", agg="token", upper=0.1)
    assert new.tolist() == [[1.0, 1.0, 0.0]] and new.dtype == torch.float32
    assert met["mismatch/rollout_rs_masked_fraction"] == pytest.approx(1 / 3)
    assert met["mismatch/rollout_rs_seq_masked_fraction"] == 1.0
    assert met["mismatch/rollout_rs_token_k2_max"] == pytest.approx(LN3**2 / 2, rel=1e-12)
    # k3 seq_mean = (0.005171 + 0.018731 + 0.901388) / 3 = 0.308430 > 0.3 -> whole row rejected
    new, met = compute_rejection_mask(old, roll, mask, divergence="k3", agg="seq_mean", upper=0.3)
    assert new.tolist() == [[False, False, False]]
    assert met["mismatch/rollout_rs_seq_mean_k3_mean"] == pytest.approx(0.308430, abs=1e-6)
    new, _ = compute_rejection_mask(old, roll, mask, divergence="k3", agg="seq_mean", upper=0.31)
    assert new.all()
    # k1 = -log rho = [-0.1, 0.2, -1.098612]: seq_sum = -0.998612, seq_max = 0.2
    new, _ = compute_rejection_mask(old, roll, mask, divergence="k1", agg="seq_sum", lower=-1.0)
    assert new.all()
    new, _ = compute_rejection_mask(old, roll, mask, divergence="k1", agg="seq_sum", lower=-0.99)
    assert not new.any()
    new, _ = compute_rejection_mask(old, roll, mask, divergence="k1", agg="seq_max", upper=0.19)
    assert not new.any()
    # token k1 within [-0.5, 0.5]: the ln 3 token (k1 = -1.0986) goes
    new, _ = compute_rejection_mask(old, roll, mask, divergence="k1", agg="token", lower=-0.5, upper=0.5)
    assert new.tolist() == [[True, True, False]]


@pytest.mark.parametrize("div", ["k1", "k2", "k3"])
@pytest.mark.parametrize("agg", ["token", "seq_sum", "seq_mean", "seq_max"])
def test_rejection_matches_reference(div, agg):
    old, roll, mask = random_batch(12, 9, seed=5, scale=0.5)
    lower, upper = (-0.3, 0.4) if div == "k1" else (None, {"token": 0.08, "seq_sum": 0.5, "seq_mean": 0.08, "seq_max": 0.2}[agg])
    new, met = compute_rejection_mask(old, roll, mask.float(), divergence=div, agg=agg, lower=lower, upper=upper)
    want = torch.zeros(12, 9)
    stats, tok_stats, rows_hit, rejected = [], [], 0, 0
    for i in range(12):
        idx = [t for t in range(9) if mask[i, t]]
        if not idx:
            continue
        lr = [min(max(float(old[i, t]) - float(roll[i, t]), -20), 20) for t in idx]
        k = {"k1": [-x for x in lr], "k2": [x * x / 2 for x in lr], "k3": [math.exp(x) - 1 - x for x in lr]}[div]
        if agg == "token":
            vals, stats = k, stats + k
        else:
            s = {"seq_sum": sum(k), "seq_mean": sum(k) / len(k), "seq_max": max(k)}[agg]
            vals, stats = [s] * len(k), stats + [s]
        tok_stats += vals  # verl: masked_mean of the per-token statistic (a row's on each of its tokens)
        keep = [(lower is None or v >= lower) and (upper is None or v <= upper) for v in vals]
        for t, kp in zip(idx, keep):
            want[i, t] = float(kp)
        rejected += len(keep) - sum(keep)
        rows_hit += not all(keep)
    assert torch.equal(new, want)
    n_rows = sum(1 for i in range(12) if mask[i].any())
    assert met["mismatch/rollout_rs_masked_fraction"] == pytest.approx(rejected / int(mask.sum()))
    assert met["mismatch/rollout_rs_seq_masked_fraction"] == pytest.approx(rows_hit / n_rows)
    name = f"mismatch/rollout_rs_{agg}_{div}"
    assert met[name + "_mean"] == pytest.approx(float(np.mean(tok_stats)), rel=1e-5, abs=1e-6)
    assert met[name + "_max"] == pytest.approx(max(stats), rel=1e-5, abs=1e-6)
    assert met[name + "_min"] == pytest.approx(min(stats), rel=1e-5, abs=1e-6)


def test_rejection_seq_mean_metric_is_token_weighted():
    """verl's ``rollout_rs_{option}_mean`` is ``masked_mean`` of the row statistic expanded over the
    row's tokens: a 3-token row weighs three times a 1-token row (a row mean would give 0.5 here)."""
    # row 0: 3 tokens with log rho = 0 (k1 = 0); row 1: 1 token with log rho = -1 (k1 = 1)
    old = torch.tensor([[0.0, 0.0, 0.0], [-1.0, 0.0, 0.0]], dtype=torch.float64)
    roll = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    for agg in ("seq_sum", "seq_mean", "seq_max"):
        _, met = compute_rejection_mask(old, roll, mask, divergence="k1", agg=agg, lower=-5.0, upper=5.0)
        assert met[f"mismatch/rollout_rs_{agg}_k1_mean"] == pytest.approx((3 * 0.0 + 1 * 1.0) / 4, abs=1e-12)
        assert met[f"mismatch/rollout_rs_{agg}_k1_max"] == pytest.approx(1.0)
        assert met[f"mismatch/rollout_rs_{agg}_k1_min"] == pytest.approx(0.0, abs=1e-12)


def test_rejection_errors():
    old, roll, mask = random_batch(2, 3, seed=0)
    with pytest.raises(ValueError, match="bound"):
        compute_rejection_mask(old, roll, mask)
    with pytest.raises(ValueError, match="Did you mean 'k3'"):
        compute_rejection_mask(old, roll, mask, divergence="k33", upper=1.0)
    with pytest.raises(ValueError, match="seq_mean"):
        compute_rejection_mask(old, roll, mask, agg="seq_avg", upper=1.0)


# ------------------------------------------------------------------------------------------------
# hypothesis properties
# ------------------------------------------------------------------------------------------------


@st.composite
def batches(draw):
    B = draw(st.integers(1, 5))
    T = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 10_000))
    scale = draw(st.sampled_from([0.0, 0.05, 0.5, 3.0, 30.0]))
    old, roll, mask = random_batch(B, T, seed=seed, scale=scale)
    return old, roll, mask


LEVELS = st.sampled_from(["token", "sequence", "geometric"])
MODES = st.sampled_from(["truncate", "clip"])


@settings(max_examples=60, deadline=None)
@given(b=batches(), level=LEVELS, mode=MODES, upper=st.floats(1.0, 10.0))
def test_prop_identical_policies_give_unit_weights(b, level, mode, upper):
    old, _, mask = b
    w, _, met = compute_rollout_is_weights(
        old, old.clone(), mask, rollout_is_level=level, rollout_is_mode=mode, rollout_is_threshold=upper
    )
    assert torch.equal(w, mask.float())  # rho = 1 exactly: inside [1/upper, upper], never vetoed
    assert met["mismatch/mismatch_kl"] == 0.0
    assert met["mismatch/mismatch_k3_kl"] == 0.0
    assert met["mismatch/mismatch_chi2_token"] == 0.0
    assert met["mismatch/mismatch_prob_diff"] == 0.0
    assert met["mismatch/mismatch_log_ppl_diff"] == 0.0
    assert met["mismatch/mismatch_ppl_ratio"] == 1.0
    assert met["mismatch/rollout_is_mean"] == 1.0 and met["mismatch/rollout_is_p50"] == 1.0
    assert met["mismatch/rollout_is_clipped_fraction"] == 0.0
    assert met["mismatch/rollout_is_eff_sample_size"] == pytest.approx(1.0)


@settings(max_examples=60, deadline=None)
@given(b=batches(), level=LEVELS, upper=st.floats(1.0, 10.0), veto=st.sampled_from([None, 1e-4, 0.5]))
def test_prop_truncate_never_exceeds_upper(b, level, upper, veto):
    old, roll, mask = b
    w, _, _ = compute_rollout_is_weights(
        old, roll, mask, rollout_is_level=level, rollout_is_threshold=upper, rollout_is_veto_threshold=veto
    )
    assert float(w.max()) <= upper * (1 + 1e-6)  # float32 rounding of upper
    assert (w >= 0).all() and (w[~mask] == 0).all()
    assert not w.requires_grad


@settings(max_examples=60, deadline=None)
@given(b=batches(), level=LEVELS, upper=st.floats(1.0, 10.0), lower_frac=st.floats(0.0, 1.0))
def test_prop_clip_is_zero_or_inside(b, level, upper, lower_frac):
    old, roll, mask = b
    lower = lower_frac * upper
    w, _, met = compute_rollout_is_weights(
        old, roll, mask, rollout_is_level=level, rollout_is_mode="clip",
        rollout_is_threshold=upper, rollout_is_threshold_lower=lower,
    )  # fmt: skip
    nz = w[w != 0]
    assert ((nz >= lower * (1 - 1e-6)) & (nz <= upper * (1 + 1e-6))).all()
    assert (w[~mask] == 0).all()
    assert 0.0 <= met["mismatch/rollout_is_clipped_fraction"] <= 1.0


@settings(max_examples=40, deadline=None)
@given(b=batches(), level=LEVELS, mode=MODES, veto=st.sampled_from([None, 1e-4, 0.5]))
def test_prop_metrics_only_mode_same_metrics(b, level, mode, veto):
    old, roll, mask = b
    kw = dict(rollout_is_level=level, rollout_is_mode=mode, rollout_is_veto_threshold=veto)
    w1, _, m1 = compute_rollout_is_weights(old, roll, mask, **kw)
    w0, _, m0 = compute_rollout_is_weights(old, roll, mask, rollout_is=False, **kw)
    assert w0 is None and w1 is not None
    assert m0.keys() == m1.keys()
    for k in m1:
        assert m0[k] == m1[k] or (math.isnan(m0[k]) and math.isnan(m1[k])), k


@settings(max_examples=40, deadline=None)
@given(b=batches(), div=st.sampled_from(["k1", "k2", "k3"]), agg=st.sampled_from(list(R.REJECTION_AGGS)),
       upper=st.floats(0.0, 2.0))  # fmt: skip
def test_prop_rejection_only_removes(b, div, agg, upper):
    old, roll, mask = b
    new, met = compute_rejection_mask(old, roll, mask, divergence=div, agg=agg, upper=upper)
    assert not (new & ~mask).any()  # never adds a token
    if agg != "token":  # sequence aggregations keep or drop whole rows
        for i in range(mask.shape[0]):
            assert torch.equal(new[i], mask[i]) or not new[i].any()
    assert 0.0 <= met["mismatch/rollout_rs_masked_fraction"] <= 1.0
