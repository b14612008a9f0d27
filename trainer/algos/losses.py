"""Policy losses and loss aggregation, as pure functions over ``[B, T]`` tensors.

Notation (per token t of response i; ``m`` is the response mask, 1 on tokens that count):
  * ``Δ_t = clamp(logp_t − old_t, −20, 20)`` the log ratio, ``r_t = exp(Δ_t)`` the ratio. The clamp
    keeps ``exp`` finite for stale or corrupt log-probs; it never binds for a sane policy.
  * ``A_t`` the advantage; ``ε_l, ε_h`` = ``clip_ratio_low`` / ``clip_ratio_high`` (each falls back to
    ``clip_ratio``); ``c`` = ``clip_ratio_c``.
  * Every loss below is a per-token loss ``ℓ_t`` (what is minimised). If ``rollout_is_weights`` ``w_t``
    are given, ``ℓ_t ← sg(w_t) · ℓ_t`` BEFORE aggregation (truncated IS for the sampler/trainer
    mismatch); ``sg`` is stop-gradient, so no gradient ever flows into ``w``.

Losses (``POLICY_LOSSES``; ``get_policy_loss_fn(name)`` also takes ``"pkg.module:function"``):
  * ``vanilla`` — PPO clip (Schulman et al. 2017, arXiv:1707.06347) with decoupled bounds
    (DAPO "clip-higher", Yu et al. 2025, arXiv:2503.14476) and dual clip for A < 0
    (Ye et al. 2020, arXiv:1912.09729):
        ℓ_t = max(−A r, −A clip(r, 1−ε_l, 1+ε_h));  if A < 0: ℓ_t ← min(ℓ_t, −A c)   (c > 1).
  * ``gspo`` — GSPO (Zheng et al. 2025, arXiv:2507.18071). Sequence ratio
    ``s_i = exp(Σ_t m Δ_t / Σ_t m)`` used per token in its stop-gradient form
    ``s_{i,t} = sg(s_i) · exp(logp_t − sg(logp_t))`` (value s_i, gradient s_i ∇logp_t, which lets
    token-level advantages through), then the PPO clip on ``s_{i,t}``. Default aggregation
    ``seq-mean-token-mean``, which is the paper's objective; the defaults for the bounds are the
    paper's ε_l = 3e-4, ε_h = 4e-4 (used only when no ``clip_ratio*`` is passed).
  * ``gpg`` — GPG (Chu et al. 2025, arXiv:2504.02546): ``ℓ_t = −A logp_t`` (no ratio, no clip).
  * ``clip_cov`` — Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs",
    arXiv:2505.22617). Token covariance ``cov_t = (A_t − mean A)(logp_t − mean logp)`` (means over the
    valid tokens of the call, detached). Among valid tokens that the PPO clip did not already clip and
    with ``clip_cov_lb < cov_t < clip_cov_ub``, ``max(1, ⌊clip_cov_ratio · N_valid⌋)`` are picked
    uniformly at random (``generator`` makes it reproducible) and their gradient is cut (ℓ_t ← 0).
    The rest get the PPO clip loss (no dual clip, as in the paper).
  * ``kl_cov`` — KL-Cov (same paper): no ratio clipping; the ``k = max(1, ⌊kl_cov_ratio · N_valid⌋)``
    valid tokens with the largest ``cov_t`` get a KL penalty: ``ℓ_t = −A r + ppo_kl_coef · |Δ_t|``;
    all others ``ℓ_t = −A r``.
  * ``geo_mean`` — GMPO (Zhao et al. 2025, arXiv:2507.20673): per sequence, the geometric mean of the
    token ratios with the clip in log space, sign-aware as in PPO:
        Δ̃_t = min(Δ_t, ε_h) if A_t > 0,  max(Δ_t, −ε_l) if A_t < 0,  0 if A_t = 0;
        ρ_i = exp(Σ_t m Δ̃_t / Σ_t m),  Ā_i = Σ_t m A_t / Σ_t m,  L_i = −Ā_i ρ_i.
    ``clip_ratio_low/high`` are LOG-space bounds here (paper default 0.4). ``L_i`` is written onto every
    valid token of sequence i and then aggregated; with the default ``seq-mean-token-mean`` this is
    exactly the paper's ``mean_i L_i``.
  * ``cispo`` — CISPO (MiniMax-M1, arXiv:2506.13585): ``ℓ_t = −sg(clip(r, 1−ε_l, 1+ε_h)) · A · logp_t``:
    the IS weight is clipped and detached, so every token keeps a gradient. (The paper sets ε_l large,
    i.e. effectively no lower bound; pass ``clip_ratio_low`` accordingly.)

  * ``sapo`` — SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347): the hard
    clip replaced by a smooth gate, ``ℓ_t = −A · f_τ(r)``, ``f_τ(r) = σ(τ (r − 1)) · 4/τ`` with
    ``τ = tau_pos`` where A > 0 and ``tau_neg`` otherwise (verl's ``actor.tau_pos`` / ``tau_neg``, 1.0 /
    1.05). Its gradient ``A · r · 4σ(1−σ) ∇logp`` equals PPO's at r = 1 and decays smoothly away from it.
    Always aggregated ``seq-mean-token-mean`` whatever ``agg.mode`` says (the paper's objective; verl
    does the same), with the global sequence count.
  * ``dro`` — DRO (Richemond et al. 2024, arXiv:2405.19107; the on-policy form of Kimi k1.5,
    arXiv:2501.12599): ``ℓ_t = −(A logp_t − ½ β Δ_t²)``, a quadratic proximal penalty instead of a
    clip; ``β`` = ``policy_loss.dro_beta`` (required, > 0).
  * ``dppo_tv`` / ``dppo_kl`` — DPPO (arXiv:2602.04879): the trust region is a per-token divergence
    between the old and new probability of the sampled token instead of a ratio band. With
    ``p = exp(logp)``, ``q = exp(old)``: a token is kept when A > 0 and the divergence of a rise is within
    ``δ_h``, or A ≤ 0 and that of a fall is within ``δ_l`` (``δ_l, δ_h`` = ``clip_ratio_low/high``, each
    falling back to ``clip_ratio``: here they are DIVERGENCE bounds, not ratio bounds):
        TV:  A > 0: p − q ≤ δ_h;   A ≤ 0: p − q ≥ −δ_l
        KL:  with D = q log(q/p) + (1−q) log((1−q+1e-8)/(1−p+1e-8)) (binary KL):
             A > 0: D ≤ δ_h or p ≤ q;   A ≤ 0: D ≤ δ_l or p ≥ q
    ``ℓ_t = −A · sg(min(r, c)) · logp_t · keep_t`` with ``c = clip_ratio_c`` (truncated IS in place of
    dual clip; the paper recommends a large c). ``pg_clipfrac`` is the fraction NOT kept,
    ``pg_clipfrac_lower`` the kept tokens whose ratio exceeds c (as in verl).
  * ``cpgd`` — CPGD (Liu et al. 2025, arXiv:2505.12504; siiRL's ``cpgd`` loss): a policy gradient on
    the log ratio, clipped in log space and pessimistically, plus a policy-drift penalty:
        Δ̃_t = min(Δ_t, ln(1+ε_h)) if A > 0,  max(Δ_t, ln(1−ε_l)) if A < 0;  ℓ_t = −A · Δ̃_t
        drift_t = sg(r − 1 − Δ_t) + sg(min(r − 1, 2)) · (logp_t − sg(logp_t))
    and the loss is ``agg(w ⊙ ℓ) + policy_drift_coeff · agg(drift)`` (IS weights ``w`` on the policy
    term only). ``drift_t``'s value is the k3 estimate of KL(π_old ‖ π_θ) and its gradient
    ``min(r − 1, 2) ∇logp`` (the k3 gradient with the ratio capped at 3, siiRL's). Deviations from
    siiRL, whose gradients are the same: siiRL's policy term is ``−A · clip(logp)`` (value off by the
    constant ``A · old``; we log the paper's ``−A · clip(Δ)``), its drift value is
    ``min(r − 1, 2) · logp`` (we log the KL estimate), siiRL adds the drift whenever
    ``adv_estimator=cpgd`` whatever the loss, where here it belongs to ``loss_mode=cpgd``, and siiRL's
    loss takes no rollout-IS weights, where here they multiply the policy term (not the drift).

``bypass_mode`` (verl's loss name for ``algorithm.rollout_correction.bypass_mode=true``, which verl
sets itself) is not a function here: the config maps it onto that mode, whose IS / rejection run in
the worker around ``vanilla`` (``loss_type=ppo_clip``) or ``gpg`` with IS weights (``reinforce``).

Aggregation (``agg_loss``; every loss takes its settings as one ``agg: LossAgg``, whose ``mode`` is one of
the rows below), with ``x = m ⊙ ℓ``, ``n_i = Σ_t m_{i,t}``, ``S`` = sequences with n_i ≥ 1:
    token-mean               Σ_{i,t} x / N_tok
    token-sum                Σ_{i,t} x
    seq-mean-token-sum       Σ_i (Σ_t x_i)            / N_seq
    seq-mean-token-mean      Σ_i (Σ_t x_i / n_i)      / N_seq     (a sequence with n_i = 0 adds 0)
    seq-mean-token-sum-norm  Σ_i (Σ_t x_i / K)        / N_seq     (Dr.GRPO, Liu et al. 2025; K =
                             ``agg.norm_constant``, default T = ``loss_mat.shape[-1]``)
  A sequence counts towards N_seq only if it has at least one valid token (fully masked padding rows
  neither add nor dilute). ``batch_norm_counts`` returns (N_tok, N_seq) with exactly this rule.

GLOBAL normalisation (why ``LossAgg``'s ``global_*`` and ``dp_size`` fields exist). A mini-batch is split into
micro-batches (gradient accumulation) and over data-parallel ranks. If every micro-batch normalised by
its own counts, the result would weight tokens by the size of the micro-batch they landed in. Instead
the caller sums ``batch_norm_counts`` over every micro-batch of the mini-batch on every DP rank
(an all-reduce) and passes the totals as ``global_num_tokens`` / ``global_num_seqs``. Each micro-batch
then returns ``Σ(its part) / N_global``, so summing micro-batch losses gives exactly the full-batch
loss and gradient. Megatron's DDP AVERAGES gradients over the DP ranks (it scales by 1/dp_size), so
the micro-batch loss is multiplied by ``dp_size`` to turn that average back into the global sum.
Caveats for the caller:
  * megatron-core's ``forward_backward_func`` also divides a 2-tuple loss by ``num_microbatches``; the
    worker must multiply by it (or otherwise undo it), exactly as it undoes the DP average here.
  * for ``seq-mean-token-sum-norm`` pass ``norm_constant`` (e.g. ``data.max_response_length``) when
    micro-batches are padded to different T, otherwise K differs between micro-batches.
  * with the globals left as None the local counts are used, so one call over the whole batch is the
    textbook definition.
  * ``clip_cov`` and ``kl_cov`` select tokens by a covariance over the tokens of ONE call, so their
    selection (not their aggregation) depends on how the batch is split; that is the paper's (and
    verl's) behaviour, per micro-batch.

Entropy bonus and KL loss: these are plain ``agg_loss(entropy, mask, agg)`` and
``agg_loss(kl, mask, agg)`` with the same ``LossAgg`` (so the same global counts); the worker forms
``pg_loss − entropy_coeff · entropy_loss + kl_coef · kl_loss``. No helper is needed.

Metrics (0-dim detached tensors, over valid tokens only; no ``.item()`` so no device sync):
  * ``pg_clipfrac``: fraction of tokens where the PPO clip is active, i.e. the clipped term won
    (A > 0 and r > 1+ε_h, or A < 0 and r < 1−ε_l) — verl's definition; split into
    ``pg_clipfrac_upper_bound`` and ``pg_clipfrac_lower_bound``.
  * ``pg_clipfrac_lower``: the dual-clip fraction (A < 0 and −A r > −A c), named as in verl.
  * ``ppo_kl`` = mean(old − logp); ``log_ratio_abs_mean`` = mean |Δ|; ``is_ratio_mean/min/max`` of the
    token ratio r (the policy drift, for every loss including GSPO/GMPO, whose sequence ratios are in
    ``seq_ratio_mean/min/max``).
  * ``pg_loss_unclipped_mean`` = mean(−A r), ``pg_loss_clipped_mean`` = mean of the per-token loss the
    chosen method uses (before IS weights).
  * ``adv_abs_mean/min/max``, ``adv_nonzero_frac``; ``rollout_is_weight_mean/min`` when weights are given.
  * loss-specific: ``clipcov_frac`` (tokens whose gradient Clip-Cov cut), ``klcov_frac`` (tokens
    KL-Cov penalised). Clip fractions that a method cannot have are reported as 0 so that every
    ratio-based loss logs the same keys.

Padding: every input is read only where ``response_mask`` is set (selected with ``where``, never
multiplied by the mask), so NaN/inf log-probs, advantages or IS weights in padded positions reach
neither the loss, the metrics nor the gradient.

Deviations from verl's implementations (all deliberate): ``clip_cov``/``kl_cov``/``geo_mean``/``dro`` clamp Δ
to ±20 like the others; ``gspo`` and ``geo_mean`` honour the ``agg.mode`` they are given (their default
``agg`` is the papers' ``seq-mean-token-mean``) and use the global counts; ``geo_mean`` applies IS weights per token before
aggregation (an arithmetic mean over the sequence, where verl takes a geometric one; identical for
sequence-level weights); ``pg_clipfrac`` keeps its meaning in every loss (Clip-Cov's own fraction is
``clipcov_frac``).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from trainer.algos.utils import load_fn, masked_mean

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

_LOG_RATIO_CLAMP = 20.0


# --------------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------------


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode '{loss_agg_mode}'; valid: {list(AGG_MODES)}")


def batch_norm_counts(loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean"):
    """Normaliser counts of one (micro-)batch: ``(num_tokens, num_seqs)`` as 0-dim int64 tensors.

    ``num_tokens`` = valid tokens; ``num_seqs`` = sequences with at least one valid token (the same rule
    ``agg_loss`` uses). The caller sums these over all micro-batches of a mini-batch and all-reduces
    them over the DP group to get ``global_num_tokens`` / ``global_num_seqs``. Tensors, not ints, so
    that no device sync is forced and they can go straight into an all-reduce.
    """
    _check_mode(loss_agg_mode)
    m = loss_mask.bool()  # [B, T]
    num_tokens = m.sum()  # []
    num_seqs = m.any(dim=-1).sum()  # []
    return num_tokens, num_seqs


@dataclass(frozen=True)
class LossAgg:
    """How a per-token loss [B, T] becomes this micro-batch's share of the global mini-batch loss."""
    mode: str = "token-mean"                 # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm | token-sum
    global_num_tokens: float | None = None   # valid tokens in the whole mini-batch (all micro-batches, all DP ranks); None = this micro-batch's
    global_num_seqs: float | None = None     # sequences with >= 1 valid token in the whole mini-batch; None = this micro-batch's
    dp_size: int = 1                         # data-parallel ranks whose gradients are averaged
    norm_constant: float | None = None       # seq-mean-token-sum-norm's constant; None = the response width

    def __post_init__(self):
        _check_mode(self.mode)


