"""Typed role groups: the actor, reference and critic as the loop sees them.

Each group owns its ranks (a :class:`~trainer.workers.group.WorkerGroup`) and its mesh: the DP
size, which rank answers for each DP shard, the split of a step's batch into shards (by reference,
:mod:`trainer.workers.dataplane`) and the gather of what comes back. The loop calls hand-written
methods (``actor.log_probs(step, ...)``, ``critic.update(step, plan.critic_update, ...)``) and never
sees a layout, a method name or a shard.

Behind every group is the same strategy-neutral worker
(:class:`~trainer.workers.train_worker.TrainWorker`: ``layout``, ``log_probs``, ``values``,
``update_actor``/``update_critic``, ``save``/``load``/``export_hf``, the weight stream and the RNG
state) holding a training strategy (:mod:`trainer.strategies`: megatron-core, DeepSpeed, ...); a new
strategy changes neither the groups nor the loop.

Updates. A step's batch is split over the DP ranks once, length-balanced; an update's mini-batch k
is, on every rank, the k-th slice of that rank's shard (reshuffled per epoch when
``shuffle``), as in verl. The driver knows every row's loss mask, so it sends each mini-batch's
GLOBAL token and sequence counts with it: each rank normalises its share by the whole mini-batch
and the summed gradient is that of the full mini-batch (``trainer.algos.losses.LossAgg``).

Metrics of an update come from every DP rank: each returns per mini-batch the partial sums of its
micro-batches (token-weighted means, loss shares, extremes), and the group combines them into the
mini-batch's values over the whole batch (:mod:`trainer.workers.metrics`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from trainer.algos.losses import batch_norm_counts
from trainer.plan import ForwardSettings, RolloutIS, UpdateSettings, is_on_policy
from trainer.workers.dataplane import Partition, Sharded, StepData, Transport
from trainer.workers.group import WorkerGroup
from trainer.workers.metrics import reduce_partials


def plan_mini_batches(part: Partition, response_mask: torch.Tensor, settings: UpdateSettings, *, seed: int,
                      agg_mode: str) -> tuple[list[list[list[int]]], list[tuple[float, float]]]:
    """Per rank, the local rows of every mini-batch (epochs flattened), and each mini-batch's
    global (tokens, sequences) counts. A mini-batch of ``m`` responses takes ``m / dp`` rows of
    each rank's shard."""
    dp, B = part.dp, part.B
    mbs = min(settings.mini_batch_size, B)
    if mbs % dp:
        raise ValueError(f"a mini-batch of {mbs} responses does not split over {dp} data-parallel ranks: make "
                         f"ppo_mini_batch_size * rollout.n a multiple of the DP size")
    per_rank = mbs // dp
    g = torch.Generator().manual_seed(seed)
    local: list[list[list[int]]] = [[] for _ in range(dp)]
    counts = []
    for _ in range(settings.epochs):
        orders = [torch.randperm(len(r), generator=g) if settings.shuffle else torch.arange(len(r)) for r in part.rows]
        for s in range(0, max(len(r) for r in part.rows), per_rank):
            sel = [o[s:s + per_rank] for o in orders]
            rows = part.rows_of(sel)
            n_tok, n_seq = batch_norm_counts(response_mask[rows], agg_mode)
            counts.append((float(n_tok), float(n_seq)))
            for d in range(dp):
                local[d].append(sel[d].tolist())
    return local, counts


