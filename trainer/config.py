"""Coxswain's whole configuration: omegaconf structured dataclasses, CLI overrides and validation.

The key tree follows verl's (``data.*``, ``actor_rollout_ref.{model,actor,rollout,ref}.*``,
``critic.*``, ``reward_model.*``, ``algorithm.*``, ``trainer.*``) so that the override lines of a verl
recipe such as ``run_dapo_32b.sh`` carry over unchanged. Batch sizes follow verl's units:
``data.train_batch_size``, ``data.gen_batch_size`` and ``ppo_mini_batch_size`` count PROMPTS; each prompt
expands to ``actor_rollout_ref.rollout.n`` responses. ``ppo_micro_batch_size_per_gpu`` counts responses.

Entry point::

    cfg = load_config(["--config", "my.yaml", "algorithm.adv_estimator=grpo", ...])

Errors are ``ConfigError`` with a message that names the key(s) at fault and the fix:
unknown keys suggest the closest valid key, wrong types name the key, value and expected type,
cross-field checks name every key involved, legacy verl keys name their replacements.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from trainer.verl_compat import refusals, verl_only


class ConfigError(ValueError):
    """A configuration the trainer cannot run with; the message names the key(s) and the fix."""


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------
@dataclass
class DataConfig:
    tokenizer: Optional[str] = None  # tokenizer dir; None = the actor model's dir
    trust_remote_code: bool = False  # allow the tokenizer's custom HF code
    train_files: Any = None  # parquet/jsonl path or list of paths; None = the shipped synthetic task
    val_files: Any = None  # held-out parquet/jsonl path(s); None = the shipped synthetic held-out split
    prompt_key: str = "prompt"  # column holding the chat messages (verl row format)
    reward_fn_key: str = "data_source"  # column that selects the scorer
    max_prompt_length: int = 512  # prompts longer than this are filtered or truncated (see truncation)
    max_response_length: int = 512  # response budget in tokens (also the overlong-shaping max length)
    train_batch_size: int = 1024  # prompts per training step
    gen_batch_size: Optional[int] = None  # prompts per generation batch (DAPO); None = train_batch_size
    val_batch_size: Optional[int] = None  # prompts per validation batch; None = the whole val set
    shuffle: bool = True  # shuffle the training prompts every epoch
    seed: Optional[int] = None  # dataloader shuffle seed; None = 1
    filter_overlong_prompts: bool = False  # drop prompts longer than max_prompt_length
    truncation: str = "error"  # error | left | right: what to do with an overlong prompt when not filtered
    on_bad_row: str = "error"  # error | skip: a malformed dataset row stops the run or is skipped and counted


# ----------------------------------------------------------------------------------------------
# actor / rollout / ref
# ----------------------------------------------------------------------------------------------
@dataclass
class DeepSpeedConfig:
    """A role's DeepSpeed settings (used when its ``strategy=deepspeed``; its ``megatron`` section is then not used)."""
    zero_stage: int = 2  # ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters (over the role's data-parallel ranks)
    dtype: Optional[str] = None  # float32 | bfloat16 | float16; None = the role's megatron.dtype (the same precision either way)
    param_offload: bool = False  # ZeRO-Offload of parameters to CPU memory (stage 3, CUDA only; refused with trainer.device=cpu)
    optimizer_offload: bool = False  # ZeRO-Offload of optimizer states to CPU memory (CUDA only; refused with trainer.device=cpu)
    seed: int = 42  # torch seed of the role's ranks


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1  # TP degree
    pipeline_model_parallel_size: int = 1  # PP degree
    virtual_pipeline_model_parallel_size: Optional[int] = None  # interleaved PP chunks per stage
    context_parallel_size: int = 1  # CP degree (long context)
    expert_model_parallel_size: int = 1  # EP degree (MoE)
    expert_tensor_parallel_size: Optional[int] = None  # TP degree of the experts (None = megatron's choice)
    sequence_parallel: bool = True  # shard activations along the sequence within TP (no effect at TP=1, as in megatron)
    use_distributed_optimizer: bool = True  # shard optimizer state over DP (ZeRO-1)
    pipeline_layer_split: Optional[List[int]] = None  # layers per PP stage (uneven split); None = even
    param_offload: bool = False  # offload params to host memory when idle
    grad_offload: bool = False  # offload grads to host memory when idle
    optimizer_offload: bool = False  # offload optimizer state to host memory when idle
    seed: int = 42  # megatron's model-parallel RNG seed
    dtype: str = "bfloat16"  # float32 | bfloat16 | float16: compute/parameter dtype (bf16/fp16 keep fp32 main params, grads and Adam state)
    use_remove_padding: bool = True  # packed THD sequences (no pad tokens) in every pass of this role
    use_torch_compile: bool = False  # torch.compile (inductor) the model chunk; the first steps pay the compile
    override_transformer_config: Dict[str, Any] = field(default_factory=dict)  # megatron TransformerConfig overrides: recompute_granularity (full | selective) / recompute_method (uniform | block) / recompute_num_layers / recompute_modules


def _follow_actor(key: str, default) -> str:
    return f"${{oc.select:actor_rollout_ref.actor.megatron.{key},{default}}}"


@dataclass
class RefMegatronConfig(MegatronConfig):
    """The reference's megatron layout follows the actor's unless set (verl's interpolations)."""
    tensor_model_parallel_size: int = _follow_actor("tensor_model_parallel_size", 1)  # TP degree
    pipeline_model_parallel_size: int = _follow_actor("pipeline_model_parallel_size", 1)  # PP degree
    virtual_pipeline_model_parallel_size: Optional[int] = _follow_actor("virtual_pipeline_model_parallel_size", "null")  # interleaved PP chunks per stage
    context_parallel_size: int = _follow_actor("context_parallel_size", 1)  # CP degree (long context)
    expert_model_parallel_size: int = _follow_actor("expert_model_parallel_size", 1)  # EP degree (MoE)
    expert_tensor_parallel_size: Optional[int] = _follow_actor("expert_tensor_parallel_size", "null")  # TP degree of the experts
    param_offload: bool = _follow_actor("param_offload", "False")  # offload params to host memory when idle
    seed: int = _follow_actor("seed", 42)  # megatron's model-parallel RNG seed
    use_remove_padding: bool = _follow_actor("use_remove_padding", "True")  # packed THD sequences in the reference's passes
    override_transformer_config: Dict[str, Any] = field(default_factory=lambda: _follow_actor("override_transformer_config", "{}"))  # megatron TransformerConfig overrides


@dataclass
class ModelConfig:
    path: str = "~/models/deepseek-llm-7b-chat"  # HF-format model dir (config.json + safetensors + tokenizer); nothing is downloaded
    tokenizer_path: Optional[str] = None  # tokenizer dir; None = path
    trust_remote_code: bool = False  # allow custom HF code (never needed for Llama/Qwen2/Qwen3)
    enable_gradient_checkpointing: bool = False  # recompute activations in backward
    use_remove_padding: bool = False  # verl's FSDP packing switch; the megatron roles pack by *.megatron.use_remove_padding (true with it false is refused)
    override_config: Dict[str, Any] = field(default_factory=dict)  # overrides applied to the HF config


@dataclass
class OptimConfig:
    optimizer: str = "adam"  # adam | sgd
    lr: float = 1e-6  # peak learning rate
    min_lr: float = 0.0  # floor for cosine decay
    lr_warmup_steps: int = -1  # linear warmup steps; < 0 = use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0  # warmup as a fraction of total training steps
    lr_warmup_init: float = 0.0  # learning rate at the start of warmup
    lr_decay_style: str = "constant"  # constant | cosine | linear (megatron's OptimizerParamScheduler)
    lr_decay_steps: Optional[int] = None  # step at which decay reaches min_lr; None = the scheduler horizon
    weight_decay: float = 0.01  # decoupled weight decay
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam betas
    eps: float = 1e-8  # Adam epsilon
    clip_grad: float = 1.0  # global grad-norm clip; 0 disables
    total_training_steps: int = -1  # scheduler horizon; <= 0 = the run's total steps


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"  # vanilla | gspo | gpg | clip_cov | kl_cov | geo_mean | cispo | sapo | dro | dppo_tv | dppo_kl | cpgd | bypass_mode (with algorithm.rollout_correction.bypass_mode=true) | pkg.module:function
    dro_beta: Optional[float] = None  # DRO: quadratic log-ratio penalty; required (> 0) with loss_mode=dro
    clip_cov_ratio: float = 0.0002  # Clip-Cov: fraction of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # Clip-Cov: covariance lower bound
    clip_cov_ub: float = 5.0  # Clip-Cov: covariance upper bound
    kl_cov_ratio: float = 0.0002  # KL-Cov: fraction of tokens given the KL penalty
    ppo_kl_coef: float = 0.1  # KL-Cov: penalty coefficient


@dataclass
class CheckpointContents:
    save_contents: List[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])  # what a checkpoint holds: model, optimizer, extra always; add hf_model for global_step_N/actor/huggingface
    load_contents: List[str] = "${.save_contents}"  # what a resume restores: model (required), optimizer, extra (LR scheduler + RNG); hf_model is ignored here


@dataclass
class RouterReplayConfig:
    mode: str = "disabled"  # MoE routing replay: disabled | R3 (every forward of this role routes each token to the experts the rollout engine used; needs rollout.enable_rollout_routing_replay) | R2 (refused: not built)
    record_file: Optional[str] = None  # verl's dump of recorded routes (debugging): not built, refused when set
    replay_file: Optional[str] = None  # verl's replay from such a dump: not built, refused when set


@dataclass
class ActorConfig:
    strategy: str = "megatron"  # megatron | deepspeed
    ppo_mini_batch_size: int = 256  # prompts per optimizer step (x rollout.n responses)
    ppo_micro_batch_size: Optional[int] = None  # legacy global micro-batch; use ppo_micro_batch_size_per_gpu
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # responses per forward/backward on one DP rank (required unless use_dynamic_bsz)
    use_dynamic_bsz: bool = False  # pack micro-batches by token budget instead of count
    ppo_max_token_len_per_gpu: int = 16384  # token budget per micro-batch when use_dynamic_bsz
    ppo_epochs: int = 1  # passes over each step's batch
    shuffle: bool = False  # shuffle samples between mini-batches
    clip_ratio: float = 0.2  # PPO clip epsilon (both sides unless low/high given)
    clip_ratio_low: Optional[float] = 0.2  # lower clip epsilon; None = clip_ratio
    clip_ratio_high: Optional[float] = 0.2  # upper clip epsilon (DAPO clip-higher); None = clip_ratio
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (dppo_*: the IS truncation)
    tau_pos: float = 1.0  # SAPO: gate temperature where the advantage is positive
    tau_neg: float = 1.05  # SAPO: gate temperature where the advantage is <= 0
    policy_drift_coeff: float = 0.0  # CPGD (siiRL's key): weight of the policy-drift KL(old || new) term of loss_mode=cpgd
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm | token-sum
    loss_scale_factor: Optional[float] = None  # constant for seq-mean-token-sum-norm; None = max response length
    entropy_coeff: float = 0.0  # entropy bonus coefficient
    calculate_sum_pi_squared: bool = False  # the old-log-prob pass also returns sum_v pi(v)^2 per response token (needed by the optimal_token_baseline estimators; logs variance_proxy/*)
    use_kl_loss: bool = False  # add a KL(actor || ref) loss term (GRPO style)
    kl_loss_coef: float = 0.001  # KL loss coefficient
    kl_loss_type: str = "low_var_kl"  # kl | abs | mse | low_var_kl (k1 | k2 | k3 aliases)
    grad_clip: Optional[float] = None  # alias of optim.clip_grad kept for verl scripts; None = optim.clip_grad
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)  # policy-loss variant
    optim: OptimConfig = field(default_factory=OptimConfig)  # actor optimizer
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # actor parallelism
    deepspeed_config: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # strategy=deepspeed: ZeRO stage, precision, offload
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)  # MoE routing replay (R3)
    checkpoint: CheckpointContents = field(default_factory=CheckpointContents)  # checkpoint contents


