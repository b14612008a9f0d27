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

import datetime
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from omegaconf import OmegaConf

from trainer.algos.kl import make_kl_controller
from trainer.async_rollout import AsyncBatchSource
from trainer.batch_source import BatchSource
from trainer.checkpoint import (CheckpointError, CheckpointManager, load_driver_state, load_workers, save_workers,
                                verify)
from trainer.config import (LAST_LOAD_NOTES, ConfigError, flatten_keys, load_config, public_container, save_resolved,
                            schema_defaults, to_yaml)
from trainer.config.preflight import (check_code_sandbox, check_data_sources, check_model, check_paths, check_supported,
                                     missing_paths, rm_inputs)
from trainer.console import changed_from_defaults, config_summary_lines, help_keys_lines, print_lines
from trainer.credit import JudgeFallbackError, make_judge
from trainer.data.dataset import BadRowError, PromptSampler, build_dataset
from trainer.envs import task_maker
from trainer.generation import DynamicSamplingError, Generation, PipelineError, timer
from trainer.hf_io import stop_token_ids
from trainer.orphans import start_reaper
from trainer.perf import PeakTable, mfu_metrics, role_passes
from trainer.plan import LoopState, Plan
from trainer.report import write_report
from trainer.rewards.manager import RewardError, RewardManager
from trainer.rewards.sandbox_fusion import SandboxServiceError
from trainer.rollout.engine import WeightSyncError
from trainer.rollout.fleet import FleetError
from trainer.rollout.multi_turn import TemplateError
from trainer.step import Hooks, Runtime, Step, batch_metrics, load_pipeline, row_multiple, timing_metrics
from trainer.step_data import StepData
from trainer.tracking import Tracker
from trainer.workers.group import WorkerDiedError


def env_tasks(cfg):
    """``rows(num, split)`` from the environment's task generator (seeded by ``data.seed``)."""
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


def resume(cluster, state, ckpt_dir: str, load_contents, allow_unverified: bool = False) -> None:
    """Verify ``ckpt_dir`` against its manifest, then restore the workers (what ``load_contents`` names)
    and the driver state. Any failure is a ``CheckpointError`` naming the checkpoint."""
    verify(ckpt_dir, allow_unverified)  # before anything in it is unpickled
    driver = load_driver_state(ckpt_dir)
    try:
        load_workers(cluster, ckpt_dir, load_contents)
    except Exception as e:  # a shard the workers cannot read
        raise CheckpointError(f"the workers could not load {ckpt_dir} ({type(e).__name__}: {str(e)[-300:]})") from e
    worker_rng = state.load_state_dict(driver)
    if "extra" in load_contents:  # verl's 'extra': LR scheduler and RNG states
        cluster.set_rng_states(worker_rng)


@dataclass
class Run:
    """What one training run holds from set-up to teardown (the driver's side)."""

    cfg: Any  # the resolved config: read by the set-up and the teardown, never by the loop
    plan: Plan
    state: LoopState
    tok: Any
    train_ds: Any
    val_ds: Any
    reward_mgr: RewardManager
    cluster: Any  # trainer.workers.cluster.Cluster
    run_dir: str
    model_path: str
    save_contents: Any  # actor.checkpoint.save_contents
    t_start: float
    where: str = "start-up (workers, resume)"  # named in the CLI's error paragraph
    judge: Any = None
    judge_server: Any = None
    ckpt: Optional[CheckpointManager] = None
    tracker: Optional[Tracker] = None
    batches: Any = None  # BatchSource or AsyncBatchSource
    first_sync: dict = field(default_factory=dict)  # the first weight sync's metrics, logged with step 1
    mfu_passes: list = field(default_factory=list)  # trainer.perf.PassCost: what perf/mfu/* divides

    def log(self, metrics: dict, step: int) -> None:
        self.state.history.append({"step": step, **metrics})
        self.tracker.log_metrics(metrics, step)

    def close(self) -> None:
        """A failed run must not leave workers, placement groups or scorer processes behind."""
        if self.batches is not None:
            self.batches.close()
        self.cluster.shutdown()
        self.reward_mgr.close()
        if self.judge_server is not None:
            self.judge_server.close()


def train(cfg) -> dict:
    """Set-up, the loop, teardown: one training run."""
    run = set_up(cfg)
    try:
        rt, pipeline = start(run)
        for step in range(run.state.step + 1, run.plan.total_steps + 1):
            run.where = f"step {step} of {run.plan.total_steps}"
            t_step = time.perf_counter()
            s = run_step(rt, pipeline, step, run.first_sync)
            run.first_sync = {}
            finish_step(run, s, t_step)
        run.where = "the final export"
        return finish(run)
    except BaseException as e:
        e.coxswain_where = run.where  # the CLI's error paragraph names it
        raise
    finally:
        run.close()


