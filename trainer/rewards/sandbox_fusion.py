"""Score code in a remote SandboxFusion service (verl's ``reward_model.sandbox_fusion.*``).

The service's ``POST <url>`` (its ``/run_code`` endpoint) takes ``{"code", "language", "stdin",
"run_timeout", "compile_timeout", "memory_limit_MB", "files", "fetch_files"}`` and answers
``{"status": "Success" | "Failed" | "SandboxError", "message", "compile_result", "run_result":
{"status": "Finished" | "TimeLimitExceeded" | "Error", "return_code", "stdout", "stderr",
"execution_time"}}``. Containment is the service's job; this module keeps the *judging* local
wherever the protocol allows:

* ``io``: one request per case with the case's stdin; the output is compared here (whitespace-insensitive).
* ``call``: one request per case; a small driver reads the arguments as JSON from stdin, calls the
  function (or ``Solution().<fn>``) and prints the return value as JSON on its last line, which is
  decoded and compared here, so only data comes back.
* ``assert``: the service cannot call back, so each test runs after the candidate's code in the same
  remote program, followed by a random marker print; the test passes when the program finishes with
  exit code 0 *and* prints the marker (an early ``exit(0)`` does not pass). A candidate that reads
  its own source could print the marker: for untrusted policies prefer ``io`` / ``call`` tests or the
  local sandbox, where tests run in a separate referee.

A sample's cases go out in parallel, at most ``max_concurrent`` at once from one scorer process
(verl shares one semaphore across its reward threads; Coxswain's scorers are processes, so the
service sees at most ``reward_model.num_workers x max_concurrent`` requests). A service that cannot
be reached or answers ``SandboxError`` raises :class:`SandboxServiceError`: the reward manager
counts it as a scorer error, never as a wrong answer.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import secrets
import time
import urllib.error
import urllib.request

from trainer.rewards._sandbox_wire import same_output, same_value
from trainer.rewards.sandbox import SandboxLimits, SandboxResult


class SandboxServiceError(RuntimeError):
    """The remote service failed (unreachable, HTTP error, SandboxError): not the candidate's fault."""


_CALL_DRIVER = """
import json as _cx_json, sys as _cx_sys
_cx_args = _cx_json.loads(_cx_sys.stdin.read())
_cx_fn = globals().get({fn!r})
if _cx_fn is None and "Solution" in globals():
    _cx_fn = getattr(Solution(), {fn!r})
_cx_out = _cx_fn(*_cx_args)
if isinstance(_cx_out, tuple):
    _cx_out = list(_cx_out)
print()
print(_cx_json.dumps(_cx_out))
"""


def _post(url: str, payload: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = json.loads(resp.read(64 << 20).decode("utf-8", "replace"))
    except urllib.error.HTTPError as e:
        raise SandboxServiceError(f"sandbox service {url} answered HTTP {e.code}: {e.read(300)!r}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise SandboxServiceError(f"sandbox service {url} unreachable or unreadable: {e}") from None
    if not isinstance(body, dict) or body.get("status") == "SandboxError":
        raise SandboxServiceError(f"sandbox service {url} failed: {str(body)[:300]}")
    return body


def run_remote(
    url: str,
    code: str,
    mode: str = "assert",
    *,
    tests: list[str] | None = None,
    setup: str = "",
    inputs: list | None = None,
    outputs: list | None = None,
    fn_name: str | None = None,
    limits: SandboxLimits | None = None,
    memory_limit_mb: int = 1024,
    max_concurrent: int = 64,
) -> SandboxResult:
    """Run the tests of one sample in the service; same modes and result type as ``run_code``."""
    lim = limits or SandboxLimits()
    t0 = time.monotonic()
    base = {"language": "python", "run_timeout": float(lim.wall_s), "compile_timeout": float(lim.wall_s),
            "memory_limit_MB": int(memory_limit_mb), "files": {}, "fetch_files": []}
    jobs: list[dict] = []
    marker = secrets.token_hex(16)
    if mode == "assert":
        for t in tests or []:
            jobs.append({**base, "code": f"{code}\n\n{setup}\n\n{t}\n\nprint({marker!r})\n", "stdin": ""})
    elif mode == "io":
        jobs = [{**base, "code": code, "stdin": str(x)} for x in inputs or []]
    elif mode == "call":
        prog = code + "\n" + _CALL_DRIVER.format(fn=str(fn_name))
        jobs = [{**base, "code": prog, "stdin": json.dumps(a if isinstance(a, list) else [a])} for a in inputs or []]
    else:
        raise ValueError(f"unknown sandbox mode {mode!r}; use assert | io | call")
    total = len(jobs)
    if not total:
        return SandboxResult("error", 0, 0, "no tests were given", time.monotonic() - t0, 0.0, ["remote_service"])
    with cf.ThreadPoolExecutor(max_workers=max(1, min(int(max_concurrent), total))) as ex:
        answers = list(ex.map(lambda j: _post(url, j, timeout=float(lim.wall_s) + 30.0), jobs))
    passed, first_fail, timeouts = 0, None, 0
    for i, ans in enumerate(answers):
        run = ans.get("run_result") or {}
        comp = ans.get("compile_result") or {}
        out, err = str(run.get("stdout") or ""), str(run.get("stderr") or comp.get("stderr") or "")
        finished = run.get("status") == "Finished" and run.get("return_code") == 0
        if run.get("status") == "TimeLimitExceeded":
            timeouts += 1
        if mode == "assert":
            ok = finished and out.rstrip().endswith(marker)
        elif mode == "io":
            ok = finished and same_output(out, (outputs or [])[i])
        else:
            try:
                ok = finished and same_value(json.loads(out.rstrip().splitlines()[-1]), (outputs or [])[i])
            except (ValueError, IndexError):
                ok = False
        if ok:
            passed += 1
        elif first_fail is None:
            first_fail = f"test {i}: {run.get('status') or ans.get('status')}: {(err or out)[-300:]}"
    wall = time.monotonic() - t0
    if passed == total:
        status, reason = "passed", ""
    elif timeouts and passed + timeouts == total:
        status, reason = "timeout", first_fail or ""
    else:
        status, reason = "failed", first_fail or ""
    return SandboxResult(status, passed, total, reason[:600], wall, 0.0, ["remote_service"])