# the papers' aggregation for gspo and geo_mean (their default when the caller passes none)
_SEQ_MEAN_TOKEN_MEAN = LossAgg(mode="seq-mean-token-mean")


def _as_count(n, like: torch.Tensor) -> torch.Tensor:
    """A count (int, float or tensor) as a tensor of ``like``'s dtype, at least 1 (an empty global
    batch then gives 0 / 1 = 0 instead of NaN)."""
    return torch.as_tensor(n, device=like.device).to(like.dtype).clamp_min(1.0)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, agg: LossAgg) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to this micro-batch's share of the global-batch loss.

    See the module docstring for the five modes and the global-normalisation contract. Masked
    positions are selected out with ``where`` (not multiplied), so NaN/inf padding cannot leak in.
    The reduction runs in at least float32 (a bf16 sum over many tokens would lose the loss) and the
    result keeps that dtype.
    """
    if not isinstance(agg, LossAgg):
        raise TypeError(f"agg must be a LossAgg, got {type(agg).__name__}")
    mode = agg.mode
    acc = torch.promote_types(loss_mat.dtype, torch.float32)
    m = loss_mask.bool()  # [B, T]
    x = torch.where(m, loss_mat.to(acc), torch.zeros((), dtype=acc, device=loss_mat.device))  # [B, T]

    if mode == "token-sum":
        return x.sum() * agg.dp_size
    if mode == "token-mean":
        n_tok = m.sum() if agg.global_num_tokens is None else agg.global_num_tokens
        return x.sum() / _as_count(n_tok, x) * agg.dp_size

    seq_sum = x.sum(dim=-1)  # [B]
    if mode == "seq-mean-token-sum":
        per_seq = seq_sum  # [B]
    elif mode == "seq-mean-token-mean":
        n_i = m.sum(dim=-1).to(acc).clamp_min(1.0)  # [B]; an empty row has seq_sum 0 -> adds 0
        per_seq = seq_sum / n_i  # [B]
    else:  # seq-mean-token-sum-norm
        k = loss_mat.shape[-1] if agg.norm_constant is None else agg.norm_constant
        per_seq = seq_sum / k  # [B]
    n_seq = m.any(dim=-1).sum() if agg.global_num_seqs is None else agg.global_num_seqs
    return per_seq.sum() / _as_count(n_seq, x) * agg.dp_size


# --------------------------------------------------------------------------------------------------
# Shared pieces of the policy losses
# --------------------------------------------------------------------------------------------------


def _bounds(clip_ratio, clip_ratio_low, clip_ratio_high, default: float) -> tuple[float, float]:
    base = default if clip_ratio is None else clip_ratio
    low = base if clip_ratio_low is None else clip_ratio_low
    high = base if clip_ratio_high is None else clip_ratio_high
    return float(low), float(high)


def _pad0(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x`` with padded positions set to 0 (by ``where``, whose backward sends exactly 0 there), so
    that a NaN/inf in padding can reach neither the loss nor, through ``0 * inf``, the gradient."""
    return torch.where(m, x, torch.zeros_like(x))


