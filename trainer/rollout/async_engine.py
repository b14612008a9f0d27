"""An asyncio front for a (synchronous, not thread-safe) rollout engine: many callers, batched calls.

Callers ``await batcher.submit(prompt_ids, sampling_params)`` from any number of coroutines (HTTP
handlers of the servers in :mod:`trainer.serving`, whose skeleton starts and stops the batcher;
trajectories of the multi-turn agent loop). One batcher task takes the first waiting item, waits until no new item has
arrived for ``wait_s`` (at most ``max_wait_s`` in all: a burst of requests arrives over many
connections or coroutines), drains the queue up to ``max_batch_samples`` samples, and runs ONE
``engine.generate`` call for them in a single worker thread (the engine runs one call at a time; the
event loop keeps accepting requests meanwhile, and they form the next batch). The engine itself does
continuous batching inside that call. A failing batch is re-run one item at a time so one bad request
cannot fail the others. Items whose caller has gone away (cancelled future) are dropped.

Seeds. The batcher calls ``engine.generate`` with one params object per item. An engine with
``request_keyed_seeds`` (the native engine) then keys each item's random stream by the item's own seed,
not its position, so a seeded request's samples equal ``engine.generate([prompt], SamplingParams(
seed=s, n=n, ...))`` whatever shares its call, and seeded requests batch freely (the multi-turn loop
gives every turn its own seed and relies on this). For an engine without it, where a sample depends on
the prompt's position in the call, a batch holds at most one seeded sampled item (not greedy), always
at position 0, which gives the same guarantee; seeded sampled requests are then not batched with each
other (unseeded and greedy ones are).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from trainer.rollout.engine import GenerationOutput, SamplingParams


@dataclass(eq=False)
class _Item:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future
    seeded: bool = False  # a seeded sampled item for a positional-seed engine: must sit at position 0


@dataclass
class EngineStats:
    requests: int = 0
    prompts: int = 0
    engine_calls: int = 0
    batched_prompts: int = 0
    max_batch_prompts: int = 0
    generated_tokens: int = 0
    engine_seconds: float = 0.0
    errors: int = 0
    started: float = field(default_factory=time.time)


class Batcher:
    """Collect items until the queue is quiet for ``wait_s`` (at most ``max_wait_s``), then one
    ``engine.generate`` call for them in one worker thread; see the module docstring."""

    def __init__(self, engine, *, max_batch_samples: int, wait_s: float, stats: EngineStats | None = None, max_wait_s: float | None = None):
        self.engine = engine
        self.max_batch_samples = max(1, max_batch_samples)
        self.wait_s = wait_s
        self.max_wait_s = max(wait_s, max_wait_s if max_wait_s is not None else 10 * wait_s)
        self.stats = stats if stats is not None else EngineStats()
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._deferred: list[_Item] = []  # items that did not fit (sample cap, a second seeded one), oldest first
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coxswain-engine")
        self._task: asyncio.Task | None = None
        # Position-independent seeds: no placement rule needed for seeded items (module docstring).
        self.request_keyed_seeds = bool(getattr(engine, "request_keyed_seeds", False))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.engine.abort()
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def submit(self, prompt: list[int], params: SamplingParams) -> list[GenerationOutput]:
        fut = asyncio.get_running_loop().create_future()
        seeded = params.seed is not None and not params.greedy and not self.request_keyed_seeds
        self.queue.put_nowait(_Item(prompt, params, fut, seeded=seeded))
        return await fut

    def abort_waiting(self) -> int:
        """Answer every item that is not yet in an engine call with an empty ``"abort"`` output (SGLang's answer
        to an aborted waiting request); the call in flight is the engine's to abort (``engine.abort()``), so
        its items come back with the tokens sampled so far. Returns how many were answered. Items of a batch
        being collected at this moment reach the engine: a caller that must stop everything aborts again
        while a call runs (the fully-async rollouter does, every 50 ms)."""
        items, self._deferred = self._deferred, []
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        n = 0
        for it in items:
            if not it.future.done():
                it.future.set_result([GenerationOutput([], [], "abort") for _ in range(it.params.n)])
                n += 1
        return n

    async def _collect(self) -> list[_Item]:
        pending, self._deferred = self._deferred, []
        if not pending:
            pending.append(await self.queue.get())
        if self.wait_s > 0:
            # Let concurrent requests arrive and share this call: wait until the queue has been quiet
            # for wait_s (a burst of N requests takes a while to arrive over N connections), but no
            # longer than max_wait_s in all, and not once a full batch is waiting.
            loop = asyncio.get_running_loop()
            t_end = loop.time() + self.max_wait_s
            seen = -1
            while self.queue.qsize() != seen and self.queue.qsize() < self.max_batch_samples and loop.time() < t_end:
                seen = self.queue.qsize()
                await asyncio.sleep(min(self.wait_s, max(0.0, t_end - loop.time())))
        while not self.queue.empty():
            pending.append(self.queue.get_nowait())
        batch: list[_Item] = []
        size, seeded = 0, False
        for it in pending:  # oldest first: deferred items lead
            if it.future.done():  # the request was cancelled (client gone) before generation
                continue
            if (batch and size + it.params.n > self.max_batch_samples) or (it.seeded and seeded):
                self._deferred.append(it)
                continue
            if it.seeded:
                batch.insert(0, it)  # position 0: its random stream is the one a solo call would use
                seeded = True
            else:
                batch.append(it)
            size += it.params.n
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            if not batch:
                continue
            t0 = time.perf_counter()
            try:
                outs = await loop.run_in_executor(self._pool, self.engine.generate,
                                                  [b.prompt for b in batch], [b.params for b in batch])
                results: list[Any] = list(outs)
                self.stats.engine_calls += 1
            except Exception:
                # Isolate the failing item(s): one call per item, each failure goes to its own request.
                results = []
                for b in batch:
                    try:
                        results.append((await loop.run_in_executor(self._pool, self.engine.generate, [b.prompt], [b.params]))[0])
                        self.stats.engine_calls += 1
                    except Exception as e:  # noqa: BLE001 - delivered to that request as a 500/400
                        results.append(e)
            self.stats.engine_seconds += time.perf_counter() - t0
            self.stats.batched_prompts += len(batch)
            self.stats.max_batch_prompts = max(self.stats.max_batch_prompts, len(batch))
            for b, r in zip(batch, results):
                if b.future.done():
                    continue
                if isinstance(r, Exception):
                    b.future.set_exception(r)
                else:
                    self.stats.generated_tokens += sum(len(o.token_ids) for o in r)
                    b.future.set_result(r)
