"""Advantage estimators: token-level rewards (and critic values) in, ``(advantages, returns)`` out.

Every estimator is called with keyword arguments only and swallows the ones it does not use
(``**kwargs``), so the controller passes one set to whichever estimator the config names:

    token_level_rewards [B, T] float   reward per response token (outcome reward sits on the last one)
    response_mask       [B, T]         1 on tokens the policy generated; 0 on padding and, in
                                       multi-turn rollouts, on environment/tool tokens ("holes")
    index               [B]            group id per sample (responses to the same prompt share it);
                                       an int64 tensor, or a list / numpy array of any hashable ids
    values              [B, T]         critic values (GAE only)
    gamma, lam                          discount and GAE lambda
    norm_adv_by_std_in_grpo             GRPO: divide by the group std (False gives Dr.GRPO)
    reward_baselines    [B]            reward of the greedy response (ReMax only)
    epsilon = 1e-6                      added to the group std
    reward_components   {key: [B]}     per-component outcome rewards (GDPO only)
    gdpo_reward_weights [K]            one weight per component (GDPO only; None = 1 each)
    old_log_probs, sum_pi_squared [B, T]  log pi of the sampled token and sum_v pi(v)^2 at each
                                       position, from the actor (optimal-token-baseline only)
    rollout_is_weights  [B, T]         rollout IS weights (optimal-token-baseline only; None = none)
    weight_factor_in_cpgd              CPGD's advantage weighting (cpgd only)

Both outputs are ``[B, T]`` in the dtype of ``token_level_rewards`` and are zero outside
``response_mask``. All estimators run under ``torch.no_grad``. Group statistics are segment
reductions over dense group ids (``utils.group_stats`` / ``index_add_`` / ``scatter_reduce_``):
one pass over the batch, no Python loop per sample or per group. The recursions along time (GAE,
discounted return-to-go) loop over T with every step vectorised over B.

Notation: ``R_i = sum_t token_level_rewards[i, t] * mask[i, t]`` is the sequence score, ``g(i)`` its
group, ``n_g`` the group size, ``mean_g`` / ``std_g`` the group mean and unbiased (Bessel) std.

* ``gae`` -- Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438):
  ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``, computed over the
  valid tokens only: at a masked position (an environment token inside a multi-turn response, or
  padding) the running next-value and the running ``A`` are carried through unchanged, so the
  recursion jumps the hole as if the environment tokens were not there (no discount is applied for
  them) and the hole itself gets advantage 0. ``returns = A + V`` with the raw ``A``; the
  advantages are then whitened over the whole batch mask (``utils.masked_whiten``, unbiased
  variance), as verl does. Deviation from the paper: the whitening.
* ``grpo`` -- GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300), outcome supervision:
  ``A_i = (R_i - mean_g) / (std_g + epsilon)`` broadcast over the response. A group of one has no
  peers, so it is given ``mean = 0`` and ``std = 1``: ``A_i = R_i / (1 + epsilon)``.
  With ``norm_adv_by_std_in_grpo=False`` this is Dr.GRPO.
* ``dr_grpo`` -- Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like Training",
  arXiv:2503.20783): ``A_i = R_i - mean_g`` (no std division; the flag is ignored). A group of one
  gets ``mean = 0``, so ``A_i = R_i``.
* ``rloo`` -- REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740):
  ``A_i = R_i - mean_{j != i} R_j = n_g / (n_g - 1) * (R_i - mean_g)``; a group of one has no
  other sample, so its baseline is 0 and ``A_i = R_i``.
* ``reinforce_plus_plus`` -- REINFORCE++ (Hu 2025, arXiv:2501.03262): ``G_t = sum_{s >= t}
  gamma^(k(s) - k(t)) r_s`` over valid tokens (``k`` counts valid tokens, so holes are skipped like
  in GAE), then whitened over the batch mask. ``returns = G``. For right-padded responses this is
  exactly verl's "reset after EOS" recursion; with holes verl resets at every masked token (so an
  earlier turn would not see the final outcome reward), whereas we carry the return across the
  hole. The paper's token-level KL penalty is not applied here: it enters through the reward
  (``kl.apply_kl_in_reward``) when ``algorithm.use_kl_in_reward`` is set.
* ``reinforce_plus_plus_baseline`` -- REINFORCE++-baseline (same paper): ``A_i = R_i - mean_g``
  (a group of one gets mean 0), broadcast over the response, then whitened over the batch mask.
* ``remax`` -- ReMax (Li et al. 2023, arXiv:2310.10505): ``A_t = G_t - b_i`` with the undiscounted
  return-to-go ``G_t = sum_{s >= t} r_s`` over valid tokens and ``b_i`` the reward of the greedy
  response (``reward_baselines``); no whitening. ``returns = G``. ``gamma`` is not used (ReMax is
  defined for outcome rewards, where it would only rescale; verl does the same).
* ``grpo_passk`` -- Pass@k training (Chen et al. 2025, arXiv:2503.19595, verl's ``grpo_passk``):
  only the best response of each group is credited, with ``A = R_max - R_second_max`` (divided by
  ``std_g + epsilon`` when ``norm_adv_by_std_in_grpo``); every other response gets 0. Ties for the
  best go to the earliest sample in the batch (its advantage is then 0 anyway, since the second
  best equals the best). Every group needs at least two samples (``ValueError`` otherwise).

* ``grpo_vectorized`` / ``rloo_vectorized`` -- verl's names for its vectorised GRPO / RLOO; here the
  same functions as ``grpo`` / ``rloo`` (every estimator here is vectorised). verl's vectorised RLOO
  gives a group of one advantage 0 where its loop RLOO (and ours) gives ``R_i``; verl's generic
  dispatch never passes ``norm_adv_by_std_in_grpo`` to ``grpo_vectorized`` (so the key is ignored
  there), ours honours it.
* ``opo`` -- On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv:2505.23585): the
  length-weighted group baseline ``b_g = sum_j L_j R_j / sum_j L_j`` with ``L_j`` the number of valid
  tokens of response j (the paper's approximation ``||grad log pi(y)||^2 ~ |y|`` of the
  variance-optimal baseline), ``A_i = R_i - b_g(i)``. A group of one gets ``b = 0`` (verl's rule); a
  group whose responses are all empty gets ``b = 0`` (verl divides by zero there).
* ``gpg`` -- GPG (Chu et al. 2025, arXiv:2504.02546): ``A_i = alpha (R_i - mean_g) / f_norm`` with the
  paper's "accurate gradient estimation" factor ``alpha = B / (B - M)``, ``M`` the number of samples
  whose group (of >= 2) has all-equal rewards (their advantage is 0 and they only dilute the batch
  mean), tested by equality (``utils.group_constant``: a computed std of ``[0.7, 0.7, 0.7]`` is 1.4e-16).
  ``f_norm = 1`` (verl's default; no config key). A group of one gets ``mean = 0`` and counts as
  valid. Deviation from verl: verl takes ``alpha = B / count_nonzero(R)`` (samples with a non-zero
  REWARD), which equals the paper's only when every sample of a mixed group has a non-zero reward and
  every constant group has reward 0; we follow the paper.
* ``gdpo`` -- GDPO, group reward-decoupled normalisation (arXiv:2601.05242): for each reward
  component ``k`` (``algorithm.gdpo_reward_keys``, keys of the scorer's dict), the GRPO advantage
  ``A_k`` of that component alone, then ``A = whiten_batch(sum_k w_k A_k)`` over the batch's valid
  tokens (``algorithm.gdpo_reward_weights``, default 1 each). Inputs: ``reward_components`` (``{key:
  [B]}``); without it the one component is the sequence score ``R``. ``norm_adv_by_std_in_grpo`` is
  honoured per component (verl's dispatch never passes it, so there it is always true).
* ``optimal_token_baseline`` -- Optimal Token Baseline (Li et al. 2025, "The Optimal Token
  Baseline", verl's ``optimal_token_baseline``): a baseline per position, ``B_t = sum_i G_{i,t} W_{i,t}
  / (sum_i W_{i,t} + epsilon)`` over the group's responses valid at position ``t``, where ``G`` is the
  undiscounted return-to-go and ``W_{i,t} = sum_{s <= t} m_s w_s`` the cumulative path-variance proxy
  with ``w_s = 1 - 2 pi_s + sum_v pi(v)^2`` (``pi_s = exp(old_log_probs)``, ``sum_pi_squared`` from the
  actor) times ``rho_s^2`` when ``rollout_is_weights`` are given. ``A = G - B``. A group of one gets
  ``B = 0``. ``handle_zero_tail``: when one response is strictly the longest of its group, its
  baseline is 0 from the second-longest length on (no peer to compare with). Positions are the
  absolute response positions.
* ``tir_optimal_token_baseline`` -- the same for multi-turn (tool-integrated) responses: positions are
  counted over VALID tokens only (the k-th generated token of each response is compared with the
  k-th of its peers, environment tokens skipped), and empty responses do not count towards a group.
  For right-padded responses without holes the two are identical.
* ``cpgd`` -- CPGD's advantage (Liu et al. 2025, arXiv:2505.12504; siiRL's ``cpgd`` estimator with
  ``algorithm.weight_factor_in_cpgd``): ``STD_weight`` is GRPO's ``(R - mean_g) / (std_g + epsilon)``;
  ``naive`` is ``R - mean_g``; ``clip_filter_like_weight`` is ``(R - mean_g) min(B / G_nz, 3)`` with
  ``G_nz`` the number of GROUPS whose rewards are not all equal (siiRL's "non-zero std", tested by
  equality; a group of one counts, with std 1) -- siiRL's
  formula, which divides a number of samples by a number of groups; kept as siiRL computes it.
  Groups of one get ``mean = 0``.

For the outcome estimators (grpo, dr_grpo, rloo, reinforce_plus_plus_baseline, grpo_passk, opo, gpg, gdpo,
cpgd) the returned ``returns`` equal the advantages (there is no critic to regress on them), as in verl.

``get_adv_estimator(name)`` resolves a name of ``ADV_ESTIMATORS`` or a user's
``"pkg.module:function"``; ``compute_advantage(name, **kwargs)`` dispatches and adds metrics.

``variance_proxy_metrics`` -- verl's ``variance_proxy/*`` metrics (``compute_variance_proxy_metrics``),
logged for any estimator whenever ``sum_pi_squared`` exists: per response ``a_i = masked_mean_t A`` and
``W_i = sum_t m w_t`` (the ``w`` above, times ``rho^2`` with IS weights), ``expected_a_squared = mean a^2``,
``expected_w = mean W``; ``proxy2_total_power = mean(a^2 max(W, 0))``, with IS weights ``mean(rho_bar^2
a^2 max(W', 0))`` where ``rho_bar_i`` is the row's mean weight and ``W'`` the sum of ``w`` without
``rho^2`` (a token with ``rho = 0`` adds 0 to it, as verl's division by ``max(rho^2, 1e-10)`` gives); ``proxy1_signal_strength = ||g||^2`` (the step's gradient norm squared) and
``proxy3_pure_noise = max(0, (proxy2 - proxy1) / (N - 1))``, both only when the gradient norm is given
(verl logs them as 0 without it).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from trainer.algos.utils import (compile_wanted, dense_group_ids, group_constant, group_stats, load_fn, masked_whiten,
                                 run_compiled)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _as_index(index, device: torch.device) -> torch.Tensor:
    """Group ids as a ``[B]`` int64 tensor on ``device``; lists / numpy arrays of any hashable ids
    (verl passes string uids) are mapped to dense integers with one ``np.unique``."""
    if index is None:
        raise ValueError("this advantage estimator needs `index` (one group id per sample)")
    if isinstance(index, torch.Tensor):
        return index.to(device)
    arr = np.asarray(index)
    if arr.dtype.kind in "iub":
        return torch.as_tensor(arr.astype(np.int64), device=device)
    _, inv = np.unique(arr, return_inverse=True)  # works for strings and other sortable ids
    return torch.as_tensor(inv.reshape(-1).astype(np.int64), device=device)


# Rows per chunk for the [B, T] passes below: the temporaries of one chunk (~1 MiB) stay in cache, so
# a pass costs one read of the inputs and one write of the output instead of several memory round trips.
_CHUNK_NUMEL = 1 << 18


def _row_chunks(n_rows: int, n_cols: int):
    step = max(1, _CHUNK_NUMEL // max(n_cols, 1))
    return [slice(s, s + step) for s in range(0, n_rows, step)]


def _masked_row_sum_kernel(values: torch.Tensor, mask01: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    # v * m rather than where(m, v, 0): inductor vectorises a multiply by a converted uint8 load (8192 x
    # 4096 float32 in ~3.5 ms, the read bandwidth) but not a select on a bool (~10-15 ms). With m in {0, 1}
    # the two agree whenever the row sum is finite (v * 0 = 0 for finite v); the caller redoes the rest.
    return (values.to(acc) * mask01.to(acc)).sum(-1)  # [B]


def _masked_broadcast_kernel(col: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where() on the mask converted to the output dtype: vectorised (a bool mask loads element by element)
    return torch.where(mask.to(col.dtype) != 0, col, 0.0)  # [B, T]: one write pass


def _as_bytes(mask: torch.Tensor) -> torch.Tensor:
    # the same bytes as uint8 (a view, no copy): inductor loads uint8 vectorised, bool element by element
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def _sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """R_i = sum of the valid token rewards ``[B]``, returned in float64 for the group statistics.

    The token sum accumulates in the rewards' dtype (at least float32), in one read of the inputs:
    on big inputs with a bool mask one compiled loop (``utils.compile_wanted``), else chunk by chunk
    of rows so the masked product never exists as a full ``[B, T]`` tensor.
    """
    acc = torch.promote_types(token_level_rewards.dtype, torch.float32)
    B, T = token_level_rewards.shape
    if response_mask.dtype == torch.bool and compile_wanted(B * T):  # a bool mask is exactly {0, 1}
        out = run_compiled(_masked_row_sum_kernel, token_level_rewards, _as_bytes(response_mask), acc)
        if out is not None:
            bad = ~torch.isfinite(out)  # [B] a non-finite reward somewhere in the row, maybe on padding
            if bool(bad.any()):  # where() semantics for those rows: padding never contributes
                rows = bad.nonzero().squeeze(1)
                out[rows] = torch.where(response_mask[rows].bool(), token_level_rewards[rows], 0).sum(-1, dtype=acc)
            return out.to(torch.float64)  # [B]
    out = torch.empty(B, dtype=acc, device=token_level_rewards.device)  # [B]
    for c in _row_chunks(B, T):
        # where() on a bool mask is ~4x faster than multiplying by it (no bool->float conversion)
        out[c] = torch.where(response_mask[c].bool(), token_level_rewards[c], 0).sum(-1, dtype=acc)
    return out.to(torch.float64)  # [B]


def _broadcast(scalar: torch.Tensor, response_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-sample scalar ``[B]`` -> ``[B, T]`` on the valid tokens, 0 elsewhere (one write pass)."""
    B, T = response_mask.shape
    col = scalar.to(dtype).unsqueeze(-1)  # [B, 1]
    if compile_wanted(B * T):
        out = run_compiled(_masked_broadcast_kernel, col, _as_bytes(response_mask))
        if out is not None:
            return out
    zero = torch.zeros((), dtype=dtype, device=response_mask.device)
    out = torch.empty((B, T), dtype=dtype, device=response_mask.device)  # [B, T]
    for c in _row_chunks(B, T):
        torch.where(response_mask[c].bool(), col[c], zero, out=out[c])
    return out


