"""The rollout fleet over HTTP: N engine servers behind the real ``sglang-router``, and a client that is a
:class:`~trainer.rollout.engine.RolloutEngine`.

    with Fleet("recipes/cpu/tiny_model", num_servers=2, threads_per_server=1) as fleet:
        outs = fleet.client.generate(prompts, SamplingParams(n=4, max_new_tokens=64, seed=7))
        fleet.client.update_weights(actor_hf_named_tensors)       # drained, bucketed, checksummed
        outs = await fleet.client.agenerate(prompt_ids, params)     # one prompt, from any event loop

API (what the controller calls):

``Fleet(model, *, num_servers=2, threads_per_server=1, max_batch_size=32, max_seq_len=None,
dtype="float32", host="127.0.0.1", policy="round_robin", health_interval_s=1.0, server_args=(),
router_args=(), log_dir=None, startup_timeout_s=600, client_kwargs={}, hosts=None)``
    ``start()`` (or ``with``) launches ``num_servers`` ``python -m trainer.rollout.native_server``
    processes on free loopback ports (``--threads threads_per_server``, ``OMP_NUM_THREADS`` likewise),
    waits for each one's ready line, then launches ``python -m sglang_router.launch_router`` (sglang-router
    0.3.2) with ``--worker-urls`` and ``--policy``, and waits until the router lists every worker as
    healthy. ``fleet.client`` is the :class:`FleetClient`; ``fleet.server_urls``, ``fleet.router_url``;
    ``fleet.stats`` (:class:`FleetStats`, shared with the client; ``as_metrics()`` gives ``fleet/*``
    keys). Logs: ``log_dir`` (a temp dir by default): ``server-K-GEN.log``, ``router.log``. ``close()``
    (also at exit) ends every process group it started (SIGTERM, then SIGKILL after 10 s); each process
    runs under a small supervisor that kills it if the trainer dies without closing (SIGKILL included). A monitor thread health-checks the servers every
    ``health_interval_s`` (process alive, and the server adapter's ``hang_probe`` answering: ``GET /health``,
    SGLang's ``GET /health_generate``), and at once when the client
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

``backend`` names an engine (:mod:`trainer.rollout.registry`); the class that starts its servers, finds
them ready, sets up the client's weight protocol and re-syncs a restarted server is the server adapter the
engine class declares (``capabilities.server``: :class:`NativeServers`, :class:`SGLangServers` below).

The client (:class:`~trainer.rollout.fleet_client.FleetClient`, its weight protocols, retries, seeds
and stops) is documented in :mod:`trainer.rollout.fleet_client`.
"""

from __future__ import annotations

import atexit
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
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer.hf_io import load_config_json
from trainer.orphans import supervised
from trainer.rollout import sglang_cpu
# the client lives in fleet_client; its names are re-exported here, where callers have always found them
from trainer.rollout.engine import WeightSyncError, moe_shape
from trainer.rollout.fleet_client import (FleetClient, FleetError, FleetStats, generate_payload,
                                          parse_generate_response, parse_output, prompt_seed)
from trainer.rollout.registry import server_adapter
from trainer.rollout.sglang_engine import model_refusal
from trainer.rollout.sglang_http import server_command
from trainer.net import SGLANG_NATIVE_READY_PREFIX as SERVER_READY_PREFIX
from trainer.net import free_port, ready_url
from trainer.wire import WEIGHTS_CONTENT_TYPE

__all__ = ["Fleet", "FleetClient", "FleetError", "FleetStats", "ServerHost", "RemoteProc", "WeightSyncError",
           "NativeServers", "SGLangServers", "generate_payload", "parse_generate_response", "parse_output", "prompt_seed"]

