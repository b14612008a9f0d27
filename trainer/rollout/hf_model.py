"""A plain-torch Llama / Qwen2 / Qwen3 decoder for inference, loaded from HF checkpoints.

This is the native engine's model. It needs no transformers model code and no megatron; it reads
``config.json`` and ``*.safetensors`` from a local directory through :mod:`trainer.hf_io` (the
readers the trainer's megatron bridge uses too) and computes the same function as the
HF classes (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``):

    x_0     = E[tokens]
    h       = x + Attn(RMSNorm(x))                 per layer, pre-norm residual
    x'      = h + W_down( silu(W_gate h~) * W_up h~ ),  h~ = RMSNorm(h)          (SwiGLU)
    logits  = W_head RMSNorm(x_L)                  (W_head = E when embeddings are tied)

    RMSNorm(x) = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back (as HF does).
    Attn: q = W_q x (+ b_q), k, v likewise with num_kv_heads <= num_heads (GQA: query head j reads
          kv head j // (num_heads / num_kv_heads)); Qwen3 applies an RMSNorm over head_dim to q and
          k (before RoPE); Qwen2 has q/k/v biases; RoPE rotates q, k by position (Su et al. 2021,
          "RoFormer"); softmax(q k^T / sqrt(head_dim)) causal.

RoPE inverse frequencies: :func:`trainer.hf_io.rope_inv_freq` (``default``, ``linear`` (Chen et al.
2023, position interpolation), ``llama3``; other types are refused when the config is read).

Storage deviates from HF's layout for speed, not in value: q/k/v are one fused ``[(H+2K)*D, hidden]``
matrix and gate/up one ``[2*I, hidden]`` matrix, so a layer does 4 matmuls instead of 7. The HF names
map to row-slices (views) of the fused tensors, so loading, ``update_weights`` and checksums all
speak HF naming (:meth:`CausalLM.hf_tensors`).

KV cache: per layer, one preallocated key and one value tensor ``[max_batch, kv_heads, max_len,
head_dim]``. Each row (slot) holds one sequence; its positions start at 0. A decode step writes each row's new key/value at
that row's own position and masks keys beyond it, so rows of different lengths share a batch and
padding never reaches a real token.

Compiled decode (:func:`decode_step`, opt-in through the engine's ``compile_decode``): the same
decode step written with static shapes -- a fixed batch bucket and the cache's full length, masked
-- so that ``torch.compile`` (inductor) fuses the ~30 small kernels of each layer into a few C++
loops around the matmuls; the analogue of a CUDA-graph decode on CPU. Its attention is written out
(:func:`decode_attention`, HF's eager precision order) rather than torch's flash kernel.

CPU speed choices (none changes the function): bf16/fp16 matmul weights can be kept prepacked for
oneDNN (bit-identical to ``F.linear``, checked at pack time); decode attention never repeats K/V for
GQA: in fp32 the G query heads sharing a kv head are folded into G query rows of that head, in
bf16/fp16 SDPA's native ``enable_gqa`` one-query path is used (each is the faster layout of torch's
CPU kernel for its dtype).
"""

from __future__ import annotations

