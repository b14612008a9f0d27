"""No process outlives a SIGKILLed driver: the scorer pool (fork server and workers, which watch their
parent), the Ray cluster it embedded and everything else it started are gone a few seconds later."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys
from trainer.config import load_config
from trainer.main import train
train(load_config(["--config", "recipes/cpu/tiny_grpo.yaml", "--config", "recipes/cpu/fp32.yaml", *json.loads(sys.argv[1])]))
"""


def test_sigkill_of_the_driver_leaves_no_process_behind(tmp_path):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db", PYTHONUNBUFFERED="1")
    args = [f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.total_training_steps=200", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.logger=[console]", "reward_model.num_workers=2"]
    log = open(tmp_path / "driver.log", "w")
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, json.dumps(args)], cwd=ROOT, env=env, stdout=log,
                         stderr=subprocess.STDOUT)
    try:
        t0 = time.time()
        while "step 2/200" not in (tmp_path / "driver.log").read_text():
            assert p.poll() is None and time.time() - t0 < 300, (tmp_path / "driver.log").read_text()[-3000:]
            time.sleep(0.2)
        family = psutil.Process(p.pid).children(recursive=True)
        names = {c.pid: " ".join(c.cmdline())[:120] for c in family}
        assert any("forkserver" in n or "multiprocessing" in n for n in names.values()), names  # the scorer pool is up
        os.kill(p.pid, signal.SIGKILL)  # the driver only: its children must notice on their own
        p.wait()

        def alive(procs):
            return [c for c in procs if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]

        ours = [c for c in family if not (names[c.pid].startswith("ray::") or "/ray/" in names[c.pid])]
        assert ours, names
        t0 = time.time()
        while alive(ours) and time.time() - t0 < 10:  # the scorer pool: within a second or two
            time.sleep(0.2)
        assert not alive(ours), {c.pid: names[c.pid] for c in alive(ours)}
        # Ray's own processes follow its raylet: its agents notice within about a minute
        while alive(family) and time.time() - t0 < 150:
            time.sleep(1)
        assert not alive(family), {c.pid: names[c.pid] for c in alive(family)}
    finally:
        if p.poll() is None:
            p.kill()
