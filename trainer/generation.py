"""Steps 1-3 of a training step and validation, on the driver: generation and scoring.

``collect_batch`` samples ``n`` responses per prompt (single-turn, or the multi-turn agent loop),
scores them with the reward manager (or a learned reward model), applies DAPO's overlong shaping and
dynamic sampling (groups with a constant metric are dropped and generation repeats); ``validate``
scores the held-out set with verl's metric names. :class:`Generation` binds these to the plan, the
rollout and the data for the batch sources (:mod:`trainer.batch_source`, :mod:`trainer.async_rollout`).
The user's generation hooks run here (``after_rollout``, ``after_reward``, ``after_filter``); a
batch they shrink is trimmed to the data-parallel ranks (:func:`fit_rows`). No function holds state
between steps (the loop's ``LoopState`` does, so checkpoint/resume sees everything). The rest of the
step (model passes, the driver's math, updates, weight sync) is :mod:`trainer.step`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
import torch

from trainer.algos.filtering import group_filter, overlong_reward_penalty, select_filter_metric
from trainer.batch import RolloutBatch
from trainer.console import val_core_acc  # noqa: F401  (read here by the loop, the report and tests)
from trainer.rewards.reward_model import place_scores, rm_metrics
from trainer.rollout.multi_turn import trajectories_to_batch
from trainer.rollout.single_turn import outputs_to_batch


class PipelineError(RuntimeError):
    """A hook or a user pipeline broke the step's contract (named in the message)."""


def fit_rows(batch, multiple: int, metrics: dict):
    """Trim the trailing rows so the batch splits over the data-parallel ranks (``multiple``: the
    least common multiple of the groups' DP sizes); the trimmed count goes to the metrics."""
    B = batch.num_samples
    keep = B - B % multiple
    if keep == B:
        return batch
    if keep == 0:
        raise PipelineError(f"after the hooks the batch has {B} samples, fewer than the {multiple} data-parallel "
                            f"ranks it must split over: drop fewer samples or generate more (data.train_batch_size).")
    metrics["pipeline/trimmed_samples"] = float(B - keep)
    return batch[torch.arange(keep)]


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
    :mod:`trainer.rewards.reward_model`). ``hooks``: a :class:`trainer.step.Hooks` whose
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


class Generation:
    """The loop's generation phases bound to the plan, the rollout and the data."""

    def __init__(self, plan, rollout, reward_mgr, tokenizer, train_ds, val_ds, reward_model=None, hooks=None,
                 row_multiple: int = 1):
        """``reward_model``: a callable ``batch -> [B]`` learned-RM scores (None: rule-based rewards).
        ``hooks``: the user's generation hooks (:mod:`trainer.step`); a batch they shrink is
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


