"""Resume verifies before it reads: in the real loop, a latest checkpoint with one flipped byte in an
actor shard is skipped with one warning and the run resumes from the step before (training the steps
after it again); an explicit resume_from_path to it stops the CLI with one line naming the file."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny import tiny_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # one Ray cluster for both in-process runs
BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "data.max_response_length=6", f"actor_rollout_ref.model.path={TINY}", "trainer.logger=[console]",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=1"]


def test_a_corrupt_latest_checkpoint_falls_back_and_an_explicit_one_stops(tmp_path, capsys, monkeypatch):
    from trainer.main import train

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    run_dir = tmp_path / "run"
    train(tiny_config(BASE + [f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=3"]))
    shard = max((p for p in (run_dir / "global_step_3" / "actor").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:  # one bit of the largest actor shard
        f.seek(shard.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    capsys.readouterr()
    out = train(tiny_config(BASE + [f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=4"]))
    text = capsys.readouterr().out
    assert f"warning: not resuming from {run_dir / 'global_step_3'}" in text and shard.name in text
    assert f"resumed from {run_dir / 'global_step_2'} at step 2" in text
    assert [h["step"] for h in out["history"]] == [1, 2, 3, 4]  # steps 3 and 4 trained after the resume
    # an explicit path to a bad checkpoint: one line, exit 2, no traceback
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    args = ["--config", "recipes/cpu/tiny_grpo.yaml", "--config", "recipes/cpu/fp32.yaml", *BASE, f"trainer.default_local_dir={tmp_path / 'other'}",
            "trainer.total_training_steps=4", "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={tmp_path / 'copy'}"]
    import shutil

    shutil.copytree(run_dir / "global_step_4", tmp_path / "copy")
    (tmp_path / "copy" / "driver_state.pt").write_bytes(b"tampered")
    p = subprocess.run([sys.executable, "-m", "trainer.main", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 2, p.stderr[-2000:]
    err = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert len(err) == 1 and "driver_state.pt does not match" in err[0] and "resume_from_path" in err[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
