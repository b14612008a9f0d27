"""The reward manager: score a batch of responses in parallel and place each score on its last token.

``RewardManager(num_workers, timeout, custom_path=None, custom_name="compute_score")`` keeps a pool of
scorer processes for the whole run. ``score(responses, ground_truths, data_sources, extra_infos,
response_mask)`` returns ``(token_level_scores [B, T], metrics, extras)``:

* ``token_level_scores[i, t_i] = score_i`` where ``t_i`` is the LAST position with
  ``response_mask[i] == 1`` (every other entry is 0): the outcome reward sits on the token that ended
  the response, as GAE / GRPO expect. A row with an all-zero mask gets no score placed and is counted
  in ``reward/empty_responses``.
* ``extras = {"scores": [B] float32, "acc": [B] float32, "per_sample": list of B dicts}``. Each
  per-sample dict has the same keys: the scorer's extra keys (``pred``, ``status``, ...; missing ones
  are None) plus ``reward_status`` (``ok`` | ``error`` | ``timeout``).
* ``metrics``: ``reward/score_mean``, ``reward/acc_mean``, ``reward/errors`` (raised, timed out, bad
  return value or a crashed worker), ``reward/timeouts``, ``reward/worker_restarts``,
  ``reward/empty_responses``, ``reward/time_s`` and ``reward/acc/<data_source>`` per source.

Failure policy: a scorer that raises, returns a non-finite or malformed value, kills its worker, or
runs past ``timeout`` seconds gives that sample score 0 and acc 0 and is counted. It never raises into
the training loop, and never goes unreported: the first error's traceback (and the first timeout) is
logged once per manager. A hung scorer does not hang the pool: at most ``num_workers`` samples are in
flight, each with a deadline ``timeout`` seconds after it was handed to an idle worker; when one
expires the pool's processes are killed and a fresh pool takes the remaining samples (the innocent
in-flight ones restart with a fresh deadline). When a worker dies on its own, the samples that were in
flight are re-run one at a time, so the one that kills its worker is identified and only it fails.

Scorers: a custom function (``custom_reward_function.path`` + ``.name``, as in verl) is called with
verl's keywords ``fn(data_source=, solution_str=, ground_truth=, extra_info=)``; ``path`` is a python
file or an importable module. Without one, ``trainer.rewards.scorers.compute_score`` dispatches on
``data_source``. A result is a number (score; acc = score) or a dict with ``score`` and optionally
``acc`` (else acc = score) and any extra keys.

``num_workers=0`` scores in the calling process, serially: ``breakpoint()`` works in a scorer, but no
timeout can be enforced there (errors are still caught and counted).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import importlib.util
import logging
import math
import multiprocessing as mp
import os
import time
import traceback
from collections import deque
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Sequence

import torch

logger = logging.getLogger(__name__)

_FN: Callable | None = None  # the scorer, set in each worker by _init_worker


def load_custom_fn(path: str, name: str = "compute_score") -> Callable:
    """Load ``name`` from a python file ``path`` (or an importable module name). Clear errors."""
    if path.endswith(".py") or os.path.sep in path:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"custom_reward_function.path={path!r}: no such file. Give the path of a .py file that defines {name}()."
            )
        mod_name = "coxswain_custom_reward_" + str(abs(hash(os.path.abspath(path))))
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    fn = getattr(module, name, None)
    if not callable(fn):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"custom_reward_function: {path!r} has no function {name!r} (it defines {public}); "
            f"set custom_reward_function.name to one of them."
        )
    return fn


def _init_worker(custom_path: str | None, custom_name: str) -> None:
    global _FN
    if custom_path:
        _FN = load_custom_fn(custom_path, custom_name)
    else:
        from trainer.rewards.scorers import compute_score

        _FN = compute_score


def _ping(delay: float = 0.0) -> int:
    time.sleep(delay)
    return os.getpid()


def _normalize(result: Any) -> tuple[float, float, dict]:
    """(score, acc, extra) from a scorer's return value; raises on a malformed one."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"scorer returned a dict without 'score' (keys: {sorted(result)})")
        score = float(result["score"])
        acc = float(result["acc"]) if result.get("acc") is not None else score
        extra = {k: _plain(v) for k, v in result.items() if k not in ("score", "acc")}
    else:
        score = float(result)  # numbers, bools, 0-d tensors / numpy scalars
        acc, extra = score, {}
    if not (math.isfinite(score) and math.isfinite(acc)):
        raise ValueError(f"scorer returned a non-finite value (score={score}, acc={acc})")
    return score, acc, extra


