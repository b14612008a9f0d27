"""Small network helpers shared by the HTTP servers and the code that launches them (no heavy imports).

* :func:`free_port`: a TCP port that was free a moment ago.
* The ready lines: each server prints ``PREFIX + URL + " (model NAME)"`` once it accepts requests
  (:func:`trainer.serving.app.serve`); a launcher waits for that line and reads the URL back with
  :func:`ready_url`. ``--port 0`` binds a free port, so the line is the only place the port is known.
"""

from __future__ import annotations

import socket

OPENAI_READY_PREFIX = "coxswain-serve: listening on "  # trainer.serving.openai (python -m trainer.serve)
SGLANG_NATIVE_READY_PREFIX = "coxswain-native-server: listening on "  # trainer.serving.sglang_native


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bind to port 0 and read it back)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ready_url(line: str, prefix: str) -> str | None:
    """The URL in a server's ready line, or None when ``line`` is not one."""
    return line[len(prefix):].split()[0] if line.startswith(prefix) else None
