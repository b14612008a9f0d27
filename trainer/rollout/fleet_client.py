"""The rollout fleet's HTTP client: a :class:`~trainer.rollout.engine.RolloutEngine` over sglang-router and
its workers, speaking SGLang's native ``/generate`` and either weight protocol (Coxswain's safetensors blobs
or SGLang's own endpoints). :mod:`trainer.rollout.fleet` starts and supervises the servers it talks to.

``FleetClient(router_url, worker_urls, *, max_concurrency=64, request_timeout_s=600, max_retries=4,
retry_backoff_s=0.1, bucket_bytes=64 MiB, on_failure=None, per_sample_requests=False,
weight_protocol="coxswain", retain_push=True, model_dir=None, model_dtype=float32)``
    Usable without a :class:`Fleet`, e.g. against real SGLang servers behind a router on GPU: the
    generate path speaks only SGLang's native ``/generate`` (v0.5.8 shapes, see
    :mod:`trainer.serving.sglang_native`).
    * ``generate(prompts, params)``: one ``/generate`` request per prompt (``n`` samples each) through
      the router, at most ``max_concurrency`` in flight; returns ``out[i][j]``. Blocking; call it from
      a thread that is not running an event loop.
    * ``await agenerate(prompt_ids, params) -> list[GenerationOutput]``: one prompt, from any asyncio
      loop (the multi-turn agent loop); requests run on the client's own loop thread.
    * ``update_weights(named_tensors, *, dtype=None, ignore=None, weight_version=None)``: drain (new
      requests wait, in-flight ones finish), push the (HF name, tensor) stream in buckets of
      ``bucket_bytes`` to every worker (``POST /update_weights_from_tensor``, a safetensors blob:
      :mod:`trainer.wire`), then
      check that every worker's ``GET /weights_checksum`` equals :func:`checksum_named_tensors` of the
      stream (cast to the workers' dtype; ``lm_head.weight`` ignored for tied models); raises
      :class:`~trainer.rollout.engine.WeightSyncError` (a ``RuntimeError``, not a :class:`FleetError`)
      naming the worker otherwise. Returns the names pushed.
      A push that meets a dead worker raises too (push again once the fleet has restarted it).
    * ``weight_protocol="sglang"``: ``update_weights`` speaks SGLang 0.5.21's own endpoints instead, which real
      SGLang servers and Coxswain's native servers both answer: ``/begin_weight_update``, per bucket
      ``/update_weights_from_tensor`` with ``load_format="flattened_bucket"`` (a CPU buffer in shared memory:
      same host), ``/end_weight_update``, ``/flush_cache`` (retried until the scheduler is idle). SGLang keeps
      no HF-named checksum, so a server's checksum is that of the stream it accepted, bucket by bucket
      (``accepted``; before any push, the checkpoint's in ``model_dir``), and the first rows of four tensors
      are read back through ``/get_weights_by_name`` and compared exactly (where the model class can
      report them; Qwen2 cannot in 0.5.21). ``retain_push`` keeps the last push's flat buckets (one copy of
      the weights in the engine dtype) for :meth:`replay_last_push`.
    * ``weights_checksum()``: the workers' common checksum (:class:`WeightSyncError` if they differ);
      ``verify_weights(expected, urls=None)`` checks them against a given one; ``expected_checksum``
      is the last verified one. ``server_info(url=None)``: a worker's ``/server_info``.
    * ``set_workers(urls)``: the worker list (a Fleet keeps it current across restarts).
    * ``abort()``: ``/abort_request {"abort_all": true}`` on every worker. ``sleep``/``wake``: no-ops.
    * ``stats``: requests, prompts, retries (``fleet/retries``), failures, generated tokens.
    * ``close()``.

Failures and retries. The router runs with ``--disable-retries`` so a failure reaches the client and is
counted: a connection error, a timeout, or an HTTP 5xx / 408 / 429 (the router answers 500
``call_upstream_request_error`` when its worker dies mid-request) is retried up to ``max_retries``
times, with exponential backoff, directly on the next worker (round-robin order) that answers
``GET /health``, and counts one ``fleet/retries`` each. Other 4xx are the request's fault: raised, not
retried. The client then pokes the fleet (``on_failure``), whose monitor restarts a dead server on a
new port, removes the old URL from the router (``DELETE /workers/{id}``) and registers the new one
(``POST /workers {"url": ...}``; 0.3.2 has no ``/add_worker``), after copying a live peer's weights into
it when weights were pushed since start (``GET /weights_safetensors``) and checking its checksum.

Seeds. ``SamplingParams.seed`` travels as SGLang's ``sampling_params.sampling_seed``. With a per-prompt
params list, each prompt's own seed is sent as is, so ``client.generate(P, plist)`` equals
``NativeEngine.generate(P, plist)`` (the engine keys such streams by the request's seed, not its
position). With ONE params object for all prompts, prompt ``i`` is sent with :func:`prompt_seed`
``(seed, i)``, so the prompts of a seeded step draw distinct streams (as in the engine), and
``client.generate(P, sp) == NativeEngine.generate(P, [replace(sp, seed=prompt_seed(sp.seed, i)) ...])``;
it is not bit-equal to ``NativeEngine.generate(P, sp)``, whose positional key has no HTTP spelling.
On real SGLang a seed is honoured only with ``--enable-deterministic-inference``, and its n parallel
samples of one seeded request come out identical (it hashes seed and position only; an unseeded one
gets seed 42 in that mode). For such servers pass ``per_sample_requests=True``: each sample is then its
own ``n = 1`` request, sample ``j`` seeded with ``prompt_seed(seed, j)`` (random seeds when unseeded),
as :mod:`trainer.rollout.sglang_engine` does in-process.

Stops. ``stop_token_ids`` are sent as is, with ``ignore_eos = not stop_token_ids``: an empty set means
"no stop" on any server. A non-empty set also stops on the model's EOS ids (SGLang's rule), so pass
the EOS ids in it, as the controller does; then outputs equal the in-process engine's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from trainer.hf_io import iter_safetensors
from trainer.rollout.engine import (GenerationOutput, RolloutEngine, RouteShape, SamplingParams, WeightSyncError, routes_of,
                                    checksum_named_tensors, iter_buckets, tensor_digest)
from trainer.rollout.sglang_http import serialize_flat
from trainer.rollout.weights import (PROBE_SUFFIXES, combine_digests, default_probe_names, flatten_bucket,
                                     iter_cast_buckets, probe_rows, readback_error, unflatten_bucket)
from trainer.wire import WEIGHTS_CONTENT_TYPE, tensors_to_safetensors

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class FleetError(RuntimeError):
    """A request the fleet could not serve (retries spent, or the request itself was refused). A weight
    push that fails raises :class:`~trainer.rollout.engine.WeightSyncError` instead (imported here)."""


# --------------------------------------------------------------------------------------------------
# the SGLang /generate protocol, client side: pure functions
# --------------------------------------------------------------------------------------------------
async def _gather(coros, return_exceptions: bool = False) -> list:
    """``asyncio.gather`` on the loop that awaits it (``FleetClient._call`` takes a coroutine)."""
    return list(await asyncio.gather(*coros, return_exceptions=return_exceptions))


def prompt_seed(seed: int, index: int) -> int:
    """The seed prompt ``index`` of a one-params call is sent with: 62 bits of sha256("seed:index")."""
    return int.from_bytes(hashlib.sha256(f"coxswain-fleet:{int(seed)}:{int(index)}".encode()).digest()[:8], "big") >> 2


def sglang_sampling_params(params: SamplingParams, seed: int | None = None) -> dict:
    """The engine's :class:`SamplingParams` as SGLang ``sampling_params`` (``seed`` overrides params.seed)."""
    seed = params.seed if seed is None else seed
    sp = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
          "top_k": params.top_k if params.top_k else -1, "n": params.n,
          "stop_token_ids": list(params.stop_token_ids), "ignore_eos": not params.stop_token_ids}
    if seed is not None:
        sp["sampling_seed"] = int(seed)
    return sp