import bisect

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from trainer.hf_io import SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES, rope_inv_freq  # noqa: F401  (re-exported)
from trainer.hf_io import ArchConfig as ModelConfig  # the engine's name for the shared config reader
from trainer.hf_io import iter_safetensors as iter_checkpoint_tensors  # the engine's name for the shared reader


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics, cast back before the weight multiply: the order HF's LlamaRMSNorm uses.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE in HF's "rotate_half" layout: pairs (i, i + D/2) rotate together.

    x ``[..., D]``; cos and ``sin_signed = [-sin_lo, sin_hi]`` broadcast to it. HF computes
    ``x * cos + cat(-x_hi, x_lo) * sin``; ``roll(x, D/2) * sin_signed`` is the same product with the
    sign moved onto the table (exact in IEEE arithmetic), one kernel fewer per call.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class KVCache:
    """Preallocated keys and values: per layer, one key and one value tensor ``[max_batch, kv_heads,
    max_len, head_dim]`` (``k[layer]``, ``v[layer]``); with ``keys_transposed`` the keys are stored
    ``[max_batch, kv_heads, head_dim, max_len]`` (the compiled step's ``gemm_template`` layout) and
    :meth:`keys` gives the usual view for writers that do not care.

    Separate tensors rather than one block: the compiled decode step (:func:`decode_step`) mutates
    them in place as distinct graph inputs; views of one block would alias each other, and the
    compiler then copies the whole block at every step (measured: 38 ms instead of 4 ms per step).
    Zero-initialised: masked-out slots still flow through softmax(..) @ V with weight 0, and
    uninitialised memory could hold NaN (0 * NaN = NaN).
    """

    def __init__(self, cfg: ModelConfig, max_batch: int, max_len: int, dtype: torch.dtype, device="cpu",
                 keys_transposed: bool = False):
        self.max_batch, self.max_len, self.keys_transposed = max_batch, max_len, keys_transposed
        shape = (max_batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        kshape = (max_batch, cfg.num_kv_heads, cfg.head_dim, max_len) if keys_transposed else shape
        self.k = [torch.zeros(kshape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    def keys(self, li: int) -> torch.Tensor:
        """Layer ``li``'s keys as ``[max_batch, K, max_len, D]`` (a view when stored transposed)."""
        return self.k[li].transpose(-1, -2) if self.keys_transposed else self.k[li]

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions into slot ``dst`` (all layers)."""
        for t in (*(self.keys(li) for li in range(len(self.k))), *self.v):
            t[dst, :, :length].copy_(t[src, :, :length])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class _Layer:
    __slots__ = ("ln1", "wqkv", "bqkv", "q_norm", "k_norm", "qk_norm", "wo", "bo", "ln2", "w_gu", "b_gu", "w_down", "b_down", "packed")


class MoEWeights:
    """One mixture-of-experts MLP (qwen3_moe / qwen2_moe): the router ``[E, h]``, the experts' fused
    gate|up ``[E, 2I, h]`` and down ``[E, h, I]`` projections, and qwen2_moe's shared expert
    (gate|up ``[2Is, h]``, down ``[h, Is]``) with its sigmoid gate ``[1, h]``. Math: :func:`moe_residual`."""

    __slots__ = ("router", "w_gu", "w_down", "shared_gu", "shared_down", "shared_gate", "record", "routes", "forced")

    def __init__(self, cfg: ModelConfig, **kw):
        # routing replay (trainer.rollout.native, R3): ``record`` keeps the last call's top-k expert ids in
        # ``routes`` ``[..., k]``; ``forced`` ``[..., k]`` (-1 rows: the router's own choice) replaces them
        self.record, self.routes, self.forced = False, None, None
        E, h, inter, sh = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        self.router = torch.zeros(E, h, **kw)
        self.w_gu = torch.zeros(E, 2 * inter, h, **kw)
        self.w_down = torch.zeros(E, h, inter, **kw)
        self.shared_gu = torch.zeros(2 * sh, h, **kw) if sh else None
        self.shared_down = torch.zeros(h, sh, **kw) if sh else None
        self.shared_gate = torch.zeros(1, h, **kw) if sh else None

    def hf(self, prefix: str, inter: int, shared: int) -> dict[str, torch.Tensor]:
        """HF names -> views into this storage (per-expert names, as the released checkpoints store them)."""
        out = {prefix + "gate.weight": self.router}
        for e in range(self.w_gu.shape[0]):
            q = f"{prefix}experts.{e}."
            out[q + "gate_proj.weight"] = self.w_gu[e, :inter]
            out[q + "up_proj.weight"] = self.w_gu[e, inter:]
            out[q + "down_proj.weight"] = self.w_down[e]
        if self.shared_gu is not None:
            out[prefix + "shared_expert.gate_proj.weight"] = self.shared_gu[:shared]
            out[prefix + "shared_expert.up_proj.weight"] = self.shared_gu[shared:]
            out[prefix + "shared_expert.down_proj.weight"] = self.shared_down
            out[prefix + "shared_expert_gate.weight"] = self.shared_gate
        return out


def moe_residual(cfg: ModelConfig, h: torch.Tensor, ln2: torch.Tensor, moe: MoEWeights) -> torch.Tensor:
    """``h + sum_{e in top-k} w_e SwiGLU_e(x) [+ sigmoid(g . x) SwiGLU_shared(x)]``, ``x = RMSNorm(h)``:
    routing probabilities ``softmax(W_router x)`` in fp32, the top ``k`` kept (renormalised to sum 1
    when ``norm_topk_prob``) and cast to the activations' dtype; each expert runs on its own tokens
    and adds its weighted output, in expert order (transformers' Qwen MoE blocks, term for term)."""
    x = rms_norm(h, ln2, cfg.rms_norm_eps)
    lead, hd = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, hd)  # [N, h]
    probs = torch.softmax(F.linear(x2, moe.router), dim=-1, dtype=torch.float)  # [N, E]
    top_w, top_i = torch.topk(probs, cfg.experts_per_token, dim=-1)  # [N, k]
    if moe.forced is not None:  # replayed routing: the given experts, weighted by this router's probabilities
        f = moe.forced.reshape(-1, top_i.shape[1]).to(top_i.device, torch.long)
        top_i = torch.where((f >= 0).all(-1, keepdim=True), f, top_i)
        top_w = probs.gather(1, top_i)
    if moe.record:
        moe.routes = top_i.view(*lead, top_i.shape[1])
    if cfg.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    top_w = top_w.to(x2.dtype)
    inter = cfg.moe_intermediate_size
    out = torch.zeros_like(x2)
    for e in torch.unique(top_i).tolist():
        slot, tok = torch.where((top_i == e).t())  # [n_e] each: top-k slot and token of expert e
        gu = F.linear(x2[tok], moe.w_gu[e])  # [n_e, 2I]
        y = F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], moe.w_down[e]) * top_w[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    if moe.shared_gu is not None:
        sh = cfg.shared_expert_intermediate_size
        gu = F.linear(x2, moe.shared_gu)
        out = out + torch.sigmoid(F.linear(x2, moe.shared_gate)) * F.linear(F.silu(gu[:, :sh]) * gu[:, sh:], moe.shared_down)
    return h + out.view(*lead, hd)


def _onednn_pack(w: torch.Tensor, batch_hint: int = 64) -> torch.Tensor | None:
    """oneDNN-prepacked copy of a bf16/fp16 CPU weight, or None where that is unavailable or inexact.

    ``torch.ops.mkldnn._linear_pointwise`` on a prepacked weight is the kernel torch.compile's CPU
    freezing pass uses; with AMX it runs bf16 decode matmuls 2-3x faster than ``F.linear``. The
    result is checked bit-for-bit against ``F.linear`` once, so packing never changes outputs.
    """
    if w.device.type != "cpu" or w.dtype not in (torch.bfloat16, torch.float16) or not torch.backends.mkldnn.is_available():
        return None
    try:
        pw = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
        if not torch.equal(torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], ""), F.linear(x, w)):
            return None
        return pw
    except (RuntimeError, AttributeError):
        return None


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor | None = None) -> torch.Tensor:
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    return F.linear(x, w, b)


