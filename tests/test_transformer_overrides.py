"""``*.megatron.override_transformer_config``: every megatron-core TransformerConfig field passes through, validated
against the dataclass; verl's Qwen3-MoE Megatron example keys resolve on a CPU machine (GPU kernel switches turned off
with one note) and stay in the resolved config; a real TransformerConfig takes what a worker would pass it."""

import dataclasses

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_bridge.hf_config import read_hf_config, transformer_config_kwargs
from tests.support.tiny import tiny_config
from trainer.config import LAST_LOAD_NOTES, ConfigError
from trainer.transformer_overrides import passthrough, transformer_config_fields

A = "actor_rollout_ref.actor.megatron.override_transformer_config"
# verl's Qwen3-MoE 30B Megatron example (examples/grpo_trainer), its override_transformer_config lines
QWEN3_MOE = {"apply_rope_fusion": True, "masked_softmax_fusion": True, "bias_activation_fusion": True,
             "bias_dropout_fusion": True, "gradient_accumulation_fusion": True, "deallocate_pipeline_outputs": True,
             "persist_layer_norm": True, "moe_grouped_gemm": True, "moe_permute_fusion": True,
             "moe_token_dispatcher_type": "alltoall", "moe_router_dtype": "fp32", "moe_enable_deepep": False,
             "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001, "moe_shared_expert_overlap": False,
             "recompute_method": "uniform", "recompute_granularity": "full", "recompute_num_layers": 1}
KERNELS_ON = ["apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion", "gradient_accumulation_fusion",
              "masked_softmax_fusion", "moe_grouped_gemm", "moe_permute_fusion", "persist_layer_norm"]


def _args(over: dict, section: str = A) -> list[str]:
    return [f"+{section}.{k}={v}" for k, v in over.items()]


def test_the_field_list_is_the_dataclass():
    assert transformer_config_fields() == {f.name for f in dataclasses.fields(TransformerConfig)}


def test_verl_qwen3_moe_example_resolves_on_cpu_with_one_note():
    cfg = tiny_config(_args(QWEN3_MOE))
    assert dict(cfg.actor_rollout_ref.actor.megatron.override_transformer_config) == QWEN3_MOE  # kept as given
    assert LAST_LOAD_NOTES[-1] == (
        f"*.megatron.override_transformer_config: {', '.join(KERNELS_ON)} turned off on this CPU run: each fuses, "
        "overlaps or replays the same arithmetic in a GPU library's kernel (Transformer Engine, apex, CUDA), so no "
        "number changes beyond float rounding order; on trainer.device=cuda they apply.")
    assert sum("override_transformer_config" in n for n in LAST_LOAD_NOTES) == 1  # actor and ref: one note


def test_what_a_worker_passes_builds_a_real_transformer_config():
    hf = read_hf_config("recipes/cpu/tiny_model")
    cpu = passthrough(QWEN3_MOE, cuda=False)
    # recompute and MoE losses are read by Coxswain itself (recompute_settings / moe_settings), not passed here
    assert cpu == {**{k: False for k in KERNELS_ON}, "deallocate_pipeline_outputs": True, "moe_enable_deepep": False,
                   "moe_token_dispatcher_type": "alltoall", "moe_router_dtype": "fp32", "moe_shared_expert_overlap": False}
    gpu = passthrough(QWEN3_MOE, cuda=True)
    assert all(gpu[k] is True for k in KERNELS_ON)
    tc = TransformerConfig(**{**transformer_config_kwargs(hf), **cpu})
    assert tc.deallocate_pipeline_outputs is True and tc.apply_rope_fusion is False and tc.moe_router_dtype == "fp32"


@pytest.mark.parametrize("over, device, expected", [
    ({"apply_rope_fusio": True}, "cpu",
     f"{A}.apply_rope_fusio: not a field of megatron-core's TransformerConfig (closest: apply_rope_fusion)."),
    ({"hidden_size": 8}, "cpu",
     f"{A}.hidden_size: set by Coxswain's megatron bridge from the checkpoint's config.json "
     "(actor_rollout_ref.model.override_config for the overridable fields); set it there, not here."),
    ({"num_layers_in_first_pipeline_stage": 1}, "cpu",
     f"{A}.num_layers_in_first_pipeline_stage: set by Coxswain's megatron bridge from "
     "actor_rollout_ref.actor.megatron.pipeline_layer_split; set it there, not here."),
    ({"fp8": "hybrid"}, "cpu",
     f"{A}.fp8='hybrid': FP8 / FP4 compute runs in Transformer Engine's GPU kernels and changes the numbers; a CPU "
     "has neither: remove it, or train with trainer.device=cuda."),
    ({"moe_token_dispatcher_type": "flex"}, "cpu",
     f"{A}.moe_token_dispatcher_type='flex' dispatches tokens with DeepEP, a GPU library; on a CPU use 'alltoall' "
     "(the same tokens reach the same experts)."),
    ({"attention_dropout": 0.1}, "cpu",
     f"{A}.attention_dropout=0.1: the megatron bridge's attention (torch SDPA over packed rows) has no dropout; remove "
     "it (or use strategy=deepspeed with model.override_config.attention_dropout)."),
])
def test_refusals(over, device, expected):
    # the reference follows the actor's section: keep it to the defaults, so one message stands for the fault
    args = _args(over) + ["actor_rollout_ref.ref.megatron.override_transformer_config={}", f"trainer.device={device}"]
    with pytest.raises(ConfigError) as e:
        tiny_config(args)
    assert str(e.value).splitlines()[1:] == [f"  1. {expected}"]


def test_gpu_fields_are_kept_on_cuda():
    cfg = tiny_config(_args({"fp8": "hybrid", "apply_rope_fusion": True}) + ["trainer.device=cuda"])
    assert dict(cfg.actor_rollout_ref.actor.megatron.override_transformer_config) == {"fp8": "hybrid",
                                                                                      "apply_rope_fusion": True}
    assert not any("override_transformer_config" in n for n in LAST_LOAD_NOTES)
