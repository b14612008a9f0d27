"""ADCA-GRPO: attribution-driven credit assignment, fusing per-step GOOD/BAD judgements with the outcome.

Reference: Zhai et al. 2025, "AgentEvolver: Towards Efficient Self-Evolving Agent System"
(arXiv:2511.10395), the "self-attributing" mechanism, and its implementation in modelscope/AgentEvolver
(``agentevolver/module/adv_processor/adca_grpo.py``, ``adca_grpo_pipeline.py`` and
``semantic_attribution.py``, read at commit a5a8db8). This module re-derives the math from that code;
it is written independently and the deviations are listed at the end.

An LLM judge (``trainer/rewards/judge.py``) labels each assistant step of a trajectory GOOD or BAD.
Here those labels and the outcome scores become token advantages, in three stages: step rewards
(``decouple`` or ``allocation``), suffix sums over steps, broadcast to tokens by step id.

Layout of the ragged steps (padded, one row per trajectory)
-----------------------------------------------------------
    step_flags   [B, S] int    +1 GOOD, -1 BAD, 0 unknown (the judge gave no usable label); S >= max K_i
    num_steps    [B]    int64  K_i, the number of assistant steps of trajectory i; columns j >= K_i are
                               padding and ignored (``step_mask[i, j] = j < K_i``)
    outcome_scores [B]  float  R_i, the outcome (ORM) score
    index        [B]           prompt-group id (the GRPO group)
    use_prm      [B]    bool   False: no attribution for this sample (skipped by ``skip_type``, or the
                               judge fell back); it gets outcome-only credit, see below
    step_ids     [B, T] int64  assistant step of each response token; -1 on environment/tool/pad tokens
    response_mask [B, T]       1 on tokens the policy generated
``pad_step_flags`` turns a list of per-trajectory flag lists (bool / +-1 / None) into this layout.

Notation: trajectory i with K_i steps, group g(i); step j is *labelled* when ``use_prm[i]``, ``j < K_i``
and ``f_ij != 0``; ``L_i`` is the set of labelled steps of i and ``n_i = |L_i|``.

Stage 2a, the outcome term (both schemes)
-----------------------------------------
Outcome scores are z-scored per group over ALL samples of the group (skipped and fallback ones too),
with the population (biased) std:
    o_i = (R_i - mean_g) / std_g    if std_g > eps,     else  o_i = R_i - mean_g
(a group of one, or a group with equal scores, gives o_i = 0). This is GRPO's outcome advantage with
the population std instead of the Bessel-corrected one, i.e. ``grpo * sqrt(n_g / (n_g - 1))``.

Stage 2b, the step-level (PRM) term
-----------------------------------
Raw PRM reward p_ij on labelled steps (0 elsewhere):
  * ``decouple``:   p_ij = fix_base * f_ij          (GOOD = +fix_base, BAD = -fix_base)
  * ``allocation``: the trajectory's unit of credit, with the sign of its outcome, is shared among its
    labelled steps, giving more weight to steps whose label agrees with the outcome. With
    s_i = sign(R_i > success_threshold) (+1 success, -1 failure) and weights
        success:  w(GOOD) = consistent_scale,        w(BAD) = pos_unconsistent_scale
        failure:  w(GOOD) = |neg_unconsistent_scale|, w(BAD) = consistent_scale
    W_i = sum_{j in L_i} w(f_ij) and p_ij = s_i * w(f_ij) / W_i   (p_ij = 0 when W_i <= eps),
    so sum_j p_ij = s_i for every trajectory with a label. ``fix_base`` is not used.
Group z-score of the PRM rewards (``do_batch_norm``), over the labelled steps of the group, with a
weight per step: ``equal_trajectory_weight=True`` gives step j of trajectory i the weight 1/n_i (each
labelled trajectory has total weight 1, so the group mean is the mean of the per-trajectory means, and
the variance the mean of the per-trajectory mean squared deviations from it: AgentEvolver's "GRPO"
mode); ``False`` gives every step weight 1 (all steps pooled: "GSPO" mode). With w_ij these weights:
    mu_g  = sum w_ij p_ij / sum w_ij,   var_g = sum w_ij (p_ij - mu_g)^2 / sum w_ij  (population)
    z_ij  = (p_ij - mu_g) / sqrt(var_g + eps)       on labelled steps, 0 elsewhere.
Without ``do_batch_norm``, z_ij = p_ij. Under the z-score ``fix_base`` cancels (up to eps).

Stage 2c, fusion into step rewards (j < K_i)
--------------------------------------------
    last_step:  r_ij = alpha * z_ij + beta * o_i * [j = K_i - 1]
    all_steps:  r_ij = alpha * z_ij + beta * o_i
``decouple`` with ``enable_length_normalization`` multiplies the whole fused reward of every step of
trajectory i by 1 / sqrt(K_i) (AgentEvolver applies it there: after the fusion, to both terms, before
the suffix sum). ``allocation`` ignores the flag, as AgentEvolver does.

Stage 3, to tokens
------------------
    A_ij = sum_{k = j}^{K_i - 1} r_ik                      (suffix sum over steps)
    advantages[i, t] = A_{i, step_ids[i, t]}  where step_ids[i, t] >= 0 and response_mask[i, t], else 0
``returns`` equal the advantages (no critic), as for the other outcome estimators.

Outcome-only credit (``use_prm[i] = False``)
--------------------------------------------
Sample i contributes nothing to, and takes nothing from, the PRM statistics: z_ij = 0 for all j, and
its step rewards are the outcome term alone (with length normalisation in decouple when enabled). So
with ``last_step`` every token of the sample gets exactly ``beta * o_i`` (the GRPO outcome advantage,
population std, times beta; divided by sqrt(K_i) under length normalisation), and with ``all_steps``
step j gets ``(K_i - j) * beta * o_i``: the same outcome credit a judged sample gets, minus the
attribution term. A labelled sample whose flags are all 0 is treated the same way.

Choosing which samples to ask the judge about (``select_judge_samples``)
------------------------------------------------------------------------
    skip_small_adv:  ask when |outcome advantage| >= eps    (a near-zero advantage: the whole group
                     agreed, the outcome term is ~0 and the judge's labels would be the only signal)
    skip_all_neg:    ask when R > neg_threshold (0 by default): samples with non-positive reward skipped
    none:            ask about every sample
``prm_active(global_step, prm_steps)``: attribution is used while ``global_step < prm_steps``
(AgentEvolver's comparison); ``prm_steps=None`` keeps it on.

Deviations from AgentEvolver (modelscope/AgentEvolver @ a5a8db8)
------------------------------------------------------------------
  1. ``beta`` weights the outcome term; AgentEvolver fixes it to 1 (beta=1 reproduces it).
  2. Unknown labels (0) and samples with ``use_prm=False`` are left out of the PRM statistics and get
     no PRM term. AgentEvolver has no "unknown": missing labels are padded (GOOD in decouple, the
     outcome's side in allocation), and skipped samples are given K copies of the label
     ``score > 0`` that then enter the group z-score like judged ones.
  3. The step z-score divides by sqrt(var + eps) for both weightings; AgentEvolver uses that for the
     equal-trajectory weighting and max(std, eps) for the pooled one. They differ only when a group's
     PRM variance is below ~eps (then every z is ~0 either way).
  4. AgentEvolver's ``orm_distribution="only_prm"`` and the cosine decay of alpha are not offered here
     (the controller may pass a per-step ``alpha``).
  5. ``skip_small_adv`` uses eps = 1e-6 by default (AgentEvolver: 1e-8); pass ``eps`` to change it.
  6. Everything is computed in float64 with segment reductions (``index_add_`` over dense group ids),
     not with Python lists per trajectory.

Dispatch: ``PRM_SCHEMES`` maps ``prm_scheme`` to a step-reward builder; ``"pkg.module:function"``
plugs in a user's own, called with the same keywords, returning ``step_rewards [B, S]`` or the tuple
``(step_rewards, prm_part, orm_part)`` (the parts feed the contribution metrics).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from trainer.algos.utils import dense_group_ids, group_stats, load_fn

F64 = torch.float64
ORM_DISTRIBUTIONS = ("last_step", "all_steps")


# --------------------------------------------------------------------------------------------------
# layout helpers
# --------------------------------------------------------------------------------------------------


def _label_value(v) -> int:
    """bool True/False -> +1/-1 (numpy and 0-dim tensor bools too), None -> 0, numbers -> sign."""
    if v is None:
        return 0
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, (bool, np.bool_)):
        return 1 if v else -1
    v = float(v)
    return 1 if v > 0 else (-1 if v < 0 else 0)


def pad_step_flags(flags: Sequence[Sequence], num_steps=None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged per-trajectory labels -> ``(step_flags [B, S] int8, num_steps [B] int64)``.

    Each label may be a bool (True GOOD / False BAD), an int (+1 / -1 / 0) or None (unknown). When
    ``num_steps`` is given, S covers it and a trajectory with fewer labels than steps has its missing
    labels at 0 (unknown); extra labels beyond ``num_steps`` are kept in the tensor but ignored by every
    function here (they lie outside ``step_mask``). Without it, ``num_steps`` is the number of labels.
    """
    lengths = torch.tensor([len(f) for f in flags], dtype=torch.int64)  # [B]
    flat = [_label_value(v) for f in flags for v in f]
    flat_t = torch.tensor(flat, dtype=torch.int8)  # [sum lengths]
    if num_steps is None:
        k = lengths.clone()
    else:
        k = torch.as_tensor(num_steps, dtype=torch.int64).reshape(-1).cpu()  # [B]
    s = int(max(int(lengths.max()) if lengths.numel() else 0, int(k.max()) if k.numel() else 0))
    out = torch.zeros(len(flags), s, dtype=torch.int8)  # [B, S]
    if flat_t.numel():
        # scatter the concatenated labels to (row, column) without a loop per trajectory
        row = torch.repeat_interleave(torch.arange(len(flags)), lengths)  # [N]
        start = torch.cumsum(lengths, 0) - lengths  # [B]
        col = torch.arange(flat_t.numel()) - torch.repeat_interleave(start, lengths)  # [N]
        out[row, col] = flat_t
    return out.to(device) if device is not None else out, k.to(device) if device is not None else k


