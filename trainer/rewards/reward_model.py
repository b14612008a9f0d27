"""Learned (discriminative) reward models: where the score is read and how it becomes the reward.

The model. An HF ``*ForSequenceClassification`` checkpoint with one label (``num_labels=1``, head
``score``: ``Linear(hidden, 1)``), run forward-only by the ``reward_model`` role group with either
strategy (``reward_model.strategy=megatron``: the bridge's value-head model, its ``score`` head loaded
from the checkpoint; ``deepspeed``: the HF model). The score of a response is the head at the hidden
state of the sequence's LAST valid token, i.e. the last token of prompt + response::

    r_i = w . h_i[e_i] + b,    e_i = max{t : attention_mask[i, t] = 1}

which is what ``AutoModelForSequenceClassification`` returns for a right-padded row (it pools the
logits at the last non-pad token) and what verl's reward models read
(``verl/workers/reward_model/megatron/reward_model.py``: ``ends = attention_mask.cumsum(-1).argmax(-1)``,
the logits at ``ends``).

Reading it with the per-token value path. The workers' value outputs are aligned with the token they
score: ``values[t]`` is the head at the hidden state after token ``t - 1`` (``megatron_bridge.logprobs``),
so the head at ``e_i`` itself would sit at ``e_i + 1``, past the sequence. :func:`with_score_token`
appends one token at ``e_i + 1`` to every row (a "score slot"); attention is causal, so that token
changes no hidden state at or before ``e_i``, and the value the workers align to it is exactly
``r_i``. No model code changes, and packing, micro-batching, TP / PP and ZeRO work as for the critic.

The reward (verl's rule, ``verl/workers/reward_manager/naive.py``: "if there is rm score, we directly
return rm score"; ``verl/trainer/ppo/ray_trainer.py`` computes ``rm_scores`` before the reward function,
and every verl reward manager returns them unchanged when present):

* with ``reward_model.enable=true`` the RM score IS the outcome reward: ``token_level_scores[i, T_i - 1]
  = r_i`` on the response's last token (:func:`place_scores`; an empty response gets none, as in verl
  where its end index falls in the prompt and is cropped away), and ``scores = r``;
* the rule-based scorer is NOT used for the reward. Coxswain still runs it (every data source has a
  scorer, ``trainer.rewards.scorers.get_scorer``) so that ``reward/acc`` and the validation accuracy
  stay logged: a learned reward is only trusted while the task's own check agrees with it;
* the RM score's batch statistics are logged as ``reward/rm_score/{mean,min,max}``
  (:func:`rm_metrics`); validation logs its mean as ``val-aux/rm_score/mean``.

Not built (each refused by the config with the reason): re-tokenising for an RM with another tokenizer
or chat template (``reward_model.model.input_tokenizer`` other than the actor's, ``max_length``),
generative reward models (``reward_model.rollout``), a separate resource pool, and DAPO overlong shaping
on top of an RM score (verl's managers return ``rm_scores`` as they are, so verl never shapes them).
"""

from __future__ import annotations

import torch


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` mask -> ``[B]`` index of each row's last valid token (0 for an all-pad row)."""
    am = attention_mask.bool()
    L = am.shape[1]
    pos = torch.arange(L, device=am.device).expand_as(am)
    return torch.where(am, pos, torch.full_like(pos, -1)).max(dim=1).values.clamp_min(0)


def with_score_token(prompts: torch.Tensor, responses: torch.Tensor, prompt_mask: torch.Tensor,
                     response_attention_mask: torch.Tensor, token_id: int = 0):
    """Responses widened by one column with a "score slot" token right after each row's last valid
    token (see the module docstring). Returns ``(responses [B, T+1], response_attention_mask [B, T+1],
    slot [B])``: ``slot[i]`` is the slot's column in the response part; the value the workers align
    there is the head at the last valid token."""
    B, T = responses.shape
    ram = torch.cat([response_attention_mask.bool(), torch.zeros(B, 1, dtype=torch.bool)], 1)  # [B, T+1]
    resp = torch.cat([responses, torch.full((B, 1), token_id, dtype=responses.dtype)], 1)
    full = torch.cat([prompt_mask.bool(), ram], 1)
    slot = last_token_index(full) + 1 - prompts.shape[1]  # [B] >= 0: the prompt has a real token
    if bool((slot < 0).any()):
        raise ValueError("a row with no real prompt or response token cannot be scored")
    rows = torch.arange(B)
    ram[rows, slot] = True
    resp[rows, slot] = token_id
    return resp, ram, slot


def place_scores(scores: torch.Tensor, response_length: torch.Tensor, width: int) -> torch.Tensor:
    """``[B]`` sequence scores -> ``[B, width]`` token-level scores, each on its response's last token
    (verl's ``_expand_to_token_level``); a row with an empty response gets nothing."""
    B = scores.shape[0]
    out = torch.zeros(B, width, dtype=torch.float32)
    live = response_length > 0
    rows = torch.arange(B)[live]
    out[rows, (response_length[live] - 1).long()] = scores[live].float()
    return out


def rm_metrics(scores: torch.Tensor, prefix: str = "reward/rm_score/") -> dict[str, float]:
    s = scores.double()
    return {prefix + "mean": float(s.mean()), prefix + "min": float(s.min()), prefix + "max": float(s.max())}


def check_score_head(model_path: str, hidden_size: int) -> None:
    """Refuse a checkpoint without a one-label ``score`` head: a causal LM or a base model would score
    with a freshly initialised head, i.e. noise, and a run would train on it without a sign."""
    from trainer.hf_io import SafetensorsDir

    ck = SafetensorsDir(str(model_path))
    if "score.weight" not in ck.keys():
        raise ValueError(f"reward_model.model.path={model_path} has no 'score' head (score.weight): a reward model is "
                         f"an HF *ForSequenceClassification checkpoint with num_labels=1 (a causal LM or base model "
                         f"would score with an untrained head)")
    shape = tuple(ck.get("score.weight").shape)
    if shape != (1, hidden_size):
        raise ValueError(f"reward_model.model.path={model_path}: score.weight has shape {shape}; a reward model has "
                         f"one label (shape (1, {hidden_size})): save it with num_labels=1")
