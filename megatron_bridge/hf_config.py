"""Read a Hugging Face ``config.json`` (Llama, Qwen2, Qwen3) and map it onto megatron-core.

The three families share one decoder layout, pre-norm RMSNorm + GQA attention with RoPE + SwiGLU MLP:

    h   = x + o_proj(Attn(rope(norm_q(q_proj(n1(x)))), rope(norm_k(k_proj(n1(x)))), v_proj(n1(x))))
    out = h + down_proj(silu(gate_proj(n2(h))) * up_proj(n2(h)))

and differ only in switches: Qwen2 has a bias on q/k/v (``add_qkv_bias``); Qwen3 has a per-head
RMSNorm on q and k (``qk_layernorm``) and no qkv bias; Llama has neither (``attention_bias`` would
put a bias on o_proj too, which megatron cannot express separately from the MLP biases, so it is
refused). Any number of key/value heads that divides the query heads is accepted (GQA/MQA).

``config.json`` is read by :mod:`trainer.hf_io` (the reader the rollout engines use too, so a
checkpoint loads in both or in neither); RoPE inverse frequencies come from
:func:`trainer.hf_io.rope_inv_freq` (``default``, ``linear``, ``llama3``, bit-identical to
``transformers``). On top of what that reader refuses, :func:`read_hf_config` refuses Llama / Qwen3
``attention_bias`` and Llama ``mlp_bias``, which the native engine runs but megatron cannot place.

Vocabulary padding: megatron splits the embedding and output rows evenly over tensor-parallel ranks,
so the vocabulary is padded with zero rows to a multiple of ``lcm(vocab_multiple, tp)``
(``vocab_multiple`` defaults to 128). Because the multiple does not depend on ``tp`` for any ``tp``
dividing 128, checkpoints keep the same global shapes at every TP and can be resharded. The padded
rows never reach a probability: :mod:`megatron_bridge.logprobs` masks them out of the softmax.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from trainer.hf_io import (  # noqa: F401  (re-exported: the bridge's names for the shared reader)
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    UnsupportedConfig,
    read_config,
    rope_inv_freq,
)
from trainer.hf_io import ArchConfig as HFModelConfig


def read_hf_config(src: str | os.PathLike | dict, overrides=None) -> HFModelConfig:
    """:func:`trainer.hf_io.read_config` (a directory, a file path, or a loaded dict; ``overrides``:
    verl's ``model.override_config``), refusing as
    well the biases this bridge does not map: Llama / Qwen3 ``attention_bias`` puts a bias on o_proj,
    Llama ``mlp_bias`` on gate/up/down, and megatron's one switch for those (``add_bias_linear``) puts
    biases on all four together."""
    cfg = read_config(src, overrides)
    if cfg.o_bias:
        raise UnsupportedConfig(f"config.json: {cfg.model_type} with attention_bias=True (a bias on o_proj) is not "
                                f"supported by the megatron bridge (megatron's add_bias_linear ties it to MLP biases); "
                                f"the native engine runs it, the trainer cannot: use a checkpoint without it")
    if cfg.mlp_bias:
        raise UnsupportedConfig("config.json: mlp_bias=True is not supported by the megatron bridge (megatron's "
                                "add_bias_linear ties MLP biases to an o_proj bias); the native engine runs it, the "
                                "trainer cannot: use a checkpoint without it")
    return cfg


def padded_vocab_size(vocab_size: int, tp: int, vocab_multiple: int = 128) -> int:
    """Smallest multiple of ``lcm(vocab_multiple, tp)`` that holds ``vocab_size`` rows."""
    m = math.lcm(int(vocab_multiple), int(tp))
    return ((vocab_size + m - 1) // m) * m


def pipeline_layout(num_layers: int, pp: int, pp_layers: list[int] | None) -> list[int]:
    """Layers per pipeline stage: ``pp_layers`` if given (uneven allowed), else an even split."""
    if pp_layers is None:
        if num_layers % pp:
            raise ValueError(f"{num_layers} layers do not split evenly over pp={pp}; pass pp_layers")
        return [num_layers // pp] * pp
    if len(pp_layers) != pp or sum(pp_layers) != num_layers or min(pp_layers) < 1:
        raise ValueError(f"pp_layers={pp_layers} must have {pp} positive entries summing to {num_layers}")
    return list(pp_layers)


def virtual_layout(num_layers: int, pp: int, vpp: int, pp_layers: list[int] | None) -> list[int]:
    """Layers per virtual pipeline stage, in model order (``pp * vpp`` entries; stage ``s`` lives on
    pipeline rank ``s % pp`` as its chunk ``s // pp``, megatron's interleaving). ``vpp == 1``: the
    pipeline layout."""
    if vpp <= 1:
        return pipeline_layout(num_layers, pp, pp_layers)
    if pp_layers is not None:
        raise ValueError(f"pp_layers={pp_layers} (an uneven pipeline split) cannot be combined with virtual pipeline "
                         f"stages (vpp={vpp}): drop one of them")
    if num_layers % (pp * vpp):
        raise ValueError(f"{num_layers} layers do not split evenly over pp={pp} x vpp={vpp} = {pp * vpp} virtual "
                         f"stages: choose a virtual_pipeline_model_parallel_size that divides {num_layers // pp if num_layers % pp == 0 else num_layers} layers per rank")
    return [num_layers // (pp * vpp)] * (pp * vpp)


def transformer_config_kwargs(
    cfg: HFModelConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
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
    virtual_layout(cfg.num_layers, pp, vpp, pp_layers)  # the error names the fault
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
        attention_dropout=cfg.attention_dropout,  # the SDPA core attention refuses > 0 (megatron_bridge/attention.py)
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=cp,
        # interleaving at pp=2: the previous and the next stage are the same rank, and batched exchanges
        # would pair a gradient send with an activation receive (Megatron-LM allows it only overlapped)
        **(dict(overlap_p2p_comm=True, batch_p2p_comm=False) if vpp > 1 and pp == 2 else {}),
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
        # micro-batches may differ in length, p2p exchanges shapes; under virtual stages every
        # micro-batch is one THD row of a fixed size instead (logprobs.schedule_args)
        variable_seq_lengths=vpp <= 1,
        moe_token_dispatcher_type="alltoall",  # unused (dense model); the default refuses variable lengths
    )
    if cfg.is_moe:
        if cfg.num_experts % ep:
            raise ValueError(f"{cfg.num_experts} experts do not split over expert_model_parallel_size={ep}")
        kw.update(
            num_moe_experts=cfg.num_experts, moe_router_topk=cfg.experts_per_token,
            moe_ffn_hidden_size=cfg.moe_intermediate_size,
            # HF: softmax over all experts, then top-k (renormalised when norm_topk_prob). megatron's
            # pre-softmax router is the former; without it, softmax over the top-k logits, which equals
            # the renormalised top-k of the full softmax
            moe_router_pre_softmax=not cfg.norm_topk_prob, moe_router_score_function="softmax",
            moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp if etp else tp)
        if cfg.shared_expert_intermediate_size:
            kw.update(moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, moe_shared_expert_gate=True)
    if pp > 1 and len(set(layout)) > 1:
        # Uneven split: megatron's explicit layout, one list per stage; the embedding sits on the first
        # stage and the loss (final norm + output layer) on the last.
        rows = [["decoder"] * n for n in layout]
        rows[0] = ["embedding"] + rows[0]
        rows[-1] = rows[-1] + ["loss"]
        kw["pipeline_model_parallel_layout"] = rows
    return kw