def linear_wx(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, packed: None = None) -> torch.Tensor:
    """``F.linear`` of ``x [M, in]`` as the batch-1 product ``(W x^T)^T``: for the compiled decode's
    ``decode_gemm="cpp"``. Inductor's C++ GEMM template (AMX / AVX-512 micro-kernels) takes a
    non-constant weight only as a contiguous first operand of a bmm; the transposed activation is
    ``M x in``, a few KB, so this costs no weight copy."""
    y = torch.bmm(w[None], x.t().contiguous()[None])[0].t()  # [M, out]
    return y if b is None else y + b


def qkv_heads(cfg: ModelConfig, x: torch.Tensor, ln1: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor | None,
              qk_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, packed: torch.Tensor | None = None,
              lin=linear):
    """x ``[..., h]`` -> q ``[..., H, D]``, k / v ``[..., K, D]``, with the q/k norm (Qwen3; ``qk_norm``
    is the joint ``[H+K, D]`` weight) and RoPE applied: q and k are normed and rotated together as H+K
    heads. Shared by the eager passes and :func:`decode_step`."""
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = lin(rms_norm(x, ln1, cfg.rms_norm_eps), wqkv, bqkv, packed)  # [..., (H+2K)D]
    lead = qkv.shape[:-1]
    qk = qkv[..., : (H + K) * D].view(*lead, H + K, D)
    v = qkv[..., (H + K) * D :].view(*lead, K, D)
    if qk_norm is not None:
        qk = rms_norm(qk, qk_norm, cfg.rms_norm_eps)
    qk = apply_rope(qk, cos, sin)  # [..., H+K, D]
    return qk[..., :H, :], qk[..., H:, :], v


def mlp_residual(cfg: ModelConfig, h: torch.Tensor, ln2: torch.Tensor, w_gu: torch.Tensor, b_gu: torch.Tensor | None,
                 w_down: torch.Tensor, b_down: torch.Tensor | None, packed_gu: torch.Tensor | None = None,
                 packed_down: torch.Tensor | None = None, lin=linear) -> torch.Tensor:
    """``h + W_down(silu(W_gate h~) * W_up h~)``, ``h~ = RMSNorm(h)`` (gate/up fused in ``w_gu``);
    a mixture-of-experts layer (``w_gu`` a :class:`MoEWeights`) goes to :func:`moe_residual`."""
    if isinstance(w_gu, MoEWeights):
        return moe_residual(cfg, h, ln2, w_gu)
    inter = cfg.intermediate_size
    gu = lin(rms_norm(h, ln2, cfg.rms_norm_eps), w_gu, b_gu, packed_gu)  # [..., 2I]
    return h + lin(F.silu(gu[..., :inter]) * gu[..., inter:], w_down, b_down, packed_down)


