"""One rank of a megatron-core model group: actor, reference or critic.

Thin by design: each method unpacks the batch shard it was sent, calls ``megatron_bridge`` (model,
log-probs, train step, checkpoints, weight stream) and ``trainer.algos`` (losses), and returns
numpy arrays or a metrics dict. It runs as a Ray actor (one per rank) or, for debugging, as a plain
object in the driver (``trainer.debug.in_process=true``), so ``breakpoint()`` works in every method.

Batch shards arrive by object reference as the dicts of :mod:`trainer.workers.dataplane` (numpy
crosses Ray without pickling tensors), already trimmed to the shard's own width; per-token outputs
come back at that width, for the response part only (``[b, T_d]``).
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from typing import Any, Iterator

import numpy as np
import torch

from trainer.batch import RolloutBatch, micro_batch_groups
from trainer.plan import ForwardSettings, RolloutIS, UpdateSettings
from trainer.workers.dataplane import shard_batch
from trainer.workers.metrics import MEAN, SUM, Partials


def _entropy_summary(entropy: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Masked sums and counts of per-token entropies (``trainer.workers.metrics.entropy_summary``):
    the driver's ``actor/entropy`` is formed from their sums over the ranks, so no per-token entropy
    leaves the rank."""
    from trainer.workers.metrics import entropy_summary

    return entropy_summary(entropy, mask)


def _memory_partials(acc, prefix: str = "perf/") -> None:
    """verl's memory metrics of an update: the device's peak allocated / reserved memory (CUDA only)
    and the node's used CPU memory (``psutil.virtual_memory().used``)."""
    from trainer.workers.metrics import MAX, MEAN

    if torch.cuda.is_available():
        acc.add(prefix + "max_memory_allocated_gb", MAX, torch.cuda.max_memory_allocated() / 1024**3)
        acc.add(prefix + "max_memory_reserved_gb", MAX, torch.cuda.max_memory_reserved() / 1024**3)
    try:
        import psutil

        acc.add(prefix + "cpu_memory_used_gb", MEAN, psutil.virtual_memory().used / 1024**3)
    except ImportError:  # pragma: no cover
        pass


def _step_partials(acc, prefix: str, m: dict) -> None:
    """The optimizer step's own metrics (the same on every rank): ``grad_norm``, ``lr``, ``skipped``,
    the total ``loss`` (this rank's micro-batch sum, a share x dp_size) and the memory metrics."""
    from trainer.workers.metrics import MEAN, SUM

    for k in ("grad_norm", "lr", "skipped"):
        if k in m:
            acc.add(prefix + k, MEAN, m[k])
    if "loss" in m:
        acc.add(prefix + "loss", SUM, m["loss"])
    _memory_partials(acc)


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


def combine_digests(digests: dict[str, bytes]) -> str:
    """``trainer.rollout.engine.checksum_named_tensors`` from per-tensor ``tensor_digest``s: the
    sync hash over the digests in sorted name order (tests check the two agree)."""
    from trainer.rollout.engine import new_hasher

    total = new_hasher()
    for name in sorted(digests):
        total.update(digests[name])
    return total.hexdigest()


