"""Exact per-token log-probs and entropies from vocab-parallel logits, for padded or packed batches.

Math (one position, logits ``z`` over the true vocabulary ``V``, rollout temperature ``T``)::

    x_v       = z_v / T                                        (temperature first, as the sampler does)
    lse       = m + log sum_v exp(x_v - m),   m = max_v x_v
    logp(y)   = x_y - lse
    H         = lse - sum_v softmax(x)_v x_v  =  lse - S2 / S1,  S1 = sum_v e_v, S2 = sum_v e_v x_v, e_v = exp(x_v - m)
    sum_v pi_v^2 = sum_v exp(2 (x_v - lse))  =  Q / S1^2,      Q = sum_v e_v^2

Each tensor-parallel rank holds a contiguous slice of the (padded) vocabulary. The max, ``S1``,
``S2``, ``Q`` and the target logit ``x_y`` (non-zero on the one rank that owns ``y``) are summed over the
TP group, so the full ``[tokens, V]`` logits are never gathered. ``Q / S1^2`` is the stable form of
``sum exp(2 (x - lse))``: every ``e_v <= 1`` and the largest is exactly 1, so ``1 <= Q <= S1 <= V``
and nothing overflows or cancels in float32. ``sum pi^2`` (the optimal token baseline's
``sum_pi_squared``, :mod:`trainer.algos.advantages`) is an input of the advantage, never trained on:
it is computed without autograd. The sum's backward is the identity
(megatron's convention for a loss replicated on every TP rank); the max is a constant shift and
carries no gradient. Vocabulary padding rows (ids >= ``V``) are set to ``-inf`` before anything
else, so they get probability exactly 0.

Alignment. Every per-token output is aligned with the token it scores: ``logprobs[b, t] =
log p(input_ids[b, t] | input_ids[b, :t])``, and ``entropy[b, t]`` / ``sum_pi_squared[b, t]`` /
``values[b, t]`` come from the same position (the hidden state after token ``t-1``), i.e. the state in which token ``t`` was chosen.
The first token of every sequence, and pad positions, get 0.

Batches. Right- or left-padded ``input_ids [B, S]`` + ``attention_mask [B, S]``, or packed rows
``input_ids [1, T]`` + ``cu_seqlens [N+1]`` (THD: sequences back to back, no padding). Position ids
restart at 0 at each sequence's first real token, and attention is causal *and* confined to the
token's own sequence *and* never sees pad keys, so neither pads nor neighbouring packed sequences
leak into a token. Packed rows run through megatron's THD path (``PackedSeqParams``): TE's kernels
on GPU, :class:`megatron_bridge.attention.TorchSDPAttention` (one causal SDPA per sequence) on CPU.
With megatron's own ``DotProductAttention`` (``build_model(attention="megatron")``), which has no
THD support, a packed row instead runs as one sequence under a block-diagonal causal mask (same
numbers, attention cost of the whole row).

CLI (to recompute trainer-side log-probs of a dumped rollout)::

    python -m megatron_bridge.logprobs --model HF_DIR --tp N --pp M [--vpp V] [--cp C] [--ep E [--etp T]] [--sp] --input IN.jsonl --out OUT.jsonl [--temperature T]

Each input line ``{"prompt_ids": [...], "response_ids": [...]}``; each output line adds
``"logprobs"``, one per response token. The ranks are launched locally (gloo on CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megatron_bridge import cpu_shims, routing_replay
from megatron_bridge.context_parallel import build_plan, gather_outputs, local_tokens
from megatron_bridge.convert import load_hf_weights
from megatron_bridge.hf_config import read_hf_config
from megatron_bridge.launch import set_parallel, spawn
from megatron_bridge.model import build_model, chunks, unwrap

# ---------------------------------------------------------------------------------------------------
# vocab-parallel math (pure torch + torch.distributed; no megatron)


# Rows per chunk of the fused pass below: the fp32 temporaries of one chunk (x, e: V x rows elements,
# 256 KiB each at this size) stay in L2, so the [tokens, V] logits are read once per pass and no
# [tokens, V] float32 copy, exp or product is ever materialised or kept for the backward.
_LOGIT_CHUNK = 1 << 16


class _VocabLogprobs(torch.autograd.Function):
    """The fused, row-chunked form of :func:`vocab_parallel_logprobs` (the module docstring's math).

    Forward: per chunk of rows, ``x = z / T`` in float32 (float64 for float64 logits) with the padding
    columns at ``-inf``, then ``S1``, ``x_y`` and ``S2``. With a tensor-parallel group a first pass
    takes the row maxima (all-reduced) and the three sums are all-reduced together afterwards; each
    all-reduce's backward is the identity, as in megatron. Saves only the logits and two ``[N]``
    vectors (``lse``, ``E = S2 / S1``). Backward, per chunk, recomputing ``p = exp(x - lse)``::

        d logp / d x_v = 1[v = y] - p_v          d H / d x_v = -p_v (x_v - E)

    times ``1 / T`` for ``z``; padding columns get 0. Why: unfused, autograd kept an fp32 ``x`` and
    ``e`` of ``[tokens, V]`` for the backward (2 x 9.8 GB for 16k tokens of a 152k vocabulary) and ran
    each elementwise op over the whole array from memory. At bench_e2e's size (2232 tokens, V = 1024,
    bf16 logits, one core) forward + backward take 7.0 ms (median of 15) against 8.9 ms unfused.
    """

    @staticmethod
    def _scaled(z, c, acc, temperature, pad_from):
        # a copy even when z is already in acc: the padding columns are written below, and z is the caller's
        x = z[c].to(acc, copy=True)
        if temperature != 1.0:
            x.div_(temperature)
        if pad_from is not None:
            x[:, pad_from:] = float("-inf")
        return x

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, pad_from, temperature, group, with_entropy, entropy_grad):
        V = logits.shape[-1]
        z = logits.reshape(-1, V)  # [N, V]
        N = z.shape[0]
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        local = labels.reshape(-1) - vocab_start  # [N]
        owned = (local >= 0) & (local < V)
        y = local.clamp(0, V - 1)
        tp = group is not None and dist.get_world_size(group) > 1
        rows = max(1, _LOGIT_CHUNK // max(V, 1))
        chunks = [slice(a, min(a + rows, N)) for a in range(0, N, rows)]
        scaled = _VocabLogprobs._scaled
        m = torch.empty(N, dtype=acc, device=z.device)
        if tp:  # the global row max first: every rank's exp must share one shift
            for c in chunks:
                m[c] = scaled(z, c, acc, temperature, pad_from).amax(-1)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        sums = torch.zeros(3, N, dtype=acc, device=z.device)  # S1, x_y, S2
        for c in chunks:
            x = scaled(z, c, acc, temperature, pad_from)  # [n, V]
            if not tp:
                m[c] = x.amax(-1)
            e = torch.exp(x - m[c, None])
            sums[0, c] = e.sum(-1)
            sums[1, c] = x.gather(-1, y[c, None])[:, 0]
            if with_entropy:  # over the real columns only (0 * -inf would be nan)
                w = V if pad_from is None else pad_from
                sums[2, c] = (e[:, :w] * x[:, :w]).sum(-1)
        sums[1] = torch.where(owned, sums[1], torch.zeros((), dtype=acc, device=z.device))
        if tp:
            dist.all_reduce(sums, group=group)
        lse = m + torch.log(sums[0])
        mean_x = sums[2] / sums[0]
        shape = logits.shape[:-1]
        logp = (sums[1] - lse).reshape(shape)
        ent = (lse - mean_x).reshape(shape) if with_entropy else logp.new_zeros(0)
        ctx.save_for_backward(logits, y, owned, lse, mean_x)
        ctx.args = (pad_from, temperature, with_entropy and entropy_grad, rows)
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, y, owned, lse, mean_x = ctx.saved_tensors
        pad_from, temperature, ent_grad, rows = ctx.args
        V = logits.shape[-1]
        z = logits.reshape(-1, V)
        N = z.shape[0]
        acc = lse.dtype
        g_lp = None if g_logp is None else g_logp.reshape(-1).to(acc) * owned  # the target term: owner only
        g_lse = None if g_logp is None else g_logp.reshape(-1).to(acc)
        g_h = g_ent.reshape(-1).to(acc) if (ent_grad and g_ent is not None) else None
        grad = torch.empty_like(z)
        for a in range(0, N, rows):
            c = slice(a, min(a + rows, N))
            x = _VocabLogprobs._scaled(z, c, acc, temperature, pad_from)
            p = torch.exp(x - lse[c, None])  # [n, V]; 0 on the padding columns
            gx = torch.zeros_like(x) if g_lse is None else p * (-g_lse[c, None])
            if g_h is not None:
                if pad_from is not None:
                    x[:, pad_from:] = 0.0  # p is 0 there; keeps 0 * -inf out
                gx -= g_h[c, None] * p * (x - mean_x[c, None])
            if g_lp is not None:
                gx.scatter_add_(-1, y[c, None], g_lp[c, None])
            if temperature != 1.0:
                gx = gx / temperature
            grad[c] = gx.to(grad.dtype)
        return grad.reshape(logits.shape), None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    group=None,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``labels`` (and entropy) from this rank's vocab slice ``logits [..., V_local]``.

    ``vocab_start``: global id of the slice's first column; ``vocab_size``: true vocabulary (ids at
    or beyond it are padding); ``group``: the tensor-parallel group (None = no parallelism).
    ``entropy_grad=False`` computes the entropy outside autograd (a metric that is not trained on).
    Returns ``(logp [...], entropy [...] or None)`` in float32 (float64 for float64 logits).
    Fused and chunked by rows (:class:`_VocabLogprobs`).
    """
    v_local = logits.shape[-1]
    pad_from = None
    if vocab_size is not None and vocab_start + v_local > vocab_size:
        pad_from = max(0, vocab_size - vocab_start)
    logp, ent = _VocabLogprobs.apply(logits, labels, vocab_start, pad_from, float(temperature), group,
                                     with_entropy, entropy_grad)
    return logp, (ent if with_entropy else None)


