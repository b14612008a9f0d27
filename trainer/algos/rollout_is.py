"""Rollout importance sampling (rollout IS), rollout-vs-trainer mismatch metrics, and rejection masks.

The sampler (SGLang, bf16 kernels) and the trainer (megatron-core) compute slightly different
token probabilities for the same policy, so the rollout is off-policy for the trainer. With the
per-token log-ratio (one per valid response token, ``m_t = 1``)

    log rho_t = old_logp_t - rollout_logp_t = log pi_train(y_t) - log pi_rollout(y_t)

computed once and clamped to [-20, 20] before any ``exp`` (``SAFETY_BOUND``; exp(20) ~ 4.9e8),
the pre-threshold weight ``w`` of a token is, by ``rollout_is_level``:

    token      w_t = exp(clamp(log rho_t))                            biased, low variance
    sequence   w_t = exp(clamp(sum_s m_s log rho_s))      per row     unbiased, high variance
    geometric  w_t = exp(clamp(sum_s m_s log rho_s / n))  per row     the per-token geometric mean

(the sequence sum is taken over the raw log-ratios and clamped as a sum, in log space, so a long
sequence can neither overflow nor underflow ``exp``). Then, by ``rollout_is_mode``:

    truncate   w' = min(w, upper)                                     TIS (Yao et al. 2025)
    clip       w' = w if lower <= w <= upper else 0                   masked IS (Liu, Li et al. 2025)

``lower`` defaults to ``1 / upper``. The veto zeroes the whole row when any valid token has
``rho_t < rollout_is_veto_threshold`` (tested in log space on the raw log-ratio). Weights are 0 on
padding and detached: they reweight the policy-gradient samples, they are not optimised.

References:
  * F. Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
    https://fengyao.notion.site/off-policy-rl (truncated IS on the sampler/trainer mismatch).
  * J. Liu, Y. Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
    Training-Inference Mismatch" (sequence/geometric levels, masking, veto, the metrics below).
  * E. Ionides 2008, "Truncated importance sampling", JCGS 17(2); A. Kong 1992 (effective sample size).
  * J. Schulman 2020, "Approximating KL divergence" (k1/k2/k3 estimators used by the rejection mask).

Metrics (``mismatch/`` prefix, names follow verl's ``mismatch_helper``). Means are over valid
tokens (a sequence-level weight counts once per token), "seq" statistics over the rows that have
at least one valid token. As in verl, the distribution statistics describe the weights BEFORE
truncation/clipping and veto (after the +-20 safety clamp): mean, min, max, percentiles,
``ratio_fraction_high/low``, the ``seq_*`` statistics; ``std`` and ``eff_sample_size`` use the
weights clamped to [lower, upper] (verl does so to keep them finite), with
ESS = 1 / mean((c / mean c)^2) = mean(c)^2 / mean(c^2). ``clipped_fraction`` is the fraction of
valid tokens whose weight truncation changed (w > upper) or clipping zeroed (w outside
[lower, upper]); veto is counted separately (``veto_fraction`` over rows,
``catastrophic_token_fraction`` over tokens). Percentiles use numpy's default "linear"
interpolation between order statistics of the valid-token weights (``numpy.percentile``).

``compute_mismatch_metrics`` (also part of the main function's output):
    mismatch_kl        mean(log pi_rollout - log pi_train)           k1 of KL(rollout || train)
    mismatch_k3_kl     mean(rho - log rho - 1)                       k3 of the same KL
    mismatch_{training,rollout}_ppl       mean over rows of exp(-mean_t logp)   (verl: per-row ppl, then row mean)
    mismatch_{training,rollout}_log_ppl   mean over rows of -mean_t logp
    mismatch_log_ppl_diff{,_max,_min}, mismatch_log_ppl_abs_diff
                       per row  mean_t rollout_logp - mean_t old_logp  (= log(train ppl / rollout ppl))
    mismatch_ppl_ratio mean over rows of exp(log_ppl_diff)
    mismatch_chi2_token  mean(rho_t^2) - 1;  mismatch_chi2_seq  mean over rows of (prod_t rho_t)^2 - 1
    mismatch_prob_diff   mean |p_rollout - p_train| over valid tokens (and ``_max``)
    mismatch_pearson     Pearson correlation of old_logp and rollout_logp over valid tokens

Deviations from verl (each deliberate, named here): (1) rows with no valid token are left out of
every per-row statistic (verl averages them in as weight 0 or 1); (2) ``mismatch_k3_kl`` and the
chi2 use the safety-clamped rho (verl's k3 uses the unclamped exp, which overflows past 88);
(3) ``rollout_is_min`` is the min of the clamped weights for every level (verl reports the
unclamped exp for sequence/geometric; both are < 2e-9 where they differ); (4) ``ratio_fraction_*``
is token-weighted for every level (verl counts rows at the sequence level); (5) ``mismatch_pearson``
correlates the log-probs as the design brief asks (verl's older ``rollout_actor_probs_pearson_corr``
correlates the probabilities); (6) the percentiles verl dropped (torch.quantile's 16M-element
limit) are back, computed without it (see ``_token_percentiles``).

Speed: one fused pass over (old, rollout, mask) produces every per-row sum the metrics need and
the weights (``_row_pass``); the [B]-sized finishing is in float64, so the float32 [B, T] pass
never has to be upcast. Quantities that would cancel in float32 are formed in shifted or series
form: rho - 1 - log rho and rho - 1 from a Taylor series for |log rho| < 0.25, |p_train - p_rollout|
as exp(max) |rho - 1| / max(rho, 1), and the Pearson covariance from var(old - rollout). On large
inputs the pass goes through ``torch.compile`` (one generated loop nest; set
``COXSWAIN_COMPILE=0`` to disable), otherwise it runs eagerly over row chunks that fit in cache.
The token-level percentiles come from a sample-bracketed exact selection instead of a full sort
(``_token_percentiles``), or optionally from a sample (``percentile_sample_size``).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from trainer.algos.utils import compile_wanted, load_fn, run_compiled

SAFETY_BOUND = 20.0  # |log rho| clamp before exp: exp(20) ~ 4.85e8, exp(-20) ~ 2.06e-9
PERCENTILES = (25, 50, 75, 95, 99)

# Every key compute_rollout_is_weights returns ("mismatch/" + name); compute_mismatch_metrics
# returns the MISMATCH_METRICS ones.
MISMATCH_METRICS = (
    "mismatch_kl", "mismatch_k3_kl", "mismatch_training_ppl", "mismatch_training_log_ppl",
    "mismatch_rollout_ppl", "mismatch_rollout_log_ppl", "mismatch_log_ppl_diff",
    "mismatch_log_ppl_abs_diff", "mismatch_log_ppl_diff_max", "mismatch_log_ppl_diff_min",
    "mismatch_ppl_ratio", "mismatch_chi2_token", "mismatch_chi2_seq", "mismatch_prob_diff",
    "mismatch_prob_diff_max", "mismatch_pearson",
)  # fmt: skip
IS_METRICS = (
    "rollout_is_mean", "rollout_is_std", "rollout_is_min", "rollout_is_max",
    *(f"rollout_is_p{q}" for q in PERCENTILES), "rollout_is_eff_sample_size",
    "rollout_is_veto_fraction", "rollout_is_catastrophic_token_fraction",
    "rollout_is_clipped_fraction", "rollout_is_seq_clipped_fraction",
    "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low",
    "rollout_is_seq_mean", "rollout_is_seq_std", "rollout_is_seq_max", "rollout_is_seq_min",
    "rollout_is_seq_max_deviation", "rollout_is_seq_fraction_high", "rollout_is_seq_fraction_low",
)  # fmt: skip

# ------------------------------------------------------------------------------------------------
# dispatch tables
# ------------------------------------------------------------------------------------------------


def _token_log_weight(log_ratio: torch.Tensor, row_sum: Optional[torch.Tensor], row_count: Optional[torch.Tensor]):
    return log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B, T]


def _sequence_log_weight(log_ratio, row_sum: torch.Tensor, row_count: torch.Tensor):
    return row_sum.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B] log prod_t rho_t, clamped as a sum


def _geometric_log_weight(log_ratio, row_sum: torch.Tensor, row_count: torch.Tensor):
    return (row_sum / row_count.clamp_min(1)).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B] mean log rho


# name -> log-weight. "token" maps the [B, T] log-ratio to [B, T]; the others map the per-row sum
# and count of the log-ratio ([B]) to one log-weight per row, broadcast over the row's tokens.
LEVELS: dict[str, Callable] = {
    "token": _token_log_weight,
    "sequence": _sequence_log_weight,
    "geometric": _geometric_log_weight,
}


def _truncate(w: torch.Tensor, lower: float, upper: float):
    """TIS: cap at ``upper``. Returns (new weights, bool "changed")."""
    return w.clamp(max=upper), w > upper


def _clip(w: torch.Tensor, lower: float, upper: float):
    """Masked IS: zero outside [lower, upper]. Returns (new weights, bool "zeroed")."""
    out = (w < lower) | (w > upper)
    return torch.where(out, torch.zeros_like(w), w), out


# name -> f(w, lower, upper) -> (w', changed). A user mode "pkg.module:function" has the same
# signature and must be elementwise (it runs on [B, T] token weights or on [B] row weights).
MODES: dict[str, Callable] = {"truncate": _truncate, "clip": _clip}


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return -log_ratio  # log pi_rollout - log pi_train: k1 of KL(rollout || train), signed


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio * log_ratio  # >= 0


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    return _k3_and_rho(log_ratio)[0]  # rho - 1 - log rho >= 0


# name -> per-token divergence of the rollout policy from the trainer, from the clamped log rho.
DIVERGENCES: dict[str, Callable] = {"k1": _k1, "k2": _k2, "k3": _k3}

REJECTION_AGGS = ("token", "seq_sum", "seq_mean", "seq_max")

# ------------------------------------------------------------------------------------------------
# execution: compiled on big inputs, eager over cache-sized row chunks otherwise
# ------------------------------------------------------------------------------------------------

_EAGER_CHUNK_NUMEL = 1 << 18  # rows per eager chunk = this // T (1 MiB float32 temporaries)
# Let inductor put every reduction and the weight write in ONE loop nest over the rows: by default it
# caps a fused group at 64 nodes and materialises re-used intermediates (e.g. |p diff|, read by a sum
# and a max) as whole [B, T] buffers, which costs extra passes over memory.
_INDUCTOR_OPTIONS = {
    "max_fusion_size": 4096,
    "realize_reads_threshold": 1000,
    "realize_cpu_opcount_threshold": 100000,
    "realize_cpu_acc_reads_threshold": 1000,
    "aggressive_fusion": True,
}


def _run_rows(fn: Callable, rows: tuple, extra: tuple = (), **kw):
    """Run ``fn(*rows, *extra, **kw)``: compiled in one call when worth it (``utils.compile_wanted``),
    else eagerly over row chunks of the [B, T] tensors in ``rows`` (``extra`` is passed whole).
    ``fn`` returns a tuple of row-aligned tensors (or None); chunk results are concatenated along rows."""
    b, t = rows[0].shape
    if compile_wanted(b * t):
        out = run_compiled(fn, *rows, *extra, options=_INDUCTOR_OPTIONS, **kw)
        if out is not None:
            return out
    step = max(1, _EAGER_CHUNK_NUMEL // max(t, 1))
    if step >= b:
        return fn(*rows, *extra, **kw)
    parts = [fn(*(x[r : r + step] for x in rows), *extra, **kw) for r in range(0, b, step)]
    return tuple(None if p[0] is None else torch.cat(p, 0) for p in zip(*parts))


# ------------------------------------------------------------------------------------------------
# the fused pass
# ------------------------------------------------------------------------------------------------

# columns of the per-row sum matrix returned by _row_pass (float32 [B, K])
_N, _SD, _SX, _SY, _SXX, _SYY, _SDD, _SK3, _SCHI, _SPD, _CAT = range(11)
_SE, _SC, _SCC, _HI, _LO, _CHG = range(11, 17)  # token level only
# columns of the per-row max matrix: max |p diff|, max clamped log rho, -min clamped log rho
_MPD, _MLW, _NEG_MIN_LW = range(3)
_K3_SERIES_BELOW = 0.25  # |log rho| below which rho - 1 - log rho comes from its Taylor series


_LOG2E = 1.4426950408889634


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp, written as exp2(x log2 e) in float32.

    Inductor's CPU heuristic materialises every re-used node that contains ``exp`` as a whole
    [B, T] buffer (``should_realize_on_reuse``), which splits the fused pass into several passes
    over memory; ``exp2`` is not on its list. The rounding of x log2 e costs < 2e-6 relative at
    |x| = 20 and ~1e-7 near 0. float64 (reference precision) keeps exp."""
    return torch.exp(x) if x.dtype == torch.float64 else torch.exp2(x * _LOG2E)


