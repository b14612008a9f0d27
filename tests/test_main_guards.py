"""The CLI refuses options it accepts in the config but cannot run, naming each one: features not built
at load time (``--print-config`` refuses them too), this machine's hardware only when a run starts."""

import subprocess
import sys
from pathlib import Path

import torch

from tests.support.tiny import TINY_ARGS

ROOT = Path(__file__).resolve().parents[1]


def _main(*args, tmp_path):
    return subprocess.run([sys.executable, "-m", "trainer.main", *TINY_ARGS,
                           f"trainer.default_local_dir={tmp_path}", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_unsupported_options_are_refused_with_reasons(tmp_path):
    for dry in ([], ["--print-config"]):  # a dry run refuses exactly what a run refuses
        p = _main(*dry, "reward_model.enable_resource_pool=true", "reward_model.load_weight=false", tmp_path=tmp_path)
        assert p.returncode == 2
        assert "'reward_model.enable_resource_pool'" in p.stderr and "'reward_model.load_weight'" in p.stderr
        assert "2 problems" in p.stderr and "a separate resource pool is not built" in p.stderr


def test_gpu_recipe_resolves_on_a_cpu_node_and_refuses_to_run(tmp_path):
    gpu = ["trainer.device=cuda", "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.dtype=bfloat16"]
    p = _main("--print-config", *gpu, tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "device: cuda" in p.stdout
    if not torch.cuda.is_available():
        p = _main(*gpu, tmp_path=tmp_path)
        assert p.returncode == 2 and "no CUDA GPU" in p.stderr and "rollout.name=sglang needs CUDA" in p.stderr


def test_missing_model_dir_is_a_clear_error(tmp_path):
    p = _main(f"actor_rollout_ref.model.path={tmp_path}/nope", tmp_path=tmp_path)  # not there: the path check's line
    assert p.returncode == 2 and f"actor_rollout_ref.model.path='{tmp_path}/nope' does not exist on this machine" in p.stderr
    p = _main(f"actor_rollout_ref.model.path={tmp_path}", tmp_path=tmp_path)  # there, but no checkpoint in it
    assert p.returncode == 2 and "is not a Hugging Face model directory" in p.stderr