@dataclass
class RefConfig:
    strategy: str = "megatron"  # megatron | deepspeed
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # responses per reference forward on one rank (required unless log_prob_use_dynamic_bsz)
    log_prob_use_dynamic_bsz: bool = "${oc.select:actor_rollout_ref.actor.use_dynamic_bsz,false}"  # pack reference micro-batches by token budget
    log_prob_max_token_len_per_gpu: int = "${oc.select:actor_rollout_ref.actor.ppo_max_token_len_per_gpu,16384}"  # token budget per reference micro-batch
    megatron: MegatronConfig = field(default_factory=lambda: RefMegatronConfig())  # reference parallelism (follows the actor's, as in verl)
    deepspeed_config: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # strategy=deepspeed: ZeRO stage, precision
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)  # MoE routing replay in the reference forward (R3)


@dataclass
class ValKwargs:
    temperature: float = 0.0  # validation sampling temperature (0 = greedy)
    top_k: int = -1  # validation top-k (-1 or 0 = off)
    top_p: float = 1.0  # validation nucleus threshold
    n: int = 1  # validation samples per prompt
    do_sample: bool = False  # sample during validation


@dataclass
class MultiTurnConfig:
    enable: bool = False  # run the multi-turn agent loop instead of single-turn generation
    max_assistant_turns: Optional[int] = None  # assistant turns per trajectory; None = until the environment ends it (bounded by the token budget)
    max_user_turns: Optional[int] = None  # environment/tool turns per trajectory; None = unbounded (bounded by the token budget)
    max_tokens_per_trajectory: Optional[int] = None  # token budget of a whole trajectory; None = prompt+response
    environment: str = "calculator"  # shipped env name or pkg.module:Class
    concurrency: int = 64  # trajectories in flight
    max_tokens_per_turn: Optional[int] = None  # cap of one assistant turn (SamplingParams.max_new_tokens); None = response_length


@dataclass
class RolloutConfig:
    name: str = "???"  # native (torch, CPU or GPU) | sglang (GPU); required, as in verl
    mode: str = "sync"  # sync (engines in Ray workers) | async (verl's server engines: HTTP servers behind sglang-router; also spelt server)
    temperature: float = 1.0  # sampling temperature (the trainer recomputes log-probs at this temperature)
    top_k: int = -1  # top-k filter (-1 or 0 = off)
    top_p: float = 1.0  # nucleus threshold (1 = off)
    n: int = 1  # responses per prompt (the GRPO group size)
    do_sample: bool = True  # sample (False = greedy)
    prompt_length: int = "${oc.select:data.max_prompt_length,512}"  # prompt cap of the engines (must be >= data.max_prompt_length)
    response_length: int = "${oc.select:data.max_response_length,512}"  # response budget of the engines
    dtype: str = "bfloat16"  # rollout compute dtype
    calculate_log_probs: bool = False  # return the sampler's per-token log-probs (needed for rollout IS)
    enable_rollout_routing_replay: bool = False  # MoE: the engines return each token's experts per layer, for router_replay.mode=R3
    tensor_model_parallel_size: int = 2  # rollout engine TP (SGLang)
    gpu_memory_utilization: float = 0.5  # SGLang mem_fraction_static
    free_cache_engine: bool = True  # release engine memory while training (colocated)
    max_num_seqs: int = 256  # engine batch slots (continuous batching)
    max_num_batched_tokens: int = 8192  # SGLang chunked-prefill budget
    enable_chunked_prefill: bool = True  # SGLang chunked prefill
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # responses per old-log-prob forward on one rank (required unless log_prob_use_dynamic_bsz)
    log_prob_use_dynamic_bsz: bool = "${oc.select:actor_rollout_ref.actor.use_dynamic_bsz,false}"  # pack old-log-prob micro-batches by token budget
    log_prob_max_token_len_per_gpu: int = "${oc.select:actor_rollout_ref.actor.ppo_max_token_len_per_gpu,16384}"  # token budget per old-log-prob micro-batch
    update_weights_bucket_megabytes: int = 512  # weight-sync bucket size in MiB (actor -> rollout engines)
    num_engines: int = 0  # rollout engines (workers) in the fleet; 0 = one per device when colocated (world / rollout TP), 1 split
    generate_threads: int = 0  # CPU torch threads per engine while generating; 0 = 1 (more only on idle cores)
    seed: int = 0  # sampling seed
    enforce_eager: bool = False  # SGLang: disable CUDA graphs
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)  # validation sampling
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # agent loop
    engine_kwargs: Dict[str, Any] = field(default_factory=dict)  # passed through to the engine (e.g. sglang.*)


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True  # colocated native engines live in the actor ranks' processes (sync = local copy); false = own processes
    model: ModelConfig = field(default_factory=ModelConfig)  # policy model
    actor: ActorConfig = field(default_factory=ActorConfig)  # policy training
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation
    ref: RefConfig = field(default_factory=RefConfig)  # reference policy


# ----------------------------------------------------------------------------------------------
# critic
# ----------------------------------------------------------------------------------------------
@dataclass
class CriticModelConfig:
    path: Optional[str] = None  # HF dir of the critic trunk; None = the actor's model
    tokenizer_path: Optional[str] = None  # tokenizer dir; None = path
    enable_gradient_checkpointing: bool = False  # full activation recompute in backward (megatron: refined by critic.megatron.override_transformer_config)


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # None = on exactly when algorithm.adv_estimator is gae
    strategy: str = "megatron"  # megatron | deepspeed
    model: CriticModelConfig = field(default_factory=CriticModelConfig)  # value model
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))  # critic optimizer
    ppo_mini_batch_size: int = "${oc.select:actor_rollout_ref.actor.ppo_mini_batch_size,256}"  # prompts per critic optimizer step
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # responses per critic forward/backward on one rank (required unless use_dynamic_bsz)
    use_dynamic_bsz: bool = "${oc.select:actor_rollout_ref.actor.use_dynamic_bsz,false}"  # fill critic micro-batches up to a token budget instead of a count
    ppo_max_token_len_per_gpu: int = 32768  # token budget per critic update micro-batch when use_dynamic_bsz
    forward_max_token_len_per_gpu: int = "${.ppo_max_token_len_per_gpu}"  # token budget per critic value micro-batch when use_dynamic_bsz
    ppo_epochs: int = "${oc.select:actor_rollout_ref.actor.ppo_epochs,1}"  # critic passes over each batch
    cliprange_value: float = 0.5  # value clipping range
    loss_agg_mode: str = "${oc.select:actor_rollout_ref.actor.loss_agg_mode,token-mean}"  # aggregation of the value loss
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # critic parallelism
    deepspeed_config: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # strategy=deepspeed: ZeRO stage, precision, offload


# ----------------------------------------------------------------------------------------------
# rewards
# ----------------------------------------------------------------------------------------------
@dataclass
class OverlongBufferConfig:
    enable: bool = False  # DAPO overlong reward shaping
    len: int = 4  # soft buffer length before max_response_length
    penalty_factor: float = 1.0  # penalty at the hard limit
    log: bool = False  # log the shaping term


@dataclass
class SandboxFusionConfig:
    url: Optional[str] = None  # a SandboxFusion service's run_code endpoint (http(s)://host:port/run_code): code runs there
    max_concurrent: int = 64  # requests one scorer process keeps in flight (a sample's test cases in parallel)
    memory_limit_mb: int = 1024  # the service's memory limit per run


@dataclass
class SandboxConfig:
    allow_weak_containment: bool = False  # score code on a host that cannot give every sandbox layer (see trainer/rewards/sandbox.py)


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None  # HF *ForSequenceClassification checkpoint (num_labels=1, head 'score'); required with reward_model.enable
    input_tokenizer: Optional[str] = "${actor_rollout_ref.model.path}"  # the tokenizer that made the rollout's ids: each response is decoded with it and re-rendered by the RM's chat template and tokenizer (verl's switch); null = the RM reads the actor's ids as they are (same vocabulary)


@dataclass
class RewardModelMegatronConfig(MegatronConfig):
    """The reward model's megatron layout: verl's ``reward_model.megatron`` defaults (its own TP / PP, no optimizer)."""
    use_distributed_optimizer: bool = False  # no optimizer: forward only (verl's default)
    seed: int = _follow_actor("seed", 42)  # megatron's model-parallel RNG seed
    use_remove_padding: bool = _follow_actor("use_remove_padding", "True")  # packed THD sequences in the reward model's forward
    override_transformer_config: Dict[str, Any] = field(default_factory=lambda: _follow_actor("override_transformer_config", "{}"))  # megatron TransformerConfig overrides


@dataclass
class RewardModelConfig:
    enable: bool = False  # score responses with a learned reward model: its score is the reward (verl's rule); the rule-based scorer still gives reward/acc
    strategy: str = "megatron"  # megatron | deepspeed: how the reward model's forward is sharded
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)  # the reward model's checkpoint
    micro_batch_size: Optional[int] = None  # legacy global micro-batch; use micro_batch_size_per_gpu
    micro_batch_size_per_gpu: Optional[int] = None  # responses per reward-model forward on one rank (required unless use_dynamic_bsz)
    use_dynamic_bsz: bool = "${critic.use_dynamic_bsz}"  # fill reward-model micro-batches up to a token budget instead of a count
    forward_max_token_len_per_gpu: int = "${critic.forward_max_token_len_per_gpu}"  # token budget per reward-model micro-batch when use_dynamic_bsz
    max_length: Optional[int] = None  # truncate each re-tokenised RM input to its first N tokens (verl's truncation='right'); null = whole
    megatron: MegatronConfig = field(default_factory=lambda: RewardModelMegatronConfig())  # strategy=megatron: the reward model's parallelism
    deepspeed_config: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # strategy=deepspeed: ZeRO stage, precision
    reward_manager: str = "naive"  # naive | prime | dapo | batch: verl's reward managers (trainer/rewards/manager.py)
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)  # the manager's keywords: dapo: max_resp_len, overlong_buffer_cfg.{enable,len,penalty_factor,log}; batch: passed to the batch scorer
    num_workers: int = 1  # scorer processes (0 = score in the trainer process)
    timeout: float = 10.0  # per-sample scorer timeout in seconds
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)  # DAPO shaping
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)  # verl's remote code sandbox
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # the local code sandbox


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None  # python file holding the user's scorer
    name: str = "compute_score"  # function name in that file
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)  # keywords bound to every call of that function


# ----------------------------------------------------------------------------------------------
# algorithm
# ----------------------------------------------------------------------------------------------
@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # initial / fixed in-reward KL coefficient
    horizon: int = 10000  # adaptive controller horizon
    target_kl: float = 0.1  # adaptive controller target


@dataclass
class FilterGroupsConfig:
    enable: bool = False  # DAPO dynamic sampling
    metric: Optional[str] = None  # None = acc; acc | score | seq_reward | seq_final_reward | any per-sample field
    max_num_gen_batches: int = 0  # generation batches per step before giving up; <= 0 = unlimited


