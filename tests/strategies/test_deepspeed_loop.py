"""The DeepSpeed strategy in the training loop, on a real local Ray cluster with two ranks.

* A DeepSpeed ZeRO-2 actor (hybrid engine, colocated) against the Megatron actor on the same seed:
  the first step samples the same batch (the same engine and weights) and its update gives the same
  loss and gradient norm; the sync into the engines is checksum-verified.
* Mixed strategies: a Megatron actor with a DeepSpeed ZeRO-3 reference (KL loss) and a DeepSpeed ZeRO-1
  critic (GAE), checkpointed every step; a resume from step 1 reproduces step 2 exactly (metrics and the
  exported weights), through DeepSpeed's own checkpoint format.
"""

import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.support.tiny import tiny_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")
pytestmark = pytest.mark.slow

BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=6",
        f"actor_rollout_ref.model.path={TINY}", "trainer.logger=[mlflow]", "data.val_batch_size=64",
        "trainer.test_freq=-1", "trainer.val_before_train=false"]
KEYS = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean", "actor/lr")


def run(tmp_path, name, *overrides):
    from trainer.main import train

    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    return train(tiny_config(BASE + [f"trainer.default_local_dir={tmp_path / name}", *overrides]))


@pytest.fixture(scope="module", autouse=True)
def _ray():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


def test_deepspeed_actor_trains_like_the_megatron_actor(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    mg = run(tmp_path, "mg", "trainer.total_training_steps=1")["history"][-1]
    ds = run(tmp_path, "ds", "trainer.total_training_steps=1", "actor_rollout_ref.actor.strategy=deepspeed",
             "actor_rollout_ref.actor.deepspeed_config.zero_stage=2")["history"][-1]
    for k in KEYS:
        assert ds[k] == pytest.approx(mg[k], rel=1e-4, abs=1e-7), (k, ds[k], mg[k])
    assert ds["actor/grad_norm"] > 0 and ds["sync/verified"] == 1.0
    # the HF export of the DeepSpeed actor loads as a plain HF checkpoint with the model's names
    exported = load_file(str(tmp_path / "ds" / "hf_export" / "model.safetensors"))
    assert "model.embed_tokens.weight" in exported and "model.layers.0.self_attn.q_proj.weight" in exported


def test_mixed_strategies_and_exact_resume_through_deepspeed_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    mixed = ["algorithm.adv_estimator=gae", "critic.strategy=deepspeed", "critic.deepspeed_config.zero_stage=1",
             "critic.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.use_kl_loss=true",
             "actor_rollout_ref.ref.strategy=deepspeed", "actor_rollout_ref.ref.deepspeed_config.zero_stage=3",
             "trainer.save_freq=1", "trainer.total_training_steps=2"]
    full = run(tmp_path, "full", *mixed)["history"]
    assert [h["step"] for h in full] == [1, 2]
    assert full[-1]["critic/vf_loss"] > 0 and "actor/kl_loss" in full[-1]
    assert os.path.isdir(tmp_path / "full" / "global_step_1" / "critic" / "deepspeed")
    # resume from step 1 in a copy of the run directory without step 2
    shutil.copytree(tmp_path / "full", tmp_path / "resumed", ignore=shutil.ignore_patterns("global_step_2", "hf_export"))
    (tmp_path / "resumed" / "latest_checkpointed_iteration.txt").write_text("1")
    again = run(tmp_path, "resumed", *mixed, "trainer.resume_mode=auto")["history"]
    step2 = next(h for h in again if h["step"] == 2)
    for k in KEYS + ("critic/vf_loss", "critic/grad_norm", "actor/kl_loss"):
        assert step2[k] == pytest.approx(full[-1][k], rel=1e-6, abs=1e-9), (k, step2[k], full[-1][k])
    a = load_file(str(tmp_path / "full" / "hf_export" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "hf_export" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_sigkill_mid_step_then_resume_is_identical_with_a_deepspeed_actor(tmp_path):
    """A ZeRO-3 DeepSpeed actor (hybrid engine) with a megatron reference and a ZeRO-2 DeepSpeed critic:
    the driver is SIGKILLed inside step 2, and the resumed run's history and weights equal an
    uninterrupted run's."""
    import signal
    import time

    import torch

    from tests.support.tiny import checkpoint_history, start_driver

    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db", PYTHONUNBUFFERED="1")
    common = BASE + ["trainer.total_training_steps=3", "trainer.save_freq=1", "actor_rollout_ref.actor.strategy=deepspeed",
                     "actor_rollout_ref.actor.deepspeed_config.zero_stage=3", "actor_rollout_ref.actor.use_kl_loss=true",
                     "algorithm.adv_estimator=gae", "critic.strategy=deepspeed", "critic.deepspeed_config.zero_stage=2",
                     "critic.ppo_micro_batch_size_per_gpu=8"]
    ref_dir, cut_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    with open(tmp_path / "ref.log", "w") as log:
        assert start_driver(common + [f"trainer.default_local_dir={ref_dir}"], env, log).wait(600) == 0, \
            (tmp_path / "ref.log").read_text()[-3000:]
    with open(tmp_path / "cut.log", "w") as log:
        p = start_driver(common + [f"trainer.default_local_dir={cut_dir}"], env, log)
        latest = cut_dir / "latest_checkpointed_iteration.txt"
        t0 = time.time()
        while not (latest.exists() and latest.read_text().strip() == "1"):
            assert p.poll() is None and time.time() - t0 < 600, (tmp_path / "cut.log").read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGKILL)  # the driver is now inside step 2
        p.wait()
    with open(tmp_path / "resume.log", "w") as log:
        assert start_driver(common + [f"trainer.default_local_dir={cut_dir}"], env, log).wait(600) == 0
    assert "resumed from" in (tmp_path / "resume.log").read_text()
    volatile = ("timing_s/", "timing_per_token_ms/", "perf/", "sync/seconds", "sync/gbps", "reward/time_s")
    a = [{k: v for k, v in h.items() if not k.startswith(volatile)} for h in checkpoint_history(ref_dir)]
    b = [{k: v for k, v in h.items() if not k.startswith(volatile)} for h in checkpoint_history(cut_dir)]
    assert [h["step"] for h in a] == [1, 2, 3] == [h["step"] for h in b]
    assert a == b and a[-1]["actor/kl_loss"] >= 0 and a[-1]["critic/vf_loss"] > 0
    wa = load_file(str(ref_dir / "hf_export" / "model.safetensors"))
    wb = load_file(str(cut_dir / "hf_export" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