def _masked_min(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    big = torch.full((), float("inf"), dtype=x.dtype, device=x.device)
    v = torch.where(m, x, big).amin()
    return torch.where(m.any(), v, torch.zeros_like(v))


def _masked_max(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    small = torch.full((), float("-inf"), dtype=x.dtype, device=x.device)
    v = torch.where(m, x, small).amax()
    return torch.where(m.any(), v, torch.zeros_like(v))


def _mmean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Mean over the set entries of ``m``; padding is selected out (not multiplied) so a non-finite
    padded value cannot turn a metric into NaN. Empty mask -> 0."""
    return masked_mean(_pad0(x, m), m)


def _frac(cond: torch.Tensor, m: torch.Tensor, dtype) -> torch.Tensor:
    return masked_mean(cond.to(dtype), m)


def _diagnostics(log_ratio, advantages, m, pg_unclipped, pg_used, weights) -> dict[str, torch.Tensor]:
    """Per-token diagnostics shared by all losses (inputs already detached; ``m`` bool ``[B, T]``)."""
    ratio = torch.exp(log_ratio)  # [B, T]
    adv_abs = advantages.abs()  # [B, T]
    dt = log_ratio.dtype
    out = {
        "ppo_kl": _mmean(-log_ratio, m),
        "log_ratio_abs_mean": _mmean(log_ratio.abs(), m),
        "is_ratio_mean": _mmean(ratio, m),
        "is_ratio_min": _masked_min(ratio, m),
        "is_ratio_max": _masked_max(ratio, m),
        "pg_loss_unclipped_mean": _mmean(pg_unclipped, m),
        "pg_loss_clipped_mean": _mmean(pg_used, m),
        "adv_abs_mean": _mmean(adv_abs, m),
        "adv_abs_min": _masked_min(adv_abs, m),
        "adv_abs_max": _masked_max(adv_abs, m),
        "adv_nonzero_frac": _frac(advantages != 0, m, dt),
    }
    if weights is not None:
        out["rollout_is_weight_mean"] = _mmean(weights, m)
        out["rollout_is_weight_min"] = _masked_min(weights, m)
    return out


def _clip_metrics(upper, lower, dual, m, dt) -> dict[str, torch.Tensor]:
    return {
        "pg_clipfrac": _frac(upper | lower, m, dt),
        "pg_clipfrac_upper_bound": _frac(upper, m, dt),
        "pg_clipfrac_lower_bound": _frac(lower, m, dt),
        "pg_clipfrac_lower": _frac(dual, m, dt),
    }


def _seq_ratio_metrics(seq_ratio: torch.Tensor, m: torch.Tensor) -> dict[str, torch.Tensor]:
    has = m.any(dim=-1)  # [B]
    return {
        "seq_ratio_mean": _mmean(seq_ratio, has),
        "seq_ratio_min": _masked_min(seq_ratio, has),
        "seq_ratio_max": _masked_max(seq_ratio, has),
    }


def _finish(pg_losses, response_mask, rollout_is_weights, agg: LossAgg):
    """Apply detached IS weights per token, then aggregate. Returns (loss, detached weights or None)."""
    w = None
    if rollout_is_weights is not None:
        w = _pad0(rollout_is_weights.detach().to(pg_losses.dtype), response_mask.bool())  # [B, T]
        pg_losses = pg_losses * w  # [B, T]
    return agg_loss(pg_losses, response_mask, agg), w


def _log_ratio(old_log_prob, log_prob, m):
    """Clamped log ratio ``[B, T]``; masked positions set to 0 so padding garbage cannot produce inf."""
    d = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    return torch.where(m, d, torch.zeros_like(d))


# --------------------------------------------------------------------------------------------------
# Policy losses
# --------------------------------------------------------------------------------------------------


def _refuse_unknown_keywords(fn: Callable) -> Callable:
    """The policy losses share one calling convention: the train worker passes every loss the family's
    keywords (:func:`loss_keywords`: the tensors, ``agg``, the clip bounds, each variant's hyper-parameters)
    and each reads its own. A keyword outside the family is a mistake (verl's ``loss_agg_mode=``: the
    aggregation here is ``agg``), refused with a ``TypeError`` naming it instead of being swallowed."""
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        unknown = sorted(set(kwargs) - loss_keywords())
        if unknown:
            raise TypeError(f"policy loss {fn.__name__}() got unknown keyword argument(s) {unknown}; the built-in "
                            f"losses take {sorted(loss_keywords())}")
        return fn(*args, **kwargs)
    return checked


@functools.cache
def loss_keywords() -> frozenset:
    """Every parameter name of the built-in policy losses (the family's keywords)."""
    return frozenset(p.name for f in POLICY_LOSSES.values() for p in inspect.signature(f).parameters.values()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))



@_refuse_unknown_keywords
def vanilla(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    agg: LossAgg = LossAgg(),
    rollout_is_weights=None,
    clip_ratio: float | None = None,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    **kwargs,
):
    """PPO clip with decoupled bounds and dual clip (see module docstring)."""
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    eps_l, eps_h = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high, 0.2)
    m = response_mask.bool()  # [B, T]
    advantages = _pad0(advantages, m)  # [B, T]
    log_ratio = _log_ratio(old_log_prob, log_prob, m)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    loss_unclipped = -advantages * ratio  # [B, T]
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - eps_l, 1.0 + eps_h)  # [B, T]
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)  # [B, T] pessimistic (max loss = min objective)
    loss_dual_cap = -advantages * clip_ratio_c  # [B, T]; only meaningful where A < 0 (then > 0)
    neg = advantages < 0  # [B, T]
    pg_losses = torch.where(neg, torch.minimum(loss_ppo, loss_dual_cap), loss_ppo)  # [B, T]

    loss, w = _finish(pg_losses, response_mask, rollout_is_weights, agg)
    with torch.no_grad():
        r = ratio.detach()
        a = advantages.detach()
        dt = r.dtype
        metrics = _clip_metrics(
            upper=(a > 0) & (r > 1.0 + eps_h),
            lower=(a < 0) & (r < 1.0 - eps_l),
            dual=neg & (loss_ppo.detach() > loss_dual_cap.detach()),
            m=m, dt=dt,
        )
        metrics.update(_diagnostics(log_ratio.detach(), a, m, loss_unclipped.detach(), pg_losses.detach(), w))
    return loss, metrics