@torch.no_grad()
def vocab_parallel_sum_pi_squared(
    logits: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    group=None,
) -> torch.Tensor:
    """``sum_v softmax(logits / T)_v^2`` from this rank's vocab slice ``logits [..., V_local]`` (the
    arguments as in :func:`vocab_parallel_logprobs`). Returns ``[...]`` in float32 (float64 for float64
    logits); no autograd (an advantage input, not a loss term)."""
    x = logits if logits.dtype == torch.float64 else logits.float()  # [..., Vl]
    if temperature != 1.0:
        x = x / temperature
    v_local = x.shape[-1]
    if vocab_size is not None and vocab_start + v_local > vocab_size:  # padding rows: probability exactly 0
        ids = torch.arange(vocab_start, vocab_start + v_local, device=x.device)
        x = x.masked_fill(ids >= vocab_size, float("-inf"))
    m = x.amax(-1)  # [...]
    tp = group is not None and dist.get_world_size(group) > 1
    if tp:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(x - m.unsqueeze(-1))  # [..., Vl] in [0, 1]
    sums = torch.stack([e.sum(-1), (e * e).sum(-1)])  # [2, ...] S1, Q of this slice
    if tp:
        dist.all_reduce(sums, group=group)  # one collective for both sums
    return sums[1] / (sums[0] * sums[0])  # [...]


