"""trainer/sync/doorbell.py against real worker processes (spawned, each serving a doorbell)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import time

import pytest

from trainer.sync.doorbell import Doorbell, DoorbellError


class Target:
    def __init__(self, rank: int):
        self.rank = rank
        self.calls = 0

    def work(self, x: int, wait_s: float = 0.0) -> dict:
        self.calls += 1
        time.sleep(wait_s)
        return {"rank": self.rank, "pid": os.getpid(), "twice": 2 * x, "calls": self.calls}

    def fail(self) -> None:
        raise ValueError(f"rank {self.rank} cannot")

    def fail_long(self) -> None:
        raise ValueError("y" * 100_000 + " the end")

    def secret(self) -> str:  # not served
        return "leaked"


def _worker(rank: int, conn) -> None:
    from trainer.sync.doorbell import serve

    server = serve(Target(rank), ("work", "fail", "fail_long"))
    conn.send((server.address, server.token))
    conn.recv()  # stay alive until the test is done


def _spawn(n: int) -> tuple[list, list, list]:
    """``n`` worker processes, each serving a doorbell: (processes, pipes that end them, endpoints)."""
    ctx = mp.get_context("spawn")
    procs, pipes, endpoints = [], [], []
    for rank in range(n):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(rank, b), daemon=True)
        p.start()
        procs.append(p)
        pipes.append(a)
        endpoints.append(a.recv())
    return procs, pipes, endpoints


@pytest.fixture(scope="module")
def workers():
    procs, pipes, endpoints = _spawn(3)
    yield procs, endpoints
    for a in pipes:
        try:
            a.send("done")
        except OSError:
            pass
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()


def test_calls_every_worker_in_parallel_and_in_rank_order(workers):
    procs, endpoints = workers
    bell = Doorbell.connect(endpoints)
    try:
        out = bell.call("work", [(1,), (2,), (3,)])
        assert [o["rank"] for o in out] == [0, 1, 2] and [o["twice"] for o in out] == [2, 4, 6]
        assert [o["pid"] for o in out] == [p.pid for p in procs]  # each ran in its own worker
        again = bell.call("work", [(0,)] * 3)
        assert [o["calls"] for o in again] == [o["calls"] + 1 for o in out]  # one target per worker, state kept
        # sent to all before reading any reply: three 0.3 s calls take about 0.3 s, not 0.9 s
        t0 = time.perf_counter()
        bell.call("work", [(0, 0.3)] * 3)
        assert time.perf_counter() - t0 < 0.75
    finally:
        bell.close()


def test_a_failing_method_names_its_rank_and_unserved_methods_are_refused(workers):
    _, endpoints = workers
    bell = Doorbell.connect(endpoints)
    with pytest.raises(DoorbellError, match=r"(?s)rank 0: fail failed on its worker:.*ValueError: rank 0 cannot"):
        bell.call("fail", [()] * 3)
    assert bell.conns == []  # closed after a failure: the caller falls back to Ray
    with pytest.raises(DoorbellError, match="closed"):
        bell.call("work", [(1,)] * 3)
    bell = Doorbell.connect(endpoints)
    try:
        with pytest.raises(DoorbellError, match=r"(?s)rank 0: secret failed.*'secret' is not served"):
            bell.call("secret", [()] * 3)
    finally:
        bell.close()


def test_a_request_without_the_token_is_dropped(workers):
    _, endpoints = workers
    address, token = endpoints[0]
    intruder = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    intruder.connect(address)
    intruder.sendall(os.urandom(16) + json.dumps(["work", [5]]).encode())
    intruder.settimeout(5)
    assert intruder.recv(1 << 16) == b""  # hung up on, nothing run
    intruder.close()
    bell = Doorbell.connect(endpoints)  # the real driver is still served
    try:
        assert bell.call("work", [(5,)] * 3)[0]["twice"] == 10
    finally:
        bell.close()


def test_unreachable_workers_give_no_doorbell():
    assert Doorbell.connect([("\0coxswain-doorbell-nobody-listens", b"0" * 16)]) is None


def test_a_worker_killed_mid_call_is_an_error_not_a_hang():
    (p,), _, endpoints = _spawn(1)
    bell = Doorbell.connect(endpoints)
    import threading

    threading.Timer(0.5, os.kill, (p.pid, signal.SIGKILL)).start()
    t0 = time.perf_counter()
    with pytest.raises(DoorbellError, match=r"(?s)rank 0: work failed.*closed the doorbell"):
        bell.call("work", [(1, 30.0)])
    assert time.perf_counter() - t0 < 10
    p.join(5)


def test_a_worker_dead_before_the_call_fails_it_after_the_others_reply():
    procs, pipes, endpoints = _spawn(2)
    bell = Doorbell.connect(endpoints)
    procs[0].kill()
    procs[0].join(5)
    t0 = time.perf_counter()
    with pytest.raises(DoorbellError, match=r"(?s)rank 0: work failed.*(could not reach|closed the doorbell)"):
        bell.call("work", [(1, 0.0), (1, 0.5)])
    assert time.perf_counter() - t0 >= 0.45  # rank 1 ran its call to the end before the error was raised
    pipes[1].send("done")
    procs[1].join(5)


def test_a_long_traceback_still_fits_in_a_reply(workers):
    _, endpoints = workers
    bell = Doorbell.connect(endpoints)
    with pytest.raises(DoorbellError, match=r"(?s)rank 0: fail_long failed.*yyyy the end") as e:
        bell.call("fail_long", [()] * 3)  # a 100 KB message: more than one packet holds
    assert len(str(e.value)) < 20_000


def test_closing_a_doorbell_ends_its_accept_thread():
    """A replaced doorbell (a new shared-memory set-up) leaves no thread behind in the worker."""
    import threading

    from trainer.sync.doorbell import serve

    def accepting() -> int:
        return sum(t.name == "coxswain-doorbell" and t.is_alive() for t in threading.enumerate())

    before = accepting()
    first = serve(Target(0), ("work",))
    second = serve(Target(0), ("work",), previous=first)
    deadline = time.monotonic() + 5
    while accepting() > before + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert accepting() == before + 1
    bell = Doorbell.connect([(second.address, second.token)])
    assert bell.call("work", [(4,)])[0]["twice"] == 8
    assert Doorbell.connect([(first.address, first.token)]) is None  # the old one no longer listens
    bell.close()
    second.close()
