"""Direct resharding: every model-parallel rank writes the shards it owns straight into the HF layout.

The gather path (:func:`megatron_bridge.export.iter_hf_param`) all-gathers each tensor-parallel
parameter, merges it (``tp_merge``), converts it to HF tensors (``canonical_to_hf``) and ships the
full tensors from one rank: every byte crosses gloo once and funnels through rank 0. Here nothing is
gathered: each rank copies its own shard's pieces to their final places in a shared HF-layout buffer
(``trainer/sync/shared_memory.py``), in parallel with the other ranks.

The plan. For one canonical parameter split over ``tp`` ranks, the map from element ``j`` of rank
``r``'s local shard to its position in the HF tensors is a fixed permutation. We obtain it by running
the gather path's own functions on index tensors: rank ``r``'s shard holds ``r * n + arange(n)``,
``tp_merge`` then ``canonical_to_hf`` move those ids exactly as they move weights. So the plan cannot
disagree with the gather path (fused QKV groups, gate/up halves, vocabulary padding cut off, tied
heads, replicated norms). The ids a rank finds in an HF tensor are compressed into 2-D strided
blocks::

    hf.view(rows, -1)[r0:r1, c0:c1]  <-  local.view(-1).as_strided((r1 - r0, c1 - c0), (row_stride, 1), offset)

(a column-parallel weight is one block per rank; a row-parallel one a column block; a fused QKV
weight one block per query group and q/k/v). Every element is written once, by the one rank that
owns it: replicated tensors by tensor-parallel rank 0 (the ids of the other ranks never appear in the
merge), pipeline stages and expert-parallel ranks their own layers; data-, context- and
expert-data-parallel replicas of a shard hold the same values, so they split its blocks among them
(:func:`spread`: big blocks cut by rows, small ones dealt by bytes), and every replica writes a part.

Cost of building it: one int64 id tensor the size of each full parameter, one parameter at a time,
once per run. The plan is only a list of block bounds (a few per tensor).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from megatron_bridge.convert import canonical_to_hf, is_expert, expert_index, local_name, tp_merge
from megatron_bridge.export import stage_plan
from megatron_bridge.model import chunks, unwrap


@dataclass(frozen=True)
class Block:
    """One strided copy from a local parameter into one HF tensor."""

    hf_name: str
    hf_shape: tuple[int, ...]
    rows: tuple[int, int]  # [r0, r1) of the HF tensor viewed as [shape[0], -1]
    cols: tuple[int, int]  # [c0, c1)
    param: str  # the local parameter's name (``named_parameters``), "" in pure plans
    offset: int  # element offset into the local parameter's flat storage
    row_stride: int  # elements between the starts of consecutive block rows in the local parameter

    @property
    def key(self) -> str:
        """Names this block on both sides of a sync (the digest of its bytes is keyed by it)."""
        return f"{self.hf_name}[{self.rows[0]}:{self.rows[1]},{self.cols[0]}:{self.cols[1]}]"

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows[1] - self.rows[0], self.cols[1] - self.cols[0]

    def src(self, local: torch.Tensor) -> torch.Tensor:
        """The block's elements in the local shard, as a [rows, cols] view (no copy)."""
        if not local.is_contiguous():
            raise ValueError(f"{self.param}: the local parameter is not contiguous; the plan addresses "
                             f"its flat storage")
        flat = local.detach().reshape(-1)
        # as_strided's offset is into the storage, and a live parameter is a view into megatron's
        # contiguous parameter buffer: count from the parameter's own start
        return flat.as_strided(self.shape, (self.row_stride, 1), flat.storage_offset() + self.offset)

    def dst(self, hf_tensor: torch.Tensor) -> torch.Tensor:
        """The block's place in a tensor of the HF shape, as a [rows, cols] view."""
        return as_2d(hf_tensor)[self.rows[0]:self.rows[1], self.cols[0]:self.cols[1]]


def as_2d(t: torch.Tensor) -> torch.Tensor:
    """[shape[0], prod(rest)] view (a 1-D tensor is one column); the frame every block is cut in."""
    return t.reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1)


def _compress(ids: torch.Tensor, lo: int, n: int) -> list[tuple[tuple[int, int], tuple[int, int], int, int]]:
    """Blocks (rows, cols, offset, row_stride) of the elements of ``ids`` (an HF tensor of ids) that
    are in ``[lo, lo + n)``: the local shard's elements, at local index ``id - lo``."""
    grid = as_2d(ids)
    own = (grid >= lo) & (grid < lo + n)
    rows = torch.nonzero(own.any(1)).flatten()
    if rows.numel() == 0:
        return []
    cols = torch.nonzero(own[rows[0]]).flatten()
    c0, c1 = int(cols[0]), int(cols[-1]) + 1
    sub = grid[rows, c0:c1] - lo  # [rows, cols] local indices
    # every owned row must own the same column range, contiguous in the local shard
    if (cols.numel() != c1 - c0 or not bool(own[rows][:, c0:c1].all()) or int(own[rows].sum()) != sub.numel()
            or (sub.shape[1] > 1 and not bool((sub[:, 1:] - sub[:, :-1] == 1).all()))):
        raise NotImplementedError("an HF tensor takes a non-rectangular piece of a local shard; "
                                  "the direct reshard plan covers only row/column blocks")
    r = rows.numpy().astype(np.int64)
    s = sub[:, 0].numpy().astype(np.int64)
    out, a, R = [], 0, len(r)
    while a < R:  # greedy: the longest run of consecutive rows whose starts advance by one stride
        b = a + 1
        if b < R and r[b] == r[a] + 1:
            d = s[b] - s[a]
            step_r, step_s = np.diff(r[a:]), np.diff(s[a:])
            bad = np.flatnonzero((step_r != 1) | (step_s != d))
            b = a + 1 + (int(bad[0]) if bad.size else R - a - 1)
        stride = int(s[a + 1] - s[a]) if b - a > 1 else c1 - c0
        out.append(((int(r[a]), int(r[b - 1]) + 1), (c0, c1), int(s[a]), stride))
        a = b
    return out


