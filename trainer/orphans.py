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
"""

from __future__ import annotations

import os
import sys
import threading
import time

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

_watching = False


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
