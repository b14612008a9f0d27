"""Fully asynchronous RL (``async_training.mode=fully_async``; verl's ``fully_async_policy`` recipe):
a rollouter thread keeps the engines generating into a bounded queue of scored prompt groups while
the trainer trains; weights are pushed every ``trigger_parameter_sync_step`` updates.

Roles (``trainer.placement=split``: the engines on their own resources)::

    rollouter | gen v0 | gen v0 | gen v0 |pause| gen v1 (resumed + new) | gen v1 | ...
    queue     |    [g g g g] -> FIFO of scored groups, each sample tagged with its weight version
    trainer   |        | take, train | take, train | ... push v1 (every trigger steps) | take, train ...

Versions. The engines' weights carry a version: 0 at the start, +1 at each push (a push follows every
``trigger_parameter_sync_step`` = K trainer steps). Every response token carries the version whose
weights sampled it (``meta["token_versions"]``, with its sampler log-prob in ``rollout_log_probs``);
a sample's version is its FIRST token's (``meta["param_version"]``: the oldest weights that touched
it; ``param_version_max`` the newest). Staleness of a sample trained at a step = the pushes done by
then minus its version.

verl's generation quota. A trainer step takes R = ``ppo_mini_batch_size x require_batches`` groups
(prompts; verl's ``required_samples``), so a version is trained on B = R x K prompts. Per version the
rollouter STARTS at most Q = int(R x (1 + s) x K) prompts, s = ``staleness_threshold`` (verl's
``max_required_samples``), counting, as verl's ``reset_staleness`` does, the prompts still in flight or
queued at the push as already started. Then pauses until the next push.

The staleness bound, from the quota. Say at a push the rollouter holds L prompts started and not yet
trained; during the coming version it starts at most Q - L more, and the trainer takes B of the
prompts in FIFO order before the next push, so at that push L' <= Q - B = s x B remain, all older than
the new ones. If s <= 1 they are all trained in the next version: no trained sample is more than 1
version behind; by induction, none is more than ceil(s) versions behind (s = 0: every sample is
trained in the version that sampled it; between its pushes the actor still takes up to K - 1 updates:
verl's meaning). So ``max_staleness = ceil(staleness_threshold)`` versions; a sample beyond it at the
trainer (only possible when work outlives the protocol, e.g. a filter that drops most groups) is
dropped and counted (``async/dropped_for_staleness``), never trained. A dropped group (DAPO's filter or
staleness) gives its quota back, so filtering cannot starve the trainer.

Pushes. The trainer pauses the rollouter (no new generation call), then either waits for the call in
flight (``partial_rollout=false``) or aborts it (``partial_rollout=true``: the engines' ``abort``, the
unfinished responses return with the tokens sampled so far), loads the new weights (checksum-verified),
and resumes: the aborted responses go first, each re-submitted as prompt + its generated prefix with
the remaining budget, and continue under the new version. The abort lands wherever the engine is, so
where a response is split is timing-dependent (fully async training is not bit-reproducible; every
token's version and log-prob are still exact). The first generation after a push is the resumed work,
so FIFO order holds.

Decoupled PPO (Hilton et al. 2022; AReaL, Fu et al. 2025). The proximal policy is the actor at the
start of each update: the separate old-log-prob pass, or with one mini-batch x one epoch the update's
own forward, which runs at exactly those weights (:meth:`trainer.plan.Plan.on_policy`); the behaviour policy is the sampler's per-token
log-probs whatever version sampled each token, and rollout IS / rejection and the PPO clip see exactly
those. (Deviation from verl: verl's fully-async trainer computes old log-probs with the weights of
the last push for every step of a sync period; here it is each step's start-of-step actor, the
issue's decoupled PPO.)

Resume. The queue holds groups in the order their prompts were drawn from the sampler (completed
groups wait in a reorder buffer for every earlier prompt), and the trainer takes them in that order,
so the prompts drawn and not yet trained are a suffix of the sampler's sequence. A checkpoint saves
where that suffix starts (the sampler state before the draw holding its first prompt, the draw's size
and the prompt's place in it: ``async_frontier.json``); a resume restarts the sampler there, so the
queued, in-flight and drawn-but-not-started prompts are generated again (with the resumed weights),
none is lost and none trained twice. (Groups DAPO dropped after the frontier are generated again too.)
The engines restart from the checkpoint's weights, labelled with the number of pushes the run had done
(``step // trigger_parameter_sync_step``).

Streaming. The rollouter keeps ``rollout.concurrent_calls`` generation calls in flight (two threads on
native engine workers, one elsewhere). The native engine admits a call that arrives while another runs
into that call's loop (:meth:`trainer.rollout.native.NativeEngine.generate`), so as the first call's
short responses finish, the second call's prompts take their slots: the engines decode full batches
instead of one call's long tail, and each call's groups reach the queue when that call returns. Versions
are unaffected: a push pauses the rollouter and aborts (or waits for) every call in flight first.

DAPO dynamic sampling runs in the rollouter: each generation call's constant groups are dropped before
they reach the queue. Multi-turn episodes run as whole calls (no partial rollout).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from trainer.algos.filtering import group_filter, select_filter_metric
from trainer.batch import RolloutBatch
from trainer.generation import PipelineError, fit_rows, generate_scored, score_outputs
from trainer.rollout.engine import GenerationOutput, extend_routes

FRONTIER_FILE = "async_frontier.json"


@dataclass(frozen=True)
class AsyncSettings:
    required: int  # R: prompt groups per trainer step (ppo_mini_batch_size x require_batches)
    trigger: int  # K: trainer steps between weight pushes
    staleness_threshold: float  # s: verl's fraction
    quota: int  # Q = int(R x (1 + s) x K): prompts started per weight version
    max_staleness: int  # ceil(s): versions a trained sample may be behind
    partial: bool  # partial_rollout
    unit: int  # prompts per generation call (DAPO: data.gen_batch_size; else ppo_mini_batch_size)

    @classmethod
    def from_config(cls, cfg) -> "AsyncSettings":
        at, a = cfg.async_training, cfg.actor_rollout_ref.actor
        required = int(a.ppo_mini_batch_size * at.require_batches)
        s, k = float(at.staleness_threshold), int(at.trigger_parameter_sync_step)
        quota = int(required * (s + 1) * k)
        unit = int(cfg.data.gen_batch_size or cfg.data.train_batch_size) if cfg.algorithm.filter_groups.enable \
            else int(a.ppo_mini_batch_size)
        return cls(required=required, trigger=k, staleness_threshold=s, quota=quota, max_staleness=math.ceil(s),
                   partial=bool(at.partial_rollout), unit=max(1, min(unit, quota)))


@dataclass(eq=False)
class _Prompt:
    """One prompt from its draw until its group is handed to the trainer (or dropped)."""
    seq: int  # draw order: the queue keeps it
    index: int  # dataset index
    gid: int
    item: dict
    epoch: int
    origin: tuple  # (sampler state before its draw, the draw's size, its place in the draw)
    params: dict  # its sampling params (n, budget, seed)
    outs: list = field(default_factory=list)  # n GenerationOutput-like [tokens, logprobs, versions, finish, routed_experts]


class AsyncBatchSource:
    """The trainer's batches in fully-async mode, with the loop's interface of
    :class:`trainer.batch_source.BatchSource` (``take``, ``prefetch``, ``settle``, ``save``, ``load``,
    ``close``); it declares ``schedules_weight_sync``, so :meth:`trainer.step.Step.sync_weights` hands
    it the weight sync as ``push``."""

    schedules_weight_sync = True  # the rollouter's versions decide when the engines take new weights

    def __init__(self, gen, state, plan):
        self.gen, self.state, self.plan = gen, state, plan
        self.st: AsyncSettings = plan.fully_async
        self.rollout = gen.rollout
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        # generation calls kept in flight at once: with an engine that admits a call into its running loop
        # (the native engine's streaming admission), a second call's prompts fill the slots the first
        # call's finished responses free, so the engines never decode a shrinking long tail alone
        self.streams = max(1, int(getattr(self.rollout, "concurrent_calls", 1)))
        self._error: Optional[BaseException] = None
        self._stop = False
        self._hold = False  # the trainer holds the engines (push, validation, checkpoint)
        self._generating = 0  # calls generating
        self._working = 0  # calls generating or scoring, until their groups are queued
        self.version = 0  # pushes done (the engines' weights)
        self._count = 0  # prompts started under this version (verl's staleness_samples)
        self._drawn: deque[_Prompt] = deque()  # drawn from the sampler, not started
        self._pending: list[_Prompt] = []  # started, some responses aborted by a push: resumed first
        self._done: dict[int, object] = {}  # reorder buffer: seq -> [group batch, ...] or None (dropped)
        self._queue: deque = deque()  # (prompt, group batch), FIFO in draw order
        self._next_flush = 0  # the smallest seq not yet queued or dropped
        self._seq = 0  # the next seq to draw
        self._live = 0  # drawn and not yet taken / dropped
        self._resume_draw: Optional[tuple[int, int]] = None  # (draw size, skip) of the first draw after a resume
        self._origins: dict[int, tuple] = {}  # seq -> origin, for every live prompt
        self._trained = 0  # groups handed to the trainer since the start (or the resume)
        self._start_step = 0
        # metrics
        self.dropped_for_staleness = 0
        self._busy = 0.0  # generation seconds since the last take
        self._busy_since: Optional[float] = None
        self._last_take: Optional[float] = None
        self._call_metrics: list[dict] = []
        self._kept = [0, 0]  # DAPO: kept groups, generated groups since the last take

    # ------------------------------------------------------------------ the loop's calls
    def take(self, step: int, m: dict):
        """``R`` groups in draw order (blocks only while the queue is short); stale groups are dropped
        and counted. Returns ``(batch, epoch)``; the step's ``async/*`` metrics go into ``m``."""
        self._start(step)
        t0 = time.perf_counter()
        R, groups = self.st.required, []
        with self._cond:
            self._hold = False
            self._cond.notify_all()
            depth = len(self._queue)
            while len(groups) < R:
                while not self._queue and self._error is None:
                    if self._working == 0 and not self._pending and self._count >= self.st.quota:
                        raise PipelineError(
                            f"step {step}: the rollouter has started its quota of {self.st.quota} prompts for weight "
                            f"version {self.version} and the queue is empty: nothing more comes until the next push. "
                            f"A trainer.pipeline must call Step.sync_weights() every step (it pushes every "
                            f"async_training.trigger_parameter_sync_step steps).")
                    self._cond.wait()
                if self._error is not None:
                    raise RuntimeError(f"the fully-async rollouter failed: {type(self._error).__name__}: "
                                       f"{self._error}") from self._error
                p, g = self._queue.popleft()
                self._live -= 1
                self._origins.pop(p.seq, None)
                if self.version - min(g.get_meta("param_version")) > self.st.max_staleness:
                    self.dropped_for_staleness += 1
                    self._count -= 1  # its quota back
                    self._cond.notify_all()
                    continue
                groups.append((p, g))
                self._trained += 1
            self._cond.notify_all()
            now = time.perf_counter()
            busy = self._busy + (now - self._busy_since if self._busy_since is not None else 0.0)
            window = now - (self._last_take if self._last_take is not None else t0)
            self._busy, self._busy_since = 0.0, (now if self._busy_since is not None else None)
            self._last_take = now
            calls, self._call_metrics = self._call_metrics, []
            kept, self._kept = self._kept, [0, 0]
            version = self.version
        wait = time.perf_counter() - t0
        batch = RolloutBatch.cat([g for _, g in groups])
        gm = _merge_call_metrics(calls)
        gm["timing_s/gen"] = wait  # verl's fully-async gen time: the trainer's wait for the queue
        if self.plan.filter_groups.get("enable"):
            gm["filter/kept_group_fraction"] = kept[0] / max(kept[1], 1)
        if self.gen.hooks:
            batch = fit_rows(self.gen.hooks.run("after_filter", batch, gm), self.gen.row_multiple, gm)
        m.update(gm)
        m.update(staleness_metrics(batch, version, self.st.max_staleness))
        m.update({"async/queue_groups": float(depth), "async/trainer_idle_s": wait,
                  "async/engine_idle_s": max(window - busy, 0.0), "async/param_version": float(version),
                  "async/dropped_for_staleness": float(self.dropped_for_staleness),
                  "async/staleness_updates_max": float(step - 1 - min(batch.get_meta("param_version")) * self.st.trigger)})
        return batch, max(p.epoch for p, _ in groups)

    def prefetch(self, step: int) -> None:
        """Nothing to start: the rollouter generates continuously."""

    def settle(self) -> dict:
        """Hold the engines for the trainer (validation, checkpoint): no new generation call, the one in
        flight finished (or, with partial rollout, aborted and kept for resumption). The next ``take``
        releases them."""
        self._pause(abort=self.st.partial)
        return {}

    def push(self, step: int, sync) -> dict:
        """After a step's update: every ``trigger_parameter_sync_step`` steps, pause the rollouter,
        ``sync()`` the actor's weights into the engines (the caller's verified sync), count the work
        carried over against the new version's quota, resume. ``async/pause_s``: stopping the engines
        (waiting for / aborting the call in flight); ``async/resume_s``: loading the weights and
        restarting."""
        if step % self.st.trigger != 0:
            return {"async/pushed": 0.0}
        t0 = time.perf_counter()
        held = self._hold
        self._pause(abort=self.st.partial)
        t1 = time.perf_counter()
        m = dict(sync())
        with self._cond:
            m["async/started_prompts"] = float(self._count)  # under the version that ends: <= the quota
            self.version += 1
            self._count = self._live - len(self._drawn)  # started, not yet trained: carried over (verl)
            self._hold = held
            self._cond.notify_all()
        t2 = time.perf_counter()
        m.update({"async/pushed": 1.0, "async/pause_s": t1 - t0, "async/resume_s": t2 - t1,
                  "timing_s/update_weights": t2 - t1})
        return m

    # ------------------------------------------------------------------ checkpoints
    def save(self, ckpt_dir: str) -> None:
        """``async_frontier.json``: where the untrained suffix of the sampler's sequence starts."""
        self._pause(abort=self.st.partial)
        with self._cond:
            front = self._frontier()
            info = {**front, "version": self.version, "dropped_for_staleness": self.dropped_for_staleness}
        with open(os.path.join(ckpt_dir, FRONTIER_FILE), "w") as f:
            json.dump(info, f)

    def load(self, ckpt_dir: str) -> bool:
        """Restart the sampler at the saved frontier (the queued and in-flight prompts of the saved run
        are drawn again). Returns False: there is no prefetched batch in this mode."""
        path = os.path.join(ckpt_dir, FRONTIER_FILE)
        if not os.path.isfile(path):
            return False
        with open(path) as f:
            info = json.load(f)
        self.state.sampler.load_state_dict(info["sampler"])
        if info.get("draw"):
            self._resume_draw = (int(info["draw"]), int(info["skip"]))
        self.dropped_for_staleness = int(info.get("dropped_for_staleness", 0))
        print(f"fully async: the sampler restarts at the first untrained prompt (epoch {info['sampler']['epoch']}, "
              f"offset {info['sampler']['offset']}, skip {info.get('skip', 0)})", flush=True)
        return False

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._threads:
            self._abort_until_idle(abort=True)
            for t in self._threads:
                t.join()

    # ------------------------------------------------------------------ the trainer's side, internals
    def _start(self, step: int) -> None:
        if self._threads:
            return
        self._start_step = step - 1
        self.version = (step - 1) // self.st.trigger  # pushes the run has done (a resume: its weights are newer)
        self._threads = [threading.Thread(target=self._run, name=f"rollouter-{i}", daemon=True)
                         for i in range(self.streams)]
        for t in self._threads:
            t.start()

    def _pause(self, abort: bool) -> None:
        if not self._threads:
            return
        with self._cond:
            self._hold = True
            self._cond.notify_all()
        self._abort_until_idle(abort)
        if self._error is not None:
            raise RuntimeError(f"the fully-async rollouter failed: {type(self._error).__name__}: "
                               f"{self._error}") from self._error

    def _abort_until_idle(self, abort: bool) -> None:
        """Wait for the generation calls in flight to return; with ``abort``, abort them (again every
        50 ms: an abort that reaches an engine before its call starts is cleared by the call)."""
        while True:
            with self._cond:
                if self._generating == 0:
                    return
                if not abort:
                    self._cond.wait()
                    continue
            self.rollout.abort()
            with self._cond:
                if self._generating:
                    self._cond.wait(0.05)

    def _frontier(self) -> dict:
        """The first prompt not yet trained (or dropped): its origin; the sampler's position when none
        is drawn. Called with the engines held."""
        if self._origins:
            state, draw, skip = self._origins[min(self._origins)]
            return {"sampler": state, "draw": draw, "skip": skip}
        if self._resume_draw is not None:  # nothing drawn since the resume: the same frontier again
            return {"sampler": self.state.sampler.state_dict(), "draw": self._resume_draw[0],
                    "skip": self._resume_draw[1]}
        return {"sampler": self.state.sampler.state_dict(), "draw": 0, "skip": 0}

    # ------------------------------------------------------------------ the rollouter thread
    def _run(self) -> None:
        try:
            while True:
                work = self._next_work()
                if work is None:
                    return
                self._generate_and_queue(work)
        except BaseException as e:  # noqa: BLE001 - surfaced to the trainer at its next take / push
            with self._cond:
                self._error = self._error or e
                self._cond.notify_all()

    def _needed(self) -> int:
        """Groups the rest of the run will train: the rollouter draws no further."""
        return (self.plan.total_steps - self._start_step) * self.st.required - self._trained

    def _next_work(self):
        """Under the lock: wait until the engines may work, then the next call's prompts (the resumed
        ones first) and mark the engines busy. None: stop."""
        with self._cond:
            while True:
                if self._stop or self._error is not None:
                    return None
                if not self._hold:
                    if self._pending:
                        work, self._pending = self._pending, []
                        break
                    room = self.st.quota - self._count
                    if room > 0 and not self._drawn and self._live < self._needed():
                        self._draw()
                    if room > 0 and self._drawn:
                        work = [self._drawn.popleft() for _ in range(min(room, self.st.unit, len(self._drawn)))]
                        self._count += len(work)
                        break
                self._cond.wait()
            self._generating += 1
            self._working += 1
            if self._busy_since is None:  # the engines are busy while any call generates
                self._busy_since = time.perf_counter()
            return work

    def _draw(self) -> None:
        """One draw of ``unit`` prompts from the sampler (the first after a resume: the rest of the saved
        frontier's draw)."""
        st, p = self.state, self.plan
        before = st.sampler.state_dict()
        size, skip = self._resume_draw or (self.st.unit, 0)
        self._resume_draw = None
        idx = st.sampler.next(size)[skip:]
        for pos, i in enumerate(idx, start=skip):
            seq = self._seq
            self._seq += 1
            params = p.sampling.params(seq + 1, 0)
            pr = _Prompt(seq=seq, index=int(i), gid=st.next_group_id, item=self.gen.train_ds[i], epoch=st.sampler.epoch,
                         origin=(before, size, pos), params=params)
            st.next_group_id += 1
            self._origins[seq] = pr.origin
            self._drawn.append(pr)
            self._live += 1

    def _call(self, work: list[_Prompt]) -> None:
        """One generation call over ``work``: new prompts (``n`` samples each) and resumed samples (the
        prompt + the prefix sampled so far, the remaining budget). Tokens are tagged with the version
        the engines held for the whole call (a push waits for / aborts the call first)."""
        version = self.version
        prompts, params, slots = [], [], []  # slots: (prompt, sample index or None for all n)
        for pr in work:
            if not pr.outs:
                prompts.append(list(pr.item["input_ids"]))
                params.append(pr.params)
                slots.append((pr, None))
                continue
            for j, (toks, lps, vers, fin, _) in enumerate(pr.outs):
                if fin != "abort":
                    continue
                budget = pr.params["max_new_tokens"] - len(toks)
                prompts.append(list(pr.item["input_ids"]) + list(toks))
                params.append({**pr.params, "n": 1, "max_new_tokens": budget,
                               "seed": pr.params["seed"] * 31 + j * 7919 + len(toks)})
                slots.append((pr, j))
        if self.st.partial:  # one params per prompt: each sample its own stream and budget
            outs = self.rollout.generate(prompts, params)
        else:
            outs = self.rollout.generate(prompts, params[0])
        for (pr, j), got in zip(slots, outs):
            if j is None:
                pr.outs = [[list(o.token_ids), list(o.logprobs), [version] * len(o.token_ids), o.finish_reason,
                            o.routed_experts] for o in got]
            else:
                o = got[0]
                toks, lps, vers, _, routes = pr.outs[j]
                pr.outs[j] = [toks + list(o.token_ids), lps + list(o.logprobs), vers + [version] * len(o.token_ids),
                              o.finish_reason, extend_routes(routes, o.routed_experts)]

    def _generate_and_queue(self, work: list[_Prompt]) -> None:
        p, g, m = self.plan, self.gen, {}
        gen_params = dict(work[0].params)
        t0 = time.perf_counter()
        batch = None
        try:
            if p.multi_turn is not None:  # whole episodes, in one call (no partial rollout)
                version = self.version
                batch, m = generate_scored(self.rollout, g.reward_mgr, g.tok, [w.item for w in work],
                                           [w.gid for w in work], gen_params, max_prompt_length=p.max_prompt_length,
                                           overlong=p.overlong, multi_turn=p.multi_turn,
                                           reward_keys=getattr(p, "reward_keys", ()), reward_model=g.reward_model,
                                           hooks=g.hooks)
                for w in work:
                    w.outs = [[None, None, None, "stop", None]]
                batch.set_meta("token_versions", [[version] * int(n) for n in batch.response_length.tolist()])
            else:
                self._call(work)
        finally:
            with self._cond:
                self._generating -= 1
                now = time.perf_counter()
                if self._generating == 0 and self._busy_since is not None:
                    self._busy += now - self._busy_since
                    self._busy_since = None
                self._cond.notify_all()
        complete = [w for w in work if all(o[3] != "abort" for o in w.outs)]
        aborted = [w for w in work if any(o[3] == "abort" for o in w.outs)]
        if batch is None and complete:
            outs = [[GenerationOutput(o[0], o[1], o[3], o[4]) for o in w.outs] for w in complete]
            batch, m = score_outputs(g.reward_mgr, g.tok, [w.item for w in complete], outs, [w.gid for w in complete],
                                     gen_params, m, max_prompt_length=p.max_prompt_length, overlong=p.overlong,
                                     reward_keys=getattr(p, "reward_keys", ()), reward_model=g.reward_model, hooks=g.hooks)
            batch.set_meta("token_versions", [vers for w in complete for (_, _, vers, _, _) in w.outs])
        m["timing_s/generate"] = m.get("timing_s/generate", 0.0) or (time.perf_counter() - t0)
        groups: dict[int, object] = {}
        if batch is not None:
            by_gid = {w.gid: w for w in complete}
            tv = batch.get_meta("token_versions")
            batch.set_meta("param_version", [min(v) if v else self.version for v in tv])
            batch.set_meta("param_version_max", [max(v) if v else self.version for v in tv])
            batch.set_meta("prompt_index", [by_gid[int(x)].index for x in batch.group_ids.tolist()])
            gids = batch.group_ids
            keep_gids = set(by_gid)
            if p.filter_groups.get("enable"):
                fields = {"acc": batch.acc, "score": batch.scores, "token_level_scores": batch.token_level_scores,
                          "token_level_rewards": batch.token_level_scores, "response_mask": batch.response_mask}
                keep, _ = group_filter(select_filter_metric(p.filter_groups["metric"], fields), gids)
                keep_gids = {int(x) for x in torch.unique(gids[keep]).tolist()}
            for gid, w in by_gid.items():
                rows = (gids == gid).nonzero().squeeze(-1)
                groups[w.seq] = batch[rows] if gid in keep_gids and len(rows) else None
        with self._cond:
            if p.filter_groups.get("enable"):
                self._kept[0] += sum(x is not None for x in groups.values())
                self._kept[1] += len(groups)
            self._call_metrics.append(m)
            self._pending = aborted + self._pending
            for w in complete:
                self._done[w.seq] = (w, groups.get(w.seq))
            while self._next_flush in self._done:  # into the queue in draw order
                w, grp = self._done.pop(self._next_flush)
                self._next_flush += 1
                if grp is None:  # dropped by the filter: done, its quota back
                    self._live -= 1
                    self._count -= 1
                    self._origins.pop(w.seq, None)
                else:
                    self._queue.append((w, grp))
            self._working -= 1
            self._cond.notify_all()


