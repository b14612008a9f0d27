"""Coxswain's whole configuration: omegaconf structured dataclasses (:mod:`.schema`), CLI overrides and
loading (:mod:`.load`), cross-key validation by section (:mod:`.checks`), what counts as a secret
(:mod:`.secrets`), user plug-ins named as ``pkg.module:function`` (:mod:`.plugins`), and the hardware and
environment checks run before any worker starts (:mod:`.preflight`, imported on its own: it needs torch and
the reward and rollout modules).

Entry point::

    cfg = load_config(["--config", "my.yaml", "algorithm.adv_estimator=grpo", ...])

Errors are ``ConfigError`` with a message that names the key(s) at fault and the fix:
unknown keys suggest the closest valid key, wrong types name the key, value and expected type,
cross-field checks name every key involved, legacy verl keys name their replacements.
"""

from trainer.config.schema import (
    ActorConfig, ActorRolloutRefConfig, AdcaConfig, AdcaGrpoConfig, AlgorithmConfig, AsyncTrainingConfig,
    CHOICES, CheckpointContents, ConfigError, CoxswainConfig, CriticConfig, CriticModelConfig,
    CustomRewardFunctionConfig, DataConfig, DebugConfig, DeepSpeedConfig, FilterGroupsConfig, HooksConfig,
    KLControlConfig, MegatronConfig, ModelConfig, MultiTurnConfig, OptimConfig, OverlongBufferConfig,
    PolicyLossConfig, RefConfig, RefMegatronConfig, RewardModelConfig, RewardModelMegatronConfig,
    RewardModelModelConfig, RolloutConfig, RolloutCorrectionConfig, RouterReplayConfig, SandboxConfig,
    SandboxFusionConfig, TrainerConfig, ValKwargs, LEAVES, flatten_keys, all_keys, closest_key, schema_defaults,
)
from trainer.config.checks import (
    DAPO_KWARGS, LOGGERS, OTHER_ENGINES, OVERLONG_FIELDS, deepspeed_errors, deepspeed_roles, error_report,
    need_critic, need_ref, validate, validation_errors, world_size,
)
from trainer.transformer_overrides import MOE_BALANCING, MOE_KEYS, RECOMPUTE_KEYS
from trainer.verl_compat import moe_settings, recompute_settings
from trainer.config.load import (
    KEY_ALIASES, LAST_LOAD_NOTES, LEGACY_KEYS, VERL_BASES, load_config, parse_overrides, public_container,
    save_resolved, to_yaml,
)

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AdcaConfig",
    "AdcaGrpoConfig",
    "AlgorithmConfig",
    "AsyncTrainingConfig",
    "CHOICES",
    "CheckpointContents",
    "ConfigError",
    "CoxswainConfig",
    "CriticConfig",
    "CriticModelConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "DebugConfig",
    "DeepSpeedConfig",
    "FilterGroupsConfig",
    "HooksConfig",
    "KLControlConfig",
    "MegatronConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PolicyLossConfig",
    "RefConfig",
    "RefMegatronConfig",
    "RewardModelConfig",
    "RewardModelMegatronConfig",
    "RewardModelModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RouterReplayConfig",
    "SandboxConfig",
    "SandboxFusionConfig",
    "TrainerConfig",
    "ValKwargs",
    "schema_defaults",
    "LEAVES",
    "flatten_keys",
    "all_keys",
    "closest_key",
    "DAPO_KWARGS",
    "LOGGERS",
    "MOE_BALANCING",
    "MOE_KEYS",
    "OTHER_ENGINES",
    "OVERLONG_FIELDS",
    "RECOMPUTE_KEYS",
    "deepspeed_errors",
    "deepspeed_roles",
    "error_report",
    "moe_settings",
    "need_critic",
    "need_ref",
    "recompute_settings",
    "validate",
    "validation_errors",
    "world_size",
    "KEY_ALIASES",
    "LAST_LOAD_NOTES",
    "LEGACY_KEYS",
    "VERL_BASES",
    "load_config",
    "parse_overrides",
    "public_container",
    "save_resolved",
    "to_yaml",
]
