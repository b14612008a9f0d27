"""Tiny random HF models and independent references for the megatron_bridge tests (no hub access).

Sizes are kept minimal (hidden 64, 2-3 layers, vocab 250 -> padded to 256) so a multi-process job
runs in seconds on two shared CPU cores. Norm weights and biases are perturbed away from their
1 / 0 init so that a wrongly mapped norm or bias cannot go unnoticed.
"""

from __future__ import annotations

import torch

VOCAB = 250  # not a multiple of 128: exercises vocabulary padding (256 rows at any TP <= 128)

# name -> (family, config kwargs). Together: GQA 4:2 and 4:1, tied and untied, qkv bias on/off,
# q/k norm, head_dim != hidden / heads, RoPE theta + linear / llama3 scaling, non-default rms eps.
CASES = {
    "llama_gqa2_untied_llama3rope": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False,
                                                   rope_theta=5000.0, rms_norm_eps=1e-5,
                                                   rope_scaling={"rope_type": "llama3", "factor": 4.0,
                                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 16})),
    "llama_gqa1_tied_linear": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True,
                                             rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2_bias_gqa2_tied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3_qknorm_gqa1_untied": ("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=False,
                                               head_dim=32, num_hidden_layers=3)),
}


def make_hf(kind: str, path: str, *, seed: int = 0, **overrides):
    """Build a random tiny HF model of family ``kind``, save it (safetensors) to ``path``, return it."""
    from transformers import (AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                              Qwen3MoeConfig)

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig,
           "qwen2_moe": Qwen2MoeConfig}[kind]
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    kw.update(overrides)
    cfg = cls(**kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif n.endswith("mlp.gate.weight"):  # a router far from uniform: no near-ties in the top-k
                p.copy_(torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def make_case(name: str, path: str, seed: int = 0):
    kind, kw = CASES[name]
    return make_hf(kind, path, seed=seed, **kw)


def random_seqs(lengths, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_reference(model, seqs, temperature: float = 1.0):
    """Per sequence, run transformers on the sequence alone (no padding at all) and return
    ``(logp [L-1], entropy [L-1])`` of tokens 1..L-1, from log_softmax(logits / T) in float32."""
    out = []
    for s in seqs:
        logits = model(torch.tensor([s])).logits[0].float() / temperature  # [L, V]
        logp = torch.log_softmax(logits, -1)  # [L, V]
        tok = torch.tensor(s[1:])
        lp = logp[:-1].gather(-1, tok[:, None])[:, 0]  # [L-1]
        ent = -(logp.exp() * logp).sum(-1)[:-1]  # [L-1]
        out.append((lp, ent))
    return out


def gather_hf(model) -> dict:
    """Full HF-named state of a live (any TP/PP) bridge model, via the streaming exporter."""
    from megatron_bridge.export import iter_hf_weights

    out = {}
    for bucket in iter_hf_weights(model, bucket_bytes=64 << 10):
        for k, t in bucket:
            out[k] = t.clone()
    return out


def loss_micro_batches(seqs, seed: int = 7) -> list[dict]:
    """Three train micro-batches of ``seqs``: the first two left-padded, the next two right-padded,
    the rest packed into one THD row; each with ``loss_mask``, random ``adv`` / ``returns`` and the
    mini-batch's token count ``n_total`` (the bridge sums micro-batch losses)."""
    from megatron_bridge.logprobs import model_inputs, pack_sequences, pad_sequences

    g = torch.Generator().manual_seed(seed)
    mbs = [pad_sequences(seqs[:2], side="left"), pad_sequences(seqs[2:4], side="right")]
    pk = pack_sequences(seqs[4:], max_tokens=64)[0]
    mbs.append({"input_ids": pk["input_ids"], "cu_seqlens": pk["cu_seqlens"]})
    total = 0
    for mb in mbs:
        inp = model_inputs(mb)
        mb["loss_mask"] = inp.token_valid
        mb["adv"] = torch.randn(inp.input_ids.shape, generator=g)
        mb["returns"] = torch.randn(inp.input_ids.shape, generator=g)
        total += int(inp.token_valid.sum())
    for mb in mbs:
        mb["n_total"] = float(total)
    return mbs


def policy_loss(outs, mb):
    """A PPO-shaped objective without RL specifics: -sum(adv * logp) - 0.01 * sum(entropy), token-sum
    normalised by the mini-batch's total token count."""
    m = mb["loss_mask"].float()
    loss = (-(mb["adv"] * outs["logprobs"]) * m).sum() / mb["n_total"] \
        - 0.01 * (outs["entropy"] * m).sum() / mb["n_total"]
    return loss, {"mean_logp": (outs["logprobs"] * m).sum() / m.sum().clamp_min(1)}


def value_loss(outs, mb):
    m = mb["loss_mask"].float()
    return ((outs["values"] - mb["returns"]) ** 2 * m).sum() / mb["n_total"], {}