@dataclass
class RolloutCorrectionConfig:
    """verl's newer spelling of rollout IS / rejection (``algorithm.rollout_correction``); used when
    ``rollout_is`` or ``rollout_rs`` is set, translated to the same weights and masks as the flat keys."""
    rollout_is: Optional[str] = None  # token | sequence: truncated IS weights at this level; None = no weights (metrics only)
    rollout_is_threshold: float = 2.0  # upper truncation bound of the IS weights
    rollout_is_batch_normalize: bool = False  # normalise the IS weights to mean 1 over the batch
    rollout_rs: Optional[str] = None  # rejection: token | sequence | geometric, or comma list of {token,seq_sum,seq_mean,seq_max}_{k1,k2,k3}
    rollout_rs_threshold: Any = None  # rejection bound(s): k1 ratio bounds as "lo_hi" or an upper ratio (lower 1/upper); k2/k3 upper bound
    rollout_rs_threshold_lower: Optional[float] = None  # k1 lower ratio bound when rollout_rs_threshold is a single number; None = 1/upper
    rollout_token_veto_threshold: Optional[float] = None  # veto a sequence with any token ratio below this; None = off
    bypass_mode: bool = False  # true: old log-probs = the sampler's (2 policies); false: decoupled (3 policies)
    loss_type: str = "ppo_clip"  # bypass mode's loss: ppo_clip | reinforce
    use_policy_gradient: bool = False  # older spelling of loss_type=reinforce


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"  # gae | grpo | grpo_vectorized | dr_grpo | rloo | rloo_vectorized | reinforce_plus_plus | reinforce_plus_plus_baseline | remax | grpo_passk | opo | gpg | gdpo | cpgd | optimal_token_baseline | tir_optimal_token_baseline (both need actor.calculate_sum_pi_squared=true) | adca_grpo | pkg.module:function
    norm_adv_by_std_in_grpo: bool = True  # False gives Dr.GRPO (also per component in gdpo)
    gdpo_reward_keys: Optional[List[str]] = None  # GDPO: keys of the scorer's returned dict, each normalised in its group on its own; required with adv_estimator=gdpo
    gdpo_reward_weights: Optional[List[float]] = None  # GDPO: one weight per gdpo_reward_keys entry; None = 1 each
    weight_factor_in_cpgd: str = "STD_weight"  # CPGD (siiRL's key): STD_weight (GRPO) | naive (R - mean) | clip_filter_like_weight
    gamma: float = 1.0  # discount
    lam: float = 1.0  # GAE lambda
    use_kl_in_reward: bool = False  # subtract coef * KL(actor || ref) from the token rewards
    kl_penalty: str = "kl"  # in-reward KL estimator: kl | abs | mse | low_var_kl
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)  # in-reward KL controller
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)  # DAPO group filter
    rollout_is_threshold: Optional[float] = None  # upper IS bound; None disables rollout IS entirely (verl's default)
    rollout_is_threshold_lower: Optional[float] = None  # lower bound for clip mode; None = 1 / upper
    rollout_is_level: str = "token"  # token | sequence | geometric
    rollout_is_mode: str = "truncate"  # truncate | clip
    rollout_is_veto_threshold: Optional[float] = 1e-4  # veto a sequence with any token ratio below; None = off
    rollout_is: bool = True  # apply the weights (False = compute the mismatch metrics only)
    rollout_rs: Optional[str] = None  # rejection sampling aggregation: token | seq_sum | seq_mean | seq_max; None = off
    rollout_rs_divergence: str = "k1"  # k1 | k2 | k3 divergence for rejection sampling
    rollout_rs_threshold: Optional[float] = None  # rejection upper bound
    rollout_rs_threshold_lower: Optional[float] = None  # rejection lower bound
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)  # verl's newer rollout-IS tree


# ----------------------------------------------------------------------------------------------
# ADCA-GRPO (AgentEvolver's attribution-driven credit assignment)
# ----------------------------------------------------------------------------------------------
@dataclass
class AdcaGrpoConfig:
    prm_scheme: str = "decouple"  # decouple | allocation
    do_batch_norm: bool = True  # z-score step rewards within each prompt group
    equal_trajectory_weight: bool = True  # each trajectory counts equally in group stats (GRPO) vs pooled steps (GSPO)
    fix_base: float = 0.2  # PRM magnitude: GOOD = +fix_base, BAD = -fix_base
    alpha: float = 0.1  # weight of the step (PRM) term
    beta: float = 1.0  # weight of the outcome (ORM) term
    orm_distribution: str = "last_step"  # last_step | all_steps
    prm_steps: Optional[int] = None  # turn attribution off after this many training steps (None = no step limit)
    prm_epoch: Optional[int] = 100  # the seed's gate: attribution only in data epochs < prm_epoch (None = always)
    enable_adca_metric: bool = True  # log the adca/* metrics
    enable_length_normalization: bool = False  # divide by sqrt(number of steps)
    consistent_scale: float = 1.0  # allocation: weight of steps whose flag agrees with the outcome
    pos_unconsistent_scale: float = 0.2  # allocation: weight of BAD steps in a successful trajectory
    neg_unconsistent_scale: float = 0.2  # allocation: weight of GOOD steps in a failed trajectory


@dataclass
class AdcaConfig:
    enable: bool = False  # step-level credit assignment by an LLM judge
    evaluation_type: str = "api"  # api (OpenAI-compatible endpoint) | local (trainer.serve)
    model: str = "qwen-max"  # judge model name
    base_url: str = "https://dashscope.aliyuncs.com/compatible-mode/v1"  # judge endpoint
    api_key_env: str = "DASHSCOPE_API_KEY"  # env var holding the judge API key (never logged)
    concurrent: int = 8  # judge requests in flight
    api_max_retries: int = 200  # retries on 429 / 5xx / timeouts (the seed's default)
    request_timeout: float = 60.0  # per-request timeout in seconds
    rate_limit_per_s: Optional[float] = None  # token-bucket rate; None = unlimited
    llm_evaluation_log_dir: Optional[str] = None  # JSONL log of every judge request/response
    skip_type: str = "skip_small_adv"  # skip_small_adv | skip_all_neg | none (the seed also writes it under adca_grpo)
    overall_score_source: str = "token_level_rewards"  # the score the judge sees: token_level_rewards (outcome, as the seed's trainer) | advantages (the GRPO advantage)
    judge_max_tokens: Optional[int] = 256  # max_tokens of each judge answer (None = the server's default)
    local_model_path: Optional[str] = None  # evaluation_type=local: HF dir served as the judge (None = the actor's model)
    local_max_seq_len: int = 4096  # evaluation_type=local: the judge server's context length
    adca_grpo: AdcaGrpoConfig = field(default_factory=AdcaGrpoConfig)  # fusion settings


# ----------------------------------------------------------------------------------------------
# trainer
# ----------------------------------------------------------------------------------------------
@dataclass
class DebugConfig:
    in_process: bool = False  # run every worker in the driver process (no Ray) so breakpoint() works
    rollout_only: bool = False  # generate and score, no training
    train_only: bool = False  # train on a dumped batch (dump_batch_path), no generation
    dump_batch_path: Optional[str] = None  # write / read a step's batch here


@dataclass
class HooksConfig:  # trainer.pipeline's hook points: each a list of 'pkg.module:function', f(batch, metrics) -> RolloutBatch | None
    after_rollout: List[str] = field(default_factory=list)  # the generated batch, before its reward (multi-turn: with the episode's reward); may drop samples
    after_reward: List[str] = field(default_factory=list)  # after scoring and overlong shaping, before DAPO's group filter; may change rewards or drop samples
    after_filter: List[str] = field(default_factory=list)  # the step's batch after DAPO's filter and trim; may drop samples
    before_advantages: List[str] = field(default_factory=list)  # after the forward passes (old/ref log-probs, values); may change rewards, not drop
    after_update: List[str] = field(default_factory=list)  # after the critic and actor updates (metrics hold theirs)
    after_eval: List[str] = field(default_factory=list)  # after a validation (metrics hold the val-* results)


@dataclass
class TrainerConfig:
    project_name: str = "verl_examples"  # tracker project (MLflow experiment)
    experiment_name: str = "gsm8k"  # tracker run name
    logger: List[str] = field(default_factory=lambda: ["console", "wandb"])  # console | mlflow | wandb (offline without WANDB_API_KEY) | tensorboard
    device: str = "cuda"  # cuda | cpu
    nnodes: int = 1  # nodes in the Ray cluster
    n_gpus_per_node: int = 8  # devices (GPUs, or CPU slots on CPU) per node
    placement: str = "colocated"  # colocated | split
    total_epochs: int = 30  # passes over the training prompts
    total_training_steps: Optional[int] = None  # stop after this many steps; None = epochs x batches
    critic_warmup: int = 0  # critic-only steps before the actor trains
    test_freq: int = -1  # eval every N steps (-1 = never)
    val_before_train: bool = True  # eval at step 0
    save_freq: int = -1  # checkpoint every N steps (-1 = never)
    max_actor_ckpt_to_keep: Optional[int] = None  # keep the newest N global_step_* checkpoints; None or <= 0 = keep all
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"  # run directory: global_step_N/{actor,critic}, latest_checkpointed_iteration.txt, resolved config, report
    log_val_generations: int = 0  # log N validation samples (input, output, score, step) per validation as a table: wandb Table, MLflow JSON artifact, tensorboard text
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: Optional[str] = None  # checkpoint dir when resume_mode=resume_path
    seed: int = 1  # driver seed
    debug: DebugConfig = field(default_factory=DebugConfig)  # debugging modes
    hooks: HooksConfig = field(default_factory=HooksConfig)  # user stages at named points of the step (trainer.pipeline)
    pipeline: Optional[str] = None  # 'pkg.module:function' f(step: trainer.pipeline.Step) replacing the step (default: trainer.pipeline.default_pipeline)
    parallel_phases: Optional[bool] = None  # run the old-log-prob, reference and critic-value passes at the same time (each on its own group); null = on for trainer.device=cpu, off on GPU (the groups share each GPU: concurrent passes raise its peak memory and time-slice it)


@dataclass
class AsyncTrainingConfig:
    mode: str = "sync"  # sync | one_step_off (step t+1's batch is generated while step t trains, one policy version stale; needs trainer.placement=split) | fully_async (a rollouter thread generates continuously into a bounded queue; trainer/async_rollout.py; needs trainer.placement=split)
    staleness_threshold: float = 0.1  # fully_async (verl's meaning): per weight version the engines start at most ppo_mini_batch_size x require_batches x trigger_parameter_sync_step x (1 + staleness_threshold) prompts; a sample more than ceil(staleness_threshold) versions behind is dropped (counted)
    trigger_parameter_sync_step: int = 4  # fully_async: trainer updates (steps) between weight pushes to the engines
    partial_rollout: bool = True  # fully_async: at a weight push in-flight generations stop and then continue under the new weights (each token keeps the version that sampled it); false = the push waits for them
    require_batches: int = 1  # fully_async: mini-batches per trainer step (the step takes ppo_mini_batch_size x require_batches prompt groups)


@dataclass
class CoxswainConfig:
    data: DataConfig = field(default_factory=DataConfig)  # datasets and batch sizes
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)  # policy side
    critic: CriticConfig = field(default_factory=CriticConfig)  # value side
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)  # rewards
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)  # user scorer
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # RL math
    attribution_driven_credit_assignment: AdcaConfig = field(default_factory=AdcaConfig)  # ADCA-GRPO
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # loop, logging, checkpoints
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)  # rollout / training overlap


# ----------------------------------------------------------------------------------------------
# key discovery, legacy keys, choices
# ----------------------------------------------------------------------------------------------
LEGACY_KEYS = {
    "actor_rollout_ref.actor.tis_imp_ratio_cap": (
        "was removed with verl's TIS rework: use algorithm.rollout_is_threshold=<cap> "
        "(with algorithm.rollout_is_level=token and algorithm.rollout_is_mode=truncate for the old behaviour; "
        "see also algorithm.rollout_is, rollout_is_threshold_lower, rollout_is_veto_threshold)"
    ),
    "actor_rollout_ref.rollout.tis_imp_ratio_cap": "was removed: use algorithm.rollout_is_threshold=<cap>",
}

# Other spellings of a key that a pasted recipe may use: alias -> canonical key. The loader moves an
# alias's value to its canonical key (both set -> an error naming both).
KEY_ALIASES: dict[str, str] = {
    # verl >= 0.7 moved the weight-sync bucket under checkpoint_engine
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes":
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
    # verl >= 0.6's top-level reward_manager section names the same manager
    "reward_manager.name": "reward_model.reward_manager",
    # the ADCA seed (AgentEvolver) reads these at either level: its recommended YAML and its trainer differ
    "attribution_driven_credit_assignment.adca_grpo.skip_type": "attribution_driven_credit_assignment.skip_type",
    "attribution_driven_credit_assignment.enable_adca_metric":
        "attribution_driven_credit_assignment.adca_grpo.enable_adca_metric",
    "attribution_driven_credit_assignment.consistent_scale": "attribution_driven_credit_assignment.adca_grpo.consistent_scale",
    "attribution_driven_credit_assignment.pos_unconsistent_scale":
        "attribution_driven_credit_assignment.adca_grpo.pos_unconsistent_scale",
    "attribution_driven_credit_assignment.neg_unconsistent_scale":
        "attribution_driven_credit_assignment.adca_grpo.neg_unconsistent_scale",
}

