"""Context parallelism (CP) for the bridge's own attention: long sequences split over ``cp`` ranks.

The split is Megatron-LM's load-balanced one (Megatron-Core "context parallelism" docs; Liu et al.
2023, *Ring Attention*, for the idea of sharding the sequence of one attention): each sequence of a
packed row is padded to a multiple of ``2 * cp`` tokens (``2 * cp * tp`` under sequence
parallelism, so every rank's share also splits over TP) and cut into ``2 * cp`` equal chunks; CP rank
``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, so every rank has the same number of tokens and about
the same causal-attention work. Padding sits at the end of its sequence, after every real token, so
causal attention keeps real queries off it; its outputs are dropped.

Each rank runs the embedding, the projections, the MLP and the norms on its own tokens only. In
attention, keys and values are all-gathered over the CP group (backward: every rank's key / value
gradient is summed over the group and each keeps its own tokens', a reduce-scatter), and each local
query attends to the keys of its own sequence at global positions ``<=`` its own
(``softmax(q k^T / sqrt(d) + causal mask) v`` per sequence, GQA as in :mod:`megatron_bridge.attention`).
RoPE gets every local token's global position.

The per-token outputs (log-probs, entropy, values: small) are all-gathered over the group and put
back in the caller's layout, so a loss sees whole sequences and every CP rank computes the same loss;
the backward of that gather keeps each rank's own tokens' gradient. Parameter gradients are then
partial sums over CP ranks; megatron's DDP averages over data x context parallel ranks and its
schedule multiplies the loss by ``cp``, which makes the step's gradient the whole sequences' one.

All of this runs with gloo on CPU (all-gather and all-reduce only). On GPU with Transformer Engine,
TE's own CP attention would be the fast path; this module is the reference it is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass
class CPPlan:
    """One micro-batch's split for this CP rank (see the module docstring)."""

    cp: int
    rank: int
    ids: torch.Tensor  # [1, Tl] this rank's tokens
    positions: torch.Tensor  # [1, Tl] their positions within their sequence
    labels: torch.Tensor  # [Tl] the next token of each (0 where there is none)
    cu_local: torch.Tensor  # [N+1] local packed layout: each sequence's two chunks, contiguous
    padded_cu: torch.Tensor  # [N+1] the padded whole row
    kv_order: torch.Tensor  # [Tp] for each padded-row token, its index in the rank-major all-gather
    out_index: torch.Tensor  # [Tp] for each padded-row token, its flat index in the caller's grid, -1 for padding
    grid_shape: tuple  # the caller's per-token layout (input_ids' shape)
    group: object = None  # the CP process group
    local_index: torch.Tensor | None = None  # [Tl] each local token's flat index in the caller's grid, -1 for padding

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[1])


def sequence_lengths(inp) -> list[int]:
    """The real token count of each sequence of prepared inputs (packed or padded)."""
    if inp.packed:
        cu = inp.cu_seqlens.to(torch.long).cpu()
        return (cu[1:] - cu[:-1]).tolist()
    return inp.real.sum(1).cpu().tolist()


