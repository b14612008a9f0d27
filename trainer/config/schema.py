"""The configuration's schema: omegaconf structured dataclasses in verl's key tree, and what is derived from
it (every leaf key and its type, the enumerated choices, the closest key to a misspelt one).

The key tree follows verl's (``data.*``, ``actor_rollout_ref.{model,actor,rollout,ref}.*``,
``critic.*``, ``reward_model.*``, ``algorithm.*``, ``trainer.*``) so that the override lines of a verl
recipe such as ``run_dapo_32b.sh`` carry over unchanged. Batch sizes follow verl's units:
``data.train_batch_size``, ``data.gen_batch_size`` and ``ppo_mini_batch_size`` count PROMPTS; each prompt
expands to ``actor_rollout_ref.rollout.n`` responses. ``ppo_micro_batch_size_per_gpu`` counts responses.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from trainer.rollout.registry import ENGINES
from trainer.strategies import STRATEGIES
from trainer.verl_compat import VERL_MEGATRON


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
    train_max_samples: int = -1  # use only this many training rows (random ones when shuffle, seeded by seed; else the first); <= 0 = all
    val_max_samples: int = -1  # the same for the validation rows


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
class FSDPWrapPolicy:
    transformer_layer_cls_to_wrap: Optional[List[str]] = None  # module classes sharded as one FSDP unit each; None = the model's _no_split_modules (its decoder layer)
    min_num_params: int = 0  # FSDP1's size-based wrapping; refused above 0 (FSDP2 wraps each decoder layer, as verl's fsdp2 does)


@dataclass
class FSDPConfig:
    """A role's FSDP settings, verl's ``fsdp_config`` (used when its ``strategy=fsdp`` or ``fsdp2``: both run on
    FSDP2, trainer/strategies/fsdp2.py)."""
    param_offload: bool = False  # sharded parameters moved to host memory between calls (moves nothing with trainer.device=cpu)
    optimizer_offload: bool = False  # Adam states moved to host memory between calls (moves nothing with trainer.device=cpu)
    offload_policy: bool = False  # FSDP2's CPUOffloadPolicy: shards live in host memory, the optimizer steps there (always on for the forward-only reference on GPU, as in verl)
    reshard_after_forward: bool = True  # free each unit's gathered weights after its forward (ZeRO-3); false keeps them until backward (ZeRO-2-like)
    fsdp_size: int = -1  # ranks one parameter is sharded over; -1 (or >= the role's ranks) = all; else hybrid sharding on a (ranks / fsdp_size, fsdp_size) mesh
    forward_prefetch: bool = False  # each unit starts the next unit's all-gather during its forward
    model_dtype: str = "fp32"  # dtype of the parameters and optimizer states (verl: the dtype the HF model is loaded in)
    dtype: str = "bfloat16"  # compute dtype of forward and backward (FSDP2 mixed precision's param_dtype) unless mixed_precision.param_dtype is given
    mixed_precision: Optional[Dict[str, Any]] = None  # verl's {param_dtype, reduce_dtype, buffer_dtype}: compute and gradient-reduction dtypes (reduce defaults to fp32)
    wrap_policy: FSDPWrapPolicy = field(default_factory=FSDPWrapPolicy)  # which modules are FSDP units
    seed: int = 42  # torch seed of the role's ranks
    forward_only: bool = False  # a forward-only role (verl's reference: true): its shards live in host memory on GPU, as with offload_policy
    strategy: str = "fsdp"  # verl's copy of the role's strategy: fsdp or fsdp2 (both run on FSDP2); the role's own strategy key picks the strategy
    entropy_checkpointing: bool = False  # recompute the entropy from the logits in backward instead of keeping its activations
    entropy_from_logits_with_chunking: bool = False  # compute the entropy over chunks of positions (less peak memory, the same values)
    full_determinism: bool = False  # torch's deterministic algorithms only (torch.use_deterministic_algorithms) on the role's ranks


@dataclass
class RefFSDPConfig(FSDPConfig):
    forward_only: bool = True  # verl's reference default


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
    override_transformer_config: Dict[str, Any] = field(default_factory=dict)  # megatron-core TransformerConfig fields, passed through (recompute_* and moe_* losses read by Coxswain; fields the bridge sets from config.json or this section refused; GPU kernel switches turned off on CPU with a note, FP8 refused there): trainer/transformer_overrides.py


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
class LoRAConfig:
    """verl's ``actor_rollout_ref.model.lora`` (Megatron-Bridge's LoRA; docs/strategies.md#lora): the actor trains
    rank-``rank`` adapters on its frozen base weights (strategy=megatron, or deepspeed through peft); the reference is
    the actor with its adapters off."""
    rank: int = 0  # adapter rank; 0 = no LoRA (the whole model trains)
    alpha: float = 32  # scale alpha / rank of the adapter's output (peft's lora_alpha)
    dropout: float = 0.0  # dropout on the adapter's input
    dropout_position: str = "pre"  # pre (on the adapter's input); post is refused with a dropout (not built)
    target_modules: List[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])  # megatron linears (last name, or a wildcard pattern of the canonical name, e.g. *.layers.0.*); [] = every decoder linear
    exclude_modules: List[str] = field(default_factory=list)  # linears taken out of target_modules (same patterns)
    lora_A_init_method: str = "xavier"  # xavier | normal | kaiming | zero
    lora_B_init_method: str = "zero"  # xavier | normal | kaiming | zero (zero: training starts at the base model)
    merge: bool = False  # false: a weight sync moves only the adapters (the engine merges them); true: merged weights W + (alpha/rank) B A
    adapter_path: Optional[str] = None  # a peft adapter directory (adapter_config.json + adapter_model.safetensors) to start from
    type: str = "lora"  # lora (canonical_lora / dora / vlm_lora are not built)
    dtype: Optional[str] = None  # adapter parameter dtype: float32 | bfloat16 | float16; None = the base weights' (deepspeed: None only)
    a2a_experimental: bool = False  # Megatron-Bridge's all-to-all adapter communication (not built; refused when true)
    freeze_language_model: bool = True  # the base weights stay frozen (false is refused: that is full fine-tuning, rank 0)
    freeze_vision_model: bool = True  # vision-language models only (not built; false refused)
    freeze_vision_projection: bool = True  # vision-language models only (not built; false refused)


@dataclass
class ModelConfig:
    path: str = "~/models/deepseek-llm-7b-chat"  # HF-format model dir (config.json + safetensors + tokenizer); nothing is downloaded
    tokenizer_path: Optional[str] = None  # tokenizer dir; None = path
    trust_remote_code: bool = False  # allow custom HF code (never needed for Llama/Qwen2/Qwen3)
    enable_gradient_checkpointing: bool = False  # recompute activations in backward
    use_remove_padding: bool = False  # verl's FSDP packing switch; the megatron roles pack by *.megatron.use_remove_padding (true with it false is refused)
    override_config: Dict[str, Any] = field(default_factory=dict)  # verl's: config.json fields set over the checkpoint's for the actor, reference and rollout (max_position_embeddings, rope_theta, rope_scaling, attention_dropout, rms_norm_eps; top level or under model_config)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # LoRA on the actor (megatron, deepspeed): docs/strategies.md#lora
    lora_rank: int = 0  # verl's older spelling of lora.rank (0 = off); with lora_alpha, target_modules, exclude_modules, lora_adapter_path
    lora_alpha: float = 16  # older spelling of lora.alpha (read when lora_rank > 0)
    target_modules: Any = "all-linear"  # older spelling (with lora_rank): all-linear, or HF projection names (q_proj+k_proj+v_proj, o_proj, gate_proj+up_proj, down_proj) or megatron linear names
    exclude_modules: Any = None  # older spelling (with lora_rank): names taken out of target_modules
    lora_adapter_path: Optional[str] = None  # older spelling of lora.adapter_path (with lora_rank)


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
    override_optimizer_config: Dict[str, Any] = field(default_factory=dict)  # strategy=megatron: megatron-core OptimizerConfig fields passed through as verl does (trainer/optimizer_overrides.py); on a CPU run the host-offload and fp32 precision-aware switches are turned off with a note


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"  # vanilla | gspo | gpg | clip_cov | kl_cov | geo_mean | cispo | sapo | dro | dppo_tv | dppo_kl | cpgd | bypass_mode (with algorithm.rollout_correction.bypass_mode=true) | pkg.module:function
    dro_beta: Optional[float] = None  # DRO: quadratic log-ratio penalty; required (> 0) with loss_mode=dro
    clip_cov_ratio: float = 0.0002  # Clip-Cov: fraction of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # Clip-Cov: covariance lower bound
    clip_cov_ub: float = 5.0  # Clip-Cov: covariance upper bound
    kl_cov_ratio: float = 0.0002  # KL-Cov: fraction of tokens given the KL penalty
    ppo_kl_coef: float = 0.1  # KL-Cov: penalty coefficient
    kwargs: Dict[str, Any] = field(default_factory=dict)  # a plug-in loss's own keywords (loss_mode=pkg.module:function), passed to every call; built-in losses read the keys above


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
    strategy: str = "megatron"  # megatron | deepspeed | fsdp | fsdp2 | pkg.module:Class (trainer.strategies)
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
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)  # strategy=fsdp / fsdp2: sharding, precision, offload
    ulysses_sequence_parallel_size: int = 1  # strategy=fsdp / fsdp2: Ulysses sequence-parallel ranks per data-parallel shard (must divide the ranks and the attention heads)
    use_remove_padding: bool = "${oc.select:actor_rollout_ref.model.use_remove_padding,false}"  # verl's: the actor packs by actor_rollout_ref.model.use_remove_padding (this key follows it; strategy=fsdp / fsdp2)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)  # MoE routing replay (R3)
    checkpoint: CheckpointContents = field(default_factory=CheckpointContents)  # checkpoint contents


@dataclass
class RefConfig:
    strategy: str = "megatron"  # megatron | deepspeed | fsdp | fsdp2 | pkg.module:Class (trainer.strategies)
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # responses per reference forward on one rank (required unless log_prob_use_dynamic_bsz)
    log_prob_use_dynamic_bsz: bool = "${oc.select:actor_rollout_ref.actor.use_dynamic_bsz,false}"  # pack reference micro-batches by token budget
    log_prob_max_token_len_per_gpu: int = "${oc.select:actor_rollout_ref.actor.ppo_max_token_len_per_gpu,16384}"  # token budget per reference micro-batch
    megatron: MegatronConfig = field(default_factory=lambda: RefMegatronConfig())  # reference parallelism (follows the actor's, as in verl)
    deepspeed_config: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # strategy=deepspeed: ZeRO stage, precision
    fsdp_config: FSDPConfig = field(default_factory=RefFSDPConfig)  # strategy=fsdp / fsdp2: sharding, precision, offload
    ulysses_sequence_parallel_size: int = "${oc.select:actor_rollout_ref.actor.ulysses_sequence_parallel_size,1}"  # strategy=fsdp / fsdp2: Ulysses ranks (follows the actor's, as in verl)
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
    weight_sync: str = "auto"  # actor -> engines transport: auto (shared memory on one node, else Ray's object store), distributed_group (a gloo/NCCL group of the actor and engine workers of their own: to native engines every rank sends its own shards; to SGLang rank 0 broadcasts full tensors, SGLang's update_weights_from_distributed), object_store
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
    override_config: Dict[str, Any] = field(default_factory=dict)  # verl's: config.json fields set over the critic's (as actor_rollout_ref.model.override_config)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)  # critic.strategy=fsdp / fsdp2: sharding, precision, offload
    use_remove_padding: bool = False  # critic.strategy=fsdp / fsdp2: packed rows (the megatron critic packs by critic.megatron.use_remove_padding)


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # None = on exactly when algorithm.adv_estimator is gae
    strategy: str = "megatron"  # megatron | deepspeed | fsdp | fsdp2 | pkg.module:Class (trainer.strategies)
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
    ulysses_sequence_parallel_size: int = 1  # strategy=fsdp / fsdp2: Ulysses ranks per data-parallel shard


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
    override_config: Dict[str, Any] = field(default_factory=dict)  # verl's: config.json fields set over the reward model's (as actor_rollout_ref.model.override_config)
    fsdp_config: FSDPConfig = field(default_factory=RefFSDPConfig)  # reward_model.strategy=fsdp / fsdp2: sharding, precision (forward only)
    use_remove_padding: bool = False  # reward_model.strategy=fsdp / fsdp2: packed rows (the megatron RM packs by reward_model.megatron.use_remove_padding)
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
    strategy: str = "megatron"  # megatron | deepspeed | fsdp | fsdp2 | pkg.module:Class (trainer.strategies): how the reward model's forward is sharded
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)  # the reward model's checkpoint
    micro_batch_size: Optional[int] = None  # legacy global micro-batch; use micro_batch_size_per_gpu
    micro_batch_size_per_gpu: Optional[int] = None  # responses per reward-model forward on one rank (required unless use_dynamic_bsz)
    use_dynamic_bsz: bool = "${critic.use_dynamic_bsz}"  # fill reward-model micro-batches up to a token budget instead of a count
    forward_max_token_len_per_gpu: int = "${critic.forward_max_token_len_per_gpu}"  # token budget per reward-model micro-batch when use_dynamic_bsz
    max_length: Optional[int] = None  # truncate each re-tokenised RM input to its first N tokens (verl's truncation='right'); null = whole
    megatron: MegatronConfig = field(default_factory=lambda: RewardModelMegatronConfig())  # strategy=megatron: the reward model's parallelism
    deepspeed_config: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # strategy=deepspeed: ZeRO stage, precision
    ulysses_sequence_parallel_size: int = 1  # strategy=fsdp / fsdp2: Ulysses ranks per data-parallel shard
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
    rollout_is_threshold: Any = 2.0  # upper truncation bound of the IS weights, or "lo_hi" (verl's IcePop): weights outside [lo, hi] zeroed
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
    evaluation_type: str = "api"  # api (OpenAI-compatible endpoint) | local (trainer.serve) | rule (the environment's rule judge)
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
    rule_environment: Optional[str] = None  # evaluation_type=rule: whose label_steps judges (None = multi_turn.environment)
    max_fallback_fraction: float = 0.1  # stop the run when more of a step's judged trajectories fall back to outcome-only credit (1 = never stop)
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
    compile: bool = False  # one switch for the compiled hot paths: every megatron role's chunk (as *.megatron.use_torch_compile) and the native engines' decode (engine_kwargs compile_decode, plus on CPU cpp_wrapper and decode_gemm=cpp, where engine_kwargs leaves them unset; not for MoE); the first steps compile (about a minute on 2 CPU cores)
    total_epochs: int = 30  # passes over the training prompts
    total_training_steps: Optional[int] = None  # stop after this many steps; None = epochs x batches
    critic_warmup: int = 0  # critic-only steps before the actor trains
    test_freq: int = -1  # eval every N steps (-1 = never)
    val_before_train: bool = True  # eval at step 0
    balance_batch: bool = True  # shards of equal size balanced on tokens over the data-parallel ranks (Karmarkar-Karp); false: contiguous chunks in the sampler's order
    save_freq: int = -1  # checkpoint every N steps (-1 = never)
    max_actor_ckpt_to_keep: Optional[int] = None  # keep the newest N global_step_* checkpoints; None or <= 0 = keep all
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"  # run directory: global_step_N/{actor,critic}, latest_checkpointed_iteration.txt, resolved config, report
    log_val_generations: int = 0  # log N validation samples (input, output, score, step) per validation as a table: wandb Table, MLflow JSON artifact, tensorboard text
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: Optional[str] = None  # checkpoint dir when resume_mode=resume_path
    resume_allow_unverified: bool = False  # resume from a checkpoint with no MANIFEST.json (only one you trust)
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
    "actor_rollout_ref.actor.strategy": (tuple(STRATEGIES), True),  # or a user's Strategy class, pkg.module:Class
    "actor_rollout_ref.ref.strategy": (tuple(STRATEGIES), True),  # or a user's Strategy class, pkg.module:Class
    "critic.strategy": (tuple(STRATEGIES), True),  # or a user's Strategy class, pkg.module:Class
    "reward_model.strategy": (tuple(STRATEGIES), True),  # or a user's Strategy class, pkg.module:Class
    "actor_rollout_ref.rollout.name": (tuple(ENGINES), True),  # or a user's engine class, pkg.module:Class
    "actor_rollout_ref.actor.router_replay.mode": (("disabled", "R2", "R3"), False),
    "actor_rollout_ref.model.lora.dropout_position": (("pre", "post"), False),
    "actor_rollout_ref.model.lora.lora_A_init_method": (("xavier", "normal", "kaiming", "zero"), False),
    "actor_rollout_ref.model.lora.lora_B_init_method": (("xavier", "normal", "kaiming", "zero"), False),
    "async_training.mode": (("sync", "one_step_off", "fully_async"), False),
    "actor_rollout_ref.ref.router_replay.mode": (("disabled", "R2", "R3"), False),
    "reward_model.reward_manager": (("naive", "prime", "dapo", "batch"), False),
    "actor_rollout_ref.rollout.mode": (("sync", "async", "server"), False),
    "actor_rollout_ref.rollout.weight_sync": (("auto", "distributed_group", "object_store"), False),
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
    "attribution_driven_credit_assignment.evaluation_type": (("api", "local", "rule"), False),
    "attribution_driven_credit_assignment.adca_grpo.prm_scheme": (("decouple", "allocation"), False),
    "attribution_driven_credit_assignment.adca_grpo.orm_distribution": (("last_step", "all_steps"), False),
}



# ----------------------------------------------------------------------------------------------
# numeric ranges
# ----------------------------------------------------------------------------------------------
INT64 = 2**63 - 1  # an int with no tighter bound still has to fit the int64 that numpy / torch hold it in
SEED_MAX = 2**32 - 1  # numpy's RandomState refuses seeds outside [0, 2**32 - 1]
MAX_TOKENS = 2**20  # one sequence of more than 1M tokens: its activations alone exceed any accelerator's memory
MAX_BATCH_TOKENS = 2**24  # a micro-batch / prefill budget of more than 16M tokens cannot be held by one device
MAX_BATCH = 2**24  # more than 16M prompts (or responses) in one step: the step's tensors alone exceed host memory
MAX_RANKS = 2**16  # a parallel size or node count above 65536 ranks names no cluster that exists


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: ``lo``..``hi`` (``None``: unbounded, ints still within int64), open at
    an end when ``lo_open`` / ``hi_open``; floats must be finite (nan and +-inf are refused: no key of verl's
    gives infinity a meaning, an unset bound is ``null``). verl's special values (``-1``: unset / off) lie inside
    the declared interval. ``why`` says what bounds it (printed with a refusal). ``null`` is accepted wherever the
    key's type is Optional (omegaconf refuses it elsewhere)."""
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def text(self, integer: bool = False) -> str:
        lo, hi = self.lo, self.hi
        if integer:  # an unbounded int is still an int64
            lo, hi = (-INT64 - 1 if lo is None else lo), (INT64 if hi is None else hi)
        lo_s = "-inf" if lo is None else _num(lo)
        hi_s = "inf" if hi is None else _num(hi)
        return f"{'(' if self.lo_open or lo is None else '['}{lo_s}, {hi_s}{')' if self.hi_open or hi is None else ']'}"

    def admits(self, v, integer: bool) -> bool:
        if v != v or v in (float("inf"), float("-inf")):  # nan, +-inf
            return False
        lo = self.lo if self.lo is not None else (-INT64 - 1 if integer else None)
        hi = self.hi if self.hi is not None else (INT64 if integer else None)
        if lo is not None and (v < lo or (self.lo_open and v == lo)):
            return False
        return hi is None or (v < hi or (not self.hi_open and v == hi))


