"""What the strategies that train a Hugging Face model as it is (DeepSpeed, FSDP2) share: loading the policy,
critic or reward model, the per-token outputs from its logits, the optimizer's parameter groups and the HF
export.

Per-token definitions (the same as the megatron path, ``megatron_bridge.logprobs``): ``x = logits / T``
(temperature first), ``logp(y) = x_y - logsumexp(x)``, ``H = logsumexp(x) - sum softmax(x) x``, ``sum pi^2
= sum exp(2 (x - logsumexp(x)))`` over the full vocabulary. The logits at position ``t`` score token
``t + 1``; :func:`next_token_outputs` returns them at ``t`` and :func:`align` moves them onto the token they
score (a row's first token and its pads get 0).

A critic is ``AutoModelForTokenClassification`` with one label (HF name ``score``, as the megatron critic
exports it), initialised as the megatron critic's head when the checkpoint has none; a reward model must
bring its trained head (:func:`trainer.rewards.reward_model.check_score_head`).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.utils.checkpoint
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from megatron_bridge.export import TOKENIZER_FILES  # the same files the megatron export copies
from trainer.fsutil import staged_dir
from trainer.hf_io import load_config_json, overridden_fields
from trainer.rewards.reward_model import check_score_head


def hf_config_with_overrides(path: str, overrides=None, **kw):
    """transformers' config of ``path`` (``kw``: its from_pretrained keywords) with verl's
    ``model.override_config`` set over it: the fields :func:`trainer.hf_io.apply_overrides` writes, so
    this model, the megatron bridge and the engines agree."""
    cfg = AutoConfig.from_pretrained(path, **kw)
    fields = overridden_fields(load_config_json(path), overrides)
    if hasattr(cfg, "rope_parameters"):  # transformers v5: rope_scaling aliases rope_parameters, which holds the theta
        fields = {k: v for k, v in fields.items() if k not in ("rope_scaling", "rope_theta")}
    for k, v in fields.items():
        setattr(cfg, k, v)
    return cfg


def role_config(role: str, path: str, overrides=None):
    """The transformers config a role's model is built from (a critic's or a reward model's: one label, no
    dropout before the head)."""
    if role not in ("critic", "reward"):
        return hf_config_with_overrides(path, overrides)
    cfg = hf_config_with_overrides(path, overrides, num_labels=1)
    cfg.classifier_dropout = 0.0  # the megatron critic has no dropout before its head
    return cfg


def model_class(role: str):
    return AutoModelForTokenClassification if role in ("critic", "reward") else AutoModelForCausalLM


def critic_head_init(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """The megatron critic's value-head init (``megatron_bridge.model.ValueHead``), for a checkpoint without a
    trained head: ``randn(1, h) / (h + 1)`` from a generator seeded 0 (the same on every rank and strategy)."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, hidden, generator=g, dtype=torch.float32) / (hidden + 1)).to(dtype)


def load_hf_model(role: str, path: str, dtype: torch.dtype, overrides=None, **kw):
    """The role's HF model in ``dtype``: a causal LM for a policy, a one-label token classifier for a critic
    (``critic``) or a reward model (``reward``). ``kw``: more from_pretrained keywords (``attn_implementation``)."""
    cfg = role_config(role, path, overrides)
    if role not in ("critic", "reward"):
        return AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=dtype, **kw)
    if role == "reward":  # its trained head or nothing (trainer.rewards.reward_model)
        check_score_head(path, cfg.hidden_size)
    model, info = AutoModelForTokenClassification.from_pretrained(path, config=cfg, dtype=dtype,
                                                                  output_loading_info=True, **kw)
    if role == "reward":
        # a *ForSequenceClassification head has no bias; the token-classification head has one: 0
        if model.score.bias is not None and "score.bias" in info.get("missing_keys", []):
            with torch.no_grad():
                model.score.bias.zero_()
    elif any(k.startswith("score.") for k in info.get("missing_keys", [])):
        # no trained head in the checkpoint: the megatron critic's init (megatron_bridge.model.ValueHead)
        with torch.no_grad():
            model.score.weight.copy_(critic_head_init(model.config.hidden_size, dtype))
            if model.score.bias is not None:
                model.score.bias.zero_()
    return model