def blocks_for(canonical: str, hf, local_shape: tuple[int, ...], tp: int, tp_rank: int, *,
               value_head: bool = False) -> list[Block]:
    """The blocks that rank ``tp_rank`` (of ``tp``) writes for one canonical parameter whose local
    shard has ``local_shape`` (pure; ``param`` left empty)."""
    n = int(np.prod(local_shape)) if local_shape else 1
    parts = [torch.arange(r * n, (r + 1) * n, dtype=torch.int64).reshape(local_shape) for r in range(tp)]
    full = tp_merge(canonical, parts, value_head)
    out = []
    for hf_name, ids in canonical_to_hf(canonical, full, hf, value_head=value_head):
        for rows, cols, off, stride in _compress(ids, tp_rank * n, n):
            out.append(Block(hf_name, tuple(ids.shape), rows, cols, "", off, stride))
    return out


SPLIT_BYTES = 256 << 10  # a block at least this big is cut by rows among the replicas that hold it


def spread(blocks: list[Block], n: int, i: int, esize: int = 4) -> list[Block]:
    """Replica ``i`` of ``n`` identical replicas' share of ``blocks``: a block of at least
    :data:`SPLIT_BYTES` is cut by rows into ``n`` near-equal parts (part ``i`` is this replica's), the
    smaller ones are dealt whole, each to the replica with the fewest bytes so far. Every replica
    computes the same assignment from the same list, so the shares partition the blocks: data-parallel
    replicas write the model together instead of the first one writing it all."""
    if n <= 1:
        return list(blocks)
    load, out = [0] * n, []
    for b in blocks:
        rows = b.rows[1] - b.rows[0]
        size = rows * (b.cols[1] - b.cols[0]) * esize
        if size >= SPLIT_BYTES and rows >= n:
            a, z = b.rows[0] + rows * i // n, b.rows[0] + rows * (i + 1) // n
            out.append(dataclasses.replace(b, rows=(a, z), offset=b.offset + (a - b.rows[0]) * b.row_stride))
            for j in range(n):
                load[j] += size // n
        else:
            j = load.index(min(load))
            load[j] += size
            if j == i:
                out.append(b)
    return out


def local_blocks(model) -> list[Block]:
    """Every block this rank writes for its model chunks (call after ``parallel_state`` is set up;
    no collective). The data-parallel (and expert-data-parallel) replicas of a shard share its blocks
    (:func:`spread`)."""
    from megatron.core import parallel_state as ps


    ms = [unwrap(c) for c in chunks(model)]
    m = ms[0]
    hf = m.hf_config
    my_stage = ps.get_pipeline_model_parallel_rank()
    params = [dict(c.named_parameters()) for c in ms]
    dense, experts = [], []
    for stage, chunk, name in stage_plan(m):
        if stage != my_stage:
            continue
        if name == "output_layer.weight" and hf.tie_word_embeddings and not m.is_critic:
            continue  # HF stores the tied head once, as the embedding
        if is_expert(name):
            if expert_index(name) // m.num_local_experts != ps.get_expert_model_parallel_rank():
                continue
            tp, tp_rank, out = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(), experts
        else:
            tp, tp_rank, out = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), dense
        lname = local_name(name, ms[chunk].layer_offset, ms[chunk].uses_te, getattr(ms[chunk], "expert_offset", 0))
        p = params[chunk][lname]
        for b in blocks_for(name, hf, tuple(p.shape), tp, tp_rank, value_head=m.is_critic):
            out.append(Block(b.hf_name, b.hf_shape, b.rows, b.cols, f"{chunk}:{lname}", b.offset, b.row_stride))
    esize = next(iter(params[0].values())).element_size()
    dense = spread(dense, ps.get_data_parallel_world_size(with_context_parallel=True),
                   ps.get_data_parallel_rank(with_context_parallel=True), esize)
    if experts:
        experts = spread(experts, ps.get_expert_data_parallel_world_size(), ps.get_expert_data_parallel_rank(), esize)
    return dense + experts


def local_param(model, ref: str) -> torch.Tensor:
    """The parameter a :class:`Block` of :func:`local_blocks` names (``"<chunk>:<name>"``)."""

    chunk, name = ref.split(":", 1)
    return dict(unwrap(chunks(model)[int(chunk)]).named_parameters())[name]
