"""Read a Hugging Face ``config.json`` (Llama, Qwen2, Qwen3) and map it onto megatron-core.

The three families share one decoder layout, pre-norm RMSNorm + GQA attention with RoPE + SwiGLU MLP:

    h   = x + o_proj(Attn(rope(norm_q(q_proj(n1(x)))), rope(norm_k(k_proj(n1(x)))), v_proj(n1(x))))
    out = h + down_proj(silu(gate_proj(n2(h))) * up_proj(n2(h)))

and differ only in switches: Qwen2 has a bias on q/k/v (``add_qkv_bias``); Qwen3 has a per-head
RMSNorm on q and k (``qk_layernorm``) and no qkv bias; Llama has neither (``attention_bias`` would
put a bias on o_proj too, which megatron cannot express separately from the MLP biases, so it is
refused). Any number of key/value heads that divides the query heads is accepted (GQA/MQA).

RoPE inverse frequencies are computed here with the exact float32 arithmetic of ``transformers``
(``modeling_rope_utils``) for the types ``default``, ``linear`` and ``llama3``; other types (yarn,
longrope, dynamic) change the attention scale or depend on the sequence length and are refused
rather than silently approximated.

Vocabulary padding: megatron splits the embedding and output rows evenly over tensor-parallel ranks,
so the vocabulary is padded with zero rows to a multiple of ``lcm(vocab_multiple, tp)``
(``vocab_multiple`` defaults to 128). Because the multiple does not depend on ``tp`` for any ``tp``
dividing 128, checkpoints keep the same global shapes at every TP and can be resharded. The padded
rows never reach a probability: :mod:`megatron_bridge.logprobs` masks them out of the softmax.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class HFModelConfig:
    """The subset of a HF decoder config the bridge needs, normalised across families."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_parameters: dict = field(default_factory=dict)  # full HF rope dict (type, factor, ...)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    raw: dict = field(default_factory=dict)  # the config.json as read, written back on export

    @property
    def rope_type(self) -> str:
        return self.rope_parameters.get("rope_type", self.rope_parameters.get("type", "default"))


def _get(d: dict, *keys, default=None):
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


def read_hf_config(src: str | os.PathLike | dict) -> HFModelConfig:
    """Parse ``config.json`` (a directory, a file path, or an already-loaded dict)."""
    if isinstance(src, dict):
        raw = dict(src)
    else:
        path = os.path.join(src, "config.json") if os.path.isdir(src) else src
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    mt = raw.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(f"model_type {mt!r} not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    heads = int(raw["num_attention_heads"])
    kv = int(_get(raw, "num_key_value_heads", default=heads))
    if heads % kv:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    head_dim = int(_get(raw, "head_dim", default=raw["hidden_size"] // heads))

    # RoPE: transformers >= 5 writes ``rope_parameters`` (with rope_theta inside); older configs have
    # a top-level ``rope_theta`` and an optional ``rope_scaling`` dict. Accept both.
    rope = dict(_get(raw, "rope_parameters", "rope_scaling", default={}) or {})
    if "rope_type" not in rope:
        rope["rope_type"] = rope.get("type", "default")
    theta = float(_get(rope, "rope_theta", default=_get(raw, "rope_theta", default=10000.0)))
    rope["rope_theta"] = theta
    if float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1 is not supported")
    if rope["rope_type"] == "llama3":
        rope.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope type {rope['rope_type']!r} not supported; use one of {SUPPORTED_ROPE_TYPES}")

    if raw.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {raw.get('hidden_act')!r}: only SwiGLU (silu) is supported")
    if raw.get("use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not supported")
    if raw.get("mlp_bias", False):
        raise NotImplementedError("mlp_bias=True is not supported")

    if mt == "qwen2":
        qkv_bias = True  # Qwen2 always carries q/k/v biases (and none on o_proj)
    else:
        qkv_bias = False
        if raw.get("attention_bias", False):
            # Llama/Qwen3 attention_bias puts a bias on o_proj too; megatron ties that switch to the
            # MLP biases (add_bias_linear), so it cannot be represented faithfully.
            raise NotImplementedError(f"{mt} with attention_bias=True is not supported")

    return HFModelConfig(
        model_type=mt,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)),
        rope_theta=theta,
        rope_parameters=rope,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=(mt == "qwen3"),
        max_position_embeddings=int(_get(raw, "max_position_embeddings", default=4096)),
        raw=raw,
    )


def padded_vocab_size(vocab_size: int, tp: int, vocab_multiple: int = 128) -> int:
    """Smallest multiple of ``lcm(vocab_multiple, tp)`` that holds ``vocab_size`` rows."""
    m = math.lcm(int(vocab_multiple), int(tp))
    return ((vocab_size + m - 1) // m) * m


def rope_inv_freq(cfg: HFModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies ``[head_dim // 2]`` (float32), bit-identical to ``transformers``.

    default: inv_freq_i = 1 / theta^(2i / d)
    linear:  inv_freq_i / factor                          (position interpolation)
    llama3:  per-band rescaling of Llama 3.1: long wavelengths divided by ``factor``, short ones
             unchanged, and a linear blend in between (smooth = (L / wavelen - lo) / (hi - lo)).
    """
    p = cfg.rope_parameters
    d = cfg.head_dim
    base = float(cfg.rope_theta)
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype=torch.float) / d))
    kind = cfg.rope_type
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(p["factor"])
    if kind == "llama3":
        factor = p["factor"]
        lo, hi = p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        lo_wav, hi_wav = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > lo_wav, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < hi_wav) * ~(wavelen > lo_wav)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(kind)


def pipeline_layout(num_layers: int, pp: int, pp_layers: list[int] | None) -> list[int]:
    """Layers per pipeline stage: ``pp_layers`` if given (uneven allowed), else an even split."""
    if pp_layers is None:
        if num_layers % pp:
            raise ValueError(f"{num_layers} layers do not split evenly over pp={pp}; pass pp_layers")
        return [num_layers // pp] * pp
    if len(pp_layers) != pp or sum(pp_layers) != num_layers or min(pp_layers) < 1:
        raise ValueError(f"pp_layers={pp_layers} must have {pp} positive entries summing to {num_layers}")
    return list(pp_layers)


def transformer_config_kwargs(
    cfg: HFModelConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    pp_layers: list[int] | None = None,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool = True,
    sequence_parallel: bool = False,
) -> dict[str, Any]:
    """Keyword arguments for ``megatron.core.transformer.TransformerConfig``.

    Dropout is off (RL log-prob passes must be deterministic) and every fusion that needs CUDA
    kernels is disabled so the same config runs on CPU; the TE spec on GPU brings its own kernels.
    """
    import torch.nn.functional as F

    layout = pipeline_layout(cfg.num_layers, pp, pp_layers)
    kw: dict[str, Any] = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_heads,
        num_query_groups=cfg.num_kv_heads,
        kv_channels=cfg.head_dim,
        layernorm_epsilon=cfg.rms_norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        variable_seq_lengths=True,  # micro-batches may differ in length; p2p exchanges shapes
        moe_token_dispatcher_type="alltoall",  # unused (dense model); the default refuses variable lengths
    )
    if pp > 1 and len(set(layout)) > 1:
        # Uneven split: megatron's explicit layout, one list per stage; the embedding sits on the first
        # stage and the loss (final norm + output layer) on the last.
        rows = [["decoder"] * n for n in layout]
        rows[0] = ["embedding"] + rows[0]
        rows[-1] = rows[-1] + ["loss"]
        kw["pipeline_model_parallel_layout"] = rows
    return kw
