"""Rollout correction composed in one place: rollout IS weights, rejection and bypass mode.

The sampler and the trainer assign slightly different probabilities to the same tokens (Yao et al.
2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
https://fengyao.notion.site/off-policy-rl; verl's rollout-correction docs, ``docs/algo/rollout_corr.md``
and ``rollout_corr_math.md``). Given the trainer's log-probs ``log pi`` (the old log-probs in the
decoupled mode, the current ones in bypass mode or on the on-policy path), the sampler's
``log pi_rollout`` and the response mask ``m`` (1 on the tokens as sampled), with
``log rho_t = log pi_t - log pi_rollout_t``:

    weights    w = IS(log rho, m)                      ``rollout_is.compute_rollout_is_weights``
    rejection  keep_k = R_k(log rho, m)   for every option k of the comma list (``compute_rejection_mask``)
    loss mask  m' = m AND keep_1 AND ... AND keep_K

Every option's statistic (a token's divergence, or a row's sum / mean / max of it) is computed on the
ORIGINAL mask ``m`` and the results are combined with AND, as verl's ``compute_rollout_rejection_mask``
does: a row whose first token fails ``token_k1`` still has that token in its ``seq_mean_k3``. Applying
the options one after another instead (each on the mask left by the previous) is a different, and
order-dependent, rule. The IS weights, and their batch normalisation (verl's
``rollout_is_batch_normalize``: divided by their mean over the valid tokens at token level, over the
rows at sequence / geometric level), are also taken on ``m``: a sequence-level weight is the product
over every token the sampler produced, rejected or not.

Rejection and the veto only mask the LOSS. The rewards and the advantage estimators read the batch as
sampled: the driver (``trainer/step.py: driver_math``) hands the estimator the original response mask
(``trainer/algos/advantages.py`` sums each row's reward over that mask), so rejecting the last token of
a row never wipes its outcome reward, and a fully rejected row keeps its place in its GRPO group with
the reward it earned (verl's estimators sum the rewards over the whole row for the same reason). The
advantages are then zeroed outside ``m'``. Rejected rows are counted in their own metric,
``rollout_rs_seq_rejected_fraction`` (rows with every valid token rejected, over rows with at least one).

Bypass mode (``rollout_correction.bypass_mode``): the old log-probs ARE the sampler's, so ``log rho``
is the current policy against the sampler. ``ppo_clip``: the PPO ratio pi / pi_rollout already is the
correction, so no IS weights are returned (their metrics still are); ``reinforce``: the weights
multiply the policy gradient. Both reject on the original mask. In bypass mode the weights exist only inside
the loss, one micro-batch at a time, so their batch normalisation is verl's: the mean over the micro-batch
being trained, summed over every rank that trains its share of it (``batch_reduce``, an all-reduce over the
strategy's loss group; verl's ``distributed_masked_mean``), not over the whole batch.

Metrics: the IS and mismatch metrics of ``compute_rollout_is_weights`` (``mismatch/`` prefix),
``rollout_is_batch_norm_factor`` when normalising, and per rejection option the metrics of
``compute_rejection_mask``; with two or more options each option's keys carry its
``{agg}_{divergence}`` and ``mismatch/rollout_rs_masked_fraction`` / ``..._seq_masked_fraction`` are
those of the combined mask.

Deviation from verl (deliberate): rows with no valid token are left out of the per-row fractions
(verl's combined ``seq_masked_fraction`` divides by every row); see ``rollout_is`` for the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from trainer.algos.rollout_is import compute_rejection_mask, compute_rollout_is_weights

BYPASS_LOSSES = ("ppo_clip", "reinforce")


@dataclass(frozen=True)
class Correction:
    """What the loss reads: the mask it aggregates over, the IS weights (None: not applied) and metrics."""

    loss_mask: torch.Tensor  # [B, T] the response mask after rejection, in the input mask's dtype
    weights: Optional[torch.Tensor]  # [B, T] detached IS weights, 0 on padding; None when not applied
    metrics: dict[str, float]


def parse_is_threshold(spec) -> tuple[float, Optional[float]]:
    """verl 0.9.1's ``rollout_is_threshold``: a number (or numeric string) is the truncation bound
    (TIS), ``"lo_hi"`` (e.g. ``"0.5_2.0"``) the IcePop band: weights outside [lo, hi] are zeroed.
    Returns ``(upper, lower)``, ``lower`` None for a single bound."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lo_hi' string, got {spec!r}")
    text = str(spec).strip()
    lo_text, sep, hi_text = text.partition("_")
    try:
        upper = float(hi_text if sep else text)
        lower = float(lo_text) if sep else None
    except ValueError as e:
        raise ValueError(f"rollout_is_threshold={spec!r} is neither a number nor a 'lo_hi' pair of numbers") from e
    # finite: an unbounded weight is what rollout_is=null means (verl gives inf no meaning here)
    if not (math.isfinite(upper) and upper > 0) or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold={spec!r}: need finite bounds with 0 < lower <= upper and upper > 0")
    return upper, lower


def _is_kwargs(settings) -> dict:
    return dict(settings) if isinstance(settings, Mapping) else settings.kwargs()


def _option(r) -> dict:
    if isinstance(r, Mapping):
        return {k: r[k] for k in ("divergence", "agg", "lower", "upper")}
    return dict(divergence=r.divergence, agg=r.agg, lower=r.lower, upper=r.upper)


