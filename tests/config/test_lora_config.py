"""The LoRA keys at load time (:mod:`trainer.lora`): verl's ``actor_rollout_ref.model.lora.*`` and the older
``lora_rank`` spelling resolve to the adapters the megatron actor builds, and everything not built is refused
with its reason and fix, all problems in one load."""

import json

import pytest

from tests.support.tiny import tiny_config
from trainer.config import ConfigError
from trainer.lora import MEGATRON_LINEARS, LoRASettings, lora_settings, megatron_targets

L = "actor_rollout_ref.model.lora"
ON = [f"{L}.rank=8", f"{L}.merge=true"]


def test_verl_keys_resolve_to_the_adapters_built():
    s = lora_settings(tiny_config(ON + [f"{L}.alpha=4", f"{L}.dropout=0.1", f"{L}.target_modules=[linear_qkv,linear_fc2]",
                                        f"{L}.exclude_modules=['*.layers.0.*']", f"{L}.lora_A_init_method=kaiming",
                                        f"{L}.lora_B_init_method=normal", f"{L}.dtype=float32"]))
    assert s == LoRASettings(rank=8, alpha=4.0, dropout=0.1, target_modules=("linear_qkv", "linear_fc2"),
                             exclude_modules=("*.layers.0.*",), a_init="kaiming", b_init="normal", dtype="float32",
                             merge=True)
    assert s.scale == 0.5 and s.apply_kwargs()["target_modules"] == ["linear_qkv", "linear_fc2"]
    assert LoRASettings(**s.as_dict()) == s  # what crosses Ray to the actor rebuilds the same settings
    # verl's defaults: alpha 32, every decoder linear, xavier / zero (training starts at the base model)
    d = lora_settings(tiny_config(ON))
    assert (d.alpha, d.target_modules, d.a_init, d.b_init, d.dtype) == (32.0, MEGATRON_LINEARS, "xavier", "zero", None)


def test_adapter_sync_is_verls_default_and_reaches_the_native_engine():
    assert lora_settings(tiny_config([f"{L}.rank=8"])).merge is False  # verl's lora.merge default
    assert lora_settings(tiny_config(ON)).merge is True
    assert lora_settings(tiny_config(["actor_rollout_ref.model.lora_rank=4"])).merge is False
    tiny_config([f"{L}.rank=8", "actor_rollout_ref.rollout.name=native"])  # loads: the native engine takes adapters
    tiny_config(ON + ["actor_rollout_ref.rollout.mode=async"])  # merged weights reach the HTTP servers


def test_rank_zero_is_off_whatever_the_other_keys_say():
    assert lora_settings(tiny_config([f"{L}.alpha=4", f"{L}.type=dora", f"{L}.merge=false"])) is None


@pytest.mark.parametrize("names, want", [
    ("all-linear", list(MEGATRON_LINEARS)),
    (["q_proj", "k_proj", "v_proj", "o_proj"], ["linear_qkv", "linear_proj"]),
    (["gate_proj", "down_proj", "up_proj"], ["linear_fc1", "linear_fc2"]),
    (["linear_fc1", "*.layers.1.*"], ["linear_fc1", "*.layers.1.*"]),
    (None, []),
])
def test_older_spelling_maps_hf_names_to_megatron_linears(names, want):
    assert megatron_targets(names, "k") == want


def test_older_spelling():
    s = lora_settings(tiny_config(["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                                   "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,down_proj]"]))
    assert (s.rank, s.alpha, s.target_modules, s.exclude_modules) == (4, 8.0, ("linear_qkv", "linear_fc2"), ())
    assert lora_settings(tiny_config(["actor_rollout_ref.model.lora_rank=4"])).target_modules == MEGATRON_LINEARS


def _problems(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        tiny_config(overrides)
    return str(e.value)


def test_what_is_not_built_is_refused_with_the_reason_in_one_load():
    msg = _problems([f"{L}.rank=8", "actor_rollout_ref.actor.strategy=tests.strategies.test_strategy_plugin:UnigramStrategy", f"{L}.type=dora", f"{L}.dropout=0.1",
                     f"{L}.dropout_position=post", f"{L}.target_modules=[q_proj]", f"{L}.freeze_language_model=false",
                     f"{L}.a2a_experimental=true", f"{L}.dtype=int8", "actor_rollout_ref.rollout.name=sglang",
                     "actor_rollout_ref.rollout.mode=async"])
    assert "9 problems" in msg, msg
    for want in ("not on actor_rollout_ref.actor.strategy=tests.strategies.test_strategy_plugin:UnigramStrategy (a strategy of your own gets no LoRA",
                 # verl's default merge=false moves the adapters only: an engine that cannot take them is named
                 f"{L}.merge=false syncs only the LoRA adapters, which the engine 'sglang' does not take",
                 "the HTTP engine servers of actor_rollout_ref.rollout.mode=async do not take yet",
                 f"set {L}.merge=true (the engines then get merged weights",
                 f"{L}.type='dora' is not built", "dropout_position=post", "['q_proj'] name no megatron linear",
                 "freeze_language_model=False", "a2a_experimental=True", "dtype='int8'"):
        assert want in msg, want


@pytest.mark.parametrize("overrides, want", [
    (["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.target_modules=[q_proj,k_proj]"],
     "megatron fuses q_proj + k_proj + v_proj into one linear_qkv"),
    (ON + ["actor_rollout_ref.model.lora_rank=4"], "use one spelling"),
    (["critic.model.lora.rank=8"], "LoRA on the critic is not built"),
    (["critic.model.lora_rank=8"], "LoRA on the critic is not built"),
    (ON + ["actor_rollout_ref.actor.strategy=deepspeed", f"{L}.dtype=float32"],
     "peft's adapters take the base weights' dtype there"),
    (ON + ["actor_rollout_ref.actor.strategy=fsdp", f"{L}.dtype=bfloat16"],
     "with actor.strategy=fsdp: peft's adapters take the base weights' dtype there"),
    (ON + [f"{L}.adapter_path=/nonexistent"], "is not a peft adapter directory"),
    ([f"{L}.rank=-1"], "actor_rollout_ref.model.lora.rank"),
])
def test_refusals(overrides, want):
    assert want in _problems(overrides)


def test_adapter_path_must_match_rank_and_alpha(tmp_path):
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    s = lora_settings(tiny_config(ON + [f"{L}.alpha=16", f"{L}.adapter_path={tmp_path}"]))
    assert s.adapter_path == str(tmp_path)
    msg = _problems(ON + [f"{L}.adapter_path={tmp_path}"])  # alpha 32 (verl's default) against the adapter's 16
    assert "r=8, lora_alpha=16, but the configured rank / alpha are 8 / 32" in msg
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                               "use_dora": True}))
    assert "only plain LoRA" in _problems(ON + [f"{L}.alpha=16", f"{L}.adapter_path={tmp_path}"])
