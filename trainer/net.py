"""Small network helpers shared by the HTTP servers and the code that launches them (no heavy imports).

* :func:`free_port`: a TCP port that was free a moment ago.
* The ready lines: each server prints ``PREFIX + URL + " (model NAME)"`` once it accepts requests
  (:func:`trainer.serving.app.serve`); a launcher waits for that line and reads the URL back with
  :func:`ready_url`. ``--port 0`` binds a free port, so the line is the only place the port is known.
"""

from __future__ import annotations

import random
import socket

OPENAI_READY_PREFIX = "coxswain-serve: listening on "  # trainer.serving.openai (python -m trainer.serve)
SGLANG_NATIVE_READY_PREFIX = "coxswain-native-server: listening on "  # trainer.serving.sglang_native


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, for a process that binds it later (the megatron
    ranks' rendezvous, a server's port chosen in advance).

    Chosen below the kernel's ephemeral range (and above Ray's default worker ports, 10002-19999): a port
    read back from ``bind(port 0)`` lies inside that range, where any other process binding port 0 (a
    fleet server, Ray, an outgoing connection) may be handed it before our process binds it; seen here as
    EADDRINUSE at a worker's rendezvous. Falls back to port 0 where that window is empty."""
    lo, hi = 20000, _ephemeral_low() - 1
    rng = random.SystemRandom()
    for _ in range(200 if hi > lo else 0):
        port = rng.randint(lo, hi)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ready_url(line: str, prefix: str) -> str | None:
    """The URL in a server's ready line, or None when ``line`` is not one."""
    return line[len(prefix):].split()[0] if line.startswith(prefix) else None
