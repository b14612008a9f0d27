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

What the RM reads (verl's rule: ``verl/experimental/reward_loop/reward_loop.py``
``_preprocess_reward_inputs``, and the ``input_tokenizer`` switch of verl's legacy reward-model worker).
With ``reward_model.model.input_tokenizer`` set (verl's default: the actor's model path) each sample is
re-tokenised for the RM (:class:`RMInputs`): the response is decoded with ``input_tokenizer`` (the
tokenizer that produced the ids), its EOS text removed, appended to the prompt's chat messages as the
assistant turn, and the conversation is rendered by the RM tokenizer's own chat template
(``add_generation_prompt=False``) and tokenized by the RM tokenizer::

    x_rm = tok_rm( template_rm( messages + [{"role": "assistant", "content": dec_in(y) - eos}] ) )

A BOS the template writes is dropped before tokenizing, and the tokenizer's own special tokens are
added, so a Llama-style template yields one BOS (verl strips it for the engine, which adds it back).
``reward_model.max_length`` truncates ``x_rm`` to its first ``max_length`` tokens (verl's
``truncation='right'``: the end of a long response is then cut and the score is read at the last kept
token). With ``input_tokenizer=null`` the RM reads the actor's ids as they are (prompt + response,
EOS included), which needs the actor's vocabulary (checked before any worker starts).

Not built (each refused by the config with the reason): generative reward models
(``reward_model.rollout``), a separate resource pool, and DAPO overlong shaping on top of an RM score
(verl's managers return ``rm_scores`` as they are, so verl never shapes them).
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


class RMInputs:
    """The reward model's input batch from a generated one (see the module docstring): the rollout's
    prompt messages (``meta["raw_prompt"]``) and decoded responses, rendered by the RM tokenizer's chat
    template. Each RM sequence goes in as a one-token response after a left-padded prompt, so the
    workers' last-valid-token read is its last token."""

    def __init__(self, input_tokenizer, rm_tokenizer, max_length: int | None = None):
        if not getattr(rm_tokenizer, "chat_template", None):
            raise ValueError("the reward model's tokenizer has no chat template, and re-tokenising renders the "
                             "conversation with it (as verl does): add a chat_template to its tokenizer_config.json, "
                             "or set reward_model.model.input_tokenizer=null to feed it the actor's token ids")
        self.src, self.rm, self.max_length = input_tokenizer, rm_tokenizer, max_length

    def texts(self, batch) -> list[str]:
        """The RM's input text of every sample."""
        msgs = batch.get_meta("raw_prompt")
        lengths = batch.response_length.tolist()
        eos = self.src.eos_token
        out = []
        for chat, resp, n in zip(msgs, batch.responses, lengths):
            text = self.src.decode(resp[:n].tolist())
            if eos:
                text = text.replace(eos, "")
            conv = list(chat) + [{"role": "assistant", "content": text}]
            rendered = self.rm.apply_chat_template(conv, add_generation_prompt=False, tokenize=False)
            bos = self.rm.bos_token
            if bos and rendered.startswith(bos):
                rendered = rendered[len(bos):]
            out.append(rendered)
        return out

    def ids(self, batch) -> list[list[int]]:
        """The RM's token ids of every sample (truncated to ``max_length`` from the right)."""
        seqs = [self.rm(t, add_special_tokens=True)["input_ids"] for t in self.texts(batch)]
        if self.max_length:
            seqs = [s[: self.max_length] for s in seqs]
        bad = [i for i, s in enumerate(seqs) if not s]
        if bad:
            raise ValueError(f"samples {bad[:5]} render to no reward-model token at all")
        return seqs

    def __call__(self, batch):
        from trainer.batch import RolloutBatch
        from trainer.rollout.single_turn import pad_left, pad_right

        seqs = self.ids(batch)
        pad = self.rm.pad_token_id if self.rm.pad_token_id is not None else 0
        heads = [s[:-1] for s in seqs]
        p_ids, p_mask = pad_left(heads, max(1, max(map(len, heads))), pad)
        r_ids, r_mask = pad_right([s[-1:] for s in seqs], 1, pad, torch.long)
        return RolloutBatch.from_tokens(p_ids, r_ids, p_mask, r_mask)
