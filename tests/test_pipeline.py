"""User pipeline stages (trainer.pipeline): hooks at named points, a user-defined step, and the
forward passes run at the same time. Unit checks of the contract, then short runs of the tiny job
on a real local Ray cluster: a reward-scaling hook scales Dr.GRPO's advantages by exactly its
factor, a filter hook drops exactly the samples it names (and the advantages are those of what is
left), and a user pipeline without the reference pass trains exactly as the default one without KL."""

import os
import threading
from pathlib import Path

import pytest
import torch

from tests.support.batches import random_batch
from tests.support import pipeline_hooks as H
from tests.support.tiny import tiny_config
from trainer.config import ConfigError
from trainer.generation import PipelineError, fit_rows
from trainer.step import Hooks, run_concurrently

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- contract
@pytest.mark.parametrize("key,spec,needle", [
    ("trainer.hooks.after_reward", "tests.support.pipeline_hooks:nope", "has no function 'nope'"),
    ("trainer.hooks.after_update", "no_such_pkg.mod:f", "cannot import module 'no_such_pkg.mod'"),
    ("trainer.hooks.after_filter", "tests.support.pipeline_hooks", "not of the form 'pkg.module:function'"),
    ("trainer.pipeline", "tests.support.pipeline_hooks:missing", "has no function 'missing'"),
])
def test_bad_hook_specs_are_refused_at_load(key, spec, needle):
    val = f"[{spec}]" if key.startswith("trainer.hooks") else spec
    with pytest.raises(ConfigError) as e:
        tiny_config([f"{key}={val}"])
    assert key in str(e.value) and needle in str(e.value)


def test_an_unknown_hook_point_is_refused():
    with pytest.raises(ConfigError, match="after_everything"):
        tiny_config(["+trainer.hooks.after_everything=[tests.support.pipeline_hooks:observe]"])
    with pytest.raises(ValueError, match="no point"):
        Hooks({"after_everything": ["tests.support.pipeline_hooks:observe"]})


def test_hooks_run_in_order_count_drops_and_guard_late_points():
    b = random_batch(n=12, P=4, T=5, seed=0)
    b.scores = torch.arange(12, dtype=torch.float32)
    b.token_level_scores = torch.zeros(12, 5)
    b.group_ids = torch.arange(12) // 4
    hooks = Hooks({"after_reward": ["tests.support.pipeline_hooks:scale_rewards", "tests.support.pipeline_hooks:drop_named"]})
    m = {}
    H.DROP, saved = ((0, 1), (2, 3)), H.DROP
    try:
        out = hooks.run("after_reward", b, m)
    finally:
        H.DROP = saved
    # scaled first (x3), then rows 1 (group 0, second) and 11 (group 2, fourth) dropped
    assert out.num_samples == 10 and m["pipeline/after_reward/dropped_samples"] == 2.0
    assert out.scores.tolist() == [3.0 * i for i in range(12) if i not in (1, 11)]
    late = Hooks({"before_advantages": ["tests.support.pipeline_hooks:bad_drop_late"]})
    with pytest.raises(PipelineError, match="before_advantages.*from 12 to 10"):
        late.run("before_advantages", b, {})


