"""The cross-key checks of a loaded configuration: every problem of a command line is collected and
reported at once, each naming the keys involved and the fix (features not built are refused here, with
the reason), plus the settings derived from several keys (recompute, MoE, world size, which roles run).

One check function per schema section (``data_errors``, ``actor_errors``, ``megatron_errors``,
``rollout_errors``, ``reward_errors``, ``algorithm_errors``, ``trainer_errors``, ...), listed in the schema's
order in :data:`SECTION_CHECKS`; :func:`validation_errors` runs the choices and sizes first, then each
section. They live here, one module beside :mod:`.schema`, rather than as ``__post_init__`` methods on the
dataclasses (verl's way) because the loader checks an omegaconf ``DictConfig`` (interpolations resolved,
overrides applied), never a dataclass instance, and most rules join keys of two or three sections; the
schema stays declarative (its comments are ``--help-keys``). Every check only reads the config: what the
loader normalises first is :func:`trainer.config.load.resolve`. Hardware and environment checks are
:mod:`trainer.config.preflight`, at run time.
"""

from __future__ import annotations

import difflib
import re

from omegaconf import DictConfig, OmegaConf

from trainer.algos.correction import parse_is_threshold
from trainer.algos.losses import loss_keywords
from trainer.checkpoint import contents_errors
from trainer.lora import lora_errors
from trainer.config.plugins import HOOK_PARAMS, PIPELINE_PARAMS, load_step_callable
from trainer.config.schema import CHOICES, KEY_RANGES, AsyncTrainingConfig, ConfigError, DeepSpeedConfig, schema_defaults
from trainer.envs import Environment, env_factory
from trainer.hf_io import override_errors, override_fields
from trainer.rollout.registry import Capabilities, engine_class
from trainer.strategies import load_strategy
from trainer.optimizer_overrides import override_errors as optimizer_override_errors
from trainer.transformer_overrides import override_errors as transformer_override_errors
from trainer.verl_compat import megatron_equivalent, parse_rejection, refusals

# the keywords verl's reward managers take (reward_model.reward_kwargs go to the manager's constructor)
STRATEGY_KEYS = ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy", "critic.strategy",
                 "reward_model.strategy")
DAPO_KWARGS = ("max_resp_len", "overlong_buffer_cfg")
OVERLONG_FIELDS = ("enable", "len", "penalty_factor", "log")


def _reward_manager_errors(cfg) -> list[str]:
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
    ob = (OmegaConf.to_container(rm.reward_kwargs, resolve=True) or {}).get("overlong_buffer_cfg") or {}
    if rm.overlong_buffer.enable or ob.get("enable"):
        errs.append("DAPO overlong shaping (reward_model.overlong_buffer / reward_kwargs.overlong_buffer_cfg) with "
                    "reward_model.enable=true: verl's reward managers return the reward model's score unchanged, so "
                    "verl never shapes it; shaping a learned score is not built. Remove one of the two.")
    if rm.max_length is not None:
        if rm.model.input_tokenizer is None:
            errs.append("reward_model.max_length truncates re-tokenised reward-model inputs, and with "
                        "reward_model.model.input_tokenizer=null nothing is re-tokenised (the RM reads the actor's ids "
                        "whole): set input_tokenizer to the actor's tokenizer path, or remove max_length.")
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        errs.append("reward_model.enable=true with actor_rollout_ref.rollout.multi_turn.enable=true: an episode's reward "
                    "is the environment's return; scoring whole episodes with a reward model is not built.")
    return errs



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


FSDP_STRATEGIES = ("fsdp", "fsdp2")  # verl's two spellings; both run on trainer/strategies/fsdp2.py
PRECISION_NAMES = ("fp32", "float32", "32", "bf16", "bfloat16", "fp16", "float16", "16")


def fsdp_sections(cfg) -> dict:
    """Every role's ``(role section, its fsdp_config, its model-level section)``: verl keeps the critic's and the
    reward model's fsdp_config under ``model``."""
    arr = cfg.actor_rollout_ref
    return {"actor_rollout_ref.actor": (arr.actor, arr.actor.fsdp_config, "actor_rollout_ref.actor.fsdp_config"),
            "actor_rollout_ref.ref": (arr.ref, arr.ref.fsdp_config, "actor_rollout_ref.ref.fsdp_config"),
            "critic": (cfg.critic, cfg.critic.model.fsdp_config, "critic.model.fsdp_config"),
            "reward_model": (cfg.reward_model, cfg.reward_model.model.fsdp_config, "reward_model.model.fsdp_config")}