# ---------------------------------------------------------------------------------------------------
# batch preparation (pure)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [B, S]
    position_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, 1, S, S] bool, True = masked out (megatron's convention)
    labels: torch.Tensor  # [B, S] next token (valid where next_valid)
    next_valid: torch.Tensor  # [B, S] bool: token t+1 exists, is real and is in the same sequence
    token_valid: torch.Tensor  # [B, S] bool: token t is real and not the first of its sequence
    packed: bool = False
    cu_seqlens: torch.Tensor | None = None  # [N+1] for packed rows
    real: torch.Tensor | None = None  # [B, S] bool attention mask of a padded batch
    pad_to: int = 0  # > 0: run as one THD row of exactly this many tokens (virtual pipeline stages; per CP rank under CP)
    cp: object = None  # context parallelism: this rank's share (megatron_bridge.context_parallel.CPPlan)
    routing: torch.Tensor | None = None  # [B*S, R, k] replayed experts of each input token (routing_replay)

    def to(self, device) -> "ModelInputs":
        mv = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return ModelInputs(*(mv(getattr(self, f)) for f in ("input_ids", "position_ids", "attention_mask", "labels",
                                                              "next_valid", "token_valid")),
                           packed=self.packed, cu_seqlens=self.cu_seqlens, real=mv(self.real), pad_to=self.pad_to,
                           cp=self.cp, routing=self.routing)


def model_device(model) -> torch.device:

    return next(unwrap(chunks(model)[0]).parameters()).device


def schedule_args(model, inputs: list, prepared: list[ModelInputs], *, seq_length: int, micro_batch_size: int) -> dict:
    """The model / data arguments of megatron's schedule for ``inputs`` (what each step pulls; their
    ``prepared`` model inputs, in the same order).

    Without virtual stages: the one chunk and one iterator, variable sequence lengths (each p2p
    exchange sends its shape first). With them (vpp > 1) megatron's interleaved schedule gets the chunk
    list and one iterator per chunk, and every micro-batch runs as one THD row padded (a dummy
    sequence, cropped on the last stage) to the longest one's token count, so every exchange has one
    fixed shape and no shape messages: with variable shapes at pp=2 the batched exchanges paired a
    stage's activation with another micro-batch's (seen here on gloo as a shape error; with equal
    shapes it would be silent), which the overlapped p2p mode the config sets at pp=2 also avoids
    (``hf_config.transformer_config_kwargs``). The schedule needs at least ``pp`` micro-batches."""
    from megatron.core import parallel_state as ps


    cs = chunks(model)
    cfg = cs[0].config
    if len(cs) == 1:
        return {"model": cs, "data_iterator": iter(inputs), "seq_length": seq_length, "micro_batch_size": micro_batch_size}
    if not getattr(unwrap(cs[0]), "supports_thd", False):
        raise ValueError("virtual pipeline stages run every micro-batch as a padded THD row: build the model with "
                         "attention='sdpa' (or Transformer Engine)")
    pp, tp, n = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(), len(inputs)
    cp = ps.get_context_parallel_world_size()
    if n < pp:
        raise ValueError(f"the interleaved pipeline (vpp={len(cs)}) needs at least pp={pp} micro-batches, got "
                         f"{n}: use smaller micro-batches (or more rows)")
    if cp > 1:  # every rank's share padded to the largest share (a dummy sequence): one shape, seq_length / cp each

        local = max(local_tokens(i, cp, tp if cfg.sequence_parallel else 1) for i in prepared)
        for i in prepared:
            i.pad_to = local
        cfg.microbatch_group_size_per_vp_stage = next(g for g in range(pp, n + 1) if n % g == 0 or n % g >= pp)
        return {"model": cs, "data_iterator": [iter(inputs) for _ in cs], "seq_length": local * cp, "micro_batch_size": 1}
    tokens = max(int(i.input_ids.shape[1]) if i.packed else int(i.real.sum()) for i in prepared)
    if cfg.sequence_parallel:
        tokens += (-tokens) % tp
    for i in prepared:
        i.pad_to = tokens
    # micro-batches run through a virtual stage in groups of g (megatron's default g = pp); the
    # schedule needs n % g == 0 or n % g >= pp: the smallest such g >= pp (the numbers do not depend on it)
    cfg.microbatch_group_size_per_vp_stage = next(g for g in range(pp, n + 1) if n % g == 0 or n % g >= pp)
    return {"model": cs, "data_iterator": [iter(inputs) for _ in cs], "seq_length": tokens, "micro_batch_size": 1}


def batch_to(mb: dict, device) -> dict:
    """The micro-batch dict with its tensors on ``device`` (what ``loss_fn`` receives)."""
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}


