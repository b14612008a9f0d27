"""Adversarial tests of the code sandbox: the escapes and forgeries an audit of the old sandbox found,
each of which must now fail.

Two kinds of attacker:
* a candidate that switches the audit hook off from inside (it can: the hook's tables are reachable
  through ``gc``), then does what it likes: the kernel layers (private read-only root, uid nobody,
  seccomp, namespaces, pids cgroup) must hold on their own;
* a candidate that tries to score without solving: forged result lines, rewritten tests, an object
  whose ``__eq__`` always answers True, an early exit. The referee must score each 0.

Each attack writes what happened into a JSON line on stdout, so the assertions read the kernel's
answers, not merely that the run "did not pass".
"""

import json
import os
import stat
import subprocess
import time

import pytest

from trainer.rewards.sandbox import REQUIRED, SandboxLimits, probe, run_code
from trainer.rewards.scorers import code_score

LIM = SandboxLimits(cpu_s=3, wall_s=8.0, mem_mb=1024, nproc=16)

# Five lines that switch the audit hook off: its decision function is a closure cell, reachable
# through gc and writable (the old sandbox fell to the same lines).
BYPASS = (
    "import gc\n"
    "for o in gc.get_objects():\n"
    "    if type(o).__name__ == 'function' and o.__name__ == 'hook' and o.__closure__:\n"
    "        for name, cell in zip(o.__code__.co_freevars, o.__closure__):\n"
    "            if name == 'refuse': cell.cell_contents = lambda *a, **k: None\n"
)

pytestmark = pytest.mark.skipif(
    any(layer not in probe()["layers"] for layer in REQUIRED),
    reason=f"this host cannot give every required sandbox layer ({[x for x in REQUIRED if x not in probe()['layers']]}); "
    "the sandbox refuses to score code here (tests/rewards/test_sandbox.py covers the refusal)",
)


def attempts(code_by_name: dict[str, str], tmp_path, guard_bypassed=True) -> dict[str, str]:
    """Run each attack in one sandbox after the bypass; returns {name: "ok" | "<exception>"}."""
    body = [BYPASS if guard_bypassed else "", "import json, os, sys\nRESULTS = {}\n"]
    for name, code in code_by_name.items():
        snippet = "\n".join("    " + line for line in code.strip().splitlines())
        body.append(f"try:\n{snippet}\n    RESULTS[{name!r}] = 'ok'\nexcept BaseException as e:\n"
                    f"    RESULTS[{name!r}] = type(e).__name__ + ': ' + str(e)\n")
    body.append("print('RESULTS=' + json.dumps(RESULTS), flush=True)\n")
    r = run_code("\n".join(body), tests=["assert True"], limits=LIM)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULTS=")), None)
    assert line is not None, (r.status, r.reason, r.stderr[-2000:])
    return json.loads(line[len("RESULTS="):])


def test_the_audit_hook_bypass_still_works_but_contains_nothing(tmp_path):
    """The bypass really switches the hook off (a fork succeeds), and still nothing leaves the jail."""
    marker = tmp_path / "outside_file"
    res = attempts({
        "fork": "pid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)",
        "shell_write": f"import subprocess\nsubprocess.run(['sh', '-c', 'id > {marker}'], check=True)",
        "shell_write_tmp": "import subprocess\nsubprocess.run(['sh', '-c', 'id > /tmp/escaped'], check=True)",
        "whoami": "import subprocess\nRESULTS['uid'] = subprocess.run(['id', '-u'], capture_output=True, text=True).stdout.strip()",
    }, tmp_path)
    assert res["fork"] == "ok", res  # the audit hook is really off
    assert res["shell_write"].startswith("CalledProcessError"), res  # sh could not create the file
    assert res["shell_write_tmp"].startswith("CalledProcessError"), res
    assert res["uid"] == "65534" or probe()["user_ns"], res  # nobody, not root
    assert not marker.exists() and not os.path.exists("/tmp/escaped")


