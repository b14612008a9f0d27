import os
import sys
import time
import types
import uuid

import psutil
import pytest
import torch

from trainer.orphans import REAPER
from trainer.workers.group import keep_embedded_ray

# ``tests`` is this directory. A package installed into site-packages may ship its own top-level ``tests``
# package (verl's wheel does, and requirements-peers.txt installs verl), and a regular package found
# anywhere on sys.path beats this namespace directory; pin the name to this directory instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
if getattr(sys.modules.get("tests"), "__path__", [None])[0] != _HERE:
    _pkg = types.ModuleType("tests")
    _pkg.__path__ = [_HERE]
    sys.modules["tests"] = _pkg


# The longest modules on a 2-core machine, longest first (the order of `--durations=40` of a `-n 2` run; see the
# #43 note). Under pytest-xdist (`--dist loadfile --no-loadscope-reorder`) the controller hands out modules in the
# workers' collection order, so these go first and the short ones fill the tail; in collection order the 8-minute
# SGLang suite and the multinode module (collected last) ran while the other worker sat idle.
LONGEST_FIRST = (
    "tests/rollout/test_sglang_cpu_suite.py",
    "tests/workers/test_multinode.py",
    "tests/strategies/test_deepspeed_loop.py",
    "tests/rollout/test_server_mode.py",
    "tests/test_async.py",
    "tests/test_async_fully.py",
    "tests/test_controller.py",
    "tests/test_lora_rl.py",
    "tests/strategies/test_fsdp_loop.py",
    "tests/strategies/test_parallel_loop.py",
    "tests/megatron_bridge/test_deepspeed_parity.py",
    "tests/test_bench_adca.py",
    "tests/test_gpu_check.py",
    "tests/launch/test_slurm.py",
    "tests/rewards/test_reward_model.py",
    # last of these: well after the SGLang suite above has ended, so that two sets of SGLang servers do not start
    # together (failures of the SGLang fleets were seen with two up at once: dropped connections; stop 58's CI lost
    # a fleet with one up, to health checks that took busy servers for dead, since fixed in trainer/rollout/fleet.py)
    "tests/rollout/test_fleet_sglang_servers.py",
)


def _longest_first(config, items) -> None:
    """Under xdist, in the workers (the controller hands out modules in their collection order; a serial run
    keeps its order): the modules above first, then the other modules with a `slow` test, then the rest; each
    module's own order is kept (a stable sort)."""
    if not _xdist_worker(config):
        return  # serial; and xdist's controller does not collect (an xdist worker's own numprocesses is None)
    root = str(config.rootpath)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    slow_files = {item.path for item in items if "slow" in item.keywords}

    def key(item):
        rel = os.path.relpath(str(item.path), root)
        return (rank.get(rel, len(rank)), 0 if item.path in slow_files else 1)

    items.sort(key=key)


def pytest_collection_modifyitems(config, items):
    _longest_first(config, items)
    # GPU tests are visible in the report as skipped with a reason, never silently dropped.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on a lent device: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def shared_ray():
    """One embedded Ray cluster for a module's in-process runs: a run's end leaves it up for the next
    (trainer.workers.group.keep_embedded_ray; a fresh cluster costs about 5 s of a 10 s tiny run), and it is
    stopped when the module ends. Its workers see the environment of the cluster's start: a test that gives
    the workers a new variable (PYTHONPATH for a plug-in) starts its own cluster instead."""
    keep_embedded_ray(True)
    yield
    keep_embedded_ray(False)
    import ray  # only to stop the module's cluster

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# ---- nothing a test starts outlives the suite ---------------------------------------------------------
# Every process a test starts inherits this marker (tests pass os.environ along, or a copy of it); at the
# end of the session any such process that no longer descends from this one (reparented to init: nothing
# will end it when the suite does) fails the suite, named, after a grace period for processes on their way
# out. Descendants of this process (multiprocessing's fork server, a Ray cluster left on) end with it, each
# watching its parent. A nested pytest (the SGLang venv's suite) marks and checks its own.
SESSION_MARKER = "COXSWAIN_TEST_SESSION"
STRAY_GRACE_S = float(os.environ.get("COXSWAIN_STRAY_GRACE_S", "20"))


# Under pytest-xdist the workers keep the controller's marker (they inherit its environment) and only the
# controller checks, after every worker has ended: a worker's leftovers are then reparented away from it.
def _xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    if _xdist_worker(config) and os.environ.get(SESSION_MARKER):
        return
    os.environ[SESSION_MARKER] = uuid.uuid4().hex


def _marked(marker: str) -> list[psutil.Process]:
    me, out = os.getpid(), []
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            if (p.environ().get(SESSION_MARKER) == marker and p.status() != psutil.STATUS_ZOMBIE
                    and REAPER not in p.cmdline()  # a driver's reaper waits for this process to end, by design
                    and me not in {a.pid for a in p.parents()}):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {p.pid}"


def pytest_sessionfinish(session, exitstatus):
    marker = os.environ.get(SESSION_MARKER)
    if not marker:
        return
    try:  # an embedded Ray cluster of this process (a test that left ray.init() on) is the suite's to stop
        import ray  # only to stop a cluster the tests left running in this process

        if ray.is_initialized():
            ray.shutdown()
    except ImportError:
        pass
    if _xdist_worker(session.config):
        return  # the controller checks
    deadline = time.monotonic() + STRAY_GRACE_S
    strays = _marked(marker)
    while strays and time.monotonic() < deadline:
        time.sleep(0.5)
        strays = _marked(marker)
    if strays:
        names = "\n  ".join(_describe(p) for p in strays)
        session.config.stray_report = f"{len(strays)} process(es) started by the tests outlived the suite (orphaned):\n  {names}"
        for p in strays:  # report, then leave nothing behind on the machine
            try:
                p.kill()
            except psutil.Error:
                pass
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    report = getattr(config, "stray_report", None)
    if report:
        terminalreporter.section("processes left behind", sep="=", red=True)
        terminalreporter.write_line(report)