def _changed(node, default, prefix: str) -> list[str]:
    """The dotted keys of ``node`` that differ from ``default`` (both plain containers)."""
    out = []
    for k, v in node.items():
        d = default.get(k) if isinstance(default, dict) else None
        if isinstance(v, dict) and isinstance(d, dict):
            out += _changed(v, d, f"{prefix}{k}.")
        elif v != d:
            out.append(prefix + k)
    return out


def _dig(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


def fsdp_errors(cfg) -> list[str]:
    """verl's FSDP keys: on a role of another strategy, refused with the megatron equivalent; on an FSDP role,
    what FSDP2 here cannot take."""
    errs, ws = [], world_size(cfg)
    used = {"actor_rollout_ref.actor": True, "actor_rollout_ref.ref": need_ref(cfg), "critic": need_critic(cfg),
            "reward_model": bool(cfg.reward_model.enable)}
    for prefix, (role, fc, fc_key) in fsdp_sections(cfg).items():
        if role.strategy not in FSDP_STRATEGIES:
            errs += _fsdp_keys_elsewhere(cfg, prefix, role, fc, fc_key, used[prefix])
        elif used[prefix]:
            errs += _fsdp_role_errors(cfg, prefix, role, fc, fc_key, ws)
    return errs


def _fsdp_keys_elsewhere(cfg, prefix: str, role, fc, fc_key: str, used: bool) -> list[str]:
    """FSDP keys changed from their defaults on a role that is not on FSDP: one line naming them and the fix."""
    sp = role.ulysses_sequence_parallel_size
    default = OmegaConf.to_container(schema_defaults(OmegaConf.get_type(fc)), resolve=True)
    changed = [k for k in _changed(OmegaConf.to_container(fc, resolve=True), default, "")
               if k not in ("forward_only", "strategy")]
    flat = OmegaConf.to_container(fc, resolve=True)
    given = [f"{fc_key}.{k}={_dig(flat, k)}" for k in changed]
    follows = prefix == "actor_rollout_ref.ref" and sp == cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size
    if sp != 1 and used and not follows:  # the reference's size follows the actor's unless set
        given.append(f"{prefix}.ulysses_sequence_parallel_size={sp}")
    if not given:
        return []
    hint = megatron_equivalent(fc_key if changed else f"{prefix}.ulysses_sequence_parallel_size")
    return [f"{', '.join(given)} {'configures' if len(given) == 1 else 'configure'} verl's FSDP, but {prefix}.strategy={role.strategy}: set "
            f"{prefix}.strategy=fsdp (or --config-name=ppo_trainer, verl's FSDP defaults for every "
            f"role)" + (f", or use {hint}" if hint and role.strategy == "megatron" else ", or remove them") + "."]


def _fsdp_role_errors(cfg, prefix: str, role, fc, fc_key: str, ws: int) -> list[str]:
    """What an FSDP role asks for that FSDP2 here cannot take: sizes, wrapping, precisions, replay, optimizer."""
    errs, sp = [], role.ulysses_sequence_parallel_size
    if fc.strategy not in FSDP_STRATEGIES:
        errs.append(f"{fc_key}.strategy={fc.strategy!r}: verl's copy of the role's strategy is fsdp or fsdp2.")
    mg = role.megatron
    big = {k: mg[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                              "expert_model_parallel_size") if mg[k] not in (None, 1)}
    if big:
        errs.append(f"{prefix}.strategy={role.strategy} shards by FSDP over data parallelism (and Ulysses), but "
                    f"{prefix}.megatron asks for model parallelism {big}: set those to 1, or use strategy=megatron.")
    if ws % sp:
        errs.append(f"{prefix}.ulysses_sequence_parallel_size={sp} does not divide the role's {ws} ranks.")
    if fc.fsdp_size == 0 or (0 < fc.fsdp_size < ws and ws % fc.fsdp_size):
        errs.append(f"{fc_key}.fsdp_size={fc.fsdp_size}: use -1 (shard over all {ws} ranks) or a divisor of {ws} "
                    f"(hybrid sharding).")
    if fc.wrap_policy.min_num_params:
        errs.append(f"{fc_key}.wrap_policy.min_num_params={fc.wrap_policy.min_num_params}: FSDP1's size-based "
                    f"wrapping is not built; FSDP2 makes each decoder layer a unit (as verl's fsdp2 does): remove the "
                    f"line, or name the classes in {fc_key}.wrap_policy.transformer_layer_cls_to_wrap.")
    errs += _fsdp_precision_errors(fc, fc_key)
    if getattr(role, "router_replay", None) is not None and role.router_replay.mode != "disabled":
        errs.append(f"{prefix}.router_replay with strategy={role.strategy}: routing replay is built into the "
                    f"megatron routers only; use strategy=megatron for MoE routing replay.")
    optim = getattr(role, "optim", None)
    if optim is not None and prefix != "actor_rollout_ref.ref" and optim.optimizer != "adam":
        errs.append(f"{prefix}.optim.optimizer={optim.optimizer!r} with strategy={role.strategy}: the FSDP strategy "
                    f"trains with AdamW (optimizer=adam).")
    if prefix == "actor_rollout_ref.actor":
        a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
        dp = ws // sp if ws % sp == 0 else ws
        mini = a.ppo_mini_batch_size * r.n
        if mini % dp:
            errs.append(f"actor_rollout_ref.actor.ppo_mini_batch_size={a.ppo_mini_batch_size} x actor_rollout_ref."
                        f"rollout.n={r.n} = {mini} responses do not split over the data-parallel size {dp} (world "
                        f"{ws} / Ulysses {sp}).")
    return errs


def _fsdp_precision_errors(fc, fc_key: str) -> list[str]:
    """model_dtype, dtype and mixed_precision.*: known names only; buffers stay fp32."""
    errs = []
    mp = OmegaConf.to_container(fc.mixed_precision, resolve=True) if fc.mixed_precision is not None else {}
    for k, v in [("model_dtype", fc.model_dtype), ("dtype", fc.dtype)] + [(f"mixed_precision.{k}", v) for k, v in mp.items()]:
        if k.startswith("mixed_precision.") and k.split(".", 1)[1] not in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            errs.append(f"{fc_key}.{k}: mixed_precision takes param_dtype, reduce_dtype and buffer_dtype.")
        elif str(v) not in PRECISION_NAMES:
            errs.append(f"{fc_key}.{k}={v!r}: use fp32, bf16 or fp16.")
    if str(mp.get("buffer_dtype", "fp32")) not in ("fp32", "float32", "32"):
        errs.append(f"{fc_key}.mixed_precision.buffer_dtype={mp['buffer_dtype']!r}: FSDP2 keeps buffers in "
                    f"model_dtype; only fp32 is built.")
    return errs


def world_size(cfg: DictConfig) -> int:
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def need_ref(cfg) -> bool:
    """The reference model runs: a KL loss or a KL penalty in the reward reads its log-probs."""
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def need_critic(cfg) -> bool:
    """The critic runs: ``critic.enable``, or when unset exactly with the GAE estimator (verl's rule)."""
    return cfg.critic.enable if cfg.critic.enable is not None else cfg.algorithm.adv_estimator == "gae"


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
    if d.train_batch_size != a.ppo_mini_batch_size * at.require_batches:
        errs.append(f"async_training.mode=fully_async: a trainer step takes actor.ppo_mini_batch_size x "
                    f"async_training.require_batches = {a.ppo_mini_batch_size} x {at.require_batches} prompt groups "
                    f"(verl's rule), but data.train_batch_size={d.train_batch_size}: set data.train_batch_size="
                    f"{a.ppo_mini_batch_size * at.require_batches} (or change require_batches).")
    if at.partial_rollout:
        if r.multi_turn.enable:
            errs.append("async_training.partial_rollout=true resumes single-turn responses only; with "
                        "rollout.multi_turn.enable=true set async_training.partial_rollout=false.")
        caps = engine_capabilities(r.name)
        if caps is not None and not caps.partial_rollout:
            errs.append("async_training.partial_rollout=true resumes aborted requests on engines that keep the tokens "
                        "sampled so far (capabilities.partial_rollout: of the built-ins, on the native engine only); "
                        f"with rollout.name={r.name} set async_training.partial_rollout=false.")
    if cfg.trainer.debug.rollout_only:
        errs.append("async_training.mode=fully_async with trainer.debug.rollout_only=true: without updates there are "
                    "no weight pushes, and the rollouter stops at its per-version quota; remove one of the two.")
    if cfg.trainer.critic_warmup:
        errs.append("async_training.mode=fully_async with trainer.critic_warmup > 0 is not built: the rollouter's weight "
                    "versions count actor updates; set trainer.critic_warmup=0.")
    return errs


def _pipeline_errors(cfg: DictConfig) -> list[str]:
    """trainer.hooks / trainer.pipeline name importable functions (imported now, so a typo fails at load)."""
    t, errs = cfg.trainer, []
    specs = [(f"trainer.hooks.{p}", s, HOOK_PARAMS) for p, lst in t.hooks.items() for s in (lst or [])]
    specs += [("trainer.pipeline", t.pipeline, PIPELINE_PARAMS)] if t.pipeline else []
    for key, spec, params in specs:
        try:
            load_step_callable(spec, key, params)
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
    caps = engine_capabilities(r.name)
    if replaying and caps is not None and not caps.routing_replay:
        adapter = engine_class(r.name).__name__.removesuffix("Engine")
        errs.append(f"R3 routing replay with actor_rollout_ref.rollout.name={r.name} is not built yet (the {adapter} "
                    "adapter does not return routed experts: capabilities.routing_replay); it runs with the native engine.")
    return errs


def engine_capabilities(name: str) -> Capabilities | None:
    """What rollout engine ``name`` can do; None when the name is refused (by its own message)."""
    try:
        return engine_class(name).capabilities
    except ValueError:
        return None


def validate(cfg: DictConfig) -> None:
    """Raise one ``ConfigError`` listing every cross-field problem of ``cfg``."""
    errs = validation_errors(cfg)
    if errs:
        raise ConfigError(error_report(errs))


def choice_errors(cfg: DictConfig) -> list[str]:
    """The refusal table (verl features not built) and every enumerated key against its choices."""
    errs: list[str] = list(refusals(cfg))
    r0 = cfg.actor_rollout_ref.rollout
    if r0.name in OTHER_ENGINES:
        # on CPU the answer is the native engine (SGLang's CPU path is a separate install)
        use = "native" if cfg.trainer.device == "cpu" else "sglang"
        errs.append(f"actor_rollout_ref.rollout.name={r0.name}: Coxswain's engines are sglang (GPU) and native (CPU or "
                    f"GPU); use actor_rollout_ref.rollout.name={use}.")
    elif ":" in str(r0.name):  # a user's engine: it must import and be an engine class (the fault and the fix)
        try:
            engine_class(r0.name)
        except ValueError as e:
            errs.append(str(e))
    for key in STRATEGY_KEYS:  # a user's strategy: it must import and be a Strategy subclass
        if ":" in str(OmegaConf.select(cfg, key)):
            try:
                load_strategy(OmegaConf.select(cfg, key))
            except ValueError as e:
                errs.append(f"{key}: {e}")
    for key, (allowed, pluggable) in CHOICES.items():
        val = OmegaConf.select(cfg, key)
        if key == "actor_rollout_ref.rollout.name" and val in OTHER_ENGINES:
            continue  # its own message below
        if val is None or val in allowed or (pluggable and ":" in str(val)):
            continue
        guess = difflib.get_close_matches(str(val), allowed, n=1)
        extra = (" or 'pkg.module:Class'" if key in STRATEGY_KEYS or key.endswith("rollout.name")
                 else " or 'pkg.module:function'") if pluggable else ""
        errs.append(f"{key}='{val}' is not one of {list(allowed)}{extra}."
                    + (f" Did you mean '{guess[0]}'?" if guess else ""))
    return errs


_FOLLOWS = re.compile(r"^\$\{(oc\.select:[\w.]+,[^}]*|\.?[\w.]+)\}$")  # ${oc.select:key,default} or ${key} / ${.key}


def range_errors(cfg: DictConfig) -> list[str]:
    """Every numeric key against its declared range (:data:`trainer.config.schema.RANGES`): one line per value
    out of range, naming the key, the value, the range and what bounds it. ``null`` passes (omegaconf already
    refused it for a key that is not Optional); a list key is checked item by item."""
    errs = []
    for key, (rng, kind, is_list) in KEY_RANGES.items():
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent)
        if OmegaConf.is_interpolation(node, leaf) and _FOLLOWS.match(str(node._get_node(leaf)._value())):
            continue  # it follows another key (verl's interpolations), which is checked itself: one error, at the source
        val = OmegaConf.select(cfg, key)
        if val is None:
            continue
        items = list(enumerate(val)) if is_list else [(None, val)]
        for i, v in items:
            if v is None or rng.admits(v, kind is int):
                continue
            name = key if i is None else f"{key}[{i}]"
            bad = "is not a finite number" if v != v or v in (float("inf"), float("-inf")) else "is out of range"
            errs.append(f"{name}={v!r} {bad}: allowed {rng.text(kind is int)} for {rng.why}; set {name} to a value in that range.")
    return errs