def padded_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> ModelInputs:
    """Inputs for a padded batch (left, right or both): positions restart at each first real token."""
    real = attention_mask.bool()  # [B, S]
    B, S = input_ids.shape
    pos = (real.long().cumsum(-1) - 1).clamp_min(0)  # [B, S]
    causal = torch.ones(S, S, dtype=torch.bool, device=input_ids.device).tril()  # [S, S] allowed
    eye = torch.eye(S, dtype=torch.bool, device=input_ids.device)
    # causal over real keys, plus the diagonal: a pad query always sees itself, so no row is fully masked
    # (a fully masked row is NaN under SDPA, and a NaN pad value would reach real rows as 0 * NaN)
    allowed = (causal[None] & real[:, None, :]) | eye[None]  # [B, S(q), S(k)]
    masked = ~allowed[:, None]  # [B, 1, S, S]
    next_valid = torch.zeros_like(real)
    next_valid[:, :-1] = real[:, :-1] & real[:, 1:]
    labels = torch.zeros_like(input_ids)
    labels[:, :-1] = input_ids[:, 1:]
    labels = torch.where(next_valid, labels, torch.zeros_like(labels))
    token_valid = torch.zeros_like(real)
    token_valid[:, 1:] = next_valid[:, :-1]
    return ModelInputs(input_ids, pos, masked, labels, next_valid, token_valid, real=real)


def packed_inputs(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, dense_mask: bool = False) -> ModelInputs:
    """Inputs for one packed row ``[T]`` or ``[1, T]`` holding sequences at ``cu_seqlens``.

    The ``[1, 1, T, T]`` block-diagonal mask is only built with ``dense_mask`` (the fallback for an
    attention without THD support); the THD path needs none.
    """
    ids = input_ids.reshape(1, -1)  # [1, T]
    T = ids.shape[1]
    cu = cu_seqlens.to(torch.long).cpu()
    if int(cu[0]) != 0 or int(cu[-1]) != T:
        raise ValueError(f"cu_seqlens {cu.tolist()} does not cover a row of {T} tokens")
    lens = cu[1:] - cu[:-1]  # [N]
    seg = torch.repeat_interleave(torch.arange(len(lens)), lens).to(ids.device)  # [T] sequence id
    starts = cu[:-1].to(ids.device)
    pos = (torch.arange(T, device=ids.device) - starts[seg])[None]  # [1, T] restarts per sequence
    masked = None
    if dense_mask:
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        allowed = causal & (seg[:, None] == seg[None, :])  # [T, T] block-diagonal causal
        masked = ~allowed[None, None]  # [1, 1, T, T]
    same_next = torch.zeros(1, T, dtype=torch.bool, device=ids.device)
    same_next[0, :-1] = seg[:-1] == seg[1:]
    labels = torch.zeros_like(ids)
    labels[:, :-1] = ids[:, 1:]
    labels = torch.where(same_next, labels, torch.zeros_like(labels))
    token_valid = torch.zeros_like(same_next)
    token_valid[:, 1:] = same_next[:, :-1]
    return ModelInputs(ids, pos, masked, labels, same_next, token_valid, packed=True, cu_seqlens=cu)


