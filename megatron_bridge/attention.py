"""Core attention for the local (non-TE) layer spec on torch's ``scaled_dot_product_attention``.

Replaces megatron's ``DotProductAttention`` (explicit ``baddbmm`` + masked softmax + ``bmm``, no
packed-sequence support) in the local spec, for two reasons:

* **Real THD packing on CPU.** With ``PackedSeqParams(qkv_format="thd")`` the tokens of a packed row
  arrive as ``[T, heads, dim]`` with ``cu_seqlens``; sequences are attended separately with a causal
  kernel (batched by similar length, right-padded inside the kernel call only), so a row costs about
  ``sum_i L_i^2`` instead of ``T^2``, no mask is materialised, and the projections and MLP around
  attention see no pad token at all.
  megatron's own RoPE already restarts positions per sequence from ``cu_seqlens`` in this format.
* **Speed and memory** on padded batches: torch's fused CPU kernel instead of the explicit score
  tensor. The arbitrary boolean mask (causal AND real keys, see ``logprobs.padded_inputs``) is passed
  through unchanged; every query row keeps at least its own key, so no row is fully masked (a fully
  masked row would give NaN, which pads would then spread to real tokens through the value matmul).

* **bf16 / fp16 on CPU: Hugging Face's eager attention** (:func:`attend`): the scores and the value
  product in the low precision, the masked softmax in fp32, the GQA heads as extra query rows (no kv
  copies). torch's CPU flash-attention backward is far slower in bf16 than in fp32, and upcasting to
  the fp32 kernel (what this module did before) cost 7.6-7.9 ms per layer forward + backward at the
  benchmark's shape (32 sequences x 70 tokens, 6 / 2 heads, head dim 32, one core) against 3.3-4.4 ms
  written out; the result is within one bf16 ulp of HF's eager formula, about two of a float64
  reference (the fp32 kernel: one).

Math, per head with ``q, k, v`` of one sequence: ``softmax(q k^T * scale + mask) v`` with
``scale = 1 / sqrt(head_dim)`` (megatron's default); GQA: query head ``h`` reads kv head
``h // (heads / kv_heads)`` (Ainslie et al. 2023). The kernel's native GQA (``enable_gqa``) reads the
shared kv heads in place instead of materialising ``repeat_interleave`` copies: same values, less
memory traffic. The kernel gets q, k and v contiguous in ``[b, heads, s, d]`` (under torch.compile
the copy fuses with the fp32 cast), because its forward is slower on the permuted ``[s, b, heads, d]``
views. Dropout is not supported (the bridge runs with ``attention_dropout = 0``). Timings behind
these choices: ``benchmarks/bench_e2e.py``, History.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron_bridge.context_parallel import attention as cp_attention


class TorchSDPAttention(MegatronModule):
    """Drop-in ``core_attention`` for megatron's ``SelfAttention`` (same constructor / forward)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        p = config.attention_dropout if attention_dropout is None else attention_dropout
        if p:
            raise NotImplementedError("TorchSDPAttention: attention dropout is not supported")
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        if config.apply_query_key_layer_scaling:
            raise NotImplementedError("apply_query_key_layer_scaling is not supported")
        self.attn_mask_type = attn_mask_type

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            plan = getattr(packed_seq_params, "_coxswain_cp", None)
            if plan is not None:  # context parallelism: gather keys / values over the CP group

                return cp_attention(query, key, value, plan, self.scale)
            return self._thd(query, key, value, packed_seq_params)
        if self.config.context_parallel_size > 1:
            raise ValueError("context parallelism needs packed (THD) inputs with a CP plan (logprobs.run_model)")
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (query, key, value))  # see the docstring
        # megatron's mask marks what is masked out; SDPA wants the opposite
        out = attend(q, k, v, None if attention_mask is None else ~attention_mask, self.scale)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [s, b, heads * d]

    # data-dependent buckets: eager inside a compiled chunk, never recompiled (eager_thd_inside_compiled_chunks)
    def _thd(self, query, key, value, psp):
        """``[T, heads, d]`` packed tokens: causal attention within each sequence. Sequences of similar
        length are batched into one right-padded ``[n, heads, L_max, d]`` kernel call: with right
        padding the causal mask alone keeps every real query off the pad keys, so attention
        (:func:`attend`) runs with no explicit mask; pad queries are dropped. Buckets keep the padded cost within 2x
        of ``sum_i L_i^2`` (see ``thd_buckets``)."""
        out = query.new_empty(query.shape[0], query.shape[1], value.shape[2])  # [T, heads, d]
        for n, L, src, slot in _thd_plan(psp, query.device):

            def grid(x):  # [T, h, d] -> [n, h, L, d], zeros on the pad slots
                g = x.new_zeros(n * L, x.shape[1], x.shape[2]).index_copy(0, slot, x.index_select(0, src))
                return g.view(n, L, x.shape[1], x.shape[2]).transpose(1, 2)

            o = attend(grid(query), grid(key), grid(value), None, self.scale)  # [n, heads, L, d]
            out = out.index_copy(0, src, o.transpose(1, 2).reshape(n * L, o.shape[1], o.shape[3]).index_select(0, slot))
        return out.reshape(out.shape[0], -1)  # [T, heads * d]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale, allowed) v`` over ``[b, heads, s, d]`` (k / v ``[b, kv_heads, s, d]``);
    ``allowed`` a boolean ``[b, 1, s, s]`` (None: causal).

    fp32, or any dtype on GPU: torch's fused SDPA kernel, with its native GQA. bf16 / fp16 on CPU:
    written out as Hugging Face's eager attention computes it (``eager_attention_forward``): scores
    and the value product in the input dtype, the masked softmax in fp32. On CPU this is faster than
    the fused kernel, whose backward is slow in bf16 and which in fp32 needs the inputs upcast
    (``benchmarks/bench_e2e.py``, History). GQA without copies: the ``G`` query heads of kv head ``j``
    become ``G * s`` query rows against it (q viewed as ``[b, K, G * s, d]``)."""
    if q.device.type != "cpu" or q.dtype == torch.float32:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    b, H, s, d = q.shape
    K = k.shape[1]
    G = H // K
    scores = torch.matmul(q.reshape(b, K, G * s, d), k.transpose(-1, -2))  # [b, K, G*s, s], input dtype
    if allowed is None:
        allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    # One op for the scale, the upcast and the mask: bias + scale * scores, in fp32 (type promotion);
    # its backward is a single scaled cast (a masked_fill's would be another pass)
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=q.device).masked_fill_(~allowed, float("-inf"))
    scores = torch.add(bias.unsqueeze(-3), scores.view(b, K, G, s, s), alpha=scale)  # [b, K, G, s, s] fp32
    p = torch.softmax(scores, dim=-1).to(v.dtype).view(b, K, G * s, s)
    return torch.matmul(p, v).view(b, H, s, d)


def _thd_plan(psp, device) -> list:
    """Per bucket ``(n, L_max, src, slot)``: the token rows of its sequences and their slots in the
    padded ``[n * L_max]`` grid. Built once per packed micro-batch and kept on its ``PackedSeqParams``
    (every layer, forward and backward, reuses it)."""
    plan = getattr(psp, "_coxswain_thd_plan", None)
    if plan is None:
        cu = psp.cu_seqlens_q.to(torch.long).cpu()
        lens = (cu[1:] - cu[:-1]).tolist()
        plan = []
        for seqs in thd_buckets(lens):
            L = max(lens[i] for i in seqs)
            src = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in seqs]).to(device)
            slot = torch.cat([j * L + torch.arange(lens[i]) for j, i in enumerate(seqs)]).to(device)
            plan.append((len(seqs), L, src, slot))
        psp._coxswain_thd_plan = plan
    return plan


def thd_buckets(lens: list[int], waste: float = 2.0) -> list[list[int]]:
    """Groups of packed sequences (indices into ``lens``, zero-length ones left out) for batched
    attention: by decreasing length, a group grows while its padded cost ``n * L_max^2`` stays within
    ``waste`` x its exact cost ``sum L_i^2``, so ragged lengths never pay for the longest one."""
    order = sorted((i for i, n in enumerate(lens) if n > 0), key=lambda i: -lens[i])
    groups, cur, exact = [], [], 0
    for i in order:
        L = lens[cur[0]] if cur else lens[i]
        if cur and (len(cur) + 1) * L * L > waste * (exact + lens[i] ** 2):
            groups.append(cur)
            cur, exact = [], 0
        cur.append(i)
        exact += lens[i] ** 2
    if cur:
        groups.append(cur)
    return groups


def grouped_qkv_split(mixed_qkv, num_groups: int, heads_per_group: int, head_dim: int):
    """Megatron's fused QKV output ``[s, b, ng * (np/ng + 2) * hn]`` (per group: its ``np/ng`` query
    heads, then one key and one value head) -> query ``[s, b, np, hn]``, key and value ``[s, b, ng, hn]``.

    The same values as ``SelfAttention.get_query_key_value_tensors``, but split on a separate head
    axis (``[s, b, ng, np/ng + 2, hn]``) instead of on the flattened ``(np/ng + 2) * hn`` axis: there,
    inductor indexes the query heads as ``(hn * h + d) % (np/ng * hn)``, a modulo on the innermost
    (head-dim) index that it cannot vectorise, and the fused bias + RoPE kernels around it run as
    scalar loops."""
    s, b = mixed_qkv.shape[0], mixed_qkv.shape[1]
    mixed = mixed_qkv.view(s, b, num_groups, heads_per_group + 2, head_dim)
    query, key, value = torch.split(mixed, [heads_per_group, 1, 1], dim=3)
    return query.reshape(s, b, num_groups * heads_per_group, head_dim), key.squeeze(3), value.squeeze(3)


def grouped_self_attention():
    from megatron.core.transformer.attention import SelfAttention

    class GroupedSelfAttention(SelfAttention):
        """megatron's ``SelfAttention`` with :func:`grouped_qkv_split` on the common path (no output
        gate, at least one kv group per TP rank); anything else is megatron's own code."""

        def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False,
                                        split_qkv=True):
            if output_gate or not split_qkv or self.config.num_query_groups < self.world_size:
                return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
            mixed_qkv, _ = self.linear_qkv(hidden_states)
            ng = self.num_query_groups_per_partition
            query, key, value = grouped_qkv_split(mixed_qkv, ng, self.num_attention_heads_per_partition // ng,
                                                  self.hidden_size_per_attention_head)
            if self.q_layernorm is not None:
                query = self.q_layernorm(query)
            if self.k_layernorm is not None:
                key = self.k_layernorm(key)
            return query, key, value

    return GroupedSelfAttention


def eager_thd_inside_compiled_chunks() -> None:
    """``TorchSDPAttention._thd`` under ``torch.compiler.disable``, set when a chunk is compiled
    (megatron_bridge.model.compile_model): applied at import it would load dynamo in every megatron process,
    compiled or not (megatron_bridge/lazy_compile.py). Idempotent."""
    thd = TorchSDPAttention.__dict__["_thd"]
    if not getattr(thd, "_torchdynamo_disable", False):
        TorchSDPAttention._thd = torch.compiler.disable(thd)