# the keywords verl's reward managers take (reward_model.reward_kwargs go to the manager's constructor)
DAPO_KWARGS = ("max_resp_len", "overlong_buffer_cfg")
OVERLONG_FIELDS = ("enable", "len", "penalty_factor", "log")


def _reward_errors(cfg) -> list[str]:
    """reward_model.reward_kwargs / custom_reward_function.reward_kwargs against the chosen manager,
    with verl's meaning: what verl would reject with a TypeError or an assertion is named here."""
    rm, crf, errs = cfg.reward_model, cfg.custom_reward_function, []
    kind = rm.reward_manager
    kw = OmegaConf.to_container(rm.reward_kwargs, resolve=True) or {}
    move = "keywords for your scorer go in custom_reward_function.reward_kwargs"
    if kind in ("naive", "prime") and kw:
        hint = (" DAPO's overlong shaping needs reward_model.reward_manager=dapo." if "overlong_buffer_cfg" in kw else "")
        errs.append(f"reward_model.reward_kwargs {sorted(kw)}: the {kind} reward manager takes no keywords "
                    f"(verl would fail with a TypeError); {move}.{hint}")
    if kind == "dapo":
        bad = sorted(set(kw) - set(DAPO_KWARGS))
        if bad:
            errs.append(f"reward_model.reward_kwargs {bad}: the dapo reward manager takes only {list(DAPO_KWARGS)}; {move}.")
        ob = kw.get("overlong_buffer_cfg")
        if ob is not None and not isinstance(ob, dict):
            errs.append(f"reward_model.reward_kwargs.overlong_buffer_cfg={ob!r} must be a mapping of {list(OVERLONG_FIELDS)}.")
        elif ob is not None:
            bad = sorted(set(ob) - set(OVERLONG_FIELDS))
            if bad:
                errs.append(f"reward_model.reward_kwargs.overlong_buffer_cfg has {bad}; its fields are {list(OVERLONG_FIELDS)}.")
            mx = kw.get("max_resp_len")
            if mx is None:
                errs.append("reward_model.reward_kwargs.overlong_buffer_cfg needs reward_model.reward_kwargs.max_resp_len "
                            f"(as verl asserts): add +reward_model.reward_kwargs.max_resp_len={cfg.data.max_response_length}.")
            elif ob.get("enable") and not (0 < int(ob.get("len", 4)) <= int(mx)):
                errs.append(f"reward_model.reward_kwargs.overlong_buffer_cfg.len={ob.get('len', 4)} must be in "
                            f"(0, max_resp_len={mx}].")
            if ob.get("enable") and rm.overlong_buffer.enable:
                errs.append("overlong shaping is on twice (reward_model.overlong_buffer.enable and "
                            "reward_model.reward_kwargs.overlong_buffer_cfg.enable): keep one spelling.")
        elif "max_resp_len" in kw:
            errs.append("reward_model.reward_kwargs.max_resp_len is the overlong shaping's maximum length: it needs "
                        "reward_model.reward_kwargs.overlong_buffer_cfg (verl fails without one); remove it or add the buffer.")
    if kind == "batch" and not crf.path:
        errs.append("reward_model.reward_manager=batch calls one scorer for the whole batch: set custom_reward_function.path "
                    "(and .name) to a function taking data_sources, solution_strs, ground_truths, extra_infos.")
    if crf.reward_kwargs and not crf.path:
        errs.append("custom_reward_function.reward_kwargs are bound to custom_reward_function.path's function: set the "
                    "path, or remove them (the built-in scorers take no keywords).")
    return errs


def _reward_model_errors(cfg) -> list[str]:
    """A learned reward model (``reward_model.enable``): its checkpoint, micro-batching, and what does not
    combine with it (trainer/rewards/reward_model.py states the rule)."""
    rm, errs = cfg.reward_model, []
    if not rm.enable:
        if rm.model.path is not None:
            errs.append(f"reward_model.model.path={rm.model.path} is set but reward_model.enable=false, so nothing would "
                        f"read it: set reward_model.enable=true to score with it, or remove the line.")
        return errs
    if not rm.model.path:
        errs.append("reward_model.enable=true needs reward_model.model.path: a Hugging Face *ForSequenceClassification "
                    "checkpoint with num_labels=1 (its head is named 'score') that reads the actor's token ids.")
    size = rm.micro_batch_size_per_gpu
    if size is None and not rm.use_dynamic_bsz:
        errs.append("reward_model.micro_batch_size_per_gpu is not set: give responses per reward-model forward "
                    "(reward_model.micro_batch_size_per_gpu=N) or fill micro-batches by a token budget "
                    "(reward_model.use_dynamic_bsz=true with reward_model.forward_max_token_len_per_gpu), as verl requires.")
    elif size is not None and size < 1:
        errs.append(f"reward_model.micro_batch_size_per_gpu={size} must be >= 1.")
    if rm.use_dynamic_bsz and rm.forward_max_token_len_per_gpu < 1:
        errs.append(f"reward_model.forward_max_token_len_per_gpu={rm.forward_max_token_len_per_gpu} must be >= 1.")
    ob = (OmegaConf.to_container(rm.reward_kwargs, resolve=True) or {}).get("overlong_buffer_cfg") or {}
    if rm.overlong_buffer.enable or ob.get("enable"):
        errs.append("DAPO overlong shaping (reward_model.overlong_buffer / reward_kwargs.overlong_buffer_cfg) with "
                    "reward_model.enable=true: verl's reward managers return the reward model's score unchanged, so "
                    "verl never shapes it; shaping a learned score is not built. Remove one of the two.")
    if rm.max_length is not None:
        if rm.max_length < 1:
            errs.append(f"reward_model.max_length={rm.max_length} must be >= 1 (or null: the whole input).")
        elif rm.model.input_tokenizer is None:
            errs.append("reward_model.max_length truncates re-tokenised reward-model inputs, and with "
                        "reward_model.model.input_tokenizer=null nothing is re-tokenised (the RM reads the actor's ids "
                        "whole): set input_tokenizer to the actor's tokenizer path, or remove max_length.")
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        errs.append("reward_model.enable=true with actor_rollout_ref.rollout.multi_turn.enable=true: an episode's reward "
                    "is the environment's return; scoring whole episodes with a reward model is not built.")
    return errs


# Enumerated string fields: key -> allowed values (a "pkg.module:function" is also allowed where noted).
CHOICES: dict[str, tuple[tuple[str, ...], bool]] = {
    "algorithm.adv_estimator": (
        ("gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
         "remax", "grpo_passk", "adca_grpo", "grpo_vectorized", "rloo_vectorized", "opo", "gpg", "gdpo",
         "optimal_token_baseline", "tir_optimal_token_baseline", "cpgd"), True),
    "algorithm.weight_factor_in_cpgd": (("STD_weight", "clip_filter_like_weight", "naive"), False),
    "algorithm.kl_penalty": (("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"), False),
    "algorithm.kl_ctrl.type": (("fixed", "adaptive"), False),
    "algorithm.rollout_is_level": (("token", "sequence", "geometric"), False),
    "algorithm.rollout_is_mode": (("truncate", "clip"), False),
    "algorithm.rollout_rs_divergence": (("k1", "k2", "k3"), False),
    "actor_rollout_ref.actor.loss_agg_mode": (
        ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"), False),
    "actor_rollout_ref.actor.kl_loss_type": (("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"), False),
    "actor_rollout_ref.actor.policy_loss.loss_mode": (
        ("vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "sapo", "dro", "dppo_tv", "dppo_kl",
         "cpgd", "bypass_mode"), True),
    "actor_rollout_ref.actor.strategy": (("megatron", "deepspeed"), False),
    "actor_rollout_ref.ref.strategy": (("megatron", "deepspeed"), False),
    "critic.strategy": (("megatron", "deepspeed"), False),
    "reward_model.strategy": (("megatron", "deepspeed"), False),
    "actor_rollout_ref.rollout.name": (("native", "sglang"), False),
    "actor_rollout_ref.actor.router_replay.mode": (("disabled", "R2", "R3"), False),
    "async_training.mode": (("sync", "one_step_off", "fully_async"), False),
    "actor_rollout_ref.ref.router_replay.mode": (("disabled", "R2", "R3"), False),
    "reward_model.reward_manager": (("naive", "prime", "dapo", "batch"), False),
    "actor_rollout_ref.rollout.mode": (("sync", "async", "server"), False),
    "actor_rollout_ref.actor.optim.lr_decay_style": (("constant", "cosine", "linear"), False),
    "critic.optim.lr_decay_style": (("constant", "cosine", "linear"), False),
    "critic.loss_agg_mode": (
        ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"), False),
    "data.truncation": (("error", "left", "right"), False),
    "data.on_bad_row": (("error", "skip"), False),
    "trainer.device": (("cpu", "cuda"), False),
    "trainer.placement": (("colocated", "split"), False),
    "trainer.resume_mode": (("auto", "disable", "resume_path"), False),
    "attribution_driven_credit_assignment.skip_type": (("skip_small_adv", "skip_all_neg", "none"), False),
    "attribution_driven_credit_assignment.overall_score_source": (("token_level_rewards", "advantages"), False),
    "attribution_driven_credit_assignment.evaluation_type": (("api", "local"), False),
    "attribution_driven_credit_assignment.adca_grpo.prm_scheme": (("decouple", "allocation"), False),
    "attribution_driven_credit_assignment.adca_grpo.orm_distribution": (("last_step", "all_steps"), False),
}


def _field_type(tp):
    """Strip Optional[...] from an annotation."""
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _schema_keys(cls=CoxswainConfig, prefix="") -> tuple[dict[str, Any], set[str]]:
    """All leaf keys ``{dotted: type}`` of the schema, and the prefixes of free-form dict fields."""
    leaves, open_prefixes = {}, set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        tp = _field_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            sub_leaves, sub_open = _schema_keys(tp, key + ".")
            leaves.update(sub_leaves)
            open_prefixes |= sub_open
        else:
            leaves[key] = hints[f.name]
            if typing.get_origin(tp) in (dict, Dict) or tp is Any:
                open_prefixes.add(key)
    return leaves, open_prefixes


_LEAVES, _OPEN = _schema_keys()
_SECTIONS = {k.rsplit(".", i)[0] for k in _LEAVES for i in range(1, k.count(".") + 1)}


def _type_name(tp) -> str:
    base = _field_type(tp)
    name = getattr(base, "__name__", None) or str(base).replace("typing.", "")
    return f"{name} or null" if base is not tp else name


def closest_key(key: str) -> Optional[str]:
    """A valid key that ``key`` is plausibly a misspelling of, or None: the same leaf name under another
    section (a moved key), a close spelling of the whole key, or a close spelling of the leaf among its
    siblings. Suggestions below these similarity bars are worse than none."""
    from trainer.verl_compat import VERL_MEGATRON

    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in (*_LEAVES, *VERL_MEGATRON) if k.rsplit(".", 1)[-1] == leaf]
    tail = [k for k in _LEAVES if k.endswith("." + key)]
    if len(tail) == 1:  # the key given without (part of) its section
        return tail[0]
    if same_leaf:
        m = difflib.get_close_matches(key, same_leaf, n=1, cutoff=0.6)
        if m:
            return m[0]
    m = difflib.get_close_matches(key, list(_LEAVES) + sorted(_SECTIONS), n=1, cutoff=0.9)
    if m:
        return m[0]
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    siblings = {k.rsplit(".", 1)[-1]: k for k in _LEAVES if k.rsplit(".", 1)[0] == parent}
    siblings.update({k.rsplit(".", 1)[-1]: k for k in _SECTIONS if k.rsplit(".", 1)[0] == parent and "." in k})
    m = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.75)
    return siblings[m[0]] if m else None


