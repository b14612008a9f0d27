"""A Ray cluster of several nodes on one machine, for tests: real ``ray start`` raylets, each with its own
CPU slots and its own loopback IP (the head on the machine's address, workers on 127.0.0.2, 127.0.0.3, ...),
so Ray sees distinct nodes exactly as on separate hosts (``node:<ip>`` resources, ``ray.io/node-id``
labels, object transfers between the nodes' object stores).

    with RayNodes(workers=1, cpus=2) as c:     # head + 1 worker node, 2 CPU slots each
        env = c.env()                          # RAY_ADDRESS and auth for a driver process
        c.kill_node(1)                         # SIGKILL node 1's raylet (its workers die with it)
        c.add_node(1)                          # the node comes back (a new Ray node id)

Every process this starts is found by the cluster's own temp dir (in its command line) or as a child of
one of them, and killed by pid on ``stop()``: ``ray stop`` would also end other users' Ray clusters on the
machine. The head, the workers and every driver use one auth token of the cluster's own (Ray 2.60's
token authentication), kept in the temp dir.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

RAY = [sys.executable, "-m", "ray.scripts.scripts"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(roots: set[int]) -> set[int]:
    """``roots`` and every process below them."""
    parent = {p: _ppid(p) for p in _pids()}
    out, grew = set(r for r in roots if r in parent), True
    while grew:
        new = {p for p, pp in parent.items() if pp in out and p not in out}
        out |= new
        grew = bool(new)
    return out


class RayNodes:
    def __init__(self, workers: int = 1, cpus: int = 2, head_cpus: int | None = None, object_store_mb: int = 150):
        self.root = tempfile.mkdtemp(prefix="cxr-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.cpus, self.head_cpus, self.n_workers = cpus, cpus if head_cpus is None else head_cpus, workers
        self.store = str(object_store_mb * 1024 * 1024)
        self.port = free_port()
        self.token_path = os.path.join(self.root, "auth_token")
        with open(self.token_path, "w") as f:
            f.write(secrets.token_hex(32))
        self.head_ip: str | None = None
        self.ips: dict[int, str] = {}  # node index -> IP (0 = head)

    # ---- environment ---------------------------------------------------------------------------------
    def base_env(self) -> dict:
        # the GCS declares a node dead after 3 failed health checks 1 s apart (Ray's defaults: 5 x 3 s), so a
        # test that kills a node's raylet sees Ray's verdict in about 3 s; a check only fails on a refused
        # connection or a 10 s timeout, so a loaded machine does not lose a live node
        env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self.token_path,
                   RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", RAY_health_check_period_ms="1000",
                   RAY_health_check_failure_threshold="3")
        env.pop("RAY_ADDRESS", None)
        return env

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"

    def env(self, **extra) -> dict:
        """A driver's environment: joins this cluster."""
        return dict(self.base_env(), RAY_ADDRESS=self.address, **extra)

    # ---- nodes ---------------------------------------------------------------------------------------
    def _agent_ports(self) -> list[str]:
        return ["--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
                "--metrics-export-port", str(free_port()), "--runtime-env-agent-port", str(free_port()),
                "--object-store-memory", self.store, "--disable-usage-stats"]

    def _run(self, args: list[str], what: str) -> None:
        out = subprocess.run(RAY + args, env=self.base_env(), capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{what} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")

    def start(self) -> "RayNodes":
        try:
            self._run(["start", "--head", "--port", str(self.port), "--num-cpus", str(self.head_cpus),
                       "--temp-dir", self.root, "--include-dashboard", "false", "--ray-client-server-port",
                       str(free_port()), *self._agent_ports()], "ray start --head")
            self.head_ip = self.nodes()[0]["ip"]  # the machine's address: Ray's head ignores a loopback one
            self.ips[0] = self.head_ip
            for k in range(1, self.n_workers + 1):
                self.add_node(k)
        except BaseException:
            self.stop()
            raise
        return self

    def add_node(self, k: int, timeout_s: float = 60.0) -> str:
        """Start worker node ``k`` (IP 127.0.0.{k+1}) and wait until Ray lists it alive."""
        ip = f"127.0.0.{k + 1}"
        self._run(["start", "--address", self.address, "--node-ip-address", ip, "--num-cpus", str(self.cpus),
                   *self._agent_ports()], f"ray start (node {k}, {ip})")
        self.ips[k] = ip
        self.wait_nodes(lambda ns: any(n["ip"] == ip and n["alive"] for n in ns), timeout_s, f"node {ip} to join")
        return ip

    def nodes(self) -> list[dict]:
        """``[{"ip", "node_id", "alive", "cpus", "head"}]`` from the GCS (a fresh process: this one stays off Ray)."""
        code = ("import json, ray; ray.init(address='%s', logging_level='ERROR', log_to_driver=False); "
                "print(json.dumps([dict(ip=n['NodeManagerAddress'], node_id=n['NodeID'], alive=n['Alive'], "
                "cpus=n['Resources'].get('CPU', 0), head='node:__internal_head__' in n['Resources']) "
                "for n in ray.nodes()]))") % (f"127.0.0.1:{self.port}" if self.head_ip is None else self.address)
        out = subprocess.run([sys.executable, "-c", code], env=self.base_env(), capture_output=True, text=True,
                             timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"listing the cluster's nodes failed:\n{out.stderr[-3000:]}")
        nodes = json.loads(out.stdout.strip().splitlines()[-1])
        return sorted(nodes, key=lambda n: (not n["head"], not n["alive"], n["ip"]))

    def wait_nodes(self, ok, timeout_s: float, what: str) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            ns = self.nodes()
            if ok(ns):
                return ns
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}: {ns}")
            time.sleep(0.5)

    def raylet_pid(self, k: int) -> int:
        ip = self.ips[k]
        for pid in self.own_pids(children=False):
            cmd = _cmdline(pid)
            if "raylet/raylet" in cmd and f"--node_ip_address={ip} " in cmd + " ":
                return pid
        raise RuntimeError(f"no raylet of node {k} ({ip}) is running")

    def kill_node(self, k: int) -> int:
        """SIGKILL node ``k``'s raylet (as a machine crash would stop it); returns its pid."""
        pid = self.raylet_pid(k)
        os.kill(pid, signal.SIGKILL)
        return pid

    # ---- processes -----------------------------------------------------------------------------------
    def own_pids(self, children: bool = True) -> set[int]:
        """This cluster's daemons (their command line names its temp dir) and, with ``children``, their
        descendants (Ray's worker processes)."""
        me = os.getpid()
        tags = [self.root] + ([f"--address={self.address} "] if self.head_ip else [])  # the client server names no dir
        roots = {p for p in _pids() if p != me and any(t in _cmdline(p) + " " for t in tags)}
        return descendants(roots) if children else roots

    def stop(self) -> None:
        """Kill every process of this cluster, by pid, and remove its temp dir."""
        deadline = time.monotonic() + 20
        while True:
            pids = self.own_pids()
            if not pids:
                break
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                break
            time.sleep(0.3)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "RayNodes":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
