"""The one aiohttp skeleton under both HTTP servers over the native engine.

:class:`EngineServer` holds what a request needs whatever the protocol: the engine, its
:class:`~trainer.rollout.async_engine.Batcher` (started when the app starts, stopped when it is cleaned
up: one engine call at a time in one worker thread, concurrent requests batched into it), the
:class:`~trainer.rollout.async_engine.EngineStats` counters, and the bearer key. ``app()`` builds the
``web.Application`` with one middleware that checks the key (``Authorization: Bearer <key>``, compared
in constant time) and turns errors into responses: a protocol's own request errors in its own JSON
shape (:meth:`EngineServer.error_response`), anything else a 500 that is counted in ``stats.errors``;
the server stays up either way.

A protocol adapter subclasses it and fills in the hooks: :meth:`~EngineServer.add_routes`,
:meth:`~EngineServer.needs_auth`, :meth:`~EngineServer.unauthorized`, :meth:`~EngineServer.error_response`,
:meth:`~EngineServer.internal_error`, and the class attributes ``ready_prefix`` (the ready line,
:mod:`trainer.net`), ``url_path`` (appended to ``http://HOST:PORT``) and ``client_max_size``.
The adapters: :mod:`trainer.serving.openai` (OpenAI-compatible, ``python -m trainer.serve``) and
:mod:`trainer.serving.sglang_native` (SGLang's native protocol, ``python -m trainer.rollout.native_server``).

Running one: :func:`serve` binds (``port=0``: a free port), sets ``server.url`` and prints the ready
line ``PREFIX URL (model NAME)`` once it accepts connections; :func:`serve_until_signal` runs it until
SIGINT / SIGTERM and shuts down cleanly (the batcher stopped, the engine's running call aborted).
The command-line pieces both servers share: :func:`add_engine_args` and :func:`load_engine`.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import signal
import threading
from typing import Any, Callable

from aiohttp import web

from trainer.rollout.async_engine import Batcher, EngineStats


# --------------------------------------------------------------------------------------------------
# auth and JSON errors
# --------------------------------------------------------------------------------------------------
def bearer_ok(request: web.Request, api_key: str) -> bool:
    """``Authorization: Bearer <api_key>``, compared in constant time."""
    auth = request.headers.get("Authorization", "")
    given = auth[7:] if auth[:7].lower() == "bearer " else ""
    return hmac.compare_digest(given.encode(), api_key.encode())


def error_body(message: str, **fields: Any) -> dict:
    """``{"error": {"message": message, **fields}}``: SGLang's error shape; OpenAI's adds type, param, code."""
    return {"error": {"message": message, **fields}}


def json_error(status: int, message: str, **fields: Any) -> web.Response:
    """:func:`error_body` as a JSON response with ``status``."""
    return web.json_response(error_body(message, **fields), status=status)


# --------------------------------------------------------------------------------------------------
# the server skeleton
# --------------------------------------------------------------------------------------------------
class EngineServer:
    """Engine, batcher, counters and key behind one aiohttp app; see the module docstring."""

    ready_prefix: str = ""  # the ready line's prefix (trainer.net)
    url_path: str = ""  # server.url = f"http://{host}:{port}{url_path}"
    client_max_size: int = 64 * 1024 * 1024  # the largest request body (of any route)

    def __init__(self, engine, *, model_name: str, api_key: str | None = None, max_batch_samples: int = 32,
                 batch_wait_s: float = 0.005, batch_max_wait_s: float = 0.05, max_request_bytes: int = 64 << 20,
                 max_samples_per_request: int = 4096):
        if max_batch_samples < 1 or max_request_bytes < 1 or max_samples_per_request < 1:
            raise ValueError("--max-batch-size, --max-request-mb and --max-samples-per-request must be > 0")
        self.max_request_bytes = int(max_request_bytes)  # generation / completion bodies (weight pushes have their own)
        self.max_samples_per_request = int(max_samples_per_request)
        self.engine = engine  # what the batcher calls (an adapter may wrap the engine after __init__)
        self.model_name = model_name
        self.api_key = api_key or None
        self.max_seq_len = int(engine.max_seq_len)
        self.vocab_size = int(engine.config.vocab_size)
        self.max_batch_samples = max_batch_samples
        self.batch_wait_s = batch_wait_s
        self.batch_max_wait_s = batch_max_wait_s
        self.stats = EngineStats()
        self.batcher: Batcher | None = None
        self.url: str | None = None  # set by serve() once bound

    # ---- hooks for a protocol adapter ---------------------------------------------------------------
    def add_routes(self, router: web.UrlDispatcher) -> None:
        raise NotImplementedError

    def needs_auth(self, request: web.Request) -> bool:
        """Whether this request must carry the key (when one is set)."""
        return True

    def unauthorized(self) -> web.Response:
        return json_error(401, "Unauthorized")

    def error_response(self, exc: Exception) -> web.Response | None:
        """The response for one of the protocol's own errors (a refused request), None for any other."""
        return None

    def internal_error(self, exc: Exception) -> web.Response:
        return json_error(500, f"internal error: {type(exc).__name__}: {exc}")

    # ---- the app -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=self.client_max_size)
        self.add_routes(app.router)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app) -> None:
        self.batcher = Batcher(self.engine, max_batch_samples=self.max_batch_samples, wait_s=self.batch_wait_s,
                               max_wait_s=self.batch_max_wait_s, stats=self.stats)
        self.batcher.start()

    async def _on_cleanup(self, app) -> None:
        if self.batcher is not None:
            await self.batcher.stop()

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        try:
            if self.api_key is not None and self.needs_auth(request) and not bearer_ok(request, self.api_key):
                return self.unauthorized()
            refused = self.refuse(request)
            if refused is not None:
                return refused
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception as e:  # noqa: BLE001 - the server stays up; the client sees a 4xx or a 500
            response = self.error_response(e)
            if response is not None:
                return response
            self.stats.errors += 1
            return self.internal_error(e)

    def refuse(self, request: web.Request) -> web.Response | None:
        """A server's own policy check after authentication (None: go on); e.g. endpoints off without a key."""
        return None

    def counters(self) -> dict:
        """The batcher's counters and the queue length, for a health / info endpoint (no model output)."""
        s = self.stats
        return {"requests": s.requests, "prompts": s.prompts, "engine_calls": s.engine_calls,
                "batched_prompts": s.batched_prompts, "max_batch_prompts": s.max_batch_prompts,
                "generated_tokens": s.generated_tokens, "engine_seconds": round(s.engine_seconds, 4),
                "errors": s.errors, "queued": self.batcher.queue.qsize() if self.batcher else 0}