@_refuse_unknown_keywords
def gspo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    agg: LossAgg = _SEQ_MEAN_TOKEN_MEAN,
    rollout_is_weights=None,
    clip_ratio: float | None = None,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    **kwargs,
):
    """GSPO: PPO clip on the length-normalised sequence ratio, token stop-gradient form."""
    if clip_ratio is None and clip_ratio_low is None and clip_ratio_high is None:
        eps_l, eps_h = 3e-4, 4e-4  # the paper's ranges
    else:
        eps_l, eps_h = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high, 0.2)
    m = response_mask.bool()  # [B, T]
    advantages = _pad0(advantages, m)  # [B, T]
    mf = m.to(log_prob.dtype)  # [B, T]
    log_ratio = _log_ratio(old_log_prob, log_prob, m)  # [B, T]
    n_i = mf.sum(dim=-1).clamp_min(1.0)  # [B]
    seq_log_ratio = (log_ratio.detach() * mf).sum(dim=-1) / n_i  # [B] sg(log s_i)
    seq_log_ratio = seq_log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B]
    # value s_i on every token, gradient s_i * d logp_t (token-level stop-gradient form of the paper);
    # padding is zeroed first so a non-finite padded log-prob cannot turn the gradient into NaN
    lp = _pad0(log_prob, m)  # [B, T]
    tok_ratio = torch.exp(seq_log_ratio.unsqueeze(-1) + lp - lp.detach())  # [B, T]
    loss_unclipped = -advantages * tok_ratio  # [B, T]
    loss_clipped = -advantages * torch.clamp(tok_ratio, 1.0 - eps_l, 1.0 + eps_h)  # [B, T]
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)  # [B, T]

    loss, w = _finish(pg_losses, response_mask, rollout_is_weights, agg)
    with torch.no_grad():
        s = tok_ratio.detach()  # [B, T]
        a = advantages.detach()
        metrics = _clip_metrics(
            upper=(a > 0) & (s > 1.0 + eps_h),
            lower=(a < 0) & (s < 1.0 - eps_l),
            dual=torch.zeros_like(m),
            m=m, dt=s.dtype,
        )
        metrics.update(_diagnostics(log_ratio.detach(), a, m, -a * torch.exp(log_ratio.detach()),
                                    pg_losses.detach(), w))
        metrics.update(_seq_ratio_metrics(torch.exp(seq_log_ratio), m))
    return loss, metrics


