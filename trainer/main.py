"""Coxswain's entry point and training loop: ``python -m trainer.main [--config FILE.yaml] key.sub=value ...``.

One step, in order (``train`` below is the whole loop; each phase is one call):
  1. rollout: ``n`` responses per prompt from the rollout fleet, keeping the sampler's log-probs;
  2. reward: the reward manager scores them; DAPO overlong shaping;
  3. dynamic sampling: drop constant groups, generate again until ``data.train_batch_size`` groups;
  4. old log-probs: the actor at its start-of-step weights (fixed for every mini-batch of the step);
     skipped when the update is one mini-batch x one epoch: its own forward gives them, exactly;
  5. reference log-probs (KL loss or KL-in-reward only);
  6. rollout IS weights and mismatch metrics, on the driver;
  7. advantages (values from the critic for GAE);
  8. critic update, then actor update: ppo_epochs x mini-batches x micro-batches;
  9. resharding sync of the actor's weights into the engines, checksum-verified;
 10. eval every ``trainer.test_freq`` steps, checkpoint every ``trainer.save_freq`` steps, log.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch
from omegaconf import OmegaConf

from trainer.config import ConfigError, all_keys, load_config, save_resolved, to_yaml


def sampling_params(cfg, step: int, gen_batch: int, val: bool = False, stop_token_ids=()) -> dict:
    r = cfg.actor_rollout_ref.rollout
    src = r.val_kwargs if val else r
    greedy = (not src.do_sample) or src.temperature == 0
    top_k = src.top_k if src.top_k and src.top_k > 0 else None
    # The seed is a function of (step, generation batch): a resumed run samples exactly the same.
    return dict(n=(src.n if not val else r.val_kwargs.n), temperature=0.0 if greedy else float(src.temperature),
                top_p=float(src.top_p), top_k=top_k, max_new_tokens=int(
                    (r.multi_turn.enable and r.multi_turn.max_tokens_per_turn) or r.response_length or cfg.data.max_response_length),
                stop_token_ids=list(stop_token_ids), seed=int(r.seed) * 1_000_003 + step * 1009 + gen_batch)


def multi_turn_settings(cfg) -> dict | None:
    """The agent loop's settings (``actor_rollout_ref.rollout.multi_turn``), or None when it is off. An
    episode (prompt + every turn) fits ``data.max_prompt_length + data.max_response_length`` tokens."""
    r = cfg.actor_rollout_ref.rollout
    if not r.multi_turn.enable:
        return None
    width = int(r.response_length or cfg.data.max_response_length)
    total = cfg.data.max_prompt_length + width
    budget = min(r.multi_turn.max_tokens_per_trajectory or total, total)
    return dict(environment=r.multi_turn.environment, max_assistant_turns=r.multi_turn.max_assistant_turns,
                max_user_turns=r.multi_turn.max_user_turns, max_tokens_per_trajectory=budget,
                concurrency=r.multi_turn.concurrency, max_response_length=width)


def env_tasks(cfg):
    """``rows(num, split)`` from the environment's task generator (seeded by ``data.seed``)."""
    from trainer.envs import task_maker

    make = task_maker(cfg.actor_rollout_ref.rollout.multi_turn.environment)
    return lambda num, split: make(num, seed=cfg.data.seed, split="train" if split == "train" else "test")


def stop_token_ids(tokenizer, model_path: str) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    except OSError:  # no generation_config.json
        pass
    return sorted(ids)


