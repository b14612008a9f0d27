"""Run untrusted Python (a policy's code answer) against tests, contained.

``run_code(code, mode, ...)`` starts ``python -I -B _sandbox_harness.py`` in a fresh temporary working
directory and returns a :class:`SandboxResult` (status, passed / total, the reason, the layers that
were actually enforced). The candidate is never imported or executed in the calling process.

What is enforced, layer by layer (``SandboxResult.enforced`` lists what this run actually got):

* ``tempdir``: a fresh ``mkdtemp`` working directory, also ``HOME`` and ``TMPDIR``; removed after.
* ``wall_clock``: the parent kills the whole session (``killpg``) after ``wall_s``. Always.
* ``rlimit_cpu``: RLIMIT_CPU soft = hard = ``cpu_s``; the kernel SIGKILLs the process. Always.
* ``rlimit_as``: RLIMIT_AS = ``mem_mb``; a huge allocation raises MemoryError. Always.
* ``rlimit_nproc``: RLIMIT_NPROC caps processes + threads. Listed only when it has an effect: the
  kernel ignores it for uid 0 (root).
* ``rlimit_fsize``: RLIMIT_FSIZE = ``fsize_mb`` per file (disk filling); also RLIMIT_CORE = 0.
* ``net_namespace``: ``unshare --net``; the candidate sees only a down loopback and no route. Needs
  root (CAP_SYS_ADMIN) or unprivileged user namespaces (``unshare --map-root-user``).
* ``pid_namespace``: ``unshare --pid --fork --kill-child``; when the run ends, every process it started
  dies with its namespace's init. Same availability as above.
* ``parent_death_signal``: ``setpriv --pdeathsig KILL``; if the process that started the run dies (a
  reward worker killed on timeout), the kernel kills the sandbox too. Where setpriv is missing and
  no namespace wraps the harness, the harness sets PR_SET_PDEATHSIG on itself (Linux).
* ``caps_dropped``: as root, ``setpriv`` empties the capability bounding set and sets no_new_privs, so
  the candidate cannot raise its rlimits, mount, load modules, etc.
* ``pids_cgroup``: a per-run pids cgroup (v1 ``/sys/fs/cgroup/pids``) with ``pids.max = nproc``, a
  kernel fork limit that also holds for root. Where the cgroup tree is writable.
* ``audit_hook``: a PEP 578 audit hook in the harness refuses fork / exec / spawn / subprocess,
  signals to other processes, loading libraries or resolving symbols with ctypes (dlopen / dlsym,
  ``from_address``), cffi, raising rlimits, socket creation and name lookups, and
  any write, create, delete, rename, chmod or link whose real path (symlinks resolved) is outside the
  working directory. Always.
* ``proxy_env``: without a network namespace, ``http(s)_proxy`` point at a closed local port, on top
  of the audit hook's socket refusal.

Limits of the design (stated, not hidden): there is no chroot or read-only mount, so reads anywhere
the uid can read are allowed, and the write guard is the Python-level audit hook (a C extension that
is already loaded could bypass it; e.g. ``ctypes.memmove`` on raw addresses is not audited by
CPython 3.11, and ctypes itself must stay importable because numpy imports it). The kernel layers
above bound the damage of anything that slips past it: time, memory, processes and network. Any
refused action is recorded and makes the run score 0, even if the candidate catches the exception.
Results travel on a private fd, one JSON line per event, each with a random nonce held in a closure,
so printing "PASSED" or exiting early cannot forge a pass. This is containment against accidents and
runaway code from a policy in training, not a boundary against a determined attacker; for that, run
code in a remote sandbox service.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_harness.py")
_CLOSED_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens there


@dataclass
class SandboxLimits:
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU, whole seconds)
    wall_s: float = 10.0  # wall-clock seconds before the parent kills the session
    mem_mb: int = 1024  # address-space limit (RLIMIT_AS)
    nproc: int = 32  # processes + threads (pids cgroup / RLIMIT_NPROC)
    fsize_mb: int = 64  # largest file the candidate may write (RLIMIT_FSIZE)
    max_output_chars: int = 4000  # stdout / stderr tail kept in the result


@dataclass
class SandboxResult:
    status: str  # passed | failed | blocked | timeout | cpu_limit | memory_limit | crashed | error
    passed: int  # tests passed
    total: int  # tests run or expected
    reason: str  # why it did not pass ("" when passed)
    wall_s: float  # wall-clock seconds of the whole run
    cpu_s: float  # user + system CPU seconds of the sandbox
    enforced: list = field(default_factory=list)  # layers that were active (see the module docstring)
    violations: list = field(default_factory=list)  # refused actions
    stdout: str = ""  # tail of the candidate's stdout
    stderr: str = ""  # tail of the candidate's stderr
    peak_pids: int | None = None  # most tasks alive at once in the run's pids cgroup (None: no cgroup)

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0


# ----------------------------------------------------------------------------------------------
# what this machine offers (probed once per process)
# ----------------------------------------------------------------------------------------------
def _ok(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.lru_cache(maxsize=None)
def probe() -> dict:
    """The wrapper command and layers available here: ``{"prefix": [...], "layers": [...], ...}``."""
    prefix: list[str] = []
    layers: list[str] = []
    user_ns = False
    unshare = shutil.which("unshare")
    root = os.geteuid() == 0
    if unshare:
        ns = [unshare, "--net", "--pid", "--fork", "--kill-child"]
        if _ok(ns + ["--", "true"]):
            prefix, layers = ns + ["--"], ["net_namespace", "pid_namespace"]
        elif not root and _ok([unshare, "--map-root-user"] + ns[1:] + ["--", "true"]):
            prefix = [unshare, "--map-root-user"] + ns[1:] + ["--"]
            layers, user_ns = ["net_namespace", "pid_namespace"], True
    setpriv = shutil.which("setpriv")
    if setpriv and _ok([setpriv, "--pdeathsig", "KILL", "--", "true"]):
        # If the process that started the sandbox dies (a reward worker killed on timeout), the
        # kernel SIGKILLs the wrapper, and --kill-child takes the namespace down with it.
        prefix = [setpriv, "--pdeathsig", "KILL", "--"] + prefix
        layers.append("parent_death_signal")
    if root and setpriv:
        sp = [setpriv, "--bounding-set", "-all", "--inh-caps", "-all", "--no-new-privs", "--"]
        if _ok(sp + ["true"]):
            prefix += sp
            layers.append("caps_dropped")
    cg = _pids_cgroup_root()
    if cg:
        _sweep_stale_cgroups(cg)
    return {"prefix": prefix, "layers": layers, "root": root, "user_ns": user_ns, "cgroup": cg}


def _sweep_stale_cgroups(root: str) -> None:
    """Remove run cgroups left by processes that died mid-run (their pid no longer exists)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if name.startswith("coxswain-sbx-") and len(parts) == 4 and parts[2].isdigit():
            if not os.path.exists(f"/proc/{parts[2]}"):
                _remove_cgroup(os.path.join(root, name))


