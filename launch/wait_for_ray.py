"""Wait until a Ray cluster is up with the nodes a job needs, by asking its GCS (no fixed sleeps).

    python launch/wait_for_ray.py --address HEAD:PORT --nodes N [--timeout 180] [--watch-pid PID ...]
                                  [--expect NAME=IP ...]

Polls every ``--interval`` seconds: first until the GCS answers, then until ``N`` nodes are alive. Exits 0
when they are, printing one line per node; otherwise exits 1 with a message naming what is missing (the
GCS never answered, or which nodes joined and how many did not) as soon as it is known: at the timeout,
or at once when a watched process (the ``srun`` that runs ``ray start --block`` on a node) has exited,
since that node will never join. The launch templates (``launch/slurm/ray_cluster.sbatch``) call it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited child not yet reaped by its shell is a zombie: gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help="HEAD:PORT (default: $RAY_ADDRESS)")
    ap.add_argument("--nodes", type=int, required=True, help="alive nodes to wait for")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--watch-pid", type=int, action="append", default=[],
                    help="a process that starts a node; its exit means the node will not join")
    ap.add_argument("--expect", action="append", default=[], metavar="NAME=IP",
                    help="a node that must join, by its address: named in the message when it has not")
    a = ap.parse_args(argv)
    if not a.address:
        print("wait_for_ray: no --address and no RAY_ADDRESS", file=sys.stderr)
        return 2
    import ray

    deadline = time.monotonic() + a.timeout
    nodes: list[dict] = []
    connected, last_err = False, ""
    while True:
        try:
            if not connected:
                host, port = a.address.rsplit(":", 1)
                socket.create_connection((host, int(port)), timeout=2).close()  # the GCS port first: init may stall
                ray.init(address=a.address, logging_level="ERROR", log_to_driver=False)
                connected = True
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            if len(nodes) >= a.nodes:
                for n in nodes:
                    res = n.get("Resources", {})
                    print(f"ray node {n['NodeManagerAddress']} up: CPU {res.get('CPU', 0):g}, GPU {res.get('GPU', 0):g}",
                          flush=True)
                print(f"ray cluster ready at {a.address}: {len(nodes)} of {a.nodes} nodes alive", flush=True)
                return 0
        except Exception as e:  # noqa: BLE001 - the GCS is not up yet: keep polling
            last_err = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if connected:
                ray.shutdown()
                connected = False
        gone = [p for p in a.watch_pid if not _alive(p)]
        if gone or time.monotonic() > deadline:
            why = (f"the process starting a node exited (pid {', '.join(map(str, gone))}); see its log"
                   if gone else f"timed out after {a.timeout:.0f} s")
            if not connected and not nodes:
                print(f"error: the Ray head at {a.address} never answered ({why}; last error: {last_err})",
                      file=sys.stderr, flush=True)
            else:
                ips = [n["NodeManagerAddress"] for n in nodes]
                absent = [f"{name} ({ip})" for name, _, ip in (e.partition("=") for e in a.expect) if ip not in ips]
                print(f"error: {len(nodes)} of {a.nodes} Ray nodes joined ({', '.join(ips) or 'none'}); "
                      f"{a.nodes - len(nodes)} did not" + (f": {', '.join(absent)}" if absent else "") + f" ({why})",
                      file=sys.stderr, flush=True)
            return 1
        time.sleep(a.interval)


if __name__ == "__main__":
    sys.exit(main())