def generate_payload(prompt_ids: Sequence[int], params: SamplingParams, seed: int | None = None) -> dict:
    """One SGLang ``/generate`` body for one prompt, asking for the sampled tokens' log-probs."""
    body = {"input_ids": [int(t) for t in prompt_ids], "sampling_params": sglang_sampling_params(params, seed),
            "return_logprob": True, "logprob_start_len": -1, "stream": False}
    if params.return_routed_experts:  # R3: SGLang's own request field (PR #12162), the native servers' too
        body["return_routed_experts"] = True
    return body


def parse_output(item: dict, routes: RouteShape | None = None) -> GenerationOutput:
    """One SGLang output object -> :class:`GenerationOutput` (tokens from ``meta_info.output_token_logprobs``,
    checked against ``output_ids``); ``routes``: the request asked for its routed experts (R3), which must
    cover its every input token (``meta_info.routed_experts``)."""
    try:
        meta = item["meta_info"]
        triples = meta["output_token_logprobs"]
        fr = meta["finish_reason"]
    except (KeyError, TypeError) as e:
        raise FleetError(f"not an SGLang /generate output with log-probs (missing {e}): {str(item)[:300]}") from e
    ids = [int(t[1]) for t in triples]
    lps = [float(t[0]) for t in triples]
    if "output_ids" in item and [int(t) for t in item["output_ids"]] != ids:
        raise FleetError(f"output_ids {item['output_ids']} disagree with output_token_logprobs' ids {ids}")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind not in ("stop", "length", "abort"):
        raise FleetError(f"unknown finish_reason {fr!r}")
    routed = None
    if routes is not None:
        try:
            routed = routes_of(meta, routes, rows=routes.prompt_len + len(ids) - 1, cut=kind == "abort")
        except ValueError as e:
            raise FleetError(str(e)) from None
    return GenerationOutput(ids, lps, kind, routed)


