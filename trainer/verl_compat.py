"""verl compatibility: what Coxswain does with each key of verl's trainer config that its own schema lacks,
the features whose keys are accepted but not built yet (refused, never ignored), and verl's newer
``algorithm.rollout_correction`` tree translated to the rollout-IS keys.

Rules (the loader in :mod:`trainer.config` applies them, collecting every problem of a command line):

* A key of Coxswain's schema is set (verl's defaults are the schema's; see docs/configuration.md for the few
  deliberate exceptions).
* A key that only verl has (``trainer.verl_keys``) is accepted when it holds verl's default: it asks for
  nothing verl would not do by default and Coxswain behaves that way. Any other value is refused with a
  message naming the key and what to do: remove the line, or the Coxswain key that does the same thing.
  A few verl keys are implementation selectors that do not change what is trained (``NO_EFFECT``): any
  value is accepted and listed in the note the loader prints.
* verl's FSDP keys (``fsdp_config``, Ulysses, ``use_remove_padding``) are the schema's: they configure a role on
  ``strategy=fsdp`` / ``fsdp2`` and are refused on a megatron role with its megatron equivalent
  (``FSDP_MESSAGES``, applied by :func:`trainer.config.checks.fsdp_errors`).
* ``REFUSED``: schema keys whose feature is not built in this version; a non-default value is refused
  with the reason (never silently ignored).

Regenerate the verl key table from a verl checkout with ``python -m trainer.verl_compat --regenerate DIR``.
"""

from __future__ import annotations

import math
import pprint
import subprocess
import sys
from typing import Any, Callable, Optional

import yaml
from omegaconf import OmegaConf

from trainer import verl_keys
from trainer.transformer_overrides import MOE_KEYS, RECOMPUTE_KEYS

VERL_MEGATRON: dict[str, Any] = verl_keys.MEGATRON
VERL_FSDP_ONLY: dict[str, Any] = verl_keys.FSDP_ONLY

