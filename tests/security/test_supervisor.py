"""The orphan supervisor (``trainer.orphans.supervised``): the command it wraps dies with whoever started it,
however that goes. Each case starts a real starter process, a real wrapper and a real command (a sleeping
Python that writes its pid), kills one of them, and checks the command's pid is gone within a few seconds.

* the starter SIGKILLed while the wrapper runs (the wrapper sees its parent change);
* the starter gone before the wrapper first looked (its pid is the wrapper's argument, not ``getppid()``
  read too late, which would be init's);
* the wrapper itself SIGKILLed, as a clean-up that kills by pid does (``PR_SET_PDEATHSIG`` in the command):
  before, the command was reparented to init and lived on.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from trainer.orphans import supervised

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"
# the starter: starts the supervised command, prints the wrapper's pid, then waits (or exits at once)
STARTER = """
import json, subprocess, sys, time, os
from trainer.orphans import supervised
p = subprocess.Popen(supervised([sys.executable, "-c", sys.argv[1], sys.argv[2]]), start_new_session=True)
print(json.dumps({"wrapper": p.pid}), flush=True)
if sys.argv[3] == "exit":
    os._exit(0)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _command_pid(pid_file: Path, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the supervised command never started"
        time.sleep(0.05)
    return int(pid_file.read_text())


def _gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)  # leave nothing behind, then report
            return False
        time.sleep(0.05)
    return True


def _start(tmp_path: Path, mode: str):
    pid_file = tmp_path / f"{mode}.pid"
    starter = subprocess.Popen([sys.executable, "-c", STARTER, COMMAND, str(pid_file), mode], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    wrapper = json.loads(starter.stdout.readline())["wrapper"]
    return starter, wrapper, pid_file


def test_the_command_dies_with_its_starter(tmp_path):
    starter, wrapper, pid_file = _start(tmp_path, "wait")
    cmd = _command_pid(pid_file)
    assert _alive(cmd) and _alive(wrapper)
    os.kill(starter.pid, signal.SIGKILL)
    starter.wait()
    assert _gone_within(cmd, 5.0), "the command outlived its SIGKILLed starter"
    assert _gone_within(wrapper, 5.0)


def test_a_starter_gone_before_the_wrapper_looked_is_noticed(tmp_path):
    starter, wrapper, pid_file = _start(tmp_path, "exit")
    starter.wait()
    assert starter.returncode == 0
    assert _gone_within(wrapper, 5.0), "the starter exited before the wrapper first looked, and the wrapper lived on"
    time.sleep(0.5)  # a command that got as far as writing its pid is gone as well
    if pid_file.exists() and pid_file.read_text():
        assert _gone_within(int(pid_file.read_text()), 3.0), "the command lived on"


def test_the_command_dies_with_its_wrapper(tmp_path):
    starter, wrapper, pid_file = _start(tmp_path, "wait")
    cmd = _command_pid(pid_file)
    try:
        os.kill(wrapper, signal.SIGKILL)  # a clean-up that kills by pid, the wrapper first
        assert _gone_within(cmd, 3.0), "the command outlived its SIGKILLed wrapper (reparented to init)"
    finally:
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait()


@pytest.mark.parametrize("argv", [["true"], [sys.executable, "-c", "import sys; sys.exit(3)"]])
def test_the_wrapper_exits_with_the_command(argv):
    assert subprocess.run(supervised(argv)).returncode == (0 if argv == ["true"] else 3)


# ---- the run's marker and its reaper (trainer.orphans.start_reaper) -------------------------------------
DRIVER = """
import json, os, subprocess, sys, time
from trainer.orphans import RUN_MARKER, start_reaper
from trainer.workers.group import init_ray
marker = start_reaper()
if sys.argv[1] == "ray":
    init_ray(num_cpus=1)  # an embedded cluster: its daemons inherit the marker
else:  # a detached process that watches nothing and ignores SIGTERM: only the reaper can end it
    subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "time.sleep(300)"], start_new_session=True)
print(json.dumps({"marker": marker}), flush=True)
time.sleep(300)
"""


def _marked(marker: str) -> dict[int, str]:
    out = {}
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("COXSWAIN_RUN") == marker and p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = " ".join(p.cmdline())[:100] or p.name()
        except psutil.Error:
            continue
    return out


@pytest.mark.parametrize("what", ["detached", pytest.param("ray", marks=pytest.mark.slow)])
def test_nothing_a_sigkilled_driver_started_outlives_it(tmp_path, what):
    """``detached``: a process in its own session that ignores SIGTERM (fails without the reaper: it lives on).
    ``ray``: the driver's embedded Ray cluster (GCS, raylet, the dashboard and runtime-env agents, which an
    adversarial check saw outlive a SIGKILLed driver; on this machine they also end within 10 s without the
    reaper, so this case guards, it does not prove the fix). Each process is found by the run's marker in its
    environment, not by name."""
    drv = subprocess.Popen([sys.executable, "-c", DRIVER, what], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        line = drv.stdout.readline()
        while line and not line.startswith('{"marker"'):  # init_ray prints a start-up line first
            line = drv.stdout.readline()
        marker = json.loads(line)["marker"]
        assert marker.startswith(f"{drv.pid}-")
        deadline = time.monotonic() + 30
        while len(started := _marked(marker)) < (4 if what == "ray" else 1):
            assert time.monotonic() < deadline, started
            time.sleep(0.2)
        if what == "ray":
            assert any("raylet" in c for c in started.values()) and any("gcs_server" in c for c in started.values())
        os.kill(drv.pid, signal.SIGKILL)
        drv.wait()
        deadline = time.monotonic() + 10
        while (left := _marked(marker)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"alive 10 s after the driver's SIGKILL: {left}"
    finally:
        if drv.poll() is None:
            drv.kill()