def local_tokens(inp, cp: int, multiple: int = 1) -> int:
    """Tokens each CP rank holds of ``inp``: every sequence padded to ``2 * cp * multiple``, over ``cp``."""
    step = 2 * cp * multiple
    return sum(-(-n // step) * step for n in sequence_lengths(inp)) // cp


def build_plan(inp, cp: int, rank: int, group, multiple: int = 1, pad_local_to: int = 0) -> CPPlan:
    """The split of prepared model inputs (``logprobs.ModelInputs``, packed or padded). ``multiple``:
    pad each sequence to a multiple of ``2 * cp * multiple`` (``multiple`` = TP under sequence parallelism).
    ``pad_local_to``: one dummy sequence (no real token) brings every rank to that many tokens, so every
    micro-batch exchanges one shape between virtual pipeline stages."""
    dev = inp.input_ids.device
    if inp.packed:
        toks = inp.input_ids.reshape(-1)  # [T]
        cu = inp.cu_seqlens.to(torch.long).cpu()
        grid = torch.arange(toks.numel())  # [T]
        labels = inp.labels.reshape(-1)
    else:
        real = inp.real.bool()  # [B, S]
        toks = inp.input_ids[real]
        lens = real.sum(1).cpu()
        cu = torch.zeros(len(lens) + 1, dtype=torch.long)
        cu[1:] = lens.cumsum(0)
        grid = real.reshape(-1).nonzero().squeeze(1).cpu()  # [T] flat positions of the real tokens
        labels = inp.labels[real]
    step = 2 * cp * multiple
    lens = (cu[1:] - cu[:-1]).tolist()
    plens = [-(-n // step) * step if n else 0 for n in lens]
    extra = pad_local_to * cp - sum(plens) if pad_local_to else 0
    if extra < 0 or extra % step:
        raise ValueError(f"pad_local_to={pad_local_to}: below this micro-batch's {sum(plens) // cp} tokens per "
                         f"rank or not a multiple of {step // cp}")
    if extra:  # the dummy: padded length only, so it occupies both chunks of every rank and nothing reads it
        lens, plens = lens + [0], plens + [extra]
        cu = torch.cat([cu, cu[-1:]])
    padded_cu = torch.zeros(len(lens) + 1, dtype=torch.long)
    padded_cu[1:] = torch.tensor(plens, dtype=torch.long).cumsum(0)
    tp_total = int(padded_cu[-1])
    src = torch.full((tp_total,), -1, dtype=torch.long)  # padded position -> index into toks
    pos = torch.zeros(tp_total, dtype=torch.long)
    for i, (n, pn) in enumerate(zip(lens, plens)):
        s = int(padded_cu[i])
        src[s:s + n] = torch.arange(int(cu[i]), int(cu[i]) + n)
        pos[s:s + pn] = torch.arange(pn)
    # each rank's local tokens, in padded-row indices: per sequence, chunks r and 2cp-1-r
    per_rank = []
    for r in range(cp):
        idx = []
        for i, pn in enumerate(plens):
            c, s = pn // (2 * cp), int(padded_cu[i])
            for j in (r, 2 * cp - 1 - r):
                idx.append(torch.arange(s + j * c, s + (j + 1) * c))
        per_rank.append(torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long))
    tl = per_rank[0].numel()
    kv_order = torch.empty(tp_total, dtype=torch.long)
    for r, idx in enumerate(per_rank):
        kv_order[idx] = torch.arange(r * tl, (r + 1) * tl)
    mine = per_rank[rank]
    has = src[mine] >= 0
    ids = torch.zeros(tl, dtype=toks.dtype, device=dev)
    ids[has.to(dev)] = toks[src[mine][has].to(dev)]
    lab = torch.zeros(tl, dtype=labels.dtype, device=dev)
    lab[has.to(dev)] = labels[src[mine][has].to(dev)]
    cu_local = torch.zeros(len(lens) + 1, dtype=torch.long)
    cu_local[1:] = (torch.tensor(plens, dtype=torch.long) // cp).cumsum(0)
    out_index = torch.full((tp_total,), -1, dtype=torch.long)
    ok = src >= 0
    out_index[ok] = grid[src[ok]]
    return CPPlan(cp, rank, ids[None], pos[mine].to(dev)[None], lab, cu_local, padded_cu, kv_order.to(dev),
                  out_index.to(dev), tuple(inp.input_ids.shape), group, local_index=out_index[mine])


class _GatherOwnGrad(torch.autograd.Function):
    """All-gather along dim 0 (rank-major); backward keeps this rank's slice of the gradient (every
    rank computes the same loss from the gathered tensor, so that slice is its whole gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, g):
        r = dist.get_rank(ctx.group)
        return g[r * ctx.n:(r + 1) * ctx.n].contiguous(), None


class _GatherSumGrad(torch.autograd.Function):
    """All-gather along dim 0; backward sums the gradient over the group and keeps this rank's slice
    (a reduce-scatter): keys and values are read by every rank's queries."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return g[r * ctx.n:(r + 1) * ctx.n].contiguous(), None


def attention(query, key, value, plan: CPPlan, scale: float) -> torch.Tensor:
    """``[Tl, heads, d]`` local queries against the whole sequences' keys / values, causal on global
    positions; returns ``[Tl, heads * d]``."""
    kf = _GatherSumGrad.apply(key, plan.group)[plan.kv_order]  # [Tp, kv_heads, d] padded-row order
    vf = _GatherSumGrad.apply(value, plan.group)[plan.kv_order]
    gqa = key.shape[1] != query.shape[1]
    out = []
    cu, pcu = plan.cu_local.tolist(), plan.padded_cu.tolist()
    qpos = plan.positions[0]
    for i in range(len(cu) - 1):
        if cu[i + 1] == cu[i]:
            continue
        q = query[cu[i]:cu[i + 1]].transpose(0, 1)[None]  # [1, h, nq, d]
        k = kf[pcu[i]:pcu[i + 1]].transpose(0, 1)[None]  # [1, hk, L, d]
        v = vf[pcu[i]:pcu[i + 1]].transpose(0, 1)[None]
        allowed = torch.arange(pcu[i + 1] - pcu[i], device=q.device)[None, :] <= qpos[cu[i]:cu[i + 1]][:, None]
        o = F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), attn_mask=allowed,
                                           scale=scale, enable_gqa=gqa)  # [1, h, nq, d]
        out.append(o[0].transpose(0, 1))  # [nq, h, d]
    o = torch.cat(out, 0)
    return o.reshape(o.shape[0], -1)


def gather_outputs(x: torch.Tensor, plan: CPPlan) -> torch.Tensor:
    """A per-token output of this rank's tokens (``[Tl]`` or ``[1, Tl]``) -> the caller's layout
    (``plan.grid_shape``, zeros where there is no token), differentiable."""
    full = _GatherOwnGrad.apply(x.reshape(-1), plan.group)[plan.kv_order]  # [Tp] padded-row order
    keep = plan.out_index >= 0
    n = 1
    for s in plan.grid_shape:
        n *= s
    grid = full.new_zeros(n).index_copy(0, plan.out_index[keep], full[keep])
    return grid.view(plan.grid_shape)