@_refuse_unknown_keywords
def gpg(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    agg: LossAgg = LossAgg(),
    rollout_is_weights=None,
    **kwargs,
):
    """GPG: plain policy gradient ``−A logp`` (``old_log_prob`` only feeds the drift diagnostics)."""
    m = response_mask.bool()  # [B, T]
    advantages = _pad0(advantages, m)  # [B, T]
    pg_losses = -advantages * _pad0(log_prob, m)  # [B, T]
    loss, w = _finish(pg_losses, response_mask, rollout_is_weights, agg)
    with torch.no_grad():
        log_ratio = _log_ratio(old_log_prob, log_prob, m).detach()
        a = advantages.detach()
        metrics = _diagnostics(log_ratio, a, m, -a * torch.exp(log_ratio), pg_losses.detach(), w)
    return loss, metrics


def _token_cov(advantages, log_prob, m):
    """``(A_t − mean A)(logp_t − mean logp)`` over the valid tokens of the call, detached ``[B, T]``."""
    a = _pad0(advantages.detach(), m)  # [B, T]
    lp = _pad0(log_prob.detach(), m)  # [B, T]
    return (a - masked_mean(a, m)) * (lp - masked_mean(lp, m))  # [B, T]


@_refuse_unknown_keywords
def clip_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    agg: LossAgg = LossAgg(),
    rollout_is_weights=None,
    clip_ratio: float | None = None,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    **kwargs,
):
    """Clip-Cov: PPO clip, plus cut the gradient of a random few high-covariance tokens."""
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    eps_l, eps_h = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high, 0.2)
    m = response_mask.bool()  # [B, T]
    advantages = _pad0(advantages, m)  # [B, T]
    log_ratio = _log_ratio(old_log_prob, log_prob, m)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    loss_unclipped = -advantages * ratio  # [B, T]
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - eps_l, 1.0 + eps_h)  # [B, T]
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)  # [B, T]

    with torch.no_grad():
        already_clipped = loss_clipped > loss_unclipped  # [B, T]
        cov = _token_cov(advantages, log_prob, m)  # [B, T]
        cand = m & ~already_clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)  # [B, T]
        n_valid = int(m.sum())  # one host sync: the number to pick depends on the data
        n_pick = min(max(int(clip_cov_ratio * n_valid), 1), cand.numel())
        # uniform random subset of the candidates: random keys in [0, 1) for candidates, −1 elsewhere;
        # the top n_pick keys are candidates first, and non-candidates are dropped by ``>= 0``.
        gen_device = generator.device if generator is not None else log_prob.device
        keys = torch.rand(cand.shape, generator=generator, device=gen_device).to(log_prob.device)  # [B, T]
        keys = torch.where(cand, keys, torch.full_like(keys, -1.0))
        top = torch.topk(keys.flatten(), n_pick).indices  # [n_pick]
        cut = torch.zeros(cand.numel(), dtype=torch.bool, device=cand.device)
        cut[top] = keys.flatten()[top] >= 0
        cut = cut.view_as(cand)  # [B, T]
    pg_losses = torch.where(cut, torch.zeros_like(loss_ppo), loss_ppo)  # [B, T]

    loss, w = _finish(pg_losses, response_mask, rollout_is_weights, agg)
    with torch.no_grad():
        r = ratio.detach()
        a = advantages.detach()
        metrics = _clip_metrics(
            upper=(a > 0) & (r > 1.0 + eps_h), lower=(a < 0) & (r < 1.0 - eps_l),
            dual=torch.zeros_like(m), m=m, dt=r.dtype,
        )
        metrics["clipcov_frac"] = _frac(cut, m, r.dtype)
        metrics.update(_diagnostics(log_ratio.detach(), a, m, loss_unclipped.detach(), pg_losses.detach(), w))
    return loss, metrics


