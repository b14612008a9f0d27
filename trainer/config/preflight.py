"""Preflight: what this machine and the files on disk must give a configuration, checked before any worker
starts. The load-time checks (:mod:`trainer.config.checks`) never look at the hardware, so a GPU recipe
resolves on a CPU login node (``--print-config``); these run where the job runs:

* :func:`check_supported`: CUDA for ``trainer.device=cuda``; SGLang (GPU, its CPU install, or a server
  interpreter) for ``rollout.name=sglang``, as the engine class says (``unavailable``);
* :func:`check_node_layout`: on more than one node, every tensor-parallel group within one node;
* :func:`check_model`: the model directories against the settings (routing replay needs an MoE model; the
  reward model's head, vocabulary and tokenizers, with :func:`rm_inputs`);
* :func:`check_code_sandbox`: code-scored data only on a host whose sandbox can contain the code;
* :func:`check_data_sources`: every row's ``data_source`` has a scorer, unless a custom reward function scores them;
* :func:`check_paths`: every path the run reads exists (:func:`missing_paths`; ``--print-config``, which serves
  login nodes where the paths live elsewhere, prints the same list as notes and still resolves).

Each raises ``ConfigError`` naming the keys and the fix.
"""

from __future__ import annotations

import os

import torch
from omegaconf import ListConfig, OmegaConf

from megatron_bridge.hf_config import UnsupportedConfig, read_hf_config
from trainer.config.checks import need_critic, need_ref
from trainer.config.schema import ConfigError
from trainer.rewards.reward_model import RMInputs, check_score_head
from trainer.rewards.sandbox import SandboxUnavailable, check_host
from trainer.rewards.scorers import code_score, get_scorer, has_scorer, unknown_sources_message
from trainer.rollout.registry import engine_class


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the model keys trainer.main.resolve_model_paths also looks up from the repository root (the shipped tiny models);
# the reward model's input_tokenizer follows the actor's path (verl's interpolation), so it is found the same way
ROOT_RELATIVE = ("actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path", "critic.model.path",
                 "reward_model.model.path", "reward_model.model.input_tokenizer")


def path_keys(cfg) -> list[tuple[str, object, bool]]:
    """``(key, value, must be a directory)`` of every path this run reads: the models and tokenizers of the roles
    that run, the data files, the user's scorer file, a resume directory, a local judge. A key that is null (the
    default, the synthetic task, the actor's model) or whose role does not run is left out."""
    arr, rm, crf = cfg.actor_rollout_ref, cfg.reward_model, cfg.custom_reward_function
    adca = cfg.attribution_driven_credit_assignment
    keys = [("actor_rollout_ref.model.path", True), ("actor_rollout_ref.model.tokenizer_path", True),
            ("data.tokenizer", True), ("data.train_files", False), ("data.val_files", False)]
    if need_critic(cfg):
        keys += [("critic.model.path", True), ("critic.model.tokenizer_path", True)]
    if rm.enable:
        keys += [("reward_model.model.path", True), ("reward_model.model.input_tokenizer", True)]
    # verl's custom_reward_function.path is a python file; Coxswain also takes an importable module name
    if crf.path and (str(crf.path).endswith(".py") or os.sep in str(crf.path)):
        keys.append(("custom_reward_function.path", False))
    if cfg.trainer.resume_mode == "resume_path":
        keys.append(("trainer.resume_from_path", True))
    if adca.enable and adca.evaluation_type == "local":
        keys.append(("attribution_driven_credit_assignment.local_model_path", True))
    out = []
    for key, is_dir in keys:
        val = OmegaConf.select(cfg, key)
        for v in (val if isinstance(val, (list, ListConfig)) else [val]):
            if v is not None:
                out.append((key, str(v), is_dir))
    return out


def missing_paths(cfg) -> list[str]:
    """One line per path of :func:`path_keys` that is not there (or not a directory where one is needed)."""
    lines = []
    for key, val, is_dir in path_keys(cfg):
        p = os.path.expanduser(val)
        if key in ROOT_RELATIVE and not os.path.isabs(p) and not os.path.exists(p):
            p = os.path.join(ROOT, p) if os.path.exists(os.path.join(ROOT, p)) else p
        if not os.path.exists(p):
            lines.append(f"{key}={val!r} does not exist on this machine")
        elif is_dir and not os.path.isdir(p):
            lines.append(f"{key}={val!r} is not a directory")
    return lines


