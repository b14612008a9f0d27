"""Run untrusted Python (a policy's code answer) against tests, contained.

``run_code(code, mode, ...)`` returns a :class:`SandboxResult` (status, passed / total, the reason,
the layers that were actually enforced). Two processes do the work, and the calling process runs
neither the candidate nor the tests:

* the **candidate** (``_sandbox_harness.py``) runs the policy's code in a jail and answers requests;
* the **referee** (``_sandbox_referee.py``) holds the tests and the expected values, runs the tests
  with the candidate's functions as remote handles, compares *serialised values* it decoded itself,
  and writes the results on a private fd that the candidate never holds.

A candidate that takes over its own process (frames, ``gc``, patching the harness) can answer
requests with arbitrary values, but it cannot see what is expected, cannot report a test as passed,
and cannot hand over an object whose ``__eq__`` lies: only data crosses (``_sandbox_wire``).

The jail, layer by layer (``SandboxResult.enforced`` lists what this run actually got):

* ``mount_namespace``: a private root (``unshare --mount`` + ``pivot_root``): a tmpfs with read-only
  binds of the system and Python directories, a fresh ``/proc``, five device nodes and a size-capped
  tmpfs ``/sandbox``, the only writable place. The host's datasets, checkpoints and ``/tmp`` are absent.
* ``net_namespace`` / ``pid_namespace``: no network but a down loopback; every process the candidate
  starts dies with the namespace's init when the run ends.
* ``unprivileged_uid`` / ``caps_dropped``: as host root, the candidate becomes ``nobody`` with an
  empty capability bounding set; without root, an unprivileged user namespace.
* ``seccomp``: ``no_new_privs`` and a syscall filter (mount, namespaces, ptrace, cross-process memory,
  modules, bpf, perf, keyrings, io_uring, mknod, non-unix sockets, ... answer EPERM).
* ``pids_cgroup`` (a per-run ``pids.max``) and/or ``rlimit_nproc`` (non-root uid): fork bombs stop.
* ``rlimit_cpu``, ``rlimit_as``, ``rlimit_fsize``, ``wall_clock`` (the parent kills both processes),
  ``parent_death_signal`` (a killed reward worker takes the sandbox with it), ``tempdir``.
* ``audit_hook``: a PEP 578 hook that refuses process creation, signals, ctypes loading, sockets and
  writes outside the work directory, and names the refused action in the result. It runs in the
  candidate's process, so it is defence in depth only; the layers above are the boundary.
* ``proxy_env``: without a network namespace, the proxy variables point at a closed port.

**Refusal.** Code is scored only when the required layers (``REQUIRED``) are all in place. Where the
host cannot give one (no root and no user namespaces, no seccomp on this architecture, ...), the
run raises :class:`SandboxUnavailable` naming what is missing, unless the user opts in to weaker
containment (``reward_model.sandbox.allow_weak_containment=true`` or ``COXSWAIN_SANDBOX_ALLOW_WEAK=1``);
a run that loses a layer at start-up is reported as ``error``, never scored. Remote execution
through a SandboxFusion service (``reward_model.sandbox_fusion.url``) is in ``sandbox_fusion.py``.

Design after bubblewrap and nsjail (mount, pid and network namespaces, seccomp, rlimits, cgroups),
built from ``unshare`` / ``setpriv`` and a few syscalls so that it needs no package beyond util-linux.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

_DIR = os.path.dirname(os.path.abspath(__file__))
_HARNESS = os.path.join(_DIR, "_sandbox_harness.py")
_REFEREE = os.path.join(_DIR, "_sandbox_referee.py")
_CLOSED_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens there
NOBODY = 65534

# What a run needs before its score is trusted ("process_limit": a pids cgroup or RLIMIT_NPROC).
REQUIRED = ("mount_namespace", "pid_namespace", "net_namespace", "unprivileged_uid", "seccomp", "process_limit")
ALLOW_WEAK_ENV = "COXSWAIN_SANDBOX_ALLOW_WEAK"


class SandboxUnavailable(RuntimeError):
    """This host cannot contain candidate code with every required layer, and the user did not opt in."""


@dataclass
class SandboxLimits:
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU, whole seconds)
    wall_s: float = 10.0  # wall-clock seconds before the parent kills the run
    mem_mb: int = 1024  # address-space limit (RLIMIT_AS)
    nproc: int = 32  # processes + threads (pids cgroup / RLIMIT_NPROC)
    fsize_mb: int = 64  # largest file, and the size of the /sandbox tmpfs
    max_output_chars: int = 4000  # stdout / stderr tail kept in the result


@dataclass
class SandboxResult:
    status: str  # passed | failed | blocked | timeout | cpu_limit | memory_limit | crashed | error
    passed: int  # tests passed
    total: int  # tests run or expected
    reason: str  # why it did not pass ("" when passed)
    wall_s: float  # wall-clock seconds of the whole run
    cpu_s: float  # user + system CPU seconds of the candidate
    enforced: list = field(default_factory=list)  # layers that were active (see the module docstring)
    violations: list = field(default_factory=list)  # refused actions
    stdout: str = ""  # tail of the candidate's stdout
    stderr: str = ""  # tail of the candidate's stderr
    peak_pids: int | None = None  # most tasks alive at once in the run's pids cgroup (None: no cgroup)
    missing: list = field(default_factory=list)  # required layers this run did not get

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


def _binds() -> tuple[list[str], list[list[str]]]:
    """Read-only directories the jail needs (system and Python), and the top-level symlinks
    (merged-/usr systems have /bin -> usr/bin) to recreate inside it."""
    import site
    import sysconfig

    want = ["/usr", "/etc", "/opt/conda"] + [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    want += [os.path.dirname(os.path.realpath(sys.executable))]
    want += list(site.getsitepackages()) + [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]]
    links = []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            links.append([top, os.readlink(top)])
        elif os.path.isdir(top):
            want.append(top)
    real = sorted({os.path.realpath(p) for p in want if os.path.isdir(p)})
    keep: list[str] = []
    for p in real:  # drop directories inside one already bound
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in keep):
            keep.append(p)
    devs = [d for d in ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom") if os.path.exists(d)]
    return keep + devs, links


@functools.lru_cache(maxsize=None)
def probe() -> dict:
    """The wrapper command and the layers this host can give: ``{"prefix", "layers", "why", ...}``.
    ``why`` says, for each required layer the host cannot give, what is missing."""
    prefix: list[str] = []
    layers: list[str] = []
    why: dict[str, str] = {}
    user_ns = False
    unshare = shutil.which("unshare")
    root = os.geteuid() == 0
    ns = [unshare or "unshare", "--mount", "--net", "--pid", "--fork", "--kill-child"]
    if unshare and root and _ok(ns + ["--", "true"]):
        prefix, layers = ns + ["--"], ["mount_namespace", "net_namespace", "pid_namespace", "unprivileged_uid"]
    elif unshare and not root and _ok([unshare, "--map-root-user"] + ns[1:] + ["--", "true"]):
        prefix = [unshare, "--map-root-user"] + ns[1:] + ["--"]
        layers, user_ns = ["mount_namespace", "net_namespace", "pid_namespace", "unprivileged_uid"], True
    else:
        msg = ("util-linux `unshare` is missing" if not unshare else
               "`unshare --mount --net --pid` failed: run as root, or enable unprivileged user namespaces "
               "(sysctl kernel.unprivileged_userns_clone=1), or give the container CAP_SYS_ADMIN")
        for layer in ("mount_namespace", "net_namespace", "pid_namespace"):
            why[layer] = msg
        if root:
            why["unprivileged_uid"] = "without namespaces the candidate would run as root"
        else:
            layers.append("unprivileged_uid")
    setpriv = shutil.which("setpriv")
    if setpriv and _ok([setpriv, "--pdeathsig", "KILL", "--", "true"]):
        # If the process that started the sandbox dies (a reward worker killed on timeout), the
        # kernel SIGKILLs the wrapper, and --kill-child takes the namespace down with it.
        prefix = [setpriv, "--pdeathsig", "KILL", "--"] + prefix
        layers.append("parent_death_signal")
    if sys.platform == "linux" and os.uname().machine == "x86_64":
        layers.append("seccomp")
    else:
        why["seccomp"] = f"no seccomp filter is built for {sys.platform}/{os.uname().machine} (x86_64 Linux only)"
    cg = _pids_cgroup_root()
    if cg:
        _sweep_stale_cgroups(cg)
    if cg or "unprivileged_uid" in layers:
        layers.append("process_limit")
    else:
        why["process_limit"] = "no writable pids cgroup, and RLIMIT_NPROC does not bind uid 0"
    binds, links = _binds()
    return {"prefix": prefix, "layers": layers, "root": root, "user_ns": user_ns, "cgroup": cg,
            "why": why, "binds": binds, "links": links}


def allow_weak_default() -> bool:
    return os.environ.get(ALLOW_WEAK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def check_host(allow_weak: bool | None = None) -> list[str]:
    """The required layers this host lacks ([] = full containment). Raises SandboxUnavailable when
    some are missing and weak containment is not allowed."""
    info = probe()
    missing = [layer for layer in REQUIRED if layer not in info["layers"]]
    allow = allow_weak_default() if allow_weak is None else bool(allow_weak)
    if missing and not allow:
        detail = "; ".join(f"{layer}: {info['why'].get(layer, 'unavailable')}" for layer in missing)
        raise SandboxUnavailable(
            f"the code sandbox cannot contain untrusted code on this host ({detail}). Fix the host, score code "
            "remotely (reward_model.sandbox_fusion.url=http://...), or accept weaker containment with "
            f"reward_model.sandbox.allow_weak_containment=true ({ALLOW_WEAK_ENV}=1)."
        )
    return missing


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


def _task_count(uid: int) -> int:
    """Tasks (processes + threads) owned by ``uid``: RLIMIT_NPROC counts all of them."""
    n = 0
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
def _jail(info: dict, lim: SandboxLimits, *, host_dir: str, cgroup_dir: str | None, req_r: int, resp_w: int,
          drop: bool, disable_guard: bool) -> dict:
    """The harness's jail settings (its JSON argument): root, binds, privilege drop, seccomp, limits."""
    private_root = "mount_namespace" in info["layers"]
    uid = NOBODY if drop else os.getuid()
    # RLIMIT_NPROC counts every task of the uid on the host; the pids cgroup is the per-run limit
    nproc = lim.nproc + (_task_count(uid) if not info["user_ns"] else 0)
    if cgroup_dir:
        nproc = max(nproc, 16 * lim.nproc)
    return {
        "req_fd": req_r, "resp_fd": resp_w,
        "workdir": host_dir, "root": host_dir, "private_root": private_root,
        "binds": info["binds"], "links": info["links"],
        "drop_privileges": private_root, "seccomp": "seccomp" in info["layers"],
        "cgroup_procs": os.path.join(cgroup_dir, "cgroup.procs") if cgroup_dir else None,
        "limits": {"cpu_s": max(1, int(lim.cpu_s)), "mem_mb": lim.mem_mb, "nproc": nproc, "fsize_mb": lim.fsize_mb},
        "disable_guard": bool(disable_guard),
        # without the setpriv wrapper the harness sets its own parent-death signal
        "parent_pid": None if "parent_death_signal" in info["layers"] else os.getpid(),
    }


