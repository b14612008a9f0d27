"""One training step, in one place: ``Step`` (its phase calls), ``default_pipeline`` (their order),
the user's hooks at named points, independent forward passes run at the same time, and the driver's
math (rollout IS / rejection, KL in reward, advantages) with the step's metrics. The whole step is
replaceable by one Python function. Generation and scoring (steps 1-3) are :mod:`trainer.generation`;
the step reads only the ``Plan`` and the ``LoopState`` (:mod:`trainer.plan`), never the raw config.

Hooks (``trainer.hooks.<point>=[pkg.module:function, ...]``). Each hook is ``f(batch, metrics)``: it
may change the batch in place (rewards, per-sample fields with ``batch.set_meta``), add entries to
the step's ``metrics`` dict, or return a new ``RolloutBatch`` that replaces it (``batch[keep]``: a
filter plugin). The points, in step order:

==================  ========================================================  =====================
point               the batch holds                                           may drop samples
==================  ========================================================  =====================
after_rollout       tokens, masks, the sampler's log-probs; no reward yet     yes
after_reward        + ``token_level_scores``, ``scores``, ``acc``             yes (before DAPO's filter)
after_filter        the step's batch (DAPO's group filter and trim done)      yes
before_advantages   + old / reference log-probs, critic values                no: the ranks hold it
after_update        + advantages, returns; ``metrics`` has the update's       no
after_eval          ``metrics`` has the ``val-*`` results of this step        no
==================  ========================================================  =====================

The three generation points run for training batches only (validation scores the held-out set
as the data defines it), in the thread that generates the batch, so in one-step-off mode the
prefetched batch a checkpoint saves already carries the hooks' changes and a resume trains on it
again unchanged. A hook that changes a reward changes ``token_level_scores`` (per token, the
score on the last sampled token) and ``scores`` (per sample) alike. Samples dropped after the
generation points are counted (``pipeline/<point>/dropped_samples``); when what is left does not
split over the data-parallel ranks, the trailing rows are trimmed to the nearest multiple and counted
(``pipeline/trimmed_samples``), as verl trims DAPO's batch to its size.

Phases. ``Step`` exposes the phase calls of the default loop (``generate``, ``forward_passes``,
``advantages``, ``update_critic``, ``update_actor``, ``sync_weights``, ``validate``, ``hook``);
:func:`default_pipeline` is the loop's step written with them, and ``trainer.pipeline=
pkg.module:function`` replaces it with the user's own ``f(step: Step) -> None`` (drop the reference
phase, add a phase, reorder), without a fork. Checkpointing, logging and resume stay in the loop
around it, so a user pipeline resumes exactly like the default one.

Parallel phases. The old log-probs (actor), the reference log-probs and the critic's values depend
on the batch only, not on each other (the dependency graph of a PPO step: Schulman et al. 2017;
siiRL's DAG workers, Wang et al. 2025, arXiv:2507.13833). With ``trainer.parallel_phases=true``
(the default on CPU; on GPU the groups share each device, so it is off unless asked for) the groups that hold them are called at the same time from driver threads, one thread
per group, and the step waits for all. Each group's calls stay in order on its own ranks (a collective
needs every rank to run the same calls in the same order, so two threads never call one group).
Workers running in the driver (``trainer.debug.in_process``) run them one after the other.
``timing_s/<phase>`` is each pass's own time from its call to its result; ``timing_s/forward_passes``
the wall time of all of them together.
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from trainer.algos.advantages import compute_advantage, variance_proxy_metrics
from trainer.algos.kl import apply_kl_in_reward
from trainer.algos.correction import compose_correction
from trainer.batch import RolloutBatch
from trainer.config.plugins import HOOK_PARAMS, PIPELINE_PARAMS, load_callable, load_step_callable  # noqa: F401 - load_callable: re-exported by trainer.pipeline
from trainer.credit import adca_advantages
from trainer.debug import dump_batch, replay_batch
from trainer.generation import PipelineError, timer, to_float_metrics
from trainer.step_data import StepData
from trainer.workers.metrics import entropy_from_summary

HOOK_POINTS = ("after_rollout", "after_reward", "after_filter", "before_advantages", "after_update", "after_eval")
GENERATION_POINTS = ("after_rollout", "after_reward", "after_filter")  # the points that may drop samples


class Hooks:
    """The configured hooks, by point (``trainer.hooks``)."""

    def __init__(self, specs: Optional[dict] = None):
        specs = dict(specs or {})
        unknown = sorted(set(specs) - set(HOOK_POINTS))
        if unknown:
            raise ValueError(f"trainer.hooks has no point(s) {unknown}; the points are {list(HOOK_POINTS)}.")
        self.fns = {p: [(s, load_step_callable(s, f"trainer.hooks.{p}", HOOK_PARAMS)) for s in (specs.get(p) or [])]
                    for p in HOOK_POINTS}

    def __bool__(self) -> bool:
        return any(self.fns.values())

    def run(self, point: str, batch, metrics: dict):
        """Every hook of ``point`` in order; returns the batch (a hook's returned batch replaces it)."""
        for spec, fn in self.fns[point]:
            before = batch.num_samples if batch is not None else None
            out = fn(batch, metrics)
            if out is not None:
                if not isinstance(out, RolloutBatch):
                    raise PipelineError(f"the hook {spec} (trainer.hooks.{point}) returned a {type(out).__name__}; "
                                        f"return None (changes made in place) or a RolloutBatch.")
                batch = out
            if before is None or batch.num_samples == before:
                continue
            if point not in GENERATION_POINTS:
                raise PipelineError(f"the hook {spec} (trainer.hooks.{point}) changed the number of samples from "
                                    f"{before} to {batch.num_samples}; at {point} the workers already hold the batch. "
                                    f"Drop samples at {', '.join(GENERATION_POINTS)}.")
            if batch.num_samples == 0:
                raise PipelineError(f"the hook {spec} (trainer.hooks.{point}) dropped every sample of the batch: "
                                    f"nothing is left to train on.")
            key = f"pipeline/{point}/dropped_samples"
            metrics[key] = metrics.get(key, 0.0) + float(before - batch.num_samples)
        return batch


# ----------------------------------------------------------------------------------------------
# the step
# ----------------------------------------------------------------------------------------------
@dataclass
class Runtime:
    """What lives for the whole run and every step uses (built once by ``trainer.main.start``)."""

    plan: Any  # Plan: every setting the step reads
    cluster: Any
    state: Any  # LoopState
    batches: Any  # BatchSource
    hooks: Hooks
    evaluate: Callable[[int], dict]
    judge: Any = None  # ADCA-GRPO's judge client (plan.adca), or None
    tokenizer: Any = None


@dataclass
class Step:
    """One training step: its phase calls and what they produced. A pipeline function calls the
    phases; the loop reads ``metrics`` and ``batch`` afterwards."""

    rt: Runtime
    step: int
    metrics: dict = field(default_factory=dict)
    batch: Any = None
    epoch: int = 0
    data: Any = None  # StepData: the batch sharded for the ranks, made once
    old: Any = None  # Sharded old log-probs (the actor's separate pass), or None
    ref: Any = None  # Sharded reference log-probs, or None
    values: Any = None  # Sharded critic values, or None
    entropy: dict = field(default_factory=dict)
    trained: bool = False  # an update ran (so the training metrics apply)
    _ran: set = field(default_factory=set)

    # ------------------------------------------------------------------ shortcuts
    @property
    def plan(self):
        return self.rt.plan

    @property
    def actor(self):
        return self.rt.cluster.actor

    @property
    def reference(self):
        """The reference group (None without KL loss or KL in reward)."""
        return self.rt.cluster.ref

    @property
    def critic(self):
        """The critic group (None unless the estimator needs values)."""
        return self.rt.cluster.critic

    @property
    def trains_actor(self) -> bool:
        """False during ``trainer.critic_warmup``."""
        return self.plan.trains_actor(self.step)

    @property
    def on_policy(self) -> bool:
        """One mini-batch x one epoch: the update's own forward gives the old log-probs."""
        return self.plan.on_policy(self.batch.num_samples, self.step)

    @property
    def bypass(self) -> bool:
        """verl's bypass mode: the sampler's log-probs are the old ones."""
        return self.plan.bypass is not None

    def _timer(self, name: str):
        return timer(self.metrics, name)

    def hook(self, point: str) -> None:
        """Run the hooks of ``point`` on the batch and the metrics (the generation points run inside
        :meth:`generate`)."""
        if point in GENERATION_POINTS:
            raise PipelineError(f"hooks at {point} run inside Step.generate(); call s.hook() only for "
                                f"{[p for p in HOOK_POINTS if p not in GENERATION_POINTS]}.")
        self.batch = self.rt.hooks.run(point, self.batch, self.metrics)
        if self.data is not None:
            self.data.batch = self.batch  # same rows; a hook's new fields go with it

    def _need(self, what: str, *names: str) -> None:
        missing = [n for n in names if n not in self._ran]
        if missing:
            raise PipelineError(f"step {self.step}: {what} needs Step.{'(), Step.'.join(missing)}() first.")

    # ------------------------------------------------------------------ 1-3 rollout, reward, filtering
    def generate(self):
        """The step's batch: rollout, reward (and the generation hooks), DAPO's filter; in one-step-off
        mode the one generated while the last step trained. ``trainer.debug`` replays or dumps it."""
        rt, m, p = self.rt, self.metrics, self.plan
        if p.train_only:
            with self._timer("gen"):
                self.batch, self.epoch = replay_batch(p.dump_batch_path, self.step), rt.state.sampler.epoch
        else:
            self.batch, self.epoch = rt.batches.take(self.step, m)
            rt.batches.prefetch(self.step + 1)  # one-step-off: the next batch, with the engines' weights, while this one trains
        if p.dump_batch_path and not p.train_only:
            dump_batch(self.batch, p.dump_batch_path, self.step)
        self._ran.add("generate")
        return self.batch

    def _step_data(self):
        if self.data is None:
            p = self.plan
            self.data = StepData(self.batch, self.rt.cluster.transport,
                                 with_rollout_log_probs=(self.on_policy and p.rollout_is is not None) or self.bypass,
                                 with_routed_experts=p.sampling.return_routed_experts, balanced=p.balance_batch)
            if self.actor is not None:  # verl's global_seqlen/* of the actor's data-parallel split
                self.metrics.update(self.data.partition(self.actor.dp).seqlen_metrics())
        return self.data

    # ------------------------------------------------------------------ 4-5 forward passes
    def forward_passes(self, *, old: Optional[bool] = None, ref: Optional[bool] = None,
                       values: Optional[bool] = None) -> None:
        """The forward passes the step needs, at the same time where their groups allow: the actor's
        old log-probs (not on the on-policy or bypass paths, where the update's forward or the
        sampler gives them), the reference log-probs (when a reference group exists) and the
        critic's values (when a critic exists). ``False`` leaves a pass out (the loss then runs
        without it, or refuses where it cannot: see :meth:`update_actor`)."""
        self._need("forward_passes", "generate")
        p, cl = self.plan, self.rt.cluster
        data = self._step_data()
        if self.bypass:
            self.batch.old_log_probs = self.batch.rollout_log_probs
        want_old = (not self.bypass and not self.on_policy) if old is None else old
        jobs: dict[str, tuple[Any, Callable]] = {}  # name -> (group, call)
        if want_old:
            jobs["old_log_prob"] = (cl.actor, lambda: cl.actor.log_probs_with_entropy(data, p.actor_log_prob))
        if (cl.ref is not None) if ref is None else ref:
            if cl.ref is None:
                raise PipelineError("forward_passes(ref=True): this run has no reference group (it is made for "
                                    "actor.use_kl_loss or algorithm.use_kl_in_reward).")
            jobs["ref"] = (cl.ref, lambda: cl.ref.log_probs(data, p.ref_log_prob))
        if (cl.critic is not None) if values is None else values:
            if cl.critic is None:
                raise PipelineError("forward_passes(values=True): this run has no critic (algorithm.adv_estimator=gae "
                                    "makes one).")
            jobs["values"] = (cl.critic, lambda: _ready(cl.critic.values(data, p.critic_values)))
        for g in {id(g): g for g, _ in jobs.values()}.values():
            data.shards(g.dp)  # put each shard once, here, not from two threads at once
        with self._timer("forward_passes"):
            # passes answered by the same processes (LoRA's reference on the actor's ranks) run one after the other
            out = run_concurrently({k: c for k, (_, c) in jobs.items()}, self.metrics,
                                   parallel=p.parallel_phases and not cl.in_process,
                                   lanes={k: id(g.group) for k, (g, _) in jobs.items()})
        if "old_log_prob" in out:
            self.old, self.entropy = out["old_log_prob"]
        self.ref, self.values = out.get("ref"), out.get("values")
        self._ran.add("forward_passes")

    # ------------------------------------------------------------------ 6-7 the driver's math
    def advantages(self) -> None:
        """Rollout IS / rejection, KL in reward, advantages and returns (the driver's math)."""
        self._need("advantages", "generate")
        if "forward_passes" not in self._ran:
            self._step_data()
        rt = self.rt
        if self.bypass:
            self.batch.old_log_probs = self.batch.rollout_log_probs
        if self.plan.use_kl_in_reward and self.ref is None:
            raise PipelineError(f"step {self.step}: algorithm.use_kl_in_reward needs the reference log-probs: call "
                                f"Step.forward_passes(ref=True) before Step.advantages().")
        if self.plan.critic_values is not None and self.critic is not None and self.values is None:
            raise PipelineError(f"step {self.step}: the estimator needs the critic's values: call "
                                f"Step.forward_passes(values=True) before Step.advantages().")
        with self._timer("adv"):
            self.metrics.update(driver_math(
                self.plan, self.batch, old=self.old, ref=self.ref, values=self.values, kl_ctrl=rt.state.kl_ctrl,
                adca=(rt.judge, rt.tokenizer) if rt.judge else None,
                step=self.step, epoch=self.epoch))
        self._ran.add("advantages")

    # ------------------------------------------------------------------ 8 updates
    def update_critic(self) -> None:
        self._need("update_critic", "advantages")
        if self.critic is None:
            raise PipelineError("update_critic(): this run has no critic.")
        data = self.data
        with self._timer("update_critic"):
            self.metrics.update(self.critic.update(
                data, self.plan.critic_update, [self.values, data.scatter(self.critic.dp, {"returns": self.batch.returns})],
                seed=self.step))
        self.trained = True

    def update_actor(self, *, kl_loss: Optional[bool] = None) -> None:
        """``ppo_epochs`` x mini-batches of the actor; stops the run on a non-finite loss or gradient.
        ``kl_loss=False`` trains this step without the KL loss (a pipeline that skipped the reference
        pass); the default follows ``actor.use_kl_loss``, which then needs the reference pass."""
        self._need("update_actor", "advantages")
        p, data, batch, m = self.plan, self.data, self.batch, self.metrics
        settings = p.actor_update
        use_kl = settings.policy.use_kl_loss if kl_loss is None else bool(kl_loss)
        if use_kl and self.ref is None:
            raise PipelineError(f"step {self.step}: actor.use_kl_loss needs the reference log-probs, and this step's "
                                f"pipeline did not compute them: call Step.forward_passes(ref=True) first, or "
                                f"Step.update_actor(kl_loss=False) to train this step without the KL loss.")
        if use_kl != settings.policy.use_kl_loss:
            settings = dataclasses.replace(settings, policy=dataclasses.replace(settings.policy, use_kl_loss=use_kl))
            m["pipeline/kl_loss_off"] = 1.0
        on_policy = self.on_policy and self.old is None  # a pipeline may have asked for the separate pass anyway
        with self._timer("update_actor"):
            kl_ref = self.ref if use_kl else None  # by reference, rank to rank
            res = self.actor.update(data, settings, [self.old, kl_ref, data.scatter(self.actor.dp, loss_fields(batch, p))],
                                    seed=self.step, on_policy=on_policy, rollout_is=p.rollout_is,
                                    bypass=dict(loss=p.bypass, rollout_is=p.rollout_is, rejection=p.rejection,
                                                batch_normalize=p.is_batch_normalize) if self.bypass else None)
            if on_policy:  # the update's own old log-probs: the IS metrics (its ranks applied the weights)
                res, batch.old_log_probs, self.entropy = res[0], (res[1] or {}).get("old_log_probs"), res[2]
                m.update(apply_rollout_is(batch, p.rollout_is, weights=False) if p.rollout_is else {})
            m.update(res)
        check_update(m, self.step)
        self.trained = True
        self._ran.add("update_actor")

    # ------------------------------------------------------------------ 9 weight sync
    def sync_weights(self) -> None:
        """The actor's weights into the rollout engines, checksum-verified (one-step-off: after the
        engines finish the next batch with the old weights; fully async: every
        ``trigger_parameter_sync_step`` steps, the rollouter paused around it)."""
        batches = self.rt.batches
        if batches.schedules_weight_sync:  # fully async (trainer.async_rollout): the source owns the engines' schedule
            self.metrics.update(batches.push(self.step, lambda: self.rt.cluster.rollout.sync_from(self.actor)))
            return
        self.metrics.update(batches.settle())
        with self._timer("update_weights"):
            self.metrics.update(self.rt.cluster.rollout.sync_from(self.actor))

    # ------------------------------------------------------------------ 10 validation
    def validate(self) -> None:
        """Score the held-out set when ``trainer.test_freq`` says this step does (then the
        ``after_eval`` hooks)."""
        rt = self.rt
        if not self.plan.should_eval(self.step, rt.state.last_eval):
            return
        rt.batches.settle()
        with self._timer("testing"):
            self.metrics.update(rt.evaluate(self.step))
        rt.state.last_eval = self.step
        rt.hooks.run("after_eval", self.batch, self.metrics)


def default_pipeline(s: Step) -> None:
    """Coxswain's step (verl's PPO step order); the example to copy for ``trainer.pipeline``."""
    s.generate()  # 1-3. rollout, reward, overlong shaping, DAPO dynamic sampling (hooks: after_rollout/reward/filter)
    if s.plan.rollout_only:  # trainer.debug.rollout_only: generate and score only, no training, no sync
        return
    s.forward_passes()  # 4-5. old log-probs, reference log-probs, critic values: at the same time
    s.hook("before_advantages")
    s.advantages()  # 6-7. rollout IS / rejection, KL in reward, advantages: the driver's math
    if s.critic is not None:  # 8. critic, then actor
        s.update_critic()
    if s.trains_actor:
        s.update_actor()
    s.hook("after_update")
    if s.trains_actor:
        s.sync_weights()  # 9. the actor's weights into the engines, checksum-verified
    s.validate()  # 10. eval (hooks: after_eval); the loop then logs and checkpoints


def run_concurrently(jobs: dict[str, Callable], metrics: dict, *, parallel: bool,
                     lanes: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Run each job and time it as ``timing_s/<name>``: in driver threads at once (``parallel``), else in order.
    ``lanes`` (job -> any key; default: a lane per job): the jobs of one lane run one after another in one
    thread (the same worker processes answer them: a rank must not run two passes at once). The first error
    is raised after all have ended, so no call is left running on a group the caller will use next."""
    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    by_lane: dict[Any, list[str]] = {}
    for k in jobs:
        by_lane.setdefault((lanes or {}).get(k, ("job", k)), []).append(k)
    if not parallel or len(by_lane) < 2:
        results = {k: timed(fn) for k, fn in jobs.items()}
    else:
        with ThreadPoolExecutor(len(by_lane), thread_name_prefix="phase") as pool:
            futs = [pool.submit(lambda names: {k: timed(jobs[k]) for k in names}, names) for names in by_lane.values()]
            errors = [f.exception() for f in futs if f.exception() is not None]
            if errors:
                raise errors[0]
            results = {k: r for f in futs for k, r in f.result().items()}
    for k, (_, dt) in results.items():
        metrics[f"timing_s/{k}"] = metrics.get(f"timing_s/{k}", 0.0) + dt
    return {k: out for k, (out, _) in results.items()}


def _ready(sharded):
    """Wait until a ``Sharded`` result exists in the object store (without fetching it), so its
    phase's time is the pass's own."""
    refs = [r for r in sharded.refs if r is not None]
    if refs and type(refs[0]).__name__ == "ObjectRef":
        import ray  # heavy (about a second); in-process runs (trainer.debug.in_process) never import it

        ray.wait(refs, num_returns=len(refs), fetch_local=False)
    return sharded


def row_multiple(cluster) -> int:
    """The least common multiple of the training groups' DP sizes: a batch size that splits over all."""
    dps = [g.dp for g in (cluster.actor, cluster.ref, cluster.critic) if g is not None]
    return math.lcm(*dps) if dps else 1


def load_pipeline(spec: Optional[str]) -> Callable[[Step], None]:
    return default_pipeline if not spec else load_step_callable(spec, "trainer.pipeline", PIPELINE_PARAMS)


# ----------------------------------------------------------------------------------------------
# the driver's math and the step's metrics
# ----------------------------------------------------------------------------------------------
def apply_rollout_is(batch: RolloutBatch, settings, *, weights: bool = True, normalize: bool = False,
                     rejection=None) -> dict[str, float]:
    """The one driver site of rollout correction (:func:`trainer.algos.correction.compose_correction`):
    the weights of the batch's old vs sampler log-probs (``batch.rollout_is_weights``), the rejection
    mask (``batch.response_mask``: every option of ``rejection`` on the mask as sampled, ANDed) and the
    ``mismatch/`` metrics. ``settings``: a :class:`trainer.plan.RolloutIS` (or its keyword dict), None
    for rejection only. ``weights=False``: metrics only (on the on-policy path the actor's ranks
    computed the weights inside the update, where the old log-probs first exist). ``normalize``
    (verl's ``rollout_is_batch_normalize``): the weights are divided by their mean over the batch: over
    valid tokens at token level, over sequences (one weight each) at sequence / geometric level, so
    they average 1."""
    c = compose_correction(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask, rollout_is=settings,
                           rejection=rejection, apply_weights=weights, batch_normalize=normalize)
    if weights and settings is not None:
        batch.rollout_is_weights = c.weights
    batch.response_mask = c.loss_mask
    return to_float_metrics(c.metrics)


def driver_math(plan, batch: RolloutBatch, *, old, ref, values, kl_ctrl, adca, step: int, epoch: int = 0) -> dict[str, float]:
    """Steps 6-7 on the driver, writing the batch's fields: rejection mask, rollout-IS weights and
    mismatch metrics, KL in reward, critic values, advantages and returns. ``old``, ``ref``,
    ``values``: the role groups' results (``Sharded``, or None), fetched here only where this math
    reads them. ``adca``: ``(judge, tokenizer)`` for ADCA-GRPO (its settings: ``plan.adca``); ``epoch``:
    the data epoch of the batch (ADCA's ``prm_epoch`` gate)."""
    m: dict[str, float] = {}
    if old is not None and plan.driver_needs_old_log_probs():
        got = old.fetch()
        batch.old_log_probs = got["old_log_probs"]
        if getattr(plan, "sum_pi_squared", False):  # actor.calculate_sum_pi_squared: the same pass returned it
            batch.sum_pi_squared = got["sum_pi_squared"]
    # IS weights, their batch normalisation and every rejection option on the mask as sampled, the options
    # ANDed (verl's compute_rollout_correction_and_rejection_mask); rejection masks the loss only: the
    # rewards and the estimator read the batch as sampled (``sampled``), see trainer/algos/correction.py
    sampled = batch.response_mask
    rejection = plan.rejection if plan.bypass is None else None  # bypass mode: in the loss
    if (plan.rollout_is is not None and old is not None) or rejection:  # on-policy: the update's ranks weight
        m.update(apply_rollout_is(batch, plan.rollout_is if old is not None else None,
                                  normalize=plan.is_batch_normalize, rejection=rejection))
    if plan.use_kl_in_reward:
        batch.ref_log_probs = ref.fetch()["ref_log_probs"]
        batch.token_level_rewards, kl_m = apply_kl_in_reward(
            batch.token_level_scores, batch.old_log_probs, batch.ref_log_probs, sampled,
            kl_coef=kl_ctrl.value, kl_penalty=plan.kl_penalty)
        kl_m = to_float_metrics(kl_m)
        kl_ctrl.update(kl_m["actor/reward_kl_penalty"], n_steps=batch.num_samples)
        m.update(kl_m)
    else:
        batch.token_level_rewards = batch.token_level_scores
    if values is not None:
        batch.values = values.fetch()["values"]
    if adca is not None:  # ADCA-GRPO: the judge's step flags fused with the outcome (plan.adca: its settings)
        judge, tok = adca
        batch.advantages, batch.returns, adv_m = adca_advantages(batch, tok, judge, plan.adca, global_step=step, epoch=epoch)
        m.update(to_float_metrics(adv_m))  # adca/*
    else:
        batch.advantages, batch.returns, adv_m = compute_advantage(
            plan.adv_estimator, token_level_rewards=batch.token_level_rewards, response_mask=sampled,
            index=batch.group_ids, values=batch.values, gamma=plan.gamma, lam=plan.lam,
            norm_adv_by_std_in_grpo=plan.norm_adv_by_std_in_grpo, **getattr(plan, "adv_kwargs", {}),
            **({"reward_components": {k: torch.tensor(batch.get_meta(f"reward_component/{k}"), dtype=torch.float64)
                                      for k in plan.reward_keys}} if getattr(plan, "reward_keys", ()) else {}),
            **_otb_inputs(plan, batch))
        # its critic/advantages|returns/* are the batch's; batch_metrics logs them for every estimator
        if batch.response_mask is not sampled:  # rejected tokens carry no advantage (the loss skips them anyway)
            batch.advantages = torch.where(batch.response_mask.bool(), batch.advantages, 0)
    return m


def _otb_inputs(plan, batch: RolloutBatch) -> dict:
    """The optimal token baseline's inputs, as verl's ``compute_advantage`` passes them: the start-of-step
    log-probs, ``sum pi^2`` (the config requires ``actor.calculate_sum_pi_squared``) and the rollout-IS
    weights when they are applied (None otherwise)."""
    if plan.adv_estimator not in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        return {}
    return {"old_log_probs": batch.old_log_probs, "sum_pi_squared": batch.sum_pi_squared,
            "rollout_is_weights": batch.rollout_is_weights}


def loss_fields(batch: RolloutBatch, plan) -> dict[str, torch.Tensor]:
    """The driver-computed per-token fields the actor's loss reads (sent once per shard)."""
    out = {"advantages": batch.advantages, "rollout_is_weights": batch.rollout_is_weights}
    if plan.rejection is not None and plan.bypass is None:  # the rejection-masked loss mask replaces the shard's own
        out["response_mask"] = batch.response_mask
    if plan.bypass is not None:  # bypass mode: the old log-probs are the sampler's
        out["old_log_probs"] = batch.rollout_log_probs
    return out


def check_update(m: dict, step: int) -> None:
    bad = [k for k in ("actor/loss", "actor/grad_norm") if k in m and not math.isfinite(m[k])]
    if bad or m.get("actor/skipped", 0.0) > 0:
        raise FloatingPointError(
            f"step {step}: the actor's {', '.join(bad) or 'gradient'} is NaN/inf, so the update was not "
            f"applied. Check the rewards and advantages (critic/score/*, critic/advantages/* above), lower "
            f"actor_rollout_ref.actor.optim.lr, or keep grad clipping on.")


def batch_metrics(batch: RolloutBatch, plan, *, entropy: dict | None = None, kl_coef: float | None = None,
                  grad_norm: float | None = None) -> dict:
    """verl's ``compute_data_metrics`` over the step's batch (``critic/score|rewards|advantages|
    returns|values/*``, ``critic/vf_explained_var``, ``response_length/*``, ``prompt_length/*``,
    ``response_length_non_aborted/*``, ``response/aborted_ratio``) plus ``reward/acc`` (Coxswain's),
    ``perf/total_num_tokens``, ``actor/entropy`` (verl's: the start-of-step policy's entropy on the
    rollout, aggregated by ``loss_agg_mode``, from the ranks' summed summaries) and ``kl_ctrl/coef``.
    The clip ratios count responses (prompts) at the configured cap ``max_response_length``
    (``max_prompt_length``). ``kl_coef`` None: the rollout-only subset (no training fields).
    With ``sum_pi_squared`` on the batch (``actor.calculate_sum_pi_squared``): verl's
    ``variance_proxy/*`` (:func:`trainer.algos.advantages.variance_proxy_metrics`; ``grad_norm``, the
    step's ``actor/grad_norm``, adds the two proxies that need it)."""
    f64 = torch.float64
    resp_len, prompt_len = batch.response_length.to(f64), batch.prompt_length.to(f64)
    live = resp_len > 0
    if not bool(live.any()):
        live = torch.ones_like(live)
    score = batch.token_level_scores.to(f64).sum(-1)[live]
    rewards = batch.token_level_rewards if batch.token_level_rewards is not None else batch.token_level_scores
    reward = rewards.to(f64).sum(-1)[live]
    m = {"critic/score/mean": float(score.mean()), "critic/score/max": float(score.max()),
         "critic/score/min": float(score.min()),
         "critic/rewards/mean": float(reward.mean()), "critic/rewards/max": float(reward.max()),
         "critic/rewards/min": float(reward.min()), "reward/acc": float(batch.acc.mean())}
    rm = batch.response_mask.bool()
    for name, x in (("advantages", batch.advantages), ("returns", batch.returns), ("values", batch.values)):
        if x is not None and bool(rm.any()):
            v = x.to(f64)[rm]
            m.update({f"critic/{name}/mean": float(v.mean()), f"critic/{name}/max": float(v.max()),
                      f"critic/{name}/min": float(v.min())})
    if batch.values is not None and batch.returns is not None and int(rm.sum()) > 1:
        ret, val = batch.returns.to(f64)[rm], batch.values.to(f64)[rm]
        m["critic/vf_explained_var"] = float(1.0 - torch.var(ret - val) / (torch.var(ret) + 1e-5))
    for name, x, cap in (("response_length", resp_len, plan.response_width),
                         ("prompt_length", prompt_len, plan.max_prompt_length)):
        m.update({f"{name}/mean": float(x.mean()), f"{name}/max": float(x.max()), f"{name}/min": float(x.min()),
                  f"{name}/clip_ratio": float((x == cap).to(f64).mean())})
    na = resp_len[live]
    m.update({"response_length_non_aborted/mean": float(na.mean()), "response_length_non_aborted/max": float(na.max()),
              "response_length_non_aborted/min": float(na.min()),
              "response_length_non_aborted/clip_ratio": float((na == plan.response_width).to(f64).mean()),
              "response/aborted_ratio": float((resp_len == 0).to(f64).mean()),
              "perf/total_num_tokens": float(batch.attention_mask.sum())})
    if kl_coef is None:
        return m
    m["kl_ctrl/coef"] = float(kl_coef)
    if getattr(batch, "sum_pi_squared", None) is not None and batch.advantages is not None:
        m.update(variance_proxy_metrics(old_log_probs=batch.old_log_probs, sum_pi_squared=batch.sum_pi_squared,
                                        advantages=batch.advantages, response_mask=batch.response_mask,
                                        rollout_is_weights=batch.rollout_is_weights, grad_norm=grad_norm))
    if entropy and entropy.get("count"):
        pol = plan.actor_update.policy
        m["actor/entropy"] = entropy_from_summary(entropy, pol.agg_mode, pol.norm_constant)
    return m


# the phases whose time verl also reports per token: generation per response token, the model passes
# and the driver's advantage math per token of the whole batch (prompt + response)
_PER_TOKEN = {"gen": "response", **{k: "all" for k in ("ref", "values", "adv", "update_critic", "update_actor")}}


def timing_metrics(m: dict, batch: RolloutBatch, n_gpus: int) -> dict[str, float]:
    """verl's ``compute_timing_metrics`` and ``compute_throughout_metrics`` from the step's
    ``timing_s/*`` (``timing_s/step`` included): ``timing_per_token_ms/*``, ``perf/total_num_tokens``,
    ``perf/time_per_step`` and ``perf/throughput`` (tokens per second per GPU; on CPU per rank slot,
    ``trainer.nnodes * trainer.n_gpus_per_node``)."""
    resp = float(batch.response_length.sum())
    total = float(batch.attention_mask.sum())
    out = {}
    for name, kind in _PER_TOKEN.items():
        t = m.get(f"timing_s/{name}")
        n = resp if kind == "response" else total
        if t is not None and n > 0:
            out[f"timing_per_token_ms/{name}"] = t * 1000.0 / n
    step = m["timing_s/step"]
    out.update({"perf/total_num_tokens": total, "perf/time_per_step": step,
                "perf/throughput": total / (step * max(n_gpus, 1)) if step > 0 else 0.0})
    return out