def test_a_hook_must_return_none_or_a_batch_and_cannot_empty_it(tmp_path, monkeypatch):
    mod = tmp_path / "user_hooks_bad.py"
    mod.write_text("def returns_dict(batch, metrics):\n    return {'x': 1}\n"
                   "def drop_all(batch, metrics):\n    return batch[batch.scores > 1e9]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    b = random_batch(n=4, P=3, T=3, seed=1)
    b.scores = torch.zeros(4)
    with pytest.raises(PipelineError, match="returned a dict"):
        Hooks({"after_rollout": ["user_hooks_bad:returns_dict"]}).run("after_rollout", b, {})
    with pytest.raises(PipelineError, match="dropped every sample"):
        Hooks({"after_filter": ["user_hooks_bad:drop_all"]}).run("after_filter", b, {})


def test_fit_rows_trims_to_the_dp_multiple_and_counts():
    b = random_batch(n=11, P=3, T=3, seed=2)
    m = {}
    out = fit_rows(b, 4, m)
    assert out.num_samples == 8 and m["pipeline/trimmed_samples"] == 3.0
    assert torch.equal(out.responses, b.responses[:8])
    assert fit_rows(b, 1, {}) is b
    with pytest.raises(PipelineError, match="fewer than the 12 data-parallel"):
        fit_rows(b, 12, {})


def test_phases_run_at_the_same_time_and_errors_wait_for_the_others():
    # each job waits for the other to have started: in order, the first would wait forever (timeout)
    started = {k: threading.Event() for k in ("a", "b")}

    def job(me, other):
        def f():
            started[me].set()
            assert started[other].wait(timeout=10), "the phases ran one after the other"
            return me
        return f

    m = {}
    out = run_concurrently({"a": job("a", "b"), "b": job("b", "a")}, m, parallel=True)
    assert out == {"a": "a", "b": "b"} and {"timing_s/a", "timing_s/b"} <= set(m)
    finished = threading.Event()

    def slow():
        threading.Event().wait(0.3)
        finished.set()

    def fails():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_concurrently({"slow": slow, "bad": fails}, {}, parallel=True)
    assert finished.is_set()  # the error surfaced only after the other phase ended

    # jobs of one lane (the same ranks answer them: LoRA's reference on the actor) never overlap, in the given
    # order; another lane runs beside them
    running, log = [], []

    def lane_job(name):
        def f():
            running.append(name)
            log.append((name, tuple(running)))
            threading.Event().wait(0.1)
            running.remove(name)
            return name
        return f

    out = run_concurrently({"old": lane_job("old"), "ref": lane_job("ref"), "values": lane_job("values")}, {},
                           parallel=True, lanes={"old": "actor", "ref": "actor", "values": "critic"})
    assert out == {"old": "old", "ref": "ref", "values": "values"}
    order = [n for n, _ in log if n != "values"]
    assert order == ["old", "ref"] and not any({"old", "ref"} <= set(r) for _, r in log)
    assert any(len(r) == 2 for _, r in log)  # "values" overlapped one of them


# ---------------------------------------------------------------------------------------------- runs
BASE = ["data.train_batch_size=16", "trainer.val_before_train=false", "trainer.logger=[console]",
        "algorithm.norm_adv_by_std_in_grpo=false"]  # Dr.GRPO: advantages linear in the rewards


@pytest.fixture(scope="module", autouse=True)
def _ray(shared_ray):
    yield  # one embedded Ray cluster for the module's runs (tests/conftest.py: shared_ray)


def run(tmp_path, name, *overrides):
    from trainer.main import train

    return train(tiny_config(BASE + [f"trainer.default_local_dir={tmp_path / name}", *overrides]))["history"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Two steps of the default pipeline, observed after each update and after the eval at step 2."""
    H.SEEN.clear(), H.EVALS.clear()
    hist = run(tmp_path_factory.mktemp("pipe"), "base", "trainer.total_training_steps=2", "trainer.test_freq=2",
               "trainer.hooks.after_rollout=[tests.support.pipeline_hooks:tag_samples]",
               "trainer.hooks.after_update=[tests.support.pipeline_hooks:observe]",
               "trainer.hooks.after_eval=[tests.support.pipeline_hooks:observe_eval]")
    return hist, list(H.SEEN), list(H.EVALS)


def _dr_grpo(scores, gids, mask):
    """Dr.GRPO in float64: a_i = s_i - mean of its group, on every response token."""
    s, out = scores.double(), torch.zeros_like(scores, dtype=torch.float64)
    for g in gids.unique():
        sel = gids == g
        out[sel] = s[sel] - s[sel].mean()
    return out[:, None] * mask.double()


@pytest.mark.slow
def test_default_pipeline_with_hooks(baseline):
    hist, seen, evals = baseline
    assert [h["step"] for h in hist] == [1, 2] and len(seen) == 2
    first = seen[0]
    assert first["n"] == 128 and first["tags"] == [f"r{i}" for i in range(128)]  # a field added after the rollout
    assert "actor/pg_loss" in first["metrics"]  # after_update sees the update's metrics
    torch.testing.assert_close(first["advantages"].double(), _dr_grpo(first["scores"], first["group_ids"], first["mask"]),
                               atol=1e-6, rtol=0)
    assert len(evals) == 1 and any(k.startswith("val-core/") for k in evals[0])
    assert {"timing_s/old_log_prob", "timing_s/forward_passes"} <= set(hist[0])


@pytest.mark.slow
def test_a_reward_scaling_hook_scales_the_advantages_exactly(baseline, tmp_path):
    _, seen, _ = baseline
    H.SEEN.clear()
    hist = run(tmp_path, "scaled", "trainer.total_training_steps=1", "trainer.test_freq=-1",
               "trainer.hooks.after_reward=[tests.support.pipeline_hooks:scale_rewards]",
               "trainer.hooks.after_update=[tests.support.pipeline_hooks:observe]")
    got, ref = H.SEEN[0], seen[0]
    assert torch.equal(got["scores"], ref["scores"] * H.SCALE)  # same samples (step 1, same seed), rewards x3
    assert float(ref["advantages"].abs().max()) > 0
    torch.testing.assert_close(got["advantages"], ref["advantages"] * H.SCALE, atol=1e-6, rtol=1e-6)
    assert hist[0]["hooks/scaled"] == H.SCALE


@pytest.mark.slow
def test_a_filter_hook_drops_the_samples_it_names(baseline, tmp_path):
    _, seen, _ = baseline
    H.SEEN.clear()
    hist = run(tmp_path, "dropped", "trainer.total_training_steps=1", "trainer.test_freq=-1",
               "trainer.hooks.after_reward=[tests.support.pipeline_hooks:drop_named]",
               "trainer.hooks.after_update=[tests.support.pipeline_hooks:observe]")
    got, ref = H.SEEN[0], seen[0]
    # 128 - 3 named = 125, trimmed to 124 to split over DP=2 (the last row of the last group)
    assert hist[0]["pipeline/after_reward/dropped_samples"] == 3.0 and hist[0]["pipeline/trimmed_samples"] == 1.0
    assert got["n"] == 124
    keep = [i for i in range(128) if i not in {0 * 8 + 1, 2 * 8 + 5, 5 * 8 + 0}][:124]
    assert torch.equal(got["scores"], ref["scores"][keep])  # exactly those rows, in order
    assert torch.equal(got["group_ids"], ref["group_ids"][keep])
    # the advantages are the estimator's over what is left (smaller groups have their own means)
    torch.testing.assert_close(got["advantages"].double(), _dr_grpo(got["scores"], got["group_ids"], got["mask"]),
                               atol=1e-6, rtol=0)


@pytest.mark.slow
def test_a_user_pipeline_without_the_reference_trains_as_the_default_without_kl(baseline, tmp_path):
    hist0, seen0, _ = baseline
    H.SEEN.clear()
    hist = run(tmp_path, "noref", "trainer.total_training_steps=2", "trainer.test_freq=2",
               "actor_rollout_ref.actor.use_kl_loss=true",  # a reference group exists ...
               "trainer.pipeline=tests.support.pipeline_hooks:no_reference",  # ... and the user's step never calls it
               "trainer.hooks.after_update=[tests.support.pipeline_hooks:observe]")
    assert all("timing_s/ref" not in h for h in hist) and all(h["pipeline/kl_loss_off"] == 1.0 for h in hist)
    skip = ("timing", "perf/", "pipeline/", "sync/seconds", "sync/gbps", "reward/time_s")
    for h, h0 in zip(hist, hist0):
        a = {k: v for k, v in h.items() if not k.startswith(skip)}
        b = {k: v for k, v in h0.items() if not k.startswith(skip)}
        assert a.keys() == b.keys()
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7), [k for k in a if a[k] != pytest.approx(b[k], rel=1e-6, abs=1e-7)]
    for s, s0 in zip(H.SEEN, seen0):
        assert torch.equal(s["advantages"], s0["advantages"])


def test_without_the_reference_the_kl_loss_is_refused_not_dropped():
    from types import SimpleNamespace

    from trainer.step import Step

    plan = SimpleNamespace(actor_update=SimpleNamespace(policy=SimpleNamespace(use_kl_loss=True)))
    s = Step(SimpleNamespace(plan=plan), 3)
    s._ran.update({"generate", "advantages"})
    with pytest.raises(PipelineError, match="use_kl_loss needs the reference log-probs.*kl_loss=False"):
        s.update_actor()


def test_the_plan_resolves_what_the_step_and_the_loop_read():
    """The step and the loop read these from the Plan, never from the raw config: each resolved once."""
    from trainer.plan import Plan

    plan = Plan.from_config(tiny_config(["trainer.debug.rollout_only=true", "trainer.debug.dump_batch_path=/tmp/dumps",
                                         "trainer.n_gpus_per_node=4", "trainer.log_val_generations=5",
                                         "attribution_driven_credit_assignment.enable=true",
                                         "attribution_driven_credit_assignment.adca_grpo.alpha=0.25"]), total_steps=2)
    assert plan.rollout_only and not plan.train_only and plan.dump_batch_path == "/tmp/dumps"
    assert plan.rank_slots == 4 and plan.log_val_generations == 5  # 1 node x 4 slots: perf/throughput's divisor
    assert plan.parallel_phases  # trainer.parallel_phases=null on CPU: on
    assert plan.adca["adca_grpo"]["alpha"] == 0.25 and isinstance(plan.adca, dict)  # plain values, picklable
    off = Plan.from_config(tiny_config(["trainer.parallel_phases=false"]), total_steps=2)
    assert off.adca is None and not off.parallel_phases and not off.rollout_only