def _harness_env(info: dict, host_dir: str, enforced: list[str]) -> dict:
    """The candidate's whole environment (nothing inherited); closed proxies where no network namespace is
    up (recorded in ``enforced``)."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": host_dir, "TMPDIR": host_dir, "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    }
    if info["user_ns"]:
        env["COXSWAIN_SBX_USERNS"] = "1"
    if "net_namespace" not in info["layers"]:
        for k in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            env[k] = _CLOSED_PROXY
        enforced.append("proxy_env")
    return env


@dataclass
class _Finished:
    """What a finished run left: the referee's events, both processes' ends, the output tails."""
    events: list[dict]
    ref_code: int | None
    cand_code: int | None
    cpu: float
    timed_out: bool
    peak: int | None
    out_tail: str
    err_tail: str
    ref_err: str


def _verdict(run: _Finished, info: dict, lim: SandboxLimits, *, allow: bool, total: int, enforced: list[str],
             wall: float) -> SandboxResult:
    """One status from the events, in order of precedence: timeout, incomplete containment, a blocked
    call, CPU limit, memory limit, set-up error, a crash, an early referee end, then pass / fail."""
    events = run.events
    hello = next((e for e in events if e["kind"] == "hello"), {})
    for layer in hello.get("enforced", []):
        if layer not in enforced:
            enforced.append(layer)
    if hello:  # the wrapper ran the harness: its namespaces and death signal are in place
        enforced += [x for x in ("net_namespace", "pid_namespace", "parent_death_signal") if x in info["layers"]]
    if "pids_cgroup" in enforced or "rlimit_nproc" in enforced:
        enforced.append("process_limit")
    missing = [layer for layer in REQUIRED if layer not in enforced]
    violations = [e["msg"] for e in events if e["kind"] == "violation"]
    test_events = {e["i"]: e for e in events if e["kind"] == "test" and isinstance(e.get("i"), int)}
    passed = sum(1 for e in test_events.values() if e.get("ok"))
    done = any(e["kind"] == "done" for e in events)
    died = next((e for e in events if e["kind"] in ("candidate_died", "setup_failed")), None)
    setup_err = next((e for e in events if e["kind"] == "compile_or_run_error"), None)
    failures = [e for _, e in sorted(test_events.items()) if not e.get("ok")]

    def result(status, reason):
        p = passed if status == "passed" or status == "failed" else 0
        return SandboxResult(status, p, total, reason, wall, run.cpu, enforced, violations, run.out_tail,
                             run.err_tail, run.peak, missing)

    if run.timed_out:
        return result("timeout", f"wall-clock limit of {lim.wall_s:g} s exceeded")
    if missing and not allow:
        notes = "; ".join(hello.get("notes", [])) or (died or {}).get("msg", "") or run.err_tail[-300:]
        return result("error", f"containment incomplete (missing: {', '.join(missing)}): not scored. {notes}"[:600])
    if violations:
        return result("blocked", violations[0])
    # The kernel's SIGKILL at RLIMIT_CPU arrives with the CPU time at the limit; rusage accounting
    # lags by up to a tick or two, hence the 0.8 factor.
    if not done and run.cpu >= 0.8 * max(1, int(lim.cpu_s)):
        return result("cpu_limit", f"CPU-time limit of {int(lim.cpu_s)} s exceeded")
    mem = [e for e in ([setup_err] if setup_err else []) + failures if e.get("status") == "memory_limit"]
    if mem:
        return result("memory_limit", f"memory limit of {lim.mem_mb} MiB exceeded (MemoryError)")
    if setup_err:
        return result("error", f"{setup_err.get('status')}: {setup_err.get('msg', '')}"[:600])
    if died is not None:
        code = run.cand_code
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return result("crashed", f"{died.get('msg')} ({how}); stderr: {run.err_tail[-300:]}")
    if not done:
        return result("error", f"the referee ended early (exit {run.ref_code}): {run.ref_err[-300:]}")
    if total and passed == total:
        return result("passed", "")
    if not total:
        return result("error", "no tests were given")
    first = failures[0] if failures else {"i": "?", "status": "missing", "msg": ""}
    return result("failed", f"test {first['i']}: {first.get('status')}: {first.get('msg', '')}"[:600])


def _start_harness(prefix: list[str], jail: dict, env: dict, host_dir: str, iodir: str,
                   pass_fds: tuple[int, ...]) -> subprocess.Popen:
    """The candidate's harness in a session of its own, behind the containment wrapper ``prefix``; its
    stdout / stderr go to files in the parent-only ``iodir``."""
    with open(os.path.join(iodir, "stdout"), "wb") as fout, open(os.path.join(iodir, "stderr"), "wb") as ferr:
        return subprocess.Popen(
            prefix + [sys.executable, "-I", "-B", _HARNESS, json.dumps(jail)],
            stdin=subprocess.DEVNULL, stdout=fout, stderr=ferr, cwd=host_dir, env=env,
            pass_fds=pass_fds, start_new_session=True, close_fds=True,
        )


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
    allow_weak: bool | None = None,
    disable_guard: bool = False,
) -> SandboxResult:
    """Run ``code`` against tests in a fresh sandbox.

    Modes: ``assert`` (``tests``: snippets such as ``assert f(2) == 4``, run by the referee with the
    candidate's names as remote handles, after the trusted ``setup``), ``io`` (``inputs`` / ``outputs``:
    stdin text -> expected stdout, whitespace-insensitive, the program re-run per case), ``call``
    (``fn_name``; ``inputs``: argument lists; ``outputs``: return values). ``allow_weak`` (default: the
    ``COXSWAIN_SANDBOX_ALLOW_WEAK`` variable) lets a host without every ``REQUIRED`` layer score code
    anyway; otherwise such a host raises :class:`SandboxUnavailable`. ``disable_guard`` turns the
    audit hook off; the tests use it to show the kernel layers hold on their own.
    """
    if mode not in ("assert", "io", "call"):
        raise ValueError(f"unknown sandbox mode {mode!r}; use assert | io | call")
    lim = limits or SandboxLimits()
    info = probe()
    allow = allow_weak_default() if allow_weak is None else bool(allow_weak)
    check_host(allow)
    t0 = time.monotonic()
    host_dir = os.path.realpath(tempfile.mkdtemp(prefix="coxswain-sbx-"))  # jail root, or the workdir
    iodir = tempfile.mkdtemp(prefix="coxswain-sbxio-")  # parent-only (0700): spec, results, output
    private_root = "mount_namespace" in info["layers"]
    drop = private_root and info["root"] and not info["user_ns"]
    enforced = ["tempdir", "wall_clock"]
    cgroup_dir = None
    total = len(tests or []) if mode == "assert" else len(inputs or [])
    fds: list[int] = []
    procs: list[subprocess.Popen] = []
    try:
        if info["cgroup"]:
            cgroup_dir = _make_cgroup(info["cgroup"], lim.nproc)
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        fds += [req_r, req_w, resp_r, resp_w]
        jail = _jail(info, lim, host_dir=host_dir, cgroup_dir=cgroup_dir, req_r=req_r, resp_w=resp_w,
                     drop=drop, disable_guard=disable_guard)
        env = _harness_env(info, host_dir, enforced)
        os.chmod(host_dir, 0o755 if private_root else 0o700)
        procs.append(_start_harness(info["prefix"], jail, env, host_dir, iodir, (req_r, resp_w)))
        _close(req_r, resp_w)
        res_path = os.path.join(iodir, "result.jsonl")
        res_fd = os.open(res_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        fds.append(res_fd)
        spec = {"result_fd": res_fd, "req_fd": req_w, "resp_fd": resp_r, "mode": mode, "code": code,
                "tests": list(tests or []), "setup": setup or "", "inputs": list(inputs or []),
                "outputs": list(outputs or []), "fn_name": fn_name,
                "limits": {"cpu_s": max(1, int(lim.cpu_s)), "mem_mb": lim.mem_mb}, "parent_pid": os.getpid()}
        spec_path = os.path.join(iodir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        with open(spec_path, "rb") as fin, open(os.path.join(iodir, "referee.err"), "wb") as rerr:
            procs.append(subprocess.Popen(
                [sys.executable, "-I", "-B", _REFEREE], stdin=fin, stdout=subprocess.DEVNULL, stderr=rerr,
                env={"PATH": env["PATH"], "LANG": "C.UTF-8"}, pass_fds=(req_w, resp_r, res_fd),
                start_new_session=True, close_fds=True,
            ))
        _close(req_w, resp_r, res_fd)
        cand, ref = procs
        deadline = t0 + lim.wall_s
        ref_code, _, timed_out = _wait(ref, deadline)
        # The referee is done (or out of time): end the candidate's session, then read its CPU time.
        _killpg(cand.pid)
        cand_code, cpu, _ = _wait(cand, time.monotonic() + 5.0)
        peak = None
        if cgroup_dir:
            peak = _read_int(os.path.join(cgroup_dir, "pids.peak"))
            _kill_cgroup(cgroup_dir)
        events = _read_events(res_path)
        out_tail = _tail(os.path.join(iodir, "stdout"), lim.max_output_chars)
        err_tail = _tail(os.path.join(iodir, "stderr"), lim.max_output_chars)
        ref_err = _tail(os.path.join(iodir, "referee.err"), 1000)
    finally:
        _close(*fds)
        for p in procs:
            if p.returncode is None:
                _killpg(p.pid)
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        if cgroup_dir:
            _remove_cgroup(cgroup_dir)
        shutil.rmtree(host_dir, ignore_errors=True)
        shutil.rmtree(iodir, ignore_errors=True)

    run = _Finished(events, ref_code, cand_code, cpu, timed_out, peak, out_tail, err_tail, ref_err)
    return _verdict(run, info, lim, allow=allow, total=total, enforced=enforced, wall=time.monotonic() - t0)


def _close(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait(proc: subprocess.Popen, deadline: float):
    """Wait for ``proc`` until the monotonic ``deadline``; returns (exit code, cpu seconds, timed out).

    ``os.wait4`` gives the CPU time of the child including the descendants it reaped (the namespace
    init under ``unshare --fork``), which tells a CPU-limit kill from other kills."""
    delay, timed_out = 0.001, False
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() >= deadline:
            timed_out = True
            _killpg(proc.pid)  # the whole session: wrappers and whatever they started
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


def _read_events(path: str) -> list[dict]:
    """The referee's events (only the referee holds the result fd)."""
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
        if isinstance(e, dict) and "kind" in e:
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
