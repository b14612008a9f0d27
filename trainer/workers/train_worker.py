"""One rank of a model group (actor, reference, critic or reward model), whatever trains it.

The worker is strategy-neutral: it unpacks the batch shard it was sent, plans the micro-batches,
assembles the losses from ``trainer.algos`` (policy loss, entropy bonus, KL loss, rollout IS; value
loss), gathers the metrics partials (:mod:`trainer.workers.metrics`), and orchestrates checkpoints and
offload. The model itself lives in ``self.strategy`` (:mod:`trainer.strategies`: megatron-core,
DeepSpeed, ...), which runs the forward passes and the optimizer step, saves and loads, and streams
the weights. A subclass only names its strategy (``strategy_name``), e.g.
:class:`trainer.workers.megatron_worker.MegatronWorker`.

It runs as a Ray actor (one per rank) or, for debugging, as a plain object in the driver
(``trainer.debug.in_process=true``), so ``breakpoint()`` works in every method.

Batch shards arrive by object reference as the dicts of :mod:`trainer.workers.dataplane` (numpy
crosses Ray without pickling tensors), already trimmed to the shard's own width; per-token outputs
come back at that width, for the response part only (``[b, T_d]``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os

import numpy as np
import torch
from omegaconf import OmegaConf

from trainer.algos.kl import kl_penalty
from trainer.algos.losses import LossAgg, agg_loss, get_policy_loss_fn, value_loss
from trainer.algos.correction import compose_correction
from trainer.batch import RolloutBatch, micro_batch_groups
from trainer.orphans import fault_hold
from trainer.plan import ForwardSettings, RolloutIS, UpdateSettings
from trainer.rewards.reward_model import with_score_token
from trainer.strategies import Strategy, load_strategy
from trainer.sync.endpoints import SenderEndpoints
from trainer.workers.dataplane import shard_batch
from trainer.workers.metrics import MEAN, SUM, Partials, entropy_summary, step_partials


def resident(*parts: str):
    """Decorator: the method runs with ``parts`` of the role's state ("params", "grads", "optimizer")
    in device memory; whatever the role offloads (``offload``) goes back to host memory afterwards.
    A generator method keeps them resident until it is drained or closed."""
    def deco(fn):
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def gen(self, *a, **kw):
                self._load_state(parts)
                try:
                    yield from fn(self, *a, **kw)
                finally:
                    self._offload_state()
            return gen

        @functools.wraps(fn)
        def wrapped(self, *a, **kw):
            self._load_state(parts)
            try:
                return fn(self, *a, **kw)
            finally:
                self._offload_state()
        return wrapped
    return deco


class TrainWorker(SenderEndpoints):
    """A rank: ``strategy`` (or the class's ``strategy_name``: a key of ``trainer.strategies.STRATEGIES`` or
    ``"pkg.module:Class"``) picks the strategy. Its keywords come from the role's config ``section`` (read by
    the strategy's ``from_section`` with the ``launch`` settings: ``optim``, ``checkpointing``,
    ``routing_replay``, ``compile``) and from every other keyword but ``role``, ``rank`` and ``num_threads``
    (the rendezvous, the model path; a test's explicit options). The weight transports' sender ends (``sync_send``,
    ``weight_buckets``, checksums) come with every strategy (:class:`trainer.sync.endpoints.SenderEndpoints`)."""

    strategy_name: str = ""

    def __init__(self, *, role: str, rank: int, num_threads: int = 1, strategy: str | None = None,
                 section: dict | None = None, launch: dict | None = None, **options):
        torch.set_num_threads(max(1, num_threads))
        self.role, self.rank = role, rank
        fault_hold("startup")
        cls = load_strategy(strategy or self.strategy_name)
        if section is not None:  # the role's config section: the strategy reads its own keys (Strategy.from_section)
            options = {**cls.from_section(OmegaConf.create(section), **(launch or {})), **options}
        self.strategy: Strategy = cls(role=role, rank=rank, **options)
        self.mesh = self.strategy.mesh

    @property
    def model(self):
        return self.strategy.model

    # ------------------------------------------------------------------ what the strategy holds
    # thin forwards: the offload decorator, the weight transports (trainer.sync) and tests read these
    def _module(self):
        return self.strategy.module()

    def _load_state(self, parts) -> None:
        self.strategy.load_state(parts)

    def _offload_state(self) -> None:
        self.strategy.offload_state()

    def offload_status(self) -> dict:
        return self.strategy.offload_status()

    def _hf_buckets(self, bucket_bytes: int):
        return self.strategy.hf_buckets(bucket_bytes)

    def _hf_params(self):
        return self.strategy.hf_params()

    def _base_params(self):
        return self.strategy.base_params()

    def _reshard_blocks(self) -> list | None:
        return self.strategy.reshard_blocks()

    def _local_param(self, ref: str):
        return self.strategy.local_param(ref)

    def layout(self) -> dict:
        """The rank's place in the mesh, its device (``device_name``: the GPU's name, or ``cpu``) and its
        intra-op threads: the driver looks up (or measures) the device's peak for ``perf/mfu/*``."""
        gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
        return {"rank": self.rank, **self.mesh, "device_name": torch.cuda.get_device_name() if gpu else "cpu",
                "threads": torch.get_num_threads()}

    def ping(self) -> int:
        return os.getpid()

    # ------------------------------------------------------------------ micro-batches
    def _micro_batches(self, batch: RolloutBatch, settings, fields: tuple[str, ...], lockstep=None) -> list[dict]:
        """The batch's micro-batches (``settings``: a ``ForwardSettings`` or ``UpdateSettings``):
        ``micro_batch_size`` rows each or filled up to ``max_token_len`` tokens
        (``trainer.batch.micro_batch_groups``); ``packed`` (where the strategy packs): one THD row of
        the real tokens (``pack_index`` maps them back to the ``[b, P+T]`` grid), else the padded rows.
        ``rows``: each micro-batch's rows of ``batch``; ``fields``: per-row tensors the loss reads.
        ``lockstep``: a process group whose ranks must all get the same number of micro-batches (a
        collective runs inside the loss): the largest count among them (verl's ``same_micro_num_in_dp``)."""
        s = self.strategy
        packed = settings.packed and s.packs  # e.g. HF attention on CPU has no packed path: padded rows
        tokens = batch.num_tokens.tolist()
        groups = micro_batch_groups(tokens, size=settings.micro_batch_size, max_tokens=settings.max_token_len,
                                    budget_key=settings.budget_key, min_groups=s.min_micro_batches)
        if lockstep is not None:
            most = int(s.group_reduce(torch.tensor([len(groups)]), lockstep, op="max"))
            if most > len(groups):
                groups = micro_batch_groups(tokens, size=settings.micro_batch_size, max_tokens=settings.max_token_len,
                                            budget_key=settings.budget_key, min_groups=most)
            if len(groups) != most:
                raise ValueError(f"this rank's {len(tokens)} rows cannot make the {most} micro-batches another "
                                 f"data-parallel rank has, and bypass mode's batch-normalised IS weights need the "
                                 f"same count on every rank: give every rank at least {most} rows per mini-batch "
                                 f"(a larger ppo_mini_batch_size) or a larger micro-batch / token budget")
        out = []
        for rows in groups:
            idx = torch.as_tensor(rows, dtype=torch.long)
            ids, am = batch.input_ids[idx], batch.attention_mask[idx]
            d = s.pack(ids, am) if packed else {"input_ids": ids, "attention_mask": am}
            d["rows"] = idx
            if s.routing_replay:  # the recorded experts of each token, in the micro-batch's own layout
                if batch.routed_experts is None:
                    raise ValueError("routing replay is on but the batch carries no routed_experts")
                re = batch.routed_experts[idx]  # [b, P+T, R, k]
                d["routed_experts"] = re.reshape(-1, *re.shape[2:])[d["pack_index"]] if packed else re
            for f in fields:
                v = getattr(batch, f)
                if v is not None:
                    d[f] = v[idx]
            out.append(d)
        return out

    def _grid(self, outs: dict, mb: dict, width: int) -> dict:
        """A micro-batch's per-token outputs on the ``[b, P+T]`` grid (unpacked when packed)."""
        if "pack_index" not in mb:
            return outs
        shape = (len(mb["rows"]), width)
        return {k: self.strategy.unpack(v, mb["pack_index"], shape) for k, v in outs.items()}

    def _forward(self, batch: RolloutBatch, settings, *, with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """Forward-only per-token outputs of every row over the response part, ``{name: [B, T]}``:
        ``logprobs`` (and ``entropy``; ``sum_pi_squared`` when ``settings.with_sum_pi_squared``) for a
        policy, ``values`` for a critic."""
        P, L = batch.prompt_width, batch.input_ids.shape[1]
        mbs = self._micro_batches(batch, settings, ())
        with torch.no_grad():
            outs = self.strategy.compute(mbs, temperature=settings.temperature, with_entropy=with_entropy,
                                         with_sum_pi_squared=settings.with_sum_pi_squared)
        full = {}
        for mb, o in zip(mbs, outs):
            for k, v in self._grid(o, mb, L).items():
                full.setdefault(k, torch.zeros(batch.num_samples, L - P, dtype=torch.float32))[mb["rows"]] = v[:, P:].float()
        return full

    # ------------------------------------------------------------------ forward passes
    @resident("params")
    def log_probs(self, shard: dict, *, settings: ForwardSettings, entropy: bool = False,
                  key: str = "log_probs", reference: bool = False) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Per-token log-probs of the shard's responses under the current weights, ``{key: [b, T_d]}``
        (``key``: the batch field they fill, e.g. ``old_log_probs``, so the update reads them as
        they are), and a summary: the entropy's masked sum and token count (``entropy``: the driver
        logs their ratio and never needs the per-token entropy). ``settings.with_sum_pi_squared``
        (verl's ``actor.calculate_sum_pi_squared``): the dict also holds ``sum_pi_squared [b, T_d]``,
        ``sum_v pi(v)^2`` at each response position (the optimal token baseline's input). ``reference``: the
        reference policy's log-probs from this rank's own model (``Strategy.reference_policy``: LoRA's actor with
        its adapters off)."""
        batch = shard_batch(shard)
        with self.strategy.reference_policy() if reference else contextlib.nullcontext():
            full = self._forward(batch, settings, with_entropy=entropy)
        summary = entropy_summary(full["entropy"], batch.response_mask) if entropy else {}
        out = {key: full["logprobs"].numpy()}
        if "sum_pi_squared" in full:
            out["sum_pi_squared"] = full["sum_pi_squared"].numpy()
        return out, summary

    @resident("params")
    def values(self, shard: dict, *, settings: ForwardSettings) -> dict[str, np.ndarray]:
        batch = shard_batch(shard)
        return {"values": self._forward(batch, settings)["values"].numpy()}

    @resident("params")
    def rm_scores(self, shard: dict, *, settings: ForwardSettings) -> dict[str, np.ndarray]:
        """A reward model's score of each row, ``{"rm_scores": [b]}``: the ``score`` head at the row's
        last valid token, read through the value path with a score slot appended
        (:func:`trainer.rewards.reward_model.with_score_token`)."""
        b = shard_batch(shard)
        P = b.prompt_width
        resp, ram, slot = with_score_token(b.prompts, b.responses, b.attention_mask[:, :P], b.attention_mask[:, P:])
        wide = RolloutBatch.from_tokens(b.prompts, resp, b.attention_mask[:, :P], ram)
        values = self._forward(wide, settings)["values"]  # [b, T+1]
        return {"rm_scores": values[torch.arange(len(slot)), slot].numpy()}

    # ------------------------------------------------------------------ updates
    @resident("params", "grads", "optimizer")
    def update_actor(self, shard: dict, mini_batches: list, *extras: dict | None, settings: UpdateSettings,
                     counts: list, on_policy: bool = False, rollout_is: RolloutIS | None = None,
                     return_log_probs: bool = False, bypass: dict | None = None) -> dict:
        """One optimizer step per mini-batch: ``mini_batches[k]`` are this rank's rows (of its shard)
        of mini-batch k, ``counts[k]`` its GLOBAL (tokens, sequences) over all ranks, so that
        micro-batch and data-parallel splits give the full-batch gradient (``LossAgg``).
        ``extras``: per-token fields of the shard (advantages, old / reference log-probs, IS
        weights, ...), each a ``{field: ndarray [b, T_d]}`` resolved by Ray from its reference.

        On-policy (one mini-batch, one epoch) the shard carries no old log-probs: the update's own
        forward runs at the start-of-step weights, so the old log-probs ARE its log-probs, taken
        detached (ratio exactly 1), and the separate old-log-prob forward is skipped. The
        rollout-IS weights (``rollout_is``) are then computed here, per micro-batch (every weight is
        a per-token or per-row function, so this equals a whole-batch computation); the driver
        computes only the mismatch metrics, from the log-probs returned with
        ``return_log_probs``. Returns ``{"metrics": [one dict per mini-batch], "log_probs":
        [b, T_d] in shard order or None, "entropy": summary or None}``."""
        fault_hold("update")
        pl = settings.policy
        # verl's bypass mode: "reinforce" is the plain policy gradient -w A log pi (GPG with the IS weights)
        policy_loss = get_policy_loss_fn("gpg" if bypass and bypass["loss"] == "reinforce" else pl.loss_mode)
        if on_policy and len(mini_batches) != 1:
            raise ValueError(f"on_policy=True needs exactly one mini-batch (got {len(mini_batches)}): with several, "
                             f"later mini-batches run at updated weights and need the start-of-step old log-probs")
        full = shard_batch(shard, *extras)
        fields = ("response_mask", "old_log_probs", "advantages", "rollout_is_weights", "ref_log_probs",
                  "rollout_log_probs")
        apply_is = rollout_is is not None and rollout_is.rollout_is
        # bypass mode's batch-normalised IS weights (verl): each micro-batch's mean over every rank's share of it
        norm = bool(bypass and bypass.get("batch_normalize"))
        group = self.strategy.loss_group() if norm else None
        reduce = functools.partial(self.strategy.group_reduce, group=group) if group is not None else None
        out, captured = [], []
        for k, rows in enumerate(mini_batches):
            batch = full[torch.as_tensor(rows, dtype=torch.long)]
            P, L = batch.prompt_width, batch.input_ids.shape[1]
            agg = pl.agg(global_num_tokens=counts[k][0], global_num_seqs=counts[k][1], dp_size=self.mesh["dp_size"])
            acc = Partials()  # this mini-batch's metrics on this rank, combined over the DP ranks by the driver

            def loss_fn(outs: dict, mb: dict, acc=acc):
                outs = self._grid(outs, mb, L)
                logp = outs["logprobs"][:, P:]  # [b, T]
                mask = mb["response_mask"]
                old, is_w = mb.get("old_log_probs"), mb.get("rollout_is_weights")
                if on_policy:
                    old = logp.detach()  # [b, T] the start-of-step policy, exactly
                    captured.append((old, outs["entropy"][:, P:].detach() if "entropy" in outs else None, mask,
                                     mb["rows"]))
                    if apply_is:
                        is_w = compose_correction(old, mb["rollout_log_probs"], mask, rollout_is=rollout_is,
                                                  with_metrics=False).weights
                elif bypass:  # old = the sampler's; IS / rejection from the current (detached) vs the sampler's
                    old = mb["rollout_log_probs"]
                    c = compose_correction(logp.detach(), old, mask, rollout_is=bypass["rollout_is"],
                                           rejection=bypass["rejection"], bypass=bypass["loss"], with_metrics=False,
                                           batch_normalize=norm, batch_reduce=reduce)
                    mask, is_w = c.loss_mask, c.weights  # ppo_clip: no weights, the ratio does it
                pg, metrics = policy_loss(old_log_prob=old, log_prob=logp, advantages=mb["advantages"],
                                          response_mask=mask, agg=agg, rollout_is_weights=is_w,
                                          clip_ratio=pl.clip_ratio, clip_ratio_low=pl.clip_ratio_low,
                                          clip_ratio_high=pl.clip_ratio_high, clip_ratio_c=pl.clip_ratio_c,
                                          **pl.variant_kwargs)
                total = pg
                mb_mask = mask.bool()
                acc.add_loss_metrics("actor/", metrics, tokens=mb_mask.sum(), seqs=mb_mask.any(-1).sum())
                acc.add("actor/pg_loss", SUM, pg.detach())  # this micro-batch's share x dp_size (LossAgg)
                if "entropy" in outs and pl.entropy_coeff:
                    ent = agg_loss(outs["entropy"][:, P:], mask, agg)
                    total = total - pl.entropy_coeff * ent
                    acc.add("actor/entropy_loss", SUM, ent.detach())
                if pl.use_kl_loss:
                    kl_l = agg_loss(kl_penalty(logp, mb["ref_log_probs"], pl.kl_loss_type), mask, agg)
                    total = total + pl.kl_loss_coef * kl_l
                    acc.add("actor/kl_loss", SUM, kl_l.detach())
                    acc.add("actor/kl_coef", MEAN, pl.kl_loss_coef)
                return total, {}

            # entropy enters the graph only when it is trained on; on-policy it is still computed, detached,
            # for the logged rollout entropy (the skipped old-log-prob pass used to provide it)
            m = self.strategy.train_step(self._micro_batches(batch, settings, fields, lockstep=group), loss_fn,
                                         temperature=settings.temperature,
                                         with_entropy=bool(pl.entropy_coeff) or on_policy,
                                         entropy_grad=bool(pl.entropy_coeff))
            step_partials(acc, "actor/", m)
            out.append(acc.to_dict())
        return {"metrics": out, **_on_policy_outputs(captured, mini_batches, return_log_probs)}

    @resident("params", "grads", "optimizer")
    def update_critic(self, shard: dict, mini_batches: list, *extras: dict | None, settings: UpdateSettings,
                      counts: list) -> dict:
        full = shard_batch(shard, *extras)
        vl_s = settings.value
        out = []
        for k, rows in enumerate(mini_batches):
            batch = full[torch.as_tensor(rows, dtype=torch.long)]
            P, L = batch.prompt_width, batch.input_ids.shape[1]
            agg = LossAgg(mode=vl_s.agg_mode, global_num_tokens=counts[k][0], global_num_seqs=counts[k][1],
                          dp_size=self.mesh["dp_size"])
            acc = Partials()

            def loss_fn(outs: dict, mb: dict, acc=acc):
                outs = self._grid(outs, mb, L)
                vl, metrics = value_loss(outs["values"][:, P:], mb["values"], mb["returns"], mb["response_mask"],
                                         cliprange_value=vl_s.cliprange_value, agg=agg)
                # the explained variance of the updated critic is no token mean; the driver logs verl's
                # critic/vf_explained_var (the step's values vs returns, over the whole batch)
                metrics.pop("vf_explained_var", None)
                mb_mask = mb["response_mask"].bool()
                acc.add_loss_metrics("critic/", metrics, tokens=mb_mask.sum(), seqs=mb_mask.any(-1).sum())
                acc.add("critic/vf_loss", SUM, vl.detach())
                return vl, {}

            m = self.strategy.train_step(self._micro_batches(batch, settings, ("response_mask", "values", "returns")),
                                         loss_fn)
            step_partials(acc, "critic/", m)
            out.append(acc.to_dict())
        return {"metrics": out}

    # ------------------------------------------------------------------ checkpoints, RNG
    @resident("params", "optimizer")
    def save(self, ckpt_dir: str, extra: dict | None = None) -> str:
        fault_hold("checkpoint")
        return self.strategy.save(ckpt_dir, extra=extra)

    @resident("params", "optimizer")
    def load(self, ckpt_dir: str, contents=("model", "optimizer", "extra")) -> dict:
        """``contents``: verl's load_contents (the model always; the optimizer and the LR scheduler
        ('extra') only when named, otherwise they keep their fresh state)."""
        return self.strategy.load(ckpt_dir, contents)

    @resident("params")
    def export_hf(self, out_dir: str, source_dir: str | None = None) -> str | None:
        return self.strategy.export_hf(out_dir, source_dir=source_dir)

    def rng_state(self) -> dict:
        return self.strategy.rng_state()

    def set_rng_state(self, state: dict) -> None:
        self.strategy.set_rng_state(state)


def _on_policy_outputs(captured: list, mini_batches: list, return_log_probs: bool) -> dict:
    """An on-policy update's by-products from the ``(old, entropy, mask, rows)`` its loss captured per
    micro-batch (on the last pipeline stage, the one that ran the loss; one mini-batch): the old
    log-probs in shard order (``return_log_probs``) and the rollout's entropy summary."""
    res = {"log_probs": None, "entropy": None}
    if not captured:
        return res
    # micro-batch rows -> mini-batch rows -> shard rows
    order = torch.as_tensor(mini_batches[0], dtype=torch.long)[torch.cat([c[3] for c in captured])]
    old = torch.cat([c[0] for c in captured]).float()
    if return_log_probs:
        lp = torch.zeros_like(old)
        lp[order] = old
        res["log_probs"] = {"old_log_probs": lp.numpy()}
    if captured[0][1] is not None:
        res["entropy"] = entropy_summary(torch.cat([c[1] for c in captured]), torch.cat([c[2] for c in captured]))
    return res