def validation_errors(cfg: DictConfig) -> list[str]:
    """Cross-field checks and the refusal table, section by section (:data:`SECTION_CHECKS`). Every message
    names all the keys involved and what to change. Pure: the config is read, never changed (the loader's
    :func:`trainer.config.load.resolve` runs first). Nothing here looks at this machine's hardware (a GPU
    recipe resolves on a CPU login node); :mod:`trainer.config.preflight` does that at run time."""
    errs = choice_errors(cfg)
    ranges = range_errors(cfg)
    if ranges:  # the section checks compare, multiply and divide by these
        return errs + ranges
    for check in SECTION_CHECKS:
        errs += check(cfg)
    return errs


def data_errors(cfg: DictConfig) -> list[str]:
    """``data.*``: the batch sizes in prompts."""
    d, a, errs = cfg.data, cfg.actor_rollout_ref.actor, []
    if d.train_batch_size % a.ppo_mini_batch_size:
        errs.append(f"data.train_batch_size={d.train_batch_size} is not divisible by "
                    f"actor_rollout_ref.actor.ppo_mini_batch_size={a.ppo_mini_batch_size}; "
                    f"make train_batch_size a multiple of ppo_mini_batch_size.")
    return errs


def megatron_roles(cfg: DictConfig) -> list[tuple]:
    """``(role prefix, its megatron section)`` of every role that runs megatron-core's layout checks (an FSDP role
    has its own, :func:`fsdp_errors`)."""
    arr, rm = cfg.actor_rollout_ref, cfg.reward_model
    roles = [("actor_rollout_ref.actor", arr.actor), ("actor_rollout_ref.ref", arr.ref), ("critic", cfg.critic),
             *([("reward_model", rm)] if rm.enable and rm.strategy == "megatron" else [])]
    return [(p, r.megatron) for p, r in roles if r.strategy not in FSDP_STRATEGIES]