class RoleGroup:
    """A model role's ranks and mesh."""

    shares_actor = False  # True: the actor's ranks answer for this role (no processes of its own)

    def __init__(self, group: WorkerGroup, transport: Transport):
        self.group, self.transport = group, transport
        self.layouts = group.call("layout")
        self.dp = self.layouts[0]["dp_size"]
        # one rank answers for each DP shard: the first of its model-parallel peers
        self.source = [next(i for i, l in enumerate(self.layouts) if l["dp_rank"] == d) for d in range(self.dp)]

    @property
    def size(self) -> int:
        return self.group.size

    def _args(self, per_dp: Sequence[tuple]) -> list[tuple]:
        """Per-rank argument tuples from per-DP-shard ones: model-parallel peers share their shard."""
        return [per_dp[l["dp_rank"]] for l in self.layouts]

    def _sharded(self, step: StepData, refs: list) -> Sharded:
        return Sharded(step.partition(self.dp), [refs[i] for i in self.source], self.transport)

    def _metrics(self, results: list) -> tuple[dict[str, float], list[dict[str, float]]]:
        """The update's metrics over ALL data-parallel ranks: per DP rank, the partials of the rank
        that ran the loss (tensor rank 0 of the last pipeline stage), combined by
        :func:`~trainer.workers.metrics.reduce_partials`. Returns (step metrics, per mini-batch)."""
        by_dp = {}
        for l, res in zip(self.layouts, results):
            if l["tp_rank"] == 0 and l["pp_rank"] == l["pp_size"] - 1:
                by_dp.setdefault(l["dp_rank"], res["metrics"])
        return reduce_partials([by_dp[d] for d in range(self.dp)], self.dp)

    def _update_call(self, method: str, step: StepData, settings: UpdateSettings, extras, *, seed: int,
                     agg_mode: str, **kwargs) -> tuple[list, tuple[dict, list[dict]]]:
        part = step.partition(self.dp)
        local, counts = plan_mini_batches(part, step.batch.response_mask, settings, seed=seed, agg_mode=agg_mode)
        shards = step.shards(self.dp)
        extra_refs = [e.refs_for(step, self.dp) if isinstance(e, Sharded) else e for e in extras if e is not None]
        per_dp = [(shards[d], local[d], *(e[d] for e in extra_refs)) for d in range(self.dp)]
        res = self.group.call(method, self._args(per_dp), settings=settings, counts=counts, **kwargs)
        return res, self._metrics(res)

    # ------------------------------------------------------------------ checkpoints, RNG
    def save(self, ckpt_dir: str) -> None:
        self.group.call("save", [(ckpt_dir,)] * self.size)

    def load(self, ckpt_dir: str) -> None:
        self.group.call("load", [(ckpt_dir,)] * self.size)

    def rng_state(self) -> list:
        return self.group.call("rng_state")

    def set_rng_state(self, states: list) -> None:
        self.group.call("set_rng_state", [(s,) for s in states])

    def pids(self) -> list[int]:
        return self.group.call("ping")

    def shutdown(self) -> None:
        self.group.shutdown()


class RefGroup(RoleGroup):
    on_actor: dict = {}  # the worker's log_probs keywords that select the reference on an actor's ranks

    def log_probs(self, step: StepData, settings: ForwardSettings) -> Sharded:
        """The reference policy's ``ref_log_probs``, left in the object store."""
        refs = self.group.async_call("log_probs", self._args([(r,) for r in step.shards(self.dp)]), num_returns=2,
                                     settings=settings, key="ref_log_probs", **self.on_actor)
        self.group.get([r[1] for r in refs])  # wait (and surface a dead worker here, not at the consumer)
        return self._sharded(step, [r[0] for r in refs])


class ActorReference(RefGroup):
    """The reference policy computed by the actor's own ranks (``Strategy.reference_policy``: with LoRA, the
    actor with its adapters off, as verl does): no ranks of its own, so the cluster neither starts, seeds nor
    stops any, and the step runs its pass after the actor's (not beside it: the same processes)."""

    shares_actor = True
    on_actor = {"reference": True}

    def shutdown(self) -> None:  # the actor group owns the processes
        pass


