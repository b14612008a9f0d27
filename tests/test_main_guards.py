"""The CLI refuses options it accepts in the config but cannot run yet, naming each one."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_unsupported_options_are_refused_with_reasons(tmp_path):
    p = subprocess.run([sys.executable, "-m", "trainer.main", f"trainer.default_local_dir={tmp_path}",
                        "actor_rollout_ref.actor.strategy=deepspeed", "reward_model.enable=true"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 2
    assert "strategy=deepspeed" in p.stderr and "reward_model.enable=true" in p.stderr


def test_missing_model_dir_is_a_clear_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "trainer.main", f"trainer.default_local_dir={tmp_path}",
                        f"actor_rollout_ref.model.path={tmp_path}/nope"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 2 and "is not a Hugging Face model directory" in p.stderr