def num_steps_from_step_ids(step_ids: torch.Tensor) -> torch.Tensor:
    """K_i = max step id + 1 per row (0 for a row without assistant tokens). ``[B, T] -> [B]``."""
    if step_ids.shape[-1] == 0:
        return torch.zeros(step_ids.shape[0], dtype=torch.int64, device=step_ids.device)
    return (step_ids.max(dim=-1).values + 1).clamp_min(0).to(torch.int64)  # [B]


def step_mask_from_num_steps(num_steps: torch.Tensor, s: int) -> torch.Tensor:
    """``step_mask [B, S]``: True at columns j < K_i."""
    return torch.arange(s, device=num_steps.device)[None, :] < num_steps[:, None]  # [B, S]


def _as_index(index, device) -> torch.Tensor:
    """Group ids as ``[B]`` int64; lists / arrays of any hashable ids (string uids) are densified."""
    if isinstance(index, torch.Tensor):
        return index.to(device).reshape(-1)
    arr = np.asarray(index)
    if arr.dtype.kind in "iub":
        return torch.as_tensor(arr.astype(np.int64), device=device).reshape(-1)
    _, inv = np.unique(arr, return_inverse=True)
    return torch.as_tensor(inv.reshape(-1).astype(np.int64), device=device)


def _as_f64(x, device=None) -> torch.Tensor:
    """``[B]`` float64; python lists are read as float64 directly (not through float32)."""
    if isinstance(x, torch.Tensor):
        return x.to(device=device or x.device, dtype=F64).reshape(-1)
    return torch.as_tensor(x, dtype=F64, device=device).reshape(-1)