def megatron_errors(cfg: DictConfig) -> list[str]:
    """``*.megatron``: each role's transformer-config overrides and its parallel layout over the world."""
    errs = []
    for role, mcfg in megatron_roles(cfg):
        errs += _override_errors(cfg, role, mcfg)
        errs += _layout_errors(cfg, role, mcfg)
    return errs


def _override_errors(cfg: DictConfig, role: str, mcfg) -> list[str]:
    """``<role>.megatron.override_transformer_config``: megatron-core TransformerConfig fields
    (:func:`trainer.transformer_overrides.override_errors`)."""
    return transformer_override_errors(role, OmegaConf.to_container(mcfg.override_transformer_config, resolve=True),
                                       cfg.trainer.device)


def _layout_errors(cfg: DictConfig, role: str, mcfg) -> list[str]:
    """``<role>.megatron``: TP x PP x CP (and EP) divide the world; the actor's mini-batch splits over DP; VPP
    and an uneven layer split fit the pipeline."""
    errs, ws = [], world_size(cfg)
    ep, etp = mcfg.expert_model_parallel_size, mcfg.expert_tensor_parallel_size
    tp, pp, cp = mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size, mcfg.context_parallel_size
    if ws % ((etp or tp) * ep * pp):
        errs.append(f"{role}.megatron.expert_model_parallel_size={ep} x expert_tensor_parallel_size="
                    f"{etp or tp} x pipeline_model_parallel_size={pp} does not divide the world size {ws}.")
    if ws % (tp * pp * cp):
        errs.append(f"{role}.megatron.tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp}"
                    + (f" x context_parallel_size={cp}" if cp > 1 else "")
                    + f" = {tp * pp * cp} does not divide the world size trainer.nnodes={cfg.trainer.nnodes} x "
                    f"trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node} = {ws}.")
        return errs
    if role == "actor_rollout_ref.actor":
        a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
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
    if vpp is not None and vpp > 1 and pp < 2:
        errs.append(f"{role}.megatron.virtual_pipeline_model_parallel_size={vpp} interleaves pipeline stages: it needs "
                    f"{role}.megatron.pipeline_model_parallel_size >= 2 (got {pp}).")
    elif vpp is not None and vpp > 1 and mcfg.pipeline_layer_split is not None:
        errs.append(f"{role}.megatron.virtual_pipeline_model_parallel_size={vpp} needs an even split: remove "
                    f"{role}.megatron.pipeline_layer_split.")
    split = mcfg.pipeline_layer_split
    if split is not None and len(split) != pp:
        errs.append(f"{role}.megatron.pipeline_layer_split has {len(split)} entries but "
                    f"{role}.megatron.pipeline_model_parallel_size={pp}.")
    return errs


