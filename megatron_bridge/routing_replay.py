"""Routing replay for mixture-of-experts layers: score each token through the experts the sampler used.

A MoE layer sends token ``x`` to the experts ``E_k(x) = top-k(s(x))`` of its router scores
``s(x) = W_r x`` and mixes ``y = sum_{e in E_k} g_e(x) f_e(x)``, with ``g`` the softmax of the scores
restricted to ``E_k`` (Qwen3-MoE: renormalised over the k) or the full softmax's entries (Qwen2-MoE).
The selection is discrete: a rollout engine in bf16 and a trainer in fp32 compute ``s`` to different
roundings, and where two experts nearly tie they pick different sets; the token's log-prob then differs
by far more than rounding, and the importance ratio with it.

Rollout routing replay (R3; Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning
Training and Inference Routers", arXiv:2510.11370) records ``E_k`` per token and layer in the engine
(:class:`trainer.rollout.engine.GenerationOutput` ``routed_experts``) and, in every trainer forward of
those tokens (old / reference log-probs, the update), uses the recorded set instead of the trainer's
top-k. Only the set is replayed: ``g`` is still computed from the live router's scores, so the router
gets its gradient. A token with no record (padding, a response's last token, which the engine never
fed back) keeps the router's own choice.

megatron-core calls ``router.router_replay.get_replay_topk(scores, k, ..., default_compute_topk)`` in
place of its top-k when a router holds a replay object (``megatron.core.transformer.moe.router_replay``).
Its own class keeps every router in one process-wide list and needs the caller to switch between
forward and backward replay; :class:`TokenReplay` is the same contract per router: it holds this
micro-batch's targets, and when the layer is recomputed in the backward pass (activation recompute)
it replays the targets of that micro-batch, saved in forward order (pipeline schedules run backwards
in the order of their forwards).

Token order. The router sees the chunk's hidden states ``[s, b, h]`` flattened sequence-major, under
sequence parallelism only this TP rank's contiguous ``s / tp`` slice; :func:`set_targets` takes, for
the ``[b, s]`` token ids the model was given, each token's row in the micro-batch's routing table (or
-1), and lays the table out in that order.
"""

from __future__ import annotations

from collections import deque

import torch

from megatron_bridge.model import chunks, unwrap


class TokenReplay:
    """One router's replay (megatron's ``RouterReplay.get_replay_topk`` contract)."""

    def __init__(self):
        self.target: torch.Tensor | None = None  # [tokens, k] long, this micro-batch; -1 rows: own choice
        self.keep = False  # the forward may be recomputed in backward: save its targets
        self.saved: deque = deque()

    def set(self, target: torch.Tensor | None, keep: bool) -> None:
        self.target, self.keep = target, keep

    def clear(self) -> None:
        self.target, self.keep = None, False
        self.saved.clear()

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        own_v, own_i = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if torch._C._current_graph_task_id() != -1 and self.saved:  # recompute inside the backward pass
            target = self.saved.popleft()
        else:
            target = self.target
            if target is not None and self.keep and not torch.is_grad_enabled():
                self.saved.append(target)  # a checkpointed forward (no graph now): its recompute replays this
        if target is None:
            return own_v, own_i
        if target.shape[0] != scores.shape[0]:
            raise RuntimeError(f"routing replay: {target.shape[0]} replayed tokens for a router that sees "
                               f"{scores.shape[0]}")
        t = target.to(scores.device)
        idx = torch.where((t >= 0).all(-1, keepdim=True), t, own_i)
        return scores.gather(1, idx), idx


def routers(chunk) -> list[tuple[int, torch.nn.Module]]:
    """``(global layer index, router)`` of every MoE layer of a (possibly wrapped) model chunk."""

    m = unwrap(chunk)
    return [(layer.layer_number - 1, layer.mlp.router) for layer in m.decoder.layers if hasattr(layer.mlp, "router")]


def install(model) -> int:
    """Give every router of every chunk of ``model`` a :class:`TokenReplay`; returns how many."""

    n = 0
    for c in chunks(model):
        for _, r in routers(c):
            r.router_replay = TokenReplay()
            n += 1
    return n


def installed(chunk) -> bool:
    return any(isinstance(r.router_replay, TokenReplay) for _, r in routers(chunk))


def clear(model) -> None:

    for c in chunks(model):
        for _, r in routers(c):
            if isinstance(r.router_replay, TokenReplay):
                r.router_replay.clear()


def set_targets(chunk, table: torch.Tensor | None, rows: torch.Tensor) -> None:
    """Point the chunk's routers at this forward's tokens.

    ``table``: ``[N, R, k]`` the micro-batch's recorded experts (row i: token i of its input ids,
    flattened; -1 where none), or None to route freely. ``rows``: ``[b, s]``, for each token id the
    model is given, its row in ``table`` or -1 (padding the bridge added)."""
    from megatron.core import parallel_state as ps


    rs = routers(chunk)
    if not rs:
        return
    if table is not None and not installed(chunk):
        raise RuntimeError("the micro-batch carries routed experts but the model has no routing replay "
                           "installed (megatron_bridge.routing_replay.install)")
    keep = torch.is_grad_enabled()  # a training forward: its checkpointed layers are recomputed in backward
    if table is None:
        for _, r in rs:
            if isinstance(r.router_replay, TokenReplay):
                r.router_replay.set(None, False)
        return
    order = rows.t().reshape(-1)  # the router's token order: sequence-major
    m = unwrap(chunk)
    tp = ps.get_tensor_model_parallel_world_size()
    if getattr(m, "sequence_parallel", False) and tp > 1:
        order = order.chunk(tp)[ps.get_tensor_model_parallel_rank()]
    order = order.to(table.device)
    has = order >= 0
    k = table.shape[-1]
    for li, r in rs:
        if li >= table.shape[1]:
            raise ValueError(f"routing replay: layer {li} has a router, the table only {table.shape[1]} layers")
        t = torch.full((order.numel(), k), -1, dtype=torch.long, device=table.device)
        t[has] = table[order[has], li].long()
        r.router_replay.set(t, keep)