log = logging.getLogger(__name__)

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
        import ray  # heavy; used only with servers on a Ray cluster

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
        import ray  # heavy; used only with servers on a Ray cluster

        if self.returncode is None:
            try:
                self.returncode = ray.get(self.handle.poll.remote(), timeout=3)
            except ray.exceptions.GetTimeoutError:
                return None  # busy: not known dead
            except Exception:  # noqa: BLE001 - the host actor (or its node, or Ray) is gone, and the server with it
                self.returncode = -9
        return self.returncode

    def host_answers(self, timeout_s: float = 3.0) -> bool:
        import ray  # heavy; used only with servers on a Ray cluster

        try:
            ray.get(self.handle.where.remote(), timeout=timeout_s)
            return True
        except Exception:  # noqa: BLE001 - dead, unavailable or not answering
            return False

    def node_alive(self) -> bool | None:
        """Ray's view of the server's node (None before it is known)."""
        import ray  # heavy; used only with servers on a Ray cluster

        if self.node_id is None:
            return None
        return next((bool(n.get("Alive")) for n in ray.nodes() if n["NodeID"] == self.node_id), False)

    def kill(self, grace_s: float = 0.0) -> None:
        import ray  # heavy; used only with servers on a Ray cluster

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
    """N engine servers behind sglang-router, and their :class:`FleetClient`; see the module docstring. How a
    server starts, is found ready, is given weights after a restart: the engine's server adapter."""

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
    # a server that exits is reported at once (its process is polled); this bounds only one that hangs. An SGLang
    # server's start-up (imports, model load, its warm-up request) took over 180 s on a loaded 2-core AVX2 machine
    # without bf16 instructions, where bf16 matrix products run ~10x slower than fp32
    startup_timeout_s: float = 600.0
    client_kwargs: dict = field(default_factory=dict)
    hosts: Sequence[dict] | None = None  # Ray actor options per server: run server k on that node (see above)
    node_grace_s: float = 30.0  # how long a dead remote server waits for Ray's verdict on its node
    # the engine (trainer.rollout.registry name or pkg.module:Class) whose server adapter runs the servers:
    # native (trainer.rollout.native_server: NativeServers) | sglang (real sglang.launch_server: SGLangServers)
    backend: str = "native"
    device: str = "cpu"  # sglang: the servers' device (cpu: SGLang's CPU path, trainer/rollout/sglang_cpu)
    max_total_tokens: int = 4096  # sglang on CPU: the KV cache's size in tokens
    server_python: str | None = None  # sglang: the interpreter with sglang (default sglang_cpu.server_python())
    # R3 routing replay: the servers capture each token's experts (SGLang: --enable-return-routed-experts; the
    # native server always can) and the client decodes them to the model's MoE shape
    routed_experts: bool = False

    def __post_init__(self):
        self.route_shape = moe_shape(load_config_json(self.model)) if self.routed_experts else None
        if self.routed_experts and self.route_shape is None:
            raise FleetError(f"routed_experts=True (R3 routing replay), but {self.model} has no MoE layers")
        # how this engine runs as servers: the adapter its class declares (capabilities.server)
        self.kind = server_adapter(self.backend)(self)
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
            self.client = FleetClient(self.router_url, self.server_urls, on_failure=self._on_failure, stats=self.stats,
                                      api_key=self.api_key, route_shape=self.route_shape,
                                      **self.kind.client_kwargs(dict(self.client_kwargs)))
            self.kind.check_start_weights()
        except BaseException:
            self.close()
            raise
        self._monitor = threading.Thread(target=self._watch, name="coxswain-fleet-monitor", daemon=True)
        self._monitor.start()
        return self

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
        return self.kind.spawn(k, generation, os.path.join(self.log_dir, f"server-{k}-{generation}.log"))

    def _await_server(self, k: int, proc: subprocess.Popen, path: str, generation: int) -> _Server:
        if isinstance(proc, RemoteProc):
            import ray  # heavy; used only with servers on a Ray cluster

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
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            url = self.kind.ready(proc, path)
            if url is not None:
                return _Server(k, proc, url, path, generation=generation)
            time.sleep(self.kind.poll_s)
        _kill_group(proc)
        with open(path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-3000:]
        raise FleetError(f"{self.kind.label} server {k} did not start (log {path}):\n{tail}")

    # ---- router ----------------------------------------------------------------------------------------
    def _start_router(self) -> None:
        port = free_port(self.host)
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *self.server_urls,
               "--policy", self.policy, "--host", self.host, "--port", str(port),
               "--prometheus-host", self.host, "--prometheus-port", str(free_port(self.host)),
               "--disable-retries",  # failures reach the client, which retries and counts them
               "--health-check-interval-secs", str(max(1, int(round(self.health_interval_s)))),
               # a dead server refuses at once; a live one's /health took up to 3.7 s on a loaded 2-core machine
               "--health-check-timeout-secs", "10",
               "--health-failure-threshold", "1", "--health-success-threshold", "1",
               "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", str(int(self.startup_timeout_s)),
               "--log-level", "warn", *map(str, self.router_args)]
        self.router = self._spawn(cmd, os.path.join(self.log_dir, "router.log"))
        self.router_url = f"http://{self.host}:{port}"
        self._await_router({s.url for s in self.servers}, set())

    def _router_workers(self) -> list[dict]:
        with urllib.request.urlopen(self.router_url + "/workers", timeout=5) as r:
            return json.load(r).get("workers", [])

    def _router_call(self, method: str, path: str, body: dict | None = None) -> None:
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
                        with urllib.request.urlopen(s.url + self.kind.hang_probe, timeout=self.kind.hang_timeout_s) as r:
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
        self.kind.sync_new_server(url)