# --------------------------------------------------------------------------------------------------
# running a server
# --------------------------------------------------------------------------------------------------
async def run_app(app: web.Application, host: str, port: int, on_bound: Callable[[int], None],
                  stop: asyncio.Event | None = None) -> None:
    """Serve ``app`` until ``stop`` is set (or forever); ``on_bound(port)`` runs once it accepts
    connections, with the port actually bound (``port=0`` binds a free one)."""
    # handler_cancellation: a client that hangs up (a judge timing out) cancels its handler, and its
    # items are dropped before they reach the engine.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    on_bound(runner.addresses[0][1])
    stop = stop or asyncio.Event()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run_until_signal(serve_fn: Callable[[asyncio.Event], Any]) -> None:
    """``asyncio.run(serve_fn(stop))`` with SIGINT / SIGTERM setting ``stop``: a clean shutdown."""
    async def _main():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve_fn(stop)

    asyncio.run(_main())


async def serve(server: EngineServer, host: str, port: int, ready: threading.Event | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set (or forever). Prints the ready line with the bound port, then sets
    ``ready`` (if given)."""
    def bound(p: int) -> None:
        server.url = f"http://{host}:{p}{server.url_path}"
        print(f"{server.ready_prefix}{server.url} (model {server.model_name})", flush=True)
        if ready is not None:
            ready.set()

    await run_app(server.app(), host, port, bound, stop)


def serve_until_signal(server: EngineServer, host: str, port: int) -> None:
    """:func:`serve` until SIGINT / SIGTERM (a command-line server's main loop)."""
    run_until_signal(lambda stop: serve(server, host, port, stop=stop))


# --------------------------------------------------------------------------------------------------
# command line: what both servers share
# --------------------------------------------------------------------------------------------------
def path_problem(value) -> str | None:
    """What makes ``value`` unusable as a path before any look at the disk (None: nothing): not a string,
    empty, or holding a NUL byte (every os call raises on one)."""
    if not isinstance(value, str) or not value:
        return f"must be a non-empty path string (got {type(value).__name__})"
    if "\x00" in value:
        return "holds a NUL byte; a path cannot"
    return None


def model_dir_arg(value: str) -> str:
    """A directory flag (``--model``, ``--weights-root``): an existing directory (argparse prints the
    reason as one line and exits 2)."""
    problem = path_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    if not os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a directory")
    return value


def add_engine_args(ap: argparse.ArgumentParser, *, port: int) -> None:
    """The model, bind address and engine flags (``--port`` defaults to ``port``)."""
    ap.add_argument("--model", required=True, type=model_dir_arg, help="HF-format checkpoint dir (Llama / Qwen2 / Qwen3)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--port", type=int, default=port, help="0 = pick a free port (printed at start)")
    ap.add_argument("--served-model-name", default=None, help="model id clients send (default: the dir's name)")
    ap.add_argument("--max-batch-size", type=int, default=32, help="samples per engine call (KV-cache rows)")
    ap.add_argument("--max-request-mb", type=float, default=64.0,
                    help="largest request body a generation / completion request may have (413 beyond)")
    ap.add_argument("--max-samples-per-request", type=int, default=4096,
                    help="prompts x n one request may ask for (413 beyond)")
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="prompt + response tokens (default: min(max_position_embeddings, 4096))")
    ap.add_argument("--batch-wait-ms", type=float, default=5.0,
                    help="a batch closes once no request arrived for this long (0 = take what is queued)")
    ap.add_argument("--batch-max-wait-ms", type=float, default=50.0, help="... or after this long in all")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def request_limits(a: argparse.Namespace) -> dict:
    """The caps of :func:`add_engine_args` as server keywords."""
    return dict(max_request_bytes=int(a.max_request_mb * (1 << 20)), max_samples_per_request=a.max_samples_per_request)


async def read_capped(request: web.Request, cap: int) -> bytes:
    """The body, refused with 413 once it passes ``cap`` bytes (read no further: a huge body costs nothing)."""
    def too_large():
        msg = (f"the request body is larger than this server's limit of {cap} bytes (--max-request-mb); send "
               f"fewer or shorter prompts per request")
        return web.HTTPRequestEntityTooLarge(max_size=cap, actual_size=cap + 1, text=json.dumps(error_body(msg)),
                                             content_type="application/json")

    if request.content_length is not None and request.content_length > cap:
        raise too_large()
    # read(n) returns what has arrived so far, up to n bytes (one network chunk of a large body): read
    # until the end of the body or one byte past the cap
    parts, size = [], 0
    while size <= cap:
        chunk = await request.content.read(cap + 1 - size)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    if size > cap:
        raise too_large()
    return b"".join(parts)


def parse_json_body(raw: bytes):
    """The request body as JSON, or ValueError with the reason: not UTF-8, not JSON, non-finite numbers
    (``NaN``, ``Infinity``), or nested too deeply for the parser."""
    def no_constants(name):
        raise ValueError(f"{name} is not a number this server accepts: every number must be finite")

    try:
        return json.loads(raw.decode("utf-8"), parse_constant=no_constants)
    except UnicodeDecodeError as e:
        raise ValueError(f"the body is not UTF-8: {e.reason} at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("the body nests too deeply") from None


def served_model_name(a: argparse.Namespace) -> str:
    """``--served-model-name``, else the checkpoint dir's name."""
    return a.served_model_name or os.path.basename(os.path.normpath(a.model))


def load_engine(a: argparse.Namespace):
    """The :class:`~trainer.rollout.native.NativeEngine` the flags of :func:`add_engine_args` describe,
    with its whole KV cache allocated (an out-of-memory shows at start, not at the first request)."""
    import torch

    from trainer.rollout.hf_model import ModelConfig
    from trainer.rollout.native import NativeEngine

    cfg = ModelConfig.from_pretrained(a.model)
    max_seq_len = a.max_seq_len or min(int(cfg.max_position_embeddings or 4096), 4096)
    engine = NativeEngine(a.model, max_batch_size=a.max_batch_size, max_seq_len=max_seq_len,
                          dtype=getattr(torch, a.dtype), device=a.device, num_threads=a.threads)
    engine.reserve()
    return engine