def micro_batch_errors(cfg: DictConfig) -> list[str]:
    """Every running role's micro-batch: a count or a token budget (verl requires one of the two)."""
    a, r, errs = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, []
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
    return errs


def actor_errors(cfg: DictConfig) -> list[str]:
    """``actor_rollout_ref.actor`` (and its model): packing, checkpoint contents, plug-in loss keywords."""
    a, errs = cfg.actor_rollout_ref.actor, []
    model = cfg.actor_rollout_ref.model
    if model.use_remove_padding and not a.megatron.use_remove_padding and a.strategy == "megatron":
        errs.append("actor_rollout_ref.model.use_remove_padding=true but actor_rollout_ref.actor.megatron.use_remove_padding="
                    "false: the megatron roles pack by megatron.use_remove_padding; remove one of the two lines.")
    ck = cfg.actor_rollout_ref.actor.checkpoint
    errs.extend(contents_errors(list(ck.save_contents), list(ck.load_contents)))
    errs.extend(_policy_loss_kwargs_errors(a.policy_loss))
    return errs


def _policy_loss_kwargs_errors(pl) -> list[str]:
    """``policy_loss.kwargs`` go to a plug-in loss only, and may not shadow the losses' shared keywords
    (each has its own config key, and the call passes it already)."""
    kw = sorted(OmegaConf.to_container(pl.kwargs, resolve=True) or {})
    if not kw:
        return []
    if ":" not in str(pl.loss_mode):
        return [f"actor_rollout_ref.actor.policy_loss.kwargs {kw} are passed to a plug-in loss "
                f"(loss_mode=pkg.module:function); the built-in loss_mode={pl.loss_mode} reads its hyper-parameters "
                f"from their own keys (actor_rollout_ref.actor.policy_loss.*, actor.clip_ratio*, ...): remove them."]
    shadow = sorted(set(kw) & loss_keywords())
    if shadow:
        return [f"actor_rollout_ref.actor.policy_loss.kwargs {shadow} are keywords every policy loss is already called "
                f"with (set by their own config keys): give your loss's own hyper-parameters other names."]
    return []


