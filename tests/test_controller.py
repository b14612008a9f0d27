"""The controller end to end on a real local Ray cluster, megatron-core actors (gloo), the native
engine, a real MLflow store: short runs, placement modes, TP=2, exact SIGKILL resume, eval dedup,
the old-log-prob anchor and the resharding checksum."""

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.batches import random_batch
from tests.support.tiny import checkpoint_history, joining_this_cluster, sigkill_after_checkpoint, start_driver, tiny_config
from trainer.plan import ForwardSettings

FWD = ForwardSettings(micro_batch_size=8)  # old log-probs at temperature 1, packed
from trainer.generation import val_core_acc
from trainer.plan import should_eval

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")
pytestmark = pytest.mark.slow

# Small and fast: 8 prompts x 4 responses per step, 2 mini-batches per step.
BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=6",
        f"actor_rollout_ref.model.path={TINY}", "trainer.logger=[mlflow]", "data.val_batch_size=64"]

VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/throughput", "perf/time_per_step", "perf/mfu/", "perf/max_memory",
            "perf/cpu_memory", "sync/seconds", "sync/gbps", "reward/time_s")


def stable(history):
    return [{k: v for k, v in h.items() if not k.startswith(VOLATILE)} for h in history]


def run(tmp_path, *overrides, name="run"):
    from trainer.main import train

    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    cfg = tiny_config(BASE + [f"trainer.default_local_dir={tmp_path / name}", *overrides])
    return train(cfg)


@pytest.fixture(scope="module", autouse=True)
def _ray(shared_ray):
    yield  # one embedded Ray cluster for the module's runs (tests/conftest.py: shared_ray)


# The module's 4-step run: an eval at steps 0, 2 and 4, a checkpoint every step. The first test reads what it
# logged and exported; the SIGKILL test below takes it as its uninterrupted reference (one run fewer).
WHOLE = ["trainer.total_training_steps=4", "trainer.save_freq=1", "trainer.test_freq=2",
         # model.override_config reaches the actor, reference and engine readers (values that change no number here)
         "actor_rollout_ref.model.override_config.max_position_embeddings=128",
         "actor_rollout_ref.model.override_config.rope_theta=10000.0",
         # a TransformerConfig field passed through and a GPU kernel switch turned off on CPU (no number changes)
         "+actor_rollout_ref.actor.megatron.override_transformer_config.deallocate_pipeline_outputs=true",
         "+actor_rollout_ref.actor.megatron.override_transformer_config.bias_activation_fusion=true"]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, _ray):
    d = tmp_path_factory.mktemp("whole")
    uri = f"sqlite:///{d}/mlflow.db"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        return d, uri, run(d, *WHOLE, name="uninterrupted")


def test_run_logs_learns_exports(whole_run):
    d, uri, out = whole_run
    hist = out["history"]
    # eval exactly at step 0 (val_before_train) and at steps 2 and 4, once each
    assert [h["step"] for h in hist] == [0, 1, 2, 3, 4]
    assert [val_core_acc(h) is not None for h in hist] == [True, False, True, False, True]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "timing_s/gen", "timing_s/update_actor",
                "perf/throughput", "sync/verified", "reward/acc", "actor/entropy", "actor/ppo_kl"):
        assert key in hist[1] or key in hist[2], key
    assert all(h["sync/verified"] == 1.0 for h in hist[1:])  # the checksum-verified sync ran after every update
    # verl's step counters: every step draws from the first pass over the prompts (epoch 0)
    assert [(h["training/global_step"], h["training/epoch"]) for h in hist[1:]] == [(t, 0) for t in (1, 2, 3, 4)]
    # the update's MFU against this CPU's measured matmul peak: a fraction, positive and well under 1
    assert all(0 < h["perf/mfu/actor"] < 1 for h in hist[1:]), [h["perf/mfu/actor"] for h in hist[1:]]
    run_dir = Path(out["run_dir"])
    assert (run_dir / "report.png").stat().st_size > 10_000 and (run_dir / "config.yaml").exists()
    # the export loads in transformers and differs from the starting weights (the actor trained)
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(run_dir / "hf_export")
    start = load_file(os.path.join(TINY, "model.safetensors"))
    sd = m.state_dict()
    diff = max((sd[k].float() - v.float()).abs().max().item() for k, v in start.items() if k in sd)
    assert diff > 0
    # MLflow got the params and the per-step metrics
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=uri)
    runs = c.search_runs([c.get_experiment_by_name("coxswain").experiment_id])
    r = runs[0]
    assert r.data.params["algorithm.adv_estimator"] == "grpo"
    assert float(r.data.params["perf/peak_tflops/float32"]) > 0 and "measured" in r.data.params["perf/peak_source"]
    val_key = next(k for k in hist[0] if k.startswith("val-core/") and "/acc/mean@" in k)
    # MLflow keys as verl writes them there: "@" -> "_at_"
    assert [m.step for m in c.get_metric_history(r.info.run_id, val_key.replace("@", "_at_"))] == [0, 2, 4]