def _prepare(step_flags, num_steps, outcome_scores, index, use_prm):
    """Common input normalisation: tensors on one device, float64 scores, dense group ids, and the
    ``labelled [B, S]`` mask (use_prm & j < K_i & flag != 0)."""
    if not isinstance(step_flags, torch.Tensor):
        step_flags, k = pad_step_flags(step_flags, num_steps)
        num_steps = k if num_steps is None else num_steps
    device = step_flags.device
    if num_steps is None:
        raise ValueError("num_steps is required with a padded step_flags tensor")
    flags = step_flags.to(device=device, dtype=torch.int64)  # [B, S]
    b, s = flags.shape
    k = torch.as_tensor(num_steps, device=device).to(torch.int64).reshape(-1)  # [B]
    if k.numel() != b:
        raise ValueError(f"num_steps has {k.numel()} entries for {b} trajectories")
    if b and int(k.max()) > s:
        raise ValueError(f"num_steps up to {int(k.max())} but step_flags has only {s} columns")
    r = _as_f64(outcome_scores, device)  # [B]
    gid = _as_index(index, device)  # [B]
    if use_prm is None:
        use = torch.ones(b, dtype=torch.bool, device=device)  # [B]
    else:
        use = torch.as_tensor(use_prm, device=device).to(torch.bool).reshape(-1)  # [B]
    step_mask = step_mask_from_num_steps(k, s)  # [B, S]
    labelled = step_mask & (flags != 0) & use[:, None]  # [B, S]
    return flags, k, r, gid, use, step_mask, labelled