class MegatronWorker:
    def __init__(self, *, role: str, rank: int, world_size: int, master_addr: str, master_port: int,
                 model_path: str, tp: int = 1, pp: int = 1, vpp: int = 1, cp: int = 1, ep: int = 1,
                 etp: int | None = None, moe: dict | None = None, pp_layers=None,
                 params_dtype: str = "float32",
                 compile: bool = False, optim: dict | None = None, seed: int = 1, num_threads: int = 1,
                 recompute: dict | None = None, sequence_parallel: bool = False, routing_replay: bool = False,
                 offload: dict | None = None):
        from megatron_bridge import launch
        from megatron_bridge.convert import load_hf_weights
        from megatron_bridge.hf_config import read_hf_config
        from megatron_bridge.model import build_model

        torch.set_num_threads(max(1, num_threads))
        self.role, self.rank = role, rank
        launch.init_distributed(rank, world_size, master_addr, master_port, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp,
                                seed=seed)
        self.mesh = launch.parallel_layout()
        self.hf = read_hf_config(model_path)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[params_dtype]
        if role == "reward":  # a reward model's head is its training: never a fresh init (trainer.rewards.reward_model)
            from trainer.rewards.reward_model import check_score_head

            check_score_head(model_path, self.hf.hidden_size)
        self.model = build_model(self.hf, pp_layers=pp_layers, params_dtype=dtype, value_head=role in ("critic", "reward"),
                                 recompute={**(recompute or {}), **(moe or {})} or None,
                                 sequence_parallel=sequence_parallel)
        load_hf_weights(self.model, model_path)
        # R3 routing replay: every forward routes each token to the experts the rollout engine used
        self.routing_replay = routing_replay
        if routing_replay:
            from megatron_bridge import routing_replay as rr

            if not self.hf.is_moe:
                raise ValueError(f"{role}: router_replay.mode=R3 replays mixture-of-experts routing, but {model_path} "
                                 f"is a dense model; remove the router_replay line")
            rr.install(self.model)
        self.trainer = None
        if optim is not None:
            from megatron_bridge.train import OptimConfig, make_trainer

            self.trainer = make_trainer(self.model, OptimConfig(**optim))
        self._setup_offload(offload or {})
        if compile:
            from megatron_bridge.model import compile_model

            compile_model(self.model)

    # ------------------------------------------------------------------ offload (megatron_bridge.offload)
    def _setup_offload(self, offload: dict) -> None:
        """verl's ``param_offload`` / ``grad_offload`` / ``optimizer_offload``: each named part lives in
        host memory except while a method that needs it runs (:func:`resident`)."""
        from megatron_bridge import offload as off

        bad = set(offload) - {"params", "grads", "optimizer"}
        if bad:
            raise ValueError(f"offload: unknown parts {sorted(bad)}")
        t = self.trainer
        self._offloaders = {}
        if offload.get("optimizer") and t is not None:  # first: it tells its own tensors from the model's
            self._offloaders["optimizer"] = off.StorageOffload(off.optimizer_state(t.optimizer, t.model), name="optimizer")
        if offload.get("grads") and t is not None:
            self._offloaders["grads"] = off.StorageOffload(off.grad_buffers(t.model), keep=False, name="grads")
        if offload.get("params"):
            self._offloaders["params"] = off.StorageOffload(off.model_params(self._module()), name="params")
        self.offloaded_bytes = {}
        self._offload_state()

    def _load_state(self, parts) -> None:
        for name in ("params", "grads", "optimizer"):  # the reverse of _offload_state's order
            o = self._offloaders.get(name)
            if o is not None and name in parts:
                o.load()

    def _offload_state(self) -> None:
        for name, o in self._offloaders.items():
            n = o.offload()
            if n:
                self.offloaded_bytes[name] = n

    def offload_status(self) -> dict:
        """Per offloaded part: whether it is in host memory now, the bytes it freed the last time, and the
        bytes its storages hold in place right now (0 while offloaded)."""
        from megatron_bridge.offload import resident_bytes

        return {"offloaded": {k: o.offloaded for k, o in self._offloaders.items()}, "bytes": dict(self.offloaded_bytes),
                "resident": {k: resident_bytes(o.tensors()) for k, o in self._offloaders.items()}}

    # ------------------------------------------------------------------ layout
    def layout(self) -> dict:
        return {"rank": self.rank, **self.mesh}

    def _module(self):
        return self.trainer.model if self.trainer is not None else self.model

    # ------------------------------------------------------------------ strategy hooks
    # What a training strategy provides; everything else in this class (batches, losses, metrics,
    # digests) is strategy-neutral and shared with trainer.workers.deepspeed_worker.
    def _compute(self, mbs: list[dict], *, temperature: float, with_entropy: bool,
                 with_sum_pi_squared: bool = False) -> list[dict]:
        """Forward-only per-token outputs of each micro-batch on its own grid (``megatron_bridge.logprobs``)."""
        from megatron_bridge.logprobs import compute_logprobs

        return compute_logprobs(self._module(), mbs, temperature=temperature, with_entropy=with_entropy,
                                with_sum_pi_squared=with_sum_pi_squared)

    def _train_step(self, mbs: list[dict], loss_fn, **kw) -> dict:
        """One optimizer step over the micro-batches: ``loss``, ``grad_norm``, ``lr``, ``skipped``."""
        from megatron_bridge.train import train_step

        return train_step(self.trainer, mbs, loss_fn, **kw)

    def _hf_buckets(self, bucket_bytes: int):
        """HF-named weight buckets, collective over the model group (every rank sees full tensors)."""
        from megatron_bridge.export import iter_hf_weights

        return iter_hf_weights(self._module(), bucket_bytes)

    def _hf_params(self):
        """``(hf_name, full tensor)`` one at a time, collective."""
        from megatron_bridge.export import iter_hf_param

        return iter_hf_param(self._module())

    def _micro_batches(self, batch: RolloutBatch, settings, fields: tuple[str, ...]) -> list[dict]:
        """The batch's micro-batches (``settings``: a ``ForwardSettings`` or ``UpdateSettings``):
        ``micro_batch_size`` rows each or filled up to ``max_token_len`` tokens
        (``trainer.batch.micro_batch_groups``); ``packed``: one THD row of the real tokens
        (``pack_index`` maps them back to the ``[b, P+T]`` grid), else the padded rows. ``rows``:
        each micro-batch's rows of ``batch``; ``fields``: per-row tensors the loss reads."""
        from megatron_bridge.logprobs import pack_padded

        # the interleaved schedule (virtual pipeline stages) needs a micro-batch per pipeline stage
        least = self.mesh["pp_size"] if self.mesh.get("vpp_size", 1) > 1 else 1
        groups = micro_batch_groups(batch.num_tokens.tolist(), size=settings.micro_batch_size,
                                    max_tokens=settings.max_token_len, budget_key=settings.budget_key, min_groups=least)
        out = []
        for rows in groups:
            idx = torch.as_tensor(rows, dtype=torch.long)
            ids, am = batch.input_ids[idx], batch.attention_mask[idx]
            d = pack_padded(ids, am) if settings.packed else {"input_ids": ids, "attention_mask": am}
            d["rows"] = idx
            if self.routing_replay:  # the recorded experts of each token, in the micro-batch's own layout
                if batch.routed_experts is None:
                    raise ValueError("routing replay is on but the batch carries no routed_experts")
                re = batch.routed_experts[idx]  # [b, P+T, R, k]
                d["routed_experts"] = re.reshape(-1, *re.shape[2:])[d["pack_index"]] if settings.packed else re
            for f in fields:
                v = getattr(batch, f)
                if v is not None:
                    d[f] = v[idx]
            out.append(d)
        return out

    @staticmethod
    def _grid(outs: dict, mb: dict, width: int) -> dict:
        """A micro-batch's per-token outputs on the ``[b, P+T]`` grid (unpacked when packed)."""
        if "pack_index" not in mb:
            return outs
        from megatron_bridge.logprobs import unpack_padded

        shape = (len(mb["rows"]), width)
        return {k: unpack_padded(v, mb["pack_index"], shape) for k, v in outs.items()}

    def _forward(self, batch: RolloutBatch, settings, *, with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """Forward-only per-token outputs of every row over the response part, ``{name: [B, T]}``:
        ``logprobs`` (and ``entropy``; ``sum_pi_squared`` when ``settings.with_sum_pi_squared``) for a
        policy, ``values`` for a critic."""
        P, L = batch.prompt_width, batch.input_ids.shape[1]
        mbs = self._micro_batches(batch, settings, ())
        with torch.no_grad():
            outs = self._compute(mbs, temperature=settings.temperature, with_entropy=with_entropy,
                                 with_sum_pi_squared=settings.with_sum_pi_squared)
        full = {}
        for mb, o in zip(mbs, outs):
            for k, v in self._grid(o, mb, L).items():
                full.setdefault(k, torch.zeros(batch.num_samples, L - P, dtype=torch.float32))[mb["rows"]] = v[:, P:].float()
        return full

    # ------------------------------------------------------------------ forward passes
    @resident("params")
    def log_probs(self, shard: dict, *, settings: ForwardSettings, entropy: bool = False,
                  key: str = "log_probs") -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Per-token log-probs of the shard's responses under the current weights, ``{key: [b, T_d]}``
        (``key``: the batch field they fill, e.g. ``old_log_probs``, so the update reads them as
        they are), and a summary: the entropy's masked sum and token count (``entropy``: the driver
        logs their ratio and never needs the per-token entropy). ``settings.with_sum_pi_squared``
        (verl's ``actor.calculate_sum_pi_squared``): the dict also holds ``sum_pi_squared [b, T_d]``,
        ``sum_v pi(v)^2`` at each response position (the optimal token baseline's input)."""
        batch = shard_batch(shard)
        full = self._forward(batch, settings, with_entropy=entropy)
        summary = _entropy_summary(full["entropy"], batch.response_mask) if entropy else {}
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
        from trainer.rewards.reward_model import with_score_token

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
        from trainer.algos.kl import kl_penalty
        from trainer.algos.losses import agg_loss, get_policy_loss_fn
        from trainer.algos.rollout_is import compute_rejection_mask, compute_rollout_is_weights

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
                    if apply_is and bool(mask.any()):
                        is_w = compute_rollout_is_weights(old, mb["rollout_log_probs"], mask, **rollout_is.kwargs())[0]
                elif bypass:  # old = the sampler's; IS / rejection from the current (detached) vs the sampler's
                    roll, cur = mb["rollout_log_probs"], logp.detach()
                    old, is_w = roll, None
                    for r in bypass["rejection"] or ():
                        mask = compute_rejection_mask(cur, roll, mask, divergence=r.divergence, agg=r.agg,
                                                      lower=r.lower, upper=r.upper)[0]
                    ris = bypass["rollout_is"]
                    if bypass["loss"] == "reinforce" and ris is not None and ris.rollout_is and bool(mask.any()):
                        is_w = compute_rollout_is_weights(cur, roll, mask, **ris.kwargs())[0]  # ppo_clip: the ratio does it
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
            m = self._train_step(self._micro_batches(batch, settings, fields), loss_fn,
                                 temperature=settings.temperature, with_entropy=bool(pl.entropy_coeff) or on_policy,
                                 entropy_grad=bool(pl.entropy_coeff))
            _step_partials(acc, "actor/", m)
            out.append(acc.to_dict())
        res = {"metrics": out, "log_probs": None, "entropy": None}
        if captured:  # the last pipeline stage (the one that ran loss_fn); one mini-batch: rows = mini_batches[0]
            # micro-batch rows -> mini-batch rows -> shard rows
            order = torch.as_tensor(mini_batches[0], dtype=torch.long)[torch.cat([c[3] for c in captured])]
            old = torch.cat([c[0] for c in captured]).float()
            if return_log_probs:
                lp = torch.zeros_like(old)
                lp[order] = old
                res["log_probs"] = {"old_log_probs": lp.numpy()}
            if captured[0][1] is not None:
                res["entropy"] = _entropy_summary(torch.cat([c[1] for c in captured]), torch.cat([c[2] for c in captured]))
        return res

    @resident("params", "grads", "optimizer")
    def update_critic(self, shard: dict, mini_batches: list, *extras: dict | None, settings: UpdateSettings,
                      counts: list) -> dict:
        from trainer.algos.losses import LossAgg, value_loss

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

            m = self._train_step(self._micro_batches(batch, settings, ("response_mask", "values", "returns")), loss_fn)
            _step_partials(acc, "critic/", m)
            out.append(acc.to_dict())
        return {"metrics": out}

    # ------------------------------------------------------------------ weights, checkpoints
    @resident("params")
    def weight_buckets(self, bucket_bytes: int, digest_dtype: str | None = None) -> Iterator[Any]:
        """Collective generator over HF-named weight buckets. Every rank must drain it; only global
        rank 0 yields the tensors (others yield None, so nothing is shipped twice).

        No copy is made here: Ray serialises a yielded bucket into its object store before the
        generator resumes (views of live parameters are fine: no optimizer step runs during a sync).
        With ``digest_dtype`` (``"none"`` = as is) rank 0 then hashes the bucket it just handed
        over, while the engines load it, and ``stream_checksum`` returns the checksum of everything
        streamed: verification without a second gather pass over the model."""
        from trainer.rollout.engine import tensor_digest

        hashing = digest_dtype is not None and self.rank == 0
        dt = getattr(torch, digest_dtype) if hashing and digest_dtype != "none" else None
        self._stream_digests, self._stream_done = {}, threading.Event()
        try:
            for bucket in self._hf_buckets(bucket_bytes):
                if self.rank != 0:
                    yield None
                    continue
                pairs = [(n, t.detach().cpu()) for n, t in bucket]
                yield pairs
                if hashing:
                    self._add_stream_digests((n, tensor_digest(n, t, dt)) for n, t in pairs)
        finally:
            self._stream_done.set()

    def _add_stream_digests(self, digests) -> None:
        """Record ``(name, digest)`` pairs of the stream in progress (``stream_checksum``); a name twice is an error."""
        for n, d in digests:
            if n in self._stream_digests:
                raise ValueError(f"tensor {n!r} appears twice in the weight stream")
            self._stream_digests[n] = d

    # ---- direct resharding through shared memory (trainer/workers/weight_shm.py) -------------------
    def _reshard_blocks(self) -> list | None:
        """This rank's blocks of the HF tensors (``megatron_bridge.reshard``); None: not supported."""
        from megatron_bridge.reshard import local_blocks

        return local_blocks(self._module())

    def shm_plan(self) -> list[tuple[str, tuple]] | None:
        """Plan this rank's part of a shared-memory sync; returns (HF name, HF shape, rows, cols) of each
        block it writes, or None when the strategy cannot (the sync keeps the object-store path)."""
        try:
            blocks = self._reshard_blocks()
        except NotImplementedError:
            return None
        if blocks is None:
            return None
        from megatron_bridge.reshard import local_param

        self._shm_blocks = blocks
        self._shm_params = {b.param: local_param(self._module(), b.param) for b in blocks}
        return [(b.hf_name, b.hf_shape, b.rows, b.cols) for b in blocks]

    def shm_attach(self, path: str, token: bytes, layout) -> bool:
        """Map the sync file; False when it is not visible from here (another node or namespace)."""
        from trainer.workers.weight_shm import SharedWeights, prepare_writes

        try:
            self._shm = SharedWeights(path, token, layout)
        except FileNotFoundError:
            return False
        self._shm_writes = prepare_writes(self._shm, self._shm_blocks)
        return True

    @resident("params")
    def shm_write(self, verify: bool) -> int:
        """Write this rank's blocks into the engines' shared weights (cast to the engine dtype), with
        ``verify`` each chunk compared in cache with what was sent (``WeightSyncError`` on a
        difference); returns the bytes written."""
        from trainer.workers.weight_shm import write_blocks

        return write_blocks(self._shm, self._shm_writes, self._shm_params.__getitem__, verify)

    def stream_checksum(self, timeout: float = 600.0) -> str | None:
        """Checksum of the last ``weight_buckets`` stream (rank 0; others None), equal to
        ``checksum_named_tensors`` of the same tensors. Waits for the stream's last digest."""
        if self.rank != 0:
            return None
        done = getattr(self, "_stream_done", None)
        if done is None or not done.wait(timeout):
            raise RuntimeError("stream_checksum: no finished weight_buckets stream with digests")
        return combine_digests(self._stream_digests)

    @resident("params")
    def weights_checksum(self, dtype: str | None = None) -> str | None:
        from trainer.rollout.engine import checksum_named_tensors

        dt = getattr(torch, dtype) if dtype else None
        pairs = ((n, t.detach().cpu()) for n, t in self._hf_params())
        if self.rank == 0:
            return checksum_named_tensors(pairs, dtype=dt)
        for _ in pairs:  # collective: still take part in every gather
            pass
        return None

    @resident("params", "optimizer")
    def save(self, ckpt_dir: str, extra: dict | None = None) -> str:
        from megatron_bridge.checkpoint import save_checkpoint

        t = self.trainer
        return save_checkpoint(ckpt_dir, self._module(), t.optimizer if t else None, t.scheduler if t else None, extra=extra)

    @resident("params", "optimizer")
    def load(self, ckpt_dir: str, contents=("model", "optimizer", "extra")) -> dict:
        """``contents``: verl's load_contents (the model always; the optimizer and the LR scheduler
        ('extra') only when named, otherwise they keep their fresh state)."""
        from megatron_bridge.checkpoint import load_checkpoint

        t = self.trainer
        out = load_checkpoint(ckpt_dir, self._module(), t.optimizer if t and "optimizer" in contents else None,
                              t.scheduler if t and "extra" in contents else None)
        if self._offloaders:
            from megatron_bridge.offload import own_storages

            own_storages(self._module(), t.optimizer if t else None)  # loaded tensors may sit in a mapped file
        return out

    @resident("params")
    def export_hf(self, out_dir: str, source_dir: str | None = None) -> str:
        from megatron_bridge.export import export_hf

        export_hf(self._module(), out_dir, source_dir=source_dir)
        return out_dir

    def rng_state(self) -> dict:
        from trainer.checkpoint import capture_rng

        return capture_rng()

    def set_rng_state(self, state: dict) -> None:
        from trainer.checkpoint import restore_rng

        restore_rng(state)

    def ping(self) -> int:
        return os.getpid()

    # ---- weight sync through a torch.distributed group (trainer/workers/weight_group.py) ---------------
    def wg_host(self) -> tuple[str, int] | None:
        """Rank 0: host a weight group's store on this node's IP, at a port the kernel picks; returns
        (ip, port), which also names the group. The other ranks: None."""
        if self.rank != 0:
            return None
        import ray

        from trainer.workers.weight_group import host_store

        ip = ray.util.get_node_ip_address()
        store = host_store(ip)
        self._wgs = getattr(self, "_wgs", {})
        self._wgs[f"{ip}:{store.port}"] = (store, None)
        return ip, store.port

    def wg_join(self, host: str, port: int, world: int, dtype: str, bucket_bytes: int) -> bool:
        """Join weight group ``host:port`` as its rank ``self.rank`` (the engines join beside; this blocks
        until all have), and bucket this rank's blocks (``shm_plan`` planned them) for sending in ``dtype``.
        A rank may be in several groups (one per rollout)."""
        from trainer.workers.weight_group import Sender, join

        self._wgs = getattr(self, "_wgs", {})
        key = f"{host}:{port}"
        store = self._wgs.pop(key, (None, None))[0]
        device = next(iter(self._shm_params.values())).device if self._shm_params else torch.device("cpu")
        pg, store = join(host, port, self.rank, world, device, store)
        plan = [(b.hf_name, b.hf_shape, b.rows, b.cols) for b in self._shm_blocks]
        self._wgs[key] = (store, pg, Sender(pg, plan, self._shm_blocks, getattr(torch, dtype), bucket_bytes, device))
        return True

    @resident("params")
    def wg_send(self, key: str, engines: list[int], verify: bool, bucket_bytes: int) -> dict:
        """Send this rank's blocks to the engines (group ranks ``engines``) of weight group ``key``; with
        ``verify`` the digest of every block as sent (``weight_group.Sender.send``)."""
        sender = self._wgs[key][2]
        sender.rebucket(bucket_bytes)
        return sender.send(engines, self._shm_params.__getitem__, verify)

    def wg_close(self, key: str) -> None:
        """Leave weight group ``key`` (its rollout's shutdown)."""
        entry = getattr(self, "_wgs", {}).pop(key, None)
        if entry is not None and len(entry) > 1 and entry[1] is not None:
            try:
                entry[1].shutdown()
            except Exception:  # noqa: BLE001 (the engines may be gone already)
                pass

    # ---- SGLang's distributed weight update: rank 0 broadcasts full tensors (trainer/workers/weight_broadcast.py)
    def bc_host(self) -> tuple[str, int, str] | None:
        """Rank 0: host the broadcast group's store on this node's IP at a port the kernel picks; returns
        (ip, port, backend: NCCL where the weights are on a GPU, else gloo). The other ranks: None."""
        if self.rank != 0:
            return None
        import ray

        from trainer.workers.weight_broadcast import host_store
        from trainer.workers.weight_group import backend_for

        m = self._module()
        device = next(p for c in (m if isinstance(m, (list, tuple)) else [m]) for p in c.parameters()).device
        ip = ray.util.get_node_ip_address()
        store = host_store(ip)
        self._bcs = getattr(self, "_bcs", {})
        self._bcs[f"{ip}:{store.port}"] = (store, None)
        return ip, store.port, backend_for(device)

    def bc_join(self, key: str, world: int, group_name: str, backend: str) -> None:
        """Rank 0 joins broadcast group ``key`` as its rank 0 (blocks until every engine rank has)."""
        if self.rank != 0:
            return
        from trainer.workers.weight_broadcast import join

        store = self._bcs[key][0]
        self._bcs[key] = (store, join(store, world, group_name, backend))

    def bc_send(self, key: str, bucket_bytes: int, dtype: str, verify: bool) -> Iterator[Any]:
        """Collective over the model group (every rank drains it; the gathers need them all): rank 0
        packs each HF bucket into a flat buffer in ``dtype``, yields its description (``weight_broadcast.pack``)
        to the driver, which hands it to the engines, then broadcasts the buffer to them. The other ranks
        yield None. With ``verify`` the digests also make ``stream_checksum``."""
        from trainer.workers.weight_broadcast import pack, send

        dt = getattr(torch, dtype)
        self._stream_digests, self._stream_done = {}, threading.Event()
        try:
            for bucket in self._hf_buckets(bucket_bytes):
                if self.rank != 0:
                    yield None
                    continue
                flat, desc = pack(bucket, dt, digests=verify)
                self._add_stream_digests((desc["digests"] or {}).items())
                yield desc  # the engines' receive joins the broadcast below
                send(self._bcs[key][1], flat)
        finally:
            self._stream_done.set()

    def bc_close(self, key: str) -> None:
        """Leave broadcast group ``key``."""
        from trainer.workers.weight_broadcast import leave

        entry = getattr(self, "_bcs", {}).pop(key, None)
        if entry is not None and entry[1] is not None:
            leave(entry[1])