def test_kernel_layers_refuse_every_write_outside_and_every_privileged_call(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.chmod(victim, 0o666)  # even a world-writable host file is out of reach: it is not in the jail
    secret = tmp_path / "expected_outputs.json"
    secret.write_text('{"answer": 42}')
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)
    res = attempts({
        "write_host_file": f"open({str(victim)!r}, 'w').write('x')",
        "read_host_dataset": f"open({str(secret)!r}).read()",
        "write_etc": "open('/etc/coxswain_escape', 'w').write('x')",
        "write_usr": "open('/usr/coxswain_escape', 'w').write('x')",
        "write_root": "open('/escape', 'w').write('x')",
        "mkfifo_outside": "os.mkfifo('/tmp/fifo')",
        "mknod_outside": "os.mknod('/tmp/node', 0o600 | 0o020000, os.makedev(1, 3))",
        "mknod_inside": "os.mknod('node', 0o600 | 0o020000, os.makedev(1, 3))",
        "fchmod_fd": "fd = os.open('/etc/hostname', os.O_RDONLY)\nos.fchmod(fd, 0o777)",
        "chmod_fd": "fd = os.open('/etc/hostname', os.O_RDONLY)\nos.chmod(fd, 0o777)",
        "utime_fd": "fd = os.open('/etc/hostname', os.O_RDONLY)\nos.utime(fd, (0, 0))",
        "setuid_root": "os.setuid(0)",
        "inet_socket": "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)",
        "new_user_namespace": "import subprocess\nsubprocess.run(['unshare', '-r', 'true'], check=True)",
        "mount": "import subprocess\nsubprocess.run(['mount', '-t', 'tmpfs', 'x', '/tmp'], check=True)",
        "ptrace_init": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                       "assert libc.ptrace(16, 1, 0, 0) == 0, ctypes.get_errno()",  # PTRACE_ATTACH
        "see_host_pids": f"assert os.path.exists('/proc/{os.getpid()}/cmdline') and {os.getpid()} != 1",
        "fill_disk": "open('big', 'wb').write(b'x' * (200 << 20))",
    }, tmp_path)
    for name, outcome in res.items():
        assert outcome != "ok", (name, outcome)
    assert "No such file" in res["write_host_file"] and "No such file" in res["read_host_dataset"], res
    assert "Read-only file system" in res["write_etc"] and "Read-only file system" in res["write_root"], res
    assert "Operation not permitted" in res["inet_socket"], res  # seccomp: only AF_UNIX sockets
    assert "Operation not permitted" in res["mknod_inside"] and "Operation not permitted" in res["setuid_root"], res
    assert victim.read_text() == "keep me" and stat.S_IMODE(victim.stat().st_mode) == 0o666
    assert not os.path.exists("/etc/coxswain_escape") and not os.path.exists("/usr/coxswain_escape")
    assert not os.path.exists("/escape") and not os.path.exists("/tmp/fifo")


def test_fork_bomb_after_the_bypass_is_capped_and_the_worker_survives(tmp_path):
    res = attempts({
        "bomb": "kids = 0\nfor _ in range(500):\n    if os.fork() == 0:\n        import time\n        time.sleep(60)\n"
                "        os._exit(0)\n    kids += 1\nRESULTS['kids'] = kids",
    }, tmp_path)
    assert res["bomb"].startswith("BlockingIOError") or res["bomb"].startswith("OSError"), res  # EAGAIN at the cap
    assert subprocess.run(["true"]).returncode == 0  # this process can still fork
    deadline = time.monotonic() + 5.0  # the kernel reaps a dead namespace's tasks asynchronously
    while True:
        leftover = subprocess.run(["pgrep", "-a", "-u", "65534"], capture_output=True, text=True).stdout.splitlines()
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert leftover == [], leftover  # the pid namespace took every sleeping child with it


FORGERIES = {
    # walk the frames for anything that reports results and call it (the old harness's emit)
    "frame_walk_emit": (
        "import sys, gc\n"
        "for o in gc.get_objects():\n"
        "    if callable(o) and getattr(o, '__name__', '') in ('emit', 'send', 'report'):\n"
        "        for i in range(10):\n"
        "            try:\n"
        "                o('test', i=i, ok=True)\n"
        "            except Exception:\n"
        "                pass\n"
    ),
    # rewrite the test list wherever it lives
    "rewrite_tests": (
        "import gc\n"
        "for o in gc.get_objects():\n"
        "    if type(o) is list and any(isinstance(x, str) and 'assert' in x for x in o):\n"
        "        o[:] = ['assert True'] * len(o)\n"
        "    if type(o) is dict and 'tests' in o:\n"
        "        o['tests'] = ['assert True']\n"
    ),
    # forged protocol frames and result lines on every fd
    "forged_frames": (
        "import os, json, struct\n"
        "for fd in range(0, 32):\n"
        "    for msg in ({'v': True}, {'kind': 'test', 'i': 0, 'ok': True}, {'kind': 'done'}):\n"
        "        b = json.dumps(msg).encode()\n"
        "        for data in (struct.pack('>I', len(b)) + b, b + b'\\n'):\n"
        "            try:\n"
        "                os.write(fd, data)\n"
        "            except OSError:\n"
        "                pass\n"
    ),
    # an answer that equals everything
    "always_equal": (
        "class Yes:\n"
        "    def __eq__(self, other):\n        return True\n"
        "    def __ne__(self, other):\n        return False\n"
        "    def __bool__(self):\n        return True\n"
    ),
    "early_exit": "import os\nos._exit(0)\n",
    "sys_exit": "import sys\nsys.exit(0)\n",
    "patch_builtins": "import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n",
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_results_score_zero(name):
    code = FORGERIES[name] + "\ndef f(x):\n    return Yes() if 'Yes' in globals() else x + 100\n"
    gt = {"test_list": ["assert False", "assert f(1) == 2", "assert f(2) == 4"]}
    out = code_score(f"```python\n{code}\n```", gt)
    assert out["score"] == 0.0 and out["pass_rate"] == 0.0, out
    # call mode: the comparison happens in the referee on decoded builtins
    r = run_code(code, mode="call", fn_name="f", inputs=[[1], [2]], outputs=[2, 4], limits=LIM)
    assert r.passed == 0 and r.status != "passed", (r.status, r.reason)
