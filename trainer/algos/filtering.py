"""DAPO dynamic sampling (group filter) and overlong reward shaping.

DAPO (Q. Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv:2503.14476):

* **Dynamic sampling** (sec. 3.2). A group of responses to one prompt whose rewards are all equal
  has zero group-relative advantage and so no gradient; DAPO drops such groups and generates more
  until the batch is full. ``group_filter`` keeps the groups whose metric is NOT constant within the
  group, i.e. max > min, which is verl's ``np.std(values) > 0``, and also keeps groups of one sample
  (verl keeps ``len == 1`` groups: with no group to compare against there is nothing to judge).
  A group holding a NaN or an infinity is dropped unless it is a singleton, as verl's test does
  (``np.std`` is NaN there and ``NaN > 0`` is False). Vectorised: one ``scatter_reduce`` (amin /
  amax) and one ``index_add_`` over dense group ids, no loop over groups.

* **Overlong reward shaping** (sec. 3.4, "soft overlong punishment"). With the expected maximum
  ``L_exp = max_response_length - overlong_buffer_len``, a response of length ``L`` gets

      R_len(L) = min(-(L - L_exp) / overlong_buffer_len * penalty_factor, 0)

  i.e. 0 up to ``L_exp``, then falling linearly to ``-penalty_factor`` at ``max_response_length``
  (verl's DAPO reward manager, same formula; the paper's penalty_factor is 1).

The filter metric names follow verl's DAPO trainer: ``seq_reward`` is the sum of the
``token_level_scores`` (the raw scores) and ``seq_final_reward`` the sum of the
``token_level_rewards`` (after KL-in-reward and shaping); ``acc``, ``score`` or any other name is
looked up as a per-sample field.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from trainer.algos.utils import dense_group_ids


def group_filter(metric_values: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Indices (ascending, int64) of the samples whose group's metric is not constant.

    ``metric_values`` [B] (any real or bool dtype), ``index`` [B] group ids (prompt uid). Returns
    ``(kept [K], metrics)`` with ``filter/kept_groups``, ``filter/total_groups``,
    ``filter/kept_fraction`` (of groups) and ``filter/kept_samples``. Every kept index belongs to a
    group that is kept whole.
    """
    if metric_values.dim() != 1 or index.dim() != 1 or metric_values.shape[0] != index.shape[0]:
        raise ValueError(
            f"group_filter wants metric_values [B] and index [B], got {tuple(metric_values.shape)} "
            f"and {tuple(index.shape)}"
        )
    b = metric_values.shape[0]
    if b == 0:
        empty = torch.zeros(0, dtype=torch.long, device=index.device)
        return empty, {"filter/kept_groups": 0.0, "filter/total_groups": 0.0, "filter/kept_fraction": 0.0, "filter/kept_samples": 0.0}
    gid, g = dense_group_ids(index)  # [B] in 0..G-1
    v = metric_values.to(torch.float64)  # [B] exact for every float32 and for ints below 2^53
    finite = torch.isfinite(v)  # [B]
    vf = torch.where(finite, v, torch.zeros_like(v))  # [B] keeps NaN out of amin/amax
    lo = torch.full((g,), float("inf"), dtype=v.dtype, device=v.device).scatter_reduce_(0, gid, vf, "amin")  # [G]
    hi = torch.full((g,), float("-inf"), dtype=v.dtype, device=v.device).scatter_reduce_(0, gid, vf, "amax")  # [G]
    cnt = torch.zeros(g, dtype=torch.long, device=v.device).index_add_(0, gid, torch.ones_like(gid))  # [G]
    bad = torch.zeros(g, dtype=torch.long, device=v.device).index_add_(0, gid, (~finite).long())  # [G]
    keep_g = ((hi > lo) & (bad == 0)) | (cnt == 1)  # [G]
    kept = keep_g[gid].nonzero().squeeze(1)  # [K] ascending sample indices
    n_kept = int(keep_g.sum().item())
    return kept, {
        "filter/kept_groups": float(n_kept),
        "filter/total_groups": float(g),
        "filter/kept_fraction": n_kept / g,
        "filter/kept_samples": float(kept.numel()),
    }


def _sum_field(name: str) -> Callable[[Mapping], torch.Tensor]:
    def f(fields: Mapping) -> torch.Tensor:
        return torch.as_tensor(fields[name]).sum(-1)  # [B] zero-padded token rows summed

    f.needs = name  # type: ignore[attr-defined]
    return f


# metric name -> how to derive it from the batch's fields (verl's DAPO trainer definitions)
DERIVED_FILTER_METRICS: dict[str, Callable[[Mapping], torch.Tensor]] = {
    "seq_reward": _sum_field("token_level_scores"),
    "seq_final_reward": _sum_field("token_level_rewards"),
}


def select_filter_metric(name: str, fields: Mapping[str, object]) -> torch.Tensor:
    """The [B] per-sample values that ``group_filter`` compares, by metric name.

    ``seq_reward`` = sum of ``token_level_scores``, ``seq_final_reward`` = sum of
    ``token_level_rewards`` (verl's definitions), any other name (``acc``, ``score``, ...) is the
    per-sample field of that name; tensors, numpy arrays and lists are accepted. Raises ``KeyError``
    naming the available fields when the needed one is missing, ``ValueError`` when it is not [B].
    """
    avail = sorted(fields)
    if name in DERIVED_FILTER_METRICS:
        need = DERIVED_FILTER_METRICS[name].needs  # type: ignore[attr-defined]
        if need not in fields:
            raise KeyError(f"filter metric '{name}' is the sum of '{need}', which the batch lacks; available fields: {avail}")
        out = DERIVED_FILTER_METRICS[name](fields)
    else:
        if name not in fields:
            raise KeyError(
                f"filter metric '{name}' is not a field of the batch; available fields: {avail}, "
                f"or the derived {sorted(DERIVED_FILTER_METRICS)}"
            )
        out = torch.as_tensor(fields[name])
        if out.dim() == 2 and out.shape[1] == 1:
            out = out[:, 0]
    if out.dim() != 1:
        raise ValueError(f"filter metric '{name}' must be one value per sample [B], got shape {tuple(out.shape)}")
    return out


def overlong_reward_penalty(
    response_length: torch.Tensor, *, max_response_length: int, overlong_buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO soft overlong punishment, [B] float: min(-(L - (max_len - buf)) / buf * factor, 0)."""
    if overlong_buffer_len <= 0:
        raise ValueError(f"overlong_buffer_len must be > 0, got {overlong_buffer_len}")
    if overlong_buffer_len > max_response_length:
        raise ValueError(
            f"overlong_buffer_len ({overlong_buffer_len}) must not exceed max_response_length ({max_response_length})"
        )
    expected = max_response_length - overlong_buffer_len
    length = response_length.to(torch.float32 if not response_length.is_floating_point() else response_length.dtype)
    exceed = length - expected  # [B]
    return (-exceed / overlong_buffer_len * penalty_factor).clamp(max=0.0)  # [B]