def test_shipped_recipe_learns_in_bf16(tmp_path):
    """The recipe as shipped (verl's bf16 defaults, no fp32 overlay: the README's main job) learns the task
    within five steps, and its bf16 engines sample from the bf16 actor's weights: the rollout-vs-trainer
    mismatch stays at bf16 rounding (an engine left on stale or mis-cast weights shows a KL far above it)."""
    from trainer.config import load_config
    from trainer.main import train

    from tests.support.tiny import TINY_YAML

    cfg = load_config(["--config", TINY_YAML, "trainer.total_training_steps=5", "trainer.logger=[console]",
                       f"trainer.default_local_dir={tmp_path / 'run'}"])
    assert (cfg.actor_rollout_ref.actor.megatron.dtype, cfg.actor_rollout_ref.rollout.dtype) == ("bfloat16", "bfloat16")
    hist = train(cfg)["history"]
    before, after = val_core_acc(hist[0]), val_core_acc(hist[-1])
    assert hist[-1]["step"] == 5 and before < 0.3 and after > 0.6, (before, after)
    assert all(abs(h["mismatch/mismatch_kl"]) < 0.01 for h in hist[1:]), [h["mismatch/mismatch_kl"] for h in hist[1:]]
    assert all(h["sync/verified"] == 1.0 for h in hist[1:])


