"""The reward manager: score a batch of responses in parallel and place each score on its last token.

``RewardManager(num_workers, timeout, custom_path=None, custom_name="compute_score", kind="naive",
scorer_kwargs=None, eos_token=None)`` keeps a pool of scorer processes for the whole run.
``score(responses, ground_truths, data_sources, extra_infos, response_mask)`` returns
``(token_level_scores [B, T], metrics, extras)``:

* ``token_level_scores[i, t_i] = score_i`` where ``t_i`` is the LAST position with
  ``response_mask[i] == 1`` (every other entry is 0): the outcome reward sits on the token that ended
  the response, as GAE / GRPO expect. A row with an all-zero mask gets no score placed and is counted
  in ``reward/empty_responses``.
* ``extras = {"scores": [B] float32, "acc": [B] float32, "per_sample": list of B dicts}``. Each
  per-sample dict has the same keys: the scorer's extra keys (``pred``, ``status``, ...; missing ones
  are None) plus ``reward_status`` (``ok`` | ``error`` | ``timeout``).
* ``metrics``: ``reward/score_mean``, ``reward/acc_mean``, ``reward/errors`` (raised, timed out, bad
  return value or a crashed worker), ``reward/error_fraction`` (errors / B), ``reward/timeouts``,
  ``reward/worker_restarts``, ``reward/empty_responses``, ``reward/time_s`` and
  ``reward/acc/<data_source>`` per source.

The managers (``kind``, verl's ``reward_model.reward_manager``; verl's ``verl/workers/reward_manager``):

* ``naive``: one call per response, ``fn(data_source=, solution_str=, ground_truth=, extra_info=)``.
* ``prime``: the same calls; verl's prime manager exists to run them in a process pool with a
  timeout, which every manager here does.
* ``dapo``: the same calls on the response text with a trailing EOS string removed (verl's
  ``DAPORewardManager``); its overlong shaping (``reward_kwargs.overlong_buffer_cfg``) is applied by
  the driver (:func:`trainer.algos.filtering.overlong_reward_penalty`), the same term as verl's.
* ``batch``: ONE call for the batch, ``fn(data_sources=, solution_strs=, ground_truths=,
  extra_infos=, **reward_model.reward_kwargs)`` returning a list of B numbers or dicts; it runs in a
  pool worker with a deadline of ``timeout`` x B. A failed call fails every response.

``scorer_kwargs`` are bound to every call and win over the call's own keywords, as verl's
``custom_reward_function.reward_kwargs``. ``extra_info`` is always a dict (``{}`` when the row has none).

Failure policy: a scorer that raises, returns a non-finite or malformed value, kills its worker, or
runs past ``timeout`` seconds gives that sample score 0 and acc 0 and is counted. The first error's
traceback (and the first timeout) is logged once per manager. When EVERY response of a batch fails,
``score`` raises :class:`RewardError` with the first traceback: a step trained on all-zero rewards
learns nothing and hides a broken scorer (verl would go on and exit 0). A hung scorer does not hang
the pool: at most ``num_workers`` samples are in flight, each with a deadline ``timeout`` seconds after
it was handed to an idle worker; when one expires the pool's processes are killed and a fresh pool
takes the remaining samples (the innocent in-flight ones restart with a fresh deadline). When a worker
dies on its own, the samples that were in flight are re-run one at a time, so the one that kills its
worker is identified and only it fails.

Scorers: a custom function (``custom_reward_function.path`` + ``.name``, as in verl); ``path`` is a
python file or an importable module. Without one, ``trainer.rewards.scorers.compute_score``
dispatches on ``data_source``. A result is a number (score; acc = score) or a dict with ``score`` and
optionally ``acc`` (else acc = score) and any extra keys.

``num_workers=0`` scores in the calling process, serially: ``breakpoint()`` works in a scorer, but no
timeout can be enforced there (errors are still caught and counted).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import math
import multiprocessing as mp
import os
import sys
import time
import traceback
import types
from collections import deque
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Sequence

import torch

from trainer.rewards.scoring_worker import _init_worker, _ping, _score_batch, _score_one, load_custom_fn, make_scorer

__all__ = ["MANAGERS", "RewardError", "RewardManager", "load_custom_fn"]

# verl's registered reward managers (``reward_model.reward_manager``)
MANAGERS = ("naive", "prime", "dapo", "batch")


class RewardError(RuntimeError):
    """Every response of a batch failed to score: the run stops rather than train on zeros."""


def timeout_text(mgr, b: int) -> str:
    t = mgr.timeout * (b if mgr.kind == "batch" else 1) if mgr.timeout else None
    return f"{t:.1f} s" if t else "no limit"

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _bare_main():
    """Hide the driver's ``__main__`` while pool workers start. With spawn / forkserver, each worker
    would otherwise re-import it (for ``python -m trainer.main``: torch, Ray, megatron, seconds per
    worker). Scorer workers never need it: their functions come from ``scoring_worker`` and custom
    scorers are loaded by file path."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


