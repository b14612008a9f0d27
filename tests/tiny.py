"""The tiny CPU job's config for tests: ``recipes/cpu/tiny_grpo.yaml`` (the settings the shipped recipe
uses on top of verl's defaults) plus a test's own overrides."""

import json
import os
import subprocess
import sys

from trainer.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(ROOT, "recipes", "cpu", "tiny_grpo.yaml")


def tiny_config(overrides=(), **kw):
    return load_config(["--config", TINY_YAML, *overrides], **kw)


# A driver in its own process (and session), for tests that SIGKILL it.
DRIVER_SCRIPT = """
import json, sys
from trainer.config import load_config
from trainer.main import train
out = train(load_config(["--config", "recipes/cpu/tiny_grpo.yaml", *json.loads(sys.argv[1])]))
"""


def start_driver(args, env, log) -> subprocess.Popen:
    """``trainer.main.train`` on the tiny recipe plus ``args``, in a new process group."""
    return subprocess.Popen([sys.executable, "-c", DRIVER_SCRIPT, json.dumps(args)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def checkpoint_history(run_dir) -> list:
    """The metrics history in the newest checkpoint of ``run_dir``."""
    from trainer.checkpoint import CheckpointManager, load_driver_state

    return load_driver_state(CheckpointManager(str(run_dir)).find_latest())["history"]