def check_paths(cfg) -> None:
    """Before any worker starts: every path the run reads is there (all missing ones named at once)."""
    missing = missing_paths(cfg)
    if missing:
        # one line, as every refusal (the console and the CLI show the last line of an error)
        raise ConfigError("paths the run reads are missing: " + "; ".join(missing)
                          + ". Fix the paths (they are resolved from the working directory), or copy the files here.")


class NotSupportedYet(ConfigError):
    """A configuration that is valid but that this machine cannot run (the message names what is missing)."""


def check_supported(cfg) -> None:
    """Refuse, with the reason, what this machine cannot run: the hardware checks that ``--print-config``
    leaves out (a GPU recipe resolves on a CPU login node). Everything else is refused at load time."""
    r = cfg.actor_rollout_ref.rollout
    gaps = []
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        gaps.append("trainer.device=cuda but this machine has no CUDA GPU: run on GPU nodes, or set trainer.device=cpu "
                    "(with actor_rollout_ref.rollout.name=native)")
    why = engine_class(r.name).unavailable(server=r.mode in ("server", "async"))  # the engine knows what it needs
    if why:
        gaps.append(why)
    if gaps:
        raise NotSupportedYet("this machine cannot run the requested configuration:\n  - " + "\n  - ".join(gaps))


def check_node_layout(cfg) -> None:
    """On more than one node, every tensor-parallel group must fit in one node: megatron's TP ranks are
    consecutive, so TP (and a rollout engine's TP) must divide ``trainer.n_gpus_per_node``."""
    t = cfg.trainer
    if t.nnodes <= 1:
        return
    sizes = [("actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
              cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size),
             ("actor_rollout_ref.rollout.tensor_model_parallel_size", cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)]
    if need_ref(cfg):
        sizes.append(("actor_rollout_ref.ref.megatron.tensor_model_parallel_size",
                      cfg.actor_rollout_ref.ref.megatron.tensor_model_parallel_size))
    if need_critic(cfg):
        sizes.append(("critic.megatron.tensor_model_parallel_size", cfg.critic.megatron.tensor_model_parallel_size))
    if cfg.reward_model.enable:
        sizes.append(("reward_model.megatron.tensor_model_parallel_size", cfg.reward_model.megatron.tensor_model_parallel_size))
    bad = [f"{k}={v}" for k, v in sizes if v and t.n_gpus_per_node % v]
    if bad:
        raise ConfigError(f"{', '.join(bad)} does not divide trainer.n_gpus_per_node={t.n_gpus_per_node}: with "
                          f"trainer.nnodes={t.nnodes} a tensor-parallel group would span nodes (its all-reduces on the "
                          f"inter-node network). Use a TP size that divides the devices of one node.")


def check_overrides(cfg) -> None:
    """verl's ``*.model.override_config`` against each role's checkpoint: the merged config must still be one
    the readers take (e.g. a supported rope type), and attention dropout needs a strategy that has it (the
    megatron bridge's core attention, torch SDPA over packed rows, has none)."""
    arr = cfg.actor_rollout_ref
    roles = [("actor_rollout_ref", arr.model.path, arr.model.override_config,
              [arr.actor.strategy] + ([arr.ref.strategy] if need_ref(cfg) else []))]
    if need_critic(cfg):
        roles.append(("critic", cfg.critic.model.path or arr.model.path, cfg.critic.model.override_config,
                      [cfg.critic.strategy]))
    if cfg.reward_model.enable:
        roles.append(("reward_model", cfg.reward_model.model.path, cfg.reward_model.model.override_config,
                      [cfg.reward_model.strategy]))
    for name, path, ov, strategies in roles:
        if not ov:
            continue
        key = f"{name}.model.override_config"
        try:
            hf = read_hf_config(path, OmegaConf.to_container(ov))
        except UnsupportedConfig as e:
            raise ConfigError(f"{key} over {path}: {e}") from None
        if hf.attention_dropout > 0 and "megatron" in strategies:
            raise ConfigError(f"{key}: attention_dropout={hf.attention_dropout} with strategy=megatron: the megatron "
                              f"bridge's attention (torch SDPA over packed rows) has no dropout; use strategy=deepspeed "
                              f"(transformers' attention applies it) or attention_dropout=0.")