# verl keys that select verl's own implementation and change nothing that is trained: any value is
# accepted (and reported in the load note). key -> why it has no effect here.
NO_EFFECT: dict[str, str] = {
    "actor_rollout_ref.actor.megatron.use_mbridge": "Coxswain always converts HF <-> megatron with its own bridge",
    "actor_rollout_ref.actor.megatron.vanilla_mbridge": "Coxswain always converts HF <-> megatron with its own bridge",
    "actor_rollout_ref.ref.megatron.use_mbridge": "Coxswain always converts HF <-> megatron with its own bridge",
    "actor_rollout_ref.ref.megatron.vanilla_mbridge": "Coxswain always converts HF <-> megatron with its own bridge",
    "critic.megatron.use_mbridge": "Coxswain always converts HF <-> megatron with its own bridge",
    "critic.megatron.vanilla_mbridge": "Coxswain always converts HF <-> megatron with its own bridge",
    "trainer.use_legacy_worker_impl": "selects between verl's worker implementations",
    "actor_rollout_ref.nccl_timeout": "collective timeouts are torch.distributed's defaults",
    "critic.nccl_timeout": "collective timeouts are torch.distributed's defaults",
    "trainer.ray_wait_register_center_timeout": "verl's worker registration wait",
    "actor_rollout_ref.rollout.load_format": "the engines always receive the actor's weights by a verified sync",
    "actor_rollout_ref.rollout.disable_log_stats": "engine statistics logging",
    "actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend":
        "the attention kernel is megatron's / the bridge's choice for the device",
    "actor_rollout_ref.ref.megatron.override_transformer_config.attention_backend":
        "the attention kernel is megatron's / the bridge's choice for the device",
    "critic.megatron.override_transformer_config.attention_backend":
        "the attention kernel is megatron's / the bridge's choice for the device",
    "data.filter_overlong_prompts_workers": "prompts are filtered in the driver",
    "actor_rollout_ref.model.use_fused_kernels": "a kernel choice: the bridge computes log-probs and entropy with its "
                                                 "own vocab-parallel functions (the same values)",
    "actor_rollout_ref.model.fused_kernel_options.impl_backend": "a kernel choice (see use_fused_kernels)",
    "actor_rollout_ref.model.use_liger": "Liger patches HF models for verl's FSDP path; the megatron model is not an HF model",
    "actor_rollout_ref.actor.use_torch_compile": "verl's FSDP-side compile, which verl's megatron actor does not read "
                                                 "either; compile the megatron model with actor_rollout_ref.actor.megatron.use_torch_compile",
    "actor_rollout_ref.ref.use_torch_compile": "verl's FSDP-side compile, not read under megatron; use "
                                               "actor_rollout_ref.ref.megatron.use_torch_compile",
    "data.dataloader_num_workers": "prompts are tokenized once, in the driver",
    "critic.model.trust_remote_code": "the critic is converted by the bridge (Llama/Qwen2/Qwen3); no model code is loaded",
    "reward_model.model.trust_remote_code": "the reward model is converted by the bridge (Llama/Qwen2/Qwen3); no model "
                                            "code is loaded",
    "reward_model.megatron.use_mbridge": "Coxswain always converts HF <-> megatron with its own bridge",
    "reward_model.megatron.vanilla_mbridge": "Coxswain always converts HF <-> megatron with its own bridge",
    "reward_model.nccl_timeout": "collective timeouts are torch.distributed's defaults",
    "data.return_raw_chat": "each row always keeps its chat messages (the multi-turn loop and the judge read them)",
    **{f"{r}.fsdp_config.use_orig_params": "FSDP1's flat-parameter switch: FSDP2 always keeps the original parameters"
       for r in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")},
    **{f"{r}.fsdp_config.use_torch_compile": "verl compiles its entropy function with it; the entropy here is computed "
                                             "eagerly (the same values)"
       for r in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")},
}

# verl-only keys (or prefixes) set to a non-default value: the specific message (else the generic one).
VERL_MESSAGES: dict[str, str] = {
    # the actor's LoRA keys are the schema's (trainer/config/lora.py); the critic's are verl's only
    "critic.model.lora": "LoRA on the critic is not built (the critic trains all its weights); LoRA trains the actor: "
                         "actor_rollout_ref.model.lora.*; remove the critic's lora lines",
    "critic.model.lora_rank": "LoRA on the critic is not built; LoRA trains the actor (actor_rollout_ref.model.lora.*); "
                              "remove the line",
    "critic.model.lora_alpha": "LoRA on the critic is not built; remove the line",
    "actor_rollout_ref.actor.profiler": "profiling is not implemented; remove the profiler lines",
    "actor_rollout_ref.ref.profiler": "profiling is not implemented; remove the profiler lines",
    "actor_rollout_ref.rollout.profiler": "profiling is not implemented; remove the profiler lines",
    "critic.profiler": "profiling is not implemented; remove the profiler lines",
    "reward_model.profiler": "profiling is not implemented; remove the profiler lines",
    "global_profiler": "profiling is not implemented; remove the global_profiler lines",
    "reward_manager.source": "reward-manager classes loaded from a file are not supported: the registered managers "
                             "(reward_model.reward_manager=naive|prime|dapo|batch) are; a batch scorer "
                             "(reward_manager=batch + custom_reward_function.path) covers most custom managers",
    "reward_manager.module": "reward-manager classes loaded from a file are not supported: the registered managers "
                             "(reward_model.reward_manager=naive|prime|dapo|batch) are; a batch scorer "
                             "(reward_manager=batch + custom_reward_function.path) covers most custom managers",
    "actor_rollout_ref.rollout.agent": "verl's agent-loop workers: Coxswain's multi-turn loop is "
                                       "actor_rollout_ref.rollout.multi_turn.* (environment=pkg.module:Class)",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "tools are environments here: "
                                                             "actor_rollout_ref.rollout.multi_turn.environment=pkg.module:Class",
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": "interactions are environments here: "
                                                                    "actor_rollout_ref.rollout.multi_turn.environment=pkg.module:Class",
    "actor_rollout_ref.model.external_lib": "custom model code is not loaded: the bridge converts Llama/Qwen2/Qwen3; remove the line",
    "actor_rollout_ref.rollout.mtp": "multi-token prediction is not implemented; remove the lines",
    "actor_rollout_ref.model.mtp": "multi-token prediction is not implemented; remove the lines",
    "trainer.default_hdfs_dir": "HDFS upload is not implemented; remove the line (checkpoints stay in trainer.default_local_dir)",
    "trainer.rollout_data_dir": "rollout dumps: use trainer.debug.dump_batch_path=DIR",
    "trainer.validation_data_dir": "validation dumps are not implemented; use trainer.log_val_generations",
    "algorithm.use_pf_ppo": "PF-PPO is not implemented; remove the line",
    "algorithm.pf_ppo": "PF-PPO is not implemented; remove the lines",
    "transfer_queue": "verl's transfer queue: Coxswain's data plane is always on (trainer/workers/dataplane.py)",
    "ray_kwargs": "Ray settings come from RAY_ADDRESS / the embedded local cluster; remove the line",
    "actor_rollout_ref.actor.megatron.use_dist_checkpointing": "megatron distributed checkpoints are not implemented; "
                                                               "checkpoints are per-rank torch files plus an HF export",
    "actor_rollout_ref.actor.megatron.dist_checkpointing_path": "megatron distributed checkpoints are not implemented",
    "actor_rollout_ref.ref.megatron.use_dist_checkpointing": "megatron distributed checkpoints are not implemented",
    "actor_rollout_ref.ref.megatron.dist_checkpointing_path": "megatron distributed checkpoints are not implemented",
    "critic.megatron.use_dist_checkpointing": "megatron distributed checkpoints are not implemented",
    "critic.megatron.dist_checkpointing_path": "megatron distributed checkpoints are not implemented",
    "reward_model.rollout": "generative reward models (an LLM judge served by rollout engines) are not built; a "
                            "discriminative one is (reward_model.model.path: a *ForSequenceClassification checkpoint)",
    "reward_model.enable_resource_pool": "the reward model runs on the trainer's ranks; a separate resource pool is "
                                         "not built: remove the line",
    "reward_model.n_gpus_per_node": "the reward model runs on the trainer's ranks (trainer.n_gpus_per_node); a "
                                    "separate resource pool is not built: remove the line",
    "reward_model.nnodes": "the reward model runs on the trainer's ranks; a separate resource pool is not built: "
                           "remove the line",
    "reward_model.load_weight": "a reward model always loads its checkpoint (an untrained head scores noise): remove "
                                "the line",
    "reward_model.model.external_lib": "custom model code is not loaded: the bridge converts Llama/Qwen2/Qwen3; "
                                       "remove the line",
    "reward_model.megatron.use_dist_checkpointing": "megatron distributed checkpoints are not implemented; the reward "
                                                    "model is read from its HF checkpoint",
    "reward_model.megatron.dist_checkpointing_path": "megatron distributed checkpoints are not implemented",
    "reward_model.megatron.dist_checkpointing_prefix": "megatron distributed checkpoints are not implemented",
    "reward_model.use_reward_loop": "verl's reward loop (asynchronous reward workers) is not built: the driver scores "
                                    "each batch after generation; remove the line",
    "reward_model.reward_loop_source": "verl's reward loop is not built; remove the line",
    "reward_model.reward_loop_module_path": "verl's reward loop is not built; remove the line",
    "reward_model.reward_loop_class_name": "verl's reward loop is not built; remove the line",
    "reward_model.launch_reward_fn_async": "asynchronous reward functions are not built: the reward is computed "
                                           "after generation, in the step; remove the line",
}

# the FSDP-only sections and their megatron equivalents
# a verl FSDP setting given to a role on another strategy: its megatron equivalent (prefix -> hint)
FSDP_MESSAGES: dict[str, str] = {
    "actor_rollout_ref.actor.fsdp_config": "actor_rollout_ref.actor.megatron.{param_offload,grad_offload,optimizer_offload,use_distributed_optimizer}",
    "actor_rollout_ref.ref.fsdp_config": "actor_rollout_ref.ref.megatron.*",
    "critic.model.fsdp_config": "critic.megatron.*",
    "reward_model.model.fsdp_config": "reward_model.megatron.*",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "actor_rollout_ref.actor.megatron.context_parallel_size",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": "actor_rollout_ref.ref.megatron.context_parallel_size",
    "critic.ulysses_sequence_parallel_size": "critic.megatron.context_parallel_size",
    "reward_model.ulysses_sequence_parallel_size": "reward_model.megatron.context_parallel_size",
    "critic.model.use_remove_padding": "critic.megatron.use_remove_padding",
    "reward_model.model.use_remove_padding": "reward_model.megatron.use_remove_padding",
}


def megatron_equivalent(key: str) -> Optional[str]:
    """The megatron key(s) that do what the verl FSDP key ``key`` does, or None."""
    return _prefix_message(key, FSDP_MESSAGES)


def _offload(v) -> bool:
    return bool(v)


# Schema keys accepted but whose feature is not built in this version: (key suffix or full key,
# "is this value a request for the unbuilt feature?", reason). ``*`` stands for each megatron role.
_MEGATRON_ROLES = ("actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron", "critic.megatron",
                   "reward_model.megatron")
_OFFLOAD_CPU = ("offload frees accelerator memory between phases; with trainer.device=cpu the parameters, gradients "
                "and optimizer state already live in host memory, so it would only copy them back and forth: "
                "remove the line (or train on GPUs: trainer.device=cuda)")

REFUSED: list[tuple[str, Callable[[Any, Any], bool], str]] = [
    ("actor_rollout_ref.actor.ppo_micro_batch_size", lambda v, c: v is not None,
     "the global (legacy) micro-batch size is not supported: set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ("*.param_offload", lambda v, c: bool(v) and c.trainer.device == "cpu", _OFFLOAD_CPU),
    ("*.grad_offload", lambda v, c: bool(v) and c.trainer.device == "cpu", _OFFLOAD_CPU),
    ("*.optimizer_offload", lambda v, c: bool(v) and c.trainer.device == "cpu", _OFFLOAD_CPU),
    ("actor_rollout_ref.actor.router_replay.mode", lambda v, c: v == "R2",
     "R2 routing replay (record in the old-log-prob forward, replay in the update) is not built; R3 (the rollout "
     "engine's routing, replayed in every forward) is: router_replay.mode=R3 with "
     "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"),
    ("actor_rollout_ref.ref.router_replay.mode", lambda v, c: v == "R2",
     "R2 routing replay is not built; R3 is (router_replay.mode=R3)"),
    ("actor_rollout_ref.actor.router_replay.record_file", lambda v, c: v is not None,
     "dumping routes to a file is not built; remove the line"),
    ("actor_rollout_ref.actor.router_replay.replay_file", lambda v, c: v is not None,
     "replaying routes from a file is not built; remove the line"),
    ("actor_rollout_ref.ref.router_replay.record_file", lambda v, c: v is not None,
     "dumping routes to a file is not built; remove the line"),
    ("actor_rollout_ref.ref.router_replay.replay_file", lambda v, c: v is not None,
     "replaying routes from a file is not built; remove the line"),
    ("actor_rollout_ref.model.lora.a2a_experimental", lambda v, c: bool(v),
     "Megatron-Bridge's all-to-all LoRA communication for expert parallelism is not built (the adapters here "
     "communicate the rank-r intermediate inside the layer); remove the line"),
    ("actor_rollout_ref.model.lora.freeze_language_model", lambda v, c: v is False,
     "LoRA trains adapters on frozen base weights; training the base too is full fine-tuning: set "
     "actor_rollout_ref.model.lora.rank=0 (or remove the line)"),
    ("actor_rollout_ref.model.lora.freeze_vision_model", lambda v, c: v is False,
     "vision-language models are not built (the bridge converts Llama/Qwen2/Qwen3 text models); remove the line"),
    ("actor_rollout_ref.model.lora.freeze_vision_projection", lambda v, c: v is False,
     "vision-language models are not built (the bridge converts Llama/Qwen2/Qwen3 text models); remove the line"),
    ("reward_model.micro_batch_size", lambda v, c: v is not None,
     "the global (legacy) micro-batch size is not supported: set reward_model.micro_batch_size_per_gpu"),
]


def refused_keys() -> dict[str, str]:
    """Every schema key of the refusal table, expanded over the megatron roles -> reason."""
    out = {}
    for pat, _, why in REFUSED:
        for key in ([f"{r}.{pat[2:]}" for r in _MEGATRON_ROLES] if pat.startswith("*.") else [pat]):
            out[key] = why
    return out


def refusals(cfg) -> list[str]:
    """The refusal table applied to a merged config: one message per key holding an unbuilt request."""
    errs = []
    for pat, bad, why in REFUSED:
        for key in ([f"{r}.{pat[2:]}" for r in _MEGATRON_ROLES] if pat.startswith("*.") else [pat]):
            val = OmegaConf.select(cfg, key, default=None)
            if bad(val, cfg):
                errs.append(f"{key}={val}: {why}.")  # each reason ends in its own fix
    return errs


def verl_default(key: str):
    """verl's default for a key only verl has (``KeyError`` if verl has no such key)."""
    if key in VERL_MEGATRON:
        return VERL_MEGATRON[key]
    return VERL_FSDP_ONLY[key]


def same_value(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b or (str(a) == str(b) and isinstance(a, str) and isinstance(b, str))


def _prefix_message(key: str, table: dict[str, str]) -> Optional[str]:
    best = None
    for p, msg in table.items():
        if (key == p or key.startswith(p + ".")) and (best is None or len(p) > len(best[0])):
            best = (p, msg)
    return best[1] if best else None


def fsdp_message(key: str) -> Optional[str]:
    """The message for a key of verl's FSDP trainer that the schema lacks, or None if ``key`` is not one."""
    if key in VERL_FSDP_ONLY:
        return (f"'{key}' is a key of verl's FSDP trainer that Coxswain does not implement; remove the line "
                f"(verl's default {VERL_FSDP_ONLY[key]!r} is what runs)")
    return None


def verl_only(key: str, value) -> tuple[str, Optional[str]]:
    """A key only verl has: ``("ok", None)`` at verl's default, ``("no_effect", why)`` for an
    implementation selector, else ``("refused", message)``. ``("unknown", None)`` if verl has no such key."""
    if key in NO_EFFECT:  # noted only when it asks for something other than verl's default
        try:
            if same_value(value, verl_default(key)):
                return "ok", None
        except KeyError:
            pass
        return "no_effect", NO_EFFECT[key]
    msg = fsdp_message(key)
    if msg is not None:
        try:
            if same_value(value, verl_default(key)):
                return "ok", None
        except KeyError:
            pass
        special = _prefix_message(key, VERL_MESSAGES)  # e.g. the critic's LoRA: say why, not only "remove it"
        return "refused", (f"verl's '{key}': {special}" if special else msg)
    try:
        default = verl_default(key)
    except KeyError:
        special = _prefix_message(key, VERL_MESSAGES)
        if special is not None:  # a verl section with free-form children (e.g. lora.*)
            return "refused", f"verl's '{key}': {special}"
        return "unknown", None
    if same_value(value, default):
        return "ok", None
    special = _prefix_message(key, VERL_MESSAGES)
    return "refused", (f"verl's '{key}': {special}" if special else
                       f"verl's '{key}' is not implemented in Coxswain; remove the line (verl's default {default!r} is what runs)")


# ----------------------------------------------------------------------------------------------
# algorithm.rollout_correction (verl >= 0.6) -> the rollout-IS / rejection keys
# ----------------------------------------------------------------------------------------------
RS_OLD = {"token": ("token", "k1"), "sequence": ("seq_sum", "k1"), "geometric": ("seq_mean", "k1")}


def parse_rejection(spec: str, threshold, lower) -> list[dict]:
    """verl's ``rollout_rs`` (comma list; ``token`` | ``sequence`` | ``geometric`` or ``{agg}_{k1|k2|k3}``)
    with ``rollout_rs_threshold`` (a float, a ``"lo_hi"`` string, or one per option, comma-separated)
    -> ``[{agg, divergence, lower, upper}]`` in this project's rejection units (k1: log-ratio bounds)."""
    opts = list(dict.fromkeys(s.strip() for s in str(spec).split(",") if s.strip()))
    ths = [t.strip() for t in str(threshold).split(",")] if isinstance(threshold, str) and "," in str(threshold) else [threshold]
    if len(ths) not in (1, len(opts)):
        raise ValueError(f"algorithm.rollout_correction.rollout_rs_threshold has {len(ths)} entries for {len(opts)} "
                         f"rollout_rs options; give one, or one per option")
    out = []
    for i, opt in enumerate(opts):
        th = ths[0] if len(ths) == 1 else ths[i]
        if opt in RS_OLD:
            agg, div = RS_OLD[opt]
        else:
            agg, _, div = opt.rpartition("_")
            if agg not in ("token", "seq_sum", "seq_mean", "seq_max") or div not in ("k1", "k2", "k3"):
                raise ValueError(f"algorithm.rollout_correction.rollout_rs option '{opt}' is not token | sequence | "
                                 f"geometric or {{token,seq_sum,seq_mean,seq_max}}_{{k1,k2,k3}}")
        if th is None:
            raise ValueError(f"algorithm.rollout_correction.rollout_rs='{opt}' needs rollout_rs_threshold")
        if div == "k1":  # ratio bounds -> log-ratio bounds
            if isinstance(th, str) and "_" in th:
                lo, hi = (float(x) for x in th.split("_", 1))
            else:
                hi = float(th)
                lo = float(lower) if lower is not None else 1.0 / hi
            if not 0 < lo <= hi:
                raise ValueError(f"algorithm.rollout_correction: rejection ratio bounds {lo}_{hi} must satisfy 0 < lower <= upper")
            out.append(dict(agg=agg, divergence="k1", lower=math.log(lo), upper=math.log(hi)))
        else:
            out.append(dict(agg=agg, divergence=div, lower=None, upper=float(th)))
    return out


def regenerate(repo: str, out_path: str = "trainer/verl_keys.py") -> tuple[int, int]:
    """Rewrite ``trainer/verl_keys.py`` from a verl git checkout's generated trainer configs."""
    def load(path):
        return yaml.safe_load(subprocess.check_output(["git", "-C", repo, "show", f"HEAD:{path}"]))

    def flat(node, prefix=""):
        out = {}
        for k, v in node.items():
            key = prefix + str(k)
            if isinstance(v, dict) and v:
                out.update(flat(v, key + "."))
            elif not key.endswith("_target_"):
                out[key] = v
        return out

    commit = subprocess.check_output(["git", "-C", repo, "rev-parse", "HEAD"], text=True).strip()
    meg = flat(load("verl/trainer/config/_generated_ppo_megatron_trainer.yaml"))
    fsdp = flat(load("verl/trainer/config/_generated_ppo_trainer.yaml"))
    fsdp_only = {k: v for k, v in fsdp.items() if k not in meg}
    with open(out_path, "w") as f:
        f.write('"""verl\'s trainer key tree and defaults (data, generated; do not edit by hand).\n\n'
                f"Taken from verl commit {commit[:12]}'s generated ``ppo_megatron_trainer`` and ``ppo_trainer`` configs by\n"
                "``python -m trainer.verl_compat --regenerate VERL_CHECKOUT``. Values are verl's defaults before\n"
                "interpolation (``${...}`` strings are kept as verl writes them).\n\"\"\"\n\n")
        f.write(f"VERL_COMMIT = {commit!r}\n\n")
        f.write("# every leaf of verl's megatron trainer config -> its default\n")
        f.write("MEGATRON = " + pprint.pformat(meg, width=110, sort_dicts=True) + "\n\n")
        f.write("# leaves only verl's FSDP trainer config has -> default\n")
        f.write("FSDP_ONLY = " + pprint.pformat(fsdp_only, width=110, sort_dicts=True) + "\n")
    return len(meg), len(fsdp_only)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--regenerate":
        sys.exit("usage: python -m trainer.verl_compat --regenerate VERL_CHECKOUT")
    print("keys: megatron %d, FSDP-only %d" % regenerate(sys.argv[2]))


# the recompute and MoE-loss fields of ``*.megatron.override_transformer_config`` that Coxswain reads itself
# (the other TransformerConfig fields pass through: trainer.transformer_overrides)


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