@_refuse_unknown_keywords
def kl_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    agg: LossAgg = LossAgg(),
    rollout_is_weights=None,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 1.0,
    **kwargs,
):
    """KL-Cov: unclipped ``−A r``, plus ``ppo_kl_coef·|Δ|`` on the top-covariance tokens."""
    if not kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    m = response_mask.bool()  # [B, T]
    advantages = _pad0(advantages, m)  # [B, T]
    log_ratio = _log_ratio(old_log_prob, log_prob, m)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    loss_unclipped = -advantages * ratio  # [B, T]

    with torch.no_grad():
        n_valid = int(m.sum())  # one host sync: k depends on the data
        sel = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
        if n_valid > 0:
            k = max(1, int(n_valid * kl_cov_ratio))
            cov = _token_cov(advantages, log_prob, m)  # [B, T]
            cov = torch.where(m, cov, torch.full_like(cov, float("-inf"))).flatten()  # [B*T]
            sel[torch.topk(cov, k).indices] = True
        sel = sel.view_as(m)  # [B, T]
    pg_losses = torch.where(sel, loss_unclipped + ppo_kl_coef * log_ratio.abs(), loss_unclipped)  # [B, T]

    loss, w = _finish(pg_losses, response_mask, rollout_is_weights, agg)
    with torch.no_grad():
        a = advantages.detach()
        none = torch.zeros_like(m)
        metrics = _clip_metrics(upper=none, lower=none, dual=none, m=m, dt=ratio.dtype)
        metrics["klcov_frac"] = _frac(sel, m, ratio.dtype)
        metrics.update(_diagnostics(log_ratio.detach(), a, m, loss_unclipped.detach(), pg_losses.detach(), w))
    return loss, metrics


@_refuse_unknown_keywords
def geo_mean(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    agg: LossAgg = _SEQ_MEAN_TOKEN_MEAN,
    rollout_is_weights=None,
    clip_ratio: float | None = None,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    **kwargs,
):
    """GMPO: geometric mean of the (log-space clipped) token ratios per sequence."""
    eps_l, eps_h = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high, 0.4)
    m = response_mask.bool()  # [B, T]
    advantages = _pad0(advantages, m)  # [B, T]
    mf = m.to(log_prob.dtype)  # [B, T]
    log_ratio = _log_ratio(old_log_prob, log_prob, m)  # [B, T]
    pos = advantages > 0  # [B, T]
    neg = advantages < 0  # [B, T]
    # pessimistic clip in log space: cap the gain for A > 0 from above, for A < 0 from below
    clipped_lr = torch.where(pos, torch.clamp(log_ratio, max=eps_h),
                             torch.where(neg, torch.clamp(log_ratio, min=-eps_l), torch.zeros_like(log_ratio)))
    n_i = mf.sum(dim=-1).clamp_min(1.0)  # [B]
    seq_ratio = torch.exp((clipped_lr * mf).sum(dim=-1) / n_i)  # [B] geometric mean ρ_i
    seq_adv = advantages.sum(dim=-1) / n_i  # [B] Ā_i (padding already 0)
    seq_loss = -seq_adv * seq_ratio  # [B] L_i
    pg_losses = seq_loss.unsqueeze(-1).expand_as(log_ratio)  # [B, T] L_i on every token of sequence i

    loss, w = _finish(pg_losses, response_mask, rollout_is_weights, agg)
    with torch.no_grad():
        lr = log_ratio.detach()
        a = advantages.detach()
        metrics = _clip_metrics(
            upper=pos & (lr > eps_h), lower=neg & (lr < -eps_l), dual=torch.zeros_like(m), m=m, dt=lr.dtype,
        )
        metrics.update(_diagnostics(lr, a, m, -a * torch.exp(lr), pg_losses.detach(), w))
        metrics.update(_seq_ratio_metrics(seq_ratio.detach(), m))
    return loss, metrics


@_refuse_unknown_keywords
def cispo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    agg: LossAgg = LossAgg(),
    rollout_is_weights=None,
    clip_ratio: float | None = None,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    **kwargs,
):
    """CISPO: REINFORCE weighted by the clipped, detached IS ratio."""
    eps_l, eps_h = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high, 0.2)
    m = response_mask.bool()  # [B, T]
    advantages = _pad0(advantages, m)  # [B, T]
    log_ratio = _log_ratio(old_log_prob, log_prob, m)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    is_w = torch.clamp(ratio, 1.0 - eps_l, 1.0 + eps_h).detach()  # [B, T] sg(clip(r))
    pg_losses = -is_w * advantages * _pad0(log_prob, m)  # [B, T]

    loss, w = _finish(pg_losses, response_mask, rollout_is_weights, agg)
    with torch.no_grad():
        r = ratio.detach()
        a = advantages.detach()
        metrics = _clip_metrics(
            upper=r > 1.0 + eps_h, lower=r < 1.0 - eps_l, dual=torch.zeros_like(m), m=m, dt=r.dtype,
        )
        metrics.update(_diagnostics(log_ratio.detach(), a, m, -a * r, pg_losses.detach(), w))
    return loss, metrics


