"""verl's FSDP scripts in the training loop, on a real local Ray cluster with two ranks (strategy=fsdp runs on FSDP2).

Each script's own arguments (``tests/data/verl_scripts/*.json``) run unchanged, on verl's FSDP defaults
(``--config-name=ppo_trainer``, what ``verl.trainer.main_ppo`` loads), except for the model, the data, the
sizes and the device (:data:`SIZES`): verl's canonical DAPO recipe (Ulysses SP=2 at this size, packed rows,
token-budget micro-batches, offload flags, group filtering), a GRPO example (KL loss against an FSDP
reference, gradient checkpointing) and a PPO example with an FSDP critic, 2 steps each (every per-step check
holds at each step). The PPO run checkpoints every step in verl's FSDP layout, and a run resumed from its step-1
checkpoint comes to the same metrics and exported weights.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.support.tiny import UNHURRIED

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")
SCRIPTS = ROOT / "tests" / "data" / "verl_scripts"
pytestmark = pytest.mark.slow

# What a tiny CPU run changes in a verl script: the model, the data, the sizes, the device (and the engine that
# runs on it). Every other argument of the script is passed as the script gives it.
SIZES = {
    "actor_rollout_ref.model.path": TINY, "critic.model.path": TINY,
    "data.train_files": "null", "data.val_files": "null",  # the shipped synthetic task
    "data.max_prompt_length": "64", "data.max_response_length": "8", "data.train_batch_size": "4",
    "data.gen_batch_size": "8", "actor_rollout_ref.rollout.n": "4", "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "4", "critic.ppo_micro_batch_size_per_gpu": "4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "8",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "160", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "160",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "160",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "512", "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "2", "actor_rollout_ref.ref.ulysses_sequence_parallel_size": "2",
    "reward_model.overlong_buffer.len": "4", "trainer.n_gpus_per_node": "2", "trainer.nnodes": "1",
    "actor_rollout_ref.rollout.name": "native", "trainer.device": "cpu",
}


def script_args(name: str, tmp_path, *extra) -> list[str]:
    """The script's arguments with only :data:`SIZES` replaced, plus 2 steps, a run directory and ``extra``."""
    args = json.loads((SCRIPTS / f"{name}.json").read_text())["args"]
    out, seen = [], set()
    for a in args:
        key = a.split("=", 1)[0].lstrip("+")
        seen.add(key)
        out.append(f"{key}={SIZES[key]}" if key in SIZES else a)
    out += [f"{k}={v}" for k, v in SIZES.items() if k not in seen and k.startswith(("trainer.device", "actor_rollout_ref.rollout.name"))]
    return ["--config-name=ppo_trainer", *out, "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path}",
            *UNHURRIED, *extra]


@pytest.fixture(scope="module", autouse=True)
def _ray(shared_ray, tmp_path_factory):
    d = tmp_path_factory.mktemp("trackers")
    os.environ.update(MLFLOW_TRACKING_URI=f"sqlite:///{d}/mlflow.db", WANDB_MODE="offline", WANDB_DIR=str(d))
    yield  # one embedded Ray cluster for the module's runs (tests/conftest.py: shared_ray)


def _train(args):
    from trainer.config import load_config
    from trainer.main import train

    cfg = load_config(args)
    return cfg, train(cfg)


def test_verl_dapo_recipe_on_fsdp_with_ulysses(tmp_path):
    cfg, out = _train(script_args("run_dapo_qwen2.5_32b_fsdp", tmp_path / "dapo"))
    a = cfg.actor_rollout_ref.actor
    assert a.strategy == "fsdp" and a.ulysses_sequence_parallel_size == 2 and a.use_remove_padding and a.use_dynamic_bsz
    assert a.fsdp_config.param_offload and a.fsdp_config.optimizer_offload  # on CPU: host memory already
    h = [r for r in out["history"] if r["step"] > 0]  # step 0: validation before training
    assert [r["step"] for r in h] == [1, 2]
    assert all(r["sync/verified"] == 1.0 and r["actor/grad_norm"] > 0 for r in h)
    # each rank writes its own FSDP shard rows into the hybrid engines' shared weights: no gather
    assert all(r["sync/shared_memory"] == 1.0 for r in h)
    assert h[0]["actor/lr"] < h[-1]["actor/lr"]  # the recipe's 10-step warmup, step by step


def test_verl_grpo_example_on_fsdp_with_kl_against_fsdp_reference(tmp_path):
    cfg, out = _train(script_args("run_qwen2-7b_math", tmp_path / "grpo"))
    assert cfg.actor_rollout_ref.ref.strategy == "fsdp" and cfg.actor_rollout_ref.model.enable_gradient_checkpointing
    h = [r for r in out["history"] if r["step"] > 0]  # step 0: validation before training
    assert [r["step"] for r in h] == [1, 2]
    # the reference is the initial policy and the script's lr (1e-6) barely moves the actor: the KL stays at the
    # bf16 rounding level (a reference with other weights gives orders of magnitude more)
    assert all(0 <= r["actor/kl_loss"] < 1e-3 for r in h) and all(r["actor/grad_norm"] > 0 for r in h)


