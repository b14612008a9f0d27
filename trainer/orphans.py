"""No process outlives the driver: helper processes watch their parent and leave when it is gone.

A SIGKILLed driver runs no ``atexit`` and no ``finally``, so children it started (the scorer pool's
fork server and workers, a local judge server, the HTTP fleet's servers and router) would be reparented
and live on. Two mechanisms, both plain polling of ``os.getppid()`` (portable, and unlike Linux's
``PR_SET_PDEATHSIG`` not tied to the parent *thread* that started the child, which in one-step-off mode
may be the prefetch thread):

* :func:`watch_parent`: a daemon thread in a Python child that exits it (``os._exit``) once its parent
  changes. Forked children do not inherit threads, so each process calls it itself (the fork server on
  import of :mod:`trainer.rewards.orphan_guard`, each scorer worker in its initializer).
* :data:`SUPERVISOR` / :func:`supervised`: for a command the driver starts with ``subprocess``, a tiny
  wrapper process (plain Python, no project imports: it starts in milliseconds) that runs the command
  as its child, forwards SIGTERM, and kills it when the wrapper's own parent goes away. The command also
  dies with the wrapper (``PR_SET_PDEATHSIG`` in the command's process, on Linux): a wrapper SIGKILLed on
  its own, by a clean-up that kills by pid, would otherwise leave the command reparented to init.
* :func:`mark_run` / :func:`start_reaper`: every process a run starts inherits the run's marker
  (``COXSWAIN_RUN`` in its environment); a reaper process, started once per driver, waits for the driver
  to end and then SIGKILLs whatever still carries the marker. This catches what the two mechanisms above
  cannot: processes that are not ours to instrument, such as the daemons of the Ray cluster the driver
  embedded (Ray's dashboard and runtime-env agents outlive a SIGKILLed driver on their own).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

SUPERVISOR = r"""
import ctypes, os, signal, subprocess, sys, time
parent = int(sys.argv[1])  # the starter's pid, as the starter saw it
def _die_with_me():
    # Linux: the command is SIGKILLed when this wrapper dies, however it dies (SIGKILL included); the wrapper
    # is single-threaded, so the signal is not tied to a thread that may exit before it
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
child = subprocess.Popen(sys.argv[2:], preexec_fn=_die_with_me if sys.platform.startswith("linux") else None)
def _stop(*_):
    child.terminate()
signal.signal(signal.SIGTERM, _stop)
while child.poll() is None:
    if os.getppid() != parent:  # the starter is gone (also when it died before this line first ran)
        child.kill()
        break
    time.sleep(0.5)
sys.exit(child.wait())
"""

RUN_MARKER = "COXSWAIN_RUN"

REAPER = r"""
import os, signal, sys, time
driver, marker, me = int(sys.argv[1]), sys.argv[2].encode(), os.getpid()
want = b"COXSWAIN_RUN=" + marker + b"\0"
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (its parent has not reaped it yet) is gone for our purpose
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False
def marked():
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in (me, driver):
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if want in f.read() + b"\0":
                    out.append(int(d))
        except OSError:
            continue
    return out
while alive(driver):
    time.sleep(0.5)
time.sleep(1.0)  # processes that leave on their own (they watch their parent) go first
for _ in range(20):  # a few rounds: a dying daemon may start another process on its way out
    pids = marked()
    if not pids:
        break
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.25)
"""

_watching = False
_reaper: subprocess.Popen | None = None

# Test support (tests/security/test_orphans.py): "<point>:<file>" makes the worker that reaches ``point`` (startup,
# rollout, update, sync, checkpoint) append "<point> <pid>" to ``file`` and hold there, mid-call, so that a test can
# SIGKILL the driver while its workers are busy in that phase. Unset (always, outside that test): nothing happens.
FAULT_HOLD = "COXSWAIN_FAULT_HOLD"
HOLD_POINTS = ("startup", "rollout", "update", "sync", "checkpoint")


def fault_hold(point: str) -> None:
    spec = os.environ.get(FAULT_HOLD)
    if not spec:
        return
    want, _, path = spec.partition(":")
    if want != point:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{point} {os.getpid()}\n")
    time.sleep(3600)


def watch_parent(interval: float = 0.5) -> None:
    """Exit this process soon after its parent dies (idempotent per process)."""
    global _watching
    if _watching:
        return
    _watching = True
    parent = os.getppid()

    def loop():
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=loop, name="watch-parent", daemon=True).start()


def after_fork_reset() -> None:
    """In a forked child: the watcher thread did not come along; let the child start its own."""
    global _watching
    _watching = False


os.register_at_fork(after_in_child=after_fork_reset)


def supervised(cmd: list[str]) -> list[str]:
    """``cmd`` wrapped in :data:`SUPERVISOR`: killed when the process that starts the wrapper dies (its pid is
    the wrapper's first argument, so a starter that dies before the wrapper first looks is noticed too), or
    when the wrapper itself dies."""
    return [sys.executable, "-c", SUPERVISOR, str(os.getpid()), *cmd]


def mark_run() -> str:
    """This process's run marker, ``"<pid>-<random>"``, set in ``os.environ`` so that every process started from
    here on inherits it. A marker inherited from another process (a driver started by a test, or by another
    driver) is replaced: each driver reaps only what it started."""
    mine = f"{os.getpid()}-"
    # Ray's agents retitle themselves with setproctitle, which by default moves the environment block to make
    # room for a long title, so /proc/<pid>/environ no longer shows the marker and the reaper cannot find them;
    # SPT_NOENV keeps the environment where it is (titles are then cut to the original argv's length).
    os.environ["SPT_NOENV"] = "1"
    if not os.environ.get(RUN_MARKER, "").startswith(mine):
        os.environ[RUN_MARKER] = mine + uuid.uuid4().hex
    return os.environ[RUN_MARKER]


def start_reaper() -> str:
    """Mark the run (:func:`mark_run`) and start, once per process, the reaper that SIGKILLs every process
    carrying the marker after this process ends (a SIGKILL of the driver included). Linux only (it reads
    ``/proc``); elsewhere only the marker is set. Returns the marker."""
    global _reaper
    marker = mark_run()
    if (_reaper is None or _reaper.poll() is not None) and os.path.isdir("/proc"):
        env = {k: v for k, v in os.environ.items() if k != RUN_MARKER}  # the reaper does not reap itself
        _reaper = subprocess.Popen([sys.executable, "-c", REAPER, str(os.getpid()), marker], env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
    return marker

