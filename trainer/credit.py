"""ADCA-GRPO in the loop: ask an LLM judge about the steps of each trajectory, then fuse its GOOD/BAD
flags with the outcome scores into token advantages.

The math is :func:`trainer.algos.adca.compute_adca_grpo_advantage` (AgentEvolver, Zhai et al. 2025,
arXiv:2511.10395; see that module's docstring for every formula). This module is the I/O around it,
one call per step from the driver's math (:func:`trainer.step.driver_math`):

  1. outcome scores R_i = sum of the token-level rewards (after overlong shaping / KL-in-reward);
  2. o_i = per-group z-score of R (:func:`outcome_zscore`) decides, with ``skip_type``, which samples
     the judge is asked about (:func:`select_judge_samples`); after ``prm_steps`` training steps, or
     from data epoch ``prm_epoch`` on (the seed's gate), nobody is asked (:func:`prm_active`);
  3. each asked trajectory becomes ``(query, steps, score)``: the steps are the assistant turns, in
     order, each with the environment's answer as its observation (multi-turn: from the conversation
     the agent loop kept in ``meta["messages"]``; single-turn: the response is the one step). The
     number of steps is ``K_i = max(step_ids) + 1``, the same K the advantage broadcast uses, so a
     turn cut by the token budget is still judged;
  4. :meth:`trainer.rewards.judge.JudgeClient.judge_batch` returns per-trajectory flags, or None when
     the judge failed (after its transport retries and one stricter-prompt retry): that sample falls
     back to outcome-only credit (``use_prm=False``);
  5. the advantages: ``compute_adca_grpo_advantage`` through the estimators' dispatch
     (:func:`trainer.algos.advantages.compute_advantage`, which takes a callable), so its ``critic/*``
     statistics are made as every estimator's are.

``evaluation_type=local`` serves a local HF model as the judge with ``python -m trainer.serve`` in a
subprocess (:class:`trainer.rewards.judge_server.LocalJudgeServer`): by default the actor's own initial
checkpoint, or ``attribution_driven_credit_assignment.local_model_path``. ``rule`` serves the environment's
own rule (:meth:`trainer.envs.base.Environment.label_steps`, GOOD = the step made progress) behind the same
chat interface (:mod:`trainer.rewards.rule_judge`), so the client's whole path runs with labels that carry
information. ``api`` talks to ``base_url`` with the key from the environment variable ``api_key_env``
(``DASHSCOPE_API_KEY`` as the seed recipe sets it).

A judge that gives no usable labels (transport failures, unparseable answers) for more than
``max_fallback_fraction`` (0.1) of a step's judged trajectories stops the run (:func:`check_fallbacks`):
past that, ADCA is outcome-only GRPO at the judge's cost.

Metrics: the judge's (``adca/judge_*``; ``adca/judge_fallback_fraction`` = fallbacks / trajectories the
judge was asked about) and the fusion's (``adca/good_fraction``, ``adca/prm_fraction``,
``adca/skipped_fraction`` = samples not asked / batch, ``adca/prm_abs_mean``, ``adca/orm_abs_mean``,
``adca/flag_outcome_corr``, ...), logged when ``adca_grpo.enable_adca_metric``.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from trainer.algos.adca import (compute_adca_grpo_advantage, num_steps_from_step_ids, outcome_zscore, prm_active,
                                select_judge_samples)
from trainer.algos.advantages import compute_advantage, compute_grpo_outcome_advantage
from trainer.batch import RolloutBatch
from trainer.rewards.judge_server import JudgeServer, LocalJudgeServer, RuleJudgeServer


# --------------------------------------------------------------------------------------------------
# trajectories for the judge
# --------------------------------------------------------------------------------------------------
def steps_from_messages(messages: Sequence[dict], k: int) -> tuple[str, list[dict]]:
    """``(query, steps)`` from a conversation: the query is the text of the user messages before the
    first assistant turn; step j is the j-th assistant message with everything the environment or
    tools said after it (up to the next assistant turn) as its observation. Exactly ``k`` steps: a
    conversation with fewer assistant messages (cannot happen with the agent loop's step ids) is padded
    with empty steps so the flags still line up with the step ids."""
    query_parts, steps = [], []
    for msg in messages:
        role, content = msg.get("role"), msg.get("content") or ""
        if role == "assistant":
            steps.append({"action": content, "observation": ""})
        elif not steps:
            if role == "user":
                query_parts.append(content)
        else:
            obs = steps[-1]["observation"]
            steps[-1]["observation"] = (obs + "\n" if obs else "") + (f"[{role}] " if role != "user" else "") + content
    steps = steps[:k] + [{"action": "", "observation": ""}] * max(0, k - len(steps))
    return "\n".join(query_parts), steps


def judge_trajectories(batch: RolloutBatch, tokenizer, rows: Sequence[int], scores: torch.Tensor,
                       num_steps: torch.Tensor) -> list[dict]:
    """The judge's view of the given rows: ``{"query", "steps", "score"}`` each."""
    has_messages = batch.meta is not None and "messages" in batch.meta.keys()
    msgs = batch.get_meta("messages") if has_messages else None
    out = []
    for i in rows:
        k = int(num_steps[i])
        if msgs is not None:
            query, steps = steps_from_messages(msgs[i], k)
        else:  # single-turn: the response is the one step
            p = batch.prompts[i][batch.attention_mask[i, :batch.prompt_width].bool()]
            n = int(batch.response_length[i])
            query = tokenizer.decode(p.tolist(), skip_special_tokens=True)
            steps = [{"action": tokenizer.decode(batch.responses[i, :n].tolist(), skip_special_tokens=True),
                      "observation": ""}][:k]
        out.append({"query": query, "steps": steps, "score": float(scores[i])})
    return out


def grpo_advantage(batch: RolloutBatch, mask: torch.Tensor) -> torch.Tensor:
    """Each sample's GRPO outcome advantage (R - mean_g) / (std_g + 1e-6), unbiased std as verl's GRPO,
    ``[B]``: what the seed's judge sees with ``overall_score_source=advantages`` (it reads the batch's
    advantages after verl's GRPO pass)."""
    adv, _ = compute_grpo_outcome_advantage(token_level_rewards=batch.token_level_rewards.double(),
                                            response_mask=mask, index=batch.group_ids)  # [B, T]
    return (adv * mask).sum(-1) / mask.sum(-1).clamp_min(1)  # [B]: the per-token value is constant per row


# --------------------------------------------------------------------------------------------------
# the phase
# --------------------------------------------------------------------------------------------------
def adca_estimator_inputs(batch: RolloutBatch, tokenizer, judge, settings, *, global_step: int, epoch: int = 0
                          ) -> tuple[dict[str, Any], dict[str, float]]:
    """The keywords of :func:`trainer.algos.adca.compute_adca_grpo_advantage` for ``batch`` (needs
    ``token_level_rewards``, ``group_ids``, ``step_ids``), with the judge's flags, and the judge's
    metrics. ``settings``: ``attribution_driven_credit_assignment`` (the plan's plain dict, or the
    config section). ``judge`` has ``judge_batch(trajectories, global_step=) -> (flags, metrics)``.
    Attribution runs while ``global_step < prm_steps`` and ``epoch < prm_epoch`` (the seed's gate, in
    data epochs). The judge sees as each trajectory's overall score (``overall_score_source``, the
    seed's name) its outcome score R_i (``token_level_rewards``, as the seed's trainer asks) or its
    GRPO advantage o_i (``advantages``)."""
    g = settings["adca_grpo"]
    mask = batch.response_mask.bool()  # [B, T]
    if batch.step_ids is None:  # single-turn: every response token belongs to step 0
        batch.step_ids = torch.where(mask, 0, -1).to(torch.int64)  # [B, T]
    step_ids = torch.where(mask, batch.step_ids, -1)  # [B, T]; a masked-out token belongs to no step
    scores = (batch.token_level_rewards.double() * mask).sum(-1)  # [B]
    k = num_steps_from_step_ids(step_ids)  # [B]

    zs = outcome_zscore(scores, batch.group_ids)  # [B]
    ask = select_judge_samples(zs, scores, settings["skip_type"])  # [B]
    ask &= k > 0
    if not prm_active(global_step, g["prm_steps"]) or (g["prm_epoch"] is not None and epoch >= g["prm_epoch"]):
        ask[:] = False
    rows = ask.nonzero().flatten().tolist()
    flags: list = [None] * len(scores)
    judge_m: dict[str, float] = {}
    if rows:
        shown = grpo_advantage(batch, mask) if settings["overall_score_source"] == "advantages" else scores
        got, judge_m = judge.judge_batch(judge_trajectories(batch, tokenizer, rows, shown, k), global_step=global_step)
        for i, f in zip(rows, got):
            flags[i] = f
    use_prm = torch.tensor([f is not None and len(f) > 0 for f in flags], dtype=torch.bool)  # [B]
    padded = [f if f is not None else [] for f in flags]
    extra = {}
    if g["prm_scheme"] == "allocation":
        extra = dict(consistent_scale=g["consistent_scale"], pos_unconsistent_scale=g["pos_unconsistent_scale"],
                     neg_unconsistent_scale=g["neg_unconsistent_scale"])
    kwargs = dict(
        step_flags=padded, index=batch.group_ids, step_ids=step_ids, response_mask=batch.response_mask,
        outcome_scores=scores, num_steps=k, use_prm=use_prm, prm_scheme=g["prm_scheme"], fix_base=g["fix_base"],
        alpha=g["alpha"], beta=g["beta"], do_batch_norm=g["do_batch_norm"],
        equal_trajectory_weight=g["equal_trajectory_weight"], orm_distribution=g["orm_distribution"],
        enable_length_normalization=g["enable_length_normalization"], num_skipped=len(scores) - len(rows),
        num_judge_calls=int(judge_m.get("adca/judge_calls", 0)), dtype=torch.float32, **extra)
    return kwargs, judge_m


def adca_metrics(estimator_m: dict, judge_m: dict[str, float], settings) -> dict[str, float]:
    """What ADCA logs (``adca_grpo.enable_adca_metric``): the fusion's ``adca/*`` from the estimator's
    metrics, then the judge's (its fallback fraction, over asked trajectories, is the one logged)."""
    if not settings["adca_grpo"]["enable_adca_metric"]:
        return {}
    metrics = {key: float(v) for key, v in estimator_m.items() if key.startswith("adca/")}
    metrics.update(judge_m)
    return metrics


class JudgeFallbackError(RuntimeError):
    """The judge gave no usable labels for more of a step's trajectories than ``max_fallback_fraction`` allows."""


def check_fallbacks(judge_m: dict[str, float], settings, global_step: int) -> None:
    """Stop the run when the judge fell back to outcome-only credit on more than ``max_fallback_fraction`` of
    the trajectories it was asked about this step: ADCA would then be GRPO with extra cost, silently."""
    limit = float(settings["max_fallback_fraction"])  # the schema default (0.1); no silent second default here
    asked = judge_m.get("adca/judge_trajectories", 0.0)
    fallbacks = judge_m.get("adca/judge_fallbacks", 0.0)
    if asked > 0 and fallbacks / asked > limit:
        raise JudgeFallbackError(
            f"ADCA's judge gave no usable step labels for {fallbacks:.0f} of the {asked:.0f} trajectories it was asked "
            f"about at step {global_step} ({fallbacks / asked:.0%} > attribution_driven_credit_assignment."
            f"max_fallback_fraction={limit:g}; {judge_m.get('adca/judge_errors', 0):.0f} calls got no answer, "
            f"{judge_m.get('adca/judge_format_retries', 0):.0f} answers did not parse): those trajectories got "
            f"outcome-only credit. Check the judge (its endpoint, model and answers: "
            f"attribution_driven_credit_assignment.llm_evaluation_log_dir logs them), or set "
            f"max_fallback_fraction=1 to go on anyway.")


def adca_advantages(batch: RolloutBatch, tokenizer, judge, settings, *, global_step: int, epoch: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(advantages [B, T], returns [B, T], metrics)`` for ``batch``: the judge's flags
    (:func:`adca_estimator_inputs`) into ADCA-GRPO through the estimators' dispatch. Raises
    :class:`JudgeFallbackError` past ``max_fallback_fraction`` (:func:`check_fallbacks`)."""
    kwargs, judge_m = adca_estimator_inputs(batch, tokenizer, judge, settings, global_step=global_step, epoch=epoch)
    check_fallbacks(judge_m, settings, global_step)
    adv, ret, m = compute_advantage(compute_adca_grpo_advantage, **kwargs)
    return adv, ret, adca_metrics(m, judge_m, settings)


# --------------------------------------------------------------------------------------------------
# the judge
# --------------------------------------------------------------------------------------------------
def make_judge(cfg, run_dir: str) -> tuple[Any, JudgeServer | None]:
    """``(JudgeClient, server or None)`` from the config; the caller closes the server."""
    from trainer.rewards.judge import JudgeClient  # imports aiohttp (about 0.6 s): only ADCA runs need it

    ac = cfg.attribution_driven_credit_assignment
    kw: dict[str, Any] = dict(max_tokens=ac.judge_max_tokens)
    server: JudgeServer | None = None
    log_path = os.path.join(run_dir, "judge_server.log")
    if ac.evaluation_type == "local":
        model = ac.local_model_path or cfg.actor_rollout_ref.model.path
        server = LocalJudgeServer(model, log_path=log_path, max_seq_len=ac.local_max_seq_len)
    elif ac.evaluation_type == "rule":
        server = RuleJudgeServer(ac.rule_environment or cfg.actor_rollout_ref.rollout.multi_turn.environment,
                                 log_path=log_path)
    if server is not None:
        kw.update(base_url=server.base_url, model=f"{ac.evaluation_type}-judge", api_key_env=None)
    return JudgeClient.from_config(ac, **kw), server