def model_inputs(mb: dict) -> ModelInputs:
    """Dispatch on the micro-batch format: ``cu_seqlens`` present = packed, else padded.
    ``routed_experts`` (``[*input_ids.shape, R, k]``, or ``[N, R, k]`` for a packed row): the experts to
    replay for each token (:mod:`megatron_bridge.routing_replay`)."""
    if "cu_seqlens" in mb:
        inp = packed_inputs(mb["input_ids"], mb["cu_seqlens"])
    else:
        mask = mb.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(mb["input_ids"], dtype=torch.bool)
        inp = padded_inputs(mb["input_ids"], mask)
    route = mb.get("routed_experts")
    if route is not None:
        n = inp.input_ids.numel()
        if route.numel() // (route.shape[-1] * route.shape[-2]) != n:
            raise ValueError(f"routed_experts {list(route.shape)} does not match input_ids {list(inp.input_ids.shape)}")
        inp.routing = route.reshape(n, *route.shape[-2:])
    return inp


def align_to_tokens(next_vals: torch.Tensor, inp: ModelInputs) -> torch.Tensor:
    """Move values computed at position t (about token t+1) to index t+1; zero the rest."""
    out = torch.zeros_like(next_vals)
    out[:, 1:] = next_vals[:, :-1]
    return torch.where(inp.token_valid, out, torch.zeros_like(out))


def pad_sequences(seqs: list[list[int]], *, side: str = "right", pad_id: int = 0, multiple: int = 1
                  ) -> dict[str, torch.Tensor]:
    """``{"input_ids" [B, S], "attention_mask" [B, S]}`` from token lists."""
    S = max(len(s) for s in seqs)
    S = ((S + multiple - 1) // multiple) * multiple
    ids = torch.full((len(seqs), S), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), S, dtype=torch.bool)
    for i, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(S - len(s), S)
        ids[i, sl] = torch.tensor(s, dtype=torch.long)
        mask[i, sl] = True
    return {"input_ids": ids, "attention_mask": mask}


def pack_sequences(seqs: list[list[int]], max_tokens: int) -> list[dict]:
    """Greedy in-order packing into rows of at most ``max_tokens`` tokens (longer sequences alone).

    Each row is ``{"input_ids": [1, T], "cu_seqlens": [n+1], "index": [n]}`` where ``index`` gives
    the position of each packed sequence in ``seqs``.
    """
    rows, cur, idx = [], [], []

    def flush():
        if cur:
            lens = torch.tensor([0] + [len(s) for s in cur])
            rows.append({"input_ids": torch.tensor([t for s in cur for t in s], dtype=torch.long)[None],
                         "cu_seqlens": lens.cumsum(0), "index": torch.tensor(idx)})
            cur.clear(), idx.clear()

    for i, s in enumerate(seqs):
        if cur and sum(len(c) for c in cur) + len(s) > max_tokens:
            flush()
        cur.append(list(s)), idx.append(i)
    flush()
    return rows


