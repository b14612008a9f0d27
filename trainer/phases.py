"""The pieces of one training step that the loop in ``trainer/main.py`` calls, one function each.

Each function does one phase and returns what the loop needs plus a metrics dict; none holds state
between steps (the loop owns all state, so checkpoint/resume sees everything).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Sequence

import numpy as np
import torch

from trainer.algos.filtering import group_filter, overlong_reward_penalty, select_filter_metric
from trainer.algos.losses import batch_norm_counts
from trainer.batch import RolloutBatch, restore_order
from trainer.rollout.engine import GenerationOutput
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


def mean_metrics(rows: Sequence[dict]) -> dict[str, float]:
    keys = {k for r in rows for k in r}
    return {k: float(np.mean([r[k] for r in rows if k in r])) for k in keys}


# ----------------------------------------------------------------------------------------------
# rollout + reward
# ----------------------------------------------------------------------------------------------
def rollout(fleet, prompts: list[list[int]], params: dict) -> list[list[GenerationOutput]]:
    """Spread prompts over the engines of the fleet (contiguous chunks) and gather the outputs."""
    k = fleet.size
    chunks = [prompts[i * len(prompts) // k:(i + 1) * len(prompts) // k] for i in range(k)]
    res = fleet.call("generate", [(c, params) for c in chunks])
    outs = []
    for per_engine in res:
        for per_prompt in per_engine:
            outs.append([GenerationOutput(list(ids), list(lps), fr) for ids, lps, fr in per_prompt])
    return outs


def generate_scored(fleet, reward_mgr, tokenizer, items: list[dict], group_ids: list[int], params: dict, *,
                    max_prompt_length: int, overlong: dict | None, multi_turn: dict | None = None
                    ) -> tuple[RolloutBatch, dict]:
    """Sample ``n`` responses per prompt, score them, apply overlong shaping; the batch carries
    ``token_level_scores``, ``scores`` and ``acc``. ``multi_turn``: play the agent loop instead
    (:func:`generate_agentic`)."""
    if multi_turn is not None:
        return generate_agentic(fleet, tokenizer, items, group_ids, params, multi_turn=multi_turn,
                                max_prompt_length=max_prompt_length)
    m: dict[str, float] = {}
    prompts = [it["input_ids"] for it in items]
    with timer(m, "generate"):
        outs = rollout(fleet, prompts, params)
    meta = {"data_source": [it["data_source"] for it in items], "ground_truth": [it["ground_truth"] for it in items],
            "extra_info": [it.get("extra_info") for it in items]}
    batch = outputs_to_batch(prompts, outs, group_ids, max_prompt_length=max_prompt_length,
                             max_response_length=params["max_new_tokens"], pad_id=tokenizer.pad_token_id, meta=meta)
    with timer(m, "reward"):
        lengths = batch.response_length
        texts = tokenizer.batch_decode([r[:n].tolist() for r, n in zip(batch.responses, lengths)], skip_special_tokens=True)
        tls, rm, extras = reward_mgr.score(texts, batch.get_meta("ground_truth"), batch.get_meta("data_source"),
                                           batch.get_meta("extra_info"), batch.response_mask)
    scores = torch.as_tensor(extras["scores"], dtype=torch.float32)
    batch.acc = torch.as_tensor(extras["acc"], dtype=torch.float32)
    if overlong is not None and overlong.get("enable"):
        pen = overlong_reward_penalty(lengths, max_response_length=params["max_new_tokens"],
                                      overlong_buffer_len=overlong["len"], penalty_factor=overlong["penalty_factor"])
        last = (lengths - 1).clamp_min(0)
        tls = tls.clone()
        tls[torch.arange(len(lengths)), last] += pen.to(tls.dtype)
        scores = scores + pen
        m["reward/overlong_penalty_mean"] = float(pen.mean())
        m["reward/overlong_fraction"] = float((pen < 0).float().mean())
    batch.token_level_scores = tls.float()
    batch.scores = scores
    m.update(to_float_metrics(rm))
    return batch, m


def generate_agentic(fleet, tokenizer, items: list[dict], group_ids: list[int], params: dict, *, multi_turn: dict,
                     max_prompt_length: int) -> tuple[RolloutBatch, dict]:
    """Multi-turn: ``n`` episodes per task of the environment ``multi_turn["environment"]`` with the
    agent loop (:mod:`trainer.rollout.multi_turn`) inside each engine's worker, prompts spread over the
    engines in contiguous chunks. The response is the whole episode after the opening prompt (sampled
    turns in the loss mask, environment turns not), ``step_ids`` number the assistant turns, and the
    outcome score is the episode's return (the sum of the environment's rewards), placed on the last
    (sampled) token; ``acc`` is the environment's success flag. ``meta["messages"]`` keeps each
    conversation (what the ADCA judge reads)."""
    from trainer.rollout.multi_turn import trajectories_to_batch

    m: dict[str, float] = {}
    tasks = [{"prompt": it["messages"], "data_source": it["data_source"], "extra_info": it.get("extra_info") or {},
              "reward_model": {"ground_truth": it["ground_truth"]}} for it in items]
    k = fleet.size
    bounds = [i * len(tasks) // k for i in range(k + 1)]
    with timer(m, "generate"):
        res = fleet.call("generate_multi_turn", [(tasks[bounds[e]:bounds[e + 1]], params, multi_turn) for e in range(k)])
    trajs = []
    for e, per_engine in enumerate(res):
        for t in per_engine:
            t.task_index += bounds[e]  # chunk-local -> batch-local
            trajs.append(t)
    batch = trajectories_to_batch(trajs, pad_id=tokenizer.pad_token_id, max_prompt_length=max_prompt_length,
                                  max_response_length=multi_turn["max_response_length"], group_ids=group_ids,
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
    return batch, m


def collect_batch(fleet, reward_mgr, tokenizer, dataset, sampler, params_for, *, train_batch_size: int,
                  gen_batch_size: int, n: int, filter_cfg: dict, max_prompt_length: int, overlong: dict | None,
                  next_group_id: int, multi_turn: dict | None = None) -> tuple[RolloutBatch, dict, int]:
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
        batch, gm = generate_scored(fleet, reward_mgr, tokenizer, items, gids, params_for(gen_batches),
                                    max_prompt_length=max_prompt_length, overlong=overlong, multi_turn=multi_turn)
        for k, v in gm.items():
            m[k] = m.get(k, 0.0) + v if k.startswith("timing_s/") else v
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
    batch = batch[: train_batch_size * n]  # groups are contiguous, so this keeps whole groups
    m["filter/gen_batches"] = float(gen_batches)
    m["filter/kept_group_fraction"] = n_groups / max(total_groups, 1)
    return batch, m, next_group_id


# ----------------------------------------------------------------------------------------------
# dispatch to megatron groups
# ----------------------------------------------------------------------------------------------
def tensors_only(batch: RolloutBatch) -> RolloutBatch:
    """A shallow copy without ``meta``: the megatron workers read tensor fields only, and indexing the
    per-sample Python objects (ground truths, data sources, ...) was most of the driver's split time
    (bench_e2e: ~4x slower indexing with meta, ~25 ms of every step)."""
    out = batch.copy()
    out.meta = None
    return out


def dp_dispatch(group, layouts: list[dict], batch: RolloutBatch, method: str, **kwargs) -> dict[str, torch.Tensor]:
    """Length-balanced split over data-parallel ranks, run ``method`` on every rank (TP/PP peers of a
    DP rank get the same shard), and reassemble the per-sample outputs in the original order."""
    dp = layouts[0]["dp_size"]
    parts, index_lists, _ = tensors_only(batch).balanced_split(dp)
    payload = [p.to_numpy_dict() for p in parts]
    res = group.call(method, [(payload[l["dp_rank"]],) for l in layouts], **kwargs)
    first = {}
    for l, r in zip(layouts, res):
        first.setdefault(l["dp_rank"], r)
    keys = first[0].keys()
    # np.array copies: Ray hands back read-only zero-copy arrays, which torch would wrap with a warning
    return {k: restore_order([torch.from_numpy(np.array(first[d][k])) for d in range(dp)], index_lists) for k in keys}


def update_group(group, layouts: list[dict], batch: RolloutBatch, method: str, *, mini_batch_size: int, epochs: int,
                 shuffle: bool, seed: int, loss: dict, loss_agg_mode: str, per_mini_batch: bool = False,
                 on_policy: bool = False, **kwargs):
    """``epochs`` x mini-batches of ``mini_batch_size`` samples; each mini-batch is split over DP
    ranks and is one optimizer step. The global token/sequence counts of every mini-batch travel with
    it, so each rank's loss is normalised by the whole mini-batch (not its shard).

    ``on_policy`` (actor only; see ``is_on_policy``): the batch needs no ``old_log_probs``, the
    workers take their update forward's detached log-probs instead, and the return value is
    ``(metrics, outputs)`` with ``outputs`` = those per-token ``log_probs`` and ``entropy`` [B, T]
    in the batch's order."""
    dp = layouts[0]["dp_size"]
    B = batch.batch_size[0]
    if on_policy and not is_on_policy(num_samples=B, mini_batch_size=mini_batch_size, epochs=epochs):
        raise ValueError(f"on_policy=True needs one epoch and one mini-batch ({epochs} epochs, {B} samples, "
                         f"mini-batches of {mini_batch_size})")
    g = torch.Generator().manual_seed(seed)
    per_rank: list[list[dict]] = [[] for _ in range(dp)]
    counts, index_lists = [], []
    batch = tensors_only(batch)
    for _ in range(epochs):
        order = torch.randperm(B, generator=g) if shuffle else torch.arange(B)
        for s in range(0, B, mini_batch_size):
            sel = order[s:s + mini_batch_size]
            mb = batch[sel]
            n_tok, n_seq = batch_norm_counts(mb.response_mask, loss_agg_mode)
            counts.append((float(n_tok), float(n_seq)))
            parts, idx, _ = mb.balanced_split(dp)
            index_lists = [sel[torch.tensor(ix, dtype=torch.long)].tolist() for ix in idx]  # rows of `batch`
            for d in range(dp):
                per_rank[d].append(parts[d].to_numpy_dict())
    loss = dict(loss, global_counts=counts, on_policy=on_policy)
    res = group.call(method, [(per_rank[l["dp_rank"]],) for l in layouts], loss=loss, **kwargs)
    outs = [r.get("outputs") if isinstance(r, dict) else None for r in res]
    res = [r["metrics"] if isinstance(r, dict) else r for r in res]
    rows = [r for l, rr in zip(layouts, res) if l["tp_rank"] == 0 and l["dp_rank"] == 0 for r in rr]
    metrics = rows if per_mini_batch else mean_metrics(rows)
    if not on_policy:
        return metrics
    by_dp: dict[int, dict] = {}
    for l, o in zip(layouts, outs):  # any rank of the last pipeline stage of each DP rank
        if o is not None:
            by_dp.setdefault(l["dp_rank"], o)
    outputs = {k: restore_order([torch.from_numpy(np.array(by_dp[d][k])) for d in range(dp)], index_lists)
               for k in by_dp[0]}
    return metrics, outputs


