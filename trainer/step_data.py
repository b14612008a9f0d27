"""One step's batch for the data-parallel ranks (``StepData``): each rank gets its shard once, by object
reference; the results come back per shard (``Sharded``).

Shape of the flow (slime's per-DP ``ray.put``, verl's TransferQueue idea, at the scale of one step):

* The driver builds the step's batch (it scores the rollouts, so it holds them) and, per DP size in
  use, splits it ONCE into length-balanced shards (``RolloutBatch.balanced_split``, Karmarkar-Karp
  on tokens). Each shard is trimmed to its own width (its longest prompt and response) and put into
  the object store once: ``StepData.shards(dp)``. Only the model inputs travel (prompt and response
  ids, attention and loss masks; ``input_ids``/``position_ids`` are rebuilt on the rank) plus the
  sampler's log-probs when a rank needs them.
* Every phase that reads the step's tokens (old log-probs, reference log-probs, values, updates)
  sends the same shard references; a rank's results come back per shard at the shard's width.
* What the driver does not compute on stays in the object store: a ``Sharded`` is one reference per
  shard to a ``{field: ndarray [b_d, T_d]}`` dict, passed as is to the next call that needs it (the
  old log-probs to the actor's update when no rollout IS needs them on the driver, the reference
  log-probs to the actor's KL loss). ``Sharded.fetch()`` brings one to the driver, in batch order
  and at batch width, only where the driver computes on it.
* What the driver computes (advantages, returns, IS weights, a rejection-masked loss mask) goes
  out the same way: ``StepData.scatter(dp, fields)`` puts one ``{field: ndarray}`` per shard.

The transport that moves the shards (Ray's object store, or the identity in-process) is passed in:
:class:`trainer.workers.dataplane.Transport`. This module sits beside :mod:`trainer.batch` and
holds no Ray, so the step (:mod:`trainer.step`) builds its ``StepData`` from a lower floor.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from trainer.batch import RolloutBatch, inverse_permutation, karmarkar_karp

# what a rank needs to run the model over its shard (ids as int32, masks as bool); input_ids /
# position_ids are rebuilt there
MODEL_FIELDS = ("prompts", "responses", "attention_mask", "response_mask")


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.contiguous().numpy()


class Partition:
    """The step's batch over ``dp`` ranks: ``index_lists[d]`` (rows of the batch on rank d, in shard
    order) and ``widths[d]`` (the shard's response width, ``T_d <= T``). ``balanced`` (verl's
    ``trainer.balance_batch``): shards of equal size whose token sums are balanced (Karmarkar-Karp);
    otherwise contiguous chunks of the batch in the sampler's order (the first ``B mod dp`` one row longer)."""

    def __init__(self, batch: RolloutBatch, dp: int, balanced: bool = True):
        self.dp, self.B, self.T = dp, batch.num_samples, batch.response_width
        self.tokens = batch.num_tokens.tolist()  # [B] prompt + response tokens of each row
        # the partitioner alone (``balanced_split`` would also copy every field of every part)
        self.index_lists = (karmarkar_karp(self.tokens, dp, equal_size=True) if balanced
                            else [c.tolist() for c in np.array_split(np.arange(self.B), dp)])
        self.rows = [torch.tensor(ix, dtype=torch.long) for ix in self.index_lists]
        lengths = batch.response_length  # [B]
        self.widths = [max(1, int(lengths[r].max())) if len(r) else 1 for r in self.rows]
        self._inv = inverse_permutation(self.index_lists)

    def seqlen_metrics(self) -> dict[str, float]:
        """verl's ``global_seqlen/*`` (``log_seqlen_unbalance``): the token sums of the batch's contiguous
        chunks of ``B // dp`` rows (``min``, ``max``, ``minmax_diff``, ``mean`` over the ranks) and of the
        shards as sent (``balanced_min``, ``balanced_max``)."""
        size = max(1, self.B // self.dp)
        chunks = [sum(self.tokens[o:o + size]) for o in range(0, self.B, size)]
        shards = [sum(self.tokens[i] for i in ix) for ix in self.index_lists]
        return {"global_seqlen/min": float(min(chunks)), "global_seqlen/max": float(max(chunks)),
                "global_seqlen/minmax_diff": float(max(chunks) - min(chunks)),
                "global_seqlen/balanced_min": float(min(shards)), "global_seqlen/balanced_max": float(max(shards)),
                "global_seqlen/mean": float(sum(chunks)) / self.dp}

    def scatter(self, x: torch.Tensor) -> list[np.ndarray]:
        """``[B, T]`` (or ``[B]``) -> per shard ``[b_d, T_d]`` (``[b_d]``) numpy, in shard row order."""
        return [_np(x[r, : w] if x.dim() == 2 else x[r]) for r, w in zip(self.rows, self.widths)]

    def gather(self, parts: Sequence[np.ndarray]) -> torch.Tensor:
        """Per shard ``[b_d, T_d]`` -> ``[B, T]`` in batch order, zeros beyond each shard's width."""
        full = [torch.nn.functional.pad(torch.from_numpy(np.array(p)), (0, self.T - p.shape[1])) if p.ndim == 2
                else torch.from_numpy(np.array(p)) for p in parts]
        return torch.cat(full, 0)[self._inv]

    def rows_of(self, local: Sequence[torch.Tensor]) -> list[int]:
        """Batch rows of per-shard local row indices (for mini-batches)."""
        return [int(i) for r, ix in zip(self.rows, local) for i in r[ix]]


class Sharded:
    """Per-token results that live in the object store: one reference per shard of ``partition``,
    each to a ``{field: ndarray [b_d, T_d]}`` dict (or None where a rank had nothing to return)."""

    def __init__(self, partition: Partition, refs: list, transport):
        self.partition, self.refs, self.transport = partition, list(refs), transport

    def fetch(self) -> dict[str, torch.Tensor]:
        """Into the driver, ``{field: [B, T]}`` in batch order."""
        parts = self.transport.get(self.refs)
        return {k: self.partition.gather([p[k] for p in parts]) for k in parts[0]}

    def refs_for(self, step: "StepData", dp: int) -> list:
        """References for a group with ``dp`` ranks: these, or (another DP size, hence another
        partition) re-sharded through the driver, the one case where a result must pass through it."""
        if step.partition(dp).index_lists == self.partition.index_lists:
            return self.refs
        return step.scatter(dp, self.fetch())


class StepData:
    """One step's batch, sharded once per DP size and put once; see the module docstring."""

    def __init__(self, batch: RolloutBatch, transport, *, with_rollout_log_probs: bool = False,
                 with_routed_experts: bool = False, balanced: bool = True):
        self.batch, self.transport, self.balanced = batch, transport, balanced
        self.fields = MODEL_FIELDS + (("rollout_log_probs",) if with_rollout_log_probs else ()) \
            + (("routed_experts",) if with_routed_experts else ())
        if with_routed_experts and batch.routed_experts is None:
            raise ValueError("routing replay is on but the rollout returned no routed experts (MoE model? the "
                             "engine must record them: actor_rollout_ref.rollout.enable_rollout_routing_replay)")
        self._parts: dict[int, Partition] = {}
        self._refs: dict[int, list] = {}

    def partition(self, dp: int) -> Partition:
        if dp not in self._parts:
            self._parts[dp] = Partition(self.batch, dp, self.balanced)
        return self._parts[dp]

    def shards(self, dp: int) -> list:
        """One object reference per DP rank to its shard's model inputs (made once per step)."""
        if dp not in self._refs:
            part = self.partition(dp)
            refs = []
            P = self.batch.prompt_width
            for r, w in zip(part.rows, part.widths):
                am = self.batch.attention_mask.index_select(0, r)  # [b, L]
                lead = int((~am[:, :P].bool()).all(0).int().cumprod(0).sum())  # all-pad prompt columns
                shard = {"attention_mask": _np(torch.cat([am[:, lead:P], am[:, P:P + w]], 1).bool())}
                for f in self.fields:  # only these fields, only the shard's columns, copied once
                    if f == "attention_mask":
                        continue
                    t = getattr(self.batch, f)
                    cols = {"prompts": slice(lead, None), "routed_experts": slice(lead, P + w)}.get(f, slice(0, w))
                    t = t[:, cols].index_select(0, r)
                    if t.dtype == torch.int64 and f in ("prompts", "responses"):
                        t = t.to(torch.int32)  # token ids fit in 31 bits: half the bytes; int64 again on the rank
                    shard[f] = _np(t)
                refs.append(self.transport.put(shard))
            self._refs[dp] = refs
        return self._refs[dp]

    def scatter(self, dp: int, fields: dict[str, torch.Tensor]) -> list:
        """Driver-computed per-token fields, one reference per shard of ``dp``."""
        part = self.partition(dp)
        per = {k: part.scatter(v) for k, v in fields.items() if v is not None}
        return [self.transport.put({k: v[d] for k, v in per.items()}) for d in range(dp)]