def test_tp2_actor_split_placement_and_critic(tmp_path, monkeypatch):
    """TP=2 actor (megatron tensor parallel over 2 CPU ranks), split placement (the engine on its own
    slot), and GAE with a critic group: one step runs, the synced engine matches the TP=2 actor."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    out = run(tmp_path, "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
              "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "trainer.placement=split",
              "algorithm.adv_estimator=gae", "algorithm.lam=0.95", "critic.ppo_micro_batch_size_per_gpu=16")
    h = out["history"][-1]
    assert h["sync/verified"] == 1.0 and "critic/vf_loss" in h and "critic/grad_norm" in h
    # one node: the TP ranks wrote their shards into shared memory for the engine's worker (trainer/sync/shared_memory.py)
    assert h["sync/shared_memory"] == 1.0


def nan_estimator(*, token_level_rewards, response_mask, **kw):
    """A user plug-in estimator gone wrong: NaN advantages."""
    adv = torch.full_like(token_level_rewards, float("nan")) * response_mask
    return adv, adv


def test_nan_loss_stops_the_run_with_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    with pytest.raises(FloatingPointError, match="NaN/inf.*lower actor_rollout_ref.actor.optim.lr") as e:
        run(tmp_path, "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
            "algorithm.adv_estimator=test_controller:nan_estimator")
    assert e.value.coxswain_where == "step 1 of 1"  # the CLI names it (tests/security/test_cli_errors.py)


def test_should_eval_once_per_boundary():
    calls = [s for s in range(1, 11) if should_eval(s, 3, 10, None)]
    assert calls == [3, 6, 9, 10]
    assert not should_eval(6, 3, 10, last_eval_step=6)  # the same boundary never evaluates twice
    assert not should_eval(5, -1, 10, None) and not should_eval(5, 0, 10, None)




def test_sigkill_mid_step_then_resume_is_identical(tmp_path, whole_run):
    common = BASE + WHOLE
    ref_dir, cut_dir = whole_run[0] / "uninterrupted", tmp_path / "killed"  # the reference: the module's run
    # the killed driver and its resume join that cluster (tests/security/test_orphans.py kills an embedded one's driver)
    env = joining_this_cluster(dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db", PYTHONUNBUFFERED="1"))

    with open(tmp_path / "cut.log", "w") as log:
        p = start_driver(common + [f"trainer.default_local_dir={cut_dir}"], env, log)
        sigkill_after_checkpoint(p, cut_dir, 2, tmp_path / "cut.log")  # the driver is inside step 3
    with open(tmp_path / "resume.log", "w") as log:
        assert start_driver(common + [f"trainer.default_local_dir={cut_dir}"], env, log).wait(600) == 0
    assert "resumed from" in (tmp_path / "resume.log").read_text()

    a, b = stable(checkpoint_history(ref_dir)), stable(checkpoint_history(cut_dir))
    assert [h["step"] for h in a] == [0, 1, 2, 3, 4] == [h["step"] for h in b]
    assert a == b
    wa = load_file(str(ref_dir / "hf_export" / "model.safetensors"))
    wb = load_file(str(cut_dir / "hf_export" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from trainer.main import resolve_model_paths
    from trainer.workers.cluster import Cluster

    # engines in their own processes (the hybrid engine is test_step_fast_paths' cluster): the
    # object-store sync path
    cfg = tiny_config(BASE + [f"trainer.default_local_dir={tmp_path_factory.mktemp('c')}",
                              "actor_rollout_ref.hybrid_engine=false"])
    resolve_model_paths(cfg)
    c = Cluster(cfg, total_steps=1)
    assert not c.hybrid and c.rollout.pids()[0] not in c.actor.pids()
    c.rollout.sync_from(c.actor)
    yield cfg, c
    c.shutdown()


def _random_batch(n=16, P=6, T=6, seed=0):
    return random_batch(n, P, T, seed)


def test_old_log_probs_stay_anchored_across_mini_batches(cluster):
    """Two mini-batches in one step: the first sees ratio exactly 1 (weights = start of step), the
    second sees the weights after one update against the SAME old log-probs (passed to the update by
    reference, never through the driver), so its ratio moves."""
    from dataclasses import replace

    from trainer.plan import Plan
    from trainer.workers.dataplane import StepData

    cfg, c = cluster
    batch = _random_batch()
    data = StepData(batch, c.transport)
    old, _ = c.actor.log_probs_with_entropy(data, FWD)
    settings = replace(Plan.from_config(cfg, total_steps=1).actor_update, mini_batch_size=8, epochs=1, shuffle=False,
                       micro_batch_size=8, temperature=1.0)
    c.transport.take_metrics()
    rows = c.actor.update(data, settings, [old, data.scatter(c.actor.dp, {"advantages": batch.advantages})], seed=0,
                          per_mini_batch=True)
    assert c.transport.take_metrics()["dataplane/driver_bytes_in"] == 0  # the old log-probs never reached the driver
    assert len(rows) == 2
    assert abs(rows[0]["actor/ppo_kl"]) < 1e-6 and abs(rows[0]["actor/is_ratio_max"] - 1) < 1e-5
    assert abs(rows[1]["actor/ppo_kl"]) > 1e-6 or abs(rows[1]["actor/is_ratio_max"] - 1) > 1e-5
    after, _ = c.actor.log_probs_with_entropy(StepData(batch, c.transport), FWD)
    assert not torch.allclose(after.fetch()["old_log_probs"], old.fetch()["old_log_probs"])  # the policy did move


def test_resharding_checksum_catches_a_bad_engine(cluster):
    from trainer.rollout.engine import WeightSyncError

    cfg, c = cluster
    m = c.rollout.sync_from(c.actor)
    assert m["sync/verified"] == 1.0 and m["sync/bytes"] > 1e6
    c.rollout.load_bucket([[("model.norm.weight", torch.zeros(96))]])
    with pytest.raises(WeightSyncError, match="stale or corrupted"):
        c.rollout.verify(c.actor)
    c.rollout.sync_from(c.actor)  # a full sync repairs it
    c.rollout.verify(c.actor)

