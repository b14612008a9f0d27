"""Worker metrics reduced over every micro-batch of every data-parallel rank.

A rank sees one shard of each mini-batch, split into micro-batches of unequal token counts; a metric
averaged per micro-batch, or taken from one rank, is not the mini-batch's value. So a rank returns,
per mini-batch, PARTIALS: ``{key: (kind, num, den)}``, and the driver combines the DP ranks'
partials (:func:`reduce_partials`). Kinds:

  ``mean``  a weighted mean: ``num`` = sum of value x weight, ``den`` = sum of weights. Token means
            (clip fractions, ``ppo_kl``, ``vpred_mean``, ...) are weighted by the micro-batch's valid
            tokens, sequence means by its sequences, so the result is the token (sequence) mean over
            the whole mini-batch, as verl's per-micro-batch token means are meant to be. Over the
            mini-batches of a step the same weights apply (the whole step's token mean). Scalars that
            are the same on every rank (``grad_norm``, ``lr``) are means of weight 1.
  ``sum``   a loss share: each micro-batch's loss is its part of the global mini-batch loss times
            ``dp_size`` (``trainer.algos.losses.LossAgg``), so the sum over micro-batches and ranks
            divided by ``dp_size`` is the mini-batch loss; the step value is the mean over the step's
            mini-batches.
  ``max`` / ``min``  over everything.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

try:
    import psutil  # optional: the node's CPU memory metric is left out without it
except ImportError:  # pragma: no cover
    psutil = None

MEAN, SUM, MAX, MIN = "mean", "sum", "max", "min"

# metrics of the policy losses that are means over sequences (rows with a valid token), not tokens
SEQ_MEANS = frozenset({"seq_ratio_mean"})


def _f(v) -> float:
    return float(v.detach().double()) if isinstance(v, torch.Tensor) else float(v)


def loss_metric_kind(name: str) -> str:
    """How a metric of a policy / value loss (one call over one micro-batch) combines: ``*_max`` and
    ``*_min`` are extremes, everything else is a masked mean."""
    if name.endswith("_max"):
        return MAX
    if name.endswith("_min"):
        return MIN
    return MEAN


class Partials:
    """One mini-batch's partial metrics on one rank."""

    def __init__(self):
        self.parts: dict[str, list] = {}

    def add(self, key: str, kind: str, value, weight=1.0) -> None:
        value, weight = _f(value), _f(weight)
        p = self.parts.get(key)
        if p is None:
            if kind == MEAN:
                self.parts[key] = [MEAN, value * weight if weight else 0.0, weight]
            else:
                self.parts[key] = [kind, value, 1.0]
            return
        if p[0] != kind:
            raise ValueError(f"metric {key!r} reported as {kind} and as {p[0]}")
        if kind == MEAN:
            if weight:
                p[1] += value * weight
                p[2] += weight
        elif kind == SUM:
            p[1] += value
        elif kind == MAX:
            p[1] = max(p[1], value)
        else:
            p[1] = min(p[1], value)

    def add_loss_metrics(self, prefix: str, metrics: Mapping, *, tokens, seqs) -> None:
        """The metrics dict of one loss call over one micro-batch with ``tokens`` valid tokens in
        ``seqs`` rows. A micro-batch without valid tokens adds nothing (its masked means are 0)."""
        tokens, seqs = _f(tokens), _f(seqs)
        if tokens <= 0:
            return
        for k, v in metrics.items():
            kind = loss_metric_kind(k)
            self.add(prefix + k, kind, v, seqs if k in SEQ_MEANS else tokens)

    def to_dict(self) -> dict[str, tuple]:
        return {k: tuple(v) for k, v in self.parts.items()}


def memory_partials(acc: Partials, prefix: str = "perf/") -> None:
    """verl's memory metrics of an update: the device's peak allocated / reserved memory (CUDA only)
    and the node's used CPU memory (``psutil.virtual_memory().used``)."""
    if torch.cuda.is_available():
        acc.add(prefix + "max_memory_allocated_gb", MAX, torch.cuda.max_memory_allocated() / 1024**3)
        acc.add(prefix + "max_memory_reserved_gb", MAX, torch.cuda.max_memory_reserved() / 1024**3)
    if psutil is not None:
        acc.add(prefix + "cpu_memory_used_gb", MEAN, psutil.virtual_memory().used / 1024**3)