def rollout_errors(cfg: DictConfig) -> list[str]:
    """``actor_rollout_ref.rollout``: the engines' prompt room and slots, sampling, the weight-sync path."""
    d, r, errs = cfg.data, cfg.actor_rollout_ref.rollout, []
    if r.prompt_length < d.max_prompt_length:
        errs.append(f"actor_rollout_ref.rollout.prompt_length={r.prompt_length} is shorter than data.max_prompt_length="
                    f"{d.max_prompt_length}: the engines could not hold the longest prompt; raise it or leave it unset.")
    # rollout.name=sglang with trainer.device=cpu runs SGLang's CPU path (trainer/rollout/sglang_cpu); whether it is
    # installed is checked at run time (trainer.main.check_supported), so --print-config resolves anywhere.
    if r.weight_sync == "distributed_group":
        if r.mode != "sync":
            errs.append(f"actor_rollout_ref.rollout.weight_sync=distributed_group with rollout.mode={r.mode}: the group "
                        f"joins the actor with Ray engine workers (mode=sync, native or SGLang); the HTTP fleet's "
                        f"servers sync through their own endpoints. Use weight_sync=auto.")
        elif cfg.trainer.placement != "split" and cfg.actor_rollout_ref.hybrid_engine:
            errs.append("actor_rollout_ref.rollout.weight_sync=distributed_group with the hybrid engine (colocated, "
                        "actor_rollout_ref.hybrid_engine=true): its engines live in the actor's processes, where the sync "
                        "is a copy in shared memory. Set trainer.placement=split (or hybrid_engine=false) for engine "
                        "workers of their own, or weight_sync=auto.")
        elif cfg.trainer.debug.in_process:
            errs.append("actor_rollout_ref.rollout.weight_sync=distributed_group with trainer.debug.in_process=true: the "
                        "group joins separate processes; use weight_sync=auto to debug in process.")
    if r.mode != "sync" and cfg.trainer.debug.in_process:
        errs.append(f"actor_rollout_ref.rollout.mode={r.mode} with trainer.debug.in_process=true: the fleet's servers are "
                    f"separate processes by design; use rollout.mode=sync to debug in process.")
    return errs