def unpack(x: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Split a packed ``[1, T]`` (or ``[T]``) per-token tensor into its sequences."""
    flat = x.reshape(-1)
    cu = cu_seqlens.tolist()
    return [flat[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]


# ---------------------------------------------------------------------------------------------------
# model-level: one forward step, shared with the train step


def _thd_params(inp: ModelInputs):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = inp.cu_seqlens.to(device=inp.input_ids.device, dtype=torch.int32)
    mx = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mx, max_seqlen_kv=mx)


def _sp_pad(n: int, model) -> int:
    """Tokens to append so the sequence splits evenly over TP ranks under sequence parallelism."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    return (-n) % tp if getattr(model, "sequence_parallel", False) and tp > 1 else 0


def _replay(model, inp: ModelInputs, rows: torch.Tensor) -> None:
    """Routing replay: the routers of ``model`` replay ``inp.routing`` for the tokens at ``rows`` (each
    model input position's row of the table, -1 for the bridge's padding); without a table they route
    freely (a model with replay installed must be told either way)."""

    routing_replay.set_targets(model, inp.routing, rows)


def _run_packed(model, m, ids: torch.Tensor, cu: torch.Tensor, pad_to: int = 0, inp: ModelInputs | None = None,
                rows: torch.Tensor | None = None):
    """A THD row through the model; under sequence parallelism the row is padded with one dummy
    sequence to a multiple of TP (megatron splits the sequence dim evenly), under virtual pipeline
    stages to ``pad_to`` tokens, and the logits cropped back. ``rows`` ``[1, T]``: each token's row in
    ``inp.routing`` (routing replay)."""
    T = ids.shape[1]
    pad = pad_to - T if pad_to else _sp_pad(T, m)
    if rows is None:
        rows = torch.arange(T)[None]
    if pad:
        ids = torch.cat([ids, ids.new_zeros(1, pad)], 1)
        cu = torch.cat([cu.to(torch.long), torch.tensor([T + pad])])
        rows = torch.cat([rows.cpu(), torch.full((1, pad), -1, dtype=torch.long)], 1)
    if inp is not None:
        _replay(model, inp, rows)
    row = ModelInputs(ids, None, None, None, None, None, packed=True, cu_seqlens=cu)
    out = model(ids, None, None, packed_seq_params=_thd_params(row))
    return out[:, :T] if pad and m.post_process else out


def _run_dense(model, m, inp: ModelInputs):
    """A padded batch with its dense mask; under sequence parallelism the sequence dim is padded to a
    multiple of TP with keys no real query can see (they come after it, and are masked besides)."""
    S, pad = inp.input_ids.shape[1], _sp_pad(inp.input_ids.shape[1], m)
    B = inp.input_ids.shape[0]
    rows = torch.arange(B * S).view(B, S)
    if not pad:
        _replay(model, inp, rows)
        return model(inp.input_ids, inp.position_ids, inp.attention_mask)
    _replay(model, inp, torch.cat([rows, torch.full((B, pad), -1, dtype=torch.long)], 1))
    Sp = S + pad
    ids = torch.cat([inp.input_ids, inp.input_ids.new_zeros(B, pad)], 1)
    pos = torch.cat([inp.position_ids, inp.position_ids.new_zeros(B, pad)], 1)
    mask = torch.ones(inp.attention_mask.shape[0], 1, Sp, Sp, dtype=torch.bool, device=ids.device)  # True = masked
    mask[:, :, :S, :S] = inp.attention_mask
    mask[:, :, torch.arange(S, Sp), torch.arange(S, Sp)] = False  # a pad query sees itself: no fully masked row
    out = model(ids, pos, mask)
    return out[:, :S] if m.post_process else out


def _run_context_parallel(model, m, inp: ModelInputs, cp: int):
    """The CP split of ``inp`` (built once per micro-batch, kept on it for :func:`head_outputs`) through
    the model: this rank's tokens with their global positions; attention gathers the rest."""
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams


    if not getattr(m, "supports_thd", False) or getattr(m, "uses_te", False):
        raise ValueError("context parallelism runs on the bridge's attention (build_model(attention='sdpa'))")
    if inp.cp is None:
        tp = ps.get_tensor_model_parallel_world_size()
        inp.cp = build_plan(inp, cp, ps.get_context_parallel_rank(), ps.get_context_parallel_group(),
                            multiple=tp if getattr(m, "sequence_parallel", False) else 1, pad_local_to=inp.pad_to)
    plan = inp.cp
    cu = plan.cu_local.to(device=plan.ids.device, dtype=torch.int32)
    mx = int((cu[1:] - cu[:-1]).max())
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mx, max_seqlen_kv=mx)
    psp._coxswain_cp = plan
    _replay(model, inp, plan.local_index[None].cpu())
    return model(plan.ids, plan.positions, None, packed_seq_params=psp)


def run_model(model, inp: ModelInputs):
    """One forward of a (possibly DDP-wrapped) bridge model chunk on prepared inputs.

    Packed rows: THD (``PackedSeqParams``) when the attention supports it, else a dense
    block-diagonal mask. Padded batches: the dense mask on the local spec; on the TE spec the batch
    is first unpadded into one packed row (TE's causal kernels ignore an arbitrary mask, so running
    it padded would let left pads leak) and the last stage's output is scattered back to ``[B, S]``.
    """
    from megatron.core import parallel_state as ps


    m = unwrap(model)
    cp = ps.get_context_parallel_world_size()
    if cp > 1:  # this rank's share of every sequence, as one THD row (megatron_bridge.context_parallel)
        return _run_context_parallel(model, m, inp, cp)
    if inp.packed and getattr(m, "supports_thd", False):
        # THD: [1, T] tokens, positions restart from cu_seqlens inside megatron's RoPE.
        return _run_packed(model, m, inp.input_ids, inp.cu_seqlens, inp.pad_to, inp=inp)
    if not getattr(m, "uses_te", False) and not inp.pad_to:
        if inp.packed:  # attention without THD: dense block-diagonal causal mask
            inp = replace(packed_inputs(inp.input_ids, inp.cu_seqlens, dense_mask=True), routing=inp.routing)
        return _run_dense(model, m, inp)
    real = inp.real  # [B, S]
    lens = real.sum(1)  # [B]
    cu = torch.zeros(len(lens) + 1, dtype=torch.long)
    cu[1:] = lens.cpu().cumsum(0)
    grid = torch.arange(real.numel()).view(real.shape)
    out = _run_packed(model, m, inp.input_ids[real][None], cu, inp.pad_to, inp=inp,
                      rows=grid[real.cpu()][None])  # [1, T] real tokens
    if not m.post_process:
        return out  # hidden [T, 1, H] for the next stage
    full = out.new_zeros(*real.shape, out.shape[-1])  # [B, S, V_local]
    full[real] = out[0]
    return full


