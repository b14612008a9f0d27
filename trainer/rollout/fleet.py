"""The rollout fleet over HTTP: N engine servers behind the real ``sglang-router``, and a client that is a
:class:`~trainer.rollout.engine.RolloutEngine`.

    with Fleet("recipes/cpu/tiny_model", num_servers=2, threads_per_server=1) as fleet:
        outs = fleet.client.generate(prompts, SamplingParams(n=4, max_new_tokens=64, seed=7))
        fleet.client.update_weights(actor_hf_named_tensors)       # drained, bucketed, checksummed
        outs = await fleet.client.agenerate(prompt_ids, params)     # one prompt, from any event loop

API (what the controller calls):

``Fleet(model, *, num_servers=2, threads_per_server=1, max_batch_size=32, max_seq_len=None,
dtype="float32", host="127.0.0.1", policy="round_robin", health_interval_s=1.0, server_args=(),
router_args=(), log_dir=None, startup_timeout_s=180, client_kwargs={}, hosts=None)``
    ``start()`` (or ``with``) launches ``num_servers`` ``python -m trainer.rollout.native_server``
    processes on free loopback ports (``--threads threads_per_server``, ``OMP_NUM_THREADS`` likewise),
    waits for each one's ready line, then launches ``python -m sglang_router.launch_router`` (sglang-router
    0.3.2) with ``--worker-urls`` and ``--policy``, and waits until the router lists every worker as
    healthy. ``fleet.client`` is the :class:`FleetClient`; ``fleet.server_urls``, ``fleet.router_url``;
    ``fleet.stats`` (:class:`FleetStats`, shared with the client; ``as_metrics()`` gives ``fleet/*``
    keys). Logs: ``log_dir`` (a temp dir by default): ``server-K-GEN.log``, ``router.log``. ``close()``
    (also at exit) ends every process group it started (SIGTERM, then SIGKILL after 10 s); each process
    runs under a small supervisor that kills it if the trainer dies without closing (SIGKILL included). A monitor thread health-checks the servers every
    ``health_interval_s`` (process alive, and ``GET /health`` answering), and at once when the client
    reports a failed request; a dead or hung server is restarted (:meth:`Fleet.restart_server`).
    ``hosts`` (on a Ray cluster): one dict of Ray actor options per server (a placement-group bundle);
    server ``k`` then runs on that bundle's node, started by a small :class:`ServerHost` actor there and
    bound to the node's IP (the router and the client on the trainer's node reach it over the network).
    When such a server's node leaves the Ray cluster, the fleet drops the server instead of restarting
    it (its requests are already retried on the others): ``fleet/dropped`` counts them, and the run goes
    on with the remaining servers (:meth:`Fleet.drop_server`).

``Fleet(..., backend="sglang", device="cpu", max_total_tokens=4096, server_python=None)``
    The servers are real ``python -m sglang.launch_server`` processes (:func:`trainer.rollout.sglang_http.
    server_command`; on CPU SGLang's CPU path, :mod:`trainer.rollout.sglang_cpu`), run by ``server_python``
    (default :func:`~trainer.rollout.sglang_cpu.server_python`: this interpreter if it has sglang, else the
    SGLang CPU venv), started with ``--admin-api-key`` = the fleet's key, ready once ``/model_info`` answers.
    The client then speaks SGLang's weight protocol (``weight_protocol="sglang"``, below) and sends each
    sample as its own request. Same host only (the tensor route shares memory); ``hosts`` is refused. A
    restarted server loads the checkpoint from disk and is given the last push again
    (:meth:`FleetClient.replay_last_push`) before it rejoins the router.

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
      :mod:`trainer.serving.wire`), then
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
import atexit
import hashlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from trainer.orphans import supervised
from trainer.rollout.engine import (GenerationOutput, RolloutEngine, SamplingParams, WeightSyncError,
                                    checksum_named_tensors, iter_buckets)
from trainer.serving.net import SGLANG_NATIVE_READY_PREFIX as SERVER_READY_PREFIX
from trainer.serving.net import free_port, ready_url
from trainer.serving.wire import WEIGHTS_CONTENT_TYPE, tensors_to_safetensors

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
PROBE_SUFFIXES = ("embed_tokens.weight", "q_proj.weight", "down_proj.weight", "norm.weight")  # default_probe_names' picks


class FleetError(RuntimeError):
    """A request the fleet could not serve (retries spent, or the request itself was refused). A weight
    push that fails raises :class:`~trainer.rollout.engine.WeightSyncError` instead (imported here)."""


# --------------------------------------------------------------------------------------------------
# the SGLang /generate protocol, client side: pure functions
# --------------------------------------------------------------------------------------------------
async def _gather(coros) -> list:
    """``asyncio.gather`` on the loop that awaits it (``FleetClient._call`` takes a coroutine)."""
    return list(await asyncio.gather(*coros))


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
    return {"input_ids": [int(t) for t in prompt_ids], "sampling_params": sglang_sampling_params(params, seed),
            "return_logprob": True, "logprob_start_len": -1, "stream": False}


def parse_output(item: dict) -> GenerationOutput:
    """One SGLang output object -> :class:`GenerationOutput` (tokens from ``meta_info.output_token_logprobs``,
    checked against ``output_ids``)."""
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
    return GenerationOutput(ids, lps, kind)


def parse_generate_response(body: Any, n: int) -> list[GenerationOutput]:
    """A ``/generate`` response for one prompt sampled ``n`` times: one object (n == 1) or a list of n."""
    items = body if isinstance(body, list) else [body]
    if len(items) != n:
        raise FleetError(f"expected {n} outputs, got {len(items)}")
    return [parse_output(it) for it in items]


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
                 model_dtype: torch.dtype | str = torch.float32):
        if weight_protocol not in ("coxswain", "sglang"):
            raise ValueError(f"weight_protocol={weight_protocol!r}: 'coxswain' (native servers) or 'sglang' (real SGLang)")
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
        import aiohttp

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
        import aiohttp

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
        import aiohttp

        url, last = self.router_url, ""
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
            outs = parse_generate_response(body, params.n)
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

    async def _push(self, urls: Sequence[str], blob: bytes, weight_version: str | None) -> None:
        await asyncio.gather(*(self._post_blob(u, blob, weight_version) for u in urls))

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
            info = self.server_info(urls[0])
            if dtype is None:
                dtype = getattr(torch, str(info.get("dtype", "float32")))
            if ignore is None:
                ignore = {"lm_head.weight"} if info.get("tie_word_embeddings") else set()
            ignore = set(ignore)
            names: list[str] = []

            def pushed():
                # Each bucket goes to every worker, then its tensors are hashed: one bucket in memory.
                for bucket in iter_buckets(((n, t) for n, t in named_tensors if n not in ignore), self.bucket_bytes):
                    self._call(self._push(urls, tensors_to_safetensors(bucket), weight_version))
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
            from trainer.rollout.engine import checksum_named_tensors as _ck
            from trainer.hf_io import iter_safetensors

            skip = {"lm_head.weight"} if self._tied() else set()
            self._disk_checksum = _ck(iter_safetensors(self.model_dir, lambda n: n not in skip), dtype=self.model_dtype)
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
        """POST to an SGLang admin endpoint; an answer other than 200 / ``success`` raises WeightSyncError."""
        async with self._session.post(url + path, json=body if body is not None else {},
                                      timeout=self._timeout(self.request_timeout_s)) as r:
            raw = await r.read()
            if r.status != 200:
                raise WeightSyncError(f"{url}{path}: HTTP {r.status}: {raw[:500]!r}")
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

    async def _push_flat(self, url: str, flat: torch.Tensor, metas: list) -> None:
        from trainer.rollout.sglang_http import serialize_flat

        # Serialized per server: each receiver opens its own shared-memory handle
        payload = serialize_flat(flat, metas)
        await self._admin(url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload],
                                                               "load_format": "flattened_bucket", "flush_cache": False})

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
            got_t = torch.tensor(got, dtype=torch.float32)
            if got_t.shape != want.shape or not torch.equal(got_t, want):
                raise WeightSyncError(f"weight sync check failed on {url}: {name} reads back different values "
                                      f"from what was pushed (first rows; max |diff| "
                                      f"{float((got_t - want).abs().max()) if got_t.shape == want.shape else 'shape'})")
            checked += 1
        return checked

    async def _replay(self, urls: Sequence[str], buckets: Sequence[tuple[torch.Tensor, list]]) -> None:
        await asyncio.gather(*(self._admin(u, "/begin_weight_update") for u in urls))
        try:
            for flat, metas in buckets:
                await asyncio.gather(*(self._push_flat(u, flat, metas) for u in urls))
        finally:
            await asyncio.gather(*(self._admin(u, "/end_weight_update") for u in urls), return_exceptions=True)
        await asyncio.gather(*(self._flush(u) for u in urls))

    def _update_weights_sglang(self, named_tensors, *, dtype, ignore, weight_version) -> list[str]:
        from trainer.rollout.sglang_engine import default_probe_names, flatten_bucket, iter_cast_buckets, probe_rows

        dtype = dtype or self.model_dtype
        if ignore is None:  # as the native servers: a tied model's lm_head is the embedding, not pushed
            ignore = {"lm_head.weight"} if self._tied() else set()
        ignore = set(ignore)
        with self.weights_lock:
            urls = list(self.worker_urls)
            names: list[str] = []
            kept: list[tuple[torch.Tensor, list]] = []
            probes: dict[str, torch.Tensor] = {}

            async def begin():
                await asyncio.gather(*(self._admin(u, "/begin_weight_update") for u in urls))

            async def end():
                await asyncio.gather(*(self._admin(u, "/end_weight_update") for u in urls), return_exceptions=True)

            def pushed():
                for bucket in iter_cast_buckets(((n, t) for n, t in named_tensors if n not in ignore), dtype,
                                                self.bucket_bytes):
                    flat, metas = flatten_bucket(bucket, dtype, device="cpu")
                    self._call(_gather(self._push_flat(u, flat, metas) for u in urls))
                    if self.retain_push:
                        kept.append((flat, metas))
                    for m in metas:  # candidate probes: first rows as sent (a few KB)
                        if m.name.endswith(PROBE_SUFFIXES):
                            probes[m.name] = probe_rows(flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape),
                                                        2, dtype)
                    names.extend(n for n, _ in bucket)
                    yield from bucket

            self._call(self._drain())
            try:
                self._call(begin())
                try:
                    source = checksum_named_tensors(pushed(), dtype=dtype)
                finally:
                    self._call(end())
                self._call(_gather(self._flush(u) for u in urls))
                pick = default_probe_names(names)
                self._probes = {n: probes[n] for n in pick if n in probes}
                for u in urls:
                    self._call(self._read_back(u))
            finally:
                self._call(self._reopen())
            self._last_push = kept
            self.expected_checksum = source
            self.accepted = {u: source for u in urls}
            self.stats.weight_pushes += 1
            return names

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
            self._call(self._replay([url], self._last_push))
            self._call(self._read_back(url))
            self.accepted[url] = self.expected_checksum
            return True

    def weights_checksum(self) -> str:
        sums = self.checksums()
        if len(set(sums.values())) != 1:
            raise WeightSyncError(f"the workers hold different weights: {sums}")
        return next(iter(sums.values()))


# --------------------------------------------------------------------------------------------------
# the fleet: processes
# --------------------------------------------------------------------------------------------------
FLEET_KEY_ENV = "COXSWAIN_FLEET_KEY"

# Every server and the router run under trainer.orphans.SUPERVISOR: killed when the trainer goes away
# (SIGKILL included, where no atexit runs).


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if isinstance(proc, RemoteProc):
        return  # ended through its host actor (_kill_group)
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(proc: subprocess.Popen, grace_s: float = 0.0) -> None:
    """End a process group the fleet started: SIGTERM and up to ``grace_s`` to exit (the supervisor then
    reaps its child, so no zombie is left behind), then SIGKILL whatever is left in the group."""
    if isinstance(proc, RemoteProc):
        proc.kill(grace_s)
        return
    if grace_s > 0 and proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


class ServerHost:
    """A Ray actor that runs one fleet server on its own node: the command under the orphan supervisor
    (so the server ends when this actor's process does, e.g. when the node's raylet dies), with
    ``--host`` set to the node's IP; ``wait_ready`` returns the server's URL."""

    def __init__(self, cmd: list[str], env: dict, log_path: str):
        import ray

        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        cmd = list(cmd)
        cmd[cmd.index("--host") + 1] = self.node_ip
        self.log_path = log_path
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "ab") as logf:
            self.proc = subprocess.Popen(supervised(cmd), stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **env}, start_new_session=True)

    def where(self) -> tuple[str, str]:
        return self.node_id, self.node_ip

    def wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    url = ready_url(line, SERVER_READY_PREFIX)
                    if url is not None:
                        return url
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        _kill_group(self.proc)
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-3000:]
        raise FleetError(f"rollout server on node {self.node_ip} did not start (log {self.log_path}):\n{tail}")

    def poll(self):
        return self.proc.poll()

    def terminate(self, grace_s: float) -> None:
        _kill_group(self.proc, grace_s)


class RemoteProc:
    """A server started by a :class:`ServerHost` actor, seen like a ``Popen`` (``poll``; ``kill``)."""

    def __init__(self, handle):
        self.handle, self.returncode, self.pid = handle, None, None
        self.node_id = self.node_ip = None

    def poll(self):
        import ray

        if self.returncode is None:
            try:
                self.returncode = ray.get(self.handle.poll.remote(), timeout=3)
            except ray.exceptions.GetTimeoutError:
                return None  # busy: not known dead
            except Exception:  # noqa: BLE001 - the host actor (or its node, or Ray) is gone, and the server with it
                self.returncode = -9
        return self.returncode

    def host_answers(self, timeout_s: float = 3.0) -> bool:
        import ray

        try:
            ray.get(self.handle.where.remote(), timeout=timeout_s)
            return True
        except Exception:  # noqa: BLE001 - dead, unavailable or not answering
            return False

    def node_alive(self) -> bool | None:
        """Ray's view of the server's node (None before it is known)."""
        import ray

        if self.node_id is None:
            return None
        return next((bool(n.get("Alive")) for n in ray.nodes() if n["NodeID"] == self.node_id), False)

    def kill(self, grace_s: float = 0.0) -> None:
        import ray

        try:
            ray.get(self.handle.terminate.remote(grace_s), timeout=grace_s + 15)
        except Exception:  # noqa: BLE001 - a lost node: the supervisor ended the server with the actor
            pass
        try:
            ray.kill(self.handle)
        except Exception:  # noqa: BLE001
            pass
        self.returncode = self.returncode if self.returncode is not None else -9


@dataclass
class _Server:
    index: int
    proc: subprocess.Popen
    url: str
    log_path: str
    failed_checks: int = 0
    generation: int = 0
    dropped: bool = False


@dataclass
class Fleet:
    """N native servers behind sglang-router, and their :class:`FleetClient`; see the module docstring."""

    model: str
    num_servers: int = 2
    threads_per_server: int = 1
    max_batch_size: int = 32
    max_seq_len: int | None = None
    dtype: str = "float32"
    host: str = "127.0.0.1"
    policy: str = "round_robin"
    health_interval_s: float = 1.0
    server_args: Sequence[str] = ()  # extra trainer.rollout.native_server flags
    router_args: Sequence[str] = ()  # extra sglang_router.launch_router flags
    log_dir: str | None = None
    startup_timeout_s: float = 180.0
    client_kwargs: dict = field(default_factory=dict)
    hosts: Sequence[dict] | None = None  # Ray actor options per server: run server k on that node (see above)
    node_grace_s: float = 30.0  # how long a dead remote server waits for Ray's verdict on its node
    backend: str = "native"  # native (trainer.rollout.native_server) | sglang (real sglang.launch_server)
    device: str = "cpu"  # sglang: the servers' device (cpu: SGLang's CPU path, trainer/rollout/sglang_cpu)
    max_total_tokens: int = 4096  # sglang on CPU: the KV cache's size in tokens
    server_python: str | None = None  # sglang: the interpreter with sglang (default sglang_cpu.server_python())

    def __post_init__(self):
        if self.backend not in ("native", "sglang"):
            raise ValueError(f"Fleet backend={self.backend!r}: 'native' or 'sglang'")
        if self.backend == "sglang":
            if self.hosts is not None:
                raise FleetError("a fleet of SGLang servers runs on the trainer's host: its weight route (SGLang's "
                                 "update_weights_from_tensor) shares memory with the sender; use backend='native' "
                                 "for servers on other nodes")
            if self.server_python is None:
                from trainer.rollout import sglang_cpu

                self.server_python = sglang_cpu.server_python()
                if self.server_python is None:
                    raise FleetError(f"backend='sglang' needs an interpreter with sglang: install the 'sglang' extra "
                                     f"(GPU) or run {sglang_cpu.INSTALL_COMMAND} (CPU)")
        self.servers: list[_Server] = []
        self.router: subprocess.Popen | None = None
        self.router_url: str | None = None
        self.client: FleetClient | None = None
        self.stats = FleetStats()
        self.api_key = secrets.token_hex(32)  # this fleet's servers accept weight / control requests with it only
        self._lock = threading.RLock()  # one restart at a time
        self._stop = threading.Event()
        self._poke = threading.Event()
        self._monitor: threading.Thread | None = None
        self._closed = False
        self._pending: list[subprocess.Popen] = []  # every process started, for close()
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="coxswain-fleet-")
        os.makedirs(self.log_dir, exist_ok=True)

    # ---- lifecycle ------------------------------------------------------------------------------------
    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def server_urls(self) -> list[str]:
        return [s.url for s in self.servers if not s.dropped]

    def start(self) -> "Fleet":
        atexit.register(self.close)
        try:
            procs = [self._spawn_server(k, 0) for k in range(self.num_servers)]  # all start at once
            self.servers = [self._await_server(k, p, path, 0) for k, (p, path) in enumerate(procs)]
            self._start_router()
            kw = dict(self.client_kwargs)
            if self.backend == "sglang":
                # each sample its own request: SGLang honours no per-request seed unless deterministic
                kw = {"per_sample_requests": True, **kw, "weight_protocol": "sglang", "model_dir": self.model,
                      "model_dtype": self.dtype}
            self.client = FleetClient(self.router_url, self.server_urls, on_failure=self._on_failure, stats=self.stats,
                                      api_key=self.api_key, **kw)
            if self.backend == "sglang":
                self.client.expected_checksum = None  # the checkpoint on disk until the first push
            else:
                self._check_start_weights()
        except BaseException:
            self.close()
            raise
        self._monitor = threading.Thread(target=self._watch, name="coxswain-fleet-monitor", daemon=True)
        self._monitor.start()
        return self

    def _check_start_weights(self) -> None:
        sums = self.client._call(self.client._checksums(self.server_urls))
        if len(set(sums.values())) != 1:
            raise WeightSyncError(f"the servers started with different weights: {sums}")
        self.client.expected_checksum = next(iter(sums.values()))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._poke.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(30)
        if self.client is not None:
            self.client.close()
        # SIGTERM everything at once, then wait: the servers exit in about a second, the router at once.
        for p in self._pending:
            if p.poll() is None:
                _signal_group(p, signal.SIGTERM)
        for p in self._pending:
            _kill_group(p, grace_s=10.0)
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001
            pass

    # ---- servers ----------------------------------------------------------------------------------------
    def _spawn(self, cmd: list[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(supervised(cmd), stdout=logf, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self._pending.append(proc)
        return proc

    def _spawn_server(self, k: int, generation: int) -> tuple[subprocess.Popen, str]:
        if self.backend == "sglang":
            return self._spawn_sglang(k, generation)
        cmd = [sys.executable, "-m", "trainer.rollout.native_server", "--model", self.model, "--host", self.host,
               "--port", "0", "--threads", str(self.threads_per_server), "--max-batch-size", str(self.max_batch_size),
               "--dtype", self.dtype, "--skip-tokenizer-init", *map(str, self.server_args)]
        if self.max_seq_len:
            cmd += ["--max-seq-len", str(self.max_seq_len)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads_per_server))
        # a fresh key per fleet, handed over in the environment (never on a command line other users can read):
        # only this trainer may push, read out or pause the weights; generation comes through the router
        env[FLEET_KEY_ENV] = self.api_key
        cmd += ["--api-key-env", FLEET_KEY_ENV, "--open-generation"]
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        path = os.path.join(self.log_dir, f"server-{k}-{generation}.log")
        if self.hosts is not None:  # on server k's own node, through a host actor there
            import ray

            extra = {k2: env[k2] for k2 in ("PYTHONUNBUFFERED", "OMP_NUM_THREADS", FLEET_KEY_ENV, "PYTHONPATH")}
            opts = dict(self.hosts[k % len(self.hosts)])
            handle = ray.remote(ServerHost).options(**opts, max_concurrency=4).remote(cmd, extra, path)
            proc = RemoteProc(handle)
            self._pending.append(proc)
            return proc, path
        return self._spawn(cmd, path, env), path

    def _spawn_sglang(self, k: int, generation: int) -> tuple[subprocess.Popen, str]:
        from trainer.rollout import sglang_cpu
        from trainer.rollout.sglang_http import server_command

        port = free_port(self.host)
        cmd = server_command(self.server_python, self.model, host=self.host, port=port, device=self.device,
                             # no --context-length: SGLang derives it from the model (as the in-worker
                             # adapter); a longer one than the model's positions is refused by SGLang
                             dtype=self.dtype, admin_key=self.api_key,
                             max_total_tokens=self.max_total_tokens, extra=self.server_args)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads_per_server))
        if self.device == "cpu":
            sglang_cpu.activate(env)
        path = os.path.join(self.log_dir, f"server-{k}-{generation}.log")
        proc = self._spawn(cmd, path, env)
        proc.coxswain_url = f"http://{self.host}:{port}"  # known up front: SGLang prints no machine-readable line
        return proc, path

    def _await_server(self, k: int, proc: subprocess.Popen, path: str, generation: int) -> _Server:
        if isinstance(proc, RemoteProc):
            import ray

            try:
                url = ray.get(proc.handle.wait_ready.remote(self.startup_timeout_s), timeout=self.startup_timeout_s + 60)
                proc.node_id, proc.node_ip = ray.get(proc.handle.where.remote())
            except ray.exceptions.RayTaskError as e:
                proc.kill()
                raise FleetError(f"rollout server {k} did not start: {e.cause if hasattr(e, 'cause') else e}") from e
            except ray.exceptions.RayError as e:
                proc.kill()
                raise FleetError(f"rollout server {k} did not start ({type(e).__name__}: {e})") from e
            return _Server(k, proc, url, path, generation=generation)
        if self.backend == "sglang":
            probe, every = (lambda: self._sglang_answers(proc.coxswain_url)), 0.5
        else:
            probe, every = (lambda: self._ready_line(path)), 0.05
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            url = probe()
            if url is not None:
                return _Server(k, proc, url, path, generation=generation)
            time.sleep(every)
        _kill_group(proc)
        with open(path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-3000:]
        raise FleetError(f"{'SGLang' if self.backend == 'sglang' else 'rollout'} server {k} did not start "
                         f"(log {path}):\n{tail}")

    @staticmethod
    def _ready_line(path: str) -> str | None:
        """The URL a native server prints once it listens, or None yet."""
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                url = ready_url(line, SERVER_READY_PREFIX)
                if url is not None:
                    return url
        return None

    @staticmethod
    def _sglang_answers(url: str) -> str | None:
        """``url`` once SGLang's /model_info answers (its tokenizer manager and scheduler are up), else None;
        SGLang prints no machine-readable ready line."""
        import urllib.request

        try:
            with urllib.request.urlopen(url + "/model_info", timeout=5) as r:
                return url if r.status == 200 else None
        except OSError:
            return None

    # ---- router ----------------------------------------------------------------------------------------
    def _start_router(self) -> None:
        port = free_port(self.host)
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *self.server_urls,
               "--policy", self.policy, "--host", self.host, "--port", str(port),
               "--prometheus-host", self.host, "--prometheus-port", str(free_port(self.host)),
               "--disable-retries",  # failures reach the client, which retries and counts them
               "--health-check-interval-secs", str(max(1, int(round(self.health_interval_s)))),
               "--health-failure-threshold", "1", "--health-success-threshold", "1",
               "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", str(int(self.startup_timeout_s)),
               "--log-level", "warn", *map(str, self.router_args)]
        self.router = self._spawn(cmd, os.path.join(self.log_dir, "router.log"))
        self.router_url = f"http://{self.host}:{port}"
        self._await_router({s.url for s in self.servers}, set())

    def _router_workers(self) -> list[dict]:
        import urllib.request

        with urllib.request.urlopen(self.router_url + "/workers", timeout=5) as r:
            return json.load(r).get("workers", [])

    def _router_call(self, method: str, path: str, body: dict | None = None) -> None:
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.router_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()

    def _await_router(self, present: set[str], absent: set[str], timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.startup_timeout_s)
        last: Any = None
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                break
            try:
                workers = {w["url"]: w for w in self._router_workers()}
                last = {u: w.get("is_healthy") for u, w in workers.items()}
                if all(workers.get(u, {}).get("is_healthy") for u in present) and not (absent & set(workers)):
                    return
            except OSError as e:
                last = e
            time.sleep(0.1)
        with open(os.path.join(self.log_dir, "router.log"), encoding="utf-8", errors="replace") as f:
            tail = f.read()[-3000:]
        raise FleetError(f"sglang-router did not reach workers {sorted(present)} healthy / {sorted(absent)} removed "
                         f"(last /workers: {last}); log:\n{tail}")

    # ---- health and restarts -----------------------------------------------------------------------------
    def _on_failure(self, reason: str) -> None:
        self._poke.set()  # wake the monitor now (called from the client's loop: never block here)

    def _watch(self) -> None:
        import urllib.request

        while not self._stop.is_set():
            self._poke.wait(self.health_interval_s)
            self._poke.clear()
            if self._stop.is_set():
                return
            for s in list(self.servers):
                if s.dropped:
                    continue
                dead = s.proc.poll() is not None
                if not dead:
                    try:
                        with urllib.request.urlopen(s.url + "/health", timeout=5) as r:
                            s.failed_checks = 0 if r.status == 200 else s.failed_checks + 1
                    except OSError:
                        s.failed_checks += 1
                    dead = s.failed_checks >= 3  # hung: three failed checks in a row
                if dead and not self._stop.is_set():
                    try:
                        self.restart_server(s.index)
                    except Exception:  # noqa: BLE001 - keep watching; the next round tries again
                        log.exception("fleet: restarting server %d failed", s.index)

    def restart_server(self, k: int) -> str:
        """Replace server ``k`` (killed if still running) by a fresh one on a new port; returns its URL."""
        with self._lock:
            old = self.servers[k]
            if old.dropped:
                return old.url
            self.client.set_workers([s.url for s in self.servers if s.index != k and not s.dropped])
            if isinstance(old.proc, RemoteProc) and self._node_lost(old.proc):
                return self.drop_server(k, f"its node {old.proc.node_ip} left the Ray cluster")
            _kill_group(old.proc, grace_s=2.0)
            self._unroute(old.url)
            gen = old.generation + 1
            proc, path = self._spawn_server(k, gen)
            try:
                new = self._await_server(k, proc, path, gen)
            except FleetError:  # a remote server's node may be going down as it is replaced: then drop it
                if isinstance(old.proc, RemoteProc) and self._node_lost(old.proc):
                    return self.drop_server(k, f"its node {old.proc.node_ip} left the Ray cluster")
                raise
            with self.client.weights_lock:  # no push in flight: copy the fleet's current weights
                self._sync_from_peer(new.url)
                self.servers[k] = new
            self._router_call("POST", "/workers", {"url": new.url})
            self._await_router({new.url}, set(), timeout=60)
            self.client.set_workers(self.server_urls)
            self.stats.restarts += 1
            log.warning("fleet: server %d restarted at %s (was %s)", k, new.url, old.url)
            return new.url

    def _node_lost(self, proc: RemoteProc) -> bool:
        """Whether a failed remote server's node has left the cluster: no when its host actor still answers
        (the server itself died or hung); otherwise Ray's verdict on the node, which comes within its
        detection time (about 15 s), waited for up to ``node_grace_s``."""
        if proc.host_answers():
            return False
        deadline = time.monotonic() + self.node_grace_s
        while True:
            alive = proc.node_alive()
            if alive is False:
                return True
            if alive is None or time.monotonic() > deadline or self._stop.is_set():
                return False
            time.sleep(1.0)

    def _unroute(self, url: str) -> None:
        """Take ``url`` off the router (and wait until it is gone); a router that cannot be reached is logged."""
        try:
            wid = next((w["id"] for w in self._router_workers() if w["url"] == url), None)
            if wid is not None:
                self._router_call("DELETE", f"/workers/{wid}")
                self._await_router(set(), {url}, timeout=30)
        except OSError as e:
            log.warning("fleet: could not remove %s from the router: %s", url, e)

    def drop_server(self, k: int, why: str) -> str:
        """Take server ``k`` out of the fleet for good (the router, the client's list, the monitor): its
        node is gone. The other servers serve on; raises :class:`FleetError` when none is left."""
        with self._lock:
            old = self.servers[k]
            old.dropped = True
            self.client.set_workers(self.server_urls)
            _kill_group(old.proc)
            self._unroute(old.url)
            self.stats.dropped += 1
            log.warning("fleet: server %d at %s dropped: %s; %d server(s) left", k, old.url, why, len(self.server_urls))
            if not self.server_urls:
                raise FleetError(f"every rollout server is lost (the last: {old.url}, {why})")
            return old.url

    def _sync_from_peer(self, url: str) -> None:
        import urllib.request

        if self.backend == "sglang":  # SGLang has no weight read-out: the client replays the last push
            self.client.replay_last_push(url)
            return
        expected = self.client.expected_checksum
        if expected is None:
            return
        auth = {"Authorization": f"Bearer {self.api_key}"}
        with urllib.request.urlopen(urllib.request.Request(url + "/weights_checksum", headers=auth), timeout=60) as r:
            if json.load(r)["checksum"] == expected:
                return  # weights from disk are the fleet's current ones
        for peer in self.client.worker_urls:
            try:
                with urllib.request.urlopen(urllib.request.Request(peer + "/weights_safetensors", headers=auth),
                                            timeout=600) as r:
                    blob = r.read()
                req = urllib.request.Request(url + "/update_weights_from_tensor", data=blob, method="POST",
                                             headers={"Content-Type": WEIGHTS_CONTENT_TYPE, **auth})
                with urllib.request.urlopen(req, timeout=600) as r:
                    r.read()
                self.client.verify_weights(expected, [url])
                return
            except (OSError, WeightSyncError) as e:
                log.warning("fleet: copying weights from %s to %s failed: %s", peer, url, e)
        raise WeightSyncError(f"restarted server {url} holds stale weights and no live peer could provide them")