def reward_errors(cfg: DictConfig) -> list[str]:
    """``reward_model.*`` / ``custom_reward_function.*``: the code sandbox, overlong shaping, the manager's
    keywords and the learned reward model."""
    d, errs = cfg.data, []
    sf = cfg.reward_model.sandbox_fusion
    if sf.url is not None and not str(sf.url).startswith(("http://", "https://")):
        errs.append(f"reward_model.sandbox_fusion.url={sf.url!r} must be an http(s) URL of the service's run_code endpoint.")
    ob = cfg.reward_model.overlong_buffer
    if ob.enable and not (0 < ob.len <= d.max_response_length):
        errs.append(f"reward_model.overlong_buffer.len={ob.len} must be in (0, data.max_response_length={d.max_response_length}].")
    errs.extend(_reward_manager_errors(cfg))
    errs.extend(_reward_model_errors(cfg))
    return errs


def algorithm_errors(cfg: DictConfig) -> list[str]:
    """``algorithm.*``: rollout IS / rejection (flat keys and ``rollout_correction``), DAPO's group filter,
    the group estimators, and the estimators' and losses' own hyper-parameters."""
    r, errs = cfg.actor_rollout_ref.rollout, []
    al = cfg.algorithm
    up, lo = al.rollout_is_threshold, al.rollout_is_threshold_lower
    if lo is not None and up is not None and lo > up:
        errs.append(f"algorithm.rollout_is_threshold_lower={lo} is greater than algorithm.rollout_is_threshold={up}; "
                    f"the lower bound must be <= the upper bound.")
    if lo is not None and up is None:
        errs.append(f"algorithm.rollout_is_threshold_lower={lo} is set but algorithm.rollout_is_threshold is null "
                    f"(rollout IS disabled); set rollout_is_threshold too.")
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
    if cfg.algorithm.filter_groups.enable:
        if al.adv_estimator == "gae":
            errs.append("algorithm.filter_groups.enable=true needs a group estimator; algorithm.adv_estimator=gae has no groups.")
        if r.n < 2:
            errs.append(f"algorithm.filter_groups.enable=true needs actor_rollout_ref.rollout.n >= 2 (got {r.n}).")
    if al.adv_estimator in ("grpo", "dr_grpo", "rloo", "grpo_passk", "reinforce_plus_plus_baseline", "adca_grpo",
                            "grpo_vectorized", "rloo_vectorized", "opo", "gpg", "gdpo", "cpgd") and r.n < 2:
        errs.append(f"algorithm.adv_estimator={al.adv_estimator} compares responses within a group: "
                    f"set actor_rollout_ref.rollout.n >= 2 (got {r.n}).")
    errs.extend(_rollout_correction_errors(al))
    errs.extend(_algorithm_variant_errors(cfg))
    return errs


def _adca_errors(cfg: DictConfig) -> list[str]:
    """``evaluation_type=rule`` needs an environment with a rule step judge; ``rule_environment`` is read only then."""
    ac = cfg.attribution_driven_credit_assignment
    key = "attribution_driven_credit_assignment"
    if ac.evaluation_type != "rule":
        return ([f"{key}.rule_environment='{ac.rule_environment}' is read only with {key}.evaluation_type=rule "
                 f"(it is '{ac.evaluation_type}'): drop it, or set evaluation_type=rule."]
                if ac.rule_environment is not None else [])
    name = ac.rule_environment or cfg.actor_rollout_ref.rollout.multi_turn.environment
    try:
        env = env_factory(name)
    except (ImportError, AttributeError, ValueError) as e:
        return [f"{key}.evaluation_type=rule: the environment '{name}' does not load ({e})."]
    own = getattr(getattr(env, "label_steps", None), "__func__", None)  # a class's classmethod, else None
    if own is None or own is Environment.label_steps.__func__:
        return [f"{key}.evaluation_type=rule: the environment '{name}' has no rule step judge (it does not define "
                f"label_steps); use evaluation_type=local or api, or set {key}.rule_environment to one that has "
                f"(towers)."]
    return []


