"""Ulysses sequence parallelism and the attention of the HF-model strategies, in plain torch.distributed.

DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models", arXiv:2309.14509), as verl's ``ulysses_sequence_parallel_size``
runs it: the ``P`` ranks of a sequence-parallel group hold the same micro-batch, and each runs the model
on its own ``S/P`` consecutive positions (the row padded to a multiple of ``P``). Every layer but
attention is position-wise, so only attention needs the other positions: around it one all-to-all turns
``[b, H, S/P, d]`` (all heads, my positions) into ``[b, H/P, S, d]`` (my heads, all positions), attention
runs on whole sequences for ``H/P`` heads, and the inverse all-to-all gives each rank its positions back.
Grouped-query K/V (``H_kv`` heads) travel as they are when ``P`` divides ``H_kv``, else each K/V head is
first repeated to the ``H`` query heads (what verl does when ``H_kv < P``); ``P`` must divide ``H``.

The per-token outputs (log-probs, entropy, values) are computed on each rank's positions and gathered
along the sequence, so every rank of the group has the whole micro-batch's outputs and computes the same
loss ``L``. Backward through the gather gives rank ``r`` the gradient of ``L`` at its own positions only;
the all-to-alls carry it to the heads of the other ranks, so the group's gradients sum to ``dL/dθ`` once.
FSDP averages gradients over all ``D x P`` ranks while the loss is normalised for the ``D`` data-parallel
shards (``LossAgg``), so the gather's backward multiplies by ``P`` (verl's ``grad_scaler``).

The attention itself (:func:`attention`, registered with transformers as ``coxswain``) is softmax
attention under an explicit mask built from each position's sequence id and index: a query attends to the
keys of its own sequence at or before it. Padded rows (sequence id 0 on pads) and packed rows (one row
of many sequences, ``use_remove_padding``: the ids change at each boundary) share the one definition,
which is what makes packing an exact no-op on the numbers. The mask is ``[b, 1, S, S]`` booleans; a pad
query attends to itself only (its output is never read) so that no softmax row is empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTN_NAME = "coxswain"


@dataclass
class SeqContext:
    """What the attention of one forward needs: the mask over the whole row and the sequence-parallel group."""
    mask: torch.Tensor  # [b, 1, S, S] bool: True = may attend
    group: Optional[dist.ProcessGroup] = None  # the Ulysses group (None: no sequence parallelism)
    size: int = 1


# The context of the latest forward, kept after it returns: activation checkpointing recomputes the layers
# during backward (on autograd's threads on an accelerator), after the forward call has returned. A process
# runs one model forward at a time, so one slot is enough.
_CTX: list[Optional[SeqContext]] = [None]


def set_seq_context(ctx: SeqContext) -> None:
    """The mask and group every :func:`attention` call uses until the next call of this function."""
    _CTX[0] = ctx


def attention_mask(seg: torch.Tensor) -> torch.Tensor:
    """``seg [b, S]``: each position's sequence id (0 = pad) -> ``[b, 1, S, S]`` bool: same sequence, key at or
    before the query; a pad query sees itself only."""
    S = seg.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=seg.device).tril()  # [S, S]
    same = (seg.unsqueeze(2) == seg.unsqueeze(1)) & (seg > 0).unsqueeze(2)  # [b, S, S]
    eye = torch.eye(S, dtype=torch.bool, device=seg.device)
    return ((same & causal) | eye).unsqueeze(1)


# ------------------------------------------------------------------ collectives with their gradients
def _all_to_all(x: torch.Tensor, group, size: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` into ``size`` chunks, send chunk ``j`` to rank ``j`` and concatenate
    what arrives along ``gather_dim``."""
    ins = [c.contiguous() for c in x.chunk(size, dim=scatter_dim)]
    outs = [torch.empty_like(ins[0]) for _ in range(size)]
    dist.all_to_all(outs, ins, group=group)
    return torch.cat(outs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, scatter_dim, gather_dim):
        ctx.args = (group, size, scatter_dim, gather_dim)
        return _all_to_all(x, group, size, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g):
        group, size, scatter_dim, gather_dim = ctx.args
        return _all_to_all(g, group, size, gather_dim, scatter_dim), None, None, None, None


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 1; backward: this rank's slice of the gradient times the group size (see above)."""

    @staticmethod
    def forward(ctx, x, group, size, rank):
        ctx.args = (size, rank, x.shape[1])
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, g):
        size, rank, n = ctx.args
        return g[:, rank * n:(rank + 1) * n] * size, None, None, None


def gather_seq(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """``[b, S/P, ...]`` on each rank -> ``[b, S, ...]`` on every rank (differentiable)."""
    if size == 1:
        return x
    return _GatherSeq.apply(x, group, size, dist.get_rank(group))


# ------------------------------------------------------------------ the attention function
def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: ``query [b, H, s, d]``, ``key`` / ``value [b, H_kv, s, d]`` ->
    ``([b, s, H, d], None)``; the mask is the context's (HF's own ``attention_mask`` is not used)."""
    ctx = _CTX[0]
    if ctx is None:
        raise RuntimeError("the coxswain attention needs trainer.strategies.ulysses.set_seq_context first")
    H, Hkv = query.shape[1], key.shape[1]
    P = ctx.size
    if P > 1:
        if Hkv % P:  # each K/V head repeated to its query heads, so the heads split evenly
            key, value = (t.repeat_interleave(H // Hkv, dim=1) for t in (key, value))
            Hkv = H
        query, key, value = (_AllToAll.apply(t, ctx.group, P, 1, 2) for t in (query, key, value))  # [b, H/P, S, d]
    if Hkv != H:  # grouped-query attention: query head h reads K/V head h // (H / H_kv)
        rep = query.shape[1] // key.shape[1]
        key, value = (t.repeat_interleave(rep, dim=1) for t in (key, value))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=ctx.mask, scale=scaling,
                                         dropout_p=dropout if module.training else 0.0)  # [b, H/P, S, d]
    if P > 1:
        out = _AllToAll.apply(out, ctx.group, P, 2, 1)  # [b, H, S/P, d]
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    """transformers builds no mask for this attention: :func:`attention` takes it from the context."""
    return None


AttentionInterface.register(ATTN_NAME, attention)
AttentionMaskInterface.register(ATTN_NAME, _no_mask)
