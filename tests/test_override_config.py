"""verl's ``*.model.override_config``: the fields set over config.json reach every reader (the shared reader the
megatron bridge, the native engine and the perf counter use; transformers' config for the DeepSpeed strategy;
the JSON SGLang is given) with the same numbers, and the dict is validated at load time."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_bridge.hf_config import read_hf_config, transformer_config_kwargs
from tests.support.tiny import tiny_config
from trainer.config import ConfigError
from trainer.config.preflight import check_overrides
from trainer.hf_io import load_config_json, overridden_fields, override_errors, read_config, rope_inv_freq
from trainer.rollout.hf_model import CausalLM
from trainer.strategies.hf_model import hf_config_with_overrides

TINY = "recipes/cpu/tiny_model"  # qwen2, hidden 96 / 4 heads: head_dim 24; v5 rope_parameters {rope_theta: 1e4}


def _hf_inv_freq(overrides) -> torch.Tensor:
    """transformers' own RoPE frequencies of the tiny model under the DeepSpeed strategy's config."""
    m = AutoModelForCausalLM.from_pretrained(TINY, config=hf_config_with_overrides(TINY, overrides))
    return m.model.rotary_emb.inv_freq


def test_rope_theta_and_max_positions_reach_every_reader():
    ov = {"rope_theta": 1.0e6, "max_position_embeddings": 512}
    hf = read_config(TINY, ov)
    assert (hf.rope_theta, hf.max_position_embeddings) == (1.0e6, 512)
    # inv_freq[i] = theta^(-2i/24): theta 1e6 gives 1e6^(-1/12) = 10^-0.5 at i = 1 (1e4 would give 10^(-1/3) = 0.464)
    inv = rope_inv_freq(hf)
    assert inv[1].item() == pytest.approx(10 ** -0.5, rel=1e-6)
    assert torch.equal(inv, _hf_inv_freq(ov))  # the DeepSpeed strategy's transformers model agrees bit for bit
    assert read_hf_config(TINY, ov).rope_theta == 1.0e6  # the megatron bridge's reader
    eng = CausalLM.from_pretrained(TINY, overrides=ov)  # the native engine
    assert (eng.cfg.rope_theta, eng.cfg.max_position_embeddings) == (1.0e6, 512)
    assert hf_config_with_overrides(TINY, ov).max_position_embeddings == 512


def test_rope_scaling_linear_and_model_config_spelling():
    # verl's megatron spelling (under model_config) means the same; linear scaling divides every frequency by 2
    ov = {"model_config": {"rope_scaling": {"type": "linear", "factor": 2.0}}}
    hf = read_config(TINY, ov)
    assert hf.rope_scaling == {"rope_type": "linear", "factor": 2.0} and hf.rope_theta == 1.0e4
    inv = rope_inv_freq(hf)
    assert inv[0].item() == 0.5 and inv[1].item() == pytest.approx(10 ** (-1 / 3) / 2, rel=1e-6)
    assert torch.equal(inv, _hf_inv_freq(ov))
    # what SGLang is given (json_model_override_args): both RoPE spellings, the checkpoint's theta kept
    sent = json.loads(json.dumps(overridden_fields(load_config_json(TINY), ov)))
    assert sent == {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 10000.0,
                    "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}


def test_dropout_reaches_deepspeed_and_megatron_and_is_refused_where_not_built():
    ov = {"attention_dropout": 0.1}
    assert hf_config_with_overrides(TINY, ov).attention_dropout == 0.1
    hf = read_hf_config(TINY, ov)
    assert transformer_config_kwargs(hf)["attention_dropout"] == 0.1
    assert transformer_config_kwargs(read_hf_config(TINY))["attention_dropout"] == 0.0
    cfg = tiny_config(["actor_rollout_ref.model.override_config.attention_dropout=0.1"])
    with pytest.raises(ConfigError) as e:
        check_overrides(cfg)
    assert str(e.value) == (
        "actor_rollout_ref.model.override_config: attention_dropout=0.1 with strategy=megatron: the megatron bridge's "
        "attention (torch SDPA over packed rows) has no dropout; use strategy=deepspeed (transformers' attention "
        "applies it) or attention_dropout=0.")
    check_overrides(tiny_config(["actor_rollout_ref.model.override_config.attention_dropout=0.1",
                                 "actor_rollout_ref.actor.strategy=deepspeed", "actor_rollout_ref.ref.strategy=deepspeed"]))


def test_a_merged_config_the_readers_refuse_is_a_config_error():
    cfg = tiny_config(["+actor_rollout_ref.model.override_config.rope_scaling={rope_type:yarn,factor:4.0}"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.model.override_config over .*tiny_model: .*rope type 'yarn' "
                                          r"is not supported"):
        check_overrides(cfg)


def test_validation_names_the_field_and_the_closest_names():
    key = "actor_rollout_ref.model.override_config"
    assert override_errors({"rope_thetha": 1e5, "model_config": {"hidden_size": 8, "attention_dropout": 1.5},
                            "max_position_embeddings": "long", "moe_config": {"freeze_moe_router": True}}, key) == [
        f"{key}.moe_config.freeze_moe_router=true: freezing the MoE router is not built; remove the line.",
        f"{key}.rope_thetha: not a field that can be overridden (closest: rope_theta); the fields are "
        "max_position_embeddings, rope_theta, rope_scaling, attention_dropout, rms_norm_eps (a field that sizes a "
        "weight would not fit the checkpoint).",
        f"{key}.max_position_embeddings='long': a number.",
        f"{key}.model_config.hidden_size: not a field that can be overridden; the fields are max_position_embeddings, "
        "rope_theta, rope_scaling, attention_dropout, rms_norm_eps (a field that sizes a weight would not fit the "
        "checkpoint).",
        f"{key}.model_config.attention_dropout=1.5: a probability in [0, 1)."]
    assert override_errors({"model_config": {}, "moe_config": {"freeze_moe_router": False}}, key) == []


def test_config_load_accepts_the_three_sections_and_refuses_unfed_engines():
    cfg = tiny_config(["actor_rollout_ref.model.override_config.max_position_embeddings=128",
                       "critic.model.override_config.rope_theta=1e5", "reward_model.model.override_config.rms_norm_eps=1e-5"])
    assert cfg.critic.model.override_config.rope_theta == 1e5 and cfg.reward_model.model.override_config.rms_norm_eps == 1e-5
    with pytest.raises(ConfigError) as e:
        tiny_config(["actor_rollout_ref.model.override_config.rope_theta=1e5", "actor_rollout_ref.rollout.mode=async"])
    assert ("actor_rollout_ref.model.override_config with actor_rollout_ref.rollout.mode=async: the engine servers read "
            "the checkpoint's config.json as it is") in str(e.value)
