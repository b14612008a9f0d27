"""verl's checkpoint layout from the real loop: ``default_local_dir/global_step_N/{actor,actor/huggingface}``,
``latest_checkpointed_iteration.txt``, ``max_actor_ckpt_to_keep``, and ``load_contents`` deciding what a
resume restores."""

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.tiny import tiny_config

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=6",
        "trainer.logger=[console]", "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=1"]


@pytest.fixture(scope="module", autouse=True)
def _ray(shared_ray):
    yield  # one embedded Ray cluster for the module's runs (tests/conftest.py: shared_ray)


def _train(run_dir, *overrides):
    from trainer.main import train

    return train(tiny_config(BASE + [f"trainer.default_local_dir={run_dir}", *overrides]))


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_verl_layout_hf_model_pruning_and_load_contents(tmp_path, capsys):
    run = tmp_path / "run"
    _train(run, "trainer.total_training_steps=2", "trainer.max_actor_ckpt_to_keep=1",
           "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    names = set(os.listdir(run))
    # max_actor_ckpt_to_keep=1: step 1 pruned; the tracker file holds the newest step, as verl writes it
    assert "global_step_2" in names and "global_step_1" not in names
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not any(n.startswith(".tmp-") for n in names)
    step2 = run / "global_step_2"
    assert (step2 / "actor").is_dir() and (step2 / "driver_state.pt").is_file()
    hf = step2 / "actor" / "huggingface"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(hf))
    # the HF copy is step 2's actor: the final export (after step 2) has the same weights, and transformers loads it
    a, b = _weights(hf), _weights(run / "hf_export")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(hf)
    AutoTokenizer.from_pretrained(hf)

    # resume step 2 -> 3 twice from the same checkpoint: all of it, and without the optimizer (fresh Adam)
    full, no_opt = tmp_path / "full", tmp_path / "no_opt"
    shutil.copytree(run, full)
    shutil.copytree(run, no_opt)
    capsys.readouterr()
    out_full = _train(full, "trainer.total_training_steps=3")
    assert f"resumed from {full / 'global_step_2'} at step 2" in capsys.readouterr().out
    out_no = _train(no_opt, "trainer.total_training_steps=3", "actor_rollout_ref.actor.checkpoint.load_contents=[model,extra]")
    assert f"resumed from {no_opt / 'global_step_2'} at step 2" in capsys.readouterr().out
    assert [h["step"] for h in out_full["history"]] == [1, 2, 3] == [h["step"] for h in out_no["history"]]
    assert (full / "latest_checkpointed_iteration.txt").read_text() == "3"
    # one mini-batch per step: same weights and batch at step 3, so the same gradient; only the optimizer state
    # differs,
    # so the update differs (a load that ignored load_contents would give identical weights)
    assert out_full["history"][-1]["actor/grad_norm"] == pytest.approx(out_no["history"][-1]["actor/grad_norm"], rel=1e-5)
    wf, wn = _weights(full / "hf_export"), _weights(no_opt / "hf_export")
    assert max((wf[k].float() - wn[k].float()).abs().max().item() for k in wf) > 0
