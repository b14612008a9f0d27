"""Containment tests for the code sandbox: each hostile candidate is stopped, scored 0 with a reason,
the test process is unharmed, and no sandbox process outlives its run."""

import os
import socket
import subprocess
import time

import pytest

from trainer.rewards.sandbox import SandboxLimits, probe, run_code
from trainer.rewards.scorers import code_score

FAST = SandboxLimits(cpu_s=1, wall_s=4.0, mem_mb=512, nproc=8)
OK_TEST = ["assert True"]


def sandbox_processes() -> list[str]:
    """Command lines of live processes running the harness (zombies excluded)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "_sandbox_harness.py" in cmd:
            found.append(f"{d}: {cmd}")
    return found


@pytest.fixture(autouse=True)
def no_strays():
    yield
    # a SIGKILLed namespace init may still be in its exit (its mount namespace torn down) when run_code returns: on
    # a loaded 2-core machine that outlasted a 2 s grace once (the -n 2 suite beside a training run); a process that
    # really survived its run is still here after 10 s
    deadline = time.monotonic() + 10.0
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == [], "a sandbox process outlived its run"


def parent_unharmed():
    # the test process can still start processes and its working directory is intact
    assert subprocess.run(["true"]).returncode == 0
    assert os.path.isdir(os.getcwd())


def test_correct_and_wrong_code():
    r = run_code("def f(x):\n    return 2 * x\n", tests=["assert f(2) == 4", "assert f(3) == 6"], limits=FAST)
    assert (r.status, r.passed, r.total, r.reason) == ("passed", 2, 2, "")
    r = run_code("def f(x):\n    return 3 * x\n", tests=["assert f(2) == 4", "assert f(0) == 0"], limits=FAST)
    # f(2) = 6 fails, f(0) = 0 passes
    assert (r.status, r.passed, r.total) == ("failed", 1, 2) and "test 0" in r.reason
    for layer in ("tempdir", "wall_clock", "rlimit_cpu", "rlimit_as", "audit_hook"):
        assert layer in r.enforced


def test_io_and_call_modes():
    r = run_code("n = int(input())\nprint(n * 2)\n", mode="io", inputs=["3\n", "5\n"], outputs=["6", "11"], limits=FAST)
    # 3*2 = 6 passes; 5*2 = 10 != 11 fails
    assert (r.status, r.passed, r.total) == ("failed", 1, 2) and "wrong_answer" in r.reason
    r = run_code(
        "class Solution:\n    def add(self, a, b):\n        return a + b\n",
        mode="call", fn_name="add", inputs=[[1, 2], [3, 4]], outputs=[3, 7], limits=FAST,
    )
    assert (r.status, r.passed) == ("passed", 2)


def test_writing_inside_the_work_dir_is_allowed():
    code = (
        "import os\nopen('data.txt', 'w').write('hi')\nos.mkdir('sub')\nopen('sub/x', 'w').write('1')\n"
        "def read(p):\n    return open(p).read()\n"
        "def where():\n    return os.getcwd(), os.environ['HOME']\n"
    )
    tests = ["assert read('data.txt') == 'hi' and read('sub/x') == '1'", "cwd, home = where(); assert cwd == home"]
    r = run_code(code, tests=tests, limits=FAST)
    assert r.status == "passed", r.reason


def test_the_tests_run_in_the_referee_against_remote_values():
    """Candidate objects reach the tests as handles (classes, methods, generators) or as copied data;
    in-place changes to list / dict / set arguments are copied back after the call."""
    code = (
        "class Node:\n    def __init__(self, v, nxt=None):\n        self.val, self.next = v, nxt\n"
        "def build(xs):\n    head = None\n    for x in reversed(xs):\n        head = Node(x, head)\n    return head\n"
        "def sort_in_place(a):\n    a.sort()\n"
        "def add_key(d):\n    d['k'] = 1\n"
        "def gen(n):\n    yield from range(n)\n"
        "LIMIT = 10 ** 30\n"
        "def pair():\n    return (1, [2.5, {'a': b'x'}], frozenset({3}))\n"
    )
    tests = [
        "h = build([1, 2]); assert h.val == 1 and h.next.val == 2 and h.next.next is None",
        "a = [3, 1, 2]; sort_in_place(a); assert a == [1, 2, 3]",
        "d = {}; add_key(d); assert d == {'k': 1}",
        "assert list(gen(4)) == [0, 1, 2, 3] and LIMIT == 10 ** 30",
        "assert pair() == (1, [2.5, {'a': b'x'}], frozenset({3})) and type(pair()[0]) is int",
        "assert build([5]) == 5",  # comparing a candidate object is refused: this test fails
    ]
    r = run_code(code, tests=tests, limits=FAST)
    assert (r.status, r.passed, r.total) == ("failed", 5, 6), r.reason
    assert "test 5" in r.reason and "not plain data" in r.reason


def test_humaneval_style_check_function_and_setup():
    code = "def add(a, b):\n    return a + b\n"
    test = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert math.isclose(candidate(0.1, 0.2), 0.3)\ncheck(add)\n"
    r = run_code(code, tests=[test], setup="import math", limits=FAST)
    assert r.status == "passed", r.reason
    r = run_code("def add(a, b):\n    return a - b\n", tests=[test], setup="import math", limits=FAST)
    assert r.status == "failed" and "AssertionError" in r.reason


# ---------------------------------------------------------------------------------------------
# the four required containments
# ---------------------------------------------------------------------------------------------
def test_fork_bomb_blocked_by_the_guard():
    r = run_code("import os\nwhile True:\n    os.fork()\n", tests=OK_TEST, limits=FAST)
    assert r.status == "blocked" and "os.fork" in r.reason
    assert code_score("```python\nimport os\nwhile True:\n    os.fork()\n```", {"test_list": OK_TEST})["score"] == 0.0
    parent_unharmed()


def test_fork_bomb_contained_by_the_kernel_without_the_guard():
    """With the audit hook off, the kernel layers alone cap the fork bomb: every child holds its
    slot (sleeps), so the count of successful forks is the cap, and all die when the run ends."""
    info = probe()
    if not info["cgroup"] and info["root"] and not info["user_ns"]:
        pytest.skip("no writable pids cgroup and running as root (RLIMIT_NPROC has no effect): only the audit hook stops fork bombs here")
    code = (
        "import os, time\n"
        "kids = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "        kids += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print('forked', kids, flush=True)\n"
    )
    r = run_code(code, tests=OK_TEST, limits=FAST, disable_guard=True)
    assert "audit_hook" not in r.enforced
    forked = int(r.stdout.split("forked")[1].split()[0])
    # nproc = 8 tasks in the cgroup: the harness itself plus at most 7 children
    assert forked <= FAST.nproc - 1, r.stdout
    if r.peak_pids is not None:
        assert r.peak_pids <= FAST.nproc
    parent_unharmed()  # and the fixture checks that none of the sleeping children survived


def test_infinite_loop_hits_the_cpu_limit():
    t0 = time.monotonic()
    r = run_code("while True:\n    pass\n", tests=OK_TEST, limits=FAST)
    assert r.status == "cpu_limit" and "CPU-time limit of 1 s" in r.reason
    assert r.cpu_s >= 0.8 and time.monotonic() - t0 < FAST.wall_s + 2
    parent_unharmed()


def test_sleeping_forever_hits_the_wall_clock():
    t0 = time.monotonic()
    r = run_code("import time\ntime.sleep(1000)\n", tests=OK_TEST, limits=SandboxLimits(cpu_s=1, wall_s=1.5, mem_mb=512))
    assert r.status == "timeout" and "wall-clock limit of 1.5 s" in r.reason
    assert time.monotonic() - t0 < 1.5 + 2.0
    parent_unharmed()


def test_huge_allocation_hits_the_memory_limit():
    r = run_code("x = bytearray(16 * 1024 ** 3)\n", tests=OK_TEST, limits=FAST)  # 16 GiB vs a 512 MiB limit
    assert r.status == "memory_limit" and "512 MiB" in r.reason
    r = run_code("def f():\n    return [0] * (10 ** 10)\n", tests=["assert len(f()) > 0"], limits=FAST)
    assert r.status == "memory_limit"
    parent_unharmed()


def test_write_outside_the_temp_dir_is_blocked(tmp_path):
    outside = tmp_path / "outside.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    attempts = {
        "open": f"open({str(outside)!r}, 'w').write('x')",
        "os.open": f"import os\nos.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT)",
        "remove": f"import os\nos.remove({str(victim)!r})",
        "rename": f"import os\nos.rename({str(victim)!r}, 'stolen.txt')",
        "chmod": f"import os\nos.chmod({str(victim)!r}, 0o777)",
        "symlink escape": f"import os\nos.symlink({str(tmp_path)!r}, 'link')\nopen('link/outside.txt', 'w').write('x')",
        "swallowed": f"try:\n    open({str(outside)!r}, 'w')\nexcept Exception:\n    pass\ndef f():\n    return 1\n",
    }
    for name, code in attempts.items():
        r = run_code(code, tests=["assert True"], limits=FAST)
        # even a candidate that catches the refusal is scored as blocked
        assert r.status == "blocked", (name, r.status, r.reason)
        assert "outside the sandbox directory" in r.reason, (name, r.reason)
    assert not outside.exists()
    assert victim.read_text() == "keep me" and oct(victim.stat().st_mode & 0o777) != "0o777"
    parent_unharmed()


# ---------------------------------------------------------------------------------------------
# network, signals, forged results
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("guard", [True, False])
def test_no_network(guard):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.5)
    port = srv.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'leak')\n"
    info = probe()
    if not guard and "net_namespace" not in info["layers"]:
        pytest.skip("no network namespace on this machine: only the audit hook (guard) blocks sockets here")
    r = run_code(code, tests=OK_TEST, limits=FAST, disable_guard=not guard)
    assert r.status != "passed"
    if guard:
        assert r.status == "blocked" and "network" in r.reason
    else:
        # seccomp refuses inet sockets (EPERM); behind it the namespace has only a down loopback
        assert "net_namespace" in r.enforced
        assert "unreachable" in r.reason or "refused" in r.reason or "not permitted" in r.reason, r.reason
    with pytest.raises(socket.timeout):
        srv.accept()  # nothing reached the listener
    srv.close()


def test_cannot_signal_the_parent():
    r = run_code(f"import os, signal\nos.kill({os.getpid()}, signal.SIGTERM)\n", tests=OK_TEST, limits=FAST)
    assert r.status == "blocked" and "signalling other processes" in r.reason
    parent_unharmed()


def test_forged_output_and_early_exit_do_not_pass():
    forge = (
        "import os, json, sys\n"
        "print(json.dumps({'kind': 'test', 'i': 0, 'ok': True, 'nonce': 'guess'}))\n"
        "for fd in range(3, 12):\n"
        "    try:\n"
        "        os.write(fd, b'{\"kind\": \"done\", \"nonce\": \"guess\"}\\n')\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"
    )
    r = run_code(forge, tests=["assert False"], limits=FAST)
    assert r.status == "crashed" and r.passed == 0  # exited before the tests: no pass
    r = run_code("import sys\nsys.exit(0)\n", tests=["assert False"], limits=FAST)
    assert r.status != "passed"


def test_common_libraries_still_work_under_the_guard():
    # numpy imports ctypes (the harness pre-imports it); threads are not processes
    code = "import numpy as np\nimport threading\nt = threading.Thread(target=lambda: None)\nt.start()\nt.join()\n"
    r = run_code(code, tests=["assert int(np.arange(5).sum()) == 10"], limits=SandboxLimits(cpu_s=4, wall_s=8.0))
    assert r.status == "passed", (r.reason, r.stderr)
    r = run_code("import ctypes\nctypes.CDLL(None).fork()\n", tests=OK_TEST, limits=FAST)
    assert r.status == "blocked" and "ctypes" in r.reason


def test_containment_on_a_machine_without_namespaces_setpriv_or_cgroups(monkeypatch, tmp_path):
    """Simulate a minimal container (no unshare, no setpriv, no writable cgroup, no seccomp): code is
    not scored unless the user opts in, and then the wall clock, the rlimits, the audit hook, the
    proxy variables and the self-set parent-death signal remain, and the result names what is missing."""
    import trainer.rewards.sandbox as sb

    why = {layer: f"{layer} is not available here" for layer in sb.REQUIRED}
    minimal = {"prefix": [], "layers": [], "root": os.geteuid() == 0, "user_ns": False, "cgroup": None,
               "why": why, "binds": [], "links": []}
    monkeypatch.setattr(sb, "probe", lambda: minimal)
    monkeypatch.delenv(sb.ALLOW_WEAK_ENV, raising=False)
    with pytest.raises(sb.SandboxUnavailable) as e:
        sb.run_code("def f():\n    return 1\n", tests=OK_TEST, limits=FAST)
    assert "mount_namespace: mount_namespace is not available here" in str(e.value)
    assert "allow_weak_containment=true" in str(e.value) and "sandbox_fusion.url" in str(e.value)
    with pytest.raises(sb.SandboxUnavailable):  # the reward manager counts and logs it; main refuses to start
        code_score("```python\ndef f():\n    return 1\n```", {"test_list": OK_TEST})
    monkeypatch.setenv(sb.ALLOW_WEAK_ENV, "1")
    r = sb.run_code("import os\nprint(os.environ['https_proxy'])\n", tests=OK_TEST, limits=FAST)
    assert r.status == "passed" and r.stdout.strip() == "http://127.0.0.1:9"
    assert {"proxy_env", "parent_death_signal", "audit_hook", "rlimit_cpu", "rlimit_as"} <= set(r.enforced)
    assert "net_namespace" not in r.enforced and "pids_cgroup" not in r.enforced
    assert {"mount_namespace", "net_namespace", "pid_namespace", "seccomp"} <= set(r.missing)
    assert sb.run_code("import time\ntime.sleep(100)\n", tests=OK_TEST, limits=SandboxLimits(cpu_s=1, wall_s=1.0)).status == "timeout"
    assert sb.run_code("import os\nos.fork()\n", tests=OK_TEST, limits=FAST).status == "blocked"
    r = sb.run_code("import socket\nsocket.socket()\n", tests=OK_TEST, limits=FAST)
    assert r.status == "blocked" and "network" in r.reason
    r = sb.run_code(f"open({str(tmp_path / 'x')!r}, 'w')\n", tests=OK_TEST, limits=FAST)
    assert r.status == "blocked" and not (tmp_path / "x").exists()


def test_a_run_with_code_data_refuses_to_start_on_a_host_that_cannot_contain_it(monkeypatch):
    """main.check_code_sandbox: code-scored data on a weak host is a config error before any worker
    starts; the opt-in, a remote service, or data that runs no code lets it start."""
    import types

    import trainer.rewards.sandbox as sb
    from tests.support.tiny import tiny_config
    from trainer.config import ConfigError
    from trainer.main import check_code_sandbox

    why = {layer: "not here" for layer in sb.REQUIRED}
    monkeypatch.setattr(sb, "probe", lambda: {"layers": [], "why": why})
    monkeypatch.delenv(sb.ALLOW_WEAK_ENV, raising=False)
    code_ds = types.SimpleNamespace(items=[{"data_source": "mbpp"}, {"data_source": "openai/gsm8k"}])
    math_ds = types.SimpleNamespace(items=[{"data_source": "openai/gsm8k"}])
    with pytest.raises(ConfigError, match=r"data sources \['mbpp'\] are scored by running code.*seccomp: not here"):
        check_code_sandbox(tiny_config(), code_ds, None)
    check_code_sandbox(tiny_config(), math_ds, math_ds)
    check_code_sandbox(tiny_config(["reward_model.sandbox.allow_weak_containment=true"]), code_ds)
    check_code_sandbox(tiny_config(["reward_model.sandbox_fusion.url=http://127.0.0.1:9/run_code"]), code_ds)
