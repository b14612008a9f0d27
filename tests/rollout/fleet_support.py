"""What the fleet tests (native servers and real SGLang servers) check after killing a server."""

from __future__ import annotations

import json
import time
import urllib.request


def await_restart(fleet, restarts_before: int, old_url: str, timeout_s: float) -> str:
    """Wait until the fleet has restarted server 0; check that it runs on a new URL, that the router lists
    exactly the new URL and server 1 as healthy (the old one removed); return the new URL."""
    deadline = time.monotonic() + timeout_s
    while fleet.stats.restarts == restarts_before:
        assert time.monotonic() < deadline, f"the fleet did not restart the killed server in {timeout_s:.0f} s"
        time.sleep(0.1)
    new_url = fleet.servers[0].url
    assert new_url != old_url and fleet.servers[0].proc.poll() is None
    with urllib.request.urlopen(fleet.router_url + "/workers", timeout=10) as r:
        router = {w["url"]: w["is_healthy"] for w in json.loads(r.read())["workers"]}
    assert router == {new_url: True, fleet.servers[1].url: True}  # old URL removed, new one registered
    return new_url