def _r(lo=None, hi=None, *, why: str, lo_open=False, hi_open=False) -> Range:
    return Range(lo, hi, lo_open, hi_open, why)


_POS = dict(lo=0, lo_open=True)  # > 0
_FRACTION = dict(lo=0, hi=1)  # [0, 1]
_ANY_INT = _r(why="verl gives every value a meaning (<= 0: off / unset)")
_SEED = _r(0, SEED_MAX, why="a random seed")
_MICRO = _r(1, MAX_BATCH, why="responses per micro-batch on one rank")
_MINI_BATCH = _r(1, MAX_BATCH, why="prompts per optimizer step")  # actor and critic alike
_EPOCHS = _r(1, why="passes over each batch")
_TOKEN_BUDGET = _r(1, MAX_BATCH_TOKENS, why="tokens per micro-batch on one rank")
_RANKS = _r(1, MAX_RANKS, why="a number of ranks (1: not split that way)")
_COEF = _r(0, why="a loss / penalty weight (0: off)")
_FINITE = _r(why="any finite weight")

# Every numeric field of the schema, by dataclass and field (a subclass, e.g. RefMegatronConfig, takes its
# base's): declared once here, checked by trainer.config.checks.range_errors at load, and walked by
# tests/config/test_ranges.py so that a new numeric key without a range fails. List fields are checked per item.
RANGES: dict[str, Range] = {
    "DataConfig.max_prompt_length": _r(1, MAX_TOKENS, why="tokens of one prompt"),
    "DataConfig.max_response_length": _r(1, MAX_TOKENS, why="tokens of one response"),
    "DataConfig.train_batch_size": _r(1, MAX_BATCH, why="prompts per step"),
    "DataConfig.train_max_samples": _r(hi=MAX_BATCH, why="rows kept (<= 0: all)"),
    "DataConfig.val_max_samples": _r(hi=MAX_BATCH, why="rows kept (<= 0: all)"),
    "DataConfig.gen_batch_size": _r(1, MAX_BATCH, why="prompts per generation batch"),
    "DataConfig.val_batch_size": _r(1, MAX_BATCH, why="prompts per validation batch"),
    "DataConfig.seed": _SEED,
    "DeepSpeedConfig.zero_stage": _r(1, 3, why="DeepSpeed's ZeRO stages 1, 2, 3"),
    "DeepSpeedConfig.seed": _SEED,
    "FSDPConfig.fsdp_size": _r(-1, MAX_RANKS, why="ranks per shard group (-1: all)"),
    "FSDPConfig.seed": _SEED,
    "FSDPWrapPolicy.min_num_params": _r(0, why="a parameter count"),
    "ActorConfig.ulysses_sequence_parallel_size": _RANKS,
    "RefConfig.ulysses_sequence_parallel_size": _RANKS,
    "CriticConfig.ulysses_sequence_parallel_size": _RANKS,
    "RewardModelConfig.ulysses_sequence_parallel_size": _RANKS,
    "MegatronConfig.tensor_model_parallel_size": _RANKS,
    "MegatronConfig.pipeline_model_parallel_size": _RANKS,
    "MegatronConfig.virtual_pipeline_model_parallel_size": _r(1, MAX_RANKS, why="model chunks per pipeline stage"),
    "MegatronConfig.context_parallel_size": _RANKS,
    "MegatronConfig.expert_model_parallel_size": _RANKS,
    "MegatronConfig.expert_tensor_parallel_size": _RANKS,
    "MegatronConfig.pipeline_layer_split": _r(0, MAX_RANKS, why="layers of one pipeline stage"),
    "MegatronConfig.seed": _SEED,
    "LoRAConfig.rank": _r(0, 2**16, why="an adapter rank (0: no LoRA)"),
    "LoRAConfig.alpha": _r(0, lo_open=True, why="the adapter scale's numerator (scale alpha / rank)"),
    "LoRAConfig.dropout": _r(0, 1, hi_open=True, why="a dropout probability"),
    "ModelConfig.lora_rank": _r(0, 2**16, why="an adapter rank (0: no LoRA)"),
    "ModelConfig.lora_alpha": _r(0, lo_open=True, why="the adapter scale's numerator (scale alpha / rank)"),
    "OptimConfig.lr": _r(0, why="a learning rate"),
    "OptimConfig.min_lr": _r(0, why="a learning rate"),
    "OptimConfig.lr_warmup_steps": _r(why="verl: a negative value means use lr_warmup_steps_ratio"),
    "OptimConfig.lr_warmup_steps_ratio": _r(**_FRACTION, why="a fraction of the training steps"),
    "OptimConfig.lr_warmup_init": _r(0, why="a learning rate"),
    "OptimConfig.lr_decay_steps": _r(1, why="a step count"),
    "OptimConfig.weight_decay": _r(0, why="decoupled weight decay"),
    "OptimConfig.betas": _r(0, 1, hi_open=True, why="Adam's moment decay rates (torch.optim.Adam's range)"),
    "OptimConfig.eps": _r(0, why="Adam's epsilon (torch.optim.Adam's range)"),
    "OptimConfig.clip_grad": _r(0, why="a gradient-norm bound (0: no clipping)"),
    "OptimConfig.total_training_steps": _ANY_INT,
    "PolicyLossConfig.dro_beta": _r(**_POS, why="DRO's penalty weight"),
    "PolicyLossConfig.clip_cov_ratio": _r(**_FRACTION, why="a fraction of the tokens"),
    "PolicyLossConfig.clip_cov_lb": _FINITE,
    "PolicyLossConfig.clip_cov_ub": _FINITE,
    "PolicyLossConfig.kl_cov_ratio": _r(**_FRACTION, why="a fraction of the tokens"),
    "PolicyLossConfig.ppo_kl_coef": _COEF,
    "ActorConfig.ppo_mini_batch_size": _MINI_BATCH,
    "ActorConfig.ppo_micro_batch_size": _MICRO,
    "ActorConfig.ppo_micro_batch_size_per_gpu": _MICRO,
    "ActorConfig.ppo_max_token_len_per_gpu": _TOKEN_BUDGET,
    "ActorConfig.ppo_epochs": _EPOCHS,
    "ActorConfig.clip_ratio": _r(**_POS, why="PPO's clip epsilon"),
    "ActorConfig.clip_ratio_low": _r(0, why="PPO's lower clip epsilon (0: no room below the ratio 1)"),
    "ActorConfig.clip_ratio_high": _r(0, why="PPO's upper clip epsilon (0: no room above the ratio 1)"),
    "ActorConfig.clip_ratio_c": _r(1, lo_open=True, why="dual-clip's bound on the ratio, as verl asserts"),
    "ActorConfig.tau_pos": _r(**_POS, why="SAPO's gate temperature"),
    "ActorConfig.tau_neg": _r(**_POS, why="SAPO's gate temperature"),
    "ActorConfig.policy_drift_coeff": _COEF,
    "ActorConfig.loss_scale_factor": _r(**_POS, why="the divisor of seq-mean-token-sum-norm"),
    "ActorConfig.entropy_coeff": _FINITE,
    "ActorConfig.kl_loss_coef": _COEF,
    "ActorConfig.grad_clip": _r(0, why="a gradient-norm bound (0: no clipping)"),
    "RefConfig.log_prob_micro_batch_size_per_gpu": _MICRO,
    "RefConfig.log_prob_max_token_len_per_gpu": _TOKEN_BUDGET,
    "ValKwargs.temperature": _r(0, why="a sampling temperature (0: greedy)"),
    "ValKwargs.top_k": _r(-1, why="top-k (-1 or 0: off)"),
    "ValKwargs.top_p": _r(**_POS, hi=1, why="a nucleus probability mass"),
    "ValKwargs.n": _r(1, 4096, why="samples per prompt; above 4096 one prompt's group alone fills an engine"),
    "MultiTurnConfig.max_assistant_turns": _r(1, MAX_TOKENS, why="turns, each at least one token"),
    "MultiTurnConfig.max_user_turns": _r(0, MAX_TOKENS, why="turns, each at least one token"),
    "MultiTurnConfig.max_tokens_per_trajectory": _r(1, MAX_TOKENS, why="tokens of one trajectory"),
    "MultiTurnConfig.concurrency": _r(1, MAX_RANKS, why="trajectories in flight, each holding an engine slot"),
    "MultiTurnConfig.max_tokens_per_turn": _r(1, MAX_TOKENS, why="tokens of one turn"),
    "RolloutConfig.temperature": _r(0, why="a sampling temperature (0: greedy)"),
    "RolloutConfig.top_k": _r(-1, why="top-k (-1 or 0: off)"),
    "RolloutConfig.top_p": _r(**_POS, hi=1, why="a nucleus probability mass (1: off)"),
    "RolloutConfig.n": _r(1, 4096, why="responses per prompt; above 4096 one prompt's group alone fills an engine"),
    "RolloutConfig.prompt_length": _r(1, MAX_TOKENS, why="tokens of one prompt"),
    "RolloutConfig.response_length": _r(1, MAX_TOKENS, why="tokens of one response"),
    "RolloutConfig.tensor_model_parallel_size": _RANKS,
    "RolloutConfig.gpu_memory_utilization": _r(**_POS, hi=1, why="a fraction of the device's memory"),
    "RolloutConfig.max_num_seqs": _r(1, MAX_BATCH, why="engine batch slots"),
    "RolloutConfig.max_num_batched_tokens": _r(1, MAX_BATCH_TOKENS, why="tokens per prefill chunk"),
    "RolloutConfig.log_prob_micro_batch_size_per_gpu": _MICRO,
    "RolloutConfig.log_prob_max_token_len_per_gpu": _TOKEN_BUDGET,
    "RolloutConfig.update_weights_bucket_megabytes": _r(1, 2**20, why="MiB of one weight bucket; above 1 TiB no host holds it"),
    "RolloutConfig.num_engines": _r(0, MAX_RANKS, why="engines in the fleet (0: one per device)"),
    "RolloutConfig.generate_threads": _r(0, 4096, why="CPU threads per engine (0: 1); more than 4096 cores names no host"),
    "RolloutConfig.seed": _SEED,
    "CriticConfig.ppo_mini_batch_size": _MINI_BATCH,
    "CriticConfig.ppo_micro_batch_size_per_gpu": _MICRO,
    "CriticConfig.ppo_max_token_len_per_gpu": _TOKEN_BUDGET,
    "CriticConfig.forward_max_token_len_per_gpu": _TOKEN_BUDGET,
    "CriticConfig.ppo_epochs": _EPOCHS,
    "CriticConfig.cliprange_value": _r(0, why="the value clip range"),
    "OverlongBufferConfig.len": _r(0, MAX_TOKENS, why="tokens of the soft buffer"),
    "OverlongBufferConfig.penalty_factor": _r(0, why="the penalty at the hard limit"),
    "SandboxFusionConfig.max_concurrent": _r(1, MAX_RANKS, why="requests in flight"),
    "SandboxFusionConfig.memory_limit_mb": _r(1, 2**22, why="MiB per run; above 4 TiB no host holds it"),
    "RewardModelConfig.micro_batch_size": _MICRO,
    "RewardModelConfig.micro_batch_size_per_gpu": _MICRO,
    "RewardModelConfig.forward_max_token_len_per_gpu": _TOKEN_BUDGET,
    "RewardModelConfig.max_length": _r(1, MAX_TOKENS, why="tokens of one reward-model input"),
    "RewardModelConfig.num_workers": _r(0, 4096, why="scorer processes (0: in the trainer); more than 4096 cores names no host"),
    "RewardModelConfig.timeout": _r(**_POS, why="seconds"),
    "KLControlConfig.kl_coef": _COEF,
    "KLControlConfig.horizon": _r(1, why="the adaptive controller divides by it"),
    "KLControlConfig.target_kl": _r(**_POS, why="the adaptive controller divides by it"),
    "FilterGroupsConfig.max_num_gen_batches": _ANY_INT,
    "RolloutCorrectionConfig.rollout_rs_threshold_lower": _r(**_POS, why="a ratio bound"),
    "RolloutCorrectionConfig.rollout_token_veto_threshold": _r(**_POS, why="a ratio bound"),
    "AlgorithmConfig.gdpo_reward_weights": _FINITE,
    "AlgorithmConfig.gamma": _r(**_FRACTION, why="a discount factor"),
    "AlgorithmConfig.lam": _r(**_FRACTION, why="GAE's lambda"),
    "AlgorithmConfig.rollout_is_threshold": _r(**_POS, why="a ratio bound (null: rollout IS off)"),
    "AlgorithmConfig.rollout_is_threshold_lower": _r(**_POS, why="a ratio bound"),
    "AlgorithmConfig.rollout_is_veto_threshold": _r(**_POS, why="a ratio bound (null: no veto)"),
    "AlgorithmConfig.rollout_rs_threshold": _r(**_POS, why="a ratio or divergence bound"),
    "AlgorithmConfig.rollout_rs_threshold_lower": _r(**_POS, why="a ratio bound"),
    "AdcaGrpoConfig.fix_base": _r(0, why="a reward magnitude"),
    "AdcaGrpoConfig.alpha": _COEF,
    "AdcaGrpoConfig.beta": _COEF,
    "AdcaGrpoConfig.prm_steps": _r(0, why="a step count"),
    "AdcaGrpoConfig.prm_epoch": _r(0, why="an epoch count"),
    "AdcaGrpoConfig.consistent_scale": _COEF,
    "AdcaGrpoConfig.pos_unconsistent_scale": _COEF,
    "AdcaGrpoConfig.neg_unconsistent_scale": _COEF,
    "AdcaConfig.concurrent": _r(1, MAX_RANKS, why="judge requests in flight"),
    "AdcaConfig.api_max_retries": _r(0, why="a retry count"),
    "AdcaConfig.request_timeout": _r(**_POS, why="seconds"),
    "AdcaConfig.rate_limit_per_s": _r(**_POS, why="requests per second (null: unlimited)"),
    "AdcaConfig.judge_max_tokens": _r(1, MAX_TOKENS, why="tokens of one judge answer"),
    "AdcaConfig.local_max_seq_len": _r(1, MAX_TOKENS, why="the judge's context length"),
    "AdcaConfig.max_fallback_fraction": _r(**_FRACTION, why="a fraction of the judged trajectories"),
    "TrainerConfig.nnodes": _r(1, MAX_RANKS, why="nodes"),
    "TrainerConfig.n_gpus_per_node": _r(1, 4096, why="devices per node; no host has more than 4096"),
    "TrainerConfig.total_epochs": _r(1, why="passes over the training prompts"),
    "TrainerConfig.total_training_steps": _r(1, why="a step count (null: total_epochs passes)"),
    "TrainerConfig.critic_warmup": _r(0, why="a step count"),
    "TrainerConfig.test_freq": _r(why="verl: <= 0 means never"),
    "TrainerConfig.save_freq": _r(why="verl: <= 0 means never"),
    "TrainerConfig.max_actor_ckpt_to_keep": _r(why="<= 0 or null keeps all"),
    "TrainerConfig.log_val_generations": _r(0, MAX_BATCH, why="samples logged per validation"),
    "TrainerConfig.seed": _SEED,
    "AsyncTrainingConfig.staleness_threshold": _r(0, why="verl's fraction of extra prompts per weight version"),
    "AsyncTrainingConfig.trigger_parameter_sync_step": _r(1, why="steps between weight pushes"),
    "AsyncTrainingConfig.require_batches": _r(1, why="mini-batches per step"),
}