class RewardManager:
    """Parallel, fault-tolerant scoring. See the module docstring."""

    def __init__(
        self,
        num_workers: int = 1,
        timeout: float | None = 10.0,
        custom_path: str | None = None,
        custom_name: str = "compute_score",
        mp_context: str = "forkserver",
        kind: str = "naive",
        scorer_kwargs: dict | None = None,
        eos_token: str | None = None,
    ):
        if kind not in MANAGERS:
            raise ValueError(f"reward manager {kind!r}: choose one of {list(MANAGERS)}")
        if kind == "batch" and not custom_path:
            raise ValueError("the batch reward manager calls a batch scorer: set custom_reward_function.path "
                             "(and .name) to a function taking data_sources, solution_strs, ground_truths, extra_infos")
        self.kind = kind
        self.num_workers = int(num_workers)
        self.timeout = float(timeout) if timeout and timeout > 0 else None
        self.custom_path = custom_path or None
        self.custom_name = custom_name or "compute_score"
        self.scorer_kwargs = dict(scorer_kwargs or {})
        self.eos_token = eos_token if kind == "dapo" else None
        self.mp_context = mp_context
        # Load once here too: a wrong path or name fails at start-up with a clear message, not as
        # B scorer errors per step. In-process mode also uses this function.
        self._fn = make_scorer(self.custom_path, self.custom_name, self.scorer_kwargs)
        self._pool: cf.ProcessPoolExecutor | None = None
        self._logged_error = False
        self._logged_timeout = False
        self.worker_restarts = 0

    @classmethod
    def from_config(cls, cfg, tokenizer=None) -> "RewardManager":
        """The run's manager from ``reward_model.*`` and ``custom_reward_function.*``. As verl does,
        ``custom_reward_function.reward_kwargs`` are bound to the scorer, and the batch manager also
        passes ``reward_model.reward_kwargs`` to it (the dapo manager's own keywords are the overlong
        shaping, which the driver applies: ``trainer.plan.overlong_shaping``)."""
        from omegaconf import OmegaConf

        rm, crf = cfg.reward_model, cfg.custom_reward_function
        kw = OmegaConf.to_container(rm.reward_kwargs, resolve=True) if rm.reward_manager == "batch" else {}
        kw.update(OmegaConf.to_container(crf.reward_kwargs, resolve=True))
        sf = rm.sandbox_fusion
        if sf.url and not crf.path:  # as verl: the remote sandbox reaches the built-in code scorer
            kw.update(sandbox_fusion_url=sf.url, memory_limit_mb=sf.memory_limit_mb, max_concurrent=sf.max_concurrent)
        if rm.sandbox.allow_weak_containment:
            # read by trainer.rewards.sandbox in every scorer process (also a user's scorer calling run_code)
            from trainer.rewards.sandbox import ALLOW_WEAK_ENV

            os.environ[ALLOW_WEAK_ENV] = "1"
        return cls(num_workers=rm.num_workers, timeout=rm.timeout, custom_path=crf.path, custom_name=crf.name,
                   kind=rm.reward_manager, scorer_kwargs=kw, eos_token=getattr(tokenizer, "eos_token", None))

    # -- pool lifecycle ------------------------------------------------------------------------
    def _new_pool(self) -> cf.ProcessPoolExecutor:
        ctx = mp.get_context(self.mp_context)
        if self.mp_context == "forkserver":
            # Imported once in the fork server, inherited by every worker (effective before it starts).
            ctx.set_forkserver_preload(["trainer.rewards.orphan_guard", "trainer.rewards.scoring_worker",
                                        "trainer.rewards.scorers", "math_verify"])
        pool = cf.ProcessPoolExecutor(
            self.num_workers, mp_context=ctx, initializer=_init_worker,
            initargs=(self.custom_path, self.custom_name, self.scorer_kwargs)
        )
        # Start every worker now (3.11 spawns them on submit) and wait until each has answered, so
        # start-up never counts against a sample's deadline.
        seen: set[int] = set()
        t_end = time.monotonic() + 120
        while len(seen) < self.num_workers and time.monotonic() < t_end:
            try:
                with _bare_main():  # processes are started inside submit()
                    warm = [pool.submit(_ping, 0.05) for _ in range(self.num_workers)]
            except BrokenProcessPool as e:
                raise RuntimeError(
                    f"reward: the scorer processes died while starting ({e}). Check that "
                    f"custom_reward_function.path={self.custom_path!r} imports in a fresh python process, "
                    f"or set reward_model.num_workers=0 to score in the trainer process."
                ) from e
            done, _ = cf.wait(warm, timeout=max(0.0, t_end - time.monotonic()))
            seen.update(f.result() for f in done if f.exception() is None)
        if len(seen) < self.num_workers:
            logger.warning("reward: only %d of %d scorer processes answered within 120 s", len(seen), self.num_workers)
        return pool

    def _pool_ready(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = self._new_pool()
        return self._pool

    def _kill_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        procs = list((getattr(pool, "_processes", None) or {}).values())
        if hasattr(pool, "kill_workers"):  # python >= 3.14
            pool.kill_workers()
        else:
            for p in procs:
                try:
                    p.kill()
                except (OSError, ValueError, AttributeError):
                    pass
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            try:
                p.join(timeout=5)
            except (OSError, ValueError, AssertionError):
                pass
        self.worker_restarts += 1

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- scoring -------------------------------------------------------------------------------
    def _score_whole_batch(self, responses, ground_truths, data_sources, extra_infos) -> list[tuple]:
        """The batch manager: one scorer call for the whole batch, in a pool worker (deadline
        ``timeout`` x batch size) or in process; a failed call fails every response."""
        b = len(responses)
        job = (list(data_sources), responses, list(ground_truths), extra_infos)
        if self.num_workers <= 0:
            res = _score_batch(self._fn, *job)
        else:
            res = self._run_all([job], func=_score_batch, timeout=self.timeout * b if self.timeout else None)[0]
        if res[0] == "ok":
            return list(res[1])
        return [res] * b

    def _run_all(self, jobs: list[tuple], func=_score_one, timeout: float | None = None) -> list[tuple]:
        """Run ``func(None, *job)`` for every job in the pool, ``timeout`` seconds each (default the
        manager's); returns one outcome tuple per job (see ``_score_one``) or ("timeout",)."""
        n = len(jobs)
        out: list[tuple | None] = [None] * n
        timeout = timeout or self.timeout
        if self.num_workers <= 0:
            return [func(self._fn, *j) for j in jobs]
        queue = deque(range(n))  # normal scheduling, num_workers in flight
        isolate: deque[int] = deque()  # after a worker died: re-run alone to find the culprit
        inflight: dict[cf.Future, tuple[int, float, bool]] = {}  # future -> (job, deadline, alone)
        while queue or isolate or inflight:
            pool = self._pool_ready()
            alone = bool(isolate)
            window = 1 if alone else self.num_workers
            src = isolate if alone else queue
            while src and len(inflight) < window:
                i = src.popleft()
                deadline = time.monotonic() + timeout if timeout else math.inf
                try:
                    inflight[pool.submit(func, None, *jobs[i])] = (i, deadline, alone)
                except (BrokenProcessPool, RuntimeError):
                    # the pool broke between results (a worker died while idle): retry on a fresh one
                    src.appendleft(i)
                    break
            if not inflight:
                self._kill_pool()
                continue
            nearest = min(d for _, d, _ in inflight.values())
            wait_s = None if nearest == math.inf else max(0.0, nearest - time.monotonic())
            done, _ = cf.wait(list(inflight), timeout=wait_s, return_when=cf.FIRST_COMPLETED)
            broken: list[tuple[int, bool]] = []
            for f in done:
                i, _, was_alone = inflight.pop(f)
                try:
                    out[i] = f.result()
                except BrokenProcessPool:
                    broken.append((i, was_alone))
                except BaseException:  # noqa: BLE001 - e.g. an unpicklable result
                    out[i] = ("error", traceback.format_exc(limit=20))
            now = time.monotonic()
            expired = [f for f, (_, d, _) in inflight.items() if d <= now]
            if broken:
                # A worker died (os._exit, segfault, OOM kill). Whoever ran alone is the culprit;
                # the others (and any still in flight, whose futures are broken too) re-run alone.
                for i, was_alone in broken:
                    if was_alone:
                        out[i] = ("error", "the scorer's worker process died (crash, os._exit or OOM kill)")
                    else:
                        isolate.append(i)
                for f, (i, _, _) in list(inflight.items()):
                    isolate.append(i)
                inflight.clear()
                self._kill_pool()
            elif expired:
                for f in expired:
                    i, _, _ = inflight.pop(f)
                    out[i] = ("timeout",)
                # The hung worker cannot be interrupted: replace the pool. Innocent in-flight samples
                # go back to the front of their queue and get a fresh deadline.
                for f, (i, _, was_alone) in list(inflight.items()):
                    (isolate if was_alone else queue).appendleft(i)
                inflight.clear()
                self._kill_pool()
        return out  # type: ignore[return-value]

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        data_sources: Sequence[str],
        extra_infos: Sequence[dict | None] | None,
        response_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, dict, dict]:
        """Score a batch. See the module docstring for the outputs."""
        b = len(responses)
        if extra_infos is None:
            extra_infos = [None] * b
        if not (len(ground_truths) == len(data_sources) == len(extra_infos) == b == response_mask.shape[0]):
            raise ValueError(
                f"score(): batch sizes differ: responses {b}, ground_truths {len(ground_truths)}, "
                f"data_sources {len(data_sources)}, extra_infos {len(extra_infos)}, response_mask {tuple(response_mask.shape)}"
            )
        t0 = time.monotonic()
        restarts0 = self.worker_restarts
        # verl's managers hand the scorer a dict (never None) as extra_info
        extra_infos = [{} if e is None else e for e in extra_infos]
        responses = list(responses)
        if self.eos_token:  # the dapo manager strips a trailing EOS text that decoding kept
            responses = [r[: -len(self.eos_token)] if r.endswith(self.eos_token) else r for r in responses]
        if self.kind == "batch":
            outcomes = self._score_whole_batch(responses, ground_truths, data_sources, extra_infos)
        else:
            jobs = [(data_sources[i], responses[i], ground_truths[i], extra_infos[i]) for i in range(b)]
            outcomes = self._run_all(jobs)

        scores = torch.zeros(b, dtype=torch.float32)  # [B]
        acc = torch.zeros(b, dtype=torch.float32)  # [B]
        per_sample: list[dict] = []
        errors = timeouts = 0
        first_failure = None
        for i, o in enumerate(outcomes):
            if o[0] != "ok" and first_failure is None:
                first_failure = (i, o)
            if o[0] == "ok":
                scores[i], acc[i] = o[1], o[2]
                per_sample.append(dict(o[3], reward_status="ok"))
                continue
            errors += 1
            if o[0] == "timeout":
                timeouts += 1
                per_sample.append({"reward_status": "timeout"})
                if not self._logged_timeout:
                    self._logged_timeout = True
                    logger.warning(
                        "reward: sample %d (data_source=%r) timed out after %s; scored 0 and counted in "
                        "reward/timeouts (further timeouts are counted, not logged)", i, data_sources[i], timeout_text(self, b),
                    )
            else:
                per_sample.append({"reward_status": "error"})
                if not self._logged_error:
                    self._logged_error = True
                    logger.warning(
                        "reward: the scorer failed on sample %d (data_source=%r); scored 0 and counted in "
                        "reward/errors (further errors are counted, not logged):\n%s", i, data_sources[i], o[1],
                    )
        keys = sorted({k for d in per_sample for k in d})
        per_sample = [{k: d.get(k) for k in keys} for d in per_sample]

        mask = response_mask.bool()  # [B, T]
        t = mask.shape[1]
        has_token = mask.any(dim=1)  # [B]
        # last valid position: T-1 minus the index of the first 1 in the reversed row
        last = (t - 1) - mask.flip(1).to(torch.int64).argmax(dim=1)  # [B]
        token_level_scores = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # [B, T]
        rows = torch.nonzero(has_token, as_tuple=True)[0]  # [B']
        token_level_scores[rows, last[rows]] = scores.to(mask.device)[rows]

        metrics = {
            "reward/score_mean": float(scores.mean()) if b else 0.0,
            "reward/acc_mean": float(acc.mean()) if b else 0.0,
            "reward/errors": float(errors),
            "reward/error_fraction": errors / b if b else 0.0,
            "reward/timeouts": float(timeouts),
            "reward/worker_restarts": float(self.worker_restarts - restarts0),
            "reward/empty_responses": float(b - int(has_token.sum())),
            "reward/time_s": time.monotonic() - t0,
        }
        by_source: dict[str, list[float]] = {}
        for i, ds in enumerate(data_sources):
            by_source.setdefault(str(ds), []).append(float(acc[i]))
        for ds, v in by_source.items():
            metrics[f"reward/acc/{ds}"] = sum(v) / len(v)
        if b and errors == b:
            # Every reward is a failure's 0: training on this batch learns nothing and would hide the bug.
            i, o = first_failure
            why = (f"it timed out after {timeout_text(self, b)} (reward_model.timeout)" if o[0] == "timeout"
                   else f"the first failure (sample {i}, data_source={data_sources[i]!r}):\n{o[1]}")
            raise RewardError(
                f"reward: all {b} responses of this batch failed to score ({self.kind} reward manager, "
                f"scorer {self.custom_path or 'trainer.rewards.scorers'}:{self.custom_name if self.custom_path else 'compute_score'}); "
                f"{why}\nFix the scorer (run it on one response in a python shell), or check "
                f"reward_model.reward_manager / custom_reward_function.reward_kwargs.")
        return token_level_scores, metrics, {"scores": scores, "acc": acc, "per_sample": per_sample}