# ----------------------------------------------------------------------------------------------
# set-up
# ----------------------------------------------------------------------------------------------
def set_up(cfg) -> Run:
    """Checks, data, the Plan, the loop's state, the reward manager and the worker groups."""
    from transformers import AutoTokenizer  # heavy (about 1.5 s): only a run needs it, not --help or the CLI's errors

    from trainer.workers.cluster import Cluster  # heavy: imports Ray (about 2 s)

    t_start = time.time()
    start_reaper()  # every process this run starts carries its marker, and none outlives the driver (trainer.orphans)
    check_paths(cfg)  # every path the run reads, all named at once, before any worker starts
    resolve_model_paths(cfg)
    check_supported(cfg)
    check_model(cfg)
    model_path = cfg.actor_rollout_ref.model.path
    save_resolved(cfg, cfg.trainer.default_local_dir)
    torch.manual_seed(cfg.trainer.seed)
    tok = AutoTokenizer.from_pretrained(cfg.data.tokenizer or cfg.actor_rollout_ref.model.tokenizer_path or model_path,
                                        trust_remote_code=bool(cfg.actor_rollout_ref.model.trust_remote_code or cfg.data.trust_remote_code))
    tasks = env_tasks(cfg) if cfg.actor_rollout_ref.rollout.multi_turn.enable else None  # the environment's own tasks
    train_ds, val_ds = build_dataset(cfg.data, tok, "train", tasks), build_dataset(cfg.data, tok, "val", tasks)
    check_data_sources(cfg, train_ds, val_ds)
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
    return Run(cfg=cfg, plan=plan, state=state, tok=tok, train_ds=train_ds, val_ds=val_ds, reward_mgr=reward_mgr,
               cluster=cluster, run_dir=cfg.trainer.default_local_dir, model_path=model_path,
               save_contents=cfg.actor_rollout_ref.actor.checkpoint.save_contents, t_start=t_start)


def start(run: Run) -> tuple[Runtime, Callable[[Step], None]]:
    """The judge, the resume, the tracker, the batch source, the first weight sync and the evaluation
    before training; returns the step's runtime and the pipeline it runs."""
    cfg, plan, state, cluster = run.cfg, run.plan, run.state, run.cluster
    if plan.adca is not None:  # ADCA-GRPO: the LLM judge of step-level credit (a local trainer.serve subprocess or an API)
        run.judge, run.judge_server = make_judge(cfg, run.run_dir)
    resume_from = resume_newest(run)
    run.tracker = Tracker(cfg.trainer.project_name, cfg.trainer.experiment_name, cfg.trainer.logger,
                          config=public_container(cfg), total_steps=plan.total_steps, run_id=state.run_id,
                          log_dir=run.run_dir)
    state.run_id = run.tracker.run_id
    run.mfu_passes = mfu_setup(run)
    hooks = Hooks(OmegaConf.to_container(cfg.trainer.hooks))  # user stages (trainer.pipeline)
    gen = generation(run, hooks)
    if plan.fully_async is not None:  # a rollouter thread generating into a queue (trainer/async_rollout.py)
        run.batches = AsyncBatchSource(gen, state, plan)
    else:
        run.batches = BatchSource(gen, state, one_step_off=plan.one_step_off, total_steps=plan.total_steps)
    if resume_from and run.batches.load(resume_from):  # one-step-off: the batch generated during the saved step
        print(f"resumed with the prefetched batch of step {state.step + 1}", flush=True)
    rollout = cluster.rollout
    run.first_sync = rollout.sync_from(cluster.actor)
    transport = getattr(rollout, "transport", "")
    if transport.startswith("object_store ("):  # shared memory was wanted and could not run: say why
        print(f"weight sync: {transport}", flush=True)
    evaluate = evaluator(run, gen)
    if state.step == 0 and plan.val_before_train and plan.test_freq != 0:
        m0 = evaluate(0)
        hooks.run("after_eval", None, m0)
        run.log(m0, 0)
        state.last_eval = 0
    rt = Runtime(plan=plan, cluster=cluster, state=state, batches=run.batches, hooks=hooks, evaluate=evaluate,
                 judge=run.judge, tokenizer=run.tok)
    return rt, load_pipeline(cfg.trainer.pipeline)