def step_partials(acc: Partials, prefix: str, m: Mapping) -> None:
    """The optimizer step's own metrics (the same on every rank): ``grad_norm``, ``lr``, ``skipped``, ``lora/*``,
    the total ``loss`` (this rank's micro-batch sum, a share x dp_size) and the memory metrics."""
    for k in ("grad_norm", "lr", "skipped"):
        if k in m:
            acc.add(prefix + k, MEAN, m[k])
    for k in m:  # a strategy's report of what it trains (LoRA: lora/adapters, lora/optimizer_params, ...)
        if k.startswith("lora/"):
            acc.add(prefix + k, MEAN, m[k])
    if "loss" in m:
        acc.add(prefix + "loss", SUM, m["loss"])
    memory_partials(acc)


def reduce_partials(per_rank: Sequence[Sequence[Mapping]], dp_size: int) -> tuple[dict[str, float], list[dict[str, float]]]:
    """``per_rank[d][k]``: DP rank d's partials of mini-batch k (``Partials.to_dict()``). Returns the
    step's metrics and each mini-batch's, every one exact over all ranks (see the module doc)."""
    n_mb = max((len(r) for r in per_rank), default=0)
    per_mb: list[dict[str, float]] = []
    step_parts: dict[str, list] = {}
    for k in range(n_mb):
        merged: dict[str, list] = {}
        for rank in per_rank:
            if k >= len(rank):
                continue
            for key, (kind, num, den) in rank[k].items():
                m = merged.setdefault(key, [kind, None, 0.0])
                if kind == MEAN or kind == SUM:
                    m[1] = (m[1] or 0.0) + num
                    m[2] += den
                elif kind == MAX:
                    m[1] = num if m[1] is None else max(m[1], num)
                else:
                    m[1] = num if m[1] is None else min(m[1], num)
        row = {}
        for key, (kind, num, den) in merged.items():
            if kind == MEAN:
                row[key] = num / den if den > 0 else 0.0
            elif kind == SUM:
                row[key] = num / dp_size
            else:
                row[key] = num
            s = step_parts.setdefault(key, [kind, None, 0.0])
            if kind == MEAN:
                s[1], s[2] = (s[1] or 0.0) + num, s[2] + den
            elif kind == SUM:
                s[1], s[2] = (s[1] or 0.0) + row[key], s[2] + 1.0
            elif kind == MAX:
                s[1] = row[key] if s[1] is None else max(s[1], row[key])
            else:
                s[1] = row[key] if s[1] is None else min(s[1], row[key])
        per_mb.append(row)
    step = {}
    for key, (kind, num, den) in step_parts.items():
        step[key] = (num / den if den > 0 else 0.0) if kind in (MEAN, SUM) else num
    return step, per_mb


def entropy_summary(entropy: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """What the driver needs for the step entropy under any ``loss_agg_mode`` without per-token
    entropies leaving the rank: token sum and count, the rows' sums and means, the rows counted."""
    m = mask.bool()
    e = torch.where(m, entropy.double(), torch.zeros((), dtype=torch.float64))
    n_i = m.sum(-1)
    has = n_i > 0
    row_sum = e.sum(-1)
    return {"sum": float(row_sum.sum()), "count": float(n_i.sum()), "seq_sum": float(row_sum[has].sum()),
            "seq_mean": float((row_sum[has] / n_i[has]).sum()), "seqs": float(has.sum())}


def entropy_from_summary(s: Mapping[str, float], mode: str, norm_constant: float | None = None) -> float:
    """The entropy of the whole batch aggregated as the loss is (``trainer.algos.losses.agg_loss``
    over the whole batch with ``mode``), from the DP ranks' summed :func:`entropy_summary`: verl's
    ``actor/entropy`` (the start-of-step policy's entropy on the rollout, ``agg_loss`` by
    ``loss_agg_mode``)."""
    if mode in ("token-mean",):
        return s["sum"] / max(s["count"], 1.0)
    if mode == "token-sum":
        return s["sum"]
    seqs = max(s["seqs"], 1.0)
    if mode == "seq-mean-token-sum":
        return s["seq_sum"] / seqs
    if mode == "seq-mean-token-mean":
        return s["seq_mean"] / seqs
    if mode == "seq-mean-token-sum-norm":
        return s["seq_sum"] / float(norm_constant) / seqs
    raise ValueError(f"unknown loss_agg_mode {mode!r}")