def _return_to_go(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted return-to-go over the valid tokens: ``G_t = r_t + gamma G_{t'}`` with ``t'`` the
    next VALID position after ``t``. Masked positions are skipped (they neither add reward nor
    discount) and carry the running return through. Zero outside the mask."""
    valid = response_mask.bool()  # [B, T]
    r = torch.where(valid, token_level_rewards, 0.0)  # [B, T] rewards on padding / env tokens ignored
    if float(gamma) == 1.0:
        # no discount: a reverse cumulative sum; holes contribute 0 and discount nothing.
        return r.flip(-1).cumsum(-1).flip(-1) * valid  # [B, T]
    # time-major copies so each step of the loop reads contiguous memory (3x faster than r[:, t])
    r_t, valid_t = r.T.contiguous(), valid.T.contiguous()  # [T, B]
    out = torch.empty_like(r_t)  # [T, B]
    running = torch.zeros_like(r_t[0])  # [B]
    for t in reversed(range(r_t.shape[0])):
        running = torch.where(valid_t[t], r_t[t] + gamma * running, running)  # [B]
        out[t] = running
    return out.T * valid  # [B, T]


# --------------------------------------------------------------------------------------------------
# estimators
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def compute_gae_advantage_return(
    *,
    token_level_rewards: torch.Tensor,
    values: torch.Tensor | None = None,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with masks that may have holes; advantages whitened over the mask, ``returns = A + V``."""
    if values is None:
        raise ValueError("adv_estimator 'gae' needs `values` from the critic (is the critic enabled?)")
    valid = response_mask.bool()  # [B, T]
    v = values.to(token_level_rewards.dtype)  # [B, T]
    # time-major copies so each step of the loop reads contiguous memory
    r_t, v_t, valid_t = token_level_rewards.T.contiguous(), v.T.contiguous(), valid.T.contiguous()  # [T, B]
    adv_t = torch.empty_like(r_t)  # [T, B]
    next_value = torch.zeros_like(r_t[0])  # [B] V of the next VALID token (0 past the end)
    last_gae = torch.zeros_like(r_t[0])  # [B] A of the next VALID token
    for t in reversed(range(r_t.shape[0])):
        delta = r_t[t] + gamma * next_value - v_t[t]  # [B]
        gae_t = delta + gamma * lam * last_gae  # [B]
        # a masked token (env token / padding) leaves the recursion state untouched
        last_gae = torch.where(valid_t[t], gae_t, last_gae)
        next_value = torch.where(valid_t[t], v_t[t], next_value)
        adv_t[t] = last_gae
    adv = adv_t.T * valid  # [B, T]
    returns = (adv + v) * valid  # [B, T] raw (un-whitened) advantage + value: the critic's target
    adv = masked_whiten(adv, valid) * valid  # [B, T]
    return adv, returns


@torch.no_grad()
def compute_grpo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (R - mean_g) / (std_g + eps) per group; singletons get mean 0, std 1."""
    scores = _sequence_scores(token_level_rewards, response_mask)  # [B] float64
    gid = _as_index(index, scores.device)  # [B]
    mean, std, cnt = group_stats(scores, gid)  # [B] each, gathered back to the sample
    single = cnt < 2  # [B]
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    adv = scores - mean  # [B]
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    out = _broadcast(adv, response_mask, token_level_rewards.dtype)  # [B, T]
    return out, out


@torch.no_grad()
def compute_dr_grpo_outcome_advantage(**kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO: R - mean_g (never divided by the std, whatever the flag says)."""
    kwargs["norm_adv_by_std_in_grpo"] = False
    return compute_grpo_outcome_advantage(**kwargs)


@torch.no_grad()
def compute_rloo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: R_i minus the mean of the other samples of the group; singletons keep R_i."""
    scores = _sequence_scores(token_level_rewards, response_mask)  # [B] float64
    gid = _as_index(index, scores.device)  # [B]
    mean, _, cnt = group_stats(scores, gid)  # [B] each
    # n/(n-1) (R - mean) == R - (sum - R)/(n-1); written this way it is one fused expression
    loo = cnt / (cnt - 1).clamp_min(1.0) * (scores - mean)  # [B]
    adv = torch.where(cnt > 1, loo, scores)  # [B]
    out = _broadcast(adv, response_mask, token_level_rewards.dtype)  # [B, T]
    return out, out


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go over valid tokens, whitened over the batch mask."""
    valid = response_mask.bool()  # [B, T]
    returns = _return_to_go(token_level_rewards, valid, gamma)  # [B, T]
    adv = masked_whiten(returns, valid) * valid  # [B, T]
    return adv, returns


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: R - mean_g broadcast over the response, whitened over the batch mask."""
    scores = _sequence_scores(token_level_rewards, response_mask)  # [B] float64
    gid = _as_index(index, scores.device)  # [B]
    mean, _, cnt = group_stats(scores, gid)  # [B] each
    mean = torch.where(cnt > 1, mean, torch.zeros_like(mean))  # a group of one: baseline 0
    centred = scores - mean  # [B]
    # Whitening over the batch's valid TOKENS (as masked_whiten would on the broadcast [B, T]
    # tensor) is a length-weighted whitening of the per-sequence values: done on [B], exactly.
    lengths = response_mask.sum(-1).to(torch.float64)  # [B] (summing in float64 directly is ~15x slower)
    n = lengths.sum()
    mu = (lengths * centred).sum() / n.clamp_min(1.0)
    var = (lengths * (centred - mu) ** 2).sum() / (n - 1).clamp_min(1.0)  # unbiased, like masked_var
    white = (centred - mu) * torch.rsqrt(var + 1e-8)  # [B]
    adv = _broadcast(white, response_mask, token_level_rewards.dtype)  # [B, T]
    return adv, adv


@torch.no_grad()
def compute_remax_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: undiscounted return-to-go minus the greedy response's reward; no whitening."""
    if reward_baselines is None:
        raise ValueError(
            "adv_estimator 'remax' needs `reward_baselines` [B]: the reward of a greedy response per prompt"
        )
    valid = response_mask.bool()  # [B, T]
    returns = _return_to_go(token_level_rewards, valid, 1.0)  # [B, T]
    base = reward_baselines.to(returns.dtype).reshape(-1, 1)  # [B, 1]
    adv = (returns - base) * valid  # [B, T]
    return adv, returns


@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k: the best response of a group gets (best - second best) [/ (std + eps)], others 0."""
    scores = _sequence_scores(token_level_rewards, response_mask)  # [B] float64
    gid, g = dense_group_ids(_as_index(index, scores.device))  # [B], G
    b = scores.shape[0]
    cnt = torch.zeros(g, dtype=torch.float64, device=scores.device).index_add_(
        0, gid, torch.ones_like(scores)
    )  # [G]
    if b and bool((cnt < 2).any()):
        raise ValueError(
            "adv_estimator 'grpo_passk' needs at least 2 responses per group "
            f"(smallest group has {int(cnt.min())}); raise actor_rollout_ref.rollout.n"
        )
    neg_inf = torch.full((g,), -torch.inf, dtype=torch.float64, device=scores.device)
    best = neg_inf.clone().scatter_reduce_(0, gid, scores, "amax")  # [G]
    pos = torch.arange(b, device=scores.device)  # [B]
    is_best = scores == best[gid]  # [B] (ties possible)
    # the earliest sample holding the group maximum is "the" best one
    big = torch.full((g,), b, dtype=torch.long, device=scores.device)
    first_best = big.scatter_reduce_(0, gid, torch.where(is_best, pos, torch.full_like(pos, b)), "amin")  # [G]
    chosen = pos == first_best[gid]  # [B] exactly one per group
    rest = torch.where(chosen, torch.full_like(scores, -torch.inf), scores)  # [B]
    second = neg_inf.clone().scatter_reduce_(0, gid, rest, "amax")  # [G]
    gap = best - second  # [G]
    if norm_adv_by_std_in_grpo:
        _, std, _ = group_stats(scores, gid)  # [B]
        gap_b = gap[gid] / (std + epsilon)  # [B]
    else:
        gap_b = gap[gid]  # [B]
    adv = torch.where(chosen, gap_b, torch.zeros_like(gap_b))  # [B]
    out = _broadcast(adv, response_mask, token_level_rewards.dtype)  # [B, T]
    return out, out


@torch.no_grad()
def compute_opo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: R minus the length-weighted group mean of R; singletons (and all-empty groups) keep R."""
    scores = _sequence_scores(token_level_rewards, response_mask)  # [B] float64
    gid, g = dense_group_ids(_as_index(index, scores.device))  # [B], G
    lengths = response_mask.sum(-1).to(torch.float64)  # [B] valid tokens: the paper's |y|
    zeros = torch.zeros(g, dtype=torch.float64, device=scores.device)
    num = zeros.clone().index_add_(0, gid, lengths * scores)  # [G]
    den = zeros.clone().index_add_(0, gid, lengths)  # [G]
    cnt = zeros.clone().index_add_(0, gid, torch.ones_like(scores))  # [G]
    base = torch.where((cnt > 1) & (den > 0), num / den.clamp_min(1.0), zeros)  # [G]
    out = _broadcast(scores - base[gid], response_mask, token_level_rewards.dtype)  # [B, T]
    return out, out


@torch.no_grad()
def compute_gpg_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    f_norm: float = 1.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: alpha (R - mean_g) / f_norm, alpha = B / (number of samples outside constant groups)."""
    if not f_norm > 0:
        raise ValueError(f"gpg: f_norm must be > 0, got {f_norm}")
    scores = _sequence_scores(token_level_rewards, response_mask)  # [B] float64
    gid = _as_index(index, scores.device)  # [B]
    mean, _, cnt = group_stats(scores, gid)  # [B] each
    single = cnt < 2  # [B]
    mean = torch.where(single, torch.zeros_like(mean), mean)
    # a sample is "invalid" (zero advantage, only dilutes the mean) when its group of >= 2 is constant:
    # tested by equality, since a computed std of equal values need not be 0
    invalid = (~single) & group_constant(scores, gid)  # [B]
    b = scores.shape[0]
    alpha = b / max(b - int(invalid.sum()), 1)  # the paper's B / (B - M)
    adv = torch.where(invalid, 0.0, alpha * (scores - mean) / f_norm)  # [B] a constant group's R - mean is 0 exactly
    out = _broadcast(adv, response_mask, token_level_rewards.dtype)  # [B, T]
    return out, out


@torch.no_grad()
def compute_gdpo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    reward_components: dict | None = None,
    gdpo_reward_weights=None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: GRPO per reward component, weighted sum, whitened over the batch's valid tokens."""
    B, T = response_mask.shape
    if reward_components:
        comps = [torch.as_tensor(v, dtype=torch.float64).reshape(-1).to(response_mask.device)
                 for v in reward_components.values()]  # K x [B]
        for k, c in zip(reward_components, comps):
            if c.shape[0] != B:
                raise ValueError(f"gdpo: reward component '{k}' has {c.shape[0]} values for {B} responses")
    else:  # one component: the outcome score itself (verl's fallback)
        comps = [_sequence_scores(token_level_rewards, response_mask)]
    if gdpo_reward_weights is None:
        weights = [1.0] * len(comps)
    else:
        weights = [float(w) for w in gdpo_reward_weights]
        if len(weights) != len(comps):
            raise ValueError(f"gdpo: {len(weights)} gdpo_reward_weights for {len(comps)} reward components")
    gid = _as_index(index, response_mask.device)  # [B]
    total = torch.zeros(B, dtype=torch.float64, device=response_mask.device)  # [B]
    for w, c in zip(weights, comps):
        mean, std, cnt = group_stats(c, gid)  # [B] each
        single = cnt < 2
        mean = torch.where(single, torch.zeros_like(mean), mean)
        std = torch.where(single, torch.ones_like(std), std)
        a = c - mean
        if norm_adv_by_std_in_grpo:
            a = a / (std + epsilon)
        total = total + w * a
    valid = response_mask.bool()  # [B, T]
    dense = _broadcast(total, response_mask, torch.float64)  # [B, T]
    out = (masked_whiten(dense, valid) * valid).to(token_level_rewards.dtype)  # [B, T]
    return out, out


def _token_weights(old_log_probs, sum_pi_squared, rollout_is_weights, valid) -> torch.Tensor:
    """``W_t = sum_{s <= t, valid} w_s``, ``w_s = (1 - 2 pi_s + sum pi^2) [rho_s^2]``, float64 ``[B, T]``."""
    if old_log_probs is None or sum_pi_squared is None:
        raise ValueError("the optimal token baseline needs `old_log_probs` and `sum_pi_squared` [B, T] "
                         "(sum over the vocabulary of pi^2 at each position, from the actor's forward)")
    pi = torch.exp(old_log_probs.to(torch.float64))  # [B, T]
    w = 1.0 - 2.0 * pi + sum_pi_squared.to(torch.float64)  # [B, T] ||score||^2 proxy of one step
    if rollout_is_weights is not None:  # the MSE-optimal baseline under truncated IS weights rho
        w = w * rollout_is_weights.to(torch.float64) ** 2
    return torch.where(valid, w, torch.zeros_like(w)).cumsum(-1)  # [B, T]


def _otb_baseline(G, W, m, gid, g: int, lengths, members, handle_zero_tail: bool, epsilon: float):
    """Per-position group baseline on aligned ``[B, K]`` tensors (``m`` the aligned validity).
    ``members`` [B] bool: the samples that count in their group. Returns ``[B, K]`` float64."""
    B, K = G.shape
    mw = torch.where(m, W, torch.zeros_like(W))  # [B, K]
    num = torch.zeros((g, K), dtype=torch.float64, device=G.device).index_add_(0, gid, torch.where(m, G, 0.0) * mw)
    den = torch.zeros((g, K), dtype=torch.float64, device=G.device).index_add_(0, gid, mw)
    cnt = torch.zeros(g, dtype=torch.float64, device=G.device).index_add_(0, gid, members.to(torch.float64))  # [G]
    base = num[gid] / (den[gid] + epsilon)  # [B, K]
    base = torch.where((cnt[gid] > 1).unsqueeze(-1), base, torch.zeros_like(base))  # a group of one: no baseline
    if handle_zero_tail:
        L = torch.where(members, lengths, torch.full_like(lengths, -1.0))  # [B] non-members never win
        longest = torch.full((g,), -1.0, dtype=torch.float64, device=G.device).scatter_reduce_(0, gid, L, "amax")
        is_max = members & (L == longest[gid])  # [B]
        n_max = torch.zeros(g, dtype=torch.float64, device=G.device).index_add_(0, gid, is_max.to(torch.float64))
        others = torch.where(is_max, torch.full_like(L, -1.0), L)  # [B]
        second = torch.full((g,), -1.0, dtype=torch.float64, device=G.device).scatter_reduce_(0, gid, others, "amax")
        # the unique longest response of a group of >= 2: no peer reaches past the second-longest length
        lone = is_max & (n_max[gid] == 1) & (cnt[gid] > 1) & (L > second[gid])  # [B]
        pos = torch.arange(K, device=G.device, dtype=torch.float64).unsqueeze(0)  # [1, K]
        tail = lone.unsqueeze(-1) & (pos >= second[gid].clamp_min(0).unsqueeze(-1))  # [B, K]
        base = torch.where(tail, torch.zeros_like(base), base)
    return base


@torch.no_grad()
def compute_optimal_token_baseline_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline, positions aligned by absolute response position."""
    valid = response_mask.bool()  # [B, T]
    G = _return_to_go(token_level_rewards.to(torch.float64), valid, 1.0)  # [B, T]
    W = _token_weights(old_log_probs, sum_pi_squared, rollout_is_weights, valid)  # [B, T]
    gid, g = dense_group_ids(_as_index(index, valid.device))  # [B], G
    lengths = valid.sum(-1).to(torch.float64)  # [B]
    base = _otb_baseline(G, W, valid, gid, g, lengths, torch.ones_like(lengths, dtype=torch.bool),
                         handle_zero_tail, epsilon)  # [B, T]
    dt = token_level_rewards.dtype
    return ((G - base) * valid).to(dt), G.to(dt)


@torch.no_grad()
def compute_tir_optimal_token_baseline_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline for multi-turn responses: the k-th VALID token of each response is
    compared with the k-th valid token of its peers (environment tokens skipped)."""
    valid = response_mask.bool()  # [B, T]
    G = _return_to_go(token_level_rewards.to(torch.float64), valid, 1.0)  # [B, T]
    W = _token_weights(old_log_probs, sum_pi_squared, rollout_is_weights, valid)  # [B, T]
    B, T = valid.shape
    lengths = valid.sum(-1)  # [B]
    K = int(lengths.max()) if B else 0
    # compact: valid token t of row i goes to column k = (number of valid tokens before it)
    k_of_t = (valid.cumsum(-1) - 1).clamp_min(0)  # [B, T]
    rows = torch.arange(B, device=valid.device).unsqueeze(-1).expand(B, T)  # [B, T]
    Gc = torch.zeros((B, K), dtype=torch.float64, device=valid.device)
    Wc = torch.zeros((B, K), dtype=torch.float64, device=valid.device)
    Gc[rows[valid], k_of_t[valid]] = G[valid]
    Wc[rows[valid], k_of_t[valid]] = W[valid]
    mc = torch.arange(K, device=valid.device).unsqueeze(0) < lengths.unsqueeze(-1)  # [B, K]
    gid, g = dense_group_ids(_as_index(index, valid.device))  # [B], G
    members = lengths > 0  # [B] empty responses do not count towards their group
    base_c = _otb_baseline(Gc, Wc, mc, gid, g, lengths.to(torch.float64), members, handle_zero_tail, epsilon)
    adv = torch.zeros((B, T), dtype=torch.float64, device=valid.device)
    adv[valid] = (Gc - base_c)[rows[valid], k_of_t[valid]]
    dt = token_level_rewards.dtype
    return adv.to(dt), G.to(dt)


@torch.no_grad()
def variance_proxy_metrics(*, old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, advantages: torch.Tensor,
                           response_mask: torch.Tensor, rollout_is_weights: torch.Tensor | None = None,
                           grad_norm: float | None = None) -> dict[str, float]:
    """verl's ``variance_proxy/*`` metrics of a batch (see the module docstring), in float64. Rows
    with no valid token count with ``a = W = 0``, as in verl (its masked mean adds 1e-8 to the count)."""
    f64 = torch.float64
    m = response_mask.to(f64)  # [B, T]
    n_tok = m.sum(-1)  # [B]
    w = 1.0 - 2.0 * torch.exp(old_log_probs.to(f64)) + sum_pi_squared.to(f64)  # [B, T]
    a = (advantages.to(f64) * m).sum(-1) / (n_tok + 1e-8)  # [B] the response's mean advantage
    if rollout_is_weights is not None:
        rho = rollout_is_weights.to(f64)  # [B, T]
        W = (w * rho**2 * m).sum(-1)  # [B]
        rho_bar = (rho * m).sum(-1) / (n_tok + 1e-8)  # [B]
        # verl recovers w from w rho^2 by dividing by max(rho^2, 1e-10): a vetoed token (rho = 0) adds 0
        w_plain = w * rho**2 / (rho**2).clamp_min(1e-10)  # [B, T]
        power = (rho_bar**2 * a**2 * (w_plain * m).sum(-1).clamp_min(0.0)).mean()
    else:
        W = (w * m).sum(-1)  # [B]
        power = (a**2 * W.clamp_min(0.0)).mean()
    out = {"variance_proxy/proxy2_total_power": float(power), "variance_proxy/expected_a_squared": float((a**2).mean()),
           "variance_proxy/expected_w": float(W.mean())}
    if grad_norm is not None:
        signal = float(grad_norm) ** 2
        out["variance_proxy/proxy1_signal_strength"] = signal
        n = a.shape[0]
        out["variance_proxy/proxy3_pure_noise"] = max(0.0, (float(power) - signal) / (n - 1)) if n > 1 else 0.0
    return out


CPGD_WEIGHTS = ("STD_weight", "clip_filter_like_weight", "naive")


@torch.no_grad()
def compute_cpgd_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    weight_factor_in_cpgd: str = "STD_weight",
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPGD's advantage: GRPO (STD_weight), centred only (naive) or centred x min(B / G_nz, 3)."""
    if weight_factor_in_cpgd not in CPGD_WEIGHTS:
        raise ValueError(f"weight_factor_in_cpgd='{weight_factor_in_cpgd}' is not one of {list(CPGD_WEIGHTS)}")
    scores = _sequence_scores(token_level_rewards, response_mask)  # [B] float64
    gid, g = dense_group_ids(_as_index(index, scores.device))  # [B], G
    mean, std, cnt = group_stats(scores, gid)  # [B] each
    single = cnt < 2
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    centred = scores - mean  # [B]
    if weight_factor_in_cpgd == "STD_weight":
        adv = centred / (std + epsilon)
    elif weight_factor_in_cpgd == "naive":
        adv = centred
    else:
        first = torch.full((g,), scores.shape[0], dtype=torch.long, device=scores.device).scatter_reduce_(
            0, gid, torch.arange(scores.shape[0], device=scores.device), "amin")  # [G] one sample per group
        varied = single | ~group_constant(scores, gid)  # [B] siiRL's "non-zero std": a group of one counts
        g_nz = int(varied[first].sum())  # groups with a non-zero std (siiRL's count), tested by equality
        # no such group: every centred value is 0 already (siiRL would divide by zero here)
        adv = centred * min(scores.shape[0] / g_nz, 3.0) if g_nz else torch.zeros_like(centred)
    out = _broadcast(adv, response_mask, token_level_rewards.dtype)  # [B, T]
    return out, out


# --------------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------------

ADV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "dr_grpo": compute_dr_grpo_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "remax": compute_remax_outcome_advantage,
    "grpo_passk": compute_grpo_passk_outcome_advantage,
    # verl's vectorised spellings: the same math (every estimator here is vectorised)
    "grpo_vectorized": compute_grpo_outcome_advantage,
    "rloo_vectorized": compute_rloo_outcome_advantage,
    "opo": compute_opo_outcome_advantage,
    "gpg": compute_gpg_outcome_advantage,
    "gdpo": compute_gdpo_outcome_advantage,
    "optimal_token_baseline": compute_optimal_token_baseline_advantage,
    "tir_optimal_token_baseline": compute_tir_optimal_token_baseline_advantage,
    "cpgd": compute_cpgd_outcome_advantage,
}


def get_adv_estimator(name) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """A name of ``ADV_ESTIMATORS``, a callable, or ``"pkg.module:function"`` (a user's estimator
    with the same keyword calling convention). Unknown names raise ``ValueError`` naming the closest."""
    return load_fn(name, ADV_ESTIMATORS, "adv_estimator")


def compute_advantage(name, **kwargs) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Dispatch to the estimator ``name`` and return ``(advantages, returns, metrics)``.

    Metrics are 0-dim detached tensors (no host sync here): mean / max / min of the advantages and
    of the returns over the valid tokens (0 when the mask is empty), and an estimator's own metrics
    when it returns them as a third element (ADCA-GRPO's ``adca/*``).
    """
    adv, ret, *own = get_adv_estimator(name)(**kwargs)
    valid = kwargs["response_mask"].bool()  # [B, T]
    metrics: dict[str, torch.Tensor] = {}
    for key, x in (("critic/advantages", adv), ("critic/returns", ret)):
        x = x.detach().to(torch.float32)  # [B, T]
        if x.numel() == 0:  # empty batch: amax/amin have nothing to reduce
            metrics.update({f"{key}/{s}": torch.zeros((), device=x.device) for s in ("mean", "max", "min")})
            continue
        n = valid.sum()
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        metrics[f"{key}/mean"] = torch.where(n > 0, (x * valid).sum() / n.clamp_min(1), zero)
        metrics[f"{key}/max"] = torch.where(n > 0, torch.where(valid, x, -torch.inf).amax(), zero)
        metrics[f"{key}/min"] = torch.where(n > 0, torch.where(valid, x, torch.inf).amin(), zero)
    for extra in own:  # the estimator's own metrics
        metrics.update(extra)
    return adv, ret, metrics