def mfu_setup(run: Run) -> list:
    """The passes ``perf/mfu/*`` reports and the peak it divides by: the GPU's datasheet figure, or on
    CPU a matmul timed now (logged as the parameters ``perf/peak_*``, and said here)."""
    lay = run.cluster.actor.layouts[0]
    peaks = PeakTable(lay.get("device_name", "cpu"), int(lay.get("threads", 1)))
    passes = role_passes(run.cfg, run.cluster, run.plan, peaks)
    run.tracker.log_params(peaks.params)
    shown = ", ".join(f"{k.rsplit('/', 1)[-1]} {v}" for k, v in peaks.params.items() if k.startswith("perf/peak_tflops/"))
    if not passes:
        print(f"note: perf/mfu/* is not logged: no peak FLOP rate is known for {peaks.device_name!r} in the "
              f"roles' dtype (trainer/perf.py GPU_PEAK_TFLOPS lists the devices)", flush=True)
    elif peaks.device_name == "cpu":
        print(f"perf/mfu/*: the peak is this CPU's measured matmul rate ({shown} TFLOP/s, "
              f"{peaks.params['perf/peak_source']}), not a datasheet figure", flush=True)
    return passes


def resume_newest(run: Run) -> Optional[str]:
    """Resume as ``trainer.resume_mode`` says (``auto``: the newest checkpoint that verifies and loads);
    returns the checkpoint resumed from, or None. Makes the run's checkpoint manager (verl's layout:
    default_local_dir/global_step_N/{actor,critic} + latest_checkpointed_iteration.txt)."""
    cfg, run_dir = run.cfg, run.run_dir
    run.ckpt = ckpt = CheckpointManager(run_dir, cfg.trainer.max_actor_ckpt_to_keep)
    load_contents = cfg.actor_rollout_ref.actor.checkpoint.load_contents
    resume_from = None
    if cfg.trainer.resume_mode == "auto":
        ckpt.clean_stale()
        for cand in ckpt.candidates():
            try:
                resume(run.cluster, run.state, cand, load_contents, cfg.trainer.resume_allow_unverified)
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
            resume(run.cluster, run.state, resume_from, load_contents, cfg.trainer.resume_allow_unverified)
        except CheckpointError as e:
            raise CheckpointError(f"{e}. Point trainer.resume_from_path at an earlier global_step_* directory, "
                                  f"or use trainer.resume_mode=auto to take the newest one that verifies") from e
    if resume_from:
        print(f"resumed from {resume_from} at step {run.state.step}", flush=True)
    return resume_from


def generation(run: Run, hooks: Hooks) -> Generation:
    """Steps 1-3 bound to the plan, the rollout, the data and the reward (a learned reward model scores
    each generated batch on its own shards when there is one)."""
    cluster, plan = run.cluster, run.plan
    rm_group = cluster.reward_model
    to_rm = rm_inputs(run.cfg) if rm_group else None  # re-tokenised for the RM's tokenizer, or the actor's ids
    score_rm = (lambda b: rm_group.scores(StepData(to_rm(b) if to_rm else b, cluster.transport), plan.rm_scores)
                ) if rm_group else None
    return Generation(plan, cluster.rollout, run.reward_mgr, run.tok, run.train_ds, run.val_ds, reward_model=score_rm,
                      hooks=hooks, row_multiple=row_multiple(cluster))


def evaluator(run: Run, gen: Generation) -> Callable[[int], dict]:
    """``evaluate(step)``: the held-out metrics; ``trainer.log_val_generations`` samples to the trackers."""
    def evaluate(step: int) -> dict:
        samples = [] if run.plan.log_val_generations > 0 else None
        out = gen.evaluate(samples=samples)
        if samples:
            run.tracker.log_val_generations(samples, step, run.plan.log_val_generations)
        return out

    return evaluate


# ----------------------------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------------------------
def run_step(rt: Runtime, pipeline: Callable[[Step], None], step: int, first_sync: dict) -> Step:
    """The step's phases (``trainer.pipeline``; default: :func:`trainer.step.default_pipeline`)."""
    s = Step(rt, step, metrics=dict(first_sync))
    pipeline(s)
    if s.batch is None:
        raise PipelineError(f"the pipeline {pipeline.__module__}:{pipeline.__name__} did not call Step.generate(): "
                            f"a step needs a batch.")
    s.metrics.update(rt.cluster.rollout.metrics())  # e.g. an HTTP fleet's counters: fleet/{retries,restarts,dropped,...}
    return s