def _k3_and_rho(log_ratio: torch.Tensor):
    """(rho - 1 - log rho, rho - 1, rho) from a (clamped) log rho, accurate in float32 near rho = 1.

    ``exp(x) - 1 - x`` cancels to nothing as x -> 0 (torch.compile's vectorised expm1 is exp - 1,
    no better), so below |x| = 0.25 the series x^2/2 + x^3/6 + ... + x^6/720 is used: its first
    omitted term, x^7/5040, is < 3e-7 of the value there (below float32 resolution). float64
    inputs use expm1, which is exact to float64 there."""
    x = log_ratio
    rho = _exp(x)
    if x.dtype == torch.float64:  # float64 (reference precision): expm1 is accurate, the series is not enough
        e = torch.expm1(x)
        return e - x, e, rho
    series = x * x * (0.5 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 + x * (1.0 / 720)))))
    small = x.abs() < _K3_SERIES_BELOW
    k3 = torch.where(small, series, rho - 1.0 - x)
    return k3, torch.where(small, series + x, rho - 1.0), rho


def _row_pass(old, roll, mask, brackets, *, token_level: bool, mode_fn, lower: float, upper: float, log_veto, want_weights: bool):
    """The one pass over [b, T] rows. Returns (sums [b, K], maxes [b, 1 or 3], bracket counts
    [b, 3Q] | None, weights [b, T] | None, strictly-inside-a-bracket flags [b, T] uint8 | None).
    Row sums are float32 (counts exact below 2^24); the caller finishes them in float64."""
    m = mask if mask.dtype == torch.bool else mask != 0  # [b, T]
    x = old.float() if old.dtype != torch.float64 else old  # [b, T] log pi_train
    y = roll.to(x.dtype)  # [b, T] log pi_rollout
    d = x - y  # [b, T] log rho, raw (veto and sums of the log-ratio use it unclamped)
    dc = LEVELS["token"](d, None, None)  # [b, T] clamped log rho = token-level log-weight
    k3, e, w = _k3_and_rho(dc)  # [b, T] each: rho - 1 - log rho, rho - 1 (exact near 1), rho = token weight
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    one = torch.ones((), dtype=x.dtype, device=x.device)

    def rsum(v):
        return torch.where(m, v, zero).sum(-1)  # [b]

    def rcount(cond):
        return torch.where(m & cond, one, zero).sum(-1)  # [b] float count (exact below 2^24)

    # |p_train - p_rollout| = exp(max(x, y)) (1 - exp(-|log rho|)) = exp(max(x, y)) |rho - 1| / max(rho, 1):
    # one exp instead of two, and exact near rho = 1 where exp(x) - exp(y) cancels (the clamp of
    # log rho at +-20 changes it by < 2.1e-9 of the larger probability)
    pdiff = _exp(torch.maximum(x, y)) * e.abs() / w.clamp_min(1.0)  # [b, T]
    cat = d < log_veto if log_veto is not None else torch.zeros_like(m)  # [b, T] catastrophic tokens
    sums = [
        torch.where(m, one, zero).sum(-1), rsum(d), rsum(x), rsum(y), rsum(x * x), rsum(y * y), rsum(d * d),
        rsum(k3), rsum(e * (e + 2.0)), rsum(pdiff), rcount(cat),
    ]  # fmt: skip
    maxes = [torch.where(m, pdiff, zero).amax(-1)]
    counts = weights = inb = None
    if token_level:
        c1 = e.clamp(lower - 1.0, upper - 1.0)  # [b, T] clamp(w, lower, upper) - 1 (std / ESS)
        wm, chg = mode_fn(w, lower, upper)  # [b, T] thresholded weights, "changed by the mode"
        sums += [rsum(e), rsum(c1), rsum(c1 * c1), rcount(w > upper), rcount(w < lower), rcount(chg)]
        maxes += [torch.where(m, dc, -math.inf).amax(-1), torch.where(m, -dc, -math.inf).amax(-1)]
        if brackets is not None:  # exact percentiles: counts at, and members strictly inside, each bracket
            v = torch.where(m, dc, math.inf)  # [b, T] padding sorts above everything
            cols, inside = [], None
            for j in range(brackets.shape[0]):
                a, bb = brackets[j, 0], brackets[j, 1]
                cols += [torch.where(v < a, one, zero).sum(-1), torch.where(v <= a, one, zero).sum(-1),
                         torch.where(v <= bb, one, zero).sum(-1)]  # fmt: skip
                hit = (v > a) & (v < bb)
                inside = hit if inside is None else inside | hit
            counts = torch.stack(cols, -1)  # [b, 3Q]
            # uint8: inductor writes it far faster than bool. The (harmless) dependence on the row
            # count pulls this store into the row loop that already holds the data, instead of a
            # separate pass over [B, T].
            inb = (inside & (sums[_N][:, None] > 0)).to(torch.uint8)  # [b, T]
        if want_weights:
            veto = (m & cat).any(-1, keepdim=True)  # [b, 1]
            weights = torch.where(m & ~veto, wm, zero)  # [b, T]
    return torch.stack(sums, -1), torch.stack(maxes, -1), counts, weights, inb


