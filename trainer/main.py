"""Coxswain's entry point and training loop: ``python -m trainer.main [--config FILE.yaml] key.sub=value ...``.

``train`` below is setup, the loop and teardown. The config is resolved once into a frozen ``Plan``
(:mod:`trainer.plan`); the loop reads ``plan.*`` and ``state.*`` (a ``LoopState``, the one thing
checkpoints save and resume restores) and calls typed role groups (``actor``, ``ref``, ``critic``:
:mod:`trainer.workers.roles`) and one ``Rollout`` (:mod:`trainer.workers.rollouts`). The step's batch
goes to the data-parallel ranks once, by object reference (``StepData``, :mod:`trainer.step_data`;
the transport: :mod:`trainer.workers.dataplane`); the driver receives only what it computes on.

One step, in order (each phase is one call of :class:`trainer.step.Step`; the order is
:func:`trainer.step.default_pipeline`, which ``trainer.pipeline`` replaces and ``trainer.hooks``
extends at named points):
  1. rollout: ``n`` responses per prompt from the rollout, keeping the sampler's log-probs;
  2. reward: the reward manager scores them; DAPO overlong shaping;
  3. dynamic sampling: drop constant groups, generate again until ``data.train_batch_size`` groups;
  4. old log-probs: the actor at its start-of-step weights (fixed for every mini-batch of the step);
     skipped when the update is one mini-batch x one epoch: its own forward gives them, exactly;
  5. reference log-probs (KL loss or KL-in-reward only) and critic values (GAE), at the same time as 4;
  6. rollout IS weights / rejection and mismatch metrics, on the driver (on the on-policy path the
     update's ranks apply the weights and the driver computes the metrics);
  7. KL in reward, advantages;
  8. critic update, then actor update: ppo_epochs x mini-batches x micro-batches;
  9. weight sync of the actor into the rollout engines, checksum-verified;
 10. eval every ``trainer.test_freq`` steps, checkpoint every ``trainer.save_freq`` steps, log.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from omegaconf import OmegaConf

from trainer.batch_source import BatchSource
from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError, all_keys, load_config, public_container, save_resolved, to_yaml
from trainer.generation import Generation, PipelineError, timer
from trainer.step import Hooks, Runtime, Step, batch_metrics, load_pipeline, row_multiple, timing_metrics
from trainer.report import write_report
from trainer.step_data import StepData


def env_tasks(cfg):
    """``rows(num, split)`` from the environment's task generator (seeded by ``data.seed``)."""
    from trainer.envs import task_maker

    make = task_maker(cfg.actor_rollout_ref.rollout.multi_turn.environment)
    return lambda num, split: make(num, seed=data_seed(cfg), split="train" if split == "train" else "test")


def data_seed(cfg) -> int:
    """verl's ``data.seed``: null means 1."""
    return 1 if cfg.data.seed is None else int(cfg.data.seed)


