"""No process outlives a SIGKILLed driver: the scorer pool (fork server and workers, which watch their
parent), the Ray cluster it embedded and everything else it started are gone within 10 s, whichever phase the
run was in."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from trainer.orphans import FAULT_HOLD, HOLD_POINTS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys
from trainer.config import load_config
from trainer.main import train
train(load_config(["--config", "recipes/cpu/tiny_grpo.yaml", "--config", "recipes/cpu/fp32.yaml", *json.loads(sys.argv[1])]))
"""


@pytest.mark.parametrize("point", HOLD_POINTS)
def test_sigkill_of_the_driver_leaves_no_process_behind(tmp_path, point):
    """SIGKILL at five points of a run, each while a worker is busy in that phase (held there by the
    COXSWAIN_FAULT_HOLD test hook): start-up, rollout, update, weight sync, checkpoint save. 10 s later no
    process the run started is left: the scorer pool, the workers, Ray's raylet, GCS and agents."""
    hold = tmp_path / "held"
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db", PYTHONUNBUFFERED="1",
               **{FAULT_HOLD: f"{point}:{hold}"})
    args = [f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.total_training_steps=200", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.logger=[console]", "reward_model.num_workers=2",
            "trainer.save_freq=1"]
    log = open(tmp_path / "driver.log", "w")
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, json.dumps(args)], cwd=ROOT, env=env, stdout=log,
                         stderr=subprocess.STDOUT)
    try:
        t0 = time.time()
        while not hold.exists():
            assert p.poll() is None and time.time() - t0 < 300, (tmp_path / "driver.log").read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(0.5)  # the other ranks reach the point too
        family = psutil.Process(p.pid).children(recursive=True)
        names = {c.pid: " ".join(c.cmdline())[:120] for c in family}
        held = {int(line.split()[1]) for line in hold.read_text().splitlines()}
        assert held <= set(names), (held, names)  # the held workers are the run's
        os.kill(p.pid, signal.SIGKILL)  # the driver only: the rest must go on their own
        p.wait()

        def alive(procs):
            return [c for c in procs if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]

        t0 = time.time()
        while alive(family) and time.time() - t0 < 10:
            time.sleep(0.2)
        assert not alive(family), {c.pid: names[c.pid] for c in alive(family)}
    finally:
        if p.poll() is None:
            p.kill()