class ActorGroup(RoleGroup):
    def log_probs_with_entropy(self, step: StepData, settings: ForwardSettings) -> tuple[Sharded, dict[str, float]]:
        """The ``old_log_probs`` (left in the object store; with ``settings.with_sum_pi_squared`` each
        shard's dict also holds ``sum_pi_squared``, from the same forward) and the rollout entropy's sum
        and count."""
        refs = self.group.async_call("log_probs", self._args([(r,) for r in step.shards(self.dp)]), num_returns=2,
                                     settings=settings, entropy=True, key="old_log_probs")
        summaries = self.group.get([refs[i][1] for i in self.source])
        return self._sharded(step, [r[0] for r in refs]), _sum_summaries(summaries)

    def update(self, step: StepData, settings: UpdateSettings, extras: Sequence, *, seed: int,
               on_policy: bool = False, rollout_is: Optional[RolloutIS] = None, per_mini_batch: bool = False,
               bypass: Optional[dict] = None):
        """``settings.epochs`` x mini-batches, one optimizer step each; ``extras``: the per-token
        fields the loss reads (``Sharded`` results, or ``StepData.scatter`` references). Returns
        the step's metrics over all DP ranks (``per_mini_batch``: one dict per mini-batch); on-policy
        ``(metrics, {"old_log_probs": [B, T]} or None, entropy summary)``: the old log-probs of the
        update's own forward come back only when rollout IS needs them on the driver. ``bypass``: verl's
        bypass mode (``{"loss": ppo_clip | reinforce, "rollout_is": RolloutIS | None, "rejection": ...}``),
        the IS weights and rejection computed in the loss from the current log-probs."""
        if on_policy and not is_on_policy(num_samples=step.batch.num_samples, mini_batch_size=settings.mini_batch_size,
                                          epochs=settings.epochs):
            raise ValueError(f"on_policy=True needs one epoch and one mini-batch ({settings.epochs} epochs, "
                             f"{step.batch.num_samples} samples, mini-batches of {settings.mini_batch_size})")
        want_lp = on_policy and rollout_is is not None
        res, (step_m, rows) = self._update_call("update_actor", step, settings, extras, seed=seed,
                                                agg_mode=settings.policy.agg_mode, on_policy=on_policy,
                                                rollout_is=rollout_is, return_log_probs=want_lp, bypass=bypass)
        metrics = rows if per_mini_batch else step_m
        if not on_policy:
            return metrics
        by_dp: dict[int, dict] = {}
        for l, r in zip(self.layouts, res):  # any rank of the last pipeline stage of each DP rank
            if r["entropy"] is not None or r["log_probs"] is not None:
                by_dp.setdefault(l["dp_rank"], r)
        ent = _sum_summaries([by_dp[d]["entropy"] for d in range(self.dp)]) if by_dp[0]["entropy"] else {}
        old = None
        if want_lp:
            part = step.partition(self.dp)
            parts = [by_dp[d]["log_probs"]["old_log_probs"] for d in range(self.dp)]
            old = {"old_log_probs": part.gather(parts)}
            self.transport.bytes_in += sum(p.nbytes for p in parts)
        return metrics, old, ent

    # ------------------------------------------------------------------ weights
    def weight_streams(self, bucket_bytes: int, digest_dtype: Optional[str]) -> list:
        """Every rank's HF-named weight stream (collective): rank 0 yields each bucket as an object
        reference, the others None. With ``digest_dtype`` rank 0 hashes what it streamed."""
        return self.group.streams("weight_buckets", bucket_bytes, digest_dtype)

    def stream_get(self, item):
        return self.group.stream_get(item)

    def stream_checksum(self) -> str:
        return next(c for c in self.group.call("stream_checksum") if c is not None)

    def weights_checksum(self, dtype: Optional[str] = None) -> str:
        return next(c for c in self.group.call("weights_checksum", dtype=dtype) if c is not None)

    def base_checksum(self, dtype: Optional[str] = None) -> str:
        """Adapter-only syncs: the checksum of the base weights (LoRA's adapters off), cast to ``dtype``."""
        return next(c for c in self.group.call("weights_checksum", dtype=dtype, base=True) if c is not None)

    def export(self, out_dir: str, source_dir: str) -> None:
        self.group.call("export_hf", [(out_dir, source_dir)] * self.size)


class CriticGroup(RoleGroup):
    def values(self, step: StepData, settings: ForwardSettings) -> Sharded:
        refs = self.group.async_call("values", self._args([(r,) for r in step.shards(self.dp)]), settings=settings)
        return self._sharded(step, refs)

    def update(self, step: StepData, settings: UpdateSettings, extras: Sequence, *, seed: int,
               per_mini_batch: bool = False):
        _, (step_m, rows) = self._update_call("update_critic", step, settings, extras, seed=seed,
                                              agg_mode=settings.value.agg_mode)
        return rows if per_mini_batch else step_m


class RewardModelGroup(RoleGroup):
    """A learned reward model (``reward_model.*``), forward-only: one score per response
    (:mod:`trainer.rewards.reward_model`)."""

    def scores(self, step: StepData, settings: ForwardSettings) -> torch.Tensor:
        """``[B]`` float32 RM scores in batch order (they come to the driver: it places the reward)."""
        refs = self.group.async_call("rm_scores", self._args([(r,) for r in step.shards(self.dp)]), settings=settings)
        res = self.group.get(refs)  # every rank (a failed model-parallel peer surfaces here)
        parts = [res[i] for i in self.source]
        self.transport.bytes_in += sum(p["rm_scores"].nbytes for p in parts)
        return step.partition(self.dp).gather([p["rm_scores"] for p in parts]).float()


def _sum_summaries(rows: Sequence[dict]) -> dict[str, float]:
    return {k: float(sum(r[k] for r in rows)) for k in rows[0]} if rows else {}