def apply_rollout_is(batch: RolloutBatch, is_kwargs: dict) -> dict[str, float]:
    """Rollout-IS weights of the batch's old vs sampler log-probs (``batch.rollout_is_weights``) and
    the ``mismatch/`` metrics; ``is_kwargs``: the keyword arguments of ``compute_rollout_is_weights``."""
    from trainer.algos.rollout_is import compute_rollout_is_weights

    w, _, is_m = compute_rollout_is_weights(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask,
                                            **is_kwargs)
    batch.rollout_is_weights = w
    return to_float_metrics(is_m)


def is_on_policy(*, num_samples: int, mini_batch_size: int, epochs: int) -> bool:
    """One epoch of one mini-batch: the only forward of the update runs at the start-of-step
    weights, so the old log-probs equal the update's own (detached) log-probs and their separate
    forward can be skipped (verl takes the same shortcut)."""
    return epochs == 1 and mini_batch_size >= num_samples


# ----------------------------------------------------------------------------------------------
# eval
# ----------------------------------------------------------------------------------------------
def validate(fleet, reward_mgr, tokenizer, dataset, params: dict, *, max_prompt_length: int,
             batch_size: int | None, multi_turn: dict | None = None) -> dict[str, float]:
    """Score the held-out set once (greedy by default); ``val/acc`` is the headline."""
    n = len(dataset)
    bs = batch_size or n
    accs, scores, lens, per_source = [], [], [], {}
    for s in range(0, n, bs):
        items = [dataset[i] for i in range(s, min(n, s + bs))]
        batch, _ = generate_scored(fleet, reward_mgr, tokenizer, items, list(range(len(items))), params,
                                   max_prompt_length=max_prompt_length, overlong=None, multi_turn=multi_turn)
        accs.append(batch.acc)
        scores.append(batch.scores)
        lens.append(batch.response_length.float())
        for src, a in zip(batch.get_meta("data_source"), batch.acc.tolist()):
            per_source.setdefault(src, []).append(a)
    out = {"val/acc": float(torch.cat(accs).mean()), "val/score": float(torch.cat(scores).mean()),
           "val/response_length": float(torch.cat(lens).mean())}
    if len(per_source) > 1:
        out.update({f"val/acc/{k}": float(np.mean(v)) for k, v in per_source.items()})
    return out


def should_eval(step: int, test_freq: int, total_steps: int, last_eval_step: int | None) -> bool:
    """Eval at most once per step boundary: every ``test_freq`` steps and after the last step."""
    if test_freq is None or test_freq <= 0 or step == last_eval_step:
        return False
    return step % test_freq == 0 or step == total_steps
