"""A doorbell: the driver runs one named, small-argument method on its worker processes of the same node
without a Ray round trip. Used for the one call whose latency is a large share of its cost: the
shared-memory weight sync (trainer/sync/shared_memory.py), where every actor rank writes its own
blocks in a few milliseconds.

Why not a Ray call: a Ray actor call to four workers on two busy cores costs 1.5-3 ms from submit to
the last result (measured here, ``ray.get`` of a no-op on four actors), about a fifth of a 75 MB
TP=2 x PP=2 sync. Ray's compiled graphs take that to 0.4 ms, but their workers poll their channels:
every idle worker holds a core at 100%, which on a machine whose cores also train and generate costs
more than it saves. Here each worker has one thread blocked in ``recv`` (no CPU while idle) on a
Unix ``SOCK_SEQPACKET`` connection from the driver: a call is one packet each way, and the driver
sends to every worker before it reads any reply, so the workers run in parallel.

Contract:

* the worker opens it (:func:`serve`, through a Ray call) for a fixed set of its methods, and returns
  an abstract-namespace address (Linux: no file, gone with the process) and a random token;
* the driver connects (:class:`Doorbell`); a worker on another node (or in another network
  namespace) is not reachable, and the caller keeps its Ray calls;
* a request is the token, then JSON ``[method, args]``; a reply is JSON ``{"ok": result}`` or
  ``{"error": traceback}``. Data only, never pickle: any local process can connect to an abstract
  socket, so a request without the token is dropped and its connection closed;
* the method runs on the doorbell's thread, beside the actor's Ray threads. The driver rings only
  where it has no Ray call in flight on those workers (the loop is synchronous around a sync), the
  same discipline its groups' ``max_concurrency=2`` already needs;
* a worker that dies mid-call closes its end: the driver's read ends with an error naming the rank,
  never a hang.
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import traceback

MAX_MSG = 1 << 16  # requests and replies are a few hundred bytes: a verify flag, a byte count, an error
MAX_ERROR = 16 << 10  # characters of a worker's traceback sent back (a reply must fit in one packet)


class _Server:
    def __init__(self, target, methods: frozenset[str]):
        self.target, self.methods = target, methods
        self.token = os.urandom(16)
        self.address = f"\0coxswain-doorbell-{os.getpid()}-{self.token.hex()[:12]}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(self.address)
        self.sock.listen(4)
        self.closed = False
        threading.Thread(target=self._accept, name="coxswain-doorbell", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="coxswain-doorbell-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    msg = conn.recv(MAX_MSG)
                except OSError:
                    return
                if not msg or msg[:16] != self.token:  # the driver hung up, or not the driver
                    return
                try:
                    method, args = json.loads(msg[16:])
                    if method not in self.methods:
                        raise ValueError(f"method {method!r} is not served by this doorbell ({sorted(self.methods)})")
                    reply = {"ok": getattr(self.target, method)(*args)}
                except Exception:  # noqa: BLE001 - sent back to the driver, which raises it with the rank
                    reply = {"error": traceback.format_exc()[-MAX_ERROR:]}  # the end of a traceback names the fault
                try:
                    conn.sendall(json.dumps(reply).encode())
                except OSError:
                    return

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (a bare close leaves it blocked)
        except OSError:
            pass
        self.sock.close()


def serve(target, methods, previous: _Server | None = None) -> _Server:
    """Open a doorbell on this process for ``target``'s ``methods`` (closing ``previous``); its
    ``address`` and ``token`` go to the driver."""
    if previous is not None:
        previous.close()
    return _Server(target, frozenset(methods))


class DoorbellError(RuntimeError):
    """A worker's method raised, or its process went away, during a doorbell call."""


class Doorbell:
    """The driver's end: one connection per worker, in rank order."""

    def __init__(self, endpoints: list[tuple[str, bytes]], timeout_s: float = 5.0):
        self.conns: list[socket.socket] = []
        self.tokens = [bytes(t) for _, t in endpoints]
        try:
            for address, _ in endpoints:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                self.conns.append(s)
                s.settimeout(timeout_s)
                s.connect(address)
                s.settimeout(None)
        except OSError:
            self.close()
            raise

    @classmethod
    def connect(cls, endpoints: list[tuple[str, bytes]]) -> "Doorbell | None":
        """A doorbell to every worker, or None where any is unreachable from here (another node)."""
        try:
            return cls(endpoints)
        except OSError:
            return None

    def call(self, method: str, args_per_rank: list[tuple]) -> list:
        """``method(*args)`` on every worker at once; the results in rank order. Raises
        :class:`DoorbellError` naming the first rank that failed (after every reply is in, so no
        worker is left mid-call when the caller recovers)."""
        if not self.conns:
            raise DoorbellError("the doorbell is closed")
        replies: list = [None] * len(self.conns)
        waiting = {}
        for i, (s, tok, args) in enumerate(zip(self.conns, self.tokens, args_per_rank)):
            try:
                s.sendall(tok + json.dumps([method, list(args)]).encode())
                waiting[s.fileno()] = i
            except OSError as e:  # its process is gone: the others still run, and are waited for
                replies[i] = {"error": f"could not reach the worker ({e}; its process exited or was killed)"}
        while waiting:
            ready, _, _ = select.select(list(waiting), [], [])
            for fd in ready:
                i = waiting.pop(fd)
                try:
                    msg = self.conns[i].recv(MAX_MSG)
                except OSError as e:
                    replies[i] = {"error": f"connection error: {e}"}
                    continue
                replies[i] = json.loads(msg) if msg else {"error": "the worker closed the doorbell (its process "
                                                          "exited or was killed)"}
        for i, r in enumerate(replies):
            if "error" in r:
                self.close()  # a worker that failed mid-call may be in any state: later calls go through Ray
                raise DoorbellError(f"rank {i}: {method} failed on its worker:\n{r['error']}")
        return [r["ok"] for r in replies]

    def close(self) -> None:
        for s in self.conns:
            try:
                s.close()
            except OSError:
                pass
        self.conns = []