# ------------------------------------------------------------------------------------------------
# percentiles without torch.quantile
# ------------------------------------------------------------------------------------------------

_EXACT_SORT_MAX = 1 << 20  # up to this many elements, percentiles come from one sort of the valid values
_SAMPLE_SIZE = 1 << 17  # sampled valid tokens used to bracket each order statistic
_BRACKET_SIGMAS = 5.0  # bracket half-width in binomial standard deviations of the sample rank
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def _ranks(q: float, n: int):
    pos = q / 100.0 * (n - 1)  # numpy "linear": value = v[lo] + (v[hi] - v[lo]) * (pos - lo)
    lo = int(math.floor(pos))
    return lo, min(lo + 1, n - 1), pos - lo


def _clamped_log_ratio(o: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    x = o.float() if o.dtype != torch.float64 else o  # the dtype _row_pass computes in
    return (x - r.to(x.dtype)).clamp(-SAFETY_BOUND, SAFETY_BOUND)


def _valid_log_weights(old, roll, m):
    return _clamped_log_ratio(old[m], roll[m])  # [N] exactly the values _row_pass sees


def _stratified_sample(old, roll, m, sample_size: int):
    """Sorted clamped log-ratios of the valid tokens among 2 * sample_size stratified positions
    (about sample_size of them at 50% padding), deterministic; None when fewer than 1024.

    One position per stratum of the flattened [B, T] grid, jittered inside it by a Weyl sequence
    (j * golden ratio mod 1): the positions are increasing (a prefetch-friendly gather) yet do not
    alias with the row length; the padding ones are dropped."""
    numel = m.numel()
    n_raw = min(numel, 2 * sample_size)
    j = torch.arange(n_raw, dtype=torch.float64, device=m.device)
    idx = ((j + (j * _GOLDEN) % 1.0) * (numel / n_raw)).long().clamp_(max=numel - 1)  # [n_raw] increasing
    idx = idx[m.reshape(-1)[idx]]
    if idx.numel() < 1024:
        return None
    return _clamped_log_ratio(old.reshape(-1)[idx], roll.reshape(-1)[idx]).sort().values  # [~sample_size]


def _sample_brackets(old, roll, m, sample_size: int, sigmas: float):
    """Bracket each percentile's order statistics from the stratified sample.

    For quantile q, the sample order statistics at q (n - 1) -/+ (sigmas sqrt(n q (1 - q)) + 2)
    bound the population's order statistics with high probability. The bounds are checked exactly
    afterwards (counts), so a miss costs a fallback, never a wrong value. Returns [Q, 2]
    (lower, upper), or None when the sample holds too few valid tokens."""
    s = _stratified_sample(old, roll, m, sample_size)
    if s is None:
        return None
    n = s.numel()
    rows = []
    for q in PERCENTILES:
        u = q / 100.0
        half = sigmas * math.sqrt(n * u * (1.0 - u)) + 2.0
        lo, hi = math.floor(u * (n - 1) - half), math.ceil(u * (n - 1) + half)
        # beyond the sample's ends the bracket runs to the clamp bounds, which hold every value
        rows.append([s[min(lo, n - 1)].item() if lo >= 0 else -SAFETY_BOUND, s[max(hi, 0)].item() if hi < n else SAFETY_BOUND])
    return torch.tensor(rows, dtype=s.dtype, device=s.device)


def _sampled_percentiles(s: torch.Tensor) -> list[float]:
    """Percentile ESTIMATES from the sorted sample (linear interpolation, on the weights)."""
    out = []
    for q in PERCENTILES:
        lo, hi, f = _ranks(q, s.numel())
        a, b = math.exp(s[lo].item()), math.exp(s[hi].item())
        out.append(a + (b - a) * f)
    return out


def _token_percentiles(old, roll, m, n_valid: int, brackets, counts, inb) -> list[float]:
    """Exact linear-interpolated percentiles of the valid token weights exp(clamp(log rho)).

    exp is monotone, so the order statistics of the weights are exp of those of the clamped
    log-ratio. Small inputs: one sort of the valid values. Large inputs: the fused pass counted,
    per bracket [a, b], the valid values < a, <= a and <= b, and flagged those strictly inside.
    Sorted, the valid values read  [< a] [= a] [inside] [= b] [> b],  so the rank k falls on a (ties
    included), inside (one small sort of the flagged values), or on b; if the sample missed, that
    rank falls back to kthvalue over all valid values. Sorting the ~17M valid values of an
    8192x4096 batch takes seconds; this sorts a few percent of them. Interpolation is done on the
    weights, in float64."""
    out = []
    if brackets is None:
        v = _valid_log_weights(old, roll, m).sort().values
        for q in PERCENTILES:
            lo, hi, f = _ranks(q, n_valid)
            a, b = math.exp(v[lo].item()), math.exp(v[hi].item())
            out.append(a + (b - a) * f)
        return out
    tot = counts.to(torch.float64).sum(0).view(-1, 3).tolist()  # [Q][#<a, #<=a, #<=b]
    idx = inb.reshape(-1).view(torch.bool).nonzero().squeeze(1)  # [few % of N] flat positions inside a bracket
    flagged = _clamped_log_ratio(old.reshape(-1)[idx], roll.reshape(-1)[idx])
    everything = None
    for (a, b), (lt_a, le_a, le_b), q in zip(brackets.tolist(), tot, PERCENTILES):
        inner = flagged[(flagged > a) & (flagged < b)].sort().values
        lt_b = le_a + inner.numel()
        lo, hi, f = _ranks(q, n_valid)
        vals = []
        for k in (lo, hi):
            if lt_a <= k < le_a:
                vals.append(a)
            elif le_a <= k < lt_b:
                vals.append(inner[int(k - le_a)].item())
            elif lt_b <= k < le_b:
                vals.append(b)
            else:  # the sample's bracket missed this rank: exact and slow
                if everything is None:
                    everything = _valid_log_weights(old, roll, m)
                vals.append(everything.kthvalue(int(k) + 1).values.item())
        wa, wb = math.exp(vals[0]), math.exp(vals[1])
        out.append(wa + (wb - wa) * f)
    return out


def _row_percentiles(log_w: torch.Tensor, n: torch.Tensor, n_valid: int) -> list[float]:
    """Percentiles of per-row weights repeated n_i times (sequence / geometric levels): a sort of the
    B row values and a search in the cumulative counts, no [B, T] work."""
    order = log_w.argsort()
    lw, cum = log_w[order], n[order].cumsum(0)  # [R], [R]
    out = []
    for q in PERCENTILES:
        lo, hi, f = _ranks(q, n_valid)
        ks = torch.tensor([lo, hi], dtype=cum.dtype, device=cum.device)
        i = torch.searchsorted(cum, ks, right=True)  # first row whose cumulative count exceeds k
        a, b = torch.exp(lw[i]).tolist()
        out.append(a + (b - a) * f)
    return out


# ------------------------------------------------------------------------------------------------
# public API
# ------------------------------------------------------------------------------------------------


def _check(old_log_prob, rollout_log_prob, response_mask):
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"shape mismatch: old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
            f"{tuple(rollout_log_prob.shape)}, response_mask {tuple(response_mask.shape)}; all must be [B, T]"
        )
    if old_log_prob.dim() != 2:
        raise ValueError(f"expected [B, T] tensors, got {old_log_prob.dim()}-d")