def head_outputs(model, output: torch.Tensor, inp: ModelInputs, *, temperature: float = 1.0,
                 with_entropy: bool = False, entropy_grad: bool = True,
                 with_sum_pi_squared: bool = False) -> dict[str, torch.Tensor]:
    """Turn the last stage's output (vocab-parallel logits, or critic values) into per-token outputs
    (``with_sum_pi_squared``: also ``sum_pi_squared``, aligned like the entropy)."""
    from megatron.core import parallel_state as ps


    m = unwrap(model)
    plan = inp.cp
    if plan is not None:  # context parallelism: this rank's tokens; gathered into the caller's layout below

        whole = lambda x: gather_outputs(x, plan)  # noqa: E731
        labels = plan.labels[None]  # [1, Tl]
    else:
        whole = lambda x: x  # noqa: E731
        labels = inp.labels
    if m.is_critic:
        vals = output[..., 0].float()  # [B, S]
        return {"values": align_to_tokens(whole(vals), inp)}
    v_local = output.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * v_local
    lp, ent = vocab_parallel_logprobs(output, labels, vocab_start=start, vocab_size=m.true_vocab_size,
                                      temperature=temperature, group=ps.get_tensor_model_parallel_group(),
                                      with_entropy=with_entropy, entropy_grad=entropy_grad)
    out = {"logprobs": align_to_tokens(whole(lp), inp)}
    if ent is not None:
        out["entropy"] = align_to_tokens(whole(ent), inp)
    if with_sum_pi_squared:
        spp = vocab_parallel_sum_pi_squared(output, vocab_start=start, vocab_size=m.true_vocab_size,
                                            temperature=temperature, group=ps.get_tensor_model_parallel_group())
        out["sum_pi_squared"] = align_to_tokens(whole(spp), inp)
    return out


def _broadcast_from_last_stage(tensors: list[torch.Tensor | None], shapes: list[torch.Size], device
                               ) -> list[torch.Tensor]:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return [t.cpu() for t in tensors]
    src = ps.get_pipeline_model_parallel_last_rank()
    group = ps.get_pipeline_model_parallel_group()
    out = []
    for t, shape in zip(tensors, shapes):
        buf = t.contiguous() if t is not None else torch.empty(shape, dtype=torch.float32, device=device)
        dist.broadcast(buf, src=src, group=group)
        out.append(buf.cpu())
    return out


