"""The SandboxFusion client against a local service speaking the same protocol.

SandboxFusion itself is a container service that cannot run here; the stand-in is a real HTTP server
on 127.0.0.1 that implements its ``/run_code`` contract (request fields, response shape, the
``TimeLimitExceeded`` status) by running the program in a subprocess. The client does not know.
"""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainer.rewards.sandbox import SandboxLimits
from trainer.rewards.sandbox_fusion import SandboxServiceError, run_remote
from trainer.rewards.scorers import compute_score


class _Service(BaseHTTPRequestHandler):
    requests: list = []
    lock = threading.Lock()
    in_flight = [0, 0]  # now, peak

    def log_message(self, *a):
        pass

    def do_POST(self):
        if self.path != "/run_code":
            self.send_error(404)
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.requests.append(body)
            self.in_flight[0] += 1
            self.in_flight[1] = max(self.in_flight)
        try:
            if "SANDBOX_ERROR" in body["code"]:
                out = {"status": "SandboxError", "message": "no executor", "compile_result": None, "run_result": None}
            else:
                try:
                    p = subprocess.run([sys.executable, "-I", "-c", body["code"]], input=body.get("stdin", ""),
                                       capture_output=True, text=True, timeout=body["run_timeout"])
                    run = {"status": "Finished", "return_code": p.returncode, "stdout": p.stdout, "stderr": p.stderr,
                           "execution_time": 0.0}
                except subprocess.TimeoutExpired:
                    run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": "", "stderr": "", "execution_time": 0.0}
                out = {"status": "Success" if run["return_code"] == 0 else "Failed", "message": "",
                       "compile_result": None, "run_result": run, "executor_pod_name": None, "files": {}}
        finally:
            with self.lock:
                self.in_flight[0] -= 1
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def service():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/run_code"
    srv.shutdown()


LIM = SandboxLimits(cpu_s=2, wall_s=3.0, mem_mb=512)


def test_modes_judged_locally(service):
    _Service.requests.clear()
    r = run_remote(service, "n = int(input())\nprint(n * 2)\n", mode="io", inputs=["3\n", "5\n"], outputs=["6", "11"],
                   limits=LIM, memory_limit_mb=777)
    assert (r.status, r.passed, r.total) == ("failed", 1, 2)  # 10 != 11
    sent = _Service.requests[0]
    assert sent["language"] == "python" and sent["memory_limit_MB"] == 777 and sent["run_timeout"] == 3.0
    assert {q["stdin"] for q in _Service.requests} == {"3\n", "5\n"}
    r = run_remote(service, "class Solution:\n    def pair(self, a, b):\n        return (b, a)\n", mode="call",
                   fn_name="pair", inputs=[[1, 2], [3, 4]], outputs=[[2, 1], [4, 3]], limits=LIM)
    assert (r.status, r.passed) == ("passed", 2), r.reason
    r = run_remote(service, "def f(x):\n    return 2 * x\n", tests=["assert f(2) == 4", "assert f(3) == 7"], limits=LIM)
    assert (r.status, r.passed) == ("failed", 1)


def test_early_exit_and_timeouts_do_not_pass(service):
    # exit(0) before the test runs: finished with code 0, but the marker never printed
    r = run_remote(service, "import os\nos._exit(0)\n", tests=["assert False"], limits=LIM)
    assert r.status == "failed" and r.passed == 0
    r = run_remote(service, "import time\ntime.sleep(30)\n", tests=["assert True"], limits=SandboxLimits(wall_s=1.0))
    assert r.status == "timeout" and r.passed == 0


def test_cases_go_out_in_parallel_up_to_max_concurrent(service):
    _Service.in_flight[1] = 0
    code = "import time\ntime.sleep(0.3)\nprint(input())\n"
    r = run_remote(service, code, mode="io", inputs=[f"{i}\n" for i in range(6)], outputs=[str(i) for i in range(6)],
                   limits=LIM, max_concurrent=3)
    assert r.status == "passed"
    assert _Service.in_flight[1] == 3  # six cases, three at a time


def test_service_failure_is_an_error_not_a_wrong_answer(service):
    with pytest.raises(SandboxServiceError, match="no executor"):
        run_remote(service, "SANDBOX_ERROR = 1\n", tests=["assert True"], limits=LIM)
    with pytest.raises(SandboxServiceError, match="unreachable"):
        run_remote("http://127.0.0.1:9/run_code", "x = 1\n", tests=["assert True"], limits=LIM)


def test_compute_score_routes_code_to_the_service(service):
    _Service.requests.clear()
    out = compute_score("mbpp", "```python\ndef f(x):\n    return x + 1\n```", {"test_list": ["assert f(1) == 2"]},
                        sandbox_fusion_url=service, memory_limit_mb=256)
    assert out["score"] == 1.0 and len(_Service.requests) == 1 and _Service.requests[0]["memory_limit_MB"] == 256
    # a math source never touches the service
    assert compute_score("openai/gsm8k", "#### 4", "4", sandbox_fusion_url=service)["score"] == 1.0
    assert len(_Service.requests) == 1


def test_config_keys_reach_the_scorer(service, monkeypatch):
    from tests.support.tiny import tiny_config
    from trainer.rewards.manager import RewardManager
    from trainer.rewards.sandbox import ALLOW_WEAK_ENV

    monkeypatch.delenv(ALLOW_WEAK_ENV, raising=False)
    cfg = tiny_config([f"reward_model.sandbox_fusion.url={service}", "reward_model.sandbox_fusion.max_concurrent=5",
                       "reward_model.sandbox.allow_weak_containment=true", "reward_model.num_workers=0"])
    mgr = RewardManager.from_config(cfg)
    assert mgr.scorer_kwargs == {"sandbox_fusion_url": service, "memory_limit_mb": 1024, "max_concurrent": 5}
    import os

    assert os.environ.get(ALLOW_WEAK_ENV) == "1"