def _mismatch_from_rows(s: torch.Tensor, pmax: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mismatch metrics from the float64 per-row sums of _row_pass (0-d tensors)."""
    n = s[:, _N]
    ntot = n.sum()
    sv, nv = s[valid], n[valid]  # [R, K], [R]
    mx, my = sv[:, _SX] / nv, sv[:, _SY] / nv  # [R] mean log-prob per row
    lpd = -sv[:, _SD] / nv  # [R] mean rollout logp - mean train logp, from the log-ratio sum
    ex, ey, ed = s[:, _SX].sum() / ntot, s[:, _SY].sum() / ntot, s[:, _SD].sum() / ntot
    vx = (s[:, _SXX].sum() / ntot - ex * ex).clamp_min(0)
    vy = (s[:, _SYY].sum() / ntot - ey * ey).clamp_min(0)
    vd = (s[:, _SDD].sum() / ntot - ed * ed).clamp_min(0)
    # cov(x, y) = (var x + var y - var(x - y)) / 2: exact as x -> y, where E[xy] - E[x]E[y] cancels
    denom = torch.sqrt(vx * vy)
    pearson = torch.where(denom > 0, ((vx + vy - vd) / 2 / denom).clamp(-1, 1), torch.full_like(denom, math.nan))
    return {
        "mismatch_kl": -ed,
        "mismatch_k3_kl": s[:, _SK3].sum() / ntot,
        "mismatch_training_ppl": torch.exp(-mx).mean(),
        "mismatch_training_log_ppl": (-mx).mean(),
        "mismatch_rollout_ppl": torch.exp(-my).mean(),
        "mismatch_rollout_log_ppl": (-my).mean(),
        "mismatch_log_ppl_diff": lpd.mean(),
        "mismatch_log_ppl_abs_diff": lpd.abs().mean(),
        "mismatch_log_ppl_diff_max": lpd.max(),
        "mismatch_log_ppl_diff_min": lpd.min(),
        "mismatch_ppl_ratio": torch.exp(lpd).mean(),
        "mismatch_chi2_token": s[:, _SCHI].sum() / ntot,
        "mismatch_chi2_seq": torch.exp(2.0 * sv[:, _SD].clamp(-SAFETY_BOUND, SAFETY_BOUND)).mean() - 1.0,
        "mismatch_prob_diff": s[:, _SPD].sum() / ntot,
        "mismatch_prob_diff_max": pmax.max(),
        "mismatch_pearson": pearson,
    }


def _to_floats(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    vals = torch.stack([metrics[k].to(torch.float64).reshape(()) for k in keys]).tolist() if keys else []
    out = {f"mismatch/{k}": float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    out.update({f"mismatch/{k}": v for k, v in zip(keys, vals)})
    return out


@torch.no_grad()
def compute_mismatch_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Sampler-vs-trainer mismatch metrics (KL, ppl, chi2, prob diff, Pearson); see the module doc."""
    _check(old_log_prob, rollout_log_prob, response_mask)
    sums, maxes, *_ = _run_rows(
        _row_pass, (old_log_prob.detach(), rollout_log_prob.detach(), response_mask), (None,),
        token_level=False, mode_fn=_truncate, lower=0.0, upper=1.0, log_veto=None, want_weights=False,
    )  # fmt: skip
    s = sums.to(torch.float64)  # [B, K] finishing in float64: [B]-sized, cheap, no cancellation worries
    valid = s[:, _N] > 0
    if not bool(valid.any()):
        raise ValueError("response_mask has no valid token")
    return _to_floats(_mismatch_from_rows(s, maxes[:, _MPD].to(torch.float64), valid))


def _is_bounds(level, mode, threshold, threshold_lower, veto):
    """Validated settings of ``compute_rollout_is_weights``: (mode function, lower, upper, log veto | None)."""
    if level not in LEVELS:
        raise ValueError(f"unknown rollout_is_level '{level}'; valid: {sorted(LEVELS)}")
    mode_fn = load_fn(mode, MODES, "rollout_is_mode")
    upper = float(threshold)
    lower = 1.0 / upper if threshold_lower is None else float(threshold_lower)
    if not upper > 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {upper}")
    if not 0 <= lower <= upper:
        how = "given" if threshold_lower is not None else "default 1/rollout_is_threshold"
        raise ValueError(
            f"need 0 <= rollout_is_threshold_lower ({lower}, {how}) <= rollout_is_threshold ({upper})"
        )
    if veto is not None and not veto > 0:
        raise ValueError(f"rollout_is_veto_threshold must be > 0 or None, got {veto}")
    return mode_fn, lower, upper, (None if veto is None else math.log(veto))


def _token_level_stats(s, maxes, valid, ntot, met) -> tuple[torch.Tensor, torch.Tensor]:
    """Token level: the weight statistics from the fused pass's row sums into ``met``; returns
    (tokens changed by the mode per row [B], per-row mean pre-threshold weight [R])."""
    mc, mcc = s[:, _SC].sum() / ntot, s[:, _SCC].sum() / ntot  # E[c - 1], E[(c - 1)^2]
    mx = maxes.to(torch.float64)  # [B, 3]
    met["rollout_is_mean"] = 1.0 + s[:, _SE].sum() / ntot
    met["rollout_is_max"] = torch.exp(mx[valid, _MLW].max())
    met["rollout_is_min"] = torch.exp(-mx[valid, _NEG_MIN_LW].max())
    met["rollout_is_std"] = torch.sqrt((mcc - mc * mc).clamp_min(0))
    met["rollout_is_eff_sample_size"] = (1 + mc) ** 2 / (1 + 2 * mc + mcc)
    met["rollout_is_ratio_fraction_high"] = s[:, _HI].sum() / ntot  # tokens above upper
    met["rollout_is_ratio_fraction_low"] = s[:, _LO].sum() / ntot
    return s[:, _CHG], 1.0 + s[valid, _SE] / s[valid, _N]


def _row_level_stats(s, level, valid, ntot, mode_fn, lower: float, upper: float, met):
    """Sequence / geometric level: one weight per row. Fills ``met``; returns (tokens changed per row [B],
    per-row weight [R], percentiles, thresholded row weights [B])."""
    n = s[:, _N]
    log_w = LEVELS[level](None, s[:, _SD], n)  # [B] float64 log-weight per row
    w_row = torch.exp(log_w)  # [B]
    lwv, wv = log_w[valid], w_row[valid]  # [R]
    c = w_row.clamp(lower, upper)  # [B]
    mc, mcc = (n * (c - 1)).sum() / ntot, (n * (c - 1) ** 2).sum() / ntot
    new_w, chg = mode_fn(w_row, lower, upper)  # [B]
    met["rollout_is_mean"] = (n * w_row).sum() / ntot
    met["rollout_is_max"] = wv.max()
    met["rollout_is_min"] = wv.min()
    met["rollout_is_std"] = torch.sqrt((mcc - mc * mc).clamp_min(0))
    met["rollout_is_eff_sample_size"] = (1 + mc) ** 2 / (1 + 2 * mc + mcc)
    met["rollout_is_ratio_fraction_high"] = ((w_row > upper).double() * n).sum() / ntot
    met["rollout_is_ratio_fraction_low"] = ((w_row < lower).double() * n).sum() / ntot
    return chg.double() * n, wv, _row_percentiles(lwv, n[valid], int(n.sum().item())), new_w


def _percentile_inputs(old, roll, m, percentile_sample_size: Optional[int]):
    """Token level: (the sorted sample the percentiles are estimated from | None, the brackets of the
    exact selection | None); both None: one sort of the valid values."""
    sample = brackets = None
    if percentile_sample_size is not None and m.numel() > 2 * percentile_sample_size:
        sample = _stratified_sample(old, roll, m, int(percentile_sample_size))
    if sample is None and m.numel() > _EXACT_SORT_MAX:
        brackets = _sample_brackets(old, roll, m, _SAMPLE_SIZE, _BRACKET_SIGMAS)
    return sample, brackets


def _row_weights(new_w: torch.Tensor, vetoed: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One weight per row [B] (0 on vetoed rows) broadcast over the row's valid tokens: [B, T], float32
    (float64 for float64 inputs)."""
    dt = dtype if dtype == torch.float64 else torch.float32
    row = torch.where(vetoed, torch.zeros_like(new_w), new_w).to(dt)  # [B]
    return torch.where(m, row[:, None], torch.zeros((), dtype=dt, device=m.device))  # [B, T]


def _shared_stats(met, changed, valid, ntot, pct, seq_w, lower: float, upper: float) -> None:
    """The statistics every level reports the same way."""
    met["rollout_is_clipped_fraction"] = changed.sum() / ntot
    met["rollout_is_seq_clipped_fraction"] = (changed[valid] > 0).double().mean()
    for q, v in zip(PERCENTILES, pct):
        met[f"rollout_is_p{q}"] = v
    met["rollout_is_seq_mean"] = seq_w.mean()
    met["rollout_is_seq_std"] = seq_w.std() if seq_w.numel() > 1 else torch.zeros((), dtype=torch.float64)
    met["rollout_is_seq_max"] = seq_w.max()
    met["rollout_is_seq_min"] = seq_w.min()
    met["rollout_is_seq_max_deviation"] = (seq_w - 1.0).abs().max()
    met["rollout_is_seq_fraction_high"] = (seq_w > upper).double().mean()
    met["rollout_is_seq_fraction_low"] = (seq_w < lower).double().mean()


@torch.no_grad()
def compute_rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is_level: str = "token",
    rollout_is_mode: str = "truncate",
    rollout_is_threshold: Optional[float] = 2.0,
    rollout_is_threshold_lower: Optional[float] = None,
    rollout_is_veto_threshold: Optional[float] = 1e-4,
    rollout_is: bool = True,
    percentile_sample_size: Optional[int] = None,
) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, float]]:
    """Rollout-IS weights [B, T] and the ``mismatch/`` metrics (IS statistics + mismatch metrics).

    ``rollout_is_threshold=None`` disables everything: returns ``(None, response_mask, {})``.
    ``rollout_is=False`` is metrics-only: all metrics are computed, the weights are returned as None.
    ``response_mask`` is returned unchanged (rejection lives in ``compute_rejection_mask``).
    Weights are float32 (float64 for float64 inputs), 0 on padding and vetoed rows, detached.

    The token-level percentiles are exact by default. ``percentile_sample_size=n`` instead
    ESTIMATES them from a deterministic stratified sample of 2n positions (about n valid tokens
    at 50% padding) whenever the batch holds more than 2n positions; the rank error is about
    sqrt(q (1 - q) / n_valid_sampled), e.g. 0.14% of the tokens at the median for 2^17 sampled
    tokens. That skips the exact selection, roughly half the cost of a token-level call at
    8192 x 4096. Sequence/geometric percentiles are always exact (they cost nothing).
    """
    if rollout_is_threshold is None:
        return None, response_mask, {}
    _check(old_log_prob, rollout_log_prob, response_mask)
    mode_fn, lower, upper, log_veto = _is_bounds(rollout_is_level, rollout_is_mode, rollout_is_threshold,
                                                 rollout_is_threshold_lower, rollout_is_veto_threshold)
    old, roll = old_log_prob.detach(), rollout_log_prob.detach()
    m = response_mask if response_mask.dtype == torch.bool else response_mask != 0  # [B, T]
    token_level = rollout_is_level == "token"
    sample, brackets = _percentile_inputs(old, roll, m, percentile_sample_size) if token_level else (None, None)
    sums, maxes, counts, weights, inb = _run_rows(
        _row_pass, (old, roll, m), (brackets,), token_level=token_level, mode_fn=mode_fn,
        lower=lower, upper=upper, log_veto=log_veto, want_weights=bool(rollout_is) and token_level,
    )  # fmt: skip
    s = sums.to(torch.float64)  # [B, K]
    valid = s[:, _N] > 0  # [B] rows with at least one valid token
    if not bool(valid.any()):
        raise ValueError("response_mask has no valid token")
    ntot = s[:, _N].sum()
    vetoed = s[:, _CAT] > 0  # [B]
    met: dict[str, torch.Tensor | float] = {"rollout_is_veto_fraction": vetoed[valid].double().mean(),
                                            "rollout_is_catastrophic_token_fraction": s[:, _CAT].sum() / ntot}
    if token_level:
        changed, seq_w = _token_level_stats(s, maxes, valid, ntot, met)
        pct = (_sampled_percentiles(sample) if sample is not None
               else _token_percentiles(old, roll, m, int(ntot.item()), brackets, counts, inb))
    else:
        changed, seq_w, pct, new_w = _row_level_stats(s, rollout_is_level, valid, ntot, mode_fn, lower, upper, met)
        weights = _row_weights(new_w, vetoed, m, old.dtype) if rollout_is else None
    _shared_stats(met, changed, valid, ntot, pct, seq_w, lower, upper)
    met.update(_mismatch_from_rows(s, maxes[:, _MPD].to(torch.float64), valid))
    return (weights if rollout_is else None), response_mask, _to_floats(met)


def _reject_pass(old, roll, mask, *, div_fn, agg: str, lower, upper):
    m = mask if mask.dtype == torch.bool else mask != 0  # [b, T]
    d = _clamped_log_ratio(old, roll)  # [b, T]
    k = div_fn(d)  # [b, T] per-token divergence
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    if agg == "token":
        stat = k  # [b, T]
    elif agg == "seq_max":
        stat = torch.where(m, k, -math.inf).amax(-1, keepdim=True)  # [b, 1]
    else:
        ssum = torch.where(m, k, zero).sum(-1, keepdim=True)  # [b, 1]
        stat = ssum if agg == "seq_sum" else ssum / m.sum(-1, keepdim=True).clamp_min(1)
    keep = torch.ones_like(stat, dtype=torch.bool)
    if lower is not None:
        keep = keep & (stat >= lower)
    if upper is not None:
        keep = keep & (stat <= upper)
    keep_t = m & keep  # [b, T]
    n = m.sum(-1).to(k.dtype)  # [b]
    kept = keep_t.sum(-1).to(k.dtype)  # [b]
    if agg == "token":
        st = torch.stack([torch.where(m, k, zero).sum(-1), torch.where(m, k, -math.inf).amax(-1), -torch.where(m, k, math.inf).amin(-1)], -1)
    else:
        s1 = stat[:, 0]
        st = torch.stack([s1, s1, -s1], -1)  # [b, 3] (row stat; the aggregation below is over rows)
    return torch.stack([n, kept], -1), st, keep_t


@torch.no_grad()
def compute_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    divergence: str = "k3",
    agg: str = "seq_mean",
    lower: Optional[float] = None,
    upper: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rejection sampling by a divergence of rollout from trainer policy (verl's ``rollout_rs``).

    Per-token divergence D_t from the clamped log rho (``DIVERGENCES``: k1 = -log rho, k2 =
    (log rho)^2 / 2, k3 = rho - 1 - log rho), aggregated by ``agg``: "token" (each token on its
    own), "seq_sum" / "seq_mean" / "seq_max" (over the row's valid tokens; the whole row is kept or
    dropped). A token or row is kept iff ``lower <= stat <= upper`` (a None bound is open). Returns
    ``(response_mask * keep`` in the mask's dtype, ``metrics)`` with the rejected token fraction
    ``rollout_rs_masked_fraction``, the fraction of rows that lost any token
    ``rollout_rs_seq_masked_fraction``, and the statistic's mean/max/min: the mean is over valid
    tokens for every ``agg`` (a row statistic counts once per token of its row, verl's
    ``masked_mean`` of the per-token statistic), max/min over tokens ("token") or rows. verl's k1 thresholds are ratio bounds: its ``"lo_hi"`` equals
    ``lower=log(lo), upper=log(hi)`` here.
    """
    _check(old_log_prob, rollout_log_prob, response_mask)
    div_fn = load_fn(divergence, DIVERGENCES, "rejection divergence")
    if agg not in REJECTION_AGGS:
        raise ValueError(f"unknown rejection agg '{agg}'; valid: {list(REJECTION_AGGS)}")
    if lower is None and upper is None:
        raise ValueError("compute_rejection_mask needs a lower and/or upper bound")
    if lower is not None and upper is not None and lower > upper:
        raise ValueError(f"rejection bounds: lower ({lower}) > upper ({upper})")
    counts, st, keep = _run_rows(
        _reject_pass, (old_log_prob.detach(), rollout_log_prob.detach(), response_mask),
        div_fn=div_fn, agg=agg, lower=lower, upper=upper,
    )  # fmt: skip
    c, st = counts.to(torch.float64), st.to(torch.float64)
    n, kept = c[:, 0], c[:, 1]
    valid = n > 0
    ntot = n.sum().clamp_min(1)
    if agg == "token":
        stat_mean, stat_max, stat_min = st[:, 0].sum() / ntot, st[valid, 1].max(), -st[valid, 2].max()
    else:  # the row statistic on each of the row's tokens, token-weighted as verl's masked_mean over them
        sv = st[valid, 0]
        stat_mean, stat_max, stat_min = (sv * n[valid]).sum() / ntot, sv.max(), sv.min()
    name = f"rollout_rs_{agg}_{divergence}" if isinstance(divergence, str) else f"rollout_rs_{agg}"
    met = {
        "rollout_rs_masked_fraction": (n - kept).sum() / ntot,
        "rollout_rs_seq_masked_fraction": (kept[valid] < n[valid]).double().mean(),
        f"{name}_mean": stat_mean,
        f"{name}_max": stat_max,
        f"{name}_min": stat_min,
    }
    if not bool(valid.any()):
        met = {k: 0.0 for k in met}
    new_mask = response_mask * keep.to(response_mask.dtype) if response_mask.dtype != torch.bool else keep
    return new_mask, _to_floats(met)
