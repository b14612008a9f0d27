"""The driver-side pieces of one training step that the loop in ``trainer/main.py`` calls.

Generation and scoring (``collect_batch``: rollout, reward, overlong shaping, DAPO dynamic sampling),
the rollout-IS / rejection step, and validation. Each function does one phase over a
:class:`~trainer.workers.rollouts.Rollout` and returns what the loop needs plus a metrics dict; none
holds state between steps (the loop's ``LoopState`` holds it, so checkpoint/resume sees everything).
Model passes are methods of the role groups (:mod:`trainer.workers.roles`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
import numpy as np
import torch

from trainer.algos.filtering import group_filter, overlong_reward_penalty, select_filter_metric
from trainer.batch import RolloutBatch
from trainer.rollout.single_turn import outputs_to_batch


class DynamicSamplingError(RuntimeError):
    pass


@contextmanager
def timer(metrics: dict, name: str):
    t0 = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - t0


def to_float_metrics(m: dict, prefix: str = "") -> dict[str, float]:
    return {prefix + k: float(v) for k, v in m.items() if v is not None}


# ----------------------------------------------------------------------------------------------
# rollout + reward
# ----------------------------------------------------------------------------------------------
def generate_scored(rollout, reward_mgr, tokenizer, items: list[dict], group_ids: list[int], params: dict, *,
                    max_prompt_length: int, overlong: dict | None, multi_turn: dict | None = None,
                    reward_keys: tuple = (), reward_model=None, hooks=None) -> tuple[RolloutBatch, dict]:
    """Sample ``n`` responses per prompt, score them, apply overlong shaping; the batch carries
    ``token_level_scores``, ``scores`` and ``acc``. ``multi_turn``: play the agent loop instead
    (:func:`generate_agentic`). ``reward_keys`` (GDPO's ``algorithm.gdpo_reward_keys``): these keys of
    the scorer's returned dict are kept per sample as ``meta["reward_component/<key>"]`` (a sample
    whose scorer failed gets 0, as its score does). ``reward_model``: a callable ``batch -> [B]`` RM
    scores; its score is then the reward and the scorer gives ``acc`` only (verl's rule,
    :mod:`trainer.rewards.reward_model`). ``hooks``: a :class:`trainer.pipeline.Hooks` whose
    ``after_rollout`` hooks see the batch before the reward and ``after_reward`` ones after it."""
    if multi_turn is not None:
        batch, m = generate_agentic(rollout, tokenizer, items, group_ids, params, multi_turn=multi_turn,
                                    max_prompt_length=max_prompt_length, hooks=hooks)
        return (hooks.run("after_reward", batch, m) if hooks else batch), m
    m: dict[str, float] = {}
    prompts = [it["input_ids"] for it in items]
    with timer(m, "generate"):
        outs = rollout.generate(prompts, params)
    return score_outputs(reward_mgr, tokenizer, items, outs, group_ids, params, m, max_prompt_length=max_prompt_length,
                         overlong=overlong, reward_keys=reward_keys, reward_model=reward_model, hooks=hooks)


def score_outputs(reward_mgr, tokenizer, items: list[dict], outs: list, group_ids: list[int], params: dict, m: dict, *,
                  max_prompt_length: int, overlong: dict | None, reward_keys: tuple = (), reward_model=None,
                  hooks=None) -> tuple[RolloutBatch, dict]:
    """:func:`generate_scored` after the rollout: ``outs[i]`` (the responses of ``items[i]``) into a
    scored batch (the fully-async rollouter assembles ``outs`` itself, across weight pushes)."""
    prompts = [it["input_ids"] for it in items]
    meta = {"data_source": [it["data_source"] for it in items], "ground_truth": [it["ground_truth"] for it in items],
            "extra_info": [it.get("extra_info") for it in items]}
    if reward_model is not None:  # verl's raw_prompt: the RM re-renders the conversation with its own template
        meta["raw_prompt"] = [it["messages"] for it in items]
    batch = outputs_to_batch(prompts, outs, group_ids, max_prompt_length=max_prompt_length,
                             max_response_length=params["max_new_tokens"], pad_id=tokenizer.pad_token_id, meta=meta)
    if hooks:
        batch = hooks.run("after_rollout", batch, m)
    with timer(m, "reward"):
        lengths = batch.response_length
        texts = tokenizer.batch_decode([r[:n].tolist() for r, n in zip(batch.responses, lengths)], skip_special_tokens=True)
        tls, rm, extras = reward_mgr.score(texts, batch.get_meta("ground_truth"), batch.get_meta("data_source"),
                                           batch.get_meta("extra_info"), batch.response_mask)
    scores = torch.as_tensor(extras["scores"], dtype=torch.float32)
    batch.acc = torch.as_tensor(extras["acc"], dtype=torch.float32)
    if reward_model is not None:  # the RM's score is the reward; the rule-based scorer's acc stays
        from trainer.rewards.reward_model import place_scores, rm_metrics

        with timer(m, "reward_model"):
            scores = reward_model(batch).float()
        tls = place_scores(scores, lengths, batch.response_width)
        m.update(rm_metrics(scores))
    if overlong is not None and overlong.get("enable"):
        # verl's DAPO manager: L_exp = max_resp_len - len (max_resp_len: reward_kwargs, else the budget)
        pen = overlong_reward_penalty(lengths, max_response_length=overlong.get("max_resp_len") or params["max_new_tokens"],
                                      overlong_buffer_len=overlong["len"], penalty_factor=overlong["penalty_factor"])
        last = (lengths - 1).clamp_min(0)
        tls = tls.clone()
        tls[torch.arange(len(lengths)), last] += pen.to(tls.dtype)
        scores = scores + pen
        if overlong.get("log"):  # verl's overlong_buffer.log: the shaping term and the overlong flag
            m["reward/overlong_reward_mean"] = float(pen.mean())
            m["reward/overlong_fraction"] = float((pen < 0).float().mean())
    batch.token_level_scores = tls.float()
    batch.scores = scores
    for key in reward_keys:
        if key in ("score", "acc"):  # the manager keeps these two out of the per-sample extras
            batch.set_meta(f"reward_component/{key}", [float(x) for x in extras["scores" if key == "score" else "acc"]])
            continue
        per = extras["per_sample"]
        if not any(d.get(key) is not None for d in per):
            have = sorted({k for d in per for k, v in d.items() if v is not None} - {"reward_status"})
            raise ValueError(f"algorithm.gdpo_reward_keys names '{key}' but the scorer's results have no such key "
                             f"(extra keys returned: {have}); return a dict with '{key}' from the scorer.")
        batch.set_meta(f"reward_component/{key}", [float(d.get(key) or 0.0) for d in per])
    m.update(to_float_metrics(rm))
    if hooks:
        batch = hooks.run("after_reward", batch, m)
    return batch, m


def generate_agentic(rollout, tokenizer, items: list[dict], group_ids: list[int], params: dict, *, multi_turn: dict,
                     max_prompt_length: int, hooks=None) -> tuple[RolloutBatch, dict]:
    """Multi-turn: ``n`` episodes per task of the environment ``multi_turn["environment"]`` with the
    agent loop (:mod:`trainer.rollout.multi_turn`) played by the rollout (``Rollout.play``). The response is the whole episode after the opening prompt (sampled
    turns in the loss mask, environment turns not), ``step_ids`` number the assistant turns, and the
    outcome score is the episode's return (the sum of the environment's rewards), placed on the last
    (sampled) token; ``acc`` is the environment's success flag. ``meta["messages"]`` keeps each
    conversation (what the ADCA judge reads)."""
    from trainer.rollout.multi_turn import trajectories_to_batch

    m: dict[str, float] = {}
    tasks = [{"prompt": it["messages"], "data_source": it["data_source"], "extra_info": it.get("extra_info") or {},
              "reward_model": {"ground_truth": it["ground_truth"]}} for it in items]
    with timer(m, "generate"):
        trajs = rollout.play(tasks, params, multi_turn)
    # as wide as the longest episode (the episode budget keeps it within the caps)
    batch = trajectories_to_batch(trajs, pad_id=tokenizer.pad_token_id, group_ids=group_ids,
                                  meta={"ground_truth": [it["ground_truth"] for it in items]})
    batch.set_meta("messages", [t.messages for t in trajs])
    scores = torch.tensor([t.reward for t in trajs], dtype=torch.float32)  # [B]
    tls = torch.zeros(batch.responses.shape, dtype=torch.float32)  # [B, T]
    tls[torch.arange(len(trajs)), (batch.response_length - 1).clamp_min(0)] = scores
    batch.token_level_scores, batch.scores = tls, scores
    turns = torch.tensor([t.num_turns for t in trajs], dtype=torch.float32)
    m.update({"multi_turn/turns_mean": float(turns.mean()), "multi_turn/turns_max": float(turns.max()),
              "multi_turn/env_reward_mean": float(scores.mean()),
              "multi_turn/context_token_fraction": float(1 - batch.response_mask.sum() / batch.response_length.sum().clamp_min(1))})
    for reason in ("done", "length", "max_assistant_turns", "max_user_turns", "abort"):
        m[f"multi_turn/finish_{reason}"] = sum(t.finish_reason == reason for t in trajs) / max(len(trajs), 1)
    if hooks:  # the environment's reward comes with the episode: after_rollout already sees it
        batch = hooks.run("after_rollout", batch, m)
    return batch, m


def collect_batch(rollout, reward_mgr, tokenizer, dataset, sampler, params_for, *, train_batch_size: int,
                  gen_batch_size: int, n: int, filter_cfg: dict, max_prompt_length: int, overlong: dict | None,
                  next_group_id: int, multi_turn: dict | None = None, reward_keys: tuple = (), reward_model=None,
                  hooks=None) -> tuple[RolloutBatch, dict, int]:
    """Generate until ``train_batch_size`` prompt groups qualify (DAPO dynamic sampling), then trim.

    Without filtering this is one generation batch of ``train_batch_size`` prompts. With filtering,
    batches of ``gen_batch_size`` prompts are generated, groups whose metric is constant are dropped,
    and generation repeats until enough groups remain or ``max_num_gen_batches`` is reached."""
    m: dict[str, float] = {}
    kept: list[RolloutBatch] = []
    n_groups, gen_batches, total_groups = 0, 0, 0
    enable = filter_cfg.get("enable", False)
    bs = gen_batch_size if enable else train_batch_size
    while True:
        idx = sampler.next(bs)
        items = [dataset[i] for i in idx]
        gids = list(range(next_group_id, next_group_id + bs))
        next_group_id += bs
        batch, gm = generate_scored(rollout, reward_mgr, tokenizer, items, gids, params_for(gen_batches),
                                    max_prompt_length=max_prompt_length, overlong=overlong, multi_turn=multi_turn,
                                    reward_keys=reward_keys, reward_model=reward_model, hooks=hooks)
        for k, v in gm.items():
            m[k] = m.get(k, 0.0) + v if k.startswith(("timing_s/", "pipeline/")) else v
        gen_batches += 1
        total_groups += bs
        if enable:
            fields = {"acc": batch.acc, "score": batch.scores, "token_level_scores": batch.token_level_scores,
                      "token_level_rewards": batch.token_level_scores, "response_mask": batch.response_mask}
            keep, _ = group_filter(select_filter_metric(filter_cfg["metric"], fields), batch.group_ids)
            batch = batch[keep]
        kept.append(batch)
        n_groups += int(torch.unique(batch.group_ids).numel())
        if not enable or n_groups >= train_batch_size:
            break
        limit = filter_cfg.get("max_num_gen_batches", 0)
        if limit and gen_batches >= limit:
            raise DynamicSamplingError(
                f"DAPO dynamic sampling: after {gen_batches} generation batches of {bs} prompts only {n_groups} of the "
                f"{train_batch_size} groups needed have a non-constant '{filter_cfg['metric']}'. The prompts are too "
                f"easy or too hard for the policy. Raise algorithm.filter_groups.max_num_gen_batches (0 = unlimited), "
                f"raise data.gen_batch_size, lower data.train_batch_size, or change the data.")
    batch = RolloutBatch.cat(kept) if len(kept) > 1 else kept[0]
    # the first train_batch_size groups (whole: a hook may have left a group with fewer than n responses)
    first = torch.unique_consecutive(batch.group_ids)[:train_batch_size]
    if len(first) < int(torch.unique(batch.group_ids).numel()):
        batch = batch[torch.isin(batch.group_ids, first).nonzero().squeeze(-1)]
    m["filter/gen_batches"] = float(gen_batches)
    m["filter/kept_group_fraction"] = n_groups / max(total_groups, 1)
    return batch, m, next_group_id


def apply_rollout_is(batch: RolloutBatch, settings, *, weights: bool = True, normalize: bool = False) -> dict[str, float]:
    """The one driver site of rollout IS: the weights of the batch's old vs sampler log-probs
    (``batch.rollout_is_weights``) and the ``mismatch/`` metrics. ``settings``: a
    :class:`trainer.plan.RolloutIS` (or its keyword dict). ``weights=False``: metrics only (on the
    on-policy path the actor's ranks computed the weights inside the update, where the old
    log-probs first exist). ``normalize`` (verl's ``rollout_is_batch_normalize``): the weights are divided
    by their mean over the batch: over valid tokens at token level, over sequences (one weight each)
    at sequence / geometric level, so they average 1."""
    from trainer.algos.rollout_is import compute_rollout_is_weights

    kw = settings if isinstance(settings, dict) else settings.kwargs()
    if not weights:
        kw = {**kw, "rollout_is": False}
    w, _, is_m = compute_rollout_is_weights(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask, **kw)
    if weights and normalize and w is not None:
        m = batch.response_mask.to(w.dtype)  # [B, T]
        if kw["rollout_is_level"] == "token":
            mean = (w * m).sum() / m.sum().clamp_min(1)
        else:  # one weight per sequence
            rows = m.sum(-1) > 0  # [B]
            seq_w = (w * m).sum(-1) / m.sum(-1).clamp_min(1)  # [B]
            mean = seq_w[rows].mean() if bool(rows.any()) else w.new_ones(())
        if float(mean) > 1e-8:
            w = w / mean
        is_m["rollout_is_batch_norm_factor"] = float(mean) if float(mean) > 1e-8 else 1.0
    if weights:
        batch.rollout_is_weights = w
    return to_float_metrics(is_m)


# ----------------------------------------------------------------------------------------------
# eval
# ----------------------------------------------------------------------------------------------
def validate(rollout, reward_mgr, tokenizer, dataset, params: dict, *, max_prompt_length: int,
             batch_size: int | None, multi_turn: dict | None = None, samples: list | None = None,
             overlong: dict | None = None, reward_model=None) -> dict[str, float]:
    """Score the held-out set once (greedy by default), ``n = val_kwargs.n`` responses per prompt,
    with verl's names (``RayPPOTrainer._val_metrics_update``): ``val-core/{data_source}/acc/mean@{n}``
    (the headline), ``val-aux/{data_source}/reward/mean@{n}`` (the score), and with n > 1 the
    ``std@{n}`` of each (the mean over prompts of the std over a prompt's n responses).
    ``val-aux/response_length/mean`` is Coxswain's. ``overlong``: the training's overlong shaping,
    which verl's DAPO manager also applies to the validation reward (never to ``acc``)."""
    n = len(dataset)
    bs = batch_size or n
    lens, per, rm = [], {}, []  # per[(source, prompt)] = ([acc], [score])
    for s in range(0, n, bs):
        items = [dataset[i] for i in range(s, min(n, s + bs))]
        batch, _ = generate_scored(rollout, reward_mgr, tokenizer, items, list(range(s, s + len(items))), params,
                                   max_prompt_length=max_prompt_length, overlong=overlong, multi_turn=multi_turn,
                                   reward_model=reward_model)
        lens.append(batch.response_length.float())
        if reward_model is not None:  # the reward below is the RM's score; its mean also under its own name
            rm.append(batch.scores)
        if samples is not None:  # trainer.log_val_generations: (input, output, score) as text
            P = batch.prompts.shape[1]
            for i, sc in enumerate(batch.scores.tolist()):
                samples.append((tokenizer.decode(batch.prompts[i][batch.attention_mask[i, :P].bool()], skip_special_tokens=True),
                                tokenizer.decode(batch.responses[i, :int(batch.response_length[i])], skip_special_tokens=True),
                                float(sc)))
        for src, g, a, sc in zip(batch.get_meta("data_source"), batch.group_ids.tolist(), batch.acc.tolist(),
                                 batch.scores.tolist()):
            accs, scores = per.setdefault((src, g), ([], []))
            accs.append(a)
            scores.append(sc)
    out = {**val_metric_names(per), "val-aux/response_length/mean": float(torch.cat(lens).mean())}
    if rm:
        out["val-aux/rm_score/mean"] = float(torch.cat(rm).double().mean())
    return out


def val_metric_names(per: dict) -> dict[str, float]:
    """verl's validation metrics from ``{(data_source, prompt): ([acc per response], [score per
    response])}``: ``mean@N`` over every response of the source, ``std@N`` (N > 1) the mean over
    prompts of ``np.std`` of its responses; ``acc`` is the core variable (``val-core``)."""
    out: dict[str, float] = {}
    for src in dict.fromkeys(k[0] for k in per):
        groups = [v for k, v in per.items() if k[0] == src]
        n_max = max(len(g[0]) for g in groups)
        for var, j, sec in (("acc", 0, "val-core"), ("reward", 1, "val-aux")):
            vals = [g[j] for g in groups]
            out[f"{sec}/{src}/{var}/mean@{n_max}"] = float(np.mean([np.mean(v) for v in vals]))
            if n_max > 1:
                out[f"val-aux/{src}/{var}/std@{n_max}"] = float(np.mean([np.std(v) for v in vals]))
    return out


def val_core_acc(metrics: dict) -> float | None:
    """The held-out accuracy of a step's metrics: the mean of its ``val-core/*/acc/mean@*`` values
    (one per data source), None when the step did not validate."""
    vals = [v for k, v in metrics.items() if k.startswith("val-core/") and "/acc/mean@" in k]
    return float(np.mean(vals)) if vals else None


class Generation:
    """The loop's generation phases bound to the plan, the rollout and the data."""

    def __init__(self, plan, rollout, reward_mgr, tokenizer, train_ds, val_ds, reward_model=None, hooks=None,
                 row_multiple: int = 1):
        """``reward_model``: a callable ``batch -> [B]`` learned-RM scores (None: rule-based rewards).
        ``hooks``: the user's generation hooks (:mod:`trainer.pipeline`); a batch they shrink is
        trimmed to a multiple of ``row_multiple`` (the training groups' DP sizes)."""
        self.plan, self.rollout, self.reward_mgr, self.tok = plan, rollout, reward_mgr, tokenizer
        self.train_ds, self.val_ds, self.reward_model = train_ds, val_ds, reward_model
        self.hooks, self.row_multiple = hooks, row_multiple

    def train_batch(self, state, step: int, m: dict) -> RolloutBatch:
        """Steps 1-3 of ``step``: the batch of ``train_batch_size`` groups, generated with the
        engines awake; advances the prompt sampler and the group ids in ``state``."""
        p = self.plan
        with self.rollout.awake():
            batch, gm, state.next_group_id = collect_batch(
                self.rollout, self.reward_mgr, self.tok, self.train_ds, state.sampler,
                lambda g: p.sampling.params(step, g), train_batch_size=p.train_batch_size,
                gen_batch_size=p.gen_batch_size, n=p.n, filter_cfg=p.filter_groups, max_prompt_length=p.max_prompt_length,
                overlong=p.overlong, next_group_id=state.next_group_id, multi_turn=p.multi_turn,
                reward_keys=getattr(p, "reward_keys", ()), reward_model=self.reward_model, hooks=self.hooks)
        if self.hooks:
            from trainer.pipeline import fit_rows

            batch = fit_rows(self.hooks.run("after_filter", batch, gm), self.row_multiple, gm)
        m.update(gm)
        return batch

    def evaluate(self, samples: list | None = None) -> dict[str, float]:
        """``samples``: a list that receives every (input, output, score) (trainer.log_val_generations)."""
        p = self.plan
        with self.rollout.awake():
            return validate(self.rollout, self.reward_mgr, self.tok, self.val_ds, p.val_sampling.params(0, 0),
                            max_prompt_length=p.max_prompt_length, batch_size=p.val_batch_size, multi_turn=p.multi_turn,
                            samples=samples, overlong=p.overlong, reward_model=self.reward_model)


def driver_math(plan, batch: RolloutBatch, *, old, ref, values, kl_ctrl, adca, step: int, epoch: int = 0) -> dict[str, float]:
    """Steps 6-7 on the driver, writing the batch's fields: rejection mask, rollout-IS weights and
    mismatch metrics, KL in reward, critic values, advantages and returns. ``old``, ``ref``,
    ``values``: the role groups' results (``Sharded``, or None), fetched here only where this math
    reads them. ``adca``: ``(judge, tokenizer, adca_cfg)`` for ADCA-GRPO; ``epoch``: the data epoch of
    the batch (ADCA's ``prm_epoch`` gate)."""
    from trainer.algos.advantages import compute_advantage
    from trainer.algos.kl import apply_kl_in_reward
    from trainer.algos.rollout_is import compute_rejection_mask

    m: dict[str, float] = {}
    if old is not None and plan.driver_needs_old_log_probs():
        got = old.fetch()
        batch.old_log_probs = got["old_log_probs"]
        if getattr(plan, "sum_pi_squared", False):  # actor.calculate_sum_pi_squared: the same pass returned it
            batch.sum_pi_squared = got["sum_pi_squared"]
    # IS weights (and their batch normalisation) on the mask BEFORE rejection, as verl's
    # compute_rollout_correction_and_rejection_mask does: a rejected token still counts in the batch mean
    # of the weights, and a sequence-level weight is the product over all of its sampled tokens
    if plan.rollout_is is not None and old is not None:  # on-policy: the update's ranks weight, see the loop
        m.update(apply_rollout_is(batch, plan.rollout_is, normalize=plan.is_batch_normalize))
    for r in (plan.rejection if plan.bypass is None else None) or ():  # verl's comma list (bypass: in the loss) of rejection options: every one must keep a token
        batch.response_mask, rs_m = compute_rejection_mask(batch.old_log_probs, batch.rollout_log_probs,
                                                           batch.response_mask, divergence=r.divergence, agg=r.agg,
                                                           lower=r.lower, upper=r.upper)
        if len(plan.rejection) > 1:  # one metric set per option
            rs_m = {k.replace("rollout_rs_", f"rollout_rs_{r.agg}_{r.divergence}_", 1): v for k, v in rs_m.items()}
        m.update(to_float_metrics(rs_m))
    if plan.use_kl_in_reward:
        batch.ref_log_probs = ref.fetch()["ref_log_probs"]
        batch.token_level_rewards, kl_m = apply_kl_in_reward(
            batch.token_level_scores, batch.old_log_probs, batch.ref_log_probs, batch.response_mask,
            kl_coef=kl_ctrl.value, kl_penalty=plan.kl_penalty)
        kl_m = to_float_metrics(kl_m)
        kl_ctrl.update(kl_m["actor/reward_kl_penalty"], n_steps=batch.num_samples)
        m.update(kl_m)
    else:
        batch.token_level_rewards = batch.token_level_scores
    if values is not None:
        batch.values = values.fetch()["values"]
    if adca is not None:  # ADCA-GRPO: the judge's step flags fused with the outcome
        from trainer.credit import adca_advantages

        judge, tok, adca_cfg = adca
        batch.advantages, batch.returns, adv_m = adca_advantages(batch, tok, judge, adca_cfg, global_step=step, epoch=epoch)
        m.update(to_float_metrics(adv_m))  # adca/*
    else:
        batch.advantages, batch.returns, adv_m = compute_advantage(
            plan.adv_estimator, token_level_rewards=batch.token_level_rewards, response_mask=batch.response_mask,
            index=batch.group_ids, values=batch.values, gamma=plan.gamma, lam=plan.lam,
            norm_adv_by_std_in_grpo=plan.norm_adv_by_std_in_grpo, **getattr(plan, "adv_kwargs", {}),
            **({"reward_components": {k: torch.tensor(batch.get_meta(f"reward_component/{k}"), dtype=torch.float64)
                                      for k in plan.reward_keys}} if getattr(plan, "reward_keys", ()) else {}),
            **_otb_inputs(plan, batch))
        # its critic/advantages|returns/* are the batch's; batch_metrics logs them for every estimator
    return m


def _otb_inputs(plan, batch: RolloutBatch) -> dict:
    """The optimal token baseline's inputs, as verl's ``compute_advantage`` passes them: the start-of-step
    log-probs, ``sum pi^2`` (the config requires ``actor.calculate_sum_pi_squared``) and the rollout-IS
    weights when they are applied (None otherwise)."""
    if plan.adv_estimator not in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        return {}
    return {"old_log_probs": batch.old_log_probs, "sum_pi_squared": batch.sum_pi_squared,
            "rollout_is_weights": batch.rollout_is_weights}


def loss_fields(batch: RolloutBatch, plan) -> dict[str, torch.Tensor]:
    """The driver-computed per-token fields the actor's loss reads (sent once per shard)."""
    out = {"advantages": batch.advantages, "rollout_is_weights": batch.rollout_is_weights}
    if plan.rejection is not None and plan.bypass is None:  # the rejection-masked loss mask replaces the shard's own
        out["response_mask"] = batch.response_mask
    if plan.bypass is not None:  # bypass mode: the old log-probs are the sampler's
        out["old_log_probs"] = batch.rollout_log_probs
    return out


def check_update(m: dict, step: int) -> None:
    import math

    bad = [k for k in ("actor/loss", "actor/grad_norm") if k in m and not math.isfinite(m[k])]
    if bad or m.get("actor/skipped", 0.0) > 0:
        raise FloatingPointError(
            f"step {step}: the actor's {', '.join(bad) or 'gradient'} is NaN/inf, so the update was not "
            f"applied. Check the rewards and advantages (critic/score/*, critic/advantages/* above), lower "
            f"actor_rollout_ref.actor.optim.lr, or keep grad clipping on.")


def batch_metrics(batch: RolloutBatch, plan, *, entropy: dict | None = None, kl_coef: float | None = None,
                  grad_norm: float | None = None) -> dict:
    """verl's ``compute_data_metrics`` over the step's batch (``critic/score|rewards|advantages|
    returns|values/*``, ``critic/vf_explained_var``, ``response_length/*``, ``prompt_length/*``,
    ``response_length_non_aborted/*``, ``response/aborted_ratio``) plus ``reward/acc`` (Coxswain's),
    ``perf/total_num_tokens``, ``actor/entropy`` (verl's: the start-of-step policy's entropy on the
    rollout, aggregated by ``loss_agg_mode``, from the ranks' summed summaries) and ``kl_ctrl/coef``.
    The clip ratios count responses (prompts) at the configured cap ``max_response_length``
    (``max_prompt_length``). ``kl_coef`` None: the rollout-only subset (no training fields).
    With ``sum_pi_squared`` on the batch (``actor.calculate_sum_pi_squared``): verl's
    ``variance_proxy/*`` (:func:`trainer.algos.advantages.variance_proxy_metrics`; ``grad_norm``, the
    step's ``actor/grad_norm``, adds the two proxies that need it)."""
    from trainer.workers.metrics import entropy_from_summary

    f64 = torch.float64
    resp_len, prompt_len = batch.response_length.to(f64), batch.prompt_length.to(f64)
    live = resp_len > 0
    if not bool(live.any()):
        live = torch.ones_like(live)
    score = batch.token_level_scores.to(f64).sum(-1)[live]
    rewards = batch.token_level_rewards if batch.token_level_rewards is not None else batch.token_level_scores
    reward = rewards.to(f64).sum(-1)[live]
    m = {"critic/score/mean": float(score.mean()), "critic/score/max": float(score.max()),
         "critic/score/min": float(score.min()),
         "critic/rewards/mean": float(reward.mean()), "critic/rewards/max": float(reward.max()),
         "critic/rewards/min": float(reward.min()), "reward/acc": float(batch.acc.mean())}
    rm = batch.response_mask.bool()
    for name, x in (("advantages", batch.advantages), ("returns", batch.returns), ("values", batch.values)):
        if x is not None and bool(rm.any()):
            v = x.to(f64)[rm]
            m.update({f"critic/{name}/mean": float(v.mean()), f"critic/{name}/max": float(v.max()),
                      f"critic/{name}/min": float(v.min())})
    if batch.values is not None and batch.returns is not None and int(rm.sum()) > 1:
        ret, val = batch.returns.to(f64)[rm], batch.values.to(f64)[rm]
        m["critic/vf_explained_var"] = float(1.0 - torch.var(ret - val) / (torch.var(ret) + 1e-5))
    for name, x, cap in (("response_length", resp_len, plan.response_width),
                         ("prompt_length", prompt_len, plan.max_prompt_length)):
        m.update({f"{name}/mean": float(x.mean()), f"{name}/max": float(x.max()), f"{name}/min": float(x.min()),
                  f"{name}/clip_ratio": float((x == cap).to(f64).mean())})
    na = resp_len[live]
    m.update({"response_length_non_aborted/mean": float(na.mean()), "response_length_non_aborted/max": float(na.max()),
              "response_length_non_aborted/min": float(na.min()),
              "response_length_non_aborted/clip_ratio": float((na == plan.response_width).to(f64).mean()),
              "response/aborted_ratio": float((resp_len == 0).to(f64).mean()),
              "perf/total_num_tokens": float(batch.attention_mask.sum())})
    if kl_coef is None:
        return m
    m["kl_ctrl/coef"] = float(kl_coef)
    if getattr(batch, "sum_pi_squared", None) is not None and batch.advantages is not None:
        from trainer.algos.advantages import variance_proxy_metrics

        m.update(variance_proxy_metrics(old_log_probs=batch.old_log_probs, sum_pi_squared=batch.sum_pi_squared,
                                        advantages=batch.advantages, response_mask=batch.response_mask,
                                        rollout_is_weights=batch.rollout_is_weights, grad_norm=grad_norm))
    if entropy and entropy.get("count"):
        pol = plan.actor_update.policy
        m["actor/entropy"] = entropy_from_summary(entropy, pol.agg_mode, pol.norm_constant)
    return m


# the phases whose time verl also reports per token: generation per response token, the model passes
# and the driver's advantage math per token of the whole batch (prompt + response)
_PER_TOKEN = {"gen": "response", **{k: "all" for k in ("ref", "values", "adv", "update_critic", "update_actor")}}


def timing_metrics(m: dict, batch: RolloutBatch, n_gpus: int) -> dict[str, float]:
    """verl's ``compute_timing_metrics`` and ``compute_throughout_metrics`` from the step's
    ``timing_s/*`` (``timing_s/step`` included): ``timing_per_token_ms/*``, ``perf/total_num_tokens``,
    ``perf/time_per_step`` and ``perf/throughput`` (tokens per second per GPU; on CPU per rank slot,
    ``trainer.nnodes * trainer.n_gpus_per_node``)."""
    resp = float(batch.response_length.sum())
    total = float(batch.attention_mask.sum())
    out = {}
    for name, kind in _PER_TOKEN.items():
        t = m.get(f"timing_s/{name}")
        n = resp if kind == "response" else total
        if t is not None and n > 0:
            out[f"timing_per_token_ms/{name}"] = t * 1000.0 / n
    step = m["timing_s/step"]
    out.update({"perf/total_num_tokens": total, "perf/time_per_step": step,
                "perf/throughput": total / (step * max(n_gpus, 1)) if step > 0 else 0.0})
    return out