def trainer_errors(cfg: DictConfig) -> list[str]:
    """``trainer.*``: the horizon, loggers, resume, debug modes, user hooks and pipeline."""
    errs = []
    t = cfg.trainer
    twice = sorted({x for x in cfg.trainer.logger if list(cfg.trainer.logger).count(x) > 1})
    if twice:  # two trackers of one kind would log every metric twice into one run (MLflow refuses the second)
        errs.append(f"trainer.logger={list(cfg.trainer.logger)} names {twice} more than once; list each logger once.")
    bad_loggers = [x for x in cfg.trainer.logger if x not in LOGGERS]
    if bad_loggers:
        errs.append(f"trainer.logger has {bad_loggers}; supported loggers are {list(LOGGERS)} "
                    f"(MLFLOW_TRACKING_URI selects an MLflow server; wandb runs offline without WANDB_API_KEY).")
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        errs.append("trainer.resume_mode=resume_path needs trainer.resume_from_path.")
    if cfg.trainer.debug.rollout_only and cfg.trainer.debug.train_only:
        errs.append("trainer.debug.rollout_only and trainer.debug.train_only cannot both be true.")
    if cfg.trainer.debug.train_only and not cfg.trainer.debug.dump_batch_path:
        errs.append("trainer.debug.train_only=true needs trainer.debug.dump_batch_path (a batch dumped by an earlier run).")
    errs += _pipeline_errors(cfg)
    return errs


def _hf_override_errors(cfg: DictConfig) -> list[str]:
    """verl's ``*.model.override_config``: known fields and values (:func:`trainer.hf_io.override_errors`), and
    readers that apply them: the native and SGLang engines in Ray workers (an HTTP fleet's servers and a user's
    engine are not given them)."""
    errs = []
    for key in ("actor_rollout_ref.model.override_config", "critic.model.override_config",
                "reward_model.model.override_config"):
        errs += override_errors(OmegaConf.to_container(OmegaConf.select(cfg, key)), key)
    r = cfg.actor_rollout_ref.rollout
    if override_fields(OmegaConf.to_container(cfg.actor_rollout_ref.model.override_config)):
        if r.mode in ("server", "async"):
            errs.append(f"actor_rollout_ref.model.override_config with actor_rollout_ref.rollout.mode={r.mode}: the "
                        f"engine servers read the checkpoint's config.json as it is, so they would sample from another "
                        f"model than the trainer's; use rollout.mode=sync, or edit config.json.")
        elif r.name not in ("native", "sglang", *OTHER_ENGINES):  # the other engines are refused on their own
            errs.append(f"actor_rollout_ref.model.override_config with actor_rollout_ref.rollout.name={r.name}: only "
                        f"the native and sglang engines are given the overrides; use one of them, or edit config.json.")
    return errs


def _optimizer_override_errors(cfg: DictConfig) -> list[str]:
    """verl's ``<role>.optim.override_optimizer_config`` of the trained roles: megatron-core OptimizerConfig
    fields (:func:`trainer.optimizer_overrides.override_errors`)."""
    errs = []
    for role, section in (("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor), ("critic", cfg.critic)):
        over = OmegaConf.to_container(section.optim.override_optimizer_config, resolve=True) or {}
        errs += optimizer_override_errors(role, over, strategy=section.strategy, device=cfg.trainer.device)
    return errs


# The section checks in the schema's order; each reads its section (and the keys it must agree with).
SECTION_CHECKS = (data_errors, actor_errors, megatron_errors, micro_batch_errors, rollout_errors,
                  _routing_replay_errors, reward_errors, algorithm_errors, _adca_errors, trainer_errors, _async_errors, deepspeed_errors,
                  fsdp_errors, _hf_override_errors, _optimizer_override_errors, lora_errors)

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
    if mode != "sapo" and (a.tau_pos != 1.0 or a.tau_neg != 1.05):
        errs.append(f"actor_rollout_ref.actor.tau_pos / tau_neg are read by loss_mode=sapo only (loss_mode={mode}); "
                    f"remove them.")
    if a.policy_drift_coeff and mode != "cpgd":
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
    try:  # a number (truncation) or verl's "lo_hi" (IcePop); read for the metrics even with rollout_is null
        parse_is_threshold(rc.rollout_is_threshold)
    except (TypeError, ValueError) as e:
        errs.append(f"algorithm.rollout_correction.{e}.")
    if rc.rollout_rs is not None:
        try:
            parse_rejection(rc.rollout_rs, rc.rollout_rs_threshold if rc.rollout_rs_threshold is not None
                            else (rc.rollout_is_threshold if rc.rollout_rs in ("token", "sequence", "geometric") else None),
                            rc.rollout_rs_threshold_lower)
        except ValueError as e:
            errs.append(str(e))
    return errs

def error_report(errors: list[str]) -> str:
    n = len(errors)
    return (f"{n} problem{'s' if n > 1 else ''} in the configuration:\n" +
            "\n".join(f"  {i}. {e}" for i, e in enumerate(errors, 1)))
