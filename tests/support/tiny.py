"""The tiny CPU job's config for tests: ``recipes/cpu/tiny_grpo.yaml`` (the settings the shipped recipe
uses on top of verl's defaults) plus a test's own overrides."""

import json
import os
import subprocess
import sys

import torch

from trainer.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_YAML = os.path.join(ROOT, "recipes", "cpu", "tiny_grpo.yaml")
# the recipe keeps verl's bf16 defaults; the tests' references are fp32 (recipes/cpu/fp32.yaml)
FP32_YAML = os.path.join(ROOT, "recipes", "cpu", "fp32.yaml")
TINY_ARGS = ["--config", TINY_YAML, "--config", FP32_YAML]


def tiny_config(overrides=(), **kw):
    return load_config([*TINY_ARGS, *overrides], **kw)


# A driver in its own process (and session), for tests that SIGKILL it.
DRIVER_SCRIPT = """
import json, sys
from trainer.config import load_config
from trainer.main import train
out = train(load_config(["--config", "recipes/cpu/tiny_grpo.yaml", "--config", "recipes/cpu/fp32.yaml", *json.loads(sys.argv[1])]))
"""


def start_driver(args, env, log) -> subprocess.Popen:
    """``trainer.main.train`` on the tiny recipe plus ``args``, in a new process group."""
    return subprocess.Popen([sys.executable, "-c", DRIVER_SCRIPT, json.dumps(args)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_cli(args, env, log) -> subprocess.Popen:
    """``python -m trainer.main`` with a script's own arguments (no tiny recipe under them), in a new process group."""
    return subprocess.Popen([sys.executable, "-m", "trainer.main", *args], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def checkpoint_history(run_dir) -> list:
    """The metrics history in the newest checkpoint of ``run_dir``."""
    from trainer.checkpoint import CheckpointManager, load_driver_state

    return load_driver_state(CheckpointManager(str(run_dir)).find_latest())["history"]


@torch.no_grad()
def rollout_logp_under(model_dir: str, batch) -> torch.Tensor:
    """log p(response token) under the HF model at ``model_dir``, temperature 1, on the batch's grid."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    P = batch.prompt_width
    out = torch.zeros(batch.responses.shape)
    for i in range(batch.num_samples):
        real = batch.attention_mask[i].bool()
        ids = batch.input_ids[i][real]
        n_p = int(real[:P].sum())
        logp = torch.log_softmax(m(ids[None]).logits[0].float(), -1)
        r = ids[n_p:]
        out[i, :len(r)] = logp[n_p - 1:-1].gather(-1, r[:, None])[:, 0]
    return out