class CausalLM:
    """Weights and forward passes (full, prefill-into-cache, decode) of one decoder."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu", max_len: int | None = None):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        H, K, D, h, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
        kw = dict(dtype=dtype, device=self.device)
        self.embed = torch.zeros(cfg.vocab_size, h, **kw)
        self.lm_head = self.embed if cfg.tie_word_embeddings else torch.zeros(cfg.vocab_size, h, **kw)
        self.norm = torch.ones(h, **kw)
        self.layers: list[_Layer] = []
        hf: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if not cfg.tie_word_embeddings:
            hf["lm_head.weight"] = self.lm_head
        qkv_rows = ((0, H * D), (H * D, (H + K) * D), ((H + K) * D, (H + 2 * K) * D))
        for i in range(cfg.num_layers):
            L = _Layer()
            p = f"model.layers.{i}."
            L.ln1, L.ln2 = torch.ones(h, **kw), torch.ones(h, **kw)
            L.wqkv = torch.zeros((H + 2 * K) * D, h, **kw)  # rows: q | k | v
            L.bqkv = torch.zeros((H + 2 * K) * D, **kw) if cfg.qkv_bias else None
            L.wo = torch.zeros(h, H * D, **kw)
            L.bo = torch.zeros(h, **kw) if cfg.o_bias else None
            L.q_norm = torch.ones(D, **kw) if cfg.qk_norm else None
            L.k_norm = torch.ones(D, **kw) if cfg.qk_norm else None
            if cfg.is_moe:  # the MLP slots hold the experts (w_gu) and nothing else
                L.w_gu, L.b_gu, L.w_down, L.b_down = MoEWeights(cfg, **kw), None, None, None
            else:
                L.w_gu = torch.zeros(2 * inter, h, **kw)  # rows: gate | up
                L.b_gu = torch.zeros(2 * inter, **kw) if cfg.mlp_bias else None
                L.w_down = torch.zeros(h, inter, **kw)
                L.b_down = torch.zeros(h, **kw) if cfg.mlp_bias else None
            hf[p + "input_layernorm.weight"] = L.ln1
            hf[p + "post_attention_layernorm.weight"] = L.ln2
            for proj, (a, b) in zip("qkv", qkv_rows):
                hf[p + f"self_attn.{proj}_proj.weight"] = L.wqkv[a:b]
                if L.bqkv is not None:
                    hf[p + f"self_attn.{proj}_proj.bias"] = L.bqkv[a:b]
            hf[p + "self_attn.o_proj.weight"] = L.wo
            if L.bo is not None:
                hf[p + "self_attn.o_proj.bias"] = L.bo
            if cfg.qk_norm:
                hf[p + "self_attn.q_norm.weight"] = L.q_norm
                hf[p + "self_attn.k_norm.weight"] = L.k_norm
            if cfg.is_moe:
                hf.update(L.w_gu.hf(p + "mlp.", cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size))
                self.layers.append(L)
                continue
            hf[p + "mlp.gate_proj.weight"] = L.w_gu[:inter]
            hf[p + "mlp.up_proj.weight"] = L.w_gu[inter:]
            hf[p + "mlp.down_proj.weight"] = L.w_down
            if cfg.mlp_bias:
                hf[p + "mlp.gate_proj.bias"] = L.b_gu[:inter]
                hf[p + "mlp.up_proj.bias"] = L.b_gu[inter:]
                hf[p + "mlp.down_proj.bias"] = L.b_down
            self.layers.append(L)
        self._hf = hf
        self._derived_stale = False  # weights written in place since the last re-derive (weights_changed)
        self.packed_head = None
        self.prepack = False
        self._set_rope(max_len or cfg.max_position_embeddings)
        for L in self.layers:
            L.packed = (None, None, None, None)
        self._repack()

    # ---- the weights in one flat storage (a shared-memory weight sync: trainer/sync/shared_memory.py)
    _ALIGN = 64  # bytes: every weight starts on a cache line

    def _weight_bases(self) -> list[tuple[object, str, torch.Tensor]]:
        """(holder, attribute, tensor) of every weight this model allocated (not the derived ones:
        ``qk_norm``, the packed copies, the rope tables), in a fixed order; a tied head is listed once
        (under ``embed``) and re-pointed with it."""
        out = [(self, "embed", self.embed), (self, "norm", self.norm)]
        if not self.cfg.tie_word_embeddings:
            out.append((self, "lm_head", self.lm_head))
        for L in self.layers:
            for a in ("ln1", "wqkv", "bqkv", "q_norm", "k_norm", "wo", "bo", "ln2", "w_gu", "b_gu", "w_down", "b_down"):
                t = getattr(L, a)
                if isinstance(t, torch.Tensor):
                    out.append((L, a, t))
                elif isinstance(t, MoEWeights):
                    out += [(t, b, getattr(t, b)) for b in ("router", "w_gu", "w_down", "shared_gu", "shared_down",
                                                            "shared_gate") if getattr(t, b) is not None]
        return out

    def _storage_plan(self) -> tuple[int, list[int], dict[str, tuple[int, tuple, tuple]]]:
        """(elements of one flat storage holding every weight, each base's element offset in it, and
        HF name -> (element offset, shape, stride) of its view there)."""
        bases = self._weight_bases()
        step = max(1, self._ALIGN // self.embed.element_size())
        offsets, n = [], 0
        for _, _, t in bases:
            offsets.append(n)
            n += -(-t.numel() // step) * step
        spans = sorted(((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t, o)
                        for (_, _, t), o in zip(bases, offsets)), key=lambda x: x[0])
        starts = [a for a, _, _, _ in spans]
        views = {}
        for name, v in self._hf.items():
            i = bisect.bisect_right(starts, v.data_ptr()) - 1
            a, b, base, off = spans[i]
            if not (i >= 0 and a <= v.data_ptr() < b):
                raise RuntimeError(f"{name}: a weight view outside every weight tensor")
            views[name] = (off + (v.data_ptr() - a) // v.element_size(), tuple(v.shape), tuple(v.stride()))
        return n, offsets, views

    def storage_layout(self) -> tuple[int, dict[str, tuple[int, tuple, tuple]]]:
        """(elements, HF name -> (element offset, shape, stride)): where :meth:`move_weights` puts every
        weight in a flat storage of this model's dtype. Models of one config and dtype agree."""
        n, _, views = self._storage_plan()
        return n, views

    def move_weights(self, storage: torch.Tensor) -> None:
        """Move every weight into ``storage`` (flat, this model's dtype and device, at least
        :meth:`storage_layout`'s elements) with its current values, at the layout's places. Several
        models may share one storage (engines on one node mapping one shared file: one copy of the
        weights); what the weights derive (packed copies) stays each model's own."""
        n, offsets, views = self._storage_plan()
        if storage.dim() != 1 or storage.numel() < n or storage.dtype != self.dtype or storage.device != self.device:
            raise ValueError(f"move_weights needs a flat {self.dtype} storage of >= {n} elements on {self.device}; "
                             f"got {tuple(storage.shape)} {storage.dtype} on {storage.device}")
        with torch.no_grad():
            for (holder, attr, t), off in zip(self._weight_bases(), offsets):
                new = storage[off:off + t.numel()].view(t.shape)
                if new.data_ptr() != t.data_ptr():
                    new.copy_(t)
                setattr(holder, attr, new)
            if self.cfg.tie_word_embeddings:
                self.lm_head = self.embed
            base = storage.storage_offset()
            self._hf = {name: storage.as_strided(shape, stride, base + off) for name, (off, shape, stride) in views.items()}
        self._repack()

    def weights_changed(self) -> None:
        """The weights were written in place (a shared-memory sync, by other processes): what is computed
        from them is re-derived before the next pass reads it (:meth:`_fresh`), not here: the writers may
        not all have finished when one engine is told, and every pass starts after the sync returned."""
        self._derived_stale = True

    def _fresh(self) -> None:
        if self._derived_stale:
            self._derived_stale = False
            self._repack()

    def set_prepack(self, enabled: bool = True) -> bool:
        """Keep oneDNN-prepacked copies of the matmul weights (bf16/fp16 on CPU only; doubles their
        memory). Re-packed after every weight load. Returns whether packing is in effect."""
        self.prepack = enabled
        self._repack()
        return self.packed_head is not None

    def _repack(self) -> None:
        # Everything derived from the weights: the joint q/k norm weight and the packed matmuls.
        H, K, D = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        for L in self.layers:
            if L.q_norm is not None:
                L.qk_norm = torch.cat((L.q_norm.expand(H, D), L.k_norm.expand(K, D)))  # [H+K, D]
        on = self.prepack
        for L in self.layers:
            L.packed = tuple(_onednn_pack(w) if on and isinstance(w, torch.Tensor) else None
                             for w in (L.wqkv, L.wo, L.w_gu, L.w_down))
        self.packed_head = _onednn_pack(self.lm_head) if on else None

    # ---- rope tables -------------------------------------------------------------------------
    def _set_rope(self, max_len: int) -> None:
        inv = rope_inv_freq(self.cfg)  # [D/2]; no supported type scales the attention (HF's factor is 1)
        pos = torch.arange(max_len, dtype=torch.int64).float()  # [L]
        freqs = pos[:, None] * inv[None, :]  # [L, D/2], fp32 like HF
        emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
        self.cos = emb.cos().to(device=self.device, dtype=self.dtype)  # [L, D]
        sin = emb.sin().to(device=self.device, dtype=self.dtype)  # [L, D]
        half = sin.shape[-1] // 2
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # [L, D] signed, see apply_rope
        self.rope_len = max_len

    def ensure_rope(self, max_len: int) -> None:
        if max_len > self.rope_len:
            self._set_rope(max_len)

    # ---- weights in HF naming ----------------------------------------------------------------
    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, view into this model's storage) for every weight. Tied models have no lm_head."""
        return iter(self._hf.items())

    def decode_weights(self) -> list[torch.Tensor | None]:
        """The flat weight list :func:`decode_step` reads: embed, final norm, lm_head, then per layer
        (ln1, wqkv, bqkv, qk_norm, wo, bo, ln2, w_gu, b_gu, w_down, b_down); absent ones are None.
        Live tensors (a weight update shows in the next call); build it per call, since
        ``qk_norm`` is re-derived at each load."""
        self._fresh()
        out: list[torch.Tensor | None] = [self.embed, self.norm, self.lm_head]
        for L in self.layers:
            out += [L.ln1, L.wqkv, L.bqkv, L.qk_norm if L.q_norm is not None else None, L.wo, L.bo, L.ln2,
                    L.w_gu, L.b_gu, L.w_down, L.b_down]
        return out

    def hf_names(self) -> list[str]:
        return list(self._hf)

    def load_hf_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy HF-named tensors into storage (casting to this model's dtype). Returns names written.

        ``lm_head.weight`` of a tied model is skipped (the embedding is the head, as in HF loading),
        as are rotary ``inv_freq`` buffers that old checkpoints carry. Unknown names or shapes raise.
        """
        written = []
        with torch.no_grad():
            for name, t in named_tensors:
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                    continue
                dst = self._hf.get(name)
                if dst is None:
                    raise KeyError(f"unknown weight {name!r} for a {self.cfg.model_type} model")
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"{name}: shape {tuple(t.shape)} != expected {tuple(dst.shape)}")
                dst.copy_(t)
                written.append(name)
        if written:
            self._repack()
        return written

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, device="cpu", max_len: int | None = None,
                        overrides: dict | None = None) -> "CausalLM":
        """``overrides``: verl's ``model.override_config`` (:func:`trainer.hf_io.apply_overrides`)."""
        cfg = ModelConfig.from_pretrained(path, overrides)
        model = cls(cfg, dtype=dtype, device=device, max_len=max_len)
        written = set(model.load_hf_tensors(iter_checkpoint_tensors(path)))
        missing = [n for n in model.hf_names() if n not in written]
        if missing:
            raise ValueError(f"checkpoint {path} lacks {len(missing)} weights, e.g. {missing[:5]}")
        return model

    # ---- forward passes ----------------------------------------------------------------------
    def _qkv(self, L: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return qkv_heads(self.cfg, x, L.ln1, L.wqkv, L.bqkv, L.qk_norm if L.q_norm is not None else None,
                         cos, sin, L.packed[0])

    def _mlp_residual(self, L: _Layer, h: torch.Tensor) -> torch.Tensor:
        return mlp_residual(self.cfg, h, L.ln2, L.w_gu, L.b_gu, L.w_down, L.b_down, L.packed[2], L.packed[3])

    def _prefill_layers(self, tokens: torch.Tensor, lengths: torch.Tensor | None, kv_sink=None) -> torch.Tensor:
        """Run every layer over right-padded prompts starting at position 0; returns hidden ``[n, T, h]``.

        ``kv_sink(layer_idx, k [n, K, T, D], v)`` receives each layer's keys/values (cache writes).
        Row r attends to keys ``< lengths[r]`` only (and causally), so its padding tail never leaks in.
        """
        c = self.cfg
        n, T = tokens.shape
        self.ensure_rope(T)
        x = F.embedding(tokens, self.embed)  # [n, T, h]
        cos = self.cos[:T, None, :]  # [T, 1, D] broadcast over heads
        sin = self.sin[:T, None, :]
        mask = None
        if lengths is not None and bool((lengths != T).any()):
            ar = torch.arange(T, device=tokens.device)
            causal = ar[None, :] <= ar[:, None]  # [T(q), T(k)]
            mask = (causal[None] & (ar[None, None, :] < lengths[:, None, None]))[:, None]  # [n, 1, T, T]
        for li, L in enumerate(self.layers):
            q, k, v = self._qkv(L, x, cos, sin)  # [n, T, H|K, D]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [n, H|K, T, D]
            if kv_sink is not None:
                kv_sink(li, k, v)
            if mask is None:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [n, H, T, D]
            else:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            a = a.transpose(1, 2).reshape(n, T, c.num_heads * c.head_dim)  # [n, T, HD]
            x = self._mlp_residual(L, x + linear(a, L.wo, L.bo, L.packed[1]))
        return rms_norm(x, self.norm, c.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head, None, self.packed_head).float()  # [..., V] fp32 for log-softmax

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
                routing: torch.Tensor | None = None) -> torch.Tensor:
        """Full forward without a cache: logits ``[n, T, V]`` (fp32) of right-padded ``tokens [n, T]``.
        ``routing`` ``[n, T, R, k]`` (MoE): each token's experts per layer, replayed instead of the
        router's top-k (a row of -1: the router's own choice); the gate weights stay the router's."""
        self._fresh()
        moes = self.moe_layers()
        if routing is not None:
            if routing.shape[2] != len(moes):
                raise ValueError(f"routing has {routing.shape[2]} layers, the model {len(moes)} MoE layers")
            for r, m in enumerate(moes):
                m.forced = routing[:, :, r]
        try:
            return self.logits(self._prefill_layers(tokens, lengths))
        finally:
            for m in moes:
                m.forced = None

    def moe_layers(self) -> list[MoEWeights]:
        """The MoE blocks, in layer order (routing tensors index them by this order)."""
        return [L.w_gu for L in self.layers if isinstance(L.w_gu, MoEWeights)]

    def record_routing(self, on: bool) -> list[MoEWeights]:
        """Switch recording of every MoE block's top-k on or off; returns the blocks."""
        moes = self.moe_layers()
        for m in moes:
            m.record, m.routes = on, None
        return moes

    def prefill(self, cache: KVCache, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Prefill prompts into the cache; returns last-token logits ``[n, V]`` (fp32).

        tokens ``[n, T]`` right-padded, lengths ``[n]``; cache slot ``slots[j]`` receives the keys/values
        of prompt row ``rows[j]`` (a prompt sampled n times is computed once and copied to n slots).
        """
        self._fresh()
        T = tokens.shape[1]
        same = rows.numel() == tokens.shape[0] and bool((rows == torch.arange(rows.numel(), device=rows.device)).all())

        def sink(li, k, v):  # k, v [n, K, T, D]
            kc, vc = cache.keys(li), cache.v[li]  # [B, K, Lmax, D]
            kc[:, :, :T].index_copy_(0, slots, (k if same else k.index_select(0, rows)).to(kc.dtype))
            vc[:, :, :T].index_copy_(0, slots, (v if same else v.index_select(0, rows)).to(vc.dtype))

        hidden = self._prefill_layers(tokens, lengths, kv_sink=sink)  # [n, T, h]
        last = hidden[torch.arange(tokens.shape[0], device=tokens.device), lengths - 1]  # [n, h]
        return self.logits(last)

    def decode(
        self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
        max_position: int | None = None, min_position: int | None = None,
    ) -> torch.Tensor:
        """One decode step for cache slots ``0..B-1``: token ``tokens[b]`` sits at ``positions[b]``.

        Writes each row's key/value at its own position, attends to keys ``<= positions[b]``, and
        returns next-token logits ``[B, V]`` (fp32). ``max_position`` / ``min_position`` (of
        ``positions``, known to the caller) save host syncs.
        """
        self._fresh()
        c = self.cfg
        B = tokens.shape[0]
        H, K, G, D = c.num_heads, c.num_kv_heads, c.num_groups, c.head_dim
        Lk = (int(positions.max()) if max_position is None else max_position) + 1  # keys needed this step
        self.ensure_rope(Lk)
        dev = tokens.device
        x = F.embedding(tokens, self.embed)  # [B, h]
        cos = self.cos[positions][:, None, :]  # [B, 1, D]
        sin = self.sin[positions][:, None, :]
        # Keys read: the first Lk positions of each slot, or in bf16 / fp16 the whole cache once Lk is at
        # least half of it. A slice of the cache is not a contiguous batch of matrices, and the CPU
        # low-precision bmm then copies it (both operands, every layer, every step: 8% of a bf16 generate
        # at the bench_e2e shape); the slots past each row's position are masked (and zero).
        Lc = cache.max_len if cache.v[0].dtype != torch.float32 and 2 * Lk >= cache.max_len else Lk
        # Rows at the same position need no mask (when only their keys are read).
        uniform = max_position is not None and min_position == max_position and Lc == Lk
        allowed = None if uniform else (torch.arange(Lc, device=dev)[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, Lc]
        # Flat row index of (slot b, kv head j, position p) in a [max_batch*K*max_len, D] view of one
        # layer's K (or V) tensor: every layer shares it, so it is built once per step.
        flat = ((torch.arange(B, device=dev)[:, None] * K + torch.arange(K, device=dev)[None, :]) * cache.max_len + positions[:, None]).reshape(-1)  # [B*K]
        for li, L in enumerate(self.layers):
            q, k, v = self._qkv(L, x, cos, sin)  # [B, H, D], [B, K, D], [B, K, D]
            kc, vc = cache.k[li], cache.v[li]  # [maxB, K, maxL, D]
            if cache.keys_transposed:
                raise ValueError("this KV cache stores keys transposed (decode_gemm='cpp'): only the compiled "
                                 "decode_step reads it; make the cache with keys_transposed=False")
            kc.view(-1, D).index_copy_(0, flat, k.reshape(B * K, D).to(kc.dtype))
            vc.view(-1, D).index_copy_(0, flat, v.reshape(B * K, D).to(kc.dtype))
            # Two matmuls and a softmax (decode_attention): torch's CPU flash kernel spends most of a
            # decode step on per-block setup at one query row per head (bench_e2e engine, 32 rows,
            # one core, AMD EPYC with AVX512-BF16: its one-query GQA path 340-620 us per layer call
            # in bf16 against 100 us; fp32 46-103 us against 47-104 us for flash over [B, K, G, D]).
            a = decode_attention(q.reshape(B, K, G, D).to(kc.dtype), kc[:B, :, :Lc], vc[:B, :, :Lc],
                                 allowed)  # [B, K, G, D]
            a = a.to(x.dtype)
            x = self._mlp_residual(L, x + linear(a.reshape(B, H * D), L.wo, L.bo, L.packed[1]))
        return self.logits(rms_norm(x, self.norm, c.rms_norm_eps))


DECODE_WEIGHTS_PER_LAYER = 11


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                     keys_transposed: bool = False) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D), masked) v`` for a decode step (eager and compiled), written out as two
    batched matmuls and a softmax: q ``[B, K, G, D]`` (the G query heads of kv head j as G query rows,
    so K/V are never repeated for GQA), k / v ``[B, K, L, D]``, ``allowed`` ``[B, 1, 1, L]`` (None: every
    key is visible).

    The precision order of HF's eager attention: scores and the value product in the cache's dtype,
    the softmax in fp32. Inductor fuses the scale, mask and softmax into one loop between the two
    matmuls; on this shape (a handful of query rows against the whole masked cache) that beats
    torch's CPU flash kernel, whose per-block setup dominates at 1-3 query rows (bench_e2e decode
    step, bf16, one core, interleaved in one process over four runs: 3.2-5.4 ms on a bf16 cache
    against 3.7-6.3 ms for flash on an fp32 cache, 12-20% less per run). ``keys_transposed``: k is
    ``[B, K, D, L]`` (a ``KVCache(keys_transposed=True)``), the contiguous operand the C++ bmm template
    needs; otherwise inductor would copy the whole key cache to that layout at every step.
    """
    kt = k if keys_transposed else k.transpose(-1, -2)  # [B, K, D, L]
    if keys_transposed:  # the template's first operand must be contiguous; inductor may lay q out otherwise
        q = q.contiguous(memory_format=torch.contiguous_format)
    s = torch.matmul(q, kt) * (q.shape[-1] ** -0.5)  # [B, K, G, L]
    s = s.float()
    p = torch.softmax(s if allowed is None else s.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.matmul(p.to(v.dtype), v)


def decode_step(cfg: ModelConfig, weights: list[torch.Tensor | None], k_cache: list[torch.Tensor],
                v_cache: list[torch.Tensor], tokens: torch.Tensor, positions: torch.Tensor,
                cos_table: torch.Tensor, sin_table: torch.Tensor, gemm_template: bool = False) -> torch.Tensor:
    """:meth:`CausalLM.decode` with static shapes, for ``torch.compile``: logits ``[B, V]`` (fp32).

    Row ``b`` (cache slot ``b``) holds token ``tokens[b]`` at ``positions[b]``; its key/value are written
    there and it attends to cache positions ``<= positions[b]`` over the cache's FULL length (masked),
    so one graph serves every step of a batch bucket. Rows past the real batch are padding: they
    write position 0 of free slots, which any later request's prefill overwrites. ``weights`` is
    :meth:`CausalLM.decode_weights`; ``cos_table`` / ``sin_table`` the model's RoPE tables.

    ``gemm_template``: the layout for inductor's C++ GEMM template (compile with ``max_autotune`` and
    the ``CPP,ATEN`` backends; the engine's ``decode_gemm="cpp"``): every matmul a bmm whose first operand
    is contiguous, i.e. linears as :func:`linear_wx` and keys stored transposed, ``k_cache`` ``[maxB,
    K, D, Lmax]``. Same function, different kernels.
    """
    H, K, G, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.num_groups, cfg.head_dim, cfg.rms_norm_eps
    B, Lmax = tokens.shape[0], v_cache[0].shape[2]
    lin = linear_wx if gemm_template else linear
    embed, norm, head = weights[0], weights[1], weights[2]
    x = F.embedding(tokens, embed)  # [B, h]
    cos, sin = cos_table[positions][:, None, :], sin_table[positions][:, None, :]  # [B, 1, D]
    allowed = (torch.arange(Lmax, device=tokens.device)[None, :] <= positions[:, None])[:, None, None, :]  # [B,1,1,L]
    rows = torch.arange(B, device=tokens.device)[:, None]  # [B, 1]
    heads = torch.arange(K, device=tokens.device)[None, :]  # [1, K]
    at = positions[:, None]  # [B, 1]
    for li in range(cfg.num_layers):
        ln1, wqkv, bqkv, qk_norm, wo, bo, ln2, w_gu, b_gu, w_down, b_down = \
            weights[3 + DECODE_WEIGHTS_PER_LAYER * li: 3 + DECODE_WEIGHTS_PER_LAYER * (li + 1)]
        q, k, v = qkv_heads(cfg, x, ln1, wqkv, bqkv, qk_norm, cos, sin, lin=lin)  # [B, H, D], [B, K, D], [B, K, D]
        kc, vc = k_cache[li], v_cache[li]  # [maxB, K, Lmax, D] ([maxB, K, D, Lmax] keys if gemm_template)
        if gemm_template:
            kc[rows, heads, :, at] = k.to(kc.dtype)  # [B, K, D] at (b, j, :, positions[b])
        else:
            kc[rows, heads, at] = k.to(kc.dtype)  # [B, K, D] at (b, j, positions[b])
        vc[rows, heads, at] = v.to(vc.dtype)
        a = decode_attention(q.reshape(B, K, G, D).to(kc.dtype), kc[:B], vc[:B], allowed,
                             keys_transposed=gemm_template).to(x.dtype)  # [B, K, G, D]
        x = mlp_residual(cfg, x + lin(a.reshape(B, H * D), wo, bo), ln2, w_gu, b_gu, w_down, b_down, lin=lin)
    return lin(rms_norm(x, norm, eps), head, None).float()