def _is_schema_key(key: str) -> bool:
    return key in _LEAVES or key in _SECTIONS or any(key.startswith(p + ".") for p in _OPEN)


def _flatten(node, prefix="") -> dict[str, Any]:
    """A nested mapping -> ``{dotted key: value}``; free-form dict fields and empty mappings stay whole."""
    out = {}
    items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else node.items()
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (dict, DictConfig)) and len(v) and key not in _OPEN and key not in _LEAVES:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = OmegaConf.to_container(v, resolve=False) if isinstance(v, (DictConfig, ListConfig)) else v
    return out


class _Load:
    """One load: every problem of every layer (files, hydra composition, command line) is collected and
    reported together; ``notes`` lists the verl keys accepted with no effect."""

    def __init__(self):
        self.cfg = OmegaConf.structured(CoxswainConfig)
        self.default = OmegaConf.structured(CoxswainConfig)
        self.errors: list[str] = []
        self.notes: list[str] = []
        self.set_by: dict[str, tuple[str, str]] = {}  # canonical key -> (origin, spelling) (two spellings in one layer: an error)

    def error(self, origin: str, msg: str) -> None:
        self.errors.append(f"{origin}: {msg}")

    def set(self, key: str, value, origin: str, *, delete: bool = False, from_base: bool = False) -> None:
        """Apply one ``key=value`` (or ``~key``) of a layer, or record why it cannot be applied."""
        key = spelled = key.strip()
        key = KEY_ALIASES.get(key, key)
        prev = self.set_by.get(key)
        if prev is not None and prev[0] == origin and prev[1] != spelled:  # two spellings of one setting in one layer
            self.error(origin, f"'{prev[1]}' and '{spelled}' are the same setting; give only one.")
            return
        if key in LEGACY_KEYS:
            self.error(origin, f"'{key}' {LEGACY_KEYS[key]}")
            return
        if key.split(".", 1)[0] == "hydra" or key.rsplit(".", 1)[-1] == "_target_":
            return  # hydra's own settings (run dirs, job logging) and verl's dataclass hints: nothing to train
        if not _is_schema_key(key):
            kind, why = verl_only(key, value)
            if kind == "ok" or (kind == "refused" and delete):
                return
            if kind == "no_effect":
                self.notes.append(f"{key}={value!r}: no effect in Coxswain ({why})")
                return
            if kind == "refused":
                self.error(origin, why)
                return
            guess = closest_key(key)
            self.error(origin, f"unknown config key '{key}'." + (f" Did you mean '{guess}'?" if guess else "")
                       + " (all keys: python -m trainer.main --help-keys)")
            return
        if delete:
            value = OmegaConf.select(self.default, key, default=None)
            if isinstance(value, (DictConfig, ListConfig)):
                value = OmegaConf.to_container(value, resolve=False)
        elif key in _LEAVES and isinstance(value, str) and not value.startswith("${"):
            base = _field_type(_LEAVES[key])
            if typing.get_origin(base) in (list, List):  # verl's trainer.logger=console: a one-item list
                value = [v.strip() for v in value.split(",") if v.strip()]
        try:
            OmegaConf.update(self.cfg, key, value, merge=isinstance(value, dict))
        except ValidationError as e:
            expected = _type_name(_LEAVES[key]) if key in _LEAVES else "a value of the schema's type"
            self.error(origin, f"key '{key}' got {value!r} ({type(value).__name__}), but expects {expected}.")
            return
        except OmegaConfBaseException as e:
            self.error(origin, f"key '{key}': {getattr(e, 'msg', e)}")
            return
        self.set_by[key] = (origin, spelled)

    def layer(self, node, origin: str, *, from_base: bool = False) -> None:
        for key, value in _flatten(node).items():
            self.set(key, value, origin, from_base=from_base)


def _parse_argv(argv: list[str]) -> tuple[list[str], Optional[str], Optional[str], list[str], list[str]]:
    """``[--config FILE]... [--config-path DIR --config-name NAME] overrides...`` -> its parts and errors."""
    files, overrides, errs = [], [], []
    opts = {"--config-path": None, "--config-name": None, "--config-dir": None}
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=")
        if name in ("--config", "--config-file", "-c") or name in opts or (name == "-cp" or name == "-cn"):
            name = {"-cp": "--config-path", "-cn": "--config-name"}.get(name, name)
            if not eq:
                if i + 1 >= len(argv):
                    errs.append(f"{a} needs a value")
                    break
                val, i = argv[i + 1], i + 1
            if name in opts:
                opts[name] = val.strip("'\"")
            else:
                files.append(val)
        elif a.startswith("--"):
            errs.append(f"unknown option '{a}': use --config FILE.yaml, --config-path DIR --config-name NAME, "
                        f"and key.sub=value overrides")
        else:
            overrides.append(a)
        i += 1
    path = opts["--config-path"] or opts["--config-dir"]
    return files, path, opts["--config-name"], overrides, errs


# verl's trainer config names: a --config-name that names one of them (with no such file in the
# config path) means verl's defaults, which are this schema's
VERL_BASES = {"ppo_megatron_trainer": "megatron", "ppo_trainer": "fsdp"}


