"""The DeepSpeed strategy in the training loop, on a real local Ray cluster with two ranks (and an FSDP2 actor
beside a megatron reference, against the same megatron run).

* A DeepSpeed ZeRO-2 actor (hybrid engine, colocated) against the Megatron actor on the same seed:
  the first step samples the same batch (the same engine and weights) and its update gives the same
  loss and gradient norm; the sync into the engines is checksum-verified.
  With KL loss, the DeepSpeed actor's reference is a ZeRO-3 DeepSpeed one, the Megatron actor's a Megatron one.
* A ZeRO-3 DeepSpeed actor (KL loss) and a ZeRO-1 DeepSpeed critic (GAE), checkpointed every step in
  DeepSpeed's own format: a run resumed from step 1's checkpoint takes the uninterrupted run's step 2, to the
  same metrics and exported weights.
"""

import os
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
def _ray(shared_ray):
    yield  # one embedded Ray cluster for the module's runs (tests/conftest.py: shared_ray)


def test_deepspeed_actor_trains_like_the_megatron_actor(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    # the KL loss against the reference: a megatron one for the megatron actor, a ZeRO-3 DeepSpeed one for the
    # DeepSpeed actor (the same initial weights, so the same KL)
    kl = "actor_rollout_ref.actor.use_kl_loss=true"
    mg = run(tmp_path, "mg", "trainer.total_training_steps=1", kl)["history"][-1]
    ds = run(tmp_path, "ds", "trainer.total_training_steps=1", kl, "actor_rollout_ref.actor.strategy=deepspeed",
             "actor_rollout_ref.actor.deepspeed_config.zero_stage=2", "actor_rollout_ref.ref.strategy=deepspeed",
             "actor_rollout_ref.ref.deepspeed_config.zero_stage=3")["history"][-1]
    for k in KEYS + ("actor/kl_loss",):
        assert ds[k] == pytest.approx(mg[k], rel=1e-4, abs=1e-7), (k, ds[k], mg[k])
    assert ds["actor/grad_norm"] > 0 and ds["sync/verified"] == 1.0
    # mixing strategies: an FSDP2 actor (Ulysses SP=2, packed rows) against the megatron reference trains alike too
    fs = run(tmp_path, "fs", "trainer.total_training_steps=1", kl, "actor_rollout_ref.actor.strategy=fsdp2",
             "actor_rollout_ref.actor.fsdp_config.dtype=fp32", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
             "actor_rollout_ref.model.use_remove_padding=true")["history"][-1]
    for k in KEYS + ("actor/kl_loss",):
        assert fs[k] == pytest.approx(mg[k], rel=1e-4, abs=1e-7), (k, fs[k], mg[k])
    assert fs["sync/verified"] == 1.0 and fs["sync/shared_memory"] == 1.0
    # the HF export of the DeepSpeed actor loads as a plain HF checkpoint with the model's names
    exported = load_file(str(tmp_path / "ds" / "hf_export" / "model.safetensors"))
    assert "model.embed_tokens.weight" in exported and "model.layers.0.self_attn.q_proj.weight" in exported


def test_resume_from_step_1_is_identical_with_deepspeed_roles(tmp_path):
    """A ZeRO-3 DeepSpeed actor (hybrid engine, KL loss against a megatron reference) and a ZeRO-1 DeepSpeed critic
    (GAE), checkpointed every step in DeepSpeed's own format: a run resumed from the uninterrupted run's step-1
    checkpoint (``trainer.resume_mode=resume_path``) takes the same step 2: the same history (actor, critic and KL
    metrics) and exported weights, bit for bit. What is the strategy's own is its checkpoint's save and load; the
    SIGKILLed driver's resume is strategy-independent and is tests/test_controller.py's (and test_lora_rl's,
    test_async's, test_multinode's): a killed driver here cost the suite two more driver start-ups."""
    import torch

    from tests.support.tiny import stable_history

    common = ["trainer.total_training_steps=2", "trainer.save_freq=1", "actor_rollout_ref.actor.strategy=deepspeed",
              "actor_rollout_ref.actor.deepspeed_config.zero_stage=3", "actor_rollout_ref.actor.use_kl_loss=true",
              "algorithm.adv_estimator=gae", "critic.strategy=deepspeed", "critic.deepspeed_config.zero_stage=1",
              "critic.ppo_micro_batch_size_per_gpu=8"]
    ref_dir, res_dir = tmp_path / "uninterrupted", tmp_path / "resumed"
    run(tmp_path, "uninterrupted", *common)
    for role in ("actor", "critic"):  # DeepSpeed's own checkpoint format
        assert os.path.isdir(ref_dir / "global_step_1" / role / "deepspeed"), role
    run(tmp_path, "resumed", *common, "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={ref_dir / 'global_step_1'}")
    # it began at step 2: a run that started afresh would have saved its own step 1
    assert not (res_dir / "global_step_1").exists() and (res_dir / "global_step_2").is_dir()
    a, b = stable_history(ref_dir), stable_history(res_dir)
    assert [h["step"] for h in a] == [1, 2] == [h["step"] for h in b]
    assert a == b and a[-1]["actor/kl_loss"] >= 0 and a[-1]["critic/vf_loss"] > 0 and a[-1]["critic/grad_norm"] > 0
    wa = load_file(str(ref_dir / "hf_export" / "model.safetensors"))
    wb = load_file(str(res_dir / "hf_export" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