def resolve_model_paths(cfg) -> None:
    """A relative model path that does not exist from the working directory is looked up from the
    repository root, so ``python -m trainer.main`` finds the shipped tiny model from anywhere."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for key in ("actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path", "critic.model.path"):
        val = OmegaConf.select(cfg, key)
        if val and not os.path.isabs(val) and not os.path.exists(val) and os.path.exists(os.path.join(root, val)):
            OmegaConf.update(cfg, key, os.path.join(root, val))
    path = cfg.actor_rollout_ref.model.path
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"actor_rollout_ref.model.path='{path}' is not a Hugging Face model directory (no "
                                f"config.json). Point it at a local HF checkpoint; nothing is downloaded.")


class NotSupportedYet(ConfigError):
    pass


def check_supported(cfg) -> None:
    """Refuse, with the reason, the accepted config options this build does not run yet: a silent
    no-op would train something other than what the user asked for."""
    r = cfg.actor_rollout_ref.rollout
    gaps = []
    if r.name == "sglang" and not torch.cuda.is_available():
        gaps.append("actor_rollout_ref.rollout.name=sglang needs CUDA GPUs (and pip install 'coxswain[sglang]'); "
                    "on CPU use the native engine (rollout.name=native)")
    if r.name == "sglang" and r.mode == "server":
        gaps.append("rollout.name=sglang with rollout.mode=server: start SGLang servers yourself and point a "
                    "FleetClient at their router; the built-in fleet launches native servers")
    if r.mode == "async":
        gaps.append("actor_rollout_ref.rollout.mode=async: rollout overlapping training is not implemented "
                    "(sync and server are)")
    if r.mode == "server" and cfg.trainer.debug.in_process:
        gaps.append("actor_rollout_ref.rollout.mode=server with trainer.debug.in_process=true: the fleet's "
                    "servers are separate processes by design")
    if cfg.actor_rollout_ref.actor.strategy != "megatron" or cfg.critic.strategy != "megatron":
        gaps.append("strategy=deepspeed: only the megatron strategy is implemented")
    if cfg.reward_model.enable:
        gaps.append("reward_model.enable=true (a learned reward model): only rule-based scorers are implemented")
    if gaps:
        raise NotSupportedYet("this build cannot run the requested configuration:\n  - " + "\n  - ".join(gaps))


def train(cfg) -> dict:
    from transformers import AutoTokenizer

    from trainer.algos.advantages import compute_advantage
    from trainer.algos.kl import apply_kl_in_reward, make_kl_controller
    from trainer.algos.rollout_is import compute_rejection_mask
    from trainer.checkpoint import CheckpointManager, capture_rng, load_driver_state, restore_rng
    from trainer.credit import adca_active, adca_advantages, make_judge
    from trainer.data.dataset import PromptSampler, build_dataset
    from trainer.debug import dump_batch, replay_batch
    from trainer.phases import (apply_rollout_is, collect_batch, dp_dispatch, is_on_policy, should_eval, timer,
                                to_float_metrics, update_group, validate)
    from trainer.report import write_report
    from trainer.rewards.manager import RewardManager
    from trainer.tracking import Tracker
    from trainer.workers.cluster import Cluster

    t_start = time.time()
    resolve_model_paths(cfg)
    check_supported(cfg)
    a, r, al, dbg = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.algorithm, cfg.trainer.debug
    run_dir = cfg.trainer.default_local_dir
    save_resolved(cfg, run_dir)
    torch.manual_seed(cfg.trainer.seed)

    tok = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.tokenizer_path or cfg.actor_rollout_ref.model.path)
    mt = multi_turn_settings(cfg)  # None: single-turn
    tasks = env_tasks(cfg) if mt is not None else None  # no data files: the environment's own tasks
    train_ds, val_ds = build_dataset(cfg.data, tok, "train", tasks), build_dataset(cfg.data, tok, "val", tasks)
    # The sampler stops at the tokenizer's EOS (and the model's generation_config EOS ids); the stop
    # token is part of the response, so the trainer learns to end.
    stop_ids = stop_token_ids(tok, cfg.actor_rollout_ref.model.path)
    sampler = PromptSampler(len(train_ds), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    steps_per_epoch = len(train_ds) // cfg.data.train_batch_size
    total_steps = cfg.trainer.total_training_steps or steps_per_epoch * cfg.trainer.total_epochs
    reward_mgr = RewardManager(num_workers=cfg.reward_model.num_workers, timeout=cfg.reward_model.timeout,
                               custom_path=cfg.custom_reward_function.path, custom_name=cfg.custom_reward_function.name)
    kl_ctrl = make_kl_controller(al.kl_ctrl.type, kl_coef=al.kl_ctrl.kl_coef, target_kl=al.kl_ctrl.target_kl,
                                 horizon=al.kl_ctrl.horizon)
    cluster = Cluster(cfg, total_steps)  # Ray (or in-process) worker groups, placement, resharder
    judge_server = None
    try:
        # ADCA-GRPO: the LLM judge of step-level credit (a local trainer.serve subprocess or an API)
        judge, judge_server = make_judge(cfg, run_dir) if adca_active(cfg) else (None, None)
        ckpt = CheckpointManager(os.path.join(run_dir, "checkpoints"), cfg.trainer.max_actor_ckpt_to_keep)

        start_step, next_group_id, last_eval, run_id, history = 0, 0, None, None, []
        resume_from = None
        if cfg.trainer.resume_mode == "auto":
            ckpt.clean_stale()
            resume_from = ckpt.find_latest()
        elif cfg.trainer.resume_mode == "resume_path":
            resume_from = cfg.trainer.resume_from_path
        if resume_from:
            st = load_driver_state(resume_from)
            cluster.load(resume_from)
            sampler.load_state_dict(st["sampler"])
            kl_ctrl.load_state_dict(st["kl_ctrl"])
            restore_rng(st["rng"])
            cluster.set_rng_states(st.get("worker_rng", {}))
            start_step, next_group_id, last_eval, run_id, history = (st["step"], st["next_group_id"], st["last_eval"],
                                                                     st.get("mlflow_run_id"), st.get("history", []))
            print(f"resumed from {resume_from} at step {start_step}", flush=True)
        tracker = Tracker(cfg.trainer.project_name, cfg.trainer.experiment_name, cfg.trainer.logger,
                          config=OmegaConf.to_container(cfg, resolve=True), total_steps=total_steps, run_id=run_id)
        sync_m = cluster.sync_weights()

        def log(metrics: dict, step: int):
            history.append({"step": step, **metrics})
            tracker.log_metrics(metrics, step)

        val_params = sampling_params(cfg, 0, 0, val=True, stop_token_ids=stop_ids)
        vkw = dict(max_prompt_length=cfg.data.max_prompt_length, batch_size=cfg.data.val_batch_size, multi_turn=mt)
        if start_step == 0 and cfg.trainer.val_before_train and cfg.trainer.test_freq != 0:
            log(validate(cluster.rollout, reward_mgr, tok, val_ds, val_params, **vkw), 0)
            last_eval = 0

        for step in range(start_step + 1, total_steps + 1):
            m: dict[str, float] = dict(sync_m) if step == start_step + 1 else {}
            t_step = time.perf_counter()
            # 1-3. rollout, reward, overlong shaping, dynamic sampling
            with timer(m, "gen"):
                if dbg.train_only:  # replay a dumped batch instead of generating
                    batch, gm = replay_batch(dbg.dump_batch_path, step), {}
                else:
                    cluster.wake_rollout()
                    batch, gm, next_group_id = collect_batch(
                        cluster.rollout, reward_mgr, tok, train_ds, sampler, lambda g: sampling_params(cfg, step, g, stop_token_ids=stop_ids),
                        train_batch_size=cfg.data.train_batch_size, gen_batch_size=cfg.data.gen_batch_size or cfg.data.train_batch_size,
                        n=r.n, filter_cfg=OmegaConf.to_container(al.filter_groups), max_prompt_length=cfg.data.max_prompt_length,
                        overlong=OmegaConf.to_container(cfg.reward_model.overlong_buffer), next_group_id=next_group_id,
                        multi_turn=mt)
                    cluster.sleep_rollout()
            m.update(gm)
            if dbg.dump_batch_path and not dbg.train_only:
                dump_batch(batch, dbg.dump_batch_path, step)
            if dbg.rollout_only:  # generate and score only: no training, no sync
                log({**m, "reward/mean": float(batch.scores.mean()), "reward/acc": float(batch.acc.mean()),
                     "response_length/mean": float(batch.response_length.float().mean())}, step)
                continue
            # 4. old log-probs: computed once, so several mini-batch updates all use the start-of-step policy.
            # On-policy (one mini-batch, one epoch, nothing before the update reads them) the update's own
            # forward is at the start-of-step weights: the workers take its log-probs, detached, instead.
            on_policy = (is_on_policy(num_samples=batch.batch_size[0], mini_batch_size=a.ppo_mini_batch_size * r.n,
                                      epochs=a.ppo_epochs) and step > cfg.trainer.critic_warmup
                         and al.rollout_rs is None and not al.use_kl_in_reward)
            if not on_policy:
                with timer(m, "old_log_prob"):
                    out = dp_dispatch(cluster.actor, cluster.actor_layout, batch, "compute_log_prob", temperature=r.temperature,
                                      micro_batch_size=r.log_prob_micro_batch_size_per_gpu, with_entropy=True)
                    batch.old_log_probs, ent = out["log_probs"], out["entropy"]
            # 5. reference log-probs
            if cluster.ref is not None:
                with timer(m, "ref"):
                    batch.ref_log_probs = dp_dispatch(cluster.ref, cluster.ref_layout, batch, "compute_log_prob",
                                                      temperature=r.temperature,
                                                      micro_batch_size=cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu)["log_probs"]
            with timer(m, "adv"):
                # 6. rollout IS (and rejection sampling) against the sampler's own log-probs
                if al.rollout_rs is not None:
                    batch.response_mask, rs_m = compute_rejection_mask(
                        batch.old_log_probs, batch.rollout_log_probs, batch.response_mask, divergence=al.rollout_rs_divergence,
                        agg=al.rollout_rs, lower=al.rollout_rs_threshold_lower, upper=al.rollout_rs_threshold)
                    m.update(to_float_metrics(rs_m))
                is_kw = None if al.rollout_is_threshold is None else dict(
                    rollout_is_level=al.rollout_is_level, rollout_is_mode=al.rollout_is_mode,
                    rollout_is_threshold=al.rollout_is_threshold, rollout_is_threshold_lower=al.rollout_is_threshold_lower,
                    rollout_is_veto_threshold=al.rollout_is_veto_threshold, rollout_is=al.rollout_is)
                if is_kw is not None and not on_policy:  # on-policy: the workers weight with the same function
                    m.update(apply_rollout_is(batch, is_kw))
                # KL in reward
                if al.use_kl_in_reward:
                    batch.token_level_rewards, kl_m = apply_kl_in_reward(
                        batch.token_level_scores, batch.old_log_probs, batch.ref_log_probs, batch.response_mask,
                        kl_coef=kl_ctrl.value, kl_penalty=al.kl_penalty)
                    kl_m = to_float_metrics(kl_m)
                    kl_ctrl.update(kl_m["actor/reward_kl_penalty"], n_steps=batch.batch_size[0])
                    m.update(kl_m)
                else:
                    batch.token_level_rewards = batch.token_level_scores
                # 7. advantages
                if cluster.critic is not None:
                    batch.values = dp_dispatch(cluster.critic, cluster.critic_layout, batch, "compute_values",
                                               micro_batch_size=cfg.critic.ppo_micro_batch_size_per_gpu)["values"]
                if judge is not None:  # ADCA-GRPO: the judge's step flags fused with the outcome
                    batch.advantages, batch.returns, adv_m = adca_advantages(
                        batch, tok, judge, cfg.attribution_driven_credit_assignment, global_step=step)
                else:
                    batch.advantages, batch.returns, adv_m = compute_advantage(
                        al.adv_estimator, token_level_rewards=batch.token_level_rewards, response_mask=batch.response_mask,
                        index=batch.group_ids, values=batch.values, gamma=al.gamma, lam=al.lam,
                        norm_adv_by_std_in_grpo=al.norm_adv_by_std_in_grpo)
                m.update(to_float_metrics(adv_m, "adv/" if judge is None else ""))  # ADCA's are adca/*
            # 8. critic, then actor
            if cluster.critic is not None:
                with timer(m, "update_critic"):
                    m.update(update_group(cluster.critic, cluster.critic_layout, batch, "update_critic",
                                          mini_batch_size=(cfg.critic.ppo_mini_batch_size or a.ppo_mini_batch_size) * r.n,
                                          epochs=cfg.critic.ppo_epochs or a.ppo_epochs, shuffle=a.shuffle, seed=step,
                                          loss_agg_mode=cfg.critic.loss_agg_mode,
                                          loss={"cliprange_value": cfg.critic.cliprange_value, "loss_agg_mode": cfg.critic.loss_agg_mode},
                                          micro_batch_size=cfg.critic.ppo_micro_batch_size_per_gpu))
            if step > cfg.trainer.critic_warmup:
                with timer(m, "update_actor"):
                    res = update_group(cluster.actor, cluster.actor_layout, batch, "update_actor",
                                       mini_batch_size=a.ppo_mini_batch_size * r.n, epochs=a.ppo_epochs, shuffle=a.shuffle,
                                       seed=step, loss_agg_mode=a.loss_agg_mode, on_policy=on_policy,
                                       loss=dict(cluster.actor_loss_settings(), rollout_is=is_kw),
                                       temperature=r.temperature, micro_batch_size=a.ppo_micro_batch_size_per_gpu)
                    if on_policy:  # the old log-probs / entropy the update saw, and the IS metrics of its weights
                        res, out = res
                        batch.old_log_probs, ent = out["log_probs"], out["entropy"]
                        m.update(apply_rollout_is(batch, is_kw) if is_kw is not None else {})
                    m.update(res)
                bad = [k for k in ("actor/loss", "actor/grad_norm") if k in m and not math.isfinite(m[k])]
                if bad or m.get("actor/skipped", 0.0) > 0:
                    raise FloatingPointError(
                        f"step {step}: the actor's {', '.join(bad) or 'gradient'} is NaN/inf, so the update was not "
                        f"applied. Check the rewards and advantages (adv/*, reward/* above), lower "
                        f"actor_rollout_ref.actor.optim.lr, or keep grad clipping on; the last checkpoint is intact and "
                        f"trainer.resume_mode=auto continues from it.")
                # 9. resharding sync, verified by checksum
                with timer(m, "sync"):
                    m.update(cluster.sync_weights())
            # 10. eval, checkpoint, log
            if should_eval(step, cfg.trainer.test_freq, total_steps, last_eval):
                with timer(m, "eval"):
                    cluster.wake_rollout()
                    m.update(validate(cluster.rollout, reward_mgr, tok, val_ds, val_params, **vkw))
                    last_eval = step
            mask = batch.response_mask.bool()
            n_tokens = int(batch.attention_mask.sum())
            m.update({"reward/mean": float(batch.scores.mean()), "reward/acc": float(batch.acc.mean()),
                      "response_length/mean": float(batch.response_length.float().mean()),
                      "response_length/clip_fraction": float((batch.response_length >= batch.responses.shape[1]).float().mean()),
                      "actor/entropy_rollout": float((ent * mask).sum() / mask.sum().clamp_min(1)),
                      "perf/tokens": float(n_tokens), "kl_ctrl/coef": float(kl_ctrl.value)})
            m["timing_s/step"] = time.perf_counter() - t_step
            m["perf/tokens_per_s"] = n_tokens / m["timing_s/step"]
            if cfg.trainer.save_freq > 0 and (step % cfg.trainer.save_freq == 0 or step == total_steps):
                with timer(m, "save"):
                    log(m, step)
                    driver_state = {"sampler": sampler.state_dict(), "kl_ctrl": kl_ctrl.state_dict(), "rng": capture_rng(),
                                    "worker_rng": cluster.rng_states(),
                                    "next_group_id": next_group_id, "last_eval": last_eval, "mlflow_run_id": tracker.run_id,
                                    "history": history}
                    ckpt.save(step, driver_state, write_workers=cluster.save)
            else:
                log(m, step)

        final = {k: v for k, v in (history[-1] if history else {}).items()}
        export_dir = os.path.join(run_dir, "hf_export")
        cluster.export_hf(export_dir)
        report = write_report(history, run_dir)
        for p in [os.path.join(run_dir, "config.yaml"), report, export_dir]:
            tracker.log_artifact(p)
        tracker.finish()
        print(f"done: {total_steps} steps in {time.time() - t_start:.0f}s; run dir {run_dir}", flush=True)
        return {"history": history, "final": final, "run_dir": run_dir}
    finally:  # a failed run must not leave workers, placement groups or scorer processes behind
        cluster.shutdown()
        reward_mgr.close()
        if judge_server is not None:
            judge_server.close()


def cli(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help-keys" in argv:
        print("\n".join(all_keys()))
        return 0
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        print("All keys: python -m trainer.main --help-keys; resolve and print only: --print-config")
        return 0
    dry = "--print-config" in argv  # resolve, print and write the config, then stop
    argv = [x for x in argv if x != "--print-config"]
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg))
    path = save_resolved(cfg, cfg.trainer.default_local_dir)
    print(f"resolved config written to {path}", flush=True)
    if not dry:
        try:
            train(cfg)
        except (ConfigError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