def _base_dir() -> str:
    """A config dir holding ``ppo_megatron_trainer.yaml`` written from this schema (verl's defaults), so
    a user's hydra config with ``defaults: [ppo_megatron_trainer, _self_]`` composes with no verl checkout."""
    import tempfile

    d = tempfile.mkdtemp(prefix="coxswain_base_")
    with open(os.path.join(d, "ppo_megatron_trainer.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(CoxswainConfig)))
    return d


def _compose(ld: _Load, path: Optional[str], name: str) -> None:
    """``--config-path/--config-name``: verl's base names mean the schema's defaults; any other config is
    composed with hydra (its ``defaults`` list may name ``ppo_megatron_trainer``) and applied as a layer."""
    origin = f"--config-name={name}"
    stem = name[:-5] if name.endswith(".yaml") else name
    cdir = os.path.abspath(os.path.expanduser(path)) if path else None
    has_file = bool(cdir) and os.path.isfile(os.path.join(cdir, stem + ".yaml"))
    if not has_file and stem in VERL_BASES:
        if VERL_BASES[stem] == "fsdp":
            ld.error(origin, "verl's FSDP trainer config: Coxswain trains with megatron-core; use "
                             "--config-name=ppo_megatron_trainer and the megatron keys named below.")
        return
    if not has_file:
        ld.error(origin, f"no config '{stem}.yaml' in --config-path={path!r}; give the directory that holds it "
                         f"(verl's own names ppo_megatron_trainer / ppo_trainer need no directory).")
        return
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=cdir, version_base=None):
            node = compose(config_name=stem, overrides=[f"hydra.searchpath=[file://{_base_dir()}]"])
    except Exception as e:  # hydra's own errors name the file and the entry
        ld.error(origin, f"cannot compose '{stem}' from {cdir}: {e}")
        return
    finally:
        GlobalHydra.instance().clear()
    ld.layer(node, origin)


def _overrides(ld: _Load, items: list[str]) -> None:
    """Command-line overrides in hydra's grammar (``key=v``, ``+key=v``, ``++key=v``, ``~key``, lists,
    quoted strings, interpolations), each parsed on its own so that one bad item hides no other."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for item in items:
        try:
            (ov,) = parser.parse_overrides([item])
        except Exception as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            ld.error("command line", f"cannot parse '{item}': {msg}. Use key.sub=value (lists: key=[a,b]).")
            continue
        if ov.is_delete():
            ld.set(ov.key_or_group, None, "command line", delete=True)
            continue
        if ov.is_sweep_override():
            ld.error("command line", f"'{item}' is a hydra sweep (multirun); give one value (a comma list as one value is quoted: key='a,b').")
            continue
        try:
            value = ov.value()
        except Exception as e:
            ld.error("command line", f"cannot parse the value of '{item}': {e}")
            continue
        ld.set(ov.key_or_group, _plain_value(value), "command line")


def _plain_value(v):
    """hydra's parsed values -> plain Python (its lists/dicts are already plain; quoted strings stay str)."""
    if isinstance(v, dict):
        return {k: _plain_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain_value(x) for x in v]
    return v


def parse_overrides(overrides: list[str]) -> DictConfig:
    """``key.sub=value`` strings -> the full config they give on top of the schema's defaults (errors raised)."""
    ld = _Load()
    _overrides(ld, overrides)
    if ld.errors:
        raise ConfigError(_report(ld.errors))
    return ld.cfg


def _report(errors: list[str]) -> str:
    n = len(errors)
    return (f"{n} problem{'s' if n > 1 else ''} in the configuration:\n" +
            "\n".join(f"  {i}. {e}" for i, e in enumerate(errors, 1)))


LAST_LOAD_NOTES: list[str] = []  # the verl keys the last load accepted with no effect (cli prints them)


def load_config(argv: Optional[list[str]] = None, *, validate_config: bool = True) -> DictConfig:
    """Build the resolved config from ``[--config FILE.yaml]... [--config-path DIR --config-name NAME]
    key=value ...``. Every problem (unknown keys, types, refused features, cross-field checks) is
    collected and raised together as one ``ConfigError``."""
    files, path, name, overrides, errs = _parse_argv(list(argv or []))
    ld = _Load()
    for e in errs:
        ld.error("command line", e)
    if name:
        _compose(ld, path, name)
    elif path:
        ld.error("--config-path", "needs --config-name too")
    for f in files:
        if not os.path.isfile(f):
            ld.error("--config", f"file '{f}' does not exist")
            continue
        node = OmegaConf.load(f)
        if not isinstance(node, DictConfig):
            ld.error(f, "the top level must be a mapping of config sections")
            continue
        node = OmegaConf.masked_copy(node, [k for k in node if k != "defaults"]) if "defaults" in node else node
        ld.layer(node, f)
    _overrides(ld, overrides)
    LAST_LOAD_NOTES[:] = ld.notes
    if validate_config:
        try:
            ld.errors.extend(validation_errors(ld.cfg))
        except OmegaConfBaseException as e:  # an interpolation that cannot resolve, a missing mandatory value
            ld.errors.append(f"{getattr(e, 'full_key', '') or 'config'}: {getattr(e, 'msg', e)}")
        if not ld.errors:  # every value must resolve, including the ones no check reads
            try:
                OmegaConf.to_container(ld.cfg, resolve=True, throw_on_missing=True)
            except OmegaConfBaseException as e:
                ld.errors.append(f"{getattr(e, 'full_key', '') or 'config'}: {getattr(e, 'msg', e)}")
    if ld.errors:
        raise ConfigError(_report(ld.errors))
    return ld.cfg


def deepspeed_roles(cfg) -> dict:
    """The roles that train (or score) on DeepSpeed: ``{prefix: (role section, its deepspeed_config)}``."""
    arr = cfg.actor_rollout_ref
    roles = {"actor_rollout_ref.actor": arr.actor, "actor_rollout_ref.ref": arr.ref, "critic": cfg.critic,
             "reward_model": cfg.reward_model}
    return {k: v for k, v in roles.items() if v.strategy == "deepspeed"}


def deepspeed_errors(cfg) -> list[str]:
    """What the DeepSpeed strategy cannot take, per role, with the reason."""
    errs = []
    arr = cfg.actor_rollout_ref
    default = DeepSpeedConfig()
    for prefix, role in (("actor_rollout_ref.actor", arr.actor), ("actor_rollout_ref.ref", arr.ref), ("critic", cfg.critic),
                         ("reward_model", cfg.reward_model)):
        if role.strategy != "deepspeed":
            changed = sorted(k for k in vars(default) if role.deepspeed_config[k] != getattr(default, k))
            if changed:
                errs.append(f"{prefix}.deepspeed_config.{{{', '.join(changed)}}} set, but {prefix}.strategy="
                            f"{role.strategy}: set {prefix}.strategy=deepspeed, or remove them.")
    for prefix, role in deepspeed_roles(cfg).items():
        ds, mg = role.deepspeed_config, role.megatron
        if ds.zero_stage not in (1, 2, 3):
            errs.append(f"{prefix}.deepspeed_config.zero_stage={ds.zero_stage}: use 1, 2 or 3 (stage 0 is plain data "
                        f"parallelism; the megatron strategy does that too).")
        dt = ds.dtype or mg.dtype
        if dt not in ("float32", "bfloat16", "float16"):
            errs.append(f"{prefix}.deepspeed_config.dtype={dt!r}: use float32, bfloat16 or float16.")
        sizes = {"tensor_model_parallel_size": mg.tensor_model_parallel_size,
                 "pipeline_model_parallel_size": mg.pipeline_model_parallel_size,
                 "context_parallel_size": mg.context_parallel_size,
                 "expert_model_parallel_size": mg.expert_model_parallel_size}
        big = {k: v for k, v in sizes.items() if v not in (None, 1)}
        if big or mg.virtual_pipeline_model_parallel_size not in (None, 1):
            errs.append(f"{prefix}.strategy=deepspeed shards by ZeRO over data parallelism only, but {prefix}.megatron "
                        f"asks for model parallelism {big or {'virtual_pipeline_model_parallel_size': mg.virtual_pipeline_model_parallel_size}}: "
                        f"set those to 1, or use strategy=megatron.")
        if (ds.param_offload or ds.optimizer_offload) and cfg.trainer.device == "cpu":
            errs.append(f"{prefix}.deepspeed_config.param_offload / optimizer_offload move state from the GPU to CPU "
                        f"memory; with trainer.device=cpu everything already is there: remove them.")
        if ds.param_offload and ds.zero_stage != 3:
            errs.append(f"{prefix}.deepspeed_config.param_offload needs zero_stage=3 (DeepSpeed offloads parameters "
                        f"only when it partitions them).")
        if getattr(role, "router_replay", None) is not None and role.router_replay.mode != "disabled":
            errs.append(f"{prefix}.router_replay with strategy=deepspeed: routing replay is built into the megatron "
                        f"routers only; use strategy=megatron for MoE routing replay.")
        optim = getattr(role, "optim", None)
        if optim is not None and prefix != "actor_rollout_ref.ref" and optim.optimizer != "adam":
            errs.append(f"{prefix}.optim.optimizer={optim.optimizer!r} with strategy=deepspeed: the DeepSpeed strategy "
                        f"trains with AdamW (optimizer=adam).")
    return errs


# megatron-core's activation recompute settings accepted in ``*.megatron.override_transformer_config``
RECOMPUTE_KEYS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")
# megatron's mixture-of-experts losses, as verl passes them through override_transformer_config
MOE_KEYS = ("moe_aux_loss_coeff", "moe_router_load_balancing_type", "moe_z_loss_coeff")
MOE_BALANCING = ("aux_loss", "seq_aux_loss", "none")


def moe_settings(mcfg) -> dict:
    """The MoE loss settings of a role's ``override_transformer_config`` (megatron TransformerConfig
    fields; the load-balancing loss is on only with a positive coefficient)."""
    over = {k: v for k, v in dict(mcfg.override_transformer_config).items() if k in MOE_KEYS}
    if float(over.get("moe_aux_loss_coeff") or 0.0) > 0 and "moe_router_load_balancing_type" not in over:
        over["moe_router_load_balancing_type"] = "aux_loss"  # megatron's default type, verl's too
    return over


def recompute_settings(enable: bool, mcfg) -> dict | None:
    """megatron's recompute settings of a role: verl's ``enable_gradient_checkpointing`` gives full
    recompute of every layer (``full`` / ``uniform`` / 1 layer per checkpoint), and the
    ``override_transformer_config`` recompute keys refine or replace it. None: no recompute."""
    over = {k: v for k, v in dict(mcfg.override_transformer_config).items() if k in RECOMPUTE_KEYS}
    if not enable and not over.get("recompute_granularity"):
        return None
    base = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    out = {**base, **over}
    if out["recompute_granularity"] == "selective":  # megatron: method / num_layers are for full recompute
        out.pop("recompute_method"), out.pop("recompute_num_layers")
    if "recompute_modules" in out:
        out["recompute_modules"] = list(out["recompute_modules"])
    return out


def world_size(cfg: DictConfig) -> int:
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def _async_errors(cfg: DictConfig) -> list[str]:
    """one_step_off and fully_async overlap generation with training: the engines need their own
    resources. fully_async's keys (verl's fully-async recipe) apply to that mode only."""
    at, errs = cfg.async_training, []
    if at.mode in ("one_step_off", "fully_async"):
        if cfg.trainer.placement != "split":
            errs.append(f"async_training.mode={at.mode} generates while the trainer trains, on the engines' own "
                        f"resources: set trainer.placement=split (colocated engines share the trainer's).")
        if cfg.trainer.debug.train_only:
            errs.append(f"async_training.mode={at.mode} with trainer.debug.train_only=true: replayed batches are not "
                        f"generated; remove one of the two.")
    defaults = AsyncTrainingConfig()
    if at.mode != "fully_async":
        for key in ("staleness_threshold", "trigger_parameter_sync_step", "partial_rollout", "require_batches"):
            if at[key] != getattr(defaults, key):
                errs.append(f"async_training.{key}={at[key]} applies to async_training.mode=fully_async only (this run "
                            f"is mode={at.mode}); set the mode or remove the line.")
        return errs
    a, r, d = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.data
    if not at.staleness_threshold >= 0:
        errs.append(f"async_training.staleness_threshold={at.staleness_threshold} must be >= 0 (verl's fraction of "
                    f"extra prompts per weight version).")
    if at.trigger_parameter_sync_step < 1:
        errs.append(f"async_training.trigger_parameter_sync_step={at.trigger_parameter_sync_step} must be >= 1.")
    if at.require_batches < 1:
        errs.append(f"async_training.require_batches={at.require_batches} must be >= 1.")
    elif d.train_batch_size != a.ppo_mini_batch_size * at.require_batches:
        errs.append(f"async_training.mode=fully_async: a trainer step takes actor.ppo_mini_batch_size x "
                    f"async_training.require_batches = {a.ppo_mini_batch_size} x {at.require_batches} prompt groups "
                    f"(verl's rule), but data.train_batch_size={d.train_batch_size}: set data.train_batch_size="
                    f"{a.ppo_mini_batch_size * at.require_batches} (or change require_batches).")
    if at.partial_rollout:
        if r.multi_turn.enable:
            errs.append("async_training.partial_rollout=true resumes single-turn responses only; with "
                        "rollout.multi_turn.enable=true set async_training.partial_rollout=false.")
        if r.name == "sglang":
            errs.append("async_training.partial_rollout=true resumes aborted requests on the native engine only (built "
                        "and tested on CPU); with rollout.name=sglang set async_training.partial_rollout=false.")
    if cfg.trainer.debug.rollout_only:
        errs.append("async_training.mode=fully_async with trainer.debug.rollout_only=true: without updates there are "
                    "no weight pushes, and the rollouter stops at its per-version quota; remove one of the two.")
    if cfg.trainer.critic_warmup:
        errs.append("async_training.mode=fully_async with trainer.critic_warmup > 0 is not built: the rollouter's weight "
                    "versions count actor updates; set trainer.critic_warmup=0.")
    return errs


def _pipeline_errors(cfg: DictConfig) -> list[str]:
    """trainer.hooks / trainer.pipeline name importable functions (imported now, so a typo fails at load)."""
    from trainer.pipeline import load_callable

    t, errs = cfg.trainer, []
    specs = [(f"trainer.hooks.{p}", s) for p, lst in t.hooks.items() for s in (lst or [])]
    specs += [("trainer.pipeline", t.pipeline)] if t.pipeline else []
    for key, spec in specs:
        try:
            load_callable(spec, key)
        except ValueError as e:
            errs.append(str(e))
    return errs


def _routing_replay_errors(cfg: DictConfig) -> list[str]:
    """R3 routing replay: the engines record, the replaying roles read; each half needs the other."""
    arr, r = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout
    replaying = [f"actor_rollout_ref.{role}.router_replay.mode=R3" for role in ("actor", "ref")
                 if arr[role].router_replay.mode == "R3"]
    errs = []
    if replaying and not r.enable_rollout_routing_replay:
        errs.append(f"{' and '.join(replaying)} replays the rollout engine's expert choices, which the engines only "
                    f"return with actor_rollout_ref.rollout.enable_rollout_routing_replay=true: add that line.")
    if r.enable_rollout_routing_replay and not replaying:
        errs.append("actor_rollout_ref.rollout.enable_rollout_routing_replay=true records every token's experts but no "
                    "role replays them: add actor_rollout_ref.actor.router_replay.mode=R3, or remove the line.")
    if replaying and r.name == "sglang":
        errs.append("R3 routing replay with actor_rollout_ref.rollout.name=sglang is not built yet (the SGLang adapter "
                    "does not return routed experts); it runs with the native engine.")
    if replaying and r.mode != "sync":
        errs.append(f"R3 routing replay with actor_rollout_ref.rollout.mode={r.mode} (the HTTP fleet) is not built yet: "
                    f"the servers do not return routed experts; use rollout.mode=sync.")
    if replaying and r.multi_turn.enable:
        errs.append("R3 routing replay with multi-turn rollouts is not built yet: each turn re-prefills the context, "
                    "so a trajectory has no single recorded routing; remove router_replay or multi_turn.enable.")
    return errs


def validate(cfg: DictConfig) -> None:
    """Raise one ``ConfigError`` listing every cross-field problem of ``cfg``."""
    errs = validation_errors(cfg)
    if errs:
        raise ConfigError(_report(errs))


def validation_errors(cfg: DictConfig) -> list[str]:
    """Cross-field checks and the refusal table. Every message names all the keys involved and what to
    change. Nothing here looks at this machine's hardware (a GPU recipe resolves on a CPU login node);
    ``trainer.main.check_supported`` does that at run time."""
    from trainer.plan import need_critic, need_ref

    errs: list[str] = list(refusals(cfg))
    r0 = cfg.actor_rollout_ref.rollout
    if r0._get_node("name")._is_missing():
        errs.append("actor_rollout_ref.rollout.name is required (as in verl): native (torch engine, CPU or GPU) or "
                    "sglang (GPU).")
        OmegaConf.update(cfg, "actor_rollout_ref.rollout.name", "native")  # so the checks below can run
    elif r0.name in OTHER_ENGINES:
        errs.append(f"actor_rollout_ref.rollout.name={r0.name}: Coxswain's engines are sglang (GPU) and native (CPU or "
                    f"GPU); use actor_rollout_ref.rollout.name=sglang.")
    for key, (allowed, pluggable) in CHOICES.items():
        val = OmegaConf.select(cfg, key)
        if key == "actor_rollout_ref.rollout.name" and val in OTHER_ENGINES:
            continue  # its own message below
        if val is None or val in allowed or (pluggable and ":" in str(val)):
            continue
        guess = difflib.get_close_matches(str(val), allowed, n=1)
        extra = " or 'pkg.module:function'" if pluggable else ""
        errs.append(f"{key}='{val}' is not one of {list(allowed)}{extra}."
                    + (f" Did you mean '{guess[0]}'?" if guess else ""))

    d, a, r = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    ws = world_size(cfg)
    sizes_bad = False
    for name, val in (("data.train_batch_size", d.train_batch_size), ("actor_rollout_ref.rollout.n", r.n),
                      ("actor_rollout_ref.actor.ppo_mini_batch_size", a.ppo_mini_batch_size),
                      ("actor_rollout_ref.actor.ppo_epochs", a.ppo_epochs),
                      ("data.max_response_length", d.max_response_length),
                      ("trainer.nnodes", cfg.trainer.nnodes), ("trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node)):
        if val < 1:
            errs.append(f"{name}={val} must be >= 1.")
            sizes_bad = True
    if sizes_bad:  # the divisibility checks below would divide by these
        return errs

    if d.train_batch_size % a.ppo_mini_batch_size:
        errs.append(f"data.train_batch_size={d.train_batch_size} is not divisible by "
                    f"actor_rollout_ref.actor.ppo_mini_batch_size={a.ppo_mini_batch_size}; "
                    f"make train_batch_size a multiple of ppo_mini_batch_size.")
    if d.gen_batch_size is not None and d.gen_batch_size < 1:
        errs.append(f"data.gen_batch_size={d.gen_batch_size} must be >= 1 (or null for data.train_batch_size).")

    rm = cfg.reward_model
    for role, mcfg in (("actor_rollout_ref.actor", a.megatron), ("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.megatron),
                       ("critic", cfg.critic.megatron),
                       *([("reward_model", rm.megatron)] if rm.enable and rm.strategy == "megatron" else [])):
        bad = sorted(set(mcfg.override_transformer_config) - set(RECOMPUTE_KEYS) - set(MOE_KEYS) - {"attention_backend"})
        if bad:
            errs.append(f"{role}.megatron.override_transformer_config: {bad} not supported; only the recompute "
                        f"settings {list(RECOMPUTE_KEYS)}, the MoE losses {list(MOE_KEYS)} (and attention_backend, "
                        f"which has no effect) are.")
        lb = dict(mcfg.override_transformer_config).get("moe_router_load_balancing_type")
        if lb is not None and lb not in MOE_BALANCING:
            errs.append(f"{role}.megatron.override_transformer_config.moe_router_load_balancing_type={lb!r}: "
                        f"choose one of {list(MOE_BALANCING)}.")
        ep, etp = mcfg.expert_model_parallel_size, mcfg.expert_tensor_parallel_size
        if ep < 1 or (etp is not None and etp < 1):
            errs.append(f"{role}.megatron.expert_model_parallel_size={ep} / expert_tensor_parallel_size={etp} must be >= 1.")
        elif ws % ((etp or mcfg.tensor_model_parallel_size) * ep * mcfg.pipeline_model_parallel_size):
            errs.append(f"{role}.megatron.expert_model_parallel_size={ep} x expert_tensor_parallel_size="
                        f"{etp or mcfg.tensor_model_parallel_size} x pipeline_model_parallel_size="
                        f"{mcfg.pipeline_model_parallel_size} does not divide the world size {ws}.")
        tp, pp, cp = mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size, mcfg.context_parallel_size
        if min(tp, pp, cp) < 1:
            errs.append(f"{role}.megatron: tensor/pipeline/context parallel sizes must be >= 1 (got {tp}/{pp}/{cp}).")
            continue
        if ws % (tp * pp * cp):
            errs.append(f"{role}.megatron.tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp}"
                        + (f" x context_parallel_size={cp}" if cp > 1 else "")
                        + f" = {tp * pp * cp} does not divide the world size trainer.nnodes={cfg.trainer.nnodes} x "
                        f"trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node} = {ws}.")
            continue
        if role == "actor_rollout_ref.actor":
            dp = ws // (tp * pp * cp)
            mini = a.ppo_mini_batch_size * r.n
            if mini % dp:
                errs.append(f"actor_rollout_ref.actor.ppo_mini_batch_size={a.ppo_mini_batch_size} x "
                            f"actor_rollout_ref.rollout.n={r.n} = {mini} responses do not split over the data-parallel "
                            f"size {dp} (world {ws} / (TP {tp} x PP {pp} x CP {cp})).")
            elif (a.ppo_micro_batch_size_per_gpu and not a.use_dynamic_bsz and mini // dp > a.ppo_micro_batch_size_per_gpu
                  and (mini // dp) % a.ppo_micro_batch_size_per_gpu):
                errs.append(f"the per-rank mini-batch of {mini // dp} responses (actor_rollout_ref.actor.ppo_mini_batch_size="
                            f"{a.ppo_mini_batch_size} x actor_rollout_ref.rollout.n={r.n} / DP {dp}) is not divisible by "
                            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={a.ppo_micro_batch_size_per_gpu}.")
        vpp = mcfg.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp < 1:
            errs.append(f"{role}.megatron.virtual_pipeline_model_parallel_size={vpp} must be >= 1 (or null).")
        elif vpp is not None and vpp > 1 and pp < 2:
            errs.append(f"{role}.megatron.virtual_pipeline_model_parallel_size={vpp} interleaves pipeline stages: it needs "
                        f"{role}.megatron.pipeline_model_parallel_size >= 2 (got {pp}).")
        elif vpp is not None and vpp > 1 and mcfg.pipeline_layer_split is not None:
            errs.append(f"{role}.megatron.virtual_pipeline_model_parallel_size={vpp} needs an even split: remove "
                        f"{role}.megatron.pipeline_layer_split.")
        split = mcfg.pipeline_layer_split
        if split is not None and len(split) != pp:
            errs.append(f"{role}.megatron.pipeline_layer_split has {len(split)} entries but "
                        f"{role}.megatron.pipeline_model_parallel_size={pp}.")

    for key, size, dyn, dyn_key in (
            ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz,
             "actor_rollout_ref.actor.use_dynamic_bsz"),
            ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", r.log_prob_micro_batch_size_per_gpu,
             r.log_prob_use_dynamic_bsz, "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz"),
            *([("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu, cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz,
                "actor_rollout_ref.ref.log_prob_use_dynamic_bsz")] if need_ref(cfg) else []),
            *([("critic.ppo_micro_batch_size_per_gpu", cfg.critic.ppo_micro_batch_size_per_gpu, cfg.critic.use_dynamic_bsz,
                "critic.use_dynamic_bsz")] if need_critic(cfg) else [])):
        if size is None and not dyn:
            errs.append(f"{key} is not set: give responses per micro-batch ({key}=N) or fill micro-batches by a token "
                        f"budget ({dyn_key}=true), as verl requires.")
        elif size is not None and size < 1:
            errs.append(f"{key}={size} must be >= 1.")
    if r.prompt_length < d.max_prompt_length:
        errs.append(f"actor_rollout_ref.rollout.prompt_length={r.prompt_length} is shorter than data.max_prompt_length="
                    f"{d.max_prompt_length}: the engines could not hold the longest prompt; raise it or leave it unset.")
    errs += _routing_replay_errors(cfg)
    errs += _async_errors(cfg)
    errs += _pipeline_errors(cfg)
    t = cfg.trainer
    if t.total_training_steps is not None and t.total_training_steps < 1:
        errs.append(f"trainer.total_training_steps={t.total_training_steps} must be >= 1 (or null: "
                    f"trainer.total_epochs passes over the training data).")
    if t.total_epochs < 1:
        errs.append(f"trainer.total_epochs={t.total_epochs} must be >= 1.")
    if r.max_num_seqs < 1:
        errs.append(f"actor_rollout_ref.rollout.max_num_seqs={r.max_num_seqs} must be >= 1 (the engines' batch slots).")
    model = cfg.actor_rollout_ref.model
    if model.use_remove_padding and not a.megatron.use_remove_padding:
        errs.append("actor_rollout_ref.model.use_remove_padding=true but actor_rollout_ref.actor.megatron.use_remove_padding="
                    "false: the megatron roles pack by megatron.use_remove_padding; remove one of the two lines.")

    al = cfg.algorithm
    up, lo = al.rollout_is_threshold, al.rollout_is_threshold_lower
    if up is not None and up <= 0:
        errs.append(f"algorithm.rollout_is_threshold={up} must be > 0 (or null to disable rollout IS).")
    if lo is not None and up is not None and lo > up:
        errs.append(f"algorithm.rollout_is_threshold_lower={lo} is greater than algorithm.rollout_is_threshold={up}; "
                    f"the lower bound must be <= the upper bound.")
    if lo is not None and up is None:
        errs.append(f"algorithm.rollout_is_threshold_lower={lo} is set but algorithm.rollout_is_threshold is null "
                    f"(rollout IS disabled); set rollout_is_threshold too.")
    if al.rollout_is_veto_threshold is not None and al.rollout_is_veto_threshold <= 0:
        errs.append(f"algorithm.rollout_is_veto_threshold={al.rollout_is_veto_threshold} must be > 0 (or null to disable the veto).")
    rc = al.rollout_correction
    if (rc.bypass_mode or rc.rollout_is is not None or rc.rollout_rs is not None) and not r.calculate_log_probs:
        errs.append("algorithm.rollout_correction (IS, rejection or bypass mode) needs the sampler's log-probs: set "
                    "actor_rollout_ref.rollout.calculate_log_probs=true.")
    if (up is not None or al.rollout_rs is not None) and not r.calculate_log_probs:
        errs.append("algorithm.rollout_is_threshold / algorithm.rollout_rs need the sampler's log-probs: "
                    "set actor_rollout_ref.rollout.calculate_log_probs=true.")
    if al.rollout_rs is not None:
        if al.rollout_rs not in ("token", "seq_sum", "seq_mean", "seq_max"):
            errs.append(f"algorithm.rollout_rs='{al.rollout_rs}' is not one of ['token', 'seq_sum', 'seq_mean', 'seq_max'] (or null).")
        if al.rollout_rs_threshold is None:
            errs.append("algorithm.rollout_rs is set but algorithm.rollout_rs_threshold is null.")
        elif al.rollout_rs_threshold_lower is not None and al.rollout_rs_threshold_lower > al.rollout_rs_threshold:
            errs.append(f"algorithm.rollout_rs_threshold_lower={al.rollout_rs_threshold_lower} is greater than "
                        f"algorithm.rollout_rs_threshold={al.rollout_rs_threshold}.")

    low = a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio
    high = a.clip_ratio_high if a.clip_ratio_high is not None else a.clip_ratio
    if low < 0 or high < 0:
        errs.append(f"actor_rollout_ref.actor.clip_ratio_low={low} / clip_ratio_high={high} must be >= 0.")
    if a.clip_ratio_c <= 1.0:
        errs.append(f"actor_rollout_ref.actor.clip_ratio_c={a.clip_ratio_c} must be > 1 (dual-clip lower bound of the ratio).")

    if cfg.algorithm.filter_groups.enable:
        if al.adv_estimator == "gae":
            errs.append("algorithm.filter_groups.enable=true needs a group estimator; algorithm.adv_estimator=gae has no groups.")
        if r.n < 2:
            errs.append(f"algorithm.filter_groups.enable=true needs actor_rollout_ref.rollout.n >= 2 (got {r.n}).")
    if al.adv_estimator in ("grpo", "dr_grpo", "rloo", "grpo_passk", "reinforce_plus_plus_baseline", "adca_grpo",
                            "grpo_vectorized", "rloo_vectorized", "opo", "gpg", "gdpo", "cpgd") and r.n < 2:
        errs.append(f"algorithm.adv_estimator={al.adv_estimator} compares responses within a group: "
                    f"set actor_rollout_ref.rollout.n >= 2 (got {r.n}).")

    errs.extend(deepspeed_errors(cfg))
    sf = cfg.reward_model.sandbox_fusion
    if sf.url is not None and not str(sf.url).startswith(("http://", "https://")):
        errs.append(f"reward_model.sandbox_fusion.url={sf.url!r} must be an http(s) URL of the service's run_code endpoint.")
    if sf.max_concurrent < 1 or sf.memory_limit_mb < 1:
        errs.append(f"reward_model.sandbox_fusion.max_concurrent={sf.max_concurrent} and .memory_limit_mb="
                    f"{sf.memory_limit_mb} must be >= 1.")
    ob = cfg.reward_model.overlong_buffer
    if ob.enable and not (0 < ob.len <= d.max_response_length):
        errs.append(f"reward_model.overlong_buffer.len={ob.len} must be in (0, data.max_response_length={d.max_response_length}].")
    errs.extend(_reward_errors(cfg))
    errs.extend(_reward_model_errors(cfg))

    bad_loggers = [x for x in cfg.trainer.logger if x not in LOGGERS]
    if bad_loggers:
        errs.append(f"trainer.logger has {bad_loggers}; supported loggers are {list(LOGGERS)} "
                    f"(MLFLOW_TRACKING_URI selects an MLflow server; wandb runs offline without WANDB_API_KEY).")
    if r.top_k < -1 or not (0.0 < r.top_p <= 1.0) or r.temperature < 0:
        errs.append(f"actor_rollout_ref.rollout.top_k={r.top_k} must be >= -1, top_p={r.top_p} in (0, 1], "
                    f"temperature={r.temperature} >= 0.")
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        errs.append("trainer.resume_mode=resume_path needs trainer.resume_from_path.")
    # rollout.name=sglang with trainer.device=cpu runs SGLang's CPU path (trainer/rollout/sglang_cpu); whether it is
    # installed is checked at run time (trainer.main.check_supported), so --print-config resolves anywhere.
    errs.extend(_rollout_correction_errors(al))
    errs.extend(_algorithm_variant_errors(cfg))
    from trainer.checkpoint import contents_errors  # verl's save_contents / load_contents, honoured or refused

    ck = cfg.actor_rollout_ref.actor.checkpoint
    errs.extend(contents_errors(list(ck.save_contents), list(ck.load_contents)))
    if r.mode != "sync" and cfg.trainer.debug.in_process:
        errs.append(f"actor_rollout_ref.rollout.mode={r.mode} with trainer.debug.in_process=true: the fleet's servers are "
                    f"separate processes by design; use rollout.mode=sync to debug in process.")
    if cfg.trainer.debug.rollout_only and cfg.trainer.debug.train_only:
        errs.append("trainer.debug.rollout_only and trainer.debug.train_only cannot both be true.")
    if cfg.trainer.debug.train_only and not cfg.trainer.debug.dump_batch_path:
        errs.append("trainer.debug.train_only=true needs trainer.debug.dump_batch_path (a batch dumped by an earlier run).")
    return errs


LOGGERS = ("console", "mlflow", "wandb", "tensorboard")
OTHER_ENGINES = ("vllm", "trtllm", "hf")  # verl's other rollout engines


def _algorithm_variant_errors(cfg) -> list[str]:
    """The estimators' and policy losses' own hyper-parameters: valid values, and the inputs they need."""
    al, a = cfg.algorithm, cfg.actor_rollout_ref.actor
    pl, errs = a.policy_loss, []
    # verl's meaning: calculate_sum_pi_squared asks the actor's old-log-prob pass for sum_v pi(v)^2; the optimal
    # token baseline reads it and verl stops (an assertion in compute_advantage) when it is not asked for
    if al.adv_estimator in ("optimal_token_baseline", "tir_optimal_token_baseline") and not a.calculate_sum_pi_squared:
        errs.append(f"algorithm.adv_estimator={al.adv_estimator} weights its baseline with sum_v pi(v)^2 at every response "
                    f"position, which the actor's old-log-prob pass returns only when asked: set "
                    f"actor_rollout_ref.actor.calculate_sum_pi_squared=true (verl requires the same).")
    if a.calculate_sum_pi_squared and al.rollout_correction.bypass_mode:
        errs.append("actor_rollout_ref.actor.calculate_sum_pi_squared=true with algorithm.rollout_correction.bypass_mode=true: "
                    "bypass mode skips the actor's old-log-prob pass (the old log-probs are the sampler's), and that pass "
                    "is where sum_v pi(v)^2 is computed (verl's bypass mode never computes it either). Use the decoupled "
                    "mode (bypass_mode=false), or remove calculate_sum_pi_squared and the optimal_token_baseline estimator.")
    if al.adv_estimator == "gdpo":
        keys = list(al.gdpo_reward_keys or [])
        if not keys:
            errs.append("algorithm.adv_estimator=gdpo normalises each reward component on its own: set "
                        "algorithm.gdpo_reward_keys=[key,...] to keys of the dict your scorer returns (as verl requires).")
        if al.gdpo_reward_weights is not None and len(al.gdpo_reward_weights) != len(keys):
            errs.append(f"algorithm.gdpo_reward_weights has {len(al.gdpo_reward_weights)} entries for {len(keys)} "
                        f"algorithm.gdpo_reward_keys; give one weight per key (or null for 1 each).")
        if cfg.actor_rollout_ref.rollout.multi_turn.enable:
            errs.append("algorithm.adv_estimator=gdpo reads the scorer's reward components, which a multi-turn episode "
                        "does not have (its reward is the environment's return); use grpo with multi_turn.")
    elif al.gdpo_reward_keys or al.gdpo_reward_weights is not None:
        errs.append("algorithm.gdpo_reward_keys / gdpo_reward_weights are read by adv_estimator=gdpo only; remove them "
                    f"(adv_estimator={al.adv_estimator}).")
    if al.weight_factor_in_cpgd != "STD_weight" and al.adv_estimator != "cpgd":
        errs.append(f"algorithm.weight_factor_in_cpgd={al.weight_factor_in_cpgd} is read by adv_estimator=cpgd only "
                    f"(adv_estimator={al.adv_estimator}); remove it.")
    mode = pl.loss_mode
    if mode == "dro" and not (pl.dro_beta is not None and pl.dro_beta > 0):
        errs.append(f"actor_rollout_ref.actor.policy_loss.loss_mode=dro needs actor_rollout_ref.actor.policy_loss.dro_beta "
                    f"> 0 (the quadratic log-ratio penalty; got {pl.dro_beta}).")
    elif mode != "dro" and pl.dro_beta is not None:
        errs.append(f"actor_rollout_ref.actor.policy_loss.dro_beta={pl.dro_beta} is read by loss_mode=dro only "
                    f"(loss_mode={mode}); remove it.")
    if not (a.tau_pos > 0 and a.tau_neg > 0):
        errs.append(f"actor_rollout_ref.actor.tau_pos={a.tau_pos} / tau_neg={a.tau_neg} (SAPO's gate temperatures) must be > 0.")
    elif mode != "sapo" and (a.tau_pos != 1.0 or a.tau_neg != 1.05):
        errs.append(f"actor_rollout_ref.actor.tau_pos / tau_neg are read by loss_mode=sapo only (loss_mode={mode}); "
                    f"remove them.")
    if a.policy_drift_coeff < 0:
        errs.append(f"actor_rollout_ref.actor.policy_drift_coeff={a.policy_drift_coeff} must be >= 0.")
    elif a.policy_drift_coeff and mode != "cpgd":
        errs.append(f"actor_rollout_ref.actor.policy_drift_coeff={a.policy_drift_coeff} is the policy-drift term of "
                    f"loss_mode=cpgd (siiRL adds it whenever adv_estimator=cpgd); set "
                    f"actor_rollout_ref.actor.policy_loss.loss_mode=cpgd (loss_mode={mode}).")
    if mode == "cpgd":
        low = a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio
        if not low < 1:
            errs.append(f"actor_rollout_ref.actor.policy_loss.loss_mode=cpgd clips the log ratio at ln(1 - clip_ratio_low): "
                        f"actor_rollout_ref.actor.clip_ratio_low={low} must be < 1.")
    if mode == "bypass_mode" and not al.rollout_correction.bypass_mode:
        errs.append("actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode is verl's loss of "
                    "algorithm.rollout_correction.bypass_mode=true (the old log-probs are the sampler's; IS and rejection "
                    "inside the loss): set that key (and its loss_type), or choose another loss_mode.")
    return errs


def _rollout_correction_errors(al) -> list[str]:
    """``algorithm.rollout_correction``: valid values, and not mixed with the flat rollout-IS keys."""
    from trainer.verl_compat import parse_rejection

    rc, errs = al.rollout_correction, []
    if rc.loss_type not in ("ppo_clip", "reinforce"):
        errs.append(f"algorithm.rollout_correction.loss_type='{rc.loss_type}' is not ppo_clip | reinforce.")
    if rc.bypass_mode and al.rollout_is_threshold is not None:
        errs.append("algorithm.rollout_correction.bypass_mode=true computes IS inside the loss from "
                    "algorithm.rollout_correction.rollout_is*; set algorithm.rollout_is_threshold=null (the flat keys).")
    if rc.rollout_is_batch_normalize and rc.rollout_is is None:
        errs.append("algorithm.rollout_correction.rollout_is_batch_normalize=true needs "
                    "algorithm.rollout_correction.rollout_is=token|sequence.")
    if rc.rollout_is is None and rc.rollout_rs is None:
        if rc.rollout_token_veto_threshold is not None:
            errs.append("algorithm.rollout_correction.rollout_token_veto_threshold is set but neither rollout_is nor "
                        "rollout_rs is: set algorithm.rollout_correction.rollout_is=token|sequence.")
        return errs
    if al.rollout_is_threshold is not None or al.rollout_rs is not None:
        errs.append("algorithm.rollout_correction.* and the flat algorithm.rollout_is_threshold / algorithm.rollout_rs "
                    "keys both configure rollout IS; use one spelling.")
    if rc.rollout_is is not None and rc.rollout_is not in ("token", "sequence"):
        errs.append(f"algorithm.rollout_correction.rollout_is='{rc.rollout_is}' is not token | sequence (or null).")
    if rc.rollout_is is not None and not rc.rollout_is_threshold > 0:
        errs.append(f"algorithm.rollout_correction.rollout_is_threshold={rc.rollout_is_threshold} must be > 0.")
    if rc.rollout_rs is not None:
        try:
            parse_rejection(rc.rollout_rs, rc.rollout_rs_threshold if rc.rollout_rs_threshold is not None
                            else (rc.rollout_is_threshold if rc.rollout_rs in ("token", "sequence", "geometric") else None),
                            rc.rollout_rs_threshold_lower)
        except ValueError as e:
            errs.append(str(e))
    return errs


def public_container(cfg: DictConfig) -> dict:
    """The resolved config as plain data that is safe to print, write or log: a value taken from the
    environment keeps its interpolation (``${oc.env:NAME}``), not the value (a reloaded config resolves it
    again); a key named like a secret (``api_key``, ``token``, ...) shows ``***``; and a value from the
    environment, or of a secret-looking environment variable, is masked wherever else it appears."""
    from trainer.tracking import _SECRET_KEY, _secret_values

    raw = OmegaConf.to_container(cfg, resolve=False)
    res = OmegaConf.to_container(cfg, resolve=True)
    hidden = set(_secret_values())

    def collect(r, v):  # the resolved values that came from the environment
        if isinstance(v, dict) and isinstance(r, dict):
            for k in v:
                collect(r.get(k), v[k])
        elif isinstance(v, list) and isinstance(r, list):
            for a, b in zip(r, v):
                collect(a, b)
        elif isinstance(r, str) and "oc.env" in r and v not in (None, "") and len(str(v)) >= 4:
            hidden.add(str(v))

    def walk(r, v, key):
        if isinstance(v, dict):
            return {k: walk(r.get(k) if isinstance(r, dict) else None, x, k) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(r[i] if isinstance(r, list) and i < len(r) else None, x, key) for i, x in enumerate(v)]
        if isinstance(r, str) and "oc.env" in r:
            return r
        if _SECRET_KEY.search(str(key)) and v not in (None, ""):
            return "***"
        if isinstance(v, str):
            for h in hidden:
                v = v.replace(h, "***")
        return v

    collect(raw, res)
    return walk(raw, res, "")


def to_yaml(cfg: DictConfig) -> str:
    """The config as YAML, resolved, with secrets kept out (:func:`public_container`)."""
    return OmegaConf.to_yaml(OmegaConf.create(public_container(cfg)))


def save_resolved(cfg: DictConfig, run_dir: str) -> str:
    """Write the resolved config to ``run_dir/config.yaml`` atomically; returns the path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(to_yaml(cfg))
    os.replace(tmp, path)
    return path


def all_keys() -> list[str]:
    return sorted(_LEAVES)