def resolve_model_paths(cfg) -> None:
    """A relative model path that does not exist from the working directory is looked up from the
    repository root, so ``python -m trainer.main`` finds the shipped tiny model from anywhere."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for key in ("actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path", "critic.model.path",
                "reward_model.model.path"):
        val = OmegaConf.select(cfg, key)
        if val and val.startswith("~"):
            OmegaConf.update(cfg, key, val := os.path.expanduser(val))
        if val and not os.path.isabs(val) and not os.path.exists(val) and os.path.exists(os.path.join(root, val)):
            OmegaConf.update(cfg, key, os.path.join(root, val))
    path = cfg.actor_rollout_ref.model.path
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"actor_rollout_ref.model.path='{path}' is not a Hugging Face model directory (no "
                                f"config.json). Point it at a local HF checkpoint; nothing is downloaded.")


def check_code_sandbox(cfg, *datasets) -> None:
    """Refuse to start a run with code-scored data on a host whose sandbox cannot contain the code
    (unless the user opted in to weaker containment or scores code in a SandboxFusion service)."""
    from trainer.rewards.scorers import code_score, get_scorer

    rm = cfg.reward_model
    if rm.sandbox_fusion.url or cfg.custom_reward_function.path:
        return
    sources = {it["data_source"] for ds in datasets if ds is not None for it in getattr(ds, "items", [])}
    code = sorted(s for s in sources if get_scorer(s) is code_score)
    if not code:
        return
    from trainer.rewards.sandbox import SandboxUnavailable, check_host

    try:
        check_host(rm.sandbox.allow_weak_containment or None)
    except SandboxUnavailable as e:
        raise ConfigError(f"data sources {code} are scored by running code: {e}") from None


class NotSupportedYet(ConfigError):
    pass


def check_supported(cfg) -> None:
    """Refuse, with the reason, what this machine cannot run: the hardware checks that ``--print-config``
    leaves out (a GPU recipe resolves on a CPU login node). Everything else is refused at load time."""
    r = cfg.actor_rollout_ref.rollout
    gaps = []
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        gaps.append("trainer.device=cuda but this machine has no CUDA GPU: run on GPU nodes, or set trainer.device=cpu "
                    "(with actor_rollout_ref.rollout.name=native)")
    if r.name == "sglang" and r.mode in ("server", "async"):
        from trainer.rollout.sglang_cpu import INSTALL_COMMAND, server_python

        # a fleet of SGLang servers: the servers need sglang, this trainer only speaks HTTP to them
        if server_python() is None:
            gaps.append("actor_rollout_ref.rollout.name=sglang with rollout.mode=server launches sglang.launch_server, "
                        "but no interpreter here has sglang: pip install 'coxswain[sglang]' (GPU), or "
                        f"{INSTALL_COMMAND} (CPU; COXSWAIN_SGLANG_PYTHON names another interpreter)")
    elif r.name == "sglang" and not torch.cuda.is_available():
        from trainer.rollout.sglang_cpu import missing_reason  # SGLang's CPU path (tested in CI) where installed

        why = missing_reason()
        if why:
            gaps.append("actor_rollout_ref.rollout.name=sglang needs CUDA GPUs with pip install 'coxswain[sglang]', or on "
                        f"CPU the SGLang CPU install, absent here ({why}); or use the native engine (rollout.name=native)")
    if gaps:
        raise NotSupportedYet("this machine cannot run the requested configuration:\n  - " + "\n  - ".join(gaps))


def check_model(cfg) -> None:
    """Refuse settings the model cannot take, before any worker starts."""
    from megatron_bridge.hf_config import read_hf_config

    arr = cfg.actor_rollout_ref
    replay = [f"actor_rollout_ref.{r}.router_replay.mode=R3" for r in ("actor", "ref") if arr[r].router_replay.mode == "R3"]
    if replay and not read_hf_config(arr.model.path).is_moe:
        raise ConfigError(f"{' and '.join(replay)} replays mixture-of-experts routing, but {arr.model.path} is a dense "
                          f"model: remove the router_replay and enable_rollout_routing_replay lines.")
    if cfg.reward_model.enable:  # before any worker starts: the RM reads the actor's token ids with its trained head
        from trainer.rewards.reward_model import check_score_head

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
    from transformers import AutoTokenizer

    from trainer.rewards.reward_model import RMInputs

    rm = cfg.reward_model
    if rm.model.input_tokenizer is None:
        return None
    trust = bool(cfg.actor_rollout_ref.model.trust_remote_code)
    return RMInputs(AutoTokenizer.from_pretrained(rm.model.input_tokenizer, trust_remote_code=trust),
                    AutoTokenizer.from_pretrained(rm.model.path, trust_remote_code=trust), max_length=rm.max_length)


def resume(cluster, state, ckpt_dir: str, load_contents) -> None:
    """Verify ``ckpt_dir`` against its manifest, then restore the workers (what ``load_contents`` names)
    and the driver state. Any failure is a ``CheckpointError`` naming the checkpoint."""
    from trainer.checkpoint import load_driver_state, load_workers, verify

    verify(ckpt_dir)  # before anything in it is unpickled
    driver = load_driver_state(ckpt_dir)
    try:
        load_workers(cluster, ckpt_dir, load_contents)
    except Exception as e:  # a shard the workers cannot read
        raise CheckpointError(f"the workers could not load {ckpt_dir} ({type(e).__name__}: {str(e)[-300:]})") from e
    worker_rng = state.load_state_dict(driver)
    if "extra" in load_contents:  # verl's 'extra': LR scheduler and RNG states
        cluster.set_rng_states(worker_rng)


def train(cfg) -> dict:
    from transformers import AutoTokenizer

    from trainer.algos.kl import make_kl_controller
    from trainer.checkpoint import CheckpointManager, save_workers
    from trainer.credit import adca_active, make_judge
    from trainer.data.dataset import PromptSampler, build_dataset
    from trainer.hf_io import stop_token_ids
    from trainer.plan import LoopState, Plan
    from trainer.rewards.manager import RewardManager
    from trainer.tracking import Tracker
    from trainer.workers.cluster import Cluster

    t_start = time.time()
    resolve_model_paths(cfg)
    check_supported(cfg)
    check_model(cfg)
    run_dir, model_path = cfg.trainer.default_local_dir, cfg.actor_rollout_ref.model.path
    save_resolved(cfg, run_dir)
    torch.manual_seed(cfg.trainer.seed)

    tok = AutoTokenizer.from_pretrained(cfg.data.tokenizer or cfg.actor_rollout_ref.model.tokenizer_path or model_path,
                                        trust_remote_code=bool(cfg.actor_rollout_ref.model.trust_remote_code or cfg.data.trust_remote_code))
    tasks = env_tasks(cfg) if cfg.actor_rollout_ref.rollout.multi_turn.enable else None  # the environment's own tasks
    train_ds, val_ds = build_dataset(cfg.data, tok, "train", tasks), build_dataset(cfg.data, tok, "val", tasks)
    total_steps = cfg.trainer.total_training_steps or len(train_ds) // cfg.data.train_batch_size * cfg.trainer.total_epochs
    if total_steps < 1:
        raise ConfigError(f"the training data has {len(train_ds)} prompts, fewer than data.train_batch_size="
                          f"{cfg.data.train_batch_size}: not one step to train; use more data or a smaller batch.")
    # the sampler stops at the tokenizer's and the model's EOS ids (the servers use the same rule); the
    # stop token is part of the response, so the trainer learns to end
    plan = Plan.from_config(cfg, total_steps=total_steps, stop_token_ids=stop_token_ids(model_path, tok))
    al = cfg.algorithm
    state = LoopState(sampler=PromptSampler(len(train_ds), seed=data_seed(cfg), shuffle=cfg.data.shuffle),
                      kl_ctrl=make_kl_controller(al.kl_ctrl.type, kl_coef=al.kl_ctrl.kl_coef, target_kl=al.kl_ctrl.target_kl,
                                                 horizon=al.kl_ctrl.horizon))
    reward_mgr = RewardManager.from_config(cfg, tok)
    check_code_sandbox(cfg, train_ds, val_ds)
    cluster = Cluster(cfg, plan.total_steps)  # Ray (or in-process) role groups, placement, rollout
    judge_server = batches = None
    where = "start-up (workers, resume)"
    try:
        # ADCA-GRPO: the LLM judge of step-level credit (a local trainer.serve subprocess or an API)
        judge, judge_server = make_judge(cfg, run_dir) if adca_active(cfg) else (None, None)
        # verl's layout: default_local_dir/global_step_N/{actor,critic} + latest_checkpointed_iteration.txt
        ckpt = CheckpointManager(run_dir, cfg.trainer.max_actor_ckpt_to_keep)
        contents = cfg.actor_rollout_ref.actor.checkpoint
        resume_from = None
        if cfg.trainer.resume_mode == "auto":  # the newest checkpoint that verifies and loads
            ckpt.clean_stale()
            for cand in ckpt.candidates():
                try:
                    resume(cluster, state, cand, contents.load_contents)
                    resume_from = cand
                    break
                except CheckpointError as e:
                    print(f"warning: not resuming from {cand}: {e}; trying the previous checkpoint", flush=True)
            else:
                if ckpt.candidates():
                    raise CheckpointError(f"no checkpoint under {run_dir} verifies (see the warnings above): move "
                                          f"them away to start fresh, or set trainer.resume_from_path")
        elif cfg.trainer.resume_mode == "resume_path":
            resume_from = cfg.trainer.resume_from_path
            try:
                resume(cluster, state, resume_from, contents.load_contents)
            except CheckpointError as e:
                raise CheckpointError(f"{e}. Point trainer.resume_from_path at an earlier global_step_* directory, "
                                      f"or use trainer.resume_mode=auto to take the newest one that verifies") from e
        if resume_from:
            print(f"resumed from {resume_from} at step {state.step}", flush=True)
        tracker = Tracker(cfg.trainer.project_name, cfg.trainer.experiment_name, cfg.trainer.logger,
                          config=public_container(cfg), total_steps=plan.total_steps, run_id=state.run_id,
                          log_dir=run_dir)
        state.run_id = tracker.run_id
        actor, rollout = cluster.actor, cluster.rollout
        rm_group = cluster.reward_model  # a learned reward model scores each generated batch (its own shards)
        to_rm = rm_inputs(cfg) if rm_group else None  # re-tokenised for the RM's tokenizer, or the actor's ids
        score_rm = (lambda b: rm_group.scores(StepData(to_rm(b) if to_rm else b, cluster.transport), plan.rm_scores)
                    ) if rm_group else None
        hooks = Hooks(OmegaConf.to_container(cfg.trainer.hooks))  # user stages (trainer.pipeline)
        gen = Generation(plan, rollout, reward_mgr, tok, train_ds, val_ds, reward_model=score_rm, hooks=hooks,
                         row_multiple=row_multiple(cluster))
        if plan.fully_async is not None:  # a rollouter thread generating into a queue (trainer/async_rollout.py)
            from trainer.async_rollout import AsyncBatchSource

            batches = AsyncBatchSource(gen, state, plan)
        else:
            batches = BatchSource(gen, state, one_step_off=plan.one_step_off, total_steps=plan.total_steps)
        if resume_from and batches.load(resume_from):  # one-step-off: the batch generated during the saved step
            print(f"resumed with the prefetched batch of step {state.step + 1}", flush=True)
        first = rollout.sync_from(actor)
        transport = getattr(rollout, "transport", "")
        if transport.startswith("object_store ("):  # shared memory was wanted and could not run: say why
            print(f"weight sync: {transport}", flush=True)

        def evaluate(step: int) -> dict:  # trainer.log_val_generations: N samples to the trackers
            samples = [] if cfg.trainer.log_val_generations > 0 else None
            out = gen.evaluate(samples=samples)
            if samples:
                tracker.log_val_generations(samples, step, cfg.trainer.log_val_generations)
            return out

        def log(metrics: dict, step: int):
            state.history.append({"step": step, **metrics})
            tracker.log_metrics(metrics, step)

        if state.step == 0 and plan.val_before_train and plan.test_freq != 0:
            m0 = evaluate(0)
            hooks.run("after_eval", None, m0)
            log(m0, 0)
            state.last_eval = 0

        rt = Runtime(plan=plan, cfg=cfg, cluster=cluster, state=state, batches=batches, hooks=hooks, evaluate=evaluate,
                     judge=judge, tokenizer=tok, parallel_phases=(cfg.trainer.device == "cpu" if cfg.trainer.parallel_phases is None
                                      else cfg.trainer.parallel_phases))
        pipeline = load_pipeline(cfg.trainer.pipeline)

        for step in range(state.step + 1, plan.total_steps + 1):
            where = f"step {step} of {plan.total_steps}"
            t_step = time.perf_counter()
            s = Step(rt, step, metrics=dict(first))
            first = {}
            pipeline(s)  # the step's phases (trainer.pipeline; default: trainer.step.default_pipeline)
            m, batch = s.metrics, s.batch
            if hasattr(rollout, "metrics"):  # the HTTP fleet's running counters: fleet/{retries,restarts,dropped,...}
                m.update(rollout.metrics())
            if batch is None:
                raise PipelineError(f"the pipeline {cfg.trainer.pipeline} did not call Step.generate(): a step needs a batch.")
            if not s.trained:  # generate and score only (debug.rollout_only, or a pipeline without updates)
                log({**m, **batch_metrics(batch, plan)}, step)
                continue
            m.update(batch_metrics(batch, plan, entropy=s.entropy, kl_coef=state.kl_ctrl.value, grad_norm=m.get("actor/grad_norm")))
            m.update(cluster.transport.take_metrics())
            m["timing_s/step"] = time.perf_counter() - t_step
            m.update(timing_metrics(m, batch, cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node))
            state.step = step
            if plan.should_save(step):
                with timer(m, "save_checkpoint"):
                    log(m, step)
                    batches.settle()  # the sampler state below includes the prefetched batch's prompts
                    ckpt.save(step, state.state_dict(worker_rng=cluster.rng_states()),
                              write_workers=lambda d: (save_workers(cluster, d, contents.save_contents, model_path),
                                                       batches.save(d)))
            else:
                log(m, step)

        where = "the final export"
        export_dir = os.path.join(run_dir, "hf_export")
        cluster.actor.export(export_dir, model_path)
        report = write_report(state.history, run_dir)
        for p, folder in [(os.path.join(run_dir, "config.yaml"), "config"), (report, "report"), (export_dir, "hf_export")]:
            tracker.log_artifact(p, folder)
        tracker.finish()
        print(f"done: {plan.total_steps} steps in {time.time() - t_start:.0f}s; run dir {run_dir}", flush=True)
        return {"history": state.history, "final": dict(state.history[-1] if state.history else {}), "run_dir": run_dir}
    except BaseException as e:
        e.coxswain_where = where  # the CLI's error paragraph names it
        raise
    finally:  # a failed run must not leave workers, placement groups or scorer processes behind
        if batches is not None:
            batches.close()
        cluster.shutdown()
        reward_mgr.close()
        if judge_server is not None:
            judge_server.close()


def cli(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help-keys" in argv:  # every key, its default and its description (the field's comment in trainer/config/schema.py)
        from trainer.console import help_keys_lines, print_lines

        return print_lines(help_keys_lines())
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
    except Exception as e:  # noqa: BLE001 - a config file that is not YAML, an unreadable path, ...
        print(f"config error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg))
    from trainer.config import LAST_LOAD_NOTES

    for note in LAST_LOAD_NOTES:  # verl implementation selectors: accepted, and said to do nothing here
        print(f"note: {note}", file=sys.stderr)
    run_dir = cfg.trainer.default_local_dir
    try:
        path = save_resolved(cfg, run_dir)
    except OSError as e:
        print(f"error: cannot write the run directory trainer.default_local_dir={run_dir!r}: {e}. "
              f"Point it at a writable directory.", file=sys.stderr)
        return 2
    print(f"resolved config written to {path}", flush=True)
    if not dry:
        try:
            train(cfg)
        except BaseException as e:  # noqa: BLE001 - every failure ends in one paragraph, the traceback in a file
            return report_failure(e, cfg)
    return 0


# Failures with a message written for the user: what happened and what to do. Anything else is
# reported as unexpected (a bug), still in one paragraph, with the traceback in the run directory.
def _anticipated() -> tuple:
    from trainer.data.dataset import BadRowError
    from trainer.generation import DynamicSamplingError
    from trainer.rewards.manager import RewardError
    from trainer.rewards.sandbox_fusion import SandboxServiceError
    from trainer.rollout.engine import WeightSyncError
    from trainer.rollout.fleet import FleetError
    from trainer.rollout.multi_turn import TemplateError
    from trainer.workers.group import WorkerDiedError

    return (ConfigError, FileNotFoundError, NotADirectoryError, PermissionError, CheckpointError, BadRowError,
            WorkerDiedError, FloatingPointError, RewardError, DynamicSamplingError, WeightSyncError, FleetError,
            TemplateError, SandboxServiceError, MemoryError)


def resume_hint(run_dir: str) -> str:
    """What a rerun would do, stated from what is on disk (never a promise the disk cannot keep)."""
    from trainer.checkpoint import CheckpointManager, verify

    try:
        cands = CheckpointManager(run_dir).candidates()
    except OSError:
        cands = []
    for c in cands:
        try:
            verify(c)
        except CheckpointError:
            continue
        return (f"The newest checkpoint that verifies is {c}: rerun the same command with "
                f"trainer.resume_mode=auto to continue from it.")
    return f"No verified checkpoint is saved under {run_dir}: a rerun starts from step 0 (trainer.save_freq sets how often one is saved)."


def report_failure(e: BaseException, cfg) -> int:
    """Print one paragraph for a failed run (what, where, what to do); the traceback goes to
    ``<run_dir>/error.log`` (``COXSWAIN_TRACEBACK=1`` also prints it). Returns the exit code."""
    import datetime
    import traceback

    run_dir = cfg.trainer.default_local_dir
    log_path = os.path.join(run_dir, "error.log")
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(log_path, "a") as f:
            f.write(f"=== {datetime.datetime.now().isoformat(timespec='seconds')} {type(e).__name__}\n")
            f.write("".join(traceback.format_exception(e)))
        saved = f"The full traceback is in {log_path}."
    except OSError as err:
        saved, log_path = f"(the traceback could not be written to {log_path}: {err})", None
    where = getattr(e, "coxswain_where", None)
    at = f" during {where}" if where else ""
    msg = str(e).strip() or "(no message)"
    if isinstance(e, KeyboardInterrupt):
        head, code = f"interrupted{at}.", 130
    elif isinstance(e, _anticipated()):
        from trainer.data.dataset import BadRowError

        # 2: the input is wrong (config, paths, data, checkpoint); 1: the run failed
        bad_input = (ConfigError, FileNotFoundError, NotADirectoryError, PermissionError, CheckpointError, BadRowError)
        head, code = f"error{at}: {msg}", 2 if isinstance(e, bad_input) else 1
    else:
        head, code = (f"unexpected error{at}: {type(e).__name__}: {msg}. This is probably a bug in Coxswain or a "
                      f"library it uses; please report it with the traceback file."), 1
    hint = resume_hint(run_dir) if where and where.startswith(("step", "the final")) else ""
    head = head if head.endswith((".", "!", "?")) else head + "."
    print(" ".join(x for x in (head, hint, saved) if x), file=sys.stderr, flush=True)
    if os.environ.get("COXSWAIN_TRACEBACK"):
        traceback.print_exception(e, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(cli())