@_refuse_unknown_keywords
def sapo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    agg: LossAgg = _SEQ_MEAN_TOKEN_MEAN,
    rollout_is_weights=None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    **kwargs,
):
    """SAPO: −A · σ(τ (r − 1)) · 4/τ, τ by the sign of A; sequence-mean of token-means."""
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"sapo: tau_pos={tau_pos} and tau_neg={tau_neg} must be > 0")
    m = response_mask.bool()  # [B, T]
    advantages = _pad0(advantages, m)  # [B, T]
    log_ratio = _log_ratio(old_log_prob, log_prob, m)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    tau = torch.where(advantages > 0, torch.full_like(ratio, float(tau_pos)), torch.full_like(ratio, float(tau_neg)))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # [B, T] f_τ(r)
    pg_losses = -advantages * gate  # [B, T]
    # the paper's (and verl's) aggregation, whatever the configured mode; the global counts are kept
    loss, w = _finish(pg_losses, response_mask, rollout_is_weights, replace(agg, mode="seq-mean-token-mean"))
    with torch.no_grad():
        a = advantages.detach()
        none = torch.zeros_like(m)
        metrics = _clip_metrics(upper=none, lower=none, dual=none, m=m, dt=ratio.dtype)
        metrics["sapo_gate_mean"] = _mmean(gate.detach(), m)
        metrics.update(_diagnostics(log_ratio.detach(), a, m, -a * ratio.detach(), pg_losses.detach(), w))
    return loss, metrics


@_refuse_unknown_keywords
def dro(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    agg: LossAgg = LossAgg(),
    rollout_is_weights=None,
    dro_beta: float | None = None,
    **kwargs,
):
    """DRO: −(A logp − ½ β (logp − old)²)."""
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(f"dro: policy_loss.dro_beta must be > 0, got {dro_beta}")
    m = response_mask.bool()  # [B, T]
    advantages = _pad0(advantages, m)  # [B, T]
    log_ratio = _log_ratio(old_log_prob, log_prob, m)  # [B, T]
    pg_losses = -(advantages * _pad0(log_prob, m) - 0.5 * float(dro_beta) * log_ratio.square())  # [B, T]
    loss, w = _finish(pg_losses, response_mask, rollout_is_weights, agg)
    with torch.no_grad():
        a = advantages.detach()
        none = torch.zeros_like(m)
        metrics = _clip_metrics(upper=none, lower=none, dual=none, m=m, dt=log_ratio.dtype)
        metrics.update(_diagnostics(log_ratio.detach(), a, m, -a * torch.exp(log_ratio.detach()),
                                    pg_losses.detach(), w))
    return loss, metrics