def _pids_cgroup_root() -> str | None:
    """A writable cgroup-v1 pids directory to create per-run children in, or None."""
    base = "/sys/fs/cgroup/pids"
    try:
        rel = "/"
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrl, path = line.rstrip("\n").split(":", 2)
                if "pids" in ctrl.split(","):
                    rel = path
        root = os.path.join(base, rel.lstrip("/"))
        test = os.path.join(root, f"coxswain-probe-{os.getpid()}")
        os.mkdir(test)
        try:
            with open(os.path.join(test, "pids.max"), "w") as f:
                f.write("8")
        finally:
            os.rmdir(test)
        return root
    except (OSError, ValueError):
        return None


def _user_task_count() -> int:
    """Tasks (processes + threads) owned by our real uid: RLIMIT_NPROC counts all of them."""
    uid, n = os.getuid(), 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{d}/task"))
            except OSError:
                pass
    return n


# ----------------------------------------------------------------------------------------------
# one run
# ----------------------------------------------------------------------------------------------
def run_code(
    code: str,
    mode: str = "assert",
    *,
    tests: list[str] | None = None,
    setup: str = "",
    inputs: list | None = None,
    outputs: list | None = None,
    fn_name: str | None = None,
    limits: SandboxLimits | None = None,
    disable_guard: bool = False,
) -> SandboxResult:
    """Run ``code`` against tests in a fresh sandbox.

    Modes: ``assert`` (``tests``: snippets such as ``assert f(2) == 4``, run after the code in its
    namespace, with optional ``setup``), ``io`` (``inputs`` / ``outputs``: stdin text -> expected stdout,
    whitespace-insensitive, the program re-run per case), ``call`` (``fn_name``; ``inputs``: argument
    lists; ``outputs``: return values). ``disable_guard`` turns the audit hook off; it exists only so
    the tests can show the kernel layers contain a fork bomb on their own.
    """
    if mode not in ("assert", "io", "call"):
        raise ValueError(f"unknown sandbox mode {mode!r}; use assert | io | call")
    lim = limits or SandboxLimits()
    info = probe()
    t0 = time.monotonic()
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="coxswain-sbx-"))
    iodir = tempfile.mkdtemp(prefix="coxswain-sbxio-")  # parent-only: spec, result, stdout, stderr
    nonce = secrets.token_hex(16)
    enforced = ["tempdir", "wall_clock", "rlimit_fsize"] + list(info["layers"])
    cgroup_dir = None
    total = len(tests or []) if mode == "assert" else len(inputs or [])
    try:
        if info["cgroup"]:
            cgroup_dir = _make_cgroup(info["cgroup"], lim.nproc)
        nproc = lim.nproc if (info["user_ns"] or info["root"]) else _user_task_count() + lim.nproc
        spec = {
            "nonce": nonce,
            "result_fd": -1,
            "workdir": workdir,
            "cgroup_procs": os.path.join(cgroup_dir, "cgroup.procs") if cgroup_dir else None,
            "limits": {"cpu_s": max(1, int(lim.cpu_s)), "mem_mb": lim.mem_mb, "nproc": nproc, "fsize_mb": lim.fsize_mb},
            "mode": mode,
            "code": code,
            "tests": list(tests or []),
            "setup": setup or "",
            "inputs": list(inputs or []),
            "outputs": list(outputs or []),
            "fn_name": fn_name,
            "disable_guard": bool(disable_guard),
            # without the setpriv wrapper the harness sets its own parent-death signal
            "parent_pid": None if "parent_death_signal" in info["layers"] else os.getpid(),
        }
        res_path = os.path.join(iodir, "result.jsonl")
        res_fd = os.open(res_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        spec["result_fd"] = res_fd
        spec_path = os.path.join(iodir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        if "net_namespace" not in info["layers"]:
            for k in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
                env[k] = _CLOSED_PROXY
            enforced.append("proxy_env")
        cmd = info["prefix"] + [sys.executable, "-I", "-B", _HARNESS]
        with open(spec_path, "rb") as fin, open(os.path.join(iodir, "stdout"), "wb") as fout, open(
            os.path.join(iodir, "stderr"), "wb"
        ) as ferr:
            try:
                proc = subprocess.Popen(
                    cmd, stdin=fin, stdout=fout, stderr=ferr, cwd=workdir, env=env,
                    pass_fds=(res_fd,), start_new_session=True, close_fds=True,
                )
            finally:
                os.close(res_fd)
            status_code, cpu, timed_out = _wait(proc, lim.wall_s)
        peak = None
        if cgroup_dir:
            peak = _read_int(os.path.join(cgroup_dir, "pids.peak"))
            _kill_cgroup(cgroup_dir)
        events = _read_events(res_path, nonce)
        out_tail = _tail(os.path.join(iodir, "stdout"), lim.max_output_chars)
        err_tail = _tail(os.path.join(iodir, "stderr"), lim.max_output_chars)
    finally:
        if cgroup_dir:
            _remove_cgroup(cgroup_dir)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(iodir, ignore_errors=True)

    for e in events:
        if e["kind"] == "enforced" and e.get("layer") not in enforced:
            layer = e.get("layer")
            if layer == "rlimit_nproc" and info["root"] and not info["user_ns"]:
                continue  # the kernel exempts uid 0 from RLIMIT_NPROC: do not claim it
            enforced.append(layer)
    violations = [e["msg"] for e in events if e["kind"] == "violation"]
    test_events = {e["i"]: e for e in events if e["kind"] == "test"}
    passed = sum(1 for e in test_events.values() if e.get("ok"))
    done = any(e["kind"] == "done" for e in events)
    setup_err = next((e for e in events if e["kind"] == "compile_or_run_error"), None)
    failures = [e for _, e in sorted(test_events.items()) if not e.get("ok")]
    wall = time.monotonic() - t0

    def result(status, reason):
        return SandboxResult(status, passed, total, reason, wall, cpu, enforced, violations, out_tail, err_tail, peak)

    if violations:
        return result("blocked", violations[0])
    if timed_out:
        return result("timeout", f"wall-clock limit of {lim.wall_s:g} s exceeded")
    # The kernel's SIGKILL at RLIMIT_CPU arrives with the CPU time at the limit; rusage accounting
    # lags by up to a tick or two, hence the 0.8 factor. (unshare does not always re-raise the
    # child's signal, so the exit status alone cannot tell.)
    if not done and cpu >= 0.8 * max(1, int(lim.cpu_s)):
        return result("cpu_limit", f"CPU-time limit of {int(lim.cpu_s)} s exceeded")
    mem = [e for e in ([setup_err] if setup_err else []) + failures if e.get("status") == "memory_limit"]
    if mem:
        return result("memory_limit", f"memory limit of {lim.mem_mb} MiB exceeded (MemoryError)")
    if setup_err:
        return result("error", f"{setup_err.get('status')}: {setup_err.get('msg', '')}")
    if not done:
        how = f"signal {-status_code}" if status_code is not None and status_code < 0 else f"exit code {status_code}"
        return result("crashed", f"the sandbox ended before the tests finished ({how}); stderr: {err_tail[-300:]}")
    if total and passed == total:
        return result("passed", "")
    if not total:
        return result("error", "no tests were given")
    first = failures[0] if failures else {"i": "?", "status": "missing", "msg": ""}
    return result("failed", f"test {first['i']}: {first.get('status')}: {first.get('msg', '')}"[:600])


def _wait(proc: subprocess.Popen, wall_s: float):
    """Wait for the session with a wall-clock limit; returns (exit code, cpu seconds, timed out).

    ``os.wait4`` gives the CPU time of the child including the descendants it reaped (the namespace
    init under ``unshare --fork``), which tells a CPU-limit kill from other kills."""
    deadline = time.monotonic() + wall_s
    delay, timed_out = 0.001, False
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() >= deadline:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole session: wrappers and candidate
            except ProcessLookupError:
                pass
            pid, status, ru = os.wait4(proc.pid, 0)
            break
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code  # we reaped it ourselves; keep Popen consistent
    return code, ru.ru_utime + ru.ru_stime, timed_out


_cg_counter = [0]


def _make_cgroup(root: str, nproc: int) -> str | None:
    _cg_counter[0] += 1
    path = os.path.join(root, f"coxswain-sbx-{os.getpid()}-{_cg_counter[0]}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(int(nproc)))
        return path
    except OSError:
        _remove_cgroup(path)
        return None


def _kill_cgroup(path: str) -> None:
    """SIGKILL whatever is still in the run's cgroup (processes that escaped the session)."""
    for _ in range(100):
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(x) for x in f.read().split()]
        except OSError:
            return
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _remove_cgroup(path: str) -> None:
    for _ in range(100):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            _kill_cgroup(path)
            time.sleep(0.01)


def _read_events(path: str, nonce: str) -> list[dict]:
    events = []
    try:
        with open(path, "rb") as f:
            data = f.read(8 << 20)
    except OSError:
        return events
    for line in data.splitlines():
        try:
            e = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(e, dict) and e.get("nonce") == nonce and "kind" in e:
            events.append(e)
    return events


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _tail(path: str, n: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