def parse_generate_response(body: Any, n: int, routes: RouteShape | None = None) -> list[GenerationOutput]:
    """A ``/generate`` response for one prompt sampled ``n`` times: one object (n == 1) or a list of n."""
    items = body if isinstance(body, list) else [body]
    if len(items) != n:
        raise FleetError(f"expected {n} outputs, got {len(items)}")
    return [parse_output(it, routes) for it in items]


# --------------------------------------------------------------------------------------------------
# the client
# --------------------------------------------------------------------------------------------------
@dataclass
class FleetStats:
    requests: int = 0  # /generate requests that succeeded
    prompts: int = 0
    retries: int = 0  # failed attempts that were retried (fleet/retries)
    failures: int = 0  # requests given up on
    generated_tokens: int = 0
    weight_pushes: int = 0
    restarts: int = 0  # servers the Fleet restarted
    dropped: int = 0  # servers the Fleet dropped (their Ray node left the cluster)

    def as_metrics(self) -> dict[str, float]:
        return {f"fleet/{k}": float(v) for k, v in self.__dict__.items()}


class FleetClient(RolloutEngine):
    """SGLang-protocol client over a router (and its workers); see the module docstring."""

    def __init__(self, router_url: str, worker_urls: Sequence[str], *, max_concurrency: int = 64,
                 request_timeout_s: float = 600.0, max_retries: int = 4, retry_backoff_s: float = 0.1,
                 bucket_bytes: int = 64 << 20, on_failure: Callable[[str], None] | None = None,
                 stats: FleetStats | None = None, per_sample_requests: bool = False, api_key: str | None = None,
                 weight_protocol: str = "coxswain", retain_push: bool = True, model_dir: str | None = None,
                 model_dtype: torch.dtype | str = torch.float32, route_shape: RouteShape | None = None):
        if weight_protocol not in ("coxswain", "sglang"):
            raise ValueError(f"weight_protocol={weight_protocol!r}: 'coxswain' (native servers) or 'sglang' (real SGLang)")
        self.route_shape = route_shape  # the model's MoE layers and top-k: what R3 routes decode to (None: dense)
        self.api_key = api_key  # the servers' Bearer key (their weight and control endpoints need it)
        self.weight_protocol = weight_protocol
        # SGLang protocol: keep the last push's flat buckets (one copy of the weights in the engine dtype, in
        # shared memory) so that a restarted server is given them again (replay_last_push)
        self.retain_push = retain_push
        self._last_push: list[tuple[torch.Tensor, list]] = []
        self._probes: dict[str, torch.Tensor] = {}  # SGLang protocol: first rows of a few tensors as pushed
        self.accepted: dict[str, str] = {}  # SGLang protocol: url -> checksum of the stream it accepted
        self.model_dir = model_dir  # the checkpoint the servers loaded at start: their checksum before any push
        self.model_dtype = getattr(torch, model_dtype) if isinstance(model_dtype, str) else model_dtype
        self._disk_checksum: str | None = None
        self.router_url = router_url.rstrip("/")
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.max_concurrency = max_concurrency
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.bucket_bytes = bucket_bytes
        self.on_failure = on_failure
        self.per_sample_requests = per_sample_requests  # n > 1 as n seeded n=1 requests (real SGLang)
        self.stats = stats if stats is not None else FleetStats()
        self.expected_checksum: str | None = None  # the workers' weights since the last verified push
        self.weights_lock = threading.RLock()  # held through a push; a Fleet restart copies weights under it
        self._rr = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="coxswain-fleet-client", daemon=True)
        self._thread.start()
        self._session = None
        self._sem: asyncio.Semaphore | None = None
        self._open: asyncio.Event | None = None  # cleared while draining for a weight push
        self._idle: asyncio.Event | None = None  # set when nothing is in flight
        self._inflight = 0
        self._call(self._setup())

    # ---- loop plumbing ----------------------------------------------------------------------------
    def _call(self, coro, timeout: float | None = None):
        if threading.current_thread() is self._thread:
            raise RuntimeError("a blocking FleetClient method was called from its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _setup(self) -> None:
        import aiohttp  # heavy to import: loaded once the client starts its loop

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False), headers=headers)
        self._sem = asyncio.Semaphore(self.max_concurrency)
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._session is not None:
            try:
                self._call(self._session.close(), timeout=10)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def set_workers(self, urls: Sequence[str]) -> None:
        """Replace the worker list (a Fleet does this when it restarts a server)."""
        self.worker_urls = [u.rstrip("/") for u in urls]

    # ---- HTTP helpers (on the loop) -------------------------------------------------------------------
    def _timeout(self, seconds: float):
        import aiohttp  # heavy to import: loaded once the client starts its loop

        return aiohttp.ClientTimeout(total=seconds)

    async def _get_json(self, url: str, timeout: float = 30.0) -> Any:
        async with self._session.get(url, timeout=self._timeout(timeout)) as r:
            body = await r.read()
            if r.status != 200:
                raise FleetError(f"GET {url}: HTTP {r.status}: {body[:300]!r}")
            return json.loads(body)

    async def _healthy(self, url: str) -> bool:
        try:
            async with self._session.get(url + "/health", timeout=self._timeout(2.0)) as r:
                return r.status == 200
        except Exception:  # noqa: BLE001 - any failure is "not healthy"
            return False

    async def _live_worker(self) -> str | None:
        urls = list(self.worker_urls)
        for k in range(len(urls)):
            url = urls[(self._rr + k) % len(urls)]
            if await self._healthy(url):
                self._rr = (self._rr + k + 1) % len(urls)
                return url
        return None

    async def _post_generate(self, payload: dict) -> Any:
        import aiohttp  # heavy to import: loaded once the client starts its loop

        url, last = self.router_url, ""
        if payload.get("return_routed_experts") and self.worker_urls:
            # sglang-router 0.3.2 re-serialises /generate bodies without return_routed_experts (checked: its reply
            # has no routes), so an R3 request goes to a worker directly, round-robin as the router would
            url = self.worker_urls[self._rr % len(self.worker_urls)]
            self._rr = (self._rr + 1) % len(self.worker_urls)
        for attempt in range(self.max_retries + 1):
            try:
                async with self._session.post(url + "/generate", json=payload,
                                              timeout=self._timeout(self.request_timeout_s)) as r:
                    body = await r.read()
                    if r.status == 200:
                        return json.loads(body)
                    last = f"HTTP {r.status} from {url}: {body[:500].decode(errors='replace')}"
                    if r.status not in RETRYABLE_STATUS:
                        self.stats.failures += 1
                        raise FleetError(f"/generate refused: {last}")
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, json.JSONDecodeError) as e:
                last = f"{type(e).__name__} from {url}: {e}"
            if attempt == self.max_retries:
                break
            self.stats.retries += 1
            log.warning("fleet: /generate failed (%s); retry %d/%d", last, attempt + 1, self.max_retries)
            if self.on_failure is not None:
                self.on_failure(last)
            await asyncio.sleep(self.retry_backoff_s * 2 ** attempt)
            url = await self._live_worker() or self.router_url
        self.stats.failures += 1
        raise FleetError(f"/generate failed after {self.max_retries} retries: {last}")

    async def _one(self, prompt_ids: Sequence[int], params: SamplingParams, seed: int | None) -> list[GenerationOutput]:
        if self.per_sample_requests and params.n > 1:
            base = params.seed if seed is None else seed
            seeds = [secrets.randbits(62) if base is None else prompt_seed(base, j) for j in range(params.n)]
            one = replace(params, n=1)
            return [o[0] for o in await asyncio.gather(*(self._one(prompt_ids, one, s) for s in seeds))]
        while not self._open.is_set():  # a weight push is draining the fleet: wait for it
            await self._open.wait()
        self._inflight += 1
        self._idle.clear()
        try:
            async with self._sem:
                body = await self._post_generate(generate_payload(prompt_ids, params, seed))
            shape = None
            if params.return_routed_experts:
                if self.route_shape is None:
                    raise FleetError("return_routed_experts asks for MoE routing, but the fleet's model has no MoE layers")
                shape = RouteShape(self.route_shape.layers, self.route_shape.top_k, len(prompt_ids))
            outs = parse_generate_response(body, params.n, shape)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        self.stats.requests += 1
        self.stats.prompts += 1
        self.stats.generated_tokens += sum(len(o.token_ids) for o in outs)
        return outs

    async def _many(self, prompts, plist, seeds) -> list[list[GenerationOutput]]:
        return list(await asyncio.gather(*(self._one(p, sp, s) for p, sp, s in zip(prompts, plist, seeds))))

    # ---- RolloutEngine ---------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[list[GenerationOutput]]:
        prompts = [list(p) for p in prompt_token_ids]
        if isinstance(params, SamplingParams):
            plist = [params] * len(prompts)
            seeds = [None if params.seed is None else prompt_seed(params.seed, i) for i in range(len(prompts))]
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
            seeds = [None] * len(prompts)  # each params' own seed, as is
        return self._call(self._many(prompts, plist, seeds))

    async def agenerate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[GenerationOutput]:
        """One prompt's ``params.n`` responses, awaitable from any event loop (its seed sent as is)."""
        fut = asyncio.run_coroutine_threadsafe(self._one(list(prompt_ids), params, None), self._loop)
        return await asyncio.wrap_future(fut)

    def abort(self) -> None:
        async def _abort_all():
            for url in self.worker_urls:
                try:
                    async with self._session.post(url + "/abort_request", json={"abort_all": True},
                                                  timeout=self._timeout(10)) as r:
                        await r.read()
                except Exception:  # noqa: BLE001 - a dead worker has nothing to abort
                    pass
        self._call(_abort_all())

    # ---- weights ---------------------------------------------------------------------------------------
    async def _drain(self) -> None:
        self._open.clear()
        await self._idle.wait()

    async def _reopen(self) -> None:
        self._open.set()

    async def _post_blob(self, url: str, blob: bytes, weight_version: str | None) -> None:
        q = f"?weight_version={weight_version}" if weight_version is not None else ""
        async with self._session.post(url + "/update_weights_from_tensor" + q, data=blob,
                                      headers={"Content-Type": WEIGHTS_CONTENT_TYPE},
                                      timeout=self._timeout(self.request_timeout_s)) as r:
            body = await r.read()
            if r.status != 200:
                raise WeightSyncError(f"weight push to {url} failed: HTTP {r.status}: {body[:500]!r}")

    async def _push(self, urls: Sequence[str], blob: bytes, weight_version: str | None) -> list[str]:
        """Post one bucket to every worker; returns the workers that could not be reached (connection refused
        or dropped: a server or its node died since the push began). Any other failure raises."""
        import aiohttp  # heavy to import: loaded once the client starts its loop

        done = await asyncio.gather(*(self._post_blob(u, blob, weight_version) for u in urls), return_exceptions=True)
        for r in done:
            if isinstance(r, BaseException) and not isinstance(r, (aiohttp.ClientConnectionError, ConnectionError)):
                raise r
        return [u for u, r in zip(urls, done) if isinstance(r, BaseException)]

    async def _first_info(self, urls: list[str]) -> dict:
        """The ``/server_info`` of the first worker that answers; the unreachable ones before it leave ``urls``."""
        import aiohttp  # heavy to import: loaded once the client starts its loop

        while urls:
            try:
                return await self._get_json(urls[0] + "/server_info")
            except (aiohttp.ClientConnectionError, ConnectionError):
                self._lose(urls, [urls[0]])
        raise WeightSyncError("no rollout server could be reached for the weight push")

    def _lose(self, urls: list[str], lost: Sequence[str]) -> None:
        """Leave the workers that could not be reached out of the push in progress (``urls``, in place) and hand
        them to the fleet (``on_failure``): its monitor restarts a dead server, which then copies a live peer's
        weights once this push (holding ``weights_lock``) is done, or drops one whose node left the cluster.
        Without this, a server lost between two steps failed the run at its next push."""
        for u in lost:
            urls.remove(u)
            log.warning("fleet: %s could not be reached during the weight push; pushing to the %d other(s)", u, len(urls))
            if self.on_failure is not None:
                self.on_failure(f"weight push: {u} unreachable")
        if lost and not urls:
            raise WeightSyncError(f"no rollout server could be reached for the weight push (last: {lost[-1]})")

    async def _checksums(self, urls: Sequence[str]) -> dict[str, str]:
        sums = await asyncio.gather(*(self._get_json(u + "/weights_checksum", timeout=self.request_timeout_s) for u in urls))
        return {u: s["checksum"] for u, s in zip(urls, sums)}

    def server_info(self, url: str | None = None) -> dict:
        return self._call(self._get_json((url or self.worker_urls[0]) + "/server_info"))

    def verify_weights(self, expected: str, urls: Sequence[str] | None = None) -> None:
        """Raise :class:`WeightSyncError` unless every worker's checksum equals ``expected``."""
        urls = list(urls or self.worker_urls)
        sums = self._call(self._checksums(urls))
        bad = {u: s for u, s in sums.items() if s != expected}
        if bad:
            raise WeightSyncError(
                f"weight sync check failed on {len(bad)} of {len(urls)} workers: expected checksum {expected}, got "
                + ", ".join(f"{u} -> {s}" for u, s in bad.items())
                + " (a tensor was lost, corrupted or cast differently in transit)")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, dtype: torch.dtype | None = None,
                       ignore: Iterable[str] | None = None, weight_version: str | None = None) -> list[str]:
        if self.weight_protocol == "sglang":
            return self._update_weights_sglang(named_tensors, dtype=dtype, ignore=ignore, weight_version=weight_version)
        with self.weights_lock:
            urls = list(self.worker_urls)
            info = self._call(self._first_info(urls))
            if dtype is None:
                dtype = getattr(torch, str(info.get("dtype", "float32")))
            if ignore is None:
                ignore = {"lm_head.weight"} if info.get("tie_word_embeddings") else set()
            ignore = set(ignore)
            names: list[str] = []

            def pushed():
                # Each bucket goes to every worker, then its tensors are hashed: one bucket in memory.
                for bucket in iter_buckets(((n, t) for n, t in named_tensors if n not in ignore), self.bucket_bytes):
                    self._lose(urls, self._call(self._push(urls, tensors_to_safetensors(bucket), weight_version)))
                    names.extend(n for n, _ in bucket)
                    yield from bucket

            self._call(self._drain())
            try:
                source = checksum_named_tensors(pushed(), dtype=dtype)
                self.verify_weights(source, urls)
            finally:
                self._call(self._reopen())
            self.expected_checksum = source
            self.stats.weight_pushes += 1
            return names

    def checksums(self) -> dict[str, str]:
        """Every worker's ``checksum_named_tensors`` of the weights it holds, by URL. Real SGLang servers cannot
        hash their weights by HF name: theirs is the checksum of the stream each ACCEPTED (bucket by bucket,
        read back where the model class can report), or :attr:`disk_checksum` before the first push."""
        if self.weight_protocol == "sglang":
            return {u: self.accepted.get(u) or self.disk_checksum() for u in self.worker_urls}
        return self._call(self._checksums(list(self.worker_urls)))

    # ---- weights: SGLang's own endpoints (real SGLang servers) ------------------------------------------
    def disk_checksum(self) -> str:
        """The checksum of the checkpoint the servers started from, cast to their dtype (computed once)."""
        if self._disk_checksum is None:
            if self.model_dir is None:
                raise WeightSyncError("no weights were pushed and the servers' checkpoint is unknown (set model_dir)")
            skip = {"lm_head.weight"} if self._tied() else set()
            self._disk_checksum = checksum_named_tensors(iter_safetensors(self.model_dir, lambda n: n not in skip), dtype=self.model_dtype)
        return self._disk_checksum

    def _tied(self) -> bool:
        if self.model_dir is None:
            return False
        try:
            with open(os.path.join(self.model_dir, "config.json")) as f:
                return bool(json.load(f).get("tie_word_embeddings", False))
        except OSError:
            return False

    async def _admin(self, url: str, path: str, body: dict | None = None) -> dict:
        """POST to an SGLang admin endpoint; an answer other than 200 / ``success`` raises WeightSyncError.
        A connection the server dropped before answering is retried on a new one, twice: a pooled keep-alive
        connection can be closed by the server's idle timeout (uvicorn: 5 s; aiohttp keeps one 15 s) just as a
        request goes out on it, and every admin call here (a weight push of a given version, a cache flush, a
        read) means the same when repeated. Seen once on a loaded 2-core machine, with two SGLang fleets up: the
        start-up push to both servers failed with "Server disconnected" as each logged "Invalid HTTP request"
        (the cause was not pinned down)."""
        import aiohttp  # heavy to import: loaded once the client starts its loop

        for attempt in range(3):
            try:
                async with self._session.post(url + path, json=body if body is not None else {},
                                              timeout=self._timeout(self.request_timeout_s)) as r:
                    raw = await r.read()
                    status = r.status
                break
            except aiohttp.ServerDisconnectedError:
                if attempt == 2:
                    raise
                log.warning("fleet: %s%s: the server closed the connection before answering; retrying", url, path)
        if status != 200:
            raise WeightSyncError(f"{url}{path}: HTTP {status}: {raw[:500]!r}")
        try:
            out = json.loads(raw) if raw else {}
        except json.JSONDecodeError:  # /flush_cache answers plain text
            return {}
        if isinstance(out, dict) and out.get("success") is False:
            raise WeightSyncError(f"{url}{path} failed: {out.get('message')}")
        return out

    async def _flush(self, url: str, timeout_s: float = 60.0) -> None:
        """SGLang flushes its prefix cache only when its scheduler is idle (HTTP 400 otherwise): a scheduler
        can still be finishing the batch whose answers the client already has, so retry until idle."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self._admin(url, "/flush_cache", None)
                return
            except WeightSyncError as e:
                if "HTTP 400" not in str(e) or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.05)

    async def _push_flat(self, url: str, flat: torch.Tensor, metas: list, weight_version: str | None = None) -> None:
        # Serialized per server: each receiver opens its own shared-memory handle
        payload = serialize_flat(flat, metas)
        body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket", "flush_cache": False}
        if weight_version is not None:
            body["weight_version"] = weight_version
        await self._admin(url, "/update_weights_from_tensor", body)

    async def _read_back(self, url: str) -> int:
        """Compare the first rows of the probe tensors with what ``url`` reports; returns how many it could
        report (SGLang answers null for a model class without ``get_weights_by_name``)."""
        checked = 0
        for name, want in self._probes.items():
            try:
                got = await self._admin(url, "/get_weights_by_name", {"name": name, "truncate_size": int(want.shape[0])})
            except WeightSyncError as e:
                if "HTTP 400" in str(e) and "Get parameter by name failed" in str(e):
                    continue  # the model class cannot report it (e.g. Qwen2 in 0.5.21: HTTP 400 over HTTP, null in process)
                raise
            if got is None or got == {}:
                continue
            err = readback_error(torch.tensor(got, dtype=torch.float32), want)
            if err != 0.0:
                raise WeightSyncError(f"weight sync check failed on {url}: {name} reads back different values "
                                      f"from what was pushed (first rows; max |diff| {err}, inf: another shape or "
                                      f"non-zero padding)")
            checked += 1
        return checked

    def _push_buckets(self, urls: Sequence[str], buckets: Iterable[tuple[torch.Tensor, list]],
                      weight_version: str | None = None) -> None:
        """SGLang's bracket around a push: ``/begin_weight_update``, each flat bucket to every server,
        ``/end_weight_update`` (also after a failure), then ``/flush_cache``."""
        self._call(_gather(self._admin(u, "/begin_weight_update") for u in urls))
        try:
            for flat, metas in buckets:
                self._call(_gather(self._push_flat(u, flat, metas, weight_version) for u in urls))
        finally:
            self._call(_gather((self._admin(u, "/end_weight_update") for u in urls), return_exceptions=True))
        self._call(_gather(self._flush(u) for u in urls))

    def _update_weights_sglang(self, named_tensors, *, dtype, ignore, weight_version) -> list[str]:
        dtype = dtype or self.model_dtype
        if ignore is None:  # as the native servers: a tied model's lm_head is the embedding, not pushed
            ignore = {"lm_head.weight"} if self._tied() else set()
        ignore = set(ignore)
        with self.weights_lock:
            urls = list(self.worker_urls)
            kept: list[tuple[torch.Tensor, list]] = []
            digests: dict[str, bytes] = {}  # of the bytes sent: the checksum of what every server accepted
            probes: dict[str, torch.Tensor] = {}  # candidate probes: first rows as sent (a few KB)

            def flat_buckets():
                for bucket in iter_cast_buckets(((n, t) for n, t in named_tensors if n not in ignore), dtype,
                                                self.bucket_bytes):
                    flat, metas = flatten_bucket(bucket, dtype, device="cpu")
                    yield flat, metas  # pushed to every server before the next bucket is made
                    for name, t in unflatten_bucket(flat, metas):
                        digests[name] = tensor_digest(name, t)
                        if name.endswith(PROBE_SUFFIXES):
                            probes[name] = probe_rows(t, 2, dtype)
                    if self.retain_push:
                        kept.append((flat, metas))

            self._call(self._drain())
            try:
                self._push_buckets(urls, flat_buckets(), weight_version)
                self._probes = {n: probes[n] for n in default_probe_names(list(digests)) if n in probes}
                for u in urls:
                    self._call(self._read_back(u))
            finally:
                self._call(self._reopen())
            source = combine_digests(digests)
            self._last_push = kept
            self.expected_checksum = source
            self.accepted = {u: source for u in urls}
            self.stats.weight_pushes += 1
            return list(digests)

    def replay_last_push(self, url: str) -> bool:
        """Give a (restarted) SGLang server the weights of the last push; False when there was none since
        start (the server's checkpoint is then the fleet's weights). Raises WeightSyncError when pushes
        happened but were not retained (``retain_push=False``)."""
        with self.weights_lock:
            if self.expected_checksum is None or not self.accepted:
                return False
            if not self._last_push:
                raise WeightSyncError(f"{url} restarted from its checkpoint, but the fleet's current weights were not "
                                      f"retained (retain_push=False): it stays out of the router until the next push")
            self._push_buckets([url], self._last_push)
            self._call(self._read_back(url))
            self.accepted[url] = self.expected_checksum
            return True

    def weights_checksum(self) -> str:
        sums = self.checksums()
        if len(set(sums.values())) != 1:
            raise WeightSyncError(f"the workers hold different weights: {sums}")
        return next(iter(sums.values()))