# --------------------------------------------------------------------------------------------------
# server adapters: how each engine runs as the fleet's servers (named by its capabilities.server)
# --------------------------------------------------------------------------------------------------
class NativeServers:
    """The native engine's servers: ``python -m trainer.rollout.native_server`` processes (locally, or on
    other nodes through :class:`ServerHost` actors), ready once they print their URL; Coxswain's weight
    protocol (safetensors blobs, checksums read from each server); a restarted server gets a live peer's
    weights when the fleet's have moved on from the checkpoint."""

    label = "rollout"
    poll_s = 0.05  # how often a starting server's log is read for its ready line
    # the monitor's hang check (three failures in a row restart the server): the native /health answers from
    # the server's event loop, which also runs generation, so a hung engine fails it
    hang_probe, hang_timeout_s = "/health", 5.0

    def __init__(self, fleet: Fleet):
        self.fleet = fleet

    def spawn(self, k: int, generation: int, path: str) -> tuple[subprocess.Popen, str]:
        f = self.fleet
        cmd = [sys.executable, "-m", "trainer.rollout.native_server", "--model", f.model, "--host", f.host,
               "--port", "0", "--threads", str(f.threads_per_server), "--max-batch-size", str(f.max_batch_size),
               "--dtype", f.dtype, "--skip-tokenizer-init", *map(str, f.server_args)]
        if f.max_seq_len:
            cmd += ["--max-seq-len", str(f.max_seq_len)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(f.threads_per_server))
        # a fresh key per fleet, handed over in the environment (never on a command line other users can read):
        # only this trainer may push, read out or pause the weights; generation comes through the router
        env[FLEET_KEY_ENV] = f.api_key
        cmd += ["--api-key-env", FLEET_KEY_ENV, "--open-generation"]
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if f.hosts is not None:  # on server k's own node, through a host actor there
            import ray  # heavy; used only with servers on a Ray cluster

            extra = {k2: env[k2] for k2 in ("PYTHONUNBUFFERED", "OMP_NUM_THREADS", FLEET_KEY_ENV, "PYTHONPATH")}
            opts = dict(f.hosts[k % len(f.hosts)])
            handle = ray.remote(ServerHost).options(**opts, max_concurrency=4).remote(cmd, extra, path)
            proc = RemoteProc(handle)
            f._pending.append(proc)
            return proc, path
        return f._spawn(cmd, path, env), path

    def ready(self, proc: subprocess.Popen, path: str) -> str | None:
        """The URL a native server prints once it listens, or None yet."""
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                url = ready_url(line, SERVER_READY_PREFIX)
                if url is not None:
                    return url
        return None

    def client_kwargs(self, kw: dict) -> dict:
        return kw

    def check_start_weights(self) -> None:
        """Every server loaded the same checkpoint: its checksum is the fleet's until the first push."""
        client = self.fleet.client
        sums = client._call(client._checksums(self.fleet.server_urls))
        if len(set(sums.values())) != 1:
            raise WeightSyncError(f"the servers started with different weights: {sums}")
        client.expected_checksum = next(iter(sums.values()))

    def sync_new_server(self, url: str) -> None:
        """A restarted server at ``url`` holds the checkpoint from disk: copy a live peer's weights into it
        when the fleet's have moved on (checked against the fleet's checksum)."""
        client = self.fleet.client
        expected = client.expected_checksum
        if expected is None:
            return
        auth = {"Authorization": f"Bearer {self.fleet.api_key}"}
        with urllib.request.urlopen(urllib.request.Request(url + "/weights_checksum", headers=auth), timeout=60) as r:
            if json.load(r)["checksum"] == expected:
                return  # weights from disk are the fleet's current ones
        for peer in client.worker_urls:
            try:
                with urllib.request.urlopen(urllib.request.Request(peer + "/weights_safetensors", headers=auth),
                                            timeout=600) as r:
                    blob = r.read()
                req = urllib.request.Request(url + "/update_weights_from_tensor", data=blob, method="POST",
                                             headers={"Content-Type": WEIGHTS_CONTENT_TYPE, **auth})
                with urllib.request.urlopen(req, timeout=600) as r:
                    r.read()
                client.verify_weights(expected, [url])
                return
            except (OSError, WeightSyncError) as e:
                log.warning("fleet: copying weights from %s to %s failed: %s", peer, url, e)
        raise WeightSyncError(f"restarted server {url} holds stale weights and no live peer could provide them")


