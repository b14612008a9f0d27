"""One-step-off asynchrony (async_training.mode=one_step_off, trainer/batch_source.py) in the whole loop on a
real local Ray cluster with split placement: step t+1's batch is sampled by the weights step t trains
from (checked token by token against transformers on each checkpoint's HF export), the training equals a
hand-scheduled reference (the same batches replayed into the synchronous loop), and a SIGKILL in step 3
then a resume gives the uninterrupted run's metrics and weights (the uninterrupted run is the first test's
one-step-off run, shared through a module fixture)."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.tiny import checkpoint_history, joining_this_cluster, rollout_logp_under, start_driver, tiny_config

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")
pytestmark = pytest.mark.slow

BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=6",
        f"actor_rollout_ref.model.path={TINY}", "trainer.logger=[mlflow]", "data.val_batch_size=64",
        "trainer.placement=split", "trainer.test_freq=-1", "trainer.val_before_train=false"]
OFF = ["async_training.mode=one_step_off"]
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/throughput", "perf/time_per_step", "perf/mfu/", "perf/max_memory",
            "perf/cpu_memory", "sync/seconds", "sync/gbps", "reward/time_s", "async/")


def stable(history):
    return [{k: v for k, v in h.items() if not k.startswith(VOLATILE)} for h in history]


def run(tmp_path, *overrides, name="run"):
    from trainer.main import train

    return train(tiny_config(BASE + [f"trainer.default_local_dir={tmp_path / name}", *overrides]))


@pytest.fixture(autouse=True)
def _mlflow(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    yield


@pytest.fixture(scope="module", autouse=True)
def _ray(shared_ray):
    yield  # one embedded Ray cluster for the module's runs (tests/conftest.py: shared_ray)


# The one-step-off run both tests below read: 4 steps, a checkpoint (with its HF weights) every step, every batch
# dumped. The SIGKILL test's uninterrupted reference is this run (one run fewer for the suite).
OFF_RUN = [*OFF, "trainer.total_training_steps=4", "trainer.save_freq=1",
           "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"]


@pytest.fixture(scope="module")
def off_run(tmp_path_factory, shared_ray):
    d = tmp_path_factory.mktemp("off")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{d}/mlflow.db")
        return d, run(d, *OFF_RUN, f"trainer.debug.dump_batch_path={d / 'dumps'}", name="off")


def test_one_step_off_samples_with_the_previous_weights_and_trains_like_the_reference(tmp_path, off_run):
    from trainer.debug import load_batch

    d, off = off_run
    dumps = d / "dumps"
    h = off["history"]
    assert [x["async/staleness"] for x in h] == [0.0, 1.0, 1.0, 1.0]
    # batch t was sampled by the weights at the start of step t-1 (step 1's by the initial ones)
    weights = {0: TINY, **{v: str(d / "off" / f"global_step_{v}" / "actor" / "huggingface") for v in (1, 2, 3)}}
    for t in (1, 2, 3, 4):
        b = load_batch(str(dumps / f"step_{t:06d}"))
        mask = b.response_mask.bool()
        sampler = rollout_logp_under(weights[max(t - 2, 0)], b)
        assert (b.rollout_log_probs - sampler)[mask].abs().max() < 1e-4, t
        if t > 1:  # not the weights the step trains from
            assert (b.rollout_log_probs - rollout_logp_under(weights[t - 1], b))[mask].abs().max() > 1e-3, t
    # the hand-scheduled reference: the same batches, replayed into the synchronous loop
    ref = run(tmp_path, "trainer.total_training_steps=4", "trainer.debug.train_only=true",
              f"trainer.debug.dump_batch_path={dumps}", name="ref")["history"]
    assert len(ref) == len(h) == 4
    for a, b in zip(h, ref):
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "mismatch/mismatch_kl"):
            assert a[k] == b[k], (a["step"], k, a[k], b[k])
    wa = load_file(str(d / "off" / "hf_export" / "model.safetensors"))
    wb = load_file(str(tmp_path / "ref" / "hf_export" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # and the batches are not the synchronous loop's: from step 2 on, sync samples with newer weights
    sync = run(tmp_path, "trainer.total_training_steps=2", name="sync")["history"]
    assert sync[0]["critic/score/mean"] == h[0]["critic/score/mean"]
    assert sync[1]["actor/pg_loss"] != h[1]["actor/pg_loss"]


def test_one_step_off_sigkill_then_resume_is_identical(tmp_path, off_run):
    """The checkpoint of step 2 holds batch 3 (generated during step 2 with step 2's weights): the resumed
    run trains on it and matches the uninterrupted run (the module's one-step-off run) exactly."""
    d, _ = off_run
    common = BASE + OFF_RUN + [f"trainer.debug.dump_batch_path={tmp_path / 'dumps'}"]
    ref_dir, cut_dir = d / "off", tmp_path / "killed"
    env = joining_this_cluster(dict(os.environ, PYTHONUNBUFFERED="1"))  # the killed driver and its resume join it
    with open(tmp_path / "cut.log", "w") as log:
        p = start_driver(common + [f"trainer.default_local_dir={cut_dir}"], env, log)
        latest = cut_dir / "latest_checkpointed_iteration.txt"
        t0 = time.time()
        while not (latest.exists() and latest.read_text().strip() == "2"):
            assert p.poll() is None and time.time() - t0 < 600, (tmp_path / "cut.log").read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert (cut_dir / "global_step_2" / "prefetched_batch" / "info.json").exists()
    with open(tmp_path / "resume.log", "w") as log:
        assert start_driver(common + [f"trainer.default_local_dir={cut_dir}"], env, log).wait(600) == 0
    text = (tmp_path / "resume.log").read_text()
    assert "resumed with the prefetched batch of step 3" in text, text[-2000:]
    a, b = stable(checkpoint_history(ref_dir)), stable(checkpoint_history(cut_dir))
    assert [x["step"] for x in a] == [1, 2, 3, 4] == [x["step"] for x in b]
    assert a == b
    wa = load_file(str(ref_dir / "hf_export" / "model.safetensors"))
    wb = load_file(str(cut_dir / "hf_export" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_one_step_off_with_dynamic_sampling_on_the_http_fleet_and_with_multi_turn(tmp_path):
    """One-step-off composes with the rest of the loop: DAPO dynamic sampling (several generation
    batches per step, all in the background) over the HTTP fleet behind sglang-router, and multi-turn
    episodes of the agent loop; each trains two steps, the second on a one-step-stale batch."""
    dapo = run(tmp_path, *OFF, "trainer.total_training_steps=2", "actor_rollout_ref.rollout.mode=server",
               "actor_rollout_ref.rollout.num_engines=1", "algorithm.filter_groups.enable=true",
               "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=8",
               "data.gen_batch_size=8", name="dapo")["history"]
    assert [h["async/staleness"] for h in dapo] == [0.0, 1.0]
    assert all(h["sync/verified"] == 1.0 for h in dapo)
    assert all(h["filter/gen_batches"] >= 1 for h in dapo)  # DAPO's generation rounds ran in the background
    agent = str(ROOT / "recipes" / "cpu" / "tiny_agent_model")
    mt = run(tmp_path, *OFF, "trainer.total_training_steps=2", "data.train_batch_size=4",
             "actor_rollout_ref.actor.ppo_mini_batch_size=4", f"actor_rollout_ref.model.path={agent}",
             "data.max_prompt_length=384", "data.max_response_length=96",
             "actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.environment=hanoi",
             "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
             "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=24", name="mt")["history"]
    assert [h["async/staleness"] for h in mt] == [0.0, 1.0] and all(h["sync/verified"] == 1.0 for h in mt)