def finish_step(run: Run, s: Step, t_step: float) -> None:
    """The step's batch and timing metrics (``t_step``: when the step began), then log (and checkpoint
    when ``trainer.save_freq`` says)."""
    plan, state, m, batch, step = run.plan, run.state, s.metrics, s.batch, s.step
    m.update({"training/global_step": step, "training/epoch": s.epoch})  # verl's trainer logs both every step
    if not s.trained:  # generate and score only (debug.rollout_only, or a pipeline without updates)
        run.log({**m, **batch_metrics(batch, plan)}, step)
        return
    m.update(batch_metrics(batch, plan, entropy=s.entropy, kl_coef=state.kl_ctrl.value, grad_norm=m.get("actor/grad_norm")))
    m.update(run.cluster.transport.take_metrics())
    m["timing_s/step"] = time.perf_counter() - t_step
    m.update(timing_metrics(m, batch, plan.rank_slots))
    m.update(mfu_metrics(run.mfu_passes, m, batch.attention_mask.sum(-1).tolist()))
    state.step = step
    if plan.should_save(step):
        with timer(m, "save_checkpoint"):
            run.log(m, step)
            save_checkpoint(run, step)
    else:
        run.log(m, step)


def save_checkpoint(run: Run, step: int) -> None:
    """The workers' shards, the driver's state and the batch source's prefetch, in one checkpoint."""
    cluster, batches = run.cluster, run.batches
    batches.settle()  # the sampler state below includes the prefetched batch's prompts
    run.ckpt.save(step, run.state.state_dict(worker_rng=cluster.rng_states()),
                  write_workers=lambda d: (save_workers(cluster, d, run.save_contents, run.model_path), batches.save(d)))


# ----------------------------------------------------------------------------------------------
# teardown
# ----------------------------------------------------------------------------------------------
def finish(run: Run) -> dict:
    """The final export, the report and the trackers' artifacts; the run's history."""
    run_dir, state = run.run_dir, run.state
    export_dir = os.path.join(run_dir, "hf_export")
    # the report's figure (matplotlib: 1.6 s on a 2-core machine, a tenth of a tiny run) is drawn while the driver
    # waits for the actor's export
    with ThreadPoolExecutor(1, thread_name_prefix="report") as pool:
        drawn = pool.submit(write_report, state.history, run_dir)
        run.cluster.actor.export(export_dir, run.model_path)
        report = drawn.result()
    for p, folder in [(os.path.join(run_dir, "config.yaml"), "config"), (report, "report"), (export_dir, "hf_export")]:
        run.tracker.log_artifact(p, folder)
    run.tracker.finish()
    print(f"done: {run.plan.total_steps} steps in {time.time() - run.t_start:.0f}s; run dir {run_dir}", flush=True)
    return {"history": state.history, "final": dict(state.history[-1] if state.history else {}), "run_dir": run_dir}


def config_changes(cfg) -> dict[str, Any]:
    """The keys whose values, as set (interpolations unresolved), differ from the schema's defaults, with the values
    the console may show (resolved, secrets masked: :func:`trainer.config.public_container`)."""
    defaults = flatten_keys(schema_defaults())
    return changed_from_defaults(flatten_keys(cfg), defaults, flatten_keys(public_container(cfg)))


def cli(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help-keys" in argv:  # every key, its default and its description (the field's comment in trainer/config/schema.py)
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
    if dry:  # --print-config: every key; a run opens with what differs from the defaults (config_changes)
        print(to_yaml(cfg))
    for note in LAST_LOAD_NOTES:  # verl implementation selectors: accepted, and said to do nothing here
        print(f"note: {note}", file=sys.stderr)
    if dry:  # a login node may not hold the run's files: the missing ones are notes here, a run refuses them
        for line in missing_paths(cfg):
            print(f"note: {line} (a run refuses it before any worker starts)", file=sys.stderr)
    run_dir = cfg.trainer.default_local_dir
    try:
        path = save_resolved(cfg, run_dir)
    except OSError as e:
        print(f"error: cannot write the run directory trainer.default_local_dir={run_dir!r}: {e}. "
              f"Point it at a writable directory.", file=sys.stderr)
        return 2
    if dry:
        print(f"resolved config written to {path}", flush=True)
        return 0
    print_lines(config_summary_lines(config_changes(cfg), path))
    sys.stdout.flush()
    try:
        train(cfg)
    except BaseException as e:  # noqa: BLE001 - every failure ends in one paragraph, the traceback in a file
        return report_failure(e, cfg)
    return 0


# Failures with a message written for the user: what happened and what to do. Anything else is
# reported as unexpected (a bug), still in one paragraph, with the traceback in the run directory.
def _anticipated() -> tuple:
    return (ConfigError, FileNotFoundError, NotADirectoryError, PermissionError, CheckpointError, BadRowError,
            WorkerDiedError, FloatingPointError, RewardError, DynamicSamplingError, WeightSyncError, FleetError,
            TemplateError, SandboxServiceError, MemoryError, JudgeFallbackError)


def resume_hint(run_dir: str) -> str:
    """What a rerun would do, stated from what is on disk (never a promise the disk cannot keep)."""
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