ENTROPY_CHUNK = 2048  # positions per chunk of the chunked entropy


def _entropy(x: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``H = logsumexp(x) - sum softmax(x) x`` per position: ``x [b, s, V]``, ``lse [b, s]``."""
    return lse - (torch.softmax(x, dim=-1) * x).sum(-1)


def _chunked_entropy(x: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The same entropy over chunks of positions: one ``[b, chunk, V]`` softmax alive at a time."""
    return torch.cat([_entropy(x[:, i:i + ENTROPY_CHUNK], lse[:, i:i + ENTROPY_CHUNK])
                      for i in range(0, x.shape[1], ENTROPY_CHUNK)], dim=1)


def next_token_outputs(logits: torch.Tensor, nxt: torch.Tensor, *, critic: bool, temperature: float,
                       with_entropy: bool, entropy_grad: bool = True, with_sum_pi_squared: bool = False,
                       checkpoint: bool = False, chunked: bool = False) -> dict:
    """Per-position outputs about the NEXT token: ``logits [b, s, V]`` (a critic: ``[b, s, 1]``), ``nxt [b, s]``
    the token after each position -> ``{name: [b, s]}`` (``values`` for a critic; ``logprobs`` and, when asked,
    ``entropy`` and ``sum_pi_squared`` for a policy). verl's entropy memory switches, which change no value:
    ``checkpoint`` (``entropy_checkpointing``) recomputes the entropy's softmax in backward instead of keeping
    it; ``chunked`` (``entropy_from_logits_with_chunking``) computes it over chunks of positions."""
    logits = logits.float()
    if critic:
        return {"values": logits[..., 0]}
    x = logits / temperature
    lse = torch.logsumexp(x, dim=-1)  # [b, s]
    res = {"logprobs": x.gather(-1, nxt.unsqueeze(-1)).squeeze(-1) - lse}
    if with_entropy:
        fn = _chunked_entropy if chunked else _entropy
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            if checkpoint and torch.is_grad_enabled():
                res["entropy"] = torch.utils.checkpoint.checkpoint(fn, x, lse, use_reentrant=False)
            else:
                res["entropy"] = fn(x, lse)
    if with_sum_pi_squared:  # sum_v exp(2 (x_v - lse)): every exponent <= 0, an advantage input (no grad)
        with torch.no_grad():
            res["sum_pi_squared"] = torch.exp(2.0 * (x - lse.unsqueeze(-1))).sum(-1)
    return res


def align(next_vals: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Values at position ``t`` (about token ``t + 1``) moved onto that token; 0 where ``valid`` is False."""
    res = torch.zeros(valid.shape, dtype=next_vals.dtype, device=next_vals.device)
    res[:, 1:] = next_vals[:, :-1]
    return torch.where(valid, res, torch.zeros_like(res))


def param_groups(model, weight_decay: float) -> list[dict]:
    """Megatron's grouping: no weight decay on biases and 1-D parameters (so every strategy follows the same
    update)."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or n.endswith(".bias") else decay).append(p)
    return [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]]


def write_hf_dir(state: dict, config, out_dir: str, source_dir: str | None) -> str:
    """``state`` (HF names -> CPU tensors) as ``model.safetensors`` with ``config`` (a transformers config) and
    the source's tokenizer files, replacing ``out_dir`` atomically."""
    with staged_dir(out_dir) as tmp:
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config.to_dict(), f, indent=2, sort_keys=True, default=str)
        if source_dir:
            for fn in TOKENIZER_FILES:
                src = os.path.join(source_dir, fn)
                if os.path.exists(src):
                    shutil.copy2(src, os.path.join(tmp, fn))
    return out_dir