def field_type(tp):
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
        tp = field_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            sub_leaves, sub_open = _schema_keys(tp, key + ".")
            leaves.update(sub_leaves)
            open_prefixes |= sub_open
        else:
            leaves[key] = hints[f.name]
            if typing.get_origin(tp) in (dict, Dict) or tp is Any:
                open_prefixes.add(key)
    return leaves, open_prefixes


LEAVES, _OPEN = _schema_keys()


def numeric_kind(tp) -> Optional[tuple[type, bool]]:
    """``(int or float, is a list)`` for a numeric annotation (Optional and List[...] of a number included), else None."""
    base = field_type(tp)
    is_list = typing.get_origin(base) in (list, List)
    item = field_type(typing.get_args(base)[0]) if is_list else base
    return (item, is_list) if item in (int, float) else None


def _key_ranges(cls=CoxswainConfig, prefix="") -> dict[str, tuple[Optional[Range], type, bool]]:
    """Every numeric leaf ``{dotted key: (its Range or None when undeclared, int or float, is a list)}``: a
    field's range is looked up under its dataclass and then its bases (RefMegatronConfig -> MegatronConfig)."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = field_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            out.update(_key_ranges(type(default) if dataclasses.is_dataclass(default) else tp, prefix + f.name + "."))
            continue
        kind = numeric_kind(hints[f.name])
        if kind:
            rng = next((RANGES[f"{c.__name__}.{f.name}"] for c in cls.__mro__ if f"{c.__name__}.{f.name}" in RANGES), None)
            out[prefix + f.name] = (rng, *kind)
    return out


KEY_RANGES = _key_ranges()  # numeric key -> (Range, int/float, list); a None range fails tests/config/test_ranges.py
_SECTIONS = {k.rsplit(".", i)[0] for k in LEAVES for i in range(1, k.count(".") + 1)}


def type_name(tp) -> str:
    base = field_type(tp)
    name = getattr(base, "__name__", None) or str(base).replace("typing.", "")
    return f"{name} or null" if base is not tp else name


def closest_key(key: str) -> Optional[str]:
    """A valid key that ``key`` is plausibly a misspelling of, or None: the same leaf name under another
    section (a moved key), a close spelling of the whole key, or a close spelling of the leaf among its
    siblings. Suggestions below these similarity bars are worse than none."""
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in (*LEAVES, *VERL_MEGATRON) if k.rsplit(".", 1)[-1] == leaf]
    tail = [k for k in LEAVES if k.endswith("." + key)]
    if len(tail) == 1:  # the key given without (part of) its section
        return tail[0]
    if same_leaf:
        m = difflib.get_close_matches(key, same_leaf, n=1, cutoff=0.6)
        if m:
            return m[0]
    m = difflib.get_close_matches(key, list(LEAVES) + sorted(_SECTIONS), n=1, cutoff=0.9)
    if m:
        return m[0]
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    siblings = {k.rsplit(".", 1)[-1]: k for k in LEAVES if k.rsplit(".", 1)[0] == parent}
    siblings.update({k.rsplit(".", 1)[-1]: k for k in _SECTIONS if k.rsplit(".", 1)[0] == parent and "." in k})
    m = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.75)
    return siblings[m[0]] if m else None


@functools.lru_cache(maxsize=None)
def _structured(cls: type) -> DictConfig:
    """``OmegaConf.structured(cls)``, built once per process and kept read-only: building it walks every
    dataclass field (0.3-0.7 s for the whole schema on a 2-core machine, twice per load), a copy takes 0.04 s."""
    node = OmegaConf.structured(cls)
    OmegaConf.set_readonly(node, True)
    return node


def schema_defaults(cls: type = None) -> DictConfig:
    """A fresh, writable ``OmegaConf.structured(cls)`` (default: the whole schema, :class:`CoxswainConfig`): the
    same typed node, validation included, copied from a template built once."""
    node = copy.deepcopy(_structured(cls or CoxswainConfig))
    OmegaConf.set_readonly(node, None)
    return node


def is_schema_key(key: str) -> bool:
    return key in LEAVES or key in _SECTIONS or any(key.startswith(p + ".") for p in _OPEN)


def flatten_keys(node, prefix="") -> dict[str, Any]:
    """A nested mapping -> ``{dotted key: value}``; free-form dict fields and empty mappings stay whole."""
    out = {}
    items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else node.items()
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (dict, DictConfig)) and len(v) and key not in _OPEN and key not in LEAVES:
            out.update(flatten_keys(v, key + "."))
        else:
            out[key] = OmegaConf.to_container(v, resolve=False) if isinstance(v, (DictConfig, ListConfig)) else v
    return out



def all_keys() -> list[str]:
    return sorted(LEAVES)