@torch.no_grad()
def compute_logprobs(model, micro_batches: list[dict], *, temperature: float = 1.0,
                     with_entropy: bool = False, with_sum_pi_squared: bool = False) -> list[dict[str, torch.Tensor]]:
    """Forward-only pass over micro-batches through megatron's pipeline schedule.

    Returns, on every rank of the model-parallel group, one dict per micro-batch with CPU tensors
    ``logprobs`` (and ``entropy``, ``sum_pi_squared``) — or ``values`` for a critic — shaped like its ``input_ids``
    (``[B, S]`` padded, ``[1, T]`` packed), aligned as described in the module docstring.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func


    cpu_shims.install()  # this thread may not be the one that built the model (threaded Ray actors)
    cs = chunks(model)
    m = unwrap(cs[0])
    was_training = cs[0].training
    for c in cs:
        c.eval()
    device = model_device(model)
    inputs = [model_inputs(mb).to(device) for mb in micro_batches]

    def step(data_iterator, mdl):
        inp = next(data_iterator)
        out = run_model(mdl, inp)

        def loss_func(output):
            res = head_outputs(mdl, output, inp, temperature=temperature, with_entropy=with_entropy,
                               with_sum_pi_squared=with_sum_pi_squared)
            return torch.zeros((), dtype=torch.float32), res

        return out, loss_func

    S = max(i.input_ids.shape[1] for i in inputs)
    B = max(i.input_ids.shape[0] for i in inputs)
    res = get_forward_backward_func()(
        forward_step_func=step, **schedule_args(model, inputs, inputs, seq_length=S, micro_batch_size=B),
        num_microbatches=len(inputs), forward_only=True)
    if was_training:
        for c in cs:
            c.train()
    keys = ["values"] if m.is_critic else (["logprobs"] + (["entropy"] if with_entropy else [])
                                           + (["sum_pi_squared"] if with_sum_pi_squared else []))
    out = []
    for i, inp in enumerate(inputs):
        shape = inp.input_ids.shape
        vals = _broadcast_from_last_stage([res[i][k] if res else None for k in keys], [shape] * len(keys), device)
        out.append(dict(zip(keys, vals)))
    return out


# ---------------------------------------------------------------------------------------------------
# CLI


def _cli_rank(model_dir: str, tp: int, pp: int, records: list[dict], temperature: float,
              max_tokens: int, pp_layers, sp: bool = False, vpp: int = 1, cp: int = 1, ep: int = 1,
              etp: int | None = None):

    set_parallel(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp)
    hf = read_hf_config(model_dir)
    model = build_model(hf, pp_layers=pp_layers, sequence_parallel=sp)
    load_hf_weights(model, model_dir)
    seqs = [list(r["prompt_ids"]) + list(r["response_ids"]) for r in records]
    rows = pack_sequences(seqs, max_tokens)
    if vpp > 1 and len(rows) < pp:  # the interleaved schedule needs >= pp micro-batches: one row per sequence
        rows = pack_sequences(seqs, 1)
    outs = compute_logprobs(model, [{k: v for k, v in r.items() if k != "index"} for r in rows],
                            temperature=temperature)
    if dist.get_rank() != 0:
        return None
    per_seq: list[list[float] | None] = [None] * len(seqs)
    for row, o in zip(rows, outs):
        for j, lp in zip(row["index"].tolist(), unpack(o["logprobs"], row["cu_seqlens"])):
            p = len(records[j]["prompt_ids"])
            per_seq[j] = lp[p:].tolist()
    return per_seq


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_bridge.logprobs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory (config.json + *.safetensors)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    ap.add_argument("--vpp", type=int, default=1, help="virtual pipeline stages per pipeline rank (interleaved; needs --pp > 1)")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism within TP (megatron's; needs --tp > 1)")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel size: each sequence split over this many ranks")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (mixture-of-experts models)")
    ap.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    ap.add_argument("--pp-layers", default=None, help="comma-separated layers per stage (uneven split)")
    ap.add_argument("--input", required=True, help="jsonl with prompt_ids and response_ids per line")
    ap.add_argument("--out", required=True, help="output jsonl: each input line plus 'logprobs'")
    ap.add_argument("--temperature", type=float, default=1.0, help="logits are divided by this first")
    ap.add_argument("--max-tokens", type=int, default=4096, help="tokens per packed row")
    a = ap.parse_args(argv)
    with open(a.input, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    for i, r in enumerate(records):
        if not r.get("prompt_ids") or "response_ids" not in r:
            raise SystemExit(f"line {i + 1}: needs non-empty 'prompt_ids' and 'response_ids'")
    pp_layers = [int(x) for x in a.pp_layers.split(",")] if a.pp_layers else None

    if a.sp and a.tp < 2:
        raise SystemExit("--sp splits the sequence over tensor-parallel ranks: give --tp 2 or more")
    if a.vpp > 1 and a.pp < 2:
        raise SystemExit("--vpp interleaves a pipeline: give --pp 2 or more")
    if a.vpp > 1 and a.cp > 1:
        raise SystemExit("--vpp with --cp is not built yet: use one of them")
    # ranks: TP x CP x PP, times the data-parallel copies expert parallelism needs (EP x ETP ranks per stage)
    inner, need = a.tp * a.cp, a.ep * (a.etp or a.tp)
    world = inner * a.pp * (need // math.gcd(need, inner))
    res = spawn(_cli_rank, world, a.model, a.tp, a.pp, records, a.temperature, a.max_tokens, pp_layers,
                a.sp, a.vpp, a.cp, a.ep, a.etp)
    per_seq = res[0]
    with open(a.out, "w", encoding="utf-8") as f:
        for r, lp in zip(records, per_seq):
            f.write(json.dumps({**r, "logprobs": lp}) + "\n")
    print(f"wrote {len(records)} lines to {a.out} (tp={a.tp}, pp={a.pp}, vpp={a.vpp}, cp={a.cp}, ep={a.ep}, sp={a.sp}, temperature={a.temperature})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
