"""Single-turn rollout: prompts in, a typed batch of ``n`` sampled responses per prompt out.

Each prompt is repeated ``n`` times under one group id (the GRPO group). Prompts are left-padded and
responses right-padded to the batch's OWN widths (its longest prompt and response); the config's
``max_prompt_length`` / ``max_response_length`` are caps, not widths, so no pass downstream carries
columns that no row uses. The sampler's per-token log-probs go into ``rollout_log_probs`` (0 on
padding); the loss mask covers exactly the sampled tokens, the stop token included.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from trainer.batch import RolloutBatch
from trainer.rollout.engine import GenerationOutput


def pad_left(seqs: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, width]`` ids and mask, real tokens at the right end."""
    # filled row by row in numpy: a per-row torch assignment pays torch's per-op overhead on every row
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=bool)
    for i, s in enumerate(seqs):
        if len(s) > width:
            raise ValueError(f"prompt {i} has {len(s)} tokens, more than the prompt width {width} "
                             f"(raise data.max_prompt_length or filter overlong prompts)")
        if len(s):
            ids[i, width - len(s):] = s
            mask[i, width - len(s):] = True
    return torch.from_numpy(ids), torch.from_numpy(mask)


def pad_right(seqs: Sequence[Sequence], width: int, pad, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, width]`` values and mask, real entries at the left end."""
    out = np.full((len(seqs), width), pad, dtype=torch.empty((), dtype=dtype).numpy().dtype)
    mask = np.zeros((len(seqs), width), dtype=bool)
    for i, s in enumerate(seqs):
        n = min(len(s), width)
        if n:
            out[i, :n] = s[:n]
            mask[i, :n] = True
    return torch.from_numpy(out), torch.from_numpy(mask)


def outputs_to_batch(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[GenerationOutput]],
                     group_ids: Sequence[int], *, max_prompt_length: int, max_response_length: int,
                     pad_id: int, meta: dict[str, Sequence] | None = None) -> RolloutBatch:
    """Flatten ``outputs[i][j]`` (response j of prompt i) into a batch of ``sum_i len(outputs[i])`` rows."""
    flat_prompts, flat_resp, flat_lp, flat_gid, finish, rows_meta = [], [], [], [], [], {k: [] for k in (meta or {})}
    for i, outs in enumerate(outputs):
        for o in outs:
            flat_prompts.append(prompts[i])
            flat_resp.append(o.token_ids)
            flat_lp.append(o.logprobs)
            flat_gid.append(group_ids[i])
            finish.append(o.finish_reason)
            for k in rows_meta:
                rows_meta[k].append(meta[k][i])
    P = max((len(p) for p in flat_prompts), default=1)
    if P > max_prompt_length:
        i = next(i for i, p in enumerate(flat_prompts) if len(p) > max_prompt_length)
        raise ValueError(f"prompt {i} has {len(flat_prompts[i])} tokens, more than data.max_prompt_length="
                         f"{max_prompt_length} (raise it or filter overlong prompts)")
    T = min(max(1, max((len(r) for r in flat_resp), default=1)), max_response_length)
    p_ids, p_mask = pad_left(flat_prompts, P, pad_id)
    r_ids, r_mask = pad_right(flat_resp, T, pad_id, torch.long)
    lps, _ = pad_right(flat_lp, T, 0.0, torch.float32)
    rows_meta["finish_reason"] = finish
    routed = [o.routed_experts for outs in outputs for o in outs]
    extra = {"routed_experts": routes_grid(routed, [len(p) for p in flat_prompts], P, T)} \
        if any(r is not None for r in routed) else {}
    return RolloutBatch.from_tokens(
        p_ids, r_ids, p_mask, r_mask, meta=rows_meta,
        rollout_log_probs=lps, group_ids=torch.as_tensor(flat_gid, dtype=torch.long), **extra)


def routes_grid(routes: Sequence[torch.Tensor | None], prompt_lens: Sequence[int], P: int, T: int) -> torch.Tensor:
    """Each row's engine routing ``[n_in, R, k]`` (its prompt, then its response's input tokens) placed on
    the batch's ``[B, P+T, R, k]`` grid: prompt tokens end at column P (left padding), response tokens
    start there; -1 wherever the engine routed nothing (pads, the last response token)."""
    shape = next(r for r in routes if r is not None).shape[1:]
    out = torch.full((len(routes), P + T, *shape), -1, dtype=torch.int16)
    for i, (r, n) in enumerate(zip(routes, prompt_lens)):
        if r is None:
            raise ValueError(f"row {i} came back without routed experts while others have them")
        m = min(r.shape[0], n + T)
        out[i, P - n: P - n + m] = r[:m]
    return out
