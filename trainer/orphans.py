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
  as its child, forwards SIGTERM, and kills it when the wrapper's own parent goes away.
"""

from __future__ import annotations

import os
import sys
import threading
import time

SUPERVISOR = r"""
import os, signal, subprocess, sys, time
parent = os.getppid()
child = subprocess.Popen(sys.argv[1:])
def _stop(*_):
    child.terminate()
signal.signal(signal.SIGTERM, _stop)
while child.poll() is None:
    if os.getppid() != parent:
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
    """``cmd`` wrapped in :data:`SUPERVISOR`: killed when the process that starts the wrapper dies."""
    return [sys.executable, "-c", SUPERVISOR, *cmd]