def test_verl_rollout_correction_example_trains_on_fsdp(tmp_path):
    """verl's examples/rollout_correction/run_with_rollout_corr.sh, 2 steps: RLOO in bypass mode (the sampler's
    log-probs are the old ones: no old-log-prob pass), loss_type=reinforce with sequence-level IS weights
    truncated at 2 and normalised to mean 1 over the batch (rollout_is_batch_normalize)."""
    # the script leaves rollout.n at 1 (RLOO needs a group) and the world at verl's default: the sizes set both
    cfg, out = _train(script_args("run_with_rollout_corr", tmp_path / "corr", *(f"{k}={SIZES[k]}" for k in (
        "actor_rollout_ref.rollout.n", "trainer.n_gpus_per_node", "data.gen_batch_size"))))
    rc = cfg.algorithm.rollout_correction
    assert (rc.bypass_mode, rc.loss_type, rc.rollout_is, rc.rollout_is_batch_normalize) == (True, "reinforce", "sequence", True)
    h = [r for r in out["history"] if r["step"] > 0]
    assert [r["step"] for r in h] == [1, 2]
    assert all(r["sync/verified"] == 1.0 and r["actor/grad_norm"] > 0 for r in h)
    assert all("timing_s/old_log_prob" not in r for r in h)  # bypass: no recompute of the old log-probs
    # sequence-level weights that vary (the engine's and the trainer's log-probs differ), normalised to mean 1 over the
    # batch's sequences on both ranks (without normalisation their mean is off 1 by about their spread). The spread is
    # the bf16 engine's rounding against the trainer's: over 1e-3 on an AMX Xeon, 6e-4 on an AVX2 EPYC; 1e-4 keeps it
    # ten times the mean's tolerance, so the mean-1 check still tells normalised weights from raw ones
    for r in h:
        assert r["actor/rollout_is_weight_min"] < 1 - 1e-4 and r["actor/rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-5)


@pytest.fixture(scope="module")
def ppo_uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("ppo") / "uninterrupted"
    cfg, out = _train(script_args("run_gemma", d, "trainer.save_freq=1"))
    return d, cfg, out


def test_verl_ppo_example_with_fsdp_critic(ppo_uninterrupted):
    d, cfg, out = ppo_uninterrupted
    assert cfg.critic.strategy == "fsdp" and cfg.algorithm.adv_estimator == "gae"
    h = [r for r in out["history"] if r["step"] > 0]  # step 0: validation before training
    assert [r["step"] for r in h] == [1, 2]
    assert all(r["critic/vf_loss"] > 0 and r["critic/grad_norm"] > 0 for r in h)
    for role in ("actor", "critic"):  # verl's FSDP checkpoint layout, one file per rank and kind
        names = set(os.listdir(d / "global_step_1" / role))
        for kind in ("model", "optim", "extra_state"):
            assert {f"{kind}_world_size_2_rank_0.pt", f"{kind}_world_size_2_rank_1.pt"} <= names, (role, names)


def test_resume_from_step_1_is_identical_on_fsdp(ppo_uninterrupted, tmp_path):
    """The PPO script with an FSDP actor and critic, resumed from the uninterrupted run's step-1 checkpoint (verl's
    FSDP layout; ``trainer.resume_mode=resume_path``): the same metrics and exported weights, bit for bit. What is
    the strategy's own is its checkpoint's save and load; the SIGKILLed driver's resume is strategy-independent and
    is tests/test_controller.py's (a killed driver here cost the suite two more driver start-ups)."""
    from tests.support.tiny import stable_history

    ref_dir, _, _ = ppo_uninterrupted
    res = tmp_path / "resumed"
    _train(script_args("run_gemma", res, "trainer.save_freq=1", "trainer.resume_mode=resume_path",
                       f"trainer.resume_from_path={ref_dir / 'global_step_1'}"))
    # it began at step 2: a run that started afresh would have saved its own step 1
    assert not (res / "global_step_1").exists() and (res / "global_step_2").is_dir()
    a, b = stable_history(ref_dir), stable_history(res)
    assert [h["step"] for h in a] == [0, 1, 2] == [h["step"] for h in b]  # 0: validation before training
    assert a == b and a[-1]["critic/vf_loss"] > 0
    wa = load_file(str(ref_dir / "hf_export" / "model.safetensors"))
    wb = load_file(str(res / "hf_export" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
