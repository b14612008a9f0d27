"""The suite checks itself: a process a test starts and leaves running fails the suite, named (the session
marker in ``tests/conftest.py``). Checked with a real nested pytest whose one test leaves an orphaned sleeper
behind (reparented to init) and returns: the nested suite must fail, name the sleeper's command, and kill it;
the same suite with the sleeper stopped passes."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

CONFTEST = Path(__file__).resolve().parent / "conftest.py"

TEST = textwrap.dedent('''
    import os, signal, subprocess, sys
    from pathlib import Path

    SLEEPER = "import time; time.sleep(300)  # hygiene-sleeper"
    # started through an intermediate process that exits at once: the sleeper is orphaned (reparented to
    # init), as a server whose supervisor was killed was
    LAUNCH = ("import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
              "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")

    def test_starts_a_sleeper(tmp_path):
        out = subprocess.run([sys.executable, "-c", LAUNCH, SLEEPER], capture_output=True, text=True, check=True)
        pid = int(out.stdout)
        Path(__file__).with_name("sleeper.pid").write_text(str(pid))
        if {stop}:
            os.kill(pid, signal.SIGKILL)
''')


def _nested(tmp_path: Path, stop: bool, *args: str) -> tuple[subprocess.CompletedProcess, int]:
    d = tmp_path / ("stopped" if stop else "left")
    d.mkdir()
    (d / "conftest.py").write_text(CONFTEST.read_text())
    (d / "test_one.py").write_text(TEST.format(stop=stop))
    env = {k: v for k, v in os.environ.items() if k != "COXSWAIN_TEST_SESSION"}
    env["COXSWAIN_STRAY_GRACE_S"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(CONFTEST.parents[1]), env.get("PYTHONPATH", "")])  # this checkout's trainer
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(d)], cwd=d,
                         env=env, capture_output=True, text=True, timeout=120)
    return out, int((d / "sleeper.pid").read_text())


@pytest.mark.parametrize("args", [(), ("-n", "2", "--dist", "loadfile")], ids=["serial", "xdist"])
def test_a_process_left_running_fails_the_suite_and_is_named(tmp_path, args):
    """Also under pytest-xdist (CI's command): the worker that ran the test ends, its orphan stays, and the
    controller, which checks after every worker has ended, names it."""
    out, pid = _nested(tmp_path, False, *args)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "1 passed" in text and "outlived the suite" in text and "hygiene-sleeper" in text and f"pid {pid}" in text
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # and it is gone


def test_a_clean_suite_passes(tmp_path):
    out, _ = _nested(tmp_path, stop=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "outlived the suite" not in out.stdout


def test_the_longest_first_list_names_modules_that_exist():
    """tests/conftest.py::LONGEST_FIRST orders modules by path: a renamed or moved module would silently fall
    back to collection order (and the xdist tail it exists to avoid), so every name must be a test module."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("_suite_conftest", root / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    names = conftest.LONGEST_FIRST
    assert len(set(names)) == len(names)
    missing = [n for n in names if not (root / n).is_file()]
    assert not missing, f"LONGEST_FIRST names modules that do not exist: {missing}"
