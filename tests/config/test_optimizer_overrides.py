"""``<role>.optim.override_optimizer_config``: megatron-core OptimizerConfig fields passed through as verl passes
them (issue 38: verl's Qwen3-MoE 30B Megatron example sets the optimizer's host offload and the precision-aware
optimizer there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from trainer.config import load_config
from trainer.config import load as config_load
from trainer.config.schema import ConfigError
from trainer.main import cli
from trainer.optimizer_overrides import (HOST_OFFLOAD_FIELDS, OPTIM_SET, optimizer_config_fields, override_errors,
                                         passthrough, turned_off)

ROOT = Path(__file__).resolve().parents[2]
QWEN3_MOE = ROOT / "tests" / "data" / "verl_scripts" / "run_qwen3moe-30b_megatron_96gb.json"
O = "+actor_rollout_ref.actor.optim.override_optimizer_config."


def _script(*extra) -> list[str]:
    args = json.loads(QWEN3_MOE.read_text())["args"]
    # the one line a Coxswain user changes: verl's vllm engine is not Coxswain's (sglang on GPU)
    return ["--config-name=ppo_megatron_trainer", *args, "actor_rollout_ref.rollout.name=sglang", *extra]


def test_verl_qwen3_moe_30b_example_resolves_with_its_optimizer_overrides(tmp_path, capsys):
    """verl's GPU recipe on a CPU login node: one --print-config run resolves it, the four optimizer lines kept as
    written (they reach megatron-core's OptimizerConfig on the GPU) and the transformer overrides with them."""
    assert cli(["--print-config", *_script(f"trainer.default_local_dir={tmp_path}")]) == 0
    out = capsys.readouterr().out
    printed = OmegaConf.create(out[:out.rindex("resolved config written to")])
    a = printed.actor_rollout_ref.actor
    assert OmegaConf.to_container(a.optim.override_optimizer_config) == {
        "optimizer_offload_fraction": 1.0, "overlap_cpu_optimizer_d2h_h2d": True,
        "use_precision_aware_optimizer": True, "optimizer_cpu_offload": True}
    assert a.megatron.override_transformer_config.moe_token_dispatcher_type == "flex"
    assert a.megatron.expert_model_parallel_size == 8


def test_unknown_coxswain_set_and_wrong_strategy_are_refused():
    with pytest.raises(ConfigError) as e:
        load_config(_script(O + "lr=1", O + "optimizer_cpu_ofload=true", O + "exp_avg_dtype=bf17"))
    msg = str(e.value)
    assert "override_optimizer_config.lr: set by Coxswain from actor_rollout_ref.actor.optim.lr" in msg
    assert "optimizer_cpu_ofload: not a field of megatron-core's OptimizerConfig (closest: optimizer_cpu_offload" in msg
    assert "exp_avg_dtype='bf17': not a dtype" in msg
    with pytest.raises(ConfigError, match="read by strategy=megatron only; strategy=fsdp builds its own AdamW"):
        load_config(_script("actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
                            "actor_rollout_ref.ref.megatron.expert_model_parallel_size=1"))


def test_low_precision_state_needs_the_precision_aware_optimizer_and_a_gpu():
    errs = override_errors("critic", {"exp_avg_dtype": "bf16"}, strategy="megatron", device="cuda")
    assert len(errs) == 1 and "need use_precision_aware_optimizer=True" in errs[0]
    over = {"use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "fp8"}
    assert override_errors("critic", over, strategy="megatron", device="cuda") == []
    errs = override_errors("critic", over, strategy="megatron", device="cpu")
    assert len(errs) == 1 and "changes the numbers" in errs[0]
    # fp32 state (the defaults, or said so): the same Adam arithmetic, so a CPU run takes it
    fp32 = {"use_precision_aware_optimizer": True, "main_params_dtype": "float32", "optimizer_cpu_offload": True}
    assert override_errors("critic", fp32, strategy="megatron", device="cpu") == []
    assert sorted(turned_off(fp32)) == ["optimizer_cpu_offload", "use_precision_aware_optimizer"]


def test_every_field_coxswain_sets_is_a_real_field():
    """The refusals name fields megatron-core has (a renamed field would otherwise slip through as 'unknown')."""
    fields = optimizer_config_fields()
    assert set(OPTIM_SET) <= fields and set(HOST_OFFLOAD_FIELDS) <= fields
    assert {"decoupled_weight_decay", "exp_avg_dtype", "use_precision_aware_optimizer"} <= fields


def test_passthrough_keeps_everything_on_gpu_and_drops_host_offload_on_cpu():
    over = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0, "use_precision_aware_optimizer": True,
            "exp_avg_dtype": "bf16", "decoupled_weight_decay": False, "loss_scale": 128.0}
    gpu = passthrough(over, cuda=True)
    assert gpu["exp_avg_dtype"] is torch.bfloat16 and gpu["optimizer_cpu_offload"] is True and gpu["loss_scale"] == 128.0
    assert passthrough(over, cuda=False) == {"decoupled_weight_decay": False, "loss_scale": 128.0}


def test_cpu_run_notes_what_it_turned_off_once():
    load_config(_script("trainer.device=cpu", "actor_rollout_ref.actor.megatron.param_offload=false",
                        "actor_rollout_ref.actor.megatron.grad_offload=false",
                        "actor_rollout_ref.actor.megatron.optimizer_offload=false",
                        "actor_rollout_ref.ref.megatron.param_offload=false",
                        "actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type=alltoall",
                        "actor_rollout_ref.ref.megatron.override_transformer_config.moe_token_dispatcher_type=alltoall"))
    notes = [n for n in config_load.LAST_LOAD_NOTES if "override_optimizer_config" in n]
    assert len(notes) == 1
    for k in ("optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
              "use_precision_aware_optimizer"):
        assert k in notes[0]


def _optimizer_classes(src: str):
    from megatron_bridge.convert import load_hf_weights
    from megatron_bridge.hf_config import read_hf_config
    from megatron_bridge.model import build_model
    from megatron_bridge.train import OptimConfig, make_trainer, optimizers

    out = []
    for overrides in ({}, {"decoupled_weight_decay": False}):
        model = build_model(read_hf_config(src))
        load_hf_weights(model, src)
        tr = make_trainer(model, OptimConfig(lr=1e-3, weight_decay=0.1, overrides=overrides))
        out.append([type(o.optimizer).__name__ for o in optimizers(tr.optimizer)])
    return out


@pytest.mark.slow
def test_overrides_reach_megatron_optimizer_config(tmp_path):
    """decoupled_weight_decay=False is megatron-core's switch from AdamW to Adam with L2 decay: the built
    optimizer changes class only if the field reached OptimizerConfig."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "megatron_bridge"))
    from bridge_tiny import make_case
    from megatron_bridge.launch import spawn

    src = str(tmp_path / "m")
    make_case("qwen2_bias_gqa2_tied", src)
    default, overridden = spawn(_optimizer_classes, 1, src)[0]
    assert default == ["AdamW"] and overridden == ["Adam"]