def _normalize(w: torch.Tensor, mask: torch.Tensor, level: str,
               reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> tuple[torch.Tensor, float]:
    """Weights over their batch mean (tokens at token level, rows otherwise), and that mean (1.0 when
    it is ~0, where the weights are left as they are). ``reduce``: sums a tensor over the ranks that hold
    the rest of the batch (None: this batch is all of it)."""
    m = mask.to(torch.float64)  # [B, T]; the sums in float64, so the mean does not depend on the split
    w64 = w.to(torch.float64)
    if level == "token":
        sums = torch.stack([(w64 * m).sum(), m.sum()])
    else:  # one weight per sequence
        rows = m.sum(-1) > 0  # [B]
        seq_w = (w64 * m).sum(-1) / m.sum(-1).clamp_min(1)  # [B]
        sums = torch.stack([seq_w[rows].sum(), rows.sum().to(torch.float64)])
    if reduce is not None:
        sums = reduce(sums)
    mean = float(sums[0] / sums[1]) if float(sums[1]) > 0 else 1.0
    if mean > 1e-8:
        return w / mean, mean
    return w, 1.0


def _rejected_rows(mask: torch.Tensor, keep: torch.Tensor) -> float:
    valid = mask.bool().any(-1)  # [B]
    dropped = valid & ~(keep.bool() & mask.bool()).any(-1)  # [B] every valid token rejected
    return float(dropped.sum()) / max(int(valid.sum()), 1)


def _reject(log_prob, rollout_log_prob, mask, options: Sequence[dict]) -> tuple[torch.Tensor, dict[str, float]]:
    """Every option on the original ``mask``, combined with AND; the metrics named as above."""
    keep, met = mask, {}
    for r in options:
        kept, rs_m = compute_rejection_mask(log_prob, rollout_log_prob, mask, **r)
        keep = keep & kept if keep.dtype == torch.bool else keep * kept
        if len(options) > 1:  # one metric set per option
            rs_m = {k.replace("rollout_rs_", f"rollout_rs_{r['agg']}_{r['divergence']}_", 1): v for k, v in rs_m.items()}
        met.update(rs_m)
    valid_tok = mask.bool()
    if len(options) > 1:  # the combined mask's fractions under the plain names
        n = max(int(valid_tok.sum()), 1)
        lost = valid_tok & ~keep.bool()  # [B, T]
        rows = valid_tok.any(-1)  # [B]
        met["mismatch/rollout_rs_masked_fraction"] = float(lost.sum()) / n
        met["mismatch/rollout_rs_seq_masked_fraction"] = float(lost.any(-1)[rows].double().mean()) if bool(rows.any()) else 0.0
    met["mismatch/rollout_rs_seq_rejected_fraction"] = _rejected_rows(mask, keep)
    return keep, met


@torch.no_grad()
def compose_correction(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: Any = None,
    rejection: Optional[Sequence] = None,
    bypass: Optional[str] = None,
    apply_weights: bool = True,
    batch_normalize: bool = False,
    batch_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    with_metrics: bool = True,
) -> Correction:
    """The loss mask, IS weights and metrics of one batch (see the module doc).

    ``log_prob``: the trainer's log-probs (old ones, or the current ones in bypass mode / on-policy),
    ``rollout_log_prob`` the sampler's, ``response_mask`` the mask as sampled, all [B, T].
    ``rollout_is``: keyword arguments of ``compute_rollout_is_weights`` (a mapping or an object with
    ``kwargs()``, e.g. ``trainer.plan.RolloutIS``); None = no IS and no mismatch metrics.
    ``rejection``: options, each with ``divergence, agg, lower, upper`` (``trainer.plan.Rejection`` or
    a mapping); None or empty = no rejection. ``bypass``: None, ``"ppo_clip"`` (weights computed for
    their metrics, not returned) or ``"reinforce"``. ``apply_weights=False``: metrics only.
    ``batch_normalize``: the weights divided by their batch mean, taken on ``response_mask``;
    ``batch_reduce`` sums the mean's numerator and count over the ranks holding the rest of the batch
    (bypass mode, inside the loss: see the module doc).
    ``with_metrics=False`` (inside a loss, where nobody reads them): IS is computed only where its
    weights are returned, and no metrics come back. A mask with no valid token returns it unchanged with no weights and no metrics."""
    if bypass is not None and bypass not in BYPASS_LOSSES:
        raise ValueError(f"bypass loss '{bypass}' is not one of {list(BYPASS_LOSSES)}")
    if not bool(response_mask.bool().any()):
        return Correction(response_mask, None, {})
    metrics: dict[str, float] = {}
    weights = None
    kw = {} if rollout_is is None else _is_kwargs(rollout_is)
    want = rollout_is is not None and apply_weights and bypass != "ppo_clip" and kw.get("rollout_is", True)
    if rollout_is is not None and (want or with_metrics):
        weights, _, is_m = compute_rollout_is_weights(log_prob, rollout_log_prob, response_mask,
                                                      **{**kw, "rollout_is": bool(want)})
        metrics.update(is_m)
        if weights is not None and batch_normalize:
            weights, metrics["rollout_is_batch_norm_factor"] = _normalize(weights, response_mask,
                                                                          kw.get("rollout_is_level", "token"),
                                                                          batch_reduce)
    loss_mask = response_mask
    if rejection:
        loss_mask, rs_m = _reject(log_prob, rollout_log_prob, response_mask, [_option(r) for r in rejection])
        metrics.update(rs_m)
    return Correction(loss_mask, weights, metrics if with_metrics else {})
