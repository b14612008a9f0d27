"""Step metrics as verl names and computes them: the driver's data / timing / validation metrics
against float64 re-implementations of verl's ``compute_data_metrics``, ``compute_timing_metrics``,
``compute_throughout_metrics`` and ``process_validation_metrics`` (mean@N, std@N); the reduction of
worker metrics over micro-batches and DP ranks; the console line, its ETA and the report's axes."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from tests.support.batches import random_batch
from trainer.generation import val_core_acc, val_metric_names
from trainer.step import batch_metrics, timing_metrics
from trainer.workers.metrics import (MAX, MEAN, MIN, SUM, Partials, entropy_from_summary, entropy_summary,
                                     reduce_partials)


class _Policy:
    def __init__(self, agg_mode="token-mean", norm_constant=6.0):
        self.agg_mode, self.norm_constant = agg_mode, norm_constant


class _Plan:
    def __init__(self, response_width, max_prompt_length, agg_mode="token-mean"):
        self.response_width, self.max_prompt_length = response_width, max_prompt_length
        self.actor_update = type("U", (), {"policy": _Policy(agg_mode)})()


def _verl_data_metrics(b, max_resp, max_prompt, use_critic):
    """verl's compute_data_metrics, in float64 over plain tensors (the batch's fields)."""
    score = b.token_level_scores.double().sum(-1)
    reward = b.token_level_rewards.double().sum(-1)
    am = b.attention_mask.double()
    P = b.prompts.shape[1]
    plen, rlen = am[:, :P].sum(-1), am[:, P:].sum(-1)
    rm = b.response_mask.bool()
    live = rlen > 0
    out = {"critic/score/mean": score[live].mean(), "critic/score/max": score[live].max(),
           "critic/score/min": score[live].min(), "critic/rewards/mean": reward[live].mean(),
           "critic/rewards/max": reward[live].max(), "critic/rewards/min": reward[live].min()}
    for name, x in (("advantages", b.advantages), ("returns", b.returns)) + ((("values", b.values),) if use_critic else ()):
        v = torch.masked_select(x.double(), rm)
        out.update({f"critic/{name}/mean": v.mean(), f"critic/{name}/max": v.max(), f"critic/{name}/min": v.min()})
    if use_critic:
        r, v = torch.masked_select(b.returns.double(), rm), torch.masked_select(b.values.double(), rm)
        out["critic/vf_explained_var"] = 1.0 - torch.var(r - v) / (torch.var(r) + 1e-5)
    out.update({"response_length/mean": rlen.mean(), "response_length/max": rlen.max(), "response_length/min": rlen.min(),
                "response_length/clip_ratio": torch.eq(rlen, max_resp).double().mean(),
                "prompt_length/mean": plen.mean(), "prompt_length/max": plen.max(), "prompt_length/min": plen.min(),
                "prompt_length/clip_ratio": torch.eq(plen, max_prompt).double().mean(),
                "response/aborted_ratio": (~live).double().mean()})
    return {k: float(v) for k, v in out.items()}


@pytest.mark.parametrize("use_critic", [False, True])
def test_batch_metrics_are_verls_compute_data_metrics(use_critic):
    b = random_batch(16, 6, 6, seed=3)
    g = torch.Generator().manual_seed(1)
    rm = b.response_mask.float()
    b.token_level_scores = torch.randn(16, 6, generator=g) * rm
    b.token_level_rewards = b.token_level_scores - 0.1 * torch.rand(16, 6, generator=g) * rm  # KL in reward
    b.scores = b.token_level_scores.sum(-1)
    b.acc = (b.scores > 0).float()
    b.returns = torch.randn(16, 6, generator=g) * rm
    if use_critic:
        b.values = b.returns + 0.3 * torch.randn(16, 6, generator=g) * rm
    plan = _Plan(response_width=6, max_prompt_length=6)
    m = batch_metrics(b, plan, entropy={}, kl_coef=0.0)
    want = _verl_data_metrics(b, 6, 6, use_critic)
    for k, v in want.items():
        assert m[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k
    assert not use_critic or "critic/values/mean" in m
    assert use_critic or "critic/values/mean" not in m
    assert m["reward/acc"] == pytest.approx(float(b.acc.mean()))
    assert m["perf/total_num_tokens"] == float(b.attention_mask.sum())
    # the clip ratios bite: some responses / prompts are at the cap of 6 in this batch
    assert 0 < m["response_length/clip_ratio"] < 1 and 0 < m["prompt_length/clip_ratio"] < 1


def test_timing_and_throughput_metrics_are_verls():
    b = random_batch(8, 6, 6, seed=4)
    resp, total = float(b.response_mask.sum()), float(b.attention_mask.sum())
    m = {"timing_s/gen": 2.0, "timing_s/reward": 0.5, "timing_s/ref": 0.25, "timing_s/update_actor": 1.0,
         "timing_s/update_weights": 0.2, "timing_s/step": 4.0}
    out = timing_metrics(m, b, n_gpus=2)
    assert out["timing_per_token_ms/gen"] == pytest.approx(2000.0 / resp)  # generation: per response token
    assert out["timing_per_token_ms/ref"] == pytest.approx(250.0 / total)  # model passes: per token
    assert out["timing_per_token_ms/update_actor"] == pytest.approx(1000.0 / total)
    assert "timing_per_token_ms/reward" not in out and "timing_per_token_ms/update_weights" not in out  # as verl
    assert out["perf/total_num_tokens"] == total and out["perf/time_per_step"] == 4.0
    assert out["perf/throughput"] == pytest.approx(total / (4.0 * 2))


def test_validation_metric_names_and_values():
    # two sources; "a" has 2 prompts x 3 responses, "b" 1 prompt x 3
    per = {("a", 0): ([1.0, 0.0, 1.0], [1.0, 0.0, 1.0]), ("a", 1): ([0.0, 0.0, 0.0], [-1.0, 0.0, 0.5]),
           ("b", 2): ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])}
    m = val_metric_names(per)
    assert m["val-core/a/acc/mean@3"] == pytest.approx(2 / 6)
    assert m["val-aux/a/reward/mean@3"] == pytest.approx((2.0 - 0.5) / 6)
    assert m["val-aux/a/acc/std@3"] == pytest.approx((np.std([1, 0, 1]) + np.std([0, 0, 0])) / 2)
    assert m["val-core/b/acc/mean@3"] == 1.0 and m["val-aux/b/reward/std@3"] == 0.0
    assert val_core_acc(m) == pytest.approx((2 / 6 + 1.0) / 2)
    one = val_metric_names({("s", 0): ([1.0], [0.5]), ("s", 1): ([0.0], [0.0])})
    assert one == {"val-core/s/acc/mean@1": 0.5, "val-aux/s/reward/mean@1": 0.25}  # n = 1: no std, as verl
    assert val_core_acc({"critic/score/mean": 1.0}) is None


# ------------------------------------------------------------------------------------------------
# worker metrics over micro-batches and DP ranks
# ------------------------------------------------------------------------------------------------
def test_reduce_partials_is_the_whole_batch_value():
    """Two DP ranks x two micro-batches of unequal token counts: the token mean is over all tokens
    (a mean of micro-batch means, or rank 0's, is not); loss shares add up to the mini-batch loss."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 5, generator=g, dtype=torch.float64)  # per-token values of 4 micro-batches
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    n_all = int(mask.sum())
    ranks = []
    for d in range(2):
        p = Partials()
        for i in (2 * d, 2 * d + 1):
            mi = mask[i]
            p.add_loss_metrics("actor/", {"clipfrac": x[i][mi].mean(), "ratio_max": x[i][mi].max(),
                                          "ratio_min": x[i][mi].min(), "seq_ratio_mean": x[i, 0]},
                               tokens=mi.sum(), seqs=1)
            p.add("actor/pg_loss", SUM, x[i][mi].sum() / n_all * 2)  # a share x dp_size (LossAgg)
        p.add("actor/grad_norm", MEAN, 3.0)
        ranks.append([p.to_dict()])
    step, per_mb = reduce_partials(ranks, dp_size=2)
    assert step == per_mb[0]
    assert step["actor/clipfrac"] == pytest.approx(float(x[mask].mean()), rel=1e-12)
    assert step["actor/pg_loss"] == pytest.approx(float(x[mask].mean()), rel=1e-12)
    assert step["actor/ratio_max"] == float(x[mask].max()) and step["actor/ratio_min"] == float(x[mask].min())
    assert step["actor/seq_ratio_mean"] == pytest.approx(float(x[:, 0].mean()))  # per sequence, not per token
    assert step["actor/grad_norm"] == 3.0
    mb_means = np.mean([float(x[i][mask[i]].mean()) for i in range(4)])
    assert abs(mb_means - step["actor/clipfrac"]) > 1e-3  # the test bites: micro-batch means differ


def test_reduce_partials_over_mini_batches():
    """Two mini-batches: token means pool every token of the step, losses average the mini-batch
    losses, max/min over everything."""
    def part(vals, tokens, loss):
        p = Partials()
        p.add("k/mean", MEAN, vals, tokens)
        p.add("k/loss", SUM, loss)
        p.add("k/top_max", MAX, vals)
        p.add("k/low_min", MIN, vals)
        return p.to_dict()

    ranks = [[part(1.0, 1, 0.2), part(4.0, 3, 1.0)], [part(3.0, 3, 0.4), part(0.0, 1, 0.6)]]
    step, per_mb = reduce_partials(ranks, dp_size=2)
    assert per_mb[0]["k/mean"] == pytest.approx((1 + 9) / 4) and per_mb[1]["k/mean"] == pytest.approx(12 / 4)
    assert per_mb[0]["k/loss"] == pytest.approx(0.3) and per_mb[1]["k/loss"] == pytest.approx(0.8)
    assert step["k/mean"] == pytest.approx((1 + 12 + 9 + 0) / 8)
    assert step["k/loss"] == pytest.approx(0.55)
    assert step["k/top_max"] == 4.0 and step["k/low_min"] == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_entropy_from_rank_summaries_is_agg_loss_over_the_batch(mode):
    """verl's actor/entropy = agg_loss(entropys, response_mask, loss_agg_mode) over the whole batch;
    here from the DP ranks' summed summaries (reference: agg_loss itself, over the whole batch)."""
    from trainer.algos.losses import LossAgg, agg_loss

    g = torch.Generator().manual_seed(2)
    ent = torch.rand(10, 7, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(10, 7, generator=g) > 0.4
    mask[3] = False  # a row with no valid token
    shards = [slice(0, 3), slice(3, 7), slice(7, 10)]
    sums = {}
    for s in shards:
        for k, v in entropy_summary(ent[s], mask[s]).items():
            sums[k] = sums.get(k, 0.0) + v
    want = float(agg_loss(ent, mask, LossAgg(mode=mode, norm_constant=7.0)))
    assert entropy_from_summary(sums, mode, 7.0) == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------------------------------------
# console and report
# ------------------------------------------------------------------------------------------------
class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_console_eta_excludes_the_first_step_and_mm_kl_is_absolute():
    from trainer.console import ConsoleLog

    clock, out = _Clock(), io.StringIO()
    c = ConsoleLog(10, stream=out, clock=clock, bar=False)
    clock.t = 5.0
    c.log({"val-core/x/acc/mean@1": 0.25}, 0)  # validation before training
    clock.t = 65.0  # step 1: 60 s of compilation / warm-up
    line1 = c.log({"critic/score/mean": 0.5, "mismatch/mismatch_kl": -2e-6, "timing_s/step": 60.0}, 1)
    assert "eta ~9m00s" in line1  # first step only: its own time, marked as an estimate
    assert "mm_kl 2e-06" in line1 and "mm_kl -" not in line1
    for s in range(2, 5):  # steady steps of 10 s
        clock.t += 10.0
        line = c.log({"critic/score/mean": 0.5}, s)
    assert "eta 1m00s" in line  # 6 steps left x 10 s, not (elapsed / steps) x left
    text = out.getvalue()
    assert text.startswith("columns:") and text.count("columns:") == 1 and "mm_kl = |mismatch/mismatch_kl|" in text
    assert "val 0.25" in text.splitlines()[1]


def test_console_resumed_run_eta_counts_from_the_resume():
    from trainer.console import ConsoleLog

    clock = _Clock()
    c = ConsoleLog(100, stream=io.StringIO(), clock=clock, bar=False)
    for s, t in ((51, 30.0), (52, 32.0), (53, 34.0)):  # resumed at step 50
        clock.t = t
        line = c.log({}, s)
    assert "eta 1m34s" in line  # 47 steps x 2 s


def test_console_progress_bar_on_a_terminal():
    from trainer.console import ConsoleLog

    class Tty(io.StringIO):
        def isatty(self):
            return True

    clock, out = _Clock(), Tty()
    c = ConsoleLog(4, stream=out, clock=clock)
    for s in (1, 2, 3):
        clock.t += 10.0
        c.log({"critic/score/mean": 0.5}, s)
    assert c.pbar is not None and c.pbar.n == 3
    c.close()
    text = out.getvalue()
    assert "3/4" in text and "|" in text and "step 3/4" in text


def test_report_has_no_offset_axes_on_flat_series(tmp_path):
    from trainer.report import report_figure, write_report

    hist = [{"step": i, "critic/score/mean": 1.0 + 1e-4 * (i % 2), "val-core/s/acc/mean@1": 0.9999 + 1e-6 * i,
             "actor/entropy": 2.0, "response_length/mean": 5.0} for i in range(1, 8)]
    fig = report_figure(hist)
    fig.canvas.draw()
    for ax in fig.axes:
        assert ax.yaxis.get_major_formatter().get_offset() == "", ax.get_title()
    assert any("held-out" in ax.get_title() and ax.lines for ax in fig.axes)  # val-core acc is plotted
    assert write_report(hist, str(tmp_path)).endswith("report.png")
