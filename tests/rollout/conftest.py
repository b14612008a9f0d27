"""Tiny random HF models (Llama / Qwen2 / Qwen3) and a word-level tokenizer, made locally (no hub)."""

from __future__ import annotations

import pytest
import torch

VOCAB = 96

# One tiny config per architecture; each exercises a different corner:
#   llama: GQA 4/2, llama3 rope scaling, untied embeddings
#   qwen2: qkv bias, tied embeddings, linear rope scaling
#   qwen3: q/k RMSNorm, head_dim (24) != hidden / heads (16), default rope, theta 5000
ARCHS = {
    "llama": dict(
        num_key_value_heads=2,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
    ),
    "qwen2": dict(num_key_value_heads=2, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen3": dict(num_key_value_heads=1, head_dim=24, rope_theta=5000.0),
}


# Mixture-of-experts twins: 4 experts, top-2; Qwen3-MoE renormalises the top-k weights, Qwen2-MoE does
# not and adds a gated shared expert.
MOE_ARCHS = {
    "qwen3_moe": dict(num_key_value_heads=1, head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    "qwen2_moe": dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
}


def hf_classes(arch: str):
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
    }[arch]


def make_hf_model(arch: str, seed: int = 0, **overrides):
    """A tiny random HF model in eval mode, fp32.

    Weights are redrawn with a larger spread than HF's init (std 0.02), so that greedy decoding rarely
    meets near-ties, where two correct implementations could part on rounding alone.
    """
    cfg_cls, model_cls = hf_classes(arch)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    kw.update({**ARCHS, **MOE_ARCHS}[arch])
    kw.update(overrides)
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_model(model, path, **kw) -> str:
    model.save_pretrained(str(path), **kw)
    return str(path)


@pytest.fixture(autouse=True)
def _one_thread():
    # The CI/dev machines are small and shared: with several intra-op threads, every barrier waits on
    # a descheduled thread, and tiny-model ops run ~10x slower. One thread is also deterministic.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_tokenizer(path, words: list[str]) -> str:
    """A word-level tokenizer (ids: <pad>=0, <eos>=1, <unk>=2, then ``words``), saved to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(str(path))
    return str(path)
