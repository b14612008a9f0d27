"""A real Slurm on this machine, for tests: Debian's ``slurm-wlm`` daemons (``munged``, ``slurmctld``, one
``slurmd`` per node) started in the foreground with every path (config, state, spool, logs, munge key and
socket) in a temp dir of their own, so the host's ``/etc/slurm`` and ``/etc/munge`` are not touched.

    with LocalSlurm(nodes=2, cpus=2) as s:         # node cx1 on 127.0.0.1, cx2 on 127.0.0.2
        job = s.sbatch(["--wait", "launch/slurm/ray_cluster.sbatch", ...], env=...)

Two nodes on one host use slurmd's ``-N NAME`` (each node its own port and ``NodeAddr``). Slurm has to
run as root (``SlurmUser=root``): CI runs as root. ``missing()`` says what is absent (binaries, root).
Every daemon, and every process below it (``slurmstepd`` and the job's processes), is killed by pid on
``stop()``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from tests.support.ray_nodes import descendants, free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "srun", "sinfo")


def missing() -> str | None:
    """Why this machine cannot run the fixture, or None."""
    gone = [b for b in BINARIES if shutil.which(b) is None]
    if gone:
        return f"Slurm is not installed ({', '.join(gone)} not found; Debian: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the local Slurm fixture runs its daemons as root (SlurmUser=root)"
    return None


class LocalSlurm:
    def __init__(self, nodes: int = 1, cpus: int = 2, memory_mb: int = 4000):
        self.root = tempfile.mkdtemp(prefix="cxs-", dir="/tmp")
        os.chmod(self.root, 0o755)  # munged refuses a socket directory others may write to
        self.n, self.cpus, self.memory_mb = nodes, cpus, memory_mb
        self.names = [f"cx{k + 1}" for k in range(nodes)]
        self.addrs = [f"127.0.0.{k + 1}" for k in range(nodes)]
        self.procs: list[subprocess.Popen] = []
        self.conf = os.path.join(self.root, "slurm.conf")
        self.munge_socket = os.path.join(self.root, "munge", "munge.socket")

    def path(self, *p) -> str:
        return os.path.join(self.root, *p)

    def env(self, **extra) -> dict:
        return dict(os.environ, SLURM_CONF=self.conf, **extra)

    # ---- set-up ---------------------------------------------------------------------------------------
    def _write_config(self) -> None:
        for d in ("munge", "state", "spool", "log"):
            os.makedirs(self.path(d), exist_ok=True)
        os.chmod(self.path("munge"), 0o700)
        with open(self.path("munge", "munge.key"), "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(self.path("munge", "munge.key"), 0o400)
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=coxswain-test", f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.path('state')}", f"SlurmdSpoolDir={self.path('spool', '%n')}",
            f"SlurmctldPidFile={self.path('slurmctld.pid')}", f"SlurmdPidFile={self.path('slurmd-%n.pid')}",
            f"SlurmctldLogFile={self.path('log', 'slurmctld.log')}", f"SlurmdLogFile={self.path('log', 'slurmd-%n.log')}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "ReturnToService=2", "SlurmdTimeout=30", "InactiveLimit=0",
            "KillWait=5", "MinJobAge=300", f"PlugStackConfig={self.path('plugstack.conf')}",
        ]
        for name, addr in zip(self.names, self.addrs):
            lines.append(f"NodeName={name} NodeHostname={host} NodeAddr={addr} Port={free_port()} CPUs={self.cpus} "
                         f"RealMemory={self.memory_mb} State=UNKNOWN")
        lines.append(f"PartitionName=test Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        open(self.path("plugstack.conf"), "w").close()

    def _daemon(self, cmd: list[str], log: str) -> subprocess.Popen:
        with open(self.path("log", log), "ab") as f:
            p = subprocess.Popen(cmd, env=self.env(), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        self.procs.append(p)
        return p

    def start(self, timeout_s: float = 60.0) -> "LocalSlurm":
        why = missing()
        if why:
            raise RuntimeError(why)
        try:
            self._write_config()
            self._daemon(["munged", "-F", "--force", f"--socket={self.munge_socket}",
                          f"--key-file={self.path('munge', 'munge.key')}", f"--pid-file={self.path('munge', 'munged.pid')}",
                          f"--log-file={self.path('log', 'munged.log')}", f"--seed-file={self.path('munge', 'seed')}"],
                         "munged.out")
            self._wait(lambda: os.path.exists(self.munge_socket), 20, "munged's socket")
            self._daemon(["slurmctld", "-D", "-i", "-f", self.conf], "slurmctld.out")
            for name in self.names:
                self._daemon(["slurmd", "-D", "-N", name, "-f", self.conf], f"slurmd-{name}.out")
            self._wait(self._nodes_idle, timeout_s, f"nodes {self.names} idle in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def _nodes_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env(), capture_output=True, text=True,
                             timeout=30)
        states = dict(ln.split() for ln in out.stdout.splitlines() if ln.strip())
        return out.returncode == 0 and all(states.get(n) == "idle" for n in self.names)

    def _wait(self, ok, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"local Slurm: no {what} after {timeout_s:.0f} s (exited: {dead}); logs:\n"
                                   + self.logs())
            time.sleep(0.3)

    def logs(self, tail: int = 1500) -> str:
        out = []
        for f in sorted(os.listdir(self.path("log"))):
            with open(self.path("log", f), errors="replace") as fh:
                out.append(f"--- {f}\n{fh.read()[-tail:]}")
        return "\n".join(out)

    # ---- use ------------------------------------------------------------------------------------------
    def run(self, cmd: list[str], timeout_s: float = 120, **kw) -> subprocess.CompletedProcess:
        env = kw.pop("env", None) or self.env()
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, **kw)

    def job_state(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict (JobState, ExitCode, StdOut, NodeList, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def own_pids(self) -> set[int]:
        """The daemons, and every process that carries this Slurm's ``SLURM_CONF`` (slurmstepd detaches from
        slurmd, but inherits its environment; the jobs' processes get it from sbatch), with their children."""
        tag = f"SLURM_CONF={self.conf}".encode()
        roots = {p.pid for p in self.procs if p.poll() is None}
        for pid in (int(x) for x in os.listdir("/proc") if x.isdigit()):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if tag in f.read().split(b"\0"):
                        roots.add(pid)
            except OSError:
                pass
        roots.discard(os.getpid())
        return descendants(roots)

    def stop(self) -> None:
        """End the daemons and everything below them (jobs, steps), by pid; remove the temp dir."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        deadline = time.monotonic() + 20
        while (pids := self.own_pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.3)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "LocalSlurm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