def _plain(v: Any) -> Any:
    """Make extra values cheap to pickle and log (numpy / torch scalars -> python)."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    item = getattr(v, "item", None)
    if callable(item):
        try:
            return item()
        except (ValueError, RuntimeError):
            pass
    return str(v)[:500]


def _score_one(fn: Callable | None, data_source, solution_str, ground_truth, extra_info) -> tuple:
    """Run one scorer call; never raises. Returns ("ok", score, acc, extra) or ("error", traceback)."""
    try:
        fn = fn or _FN
        result = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)
        return ("ok",) + _normalize(result)
    except BaseException:  # noqa: BLE001 - a user scorer may raise anything, SystemExit included
        return ("error", traceback.format_exc(limit=20))


class RewardManager:
    """Parallel, fault-tolerant scoring. See the module docstring."""

    def __init__(
        self,
        num_workers: int = 2,
        timeout: float | None = 10.0,
        custom_path: str | None = None,
        custom_name: str = "compute_score",
        mp_context: str = "forkserver",
    ):
        self.num_workers = int(num_workers)
        self.timeout = float(timeout) if timeout and timeout > 0 else None
        self.custom_path = custom_path or None
        self.custom_name = custom_name or "compute_score"
        self.mp_context = mp_context
        # Load once here too: a wrong path or name fails at start-up with a clear message, not as
        # B scorer errors per step. In-process mode also uses this function.
        self._fn = load_custom_fn(self.custom_path, self.custom_name) if self.custom_path else None
        if self._fn is None:
            from trainer.rewards.scorers import compute_score

            self._fn = compute_score
        self._pool: cf.ProcessPoolExecutor | None = None
        self._logged_error = False
        self._logged_timeout = False
        self.worker_restarts = 0

    # -- pool lifecycle ------------------------------------------------------------------------
    def _new_pool(self) -> cf.ProcessPoolExecutor:
        ctx = mp.get_context(self.mp_context)
        if self.mp_context == "forkserver":
            ctx.set_forkserver_preload(["trainer.rewards.scorers"])  # only effective before it starts
        pool = cf.ProcessPoolExecutor(
            self.num_workers, mp_context=ctx, initializer=_init_worker, initargs=(self.custom_path, self.custom_name)
        )
        # Start every worker now (spawning happens on submit), so start-up time and the scorers'
        # imports do not count against the first samples' deadlines.
        warm = [pool.submit(_ping, 0.05) for _ in range(self.num_workers)]
        cf.wait(warm, timeout=120)
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
    def _run_all(self, jobs: list[tuple]) -> list[tuple]:
        """Score every job; returns one outcome tuple per job (see ``_score_one``) or ("timeout",)."""
        n = len(jobs)
        out: list[tuple | None] = [None] * n
        if self.num_workers <= 0:
            return [_score_one(self._fn, *j) for j in jobs]
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
                deadline = time.monotonic() + self.timeout if self.timeout else math.inf
                try:
                    inflight[pool.submit(_score_one, None, *jobs[i])] = (i, deadline, alone)
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
        jobs = [(data_sources[i], responses[i], ground_truths[i], extra_infos[i]) for i in range(b)]
        outcomes = self._run_all(jobs)

        scores = torch.zeros(b, dtype=torch.float32)  # [B]
        acc = torch.zeros(b, dtype=torch.float32)  # [B]
        per_sample: list[dict] = []
        errors = timeouts = 0
        for i, o in enumerate(outcomes):
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
                        "reward: sample %d (data_source=%r) timed out after %.1f s; scored 0 and counted in "
                        "reward/timeouts (further timeouts are counted, not logged)", i, data_sources[i], self.timeout,
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
        token_level_scores = torch.zeros(mask.shape, dtype=torch.float32)  # [B, T]
        rows = torch.nonzero(has_token, as_tuple=True)[0]  # [B']
        token_level_scores[rows, last[rows]] = scores[rows]

        metrics = {
            "reward/score_mean": float(scores.mean()) if b else 0.0,
            "reward/acc_mean": float(acc.mean()) if b else 0.0,
            "reward/errors": float(errors),
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
        return token_level_scores, metrics, {"scores": scores, "acc": acc, "per_sample": per_sample}