def staleness_metrics(batch, version: int, bound: int) -> dict[str, float]:
    """Per batch: staleness (pushes done minus each sample's version, its first token's) mean / max /
    min, the fraction of samples at each staleness 0..bound (``async/staleness_hist/<d>``: the version
    histogram, relative to the trainer's) and of samples whose tokens span several versions."""
    v = torch.tensor(batch.get_meta("param_version"), dtype=torch.float64)  # [B]
    vmax = torch.tensor(batch.get_meta("param_version_max"), dtype=torch.float64)  # [B]
    s = version - v
    out = {"async/staleness/mean": float(s.mean()), "async/staleness/max": float(s.max()),
           "async/staleness/min": float(s.min()), "async/partial_samples": float((vmax > v).double().mean())}
    for d in range(bound + 1):
        out[f"async/staleness_hist/{d}"] = float((s == d).double().mean())
    return out


def _merge_call_metrics(calls: list[dict]) -> dict[str, float]:
    """The generation calls' metrics since the last take: times and counts summed, the rest averaged."""
    out: dict[str, float] = {}
    keys = {k for c in calls for k in c}
    for k in keys:
        vals = [float(c[k]) for c in calls if k in c]
        out[k] = sum(vals) if k.startswith(("timing_s/", "pipeline/")) else sum(vals) / len(vals)
    return out