def check_model(cfg) -> None:
    """Refuse settings the model cannot take, before any worker starts."""
    check_overrides(cfg)
    arr = cfg.actor_rollout_ref
    replay = [f"actor_rollout_ref.{r}.router_replay.mode=R3" for r in ("actor", "ref") if arr[r].router_replay.mode == "R3"]
    if replay and not read_hf_config(arr.model.path).is_moe:
        raise ConfigError(f"{' and '.join(replay)} replays mixture-of-experts routing, but {arr.model.path} is a dense "
                          f"model: remove the router_replay and enable_rollout_routing_replay lines.")
    if cfg.reward_model.enable:  # before any worker starts: the RM reads the actor's token ids with its trained head
        path = cfg.reward_model.model.path
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"reward_model.model.path='{path}' is not a Hugging Face model directory (no config.json).")
        rm_hf, actor_hf = read_hf_config(path), read_hf_config(arr.model.path)
        if cfg.reward_model.model.input_tokenizer is None and rm_hf.vocab_size != actor_hf.vocab_size:
            raise ConfigError(f"reward_model.model.path={path} has a vocabulary of {rm_hf.vocab_size} tokens, the actor "
                              f"{actor_hf.vocab_size}: with reward_model.model.input_tokenizer=null the reward model "
                              f"reads the actor's token ids, so it needs the actor's tokenizer. Set input_tokenizer to "
                              f"the actor's tokenizer path to re-tokenise each response with the reward model's own.")
        try:
            check_score_head(path, rm_hf.hidden_size)
            rm_inputs(cfg)  # the tokenizers load and the RM's has a chat template
        except (ValueError, OSError) as e:
            raise ConfigError(str(e)) from None


def rm_inputs(cfg):
    """The reward model's input builder: re-tokenising (``reward_model.model.input_tokenizer`` set, verl's
    default) or None (the RM reads the actor's ids)."""
    from transformers import AutoTokenizer  # heavy (about 2 s to import): only with a re-tokenising reward model

    rm = cfg.reward_model
    if rm.model.input_tokenizer is None:
        return None
    trust = bool(cfg.actor_rollout_ref.model.trust_remote_code)
    return RMInputs(AutoTokenizer.from_pretrained(rm.model.input_tokenizer, trust_remote_code=trust),
                    AutoTokenizer.from_pretrained(rm.model.path, trust_remote_code=trust), max_length=rm.max_length)


def check_data_sources(cfg, *datasets) -> None:
    """Refuse, at load, data whose ``data_source`` no built-in scorer knows when no custom reward function is
    set (verl's ``default_compute_score`` raises NotImplementedError for them, mid-run). A multi-turn
    environment scores its own episodes, so its rows are not checked."""
    if cfg.custom_reward_function.path or cfg.actor_rollout_ref.rollout.multi_turn.enable:
        return
    sources = {it["data_source"] for ds in datasets if ds is not None for it in getattr(ds, "items", [])}
    unknown = sorted(s for s in sources if not has_scorer(s))
    if unknown:
        raise ConfigError(f"data ({cfg.data.train_files}, {cfg.data.val_files}): {unknown_sources_message(unknown)}")


def check_code_sandbox(cfg, *datasets) -> None:
    """Refuse to start a run with code-scored data on a host whose sandbox cannot contain the code
    (unless the user opted in to weaker containment or scores code in a SandboxFusion service)."""
    rm = cfg.reward_model
    if rm.sandbox_fusion.url or cfg.custom_reward_function.path:
        return
    sources = {it["data_source"] for ds in datasets if ds is not None for it in getattr(ds, "items", [])}
    code = sorted(s for s in sources if has_scorer(s) and get_scorer(s) is code_score)
    if not code:
        return
    try:
        check_host(rm.sandbox.allow_weak_containment or None)
    except SandboxUnavailable as e:
        raise ConfigError(f"data sources {code} are scored by running code: {e}") from None
