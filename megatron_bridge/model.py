"""Build a megatron-core ``GPTModel`` for a HF Llama / Qwen2 / Qwen3 config on this rank's TP/PP slice.

Layer spec: megatron's TransformerEngine spec when CUDA and transformer-engine are present, the
local (pure torch) spec otherwise — the local spec is what runs on CPU in CI. In the local spec the
core attention is :class:`megatron_bridge.attention.TorchSDPAttention` (torch SDPA, real THD packing)
unless ``attention="megatron"`` asks for megatron's ``DotProductAttention`` (dense masks only).

Two changes to the stock ``GPTModel``, both small and local to this file:

* **RoPE follows the position ids.** Stock megatron builds the rotary table from the sequence
  length alone, so every row of a batch is rotated as if it started at position 0 of the padded
  tensor: a left-padded prompt, or the second sequence of a packed row, gets the wrong angles. Here
  the rotary module computes ``angle[b, t] = position_ids[b, t] * inv_freq`` per token (the HF
  formula, with the HF inverse frequencies from :func:`trainer.hf_io.rope_inv_freq`), so positions
  restart at every sequence. With a real THD ``PackedSeqParams`` (TE on GPU) megatron restarts the
  positions itself from ``cu_seqlens`` and the plain table is returned.
* **Packed RoPE without a per-sequence loop.** megatron's reference THD rotary
  (``rope_utils._apply_rotary_pos_emb_thd``) splits the packed row and loops over its sequences in
  Python, per layer, for queries and keys; with dozens of short sequences that loop cost more than
  the matmuls it sits between. Without context parallelism the same angles are ``freqs[pos]`` with
  ``pos`` each token's position in its own sequence, applied to the whole row at once
  (:func:`_thd_rope`); with CP megatron's own function runs. The angle tables are built once per
  forward (not per layer, for queries and keys apart), and the rotation is one autograd function
  (:class:`_RotateHalf`) with megatron's roundings: bit-identical output and gradient, four kernels
  each way instead of nine and eleven.
* **Critic value head.** ``value_head=True`` replaces the vocabulary output layer by a
  TP-replicated ``Linear(hidden, 1)`` (HF name ``score``, as in ``AutoModelForTokenClassification``
  with one label), so the critic reuses the whole forward/backward/checkpoint machinery.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_bridge.hf_config import (
    HFModelConfig,
    padded_vocab_size,
    pipeline_layout,
    transformer_config_kwargs,
    virtual_layout,
)
from trainer.hf_io import rope_inv_freq
from megatron_bridge import cpu_shims

try:  # megatron-core is an install requirement; this module is the bridge's only entry to it
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
except ImportError as e:  # pragma: no cover - surfaced with a clear message
    raise ImportError("megatron_bridge needs megatron-core (pip install megatron-core==0.16.1)") from e


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


class PositionRotary(nn.Module):
    """Rotary angles from explicit position ids: returns ``[S, B, 1, head_dim]`` (or ``[S, 1, 1, D]``).

    ``positions`` is set by :meth:`BridgeGPTModel.forward` for the duration of one call.
    """

    def __init__(self, inv_freq: torch.Tensor):
        super().__init__()
        self.inv_freq = inv_freq.float()  # plain attribute: stays fp32, never in a state dict
        self.positions: torch.Tensor | None = None
        self.device = torch.device("cpu")  # the model's device, set per call by BridgeGPTModel

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if self.positions is None:  # packed rows without explicit positions: restarts come from cu_seqlens
            pos = (torch.arange(max_seq_len, device=self.device) + offset)[:, None]  # [S, 1]
        else:
            pos = self.positions.t().to(self.device)  # [S, B]
        inv = self.inv_freq.to(pos.device)
        freqs = pos[..., None].float() * inv  # [S, B, D/2], same product as transformers
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, B, D] non-interleaved halves, as HF
        return emb[:, :, None, :]  # [S, B, 1, D]

    def get_rotary_seq_len(self, inference_context, transformer, transformer_input, transformer_config,
                           packed_seq_params=None, **_):
        if packed_seq_params is not None:
            return max(packed_seq_params.max_seqlen_q, packed_seq_params.max_seqlen_kv)
        if transformer is not None and transformer.input_tensor is not None:
            return transformer.input_tensor.size(0)
        return transformer_input.size(0)


def _thd_rope(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
              cp_group=None):
    """RoPE of a packed row ``t [T, heads, d]``: every token gets the angles of its position within its
    own sequence (megatron's ``_apply_rotary_pos_emb_thd`` at CP 1, without its Python loop)."""
    from megatron.core.models.common.embeddings import rope_utils

    T = t.shape[0]
    if cp_group is not None and cp_group.size() > 1 and freqs.size(0) != T:
        return _MEGATRON_THD_ROPE(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
    if not rotary_interleaved and not multi_latent_attention and freqs.shape[-1] == t.shape[-1]:
        cos, sin_signed = _rope_tables(freqs, cu_seqlens, T, t.dtype, mscale)
        return _RotateHalf.apply(t, cos, sin_signed)
    if freqs.size(0) != T:  # a table from position 0: each token's position within its sequence
        freqs = freqs[_thd_positions(cu_seqlens, T, t.device)]  # [T, 1, 1, D]
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs, rotary_interleaved=rotary_interleaved,
                                                 multi_latent_attention=multi_latent_attention,
                                                 mscale=mscale).squeeze(1)


def _thd_positions(cu_seqlens, T: int, device) -> torch.Tensor:
    """Each token's position within its own sequence of a packed row ``[T]``."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), cu[1:] - cu[:-1])  # [T]
    return torch.arange(T, device=device) - cu[:-1][seg]


_ROPE_TABLES: list = [None]  # (key, (cos, sin_signed)) of the last call; key: see _rope_tables


def _rope_tables(freqs, cu_seqlens, T: int, dtype, mscale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin_signed = [-sin_lo, sin_hi]`` ``[T, 1, D]`` in ``dtype``, rounded as megatron
    rounds them (``(cos(freqs) * mscale).to(dtype)``). Every layer's queries and keys of one forward
    get the same ``freqs`` and ``cu_seqlens`` objects, so the tables are built once per forward, not
    twice per layer: the last call's are kept (keyed by identity; the tensors are held, so an id is
    never reused while it is the key)."""
    key = (freqs, cu_seqlens, freqs._version, cu_seqlens._version, T, dtype, mscale)  # an in-place edit: rebuilt
    compiling = torch.compiler.is_compiling()  # a traced graph computes them itself (no global state)
    last = None if compiling else _ROPE_TABLES[0]
    if last is not None and all(a is b or (not torch.is_tensor(a) and a == b) for a, b in zip(last[0], key)):
        return last[1]
    f = freqs if freqs.size(0) == T else freqs[_thd_positions(cu_seqlens, T, freqs.device)]
    f = f.reshape(T, 1, f.shape[-1])
    cos = (torch.cos(f) * mscale).to(dtype)
    sin = (torch.sin(f) * mscale).to(dtype)
    half = f.shape[-1] // 2
    sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    if not compiling:
        _ROPE_TABLES[0] = (key, (cos, sin_signed))
    return cos, sin_signed


class _RotateHalf(torch.autograd.Function):
    """megatron's non-interleaved RoPE, ``t * cos + cat(-t_hi, t_lo) * sin``, as two products and a sum.

    ``cat(-t_hi, t_lo) * sin`` is ``roll(t, D/2) * [-sin_lo, sin_hi]``: the sign moves onto the table,
    exact in IEEE arithmetic, so the output is bit-identical to megatron's and so is the gradient,
    ``g * cos + roll(g * [-sin_lo, sin_hi], D/2)`` (what autograd computes through megatron's chunk,
    negation and two concatenations, in the same roundings). Four kernels forward and backward
    instead of megatron's nine and eleven, and only the tables are saved for the backward.
    """

    @staticmethod
    def forward(ctx, t, cos, sin_signed):
        ctx.save_for_backward(cos, sin_signed)
        return t * cos + torch.roll(t, t.shape[-1] // 2, dims=-1) * sin_signed

    @staticmethod
    def backward(ctx, g):
        cos, sin_signed = ctx.saved_tensors
        return g * cos + torch.roll(g * sin_signed, g.shape[-1] // 2, dims=-1), None, None


_MEGATRON_THD_ROPE = None


def _install_thd_rope() -> None:
    global _MEGATRON_THD_ROPE
    from megatron.core.models.common.embeddings import rope_utils

    if _MEGATRON_THD_ROPE is None:
        _MEGATRON_THD_ROPE = rope_utils._apply_rotary_pos_emb_thd
        rope_utils._apply_rotary_pos_emb_thd = _thd_rope


def _eager_inside_compiled_chunks() -> None:
    """The data-dependent pieces run eagerly inside a compiled chunk (``torch.compiler.disable``): the packed
    rows' RoPE positions and the attention's length buckets. Applied when a chunk is compiled, not at import:
    ``torch.compiler.disable`` loads dynamo (about 1.5 s of every megatron process's start-up,
    megatron_bridge/lazy_compile.py), and an eager chunk does not need it."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_bridge.attention import eager_thd_inside_compiled_chunks  # as build_model imports it: lazily

    if rope_utils._apply_rotary_pos_emb_thd is _thd_rope:
        rope_utils._apply_rotary_pos_emb_thd = torch.compiler.disable(_thd_rope)
    eager_thd_inside_compiled_chunks()


class ValueHead(nn.Module):
    """Scalar head for the critic, replicated on every TP rank (hidden is replicated there too).

    Initialised from its own seeded generator, N(0, 1/(H+1)^2) weights and zero bias, so the head is
    the same on every rank and at every TP/PP layout (the global RNG stream differs per stage).
    """

    def __init__(self, hidden: int, dtype: torch.dtype, seed: int = 0, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(1, hidden, generator=g, dtype=torch.float32) / (hidden + 1)
        self.weight = nn.Parameter(w.to(dtype))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype))
        for p in (self.weight, self.bias):
            p.tensor_model_parallel = False  # counted once in the grad norm (TP rank 0)

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            # sequence parallelism hands each TP rank S/tp positions; the head is replicated, so every rank
            # computes the same values from the whole sequence, and the backward takes this rank's slice
            # of the (identical) gradient instead of summing TP copies
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return nn.functional.linear(hidden, self.weight, self.bias), None  # [S, B, 1]


class SequenceParallelTorchNorm:
    """megatron's ``WrappedTorchNorm`` (torch's RMSNorm / LayerNorm) for the local spec, which megatron
    refuses under sequence parallelism only because a torch norm does not mark its weight: under SP each
    TP rank normalises its own S/tp positions, so the weight's gradient is a partial sum that
    ``finalize_model_grads`` must all-reduce over TP, and it does so for parameters flagged
    ``sequence_parallel``. ``mark=False`` (q/k norms, which run after the sequence is gathered)."""

    mark = True

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        norm_cls = {"RMSNorm": nn.RMSNorm, "LayerNorm": nn.LayerNorm}[config.normalization]
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        if cls.mark and config.sequence_parallel:
            for prm in norm.parameters():
                prm.sequence_parallel = True
        return norm


class GatheredTorchNorm(SequenceParallelTorchNorm):
    mark = False


def _sequence_parallel_spec(spec, config):
    """The local layer spec with SP-capable norms, as a block spec (whose final norm is one too)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    sub = spec.submodules
    sub.input_layernorm = SequenceParallelTorchNorm
    if sub.pre_mlp_layernorm is not IdentityOp:
        sub.pre_mlp_layernorm = SequenceParallelTorchNorm
    att = sub.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(att, name) is not IdentityOp:
            setattr(att, name, GatheredTorchNorm)
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelTorchNorm)


class BridgeGPTModel(GPTModel):
    """``GPTModel`` whose RoPE uses the given position ids (see module docstring)."""

    def forward(self, input_ids, position_ids, attention_mask, *args, **kwargs):
        rot = getattr(self, "rotary_pos_emb", None)
        if rot is not None:
            rot.positions = position_ids
            rot.device = next(self.parameters()).device
        try:
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        finally:
            if rot is not None:
                rot.positions = None


def build_transformer_config(hf: HFModelConfig, *, pp_layers=None, params_dtype=torch.float32,
                             recompute: dict | None = None, sequence_parallel: bool = False) -> TransformerConfig:
    """``recompute``: megatron-core's activation recompute fields of ``TransformerConfig``, e.g.
    ``{"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}``:
    the layers' activations are dropped in the forward and recomputed in the backward."""
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    cp = ps.get_context_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    kw = transformer_config_kwargs(hf, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, pp_layers=pp_layers,
                                   params_dtype=params_dtype,
                                   use_cpu_initialization=not torch.cuda.is_available(),
                                   sequence_parallel=bool(sequence_parallel) and tp > 1)  # megatron: SP needs TP > 1
    kw.update(recompute or {})
    return TransformerConfig(**kw)


def build_model(
    hf: HFModelConfig,
    *,
    pp_layers: list[int] | None = None,
    params_dtype: torch.dtype = torch.float32,
    value_head: bool = False,
    use_te: bool | None = None,
    vocab_multiple: int = 128,
    value_head_seed: int = 0,
    attention: str = "sdpa",
    recompute: dict | None = None,
    sequence_parallel: bool = False,
):
    """This rank's model for the current megatron parallel state (TP, PP, VPP from ``ps``): one
    ``BridgeGPTModel`` chunk, or with virtual pipeline stages (vpp > 1) the list of this rank's
    ``vpp`` chunks in schedule order (megatron's convention; :func:`chunks` reads both).

    The weights are megatron's random init (CPU init is TP-invariant: the full matrix is drawn,
    then split); load real weights with :func:`megatron_bridge.convert.load_hf_weights`.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )


    cpu_shims.install()  # idempotent, per thread; a no-op with CUDA
    if hf.is_moe:
        cpu_shims.fix_moe_without_te()
    _install_thd_rope()
    config = build_transformer_config(hf, pp_layers=pp_layers, params_dtype=params_dtype, recompute=recompute,
                                      sequence_parallel=sequence_parallel)
    if use_te is None:  # context parallelism runs on the bridge's own attention (megatron_bridge.context_parallel)
        use_te = te_available() and ps.get_context_parallel_world_size() == 1
    moe = dict(num_experts=hf.num_experts, moe_grouped_gemm=False) if hf.is_moe else {}
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=hf.qk_norm, **moe)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=hf.qk_norm, normalization="RMSNorm", **moe)
        if attention == "sdpa":
            from megatron_bridge.attention import TorchSDPAttention

            from megatron_bridge.attention import grouped_self_attention

            spec.submodules.self_attention.submodules.core_attention = TorchSDPAttention
            spec.submodules.self_attention.module = grouped_self_attention()
        elif attention != "megatron":
            raise ValueError(f"attention={attention!r}: expected 'sdpa' or 'megatron'")
        if config.sequence_parallel:
            spec = _sequence_parallel_spec(spec, config)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    kw = dict(hf=hf, config=config, spec=spec, pp_layers=pp_layers, params_dtype=params_dtype, value_head=value_head,
              use_te=use_te, vocab_multiple=vocab_multiple, value_head_seed=value_head_seed, attention=attention)
    if vpp == 1:
        return _build_chunk(vp_stage=None, **kw)
    return [_build_chunk(vp_stage=v, **kw) for v in range(vpp)]


def _build_chunk(*, hf, config, spec, pp_layers, params_dtype, value_head, use_te, vocab_multiple, value_head_seed,
                 attention, vp_stage: int | None) -> BridgeGPTModel:
    """One model chunk: the whole stage (``vp_stage`` None) or virtual stage ``vp_stage`` of this rank."""
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    vpp = 1 if vp_stage is None else ps.get_virtual_pipeline_model_parallel_world_size()
    vocab = padded_vocab_size(hf.vocab_size, tp, vocab_multiple)
    tie = hf.tie_word_embeddings and not value_head
    first = ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    model = BridgeGPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=hf.max_position_embeddings,
        pre_process=first,
        post_process=last,
        parallel_output=True,
        share_embeddings_and_output_weights=tie,
        position_embedding_type="rope",
        rotary_base=int(hf.rope_theta) if float(hf.rope_theta).is_integer() else hf.rope_theta,
        vp_stage=vp_stage,
    )
    model.rotary_pos_emb = PositionRotary(rope_inv_freq(hf))
    if value_head and model.post_process:
        dev = next(model.parameters()).device
        model.output_layer = ValueHead(hf.hidden_size, params_dtype, seed=value_head_seed,
                                       sequence_parallel=config.sequence_parallel).to(dev)
    if params_dtype != torch.float32:
        # megatron's local spec builds its norms as plain torch modules in fp32 (on GPU, megatron's
        # Float16Module casts the whole chunk); cast every float parameter, as that wrapper would, so
        # bf16 activations meet bf16 norm weights (torch's fused RMSNorm needs matching dtypes)
        for prm in model.parameters():
            if prm.is_floating_point() and prm.dtype != params_dtype:
                prm.data = prm.data.to(params_dtype)
    if torch.cuda.is_available():
        # megatron-core allocates its parallel linears on the current GPU, but the local spec's norms, the
        # rotary table and the value head are plain torch modules made on the CPU; megatron's own get_model
        # moves every chunk to the device for the same reason (found by benchmarks/gpu_check.py on an H200:
        # the optimizer refused CPU bf16 params and the fused RMSNorm met a CPU weight)
        model.cuda(torch.cuda.current_device())
    layout = pipeline_layout(hf.num_layers, pp, pp_layers)
    vlayout = virtual_layout(hf.num_layers, pp, vpp, pp_layers)
    stage = pp_rank if vp_stage is None else vp_stage * pp + pp_rank  # index into vlayout
    # Bookkeeping the converter, exporter and log-prob code read back.
    model.hf_config = hf
    model.stage_layers = layout
    model.virtual_layers = vlayout  # layers per virtual stage, in model order (= stage_layers when vpp == 1)
    model.vp_stage = vp_stage
    model.layer_offset = sum(vlayout[:stage])
    # mixture of experts: this rank's experts are the global ones [expert_offset, + num_local_experts)
    model.num_local_experts = hf.num_experts // ps.get_expert_model_parallel_world_size() if hf.is_moe else 0
    model.expert_offset = ps.get_expert_model_parallel_rank() * model.num_local_experts
    model.true_vocab_size = hf.vocab_size
    model.padded_vocab_size = vocab
    model.is_critic = value_head
    model.uses_te = use_te
    model.supports_thd = use_te or attention == "sdpa"  # packed rows run as real THD
    model.sequence_parallel = config.sequence_parallel  # inputs are padded to a multiple of TP (logprobs.run_model)
    n_local = len(model.decoder.layers)
    assert n_local == vlayout[stage], (n_local, vlayout, stage)
    if n_local:
        assert model.decoder.layers[0].layer_number - 1 == model.layer_offset
    return model


def chunks(model) -> list:
    """This rank's model chunks as a list: ``[model]``, or the list itself under virtual pipeline stages."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def unwrap(model) -> BridgeGPTModel:
    """The ``BridgeGPTModel`` inside a megatron DDP / Float16Module wrapper (or the model itself)."""
    while not isinstance(model, BridgeGPTModel) and hasattr(model, "module"):
        model = model.module
    return model


def compile_model(model):
    """``torch.compile`` (inductor) this rank's model chunk in place, under any DDP wrapper.

    ``Module.compile`` keeps the module object, its parameters and its state-dict names, so the DDP
    grad hooks, the optimizer, checkpoints and weight streaming are untouched. Shapes are left to
    dynamo's automatic dynamic mode: the first call compiles for its shape, the first call with
    another shape recompiles once with symbolic sizes, and later shapes reuse that graph. On CPU the
    gain is the fusion of the elementwise chains (RMSNorm, RoPE, SwiGLU, residual adds, casts) around
    the matmuls: measured 0.43 -> 0.31 s per forward+backward at the bench_e2e size in bf16.
    """
    _eager_inside_compiled_chunks()
    for c in chunks(model):
        unwrap(c).compile()
    return model