# --------------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------------


def outcome_zscore(outcome_scores: torch.Tensor, index, eps: float = 1e-8) -> torch.Tensor:
    """o_i = (R_i - mean_g) / std_g (population std) per group; (R_i - mean_g) when std_g <= eps. ``[B]``
    float64. This is also the outcome advantage ``select_judge_samples`` expects."""
    r = _as_f64(outcome_scores)  # [B]
    gid = _as_index(index, r.device)  # [B]
    mean, std, _ = group_stats(r, gid, unbiased=False)  # [B] each, float64
    centred = r - mean  # [B]
    return torch.where(std > eps, centred / std.clamp_min(eps), centred)  # [B]


def group_zscore_steps(
    p: torch.Tensor,
    labelled: torch.Tensor,
    index,
    *,
    equal_trajectory_weight: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Weighted z-score of the step values ``p [B, S]`` over the ``labelled [B, S]`` steps of each group.

    Weights: 1 / n_i per labelled step of trajectory i (``equal_trajectory_weight``) or 1 (pooled).
    Returns ``(p - mu_g) / sqrt(var_g + eps)`` on labelled steps and 0 elsewhere, float64 ``[B, S]``.
    """
    p = p.to(F64)  # [B, S]
    lab = labelled.to(F64)  # [B, S]
    gid, g = dense_group_ids(_as_index(index, p.device))  # [B]
    if equal_trajectory_weight:
        n = lab.sum(-1, keepdim=True)  # [B, 1]
        w = lab / n.clamp_min(1.0)  # [B, S] each labelled trajectory sums to 1
    else:
        w = lab  # [B, S]
    zeros = torch.zeros(g, dtype=F64, device=p.device)  # [G]
    wsum = zeros.clone().index_add_(0, gid, w.sum(-1))  # [G]
    s1 = zeros.clone().index_add_(0, gid, (w * p).sum(-1))  # [G]
    mu = torch.where(wsum > 0, s1 / wsum.clamp_min(1e-300), zeros)  # [G] a group without labels: 0
    dev = (p - mu[gid][:, None]) * lab  # [B, S]
    s2 = zeros.clone().index_add_(0, gid, (w * dev * dev).sum(-1))  # [G]
    var = torch.where(wsum > 0, s2 / wsum.clamp_min(1e-300), zeros)  # [G]
    return dev / torch.sqrt(var + eps)[gid][:, None]  # [B, S]


# --------------------------------------------------------------------------------------------------
# step rewards
# --------------------------------------------------------------------------------------------------


def _fuse(z, o, k, step_mask, *, alpha, beta, orm_distribution, length_scale=None):
    """r = (alpha z + beta o on the last / every step) * length_scale; returns (r, prm_part, orm_part)."""
    if orm_distribution not in ORM_DISTRIBUTIONS:
        raise ValueError(f"unknown orm_distribution '{orm_distribution}'; valid: {list(ORM_DISTRIBUTIONS)}")
    sm = step_mask.to(F64)  # [B, S]
    if orm_distribution == "last_step":
        cols = torch.arange(step_mask.shape[1], device=step_mask.device)  # [S]
        where_orm = (cols[None, :] == (k - 1)[:, None]).to(F64)  # [B, S] one-hot of the last step
    else:
        where_orm = sm  # [B, S]
    prm_part = alpha * z * sm  # [B, S]
    orm_part = beta * o[:, None] * where_orm  # [B, S]
    if length_scale is not None:
        prm_part = prm_part * length_scale[:, None]
        orm_part = orm_part * length_scale[:, None]
    return prm_part + orm_part, prm_part, orm_part


@torch.no_grad()
def compute_step_rewards_decouple(
    *,
    step_flags,
    num_steps=None,
    outcome_scores,
    index,
    use_prm=None,
    fix_base: float = 0.2,
    alpha: float = 0.1,
    beta: float = 1.0,
    do_batch_norm: bool = True,
    equal_trajectory_weight: bool = True,
    orm_distribution: str = "last_step",
    enable_length_normalization: bool = False,
    eps: float = 1e-8,
    return_parts: bool = False,
    **kwargs,
):
    """Decouple scheme: z-score ±fix_base PRM rewards and the outcomes separately, then fuse.

    Returns ``step_rewards [B, S]`` float64 (0 at j >= K_i), or ``(step_rewards, prm_part, orm_part)``
    with ``return_parts``.
    """
    flags, k, r, gid, _, step_mask, lab = _prepare(step_flags, num_steps, outcome_scores, index, use_prm)
    p = float(fix_base) * flags.to(F64) * lab  # [B, S]
    if do_batch_norm:
        z = group_zscore_steps(p, lab, gid, equal_trajectory_weight=equal_trajectory_weight, eps=eps)  # [B, S]
    else:
        z = p
    o = outcome_zscore(r, gid, eps=eps)  # [B]
    scale = torch.rsqrt(k.clamp_min(1).to(F64)) if enable_length_normalization else None  # [B]
    out = _fuse(z, o, k, step_mask, alpha=alpha, beta=beta, orm_distribution=orm_distribution, length_scale=scale)
    return out if return_parts else out[0]


@torch.no_grad()
def compute_step_rewards_allocation(
    *,
    step_flags,
    num_steps=None,
    outcome_scores,
    index,
    use_prm=None,
    alpha: float = 0.1,
    beta: float = 1.0,
    do_batch_norm: bool = True,
    equal_trajectory_weight: bool = True,
    orm_distribution: str = "last_step",
    consistent_scale: float = 1.0,
    pos_unconsistent_scale: float = 0.2,
    neg_unconsistent_scale: float = 0.2,
    success_threshold: float = 0.5,
    eps: float = 1e-8,
    return_parts: bool = False,
    **kwargs,
):
    """Allocation scheme: share a signed unit of credit over the labelled steps (weights favour labels
    that agree with the outcome), z-score per group, then fuse with the z-scored outcome.
    ``fix_base`` and ``enable_length_normalization`` are accepted and ignored (as in AgentEvolver)."""
    flags, k, r, gid, _, step_mask, lab = _prepare(step_flags, num_steps, outcome_scores, index, use_prm)
    succ = r > success_threshold  # [B]
    sgn = torch.where(succ, 1.0, -1.0).to(F64)  # [B]
    one = torch.ones_like(r)  # [B]
    w_good = torch.where(succ, float(consistent_scale) * one, abs(float(neg_unconsistent_scale)) * one)  # [B]
    w_bad = torch.where(succ, float(pos_unconsistent_scale) * one, float(consistent_scale) * one)  # [B]
    w = torch.where(flags > 0, w_good[:, None], w_bad[:, None]) * lab  # [B, S]
    tot = w.sum(-1)  # [B]
    unit = torch.where(tot > eps, 1.0 / tot.clamp_min(eps), torch.zeros_like(tot))  # [B]
    p = sgn[:, None] * w * unit[:, None]  # [B, S] sums to sgn_i over the labelled steps
    if do_batch_norm:
        z = group_zscore_steps(p, lab, gid, equal_trajectory_weight=equal_trajectory_weight, eps=eps)  # [B, S]
    else:
        z = p
    o = outcome_zscore(r, gid, eps=eps)  # [B]
    out = _fuse(z, o, k, step_mask, alpha=alpha, beta=beta, orm_distribution=orm_distribution)
    return out if return_parts else out[0]


PRM_SCHEMES: dict[str, Callable] = {
    "decouple": compute_step_rewards_decouple,
    "allocation": compute_step_rewards_allocation,
}


def get_prm_scheme(name) -> Callable:
    """A name of ``PRM_SCHEMES``, a callable, or ``"pkg.module:function"``."""
    return load_fn(name, PRM_SCHEMES, "prm_scheme")


# --------------------------------------------------------------------------------------------------
# steps -> tokens
# --------------------------------------------------------------------------------------------------


def step_rewards_to_token_advantages(
    step_rewards: torch.Tensor,
    step_mask: torch.Tensor,
    step_ids: torch.Tensor,
    response_mask: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Suffix sum over steps, then each token takes its step's value; 0 where ``step_ids < 0`` or
    ``response_mask`` is 0. Step ids must be < S (``compute_adca_grpo_advantage`` checks them against
    ``num_steps``). Returns ``[B, T]`` in ``dtype`` (default: that of ``step_rewards``)."""
    dtype = dtype or step_rewards.dtype
    b, s = step_rewards.shape
    if s == 0:
        return torch.zeros(step_ids.shape, dtype=dtype, device=step_ids.device)
    r = step_rewards.to(F64) * step_mask.to(F64)  # [B, S]
    adv_steps = r.flip(-1).cumsum(-1).flip(-1)  # [B, S] A_ij = sum_{k >= j} r_ik (float64 sums)
    # column S holds 0 and every negative step id maps to it, so env / pad tokens read 0 from the
    # gather itself; the gather runs in the output dtype (it is the O(B*T) part)
    padded = torch.cat([adv_steps, torch.zeros_like(adv_steps[:, :1])], dim=1).to(dtype)  # [B, S + 1]
    sid = step_ids.to(torch.int64)  # [B, T]
    tok = padded.gather(1, torch.where(sid < 0, s, sid))  # [B, T]
    return tok.masked_fill_(~response_mask.bool(), 0)  # [B, T]


# --------------------------------------------------------------------------------------------------
# judge selection and schedule
# --------------------------------------------------------------------------------------------------

SKIP_TYPES = ("skip_small_adv", "skip_all_neg", "none")


def select_judge_samples(
    outcome_advantage: torch.Tensor,
    outcome_scores: torch.Tensor,
    skip_type: str = "skip_small_adv",
    eps: float = 1e-6,
    neg_threshold: float = 0.0,
) -> torch.Tensor:
    """``ask_judge [B] bool``: which samples the judge is asked about (the rest get outcome-only credit).

    ``outcome_advantage`` is the per-sample outcome advantage (e.g. ``outcome_zscore`` or the GRPO one).
    """
    adv = _as_f64(outcome_advantage)  # [B]
    r = _as_f64(outcome_scores)  # [B]
    if skip_type == "skip_small_adv":
        return adv.abs() >= eps  # [B]
    if skip_type == "skip_all_neg":
        return r > neg_threshold  # [B]
    if skip_type == "none":
        return torch.ones(r.shape, dtype=torch.bool, device=r.device)  # [B]
    raise ValueError(f"unknown skip_type '{skip_type}'; valid: {list(SKIP_TYPES)}")


def prm_active(global_step: int, prm_steps: int | None) -> bool:
    """Whether attribution is used at ``global_step``: while ``global_step < prm_steps`` (None: always)."""
    return prm_steps is None or int(global_step) < int(prm_steps)


# --------------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------------


def _pearson(x: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of x and y over the entries where m; 0 when undefined (< 2 points or a
    constant side)."""
    mf = m.to(F64)
    n = mf.sum()
    mx = (x * mf).sum() / n.clamp_min(1.0)
    my = (y * mf).sum() / n.clamp_min(1.0)
    dx, dy = (x - mx) * mf, (y - my) * mf
    sxx, syy, sxy = (dx * dx).sum(), (dy * dy).sum(), (dx * dy).sum()
    den = torch.sqrt(sxx * syy)
    ok = (n >= 2) & (den > 1e-12)
    return torch.where(ok, sxy / den.clamp_min(1e-12), torch.zeros_like(den))


@torch.no_grad()
def _adca_inputs(step_flags, step_ids, mask, outcome_scores, token_level_rewards, num_steps, dtype):
    """Defaults and checks of ``compute_adca_grpo_advantage``'s inputs: (outcome scores [B], output dtype,
    step ids [B, T] int64, steps per row [B] int64, step flags [B, S])."""
    if outcome_scores is None:
        if token_level_rewards is None:
            raise ValueError("adca_grpo needs outcome_scores or token_level_rewards")
        outcome_scores = (token_level_rewards.to(F64) * mask).sum(-1)  # [B]
    if dtype is None:
        dtype = token_level_rewards.dtype if token_level_rewards is not None else torch.float32
    sid = step_ids.to(torch.int64)  # [B, T]
    if num_steps is None:
        num_steps = num_steps_from_step_ids(sid)  # [B]
    if not isinstance(step_flags, torch.Tensor):
        step_flags, _ = pad_step_flags(step_flags, num_steps, device=sid.device)
    k = torch.as_tensor(num_steps, device=sid.device).to(torch.int64).reshape(-1)  # [B]
    if sid.numel() and bool((sid >= k[:, None]).any()):
        raise ValueError("step_ids name a step >= num_steps for some trajectory (steps and flags disagree)")
    return outcome_scores, dtype, sid, k, step_flags


def _adca_count_metrics(b: int, num_skipped, num_fallback, num_judge_calls) -> dict[str, torch.Tensor]:
    """The judge's counts as fractions of the batch (each only when its count is given)."""
    metrics = {}
    if num_skipped is not None:
        metrics["adca/skipped_fraction"] = torch.tensor(num_skipped / max(b, 1), dtype=F64)
    if num_fallback is not None:
        metrics["adca/judge_fallback_fraction"] = torch.tensor(num_fallback / max(b, 1), dtype=F64)
    if num_judge_calls is not None:
        metrics["adca/judge_calls"] = torch.tensor(float(num_judge_calls), dtype=F64)
    return metrics


def _adca_part_metrics(k, prm_part, orm_part, zero) -> dict[str, torch.Tensor]:
    """Per trajectory sums of |PRM term| and |outcome term| in the step rewards, and the outcome's share."""
    has_steps = k > 0  # [B]
    n_traj = has_steps.to(F64).sum().clamp_min(1.0)
    prm_abs = prm_part.abs().sum(-1)  # [B]
    orm_abs = orm_part.abs().sum(-1)  # [B]
    tot = prm_abs.sum() + orm_abs.sum()
    return {"adca/prm_abs_mean": (prm_abs * has_steps).sum() / n_traj,
            "adca/orm_abs_mean": (orm_abs * has_steps).sum() / n_traj,
            "adca/outcome_share": torch.where(tot > 0, orm_abs.sum() / tot.clamp_min(1e-300), zero)}


def _adca_metrics(step_flags, k, outcome_scores, index, use_prm, step_mask, prm_part, orm_part,
                  counts: tuple) -> dict[str, torch.Tensor]:
    """The ``adca/*`` metrics of ``compute_adca_grpo_advantage`` (no host sync), float32 0-d tensors."""
    flags, _, r, _, use, _, lab = _prepare(step_flags, k, outcome_scores, index, use_prm)
    b = flags.shape[0]
    zero = torch.zeros((), dtype=F64, device=flags.device)
    attributed_steps = (step_mask & use[:, None]).to(F64)  # [B, S]
    n_lab = lab.to(F64).sum()
    n_good = (lab & (flags > 0)).to(F64).sum()
    metrics: dict[str, torch.Tensor] = {
        "adca/good_fraction": n_good / n_lab.clamp_min(1.0),
        "adca/unknown_step_fraction": torch.where(
            attributed_steps.sum() > 0, 1.0 - n_lab / attributed_steps.sum().clamp_min(1.0), zero
        ),
        "adca/prm_fraction": use.to(F64).mean() if b else zero,
        "adca/mean_steps": k.to(F64).mean() if b else zero,
        **_adca_count_metrics(b, *counts),
    }
    if prm_part is not None:
        metrics.update(_adca_part_metrics(k, prm_part, orm_part, zero))
    labf = lab.to(F64)  # [B, S]
    n_i = labf.sum(-1)  # [B]
    mean_flag = (flags.to(F64) * labf).sum(-1) / n_i.clamp_min(1.0)  # [B]
    metrics["adca/flag_outcome_corr"] = _pearson(mean_flag, r, n_i > 0)
    return {key: v.detach().to(torch.float32) for key, v in metrics.items()}


def compute_adca_grpo_advantage(
    *, step_flags, index, step_ids: torch.Tensor, response_mask: torch.Tensor, outcome_scores=None,
    token_level_rewards: torch.Tensor | None = None, num_steps=None, use_prm=None, prm_scheme="decouple",
    fix_base: float = 0.2, alpha: float = 0.1, beta: float = 1.0, do_batch_norm: bool = True,
    equal_trajectory_weight: bool = True, orm_distribution: str = "last_step",
    enable_length_normalization: bool = False, eps: float = 1e-8, num_skipped: int | None = None,
    num_fallback: int | None = None, num_judge_calls: int | None = None, dtype: torch.dtype | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """ADCA-GRPO advantages: ``(advantages [B, T], returns [B, T], metrics)``.

    ``outcome_scores`` defaults to the masked sum of ``token_level_rewards``; ``num_steps`` to
    ``max(step_ids) + 1`` per row. ``use_prm`` False marks samples that get outcome-only credit
    (module docstring). Extra keywords (e.g. the allocation weights) go to the scheme. The output dtype
    is ``dtype``, else that of ``token_level_rewards``, else float32. Metrics are 0-dim tensors:
      adca/good_fraction         GOOD labels / labelled steps of attributed samples
      adca/unknown_step_fraction steps of attributed samples without a usable label
      adca/prm_fraction          samples with attribution (use_prm)
      adca/skipped_fraction, adca/judge_fallback_fraction, adca/judge_calls   from the counts passed in
      adca/prm_abs_mean, adca/orm_abs_mean   per trajectory, sum over steps of |PRM term| / |outcome
                                 term| in the step rewards, averaged over trajectories with >= 1 step
      adca/outcome_share         sum |outcome term| / (sum |outcome term| + sum |PRM term|)
      adca/flag_outcome_corr     Pearson correlation, over attributed samples with a label, between
                                 the mean label (+1/-1) of the trajectory and its outcome score
      adca/mean_steps            mean K_i
    """
    mask = response_mask.bool()  # [B, T]
    outcome_scores, dtype, sid, k, step_flags = _adca_inputs(step_flags, step_ids, mask, outcome_scores,
                                                             token_level_rewards, num_steps, dtype)
    out = get_prm_scheme(prm_scheme)(
        step_flags=step_flags, num_steps=k, outcome_scores=outcome_scores, index=index, use_prm=use_prm,
        fix_base=fix_base, alpha=alpha, beta=beta, do_batch_norm=do_batch_norm,
        equal_trajectory_weight=equal_trajectory_weight, orm_distribution=orm_distribution,
        enable_length_normalization=enable_length_normalization, eps=eps, return_parts=True, **kwargs,
    )
    step_rewards, prm_part, orm_part = out if isinstance(out, tuple) else (out, None, None)
    step_mask = step_mask_from_num_steps(k, step_rewards.shape[1])  # [B, S]
    adv = step_rewards_to_token_advantages(step_rewards, step_mask, sid, mask, dtype=dtype)  # [B, T]
    metrics = _adca_metrics(step_flags, k, outcome_scores, index, use_prm, step_mask, prm_part, orm_part,
                            (num_skipped, num_fallback, num_judge_calls))
    return adv, adv, metrics