class SGLangServers:
    """Real ``python -m sglang.launch_server`` processes (:func:`trainer.rollout.sglang_http.server_command`;
    on CPU SGLang's CPU path), run by the fleet's ``server_python``, ready once ``/model_info`` answers;
    SGLang's own weight protocol, each sample its own request. Same host only (the tensor route shares
    memory). A restarted server is given the last push again (SGLang has no weight read-out)."""

    label = "SGLang"
    poll_s = 0.5
    # SGLang's /health_generate queues a 1-token request and answers 200 once the scheduler produced anything
    # since it came in, or 503 after SGLang's own 20 s (SGLANG_HEALTH_CHECK_TIMEOUT): it takes at least 1 s,
    # and longer while the scheduler is busy (a weight push, a loaded machine). The monitor waits past SGLang's
    # deadline, so a slow answer is not taken for a hang; the router's /health is liveness only (spawn below)
    hang_probe, hang_timeout_s = "/health_generate", 25.0

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        why = model_refusal(load_config_json(fleet.model), fleet.model)
        if why:
            raise FleetError(why)
        if fleet.hosts is not None:
            raise FleetError("a fleet of SGLang servers runs on the trainer's host: its weight route (SGLang's "
                             "update_weights_from_tensor) shares memory with the sender; use backend='native' "
                             "for servers on other nodes")
        if fleet.server_python is None:
            fleet.server_python = sglang_cpu.server_python()
            if fleet.server_python is None:
                raise FleetError(f"backend='sglang' needs an interpreter with sglang: install the 'sglang' extra "
                                 f"(GPU) or run {sglang_cpu.INSTALL_COMMAND} (CPU)")

    def spawn(self, k: int, generation: int, path: str) -> tuple[subprocess.Popen, str]:
        f = self.fleet
        port = free_port(f.host)
        cmd = server_command(f.server_python, f.model, host=f.host, port=port, device=f.device,
                             # no --context-length: SGLang derives it from the model (as the in-worker
                             # adapter); a longer one than the model's positions is refused by SGLang
                             dtype=f.dtype, admin_key=f.api_key,
                             max_total_tokens=f.max_total_tokens,
                             extra=[*(["--enable-return-routed-experts"] if f.routed_experts else []), *f.server_args])
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(f.threads_per_server))
        # /health answers from the HTTP process (200 once started, 503 while starting or shutting down) instead
        # of running SGLang's generation check (>= 1 s, up to 20 s on a busy scheduler): the router checks every
        # health_interval_s with a 5 s limit, and took two busy servers for dead on a loaded 2-core CI machine
        # ("No available workers"); a hung scheduler is the monitor's /health_generate check (hang_probe)
        env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "0"
        if f.device == "cpu":
            sglang_cpu.activate(env)
        proc = f._spawn(cmd, path, env)
        proc.coxswain_url = f"http://{f.host}:{port}"  # known up front: SGLang prints no machine-readable line
        return proc, path

    def ready(self, proc: subprocess.Popen, path: str) -> str | None:
        """The server's URL once SGLang's /model_info answers (its tokenizer manager and scheduler are up),
        else None; SGLang prints no machine-readable ready line."""
        url = proc.coxswain_url
        try:
            with urllib.request.urlopen(url + "/model_info", timeout=5) as r:
                return url if r.status == 200 else None
        except OSError:
            return None

    def client_kwargs(self, kw: dict) -> dict:
        # each sample its own request: SGLang honours no per-request seed unless deterministic
        return {"per_sample_requests": True, **kw, "weight_protocol": "sglang", "model_dir": self.fleet.model,
                "model_dtype": self.fleet.dtype}

    def check_start_weights(self) -> None:
        self.fleet.client.expected_checksum = None  # the checkpoint on disk until the first push

    def sync_new_server(self, url: str) -> None:
        self.fleet.client.replay_last_push(url)
