"""The fleet client's admin POSTs (weight pushes, cache flushes) on a connection the server drops before it
answers: retried on a new connection, twice, then the error (the aiohttp client and the blocking urllib one). A real HTTP/1.1 server on 127.0.0.1 that drops the
first ``drops`` connections after reading the request's headers."""

import json
import socket
import threading

import aiohttp
import pytest

from trainer.rollout.fleet_client import FleetClient


class DroppingServer:
    def __init__(self, drops: int):
        self.drops, self.connections = drops, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.connections += 1
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if self.connections <= self.drops:
                    continue  # closed without an answer
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += conn.recv(65536)
                assert json.loads(body) == {"weight_version": "7"}
                out = b'{"success": true}'
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(out), out))

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("drops", [1, 2])
def test_a_dropped_admin_request_is_retried_on_a_new_connection(drops):
    srv = DroppingServer(drops)
    client = FleetClient(srv.url, [srv.url])
    try:
        out = client._call(client._admin(srv.url, "/update_weights_from_tensor", {"weight_version": "7"}), timeout=30)
    finally:
        client.close()
        srv.close()
    assert out == {"success": True} and srv.connections == drops + 1


def test_a_server_that_keeps_dropping_fails_the_push_after_three_tries():
    srv = DroppingServer(drops=10)
    client = FleetClient(srv.url, [srv.url])
    try:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            client._call(client._admin(srv.url, "/update_weights_from_tensor", {"weight_version": "7"}), timeout=30)
    finally:
        client.close()
        srv.close()
    assert srv.connections == 3


def test_the_blocking_admin_post_retries_a_dropped_connection_too():
    from trainer.rollout.sglang_http import _post

    srv = DroppingServer(drops=2)
    try:
        assert _post(srv.url, "/update_weights_from_disk", {"weight_version": "7"}, timeout=30) == {"success": True}
    finally:
        srv.close()
    assert srv.connections == 3