def _dppo(divergence, old_log_prob, log_prob, advantages, response_mask, *, agg, rollout_is_weights,
          clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c):
    d_low, d_high = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high, 0.2)
    if not clip_ratio_c > 0:
        raise ValueError(f"dppo: clip_ratio_c (the IS truncation) must be > 0, got {clip_ratio_c}")
    m = response_mask.bool()  # [B, T]
    advantages = _pad0(advantages, m)  # [B, T]
    lp, old = _pad0(log_prob, m), _pad0(old_log_prob, m)  # [B, T]
    log_ratio = _log_ratio(old_log_prob, log_prob, m)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    with torch.no_grad():
        p, q = torch.exp(lp.detach()), torch.exp(old.detach())  # [B, T] new / old prob of the sampled token
        if divergence == "tv":
            keep_pos, keep_neg = (p - q) <= d_high, (p - q) >= -d_low
        else:  # binary KL between Bernoulli(q) and Bernoulli(p); a move towards q is always kept
            bkl = q * (old.detach() - lp.detach()) + (1.0 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
            keep_pos, keep_neg = (bkl <= d_high) | (p <= q), (bkl <= d_low) | (p >= q)
        keep = torch.where(advantages > 0, keep_pos, keep_neg)  # [B, T]
        trunc = torch.clamp(ratio.detach(), max=float(clip_ratio_c))  # [B, T] sg(min(r, c))
    pg_losses = -advantages * trunc * lp * keep.to(lp.dtype)  # [B, T]
    loss, w = _finish(pg_losses, response_mask, rollout_is_weights, agg)
    with torch.no_grad():
        a = advantages.detach()
        dt = ratio.dtype
        metrics = {"pg_clipfrac": _frac(~keep, m, dt),
                   "pg_clipfrac_upper_bound": _frac(~keep & (a > 0), m, dt),
                   "pg_clipfrac_lower_bound": _frac(~keep & (a <= 0), m, dt),
                   "pg_clipfrac_lower": _frac(keep & (ratio.detach() > clip_ratio_c), m, dt)}
        metrics.update(_diagnostics(log_ratio.detach(), a, m, -a * ratio.detach(), pg_losses.detach(), w))
    return loss, metrics


@_refuse_unknown_keywords
def dppo_tv(old_log_prob, log_prob, advantages, response_mask, *, agg: LossAgg = LossAgg(), rollout_is_weights=None,
            clip_ratio: float | None = None, clip_ratio_low: float | None = None,
            clip_ratio_high: float | None = None, clip_ratio_c: float = 3.0, **kwargs):
    """DPPO-Binary-TV: policy gradient with truncated IS, kept where |p − q| stays within the bound."""
    return _dppo("tv", old_log_prob, log_prob, advantages, response_mask, agg=agg, rollout_is_weights=rollout_is_weights,
                 clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                 clip_ratio_c=clip_ratio_c)


@_refuse_unknown_keywords
def dppo_kl(old_log_prob, log_prob, advantages, response_mask, *, agg: LossAgg = LossAgg(), rollout_is_weights=None,
            clip_ratio: float | None = None, clip_ratio_low: float | None = None,
            clip_ratio_high: float | None = None, clip_ratio_c: float = 3.0, **kwargs):
    """DPPO-Binary-KL: policy gradient with truncated IS, kept where the binary KL stays within the bound."""
    return _dppo("kl", old_log_prob, log_prob, advantages, response_mask, agg=agg, rollout_is_weights=rollout_is_weights,
                 clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                 clip_ratio_c=clip_ratio_c)


@_refuse_unknown_keywords
def cpgd(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    agg: LossAgg = LossAgg(),
    rollout_is_weights=None,
    clip_ratio: float | None = None,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    policy_drift_coeff: float = 0.0,
    **kwargs,
):
    """CPGD: −A · (log ratio clipped in log space) + policy_drift_coeff · KL(π_old ‖ π_θ) (k3, capped gradient)."""
    eps_l, eps_h = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high, 0.2)
    if not (0 <= eps_l < 1):
        raise ValueError(f"cpgd: clip_ratio_low={eps_l} must be in [0, 1) (the bound is ln(1 − clip_ratio_low))")
    if policy_drift_coeff < 0:
        raise ValueError(f"cpgd: policy_drift_coeff={policy_drift_coeff} must be >= 0")
    m = response_mask.bool()  # [B, T]
    advantages = _pad0(advantages, m)  # [B, T]
    log_ratio = _log_ratio(old_log_prob, log_prob, m)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    hi, lo = math.log1p(eps_h), math.log1p(-eps_l)
    pos, neg = advantages > 0, advantages < 0  # [B, T]
    # pessimistic clip: a gain beyond the band earns nothing more (A > 0 capped above, A < 0 below)
    clipped = torch.where(pos, torch.clamp(log_ratio, max=hi), torch.where(neg, torch.clamp(log_ratio, min=lo), log_ratio))
    pg_losses = -advantages * clipped  # [B, T]
    loss, w = _finish(pg_losses, response_mask, rollout_is_weights, agg)
    drift = None
    if policy_drift_coeff:
        lp = _pad0(log_prob, m)  # [B, T]
        r = ratio.detach()
        drift = (r - 1.0 - log_ratio.detach()) + torch.clamp(r - 1.0, max=2.0) * (lp - lp.detach())  # [B, T]
        loss = loss + float(policy_drift_coeff) * agg_loss(drift, response_mask, agg)
    with torch.no_grad():
        a = advantages.detach()
        lr = log_ratio.detach()
        metrics = _clip_metrics(upper=pos & (lr > hi), lower=neg & (lr < lo), dual=torch.zeros_like(m), m=m, dt=lr.dtype)
        metrics["policy_drift_kl"] = _mmean(ratio.detach() - 1.0 - lr, m)  # k3 estimate of KL(π_old ‖ π_θ)
        metrics.update(_diagnostics(lr, a, m, -a * torch.exp(lr), pg_losses.detach(), w))
    return loss, metrics


POLICY_LOSSES: dict[str, Callable] = {
    "vanilla": vanilla,
    "gspo": gspo,
    "gpg": gpg,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
    "geo_mean": geo_mean,
    "cispo": cispo,
    "sapo": sapo,
    "dro": dro,
    "dppo_tv": dppo_tv,
    "dppo_kl": dppo_kl,
    "cpgd": cpgd,
}


def get_policy_loss_fn(name: str | Callable) -> Callable:
    """A name from ``POLICY_LOSSES``, a callable, or ``"pkg.module:function"`` with the same signature."""
    return load_fn(name, POLICY_LOSSES, "policy loss")


# ---------------------------------------------------------------------------------------------
# critic
# ---------------------------------------------------------------------------------------------
def value_loss(
    vpreds: torch.Tensor,  # [B, T] current critic values
    values: torch.Tensor,  # [B, T] values at the start of the step (old)
    returns: torch.Tensor,  # [B, T] GAE returns
    response_mask: torch.Tensor,  # [B, T]
    *,
    cliprange_value: float = 0.5,
    agg: LossAgg = LossAgg(),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (Schulman et al. 2017; the form in OpenAI baselines):

        V_clip = clip(V, V_old - c, V_old + c)
        loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)

    aggregated with :func:`agg_loss` (global-batch normalisation as for the policy losses). The
    prediction itself is clipped, as verl's ``compute_value_loss`` does: the equivalent
    ``V_old + clip(V - V_old, -c, c)`` can round ``V`` by one ulp inside the range, and that ulp
    makes the clipped term "larger" and the token count as clipped.
    Metrics: ``vf_clipfrac`` (fraction of tokens where the clipped term is the larger one),
    ``vpred_mean``, ``vf_explained_var`` = 1 - Var(R - V) / Var(R) over valid tokens.
    """
    m = response_mask.bool()
    vpreds_f, values_f, returns_f = vpreds.float(), values.float().detach(), returns.float().detach()
    clipped = torch.maximum(torch.minimum(vpreds_f, values_f + cliprange_value), values_f - cliprange_value)
    l1 = (vpreds_f - returns_f) ** 2
    l2 = (clipped - returns_f) ** 2
    loss_mat = 0.5 * torch.maximum(l1, l2)
    loss = agg_loss(loss_mat, m, agg)
    with torch.no_grad():
        n = m.sum().clamp_min(1)
        r = returns_f[m]
        resid = (returns_f - vpreds_f)[m]
        var_r = r.var(unbiased=False) if r.numel() > 1 else torch.zeros(())
        ev = 1.0 - resid.var(unbiased=False) / var_r.clamp_min(1e-8) if r.numel() > 1 else torch.zeros(())
        metrics = {"vf_clipfrac": ((l2 > l1) & m).sum() / n, "vpred_mean": (vpreds_f * m).sum() / n,
                   "vf_explained_var": ev}
    return loss, metrics
