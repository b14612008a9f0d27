"""verl's reward managers (naive | prime | dapo | batch) with verl's keyword plumbing, the DAPO overlong
lines of verl's scripts shaping the reward on real generations, and a batch in which every response
fails to score stopping the run with the scorer's traceback."""

import math
import textwrap
from pathlib import Path

import pytest
import torch

from tests.support.tiny import tiny_config
from trainer.rewards.manager import RewardError, RewardManager

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")

SCORERS = textwrap.dedent(
    """
    def per_sample(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0, scale=1.0):
        assert isinstance(extra_info, dict), type(extra_info)
        return {"score": scale * (float(solution_str == ground_truth) + bonus), "seen": solution_str}

    def verl_batch(data_sources, solution_strs, ground_truths, extra_infos, offset=0.0):
        # verl's BatchRewardManager contract: lists in, one score (number or dict) per response out
        n = len(solution_strs)
        return [{"score": float(s == g) + offset, "batch_size": n} if i % 2 else float(s == g) + offset
                for i, (s, g) in enumerate(zip(solution_strs, ground_truths))]

    def short_batch(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0] * (len(solution_strs) - 1)

    def broken(data_source, solution_str, ground_truth, extra_info=None):
        raise KeyError("no_such_field in extra_info")

    def constant(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0
    """
)


@pytest.fixture(scope="module")
def scorers(tmp_path_factory):
    p = tmp_path_factory.mktemp("scorers") / "my_scorers.py"
    p.write_text(SCORERS)
    return str(p)


def ones(b, t=4):
    return torch.ones(b, t, dtype=torch.long)


RESP, GTS = ["a", "b", "c", "d"], ["a", "x", "c", "y"]


@pytest.mark.parametrize("workers", [0, 1])
def test_batch_manager_calls_the_scorer_once_with_lists(scorers, workers):
    """reward_manager=batch: one call for the batch (each dict item reports the batch size it saw),
    reward_model.reward_kwargs reach the scorer, numbers and dicts both accepted; in process and in a worker."""
    with RewardManager(num_workers=workers, custom_path=scorers, custom_name="verl_batch", kind="batch",
                       scorer_kwargs={"offset": 0.5}) as m:
        tls, metrics, ex = m.score(RESP, GTS, ["s"] * 4, None, ones(4))
    assert ex["scores"].tolist() == [1.5, 0.5, 1.5, 0.5]
    assert [d["batch_size"] for d in ex["per_sample"]] == [None, 4, None, 4]
    assert tls[:, -1].tolist() == [1.5, 0.5, 1.5, 0.5] and metrics["reward/errors"] == 0.0


def test_batch_manager_wrong_length_fails_the_batch(scorers):
    m = RewardManager(num_workers=0, custom_path=scorers, custom_name="short_batch", kind="batch")
    with pytest.raises(RewardError, match=r"(?s)all 4 responses.*expected a list of 4, got list of length 3"):
        m.score(RESP, GTS, ["s"] * 4, None, ones(4))


def test_batch_manager_needs_a_scorer():
    with pytest.raises(ValueError, match="custom_reward_function.path"):
        RewardManager(num_workers=0, kind="batch")


def test_scorer_kwargs_are_bound_and_win(scorers):
    """custom_reward_function.reward_kwargs: bound to every call, winning over the call's own keywords
    (verl's _call_with_kwargs); extra_info is a dict even when the row has none."""
    m = RewardManager(num_workers=0, custom_path=scorers, custom_name="per_sample", scorer_kwargs={"bonus": 1.0, "scale": 2.0})
    _, _, ex = m.score(RESP, GTS, ["s"] * 4, [None, {}, {"k": 1}, None], ones(4))
    assert ex["scores"].tolist() == [4.0, 2.0, 4.0, 2.0]


def test_dapo_manager_strips_a_trailing_eos_text(scorers):
    m = RewardManager(num_workers=0, custom_path=scorers, custom_name="per_sample", kind="dapo", eos_token="</s>")
    _, _, ex = m.score(["a</s>", "b"], ["a", "b"], ["s"] * 2, None, ones(2))
    assert [d["seen"] for d in ex["per_sample"]] == ["a", "b"] and ex["scores"].tolist() == [1.0, 1.0]
    naive = RewardManager(num_workers=0, custom_path=scorers, custom_name="per_sample", eos_token="</s>")
    assert naive.score(["a</s>"], ["a"], ["s"], None, ones(1))[2]["scores"].tolist() == [0.0]  # naive keeps the text


def test_all_failed_batch_stops_with_the_first_traceback(scorers):
    """reward_manager=batch-style silent failure of the issue: every call raises. The batch is not
    trained on zeros; the error carries the scorer's own traceback. A partly failed batch is scored
    and reports its error fraction."""
    m = RewardManager(num_workers=1, custom_path=scorers, custom_name="broken")
    try:
        with pytest.raises(RewardError, match=r"(?s)all 3 responses.*sample 0.*KeyError: 'no_such_field in extra_info'"):
            m.score(["a", "b", "c"], ["a"] * 3, ["s"] * 3, None, ones(3))
    finally:
        m.close()
    part = RewardManager(num_workers=0, custom_path=scorers, custom_name="per_sample")
    _, metrics, _ = part.score(["a", "b"], ["a", "b"], ["s"] * 2, [None, "not a dict"], ones(2))
    assert metrics["reward/errors"] == 1.0 and metrics["reward/error_fraction"] == 0.5


def _engine_rollout():
    from trainer.workers.group import WorkerGroup
    from trainer.workers.rollout_worker import RolloutWorker
    from trainer.workers.rollouts import EngineRollout

    grp = WorkerGroup("rollout", RolloutWorker, [dict(model_path=TINY, max_seq_len=128)], in_process=True)
    return EngineRollout(grp, free_cache=False, bucket_bytes=1 << 20, engine_dtype="float32")


def test_verl_dapo_lines_shape_real_generations(scorers):
    """The reward lines of verl's DAPO scripts (reward_manager=dapo, +reward_model.reward_kwargs.
    overlong_buffer_cfg.*, +reward_model.reward_kwargs.max_resp_len) on the tiny model's own samples:
    each response's score is its scorer value plus min(-(L - (max_resp_len - len)) / len * factor, 0)
    in float64 from its token length L, placed on its last token, with verl's log metrics."""
    from transformers import AutoTokenizer

    from trainer.data.dataset import build_dataset
    from trainer.hf_io import stop_token_ids
    from trainer.generation import generate_scored
    from trainer.plan import Plan

    lines = ["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
             "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
             "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
             "+reward_model.reward_kwargs.overlong_buffer_cfg.log=True", "+reward_model.reward_kwargs.max_resp_len=7",
             f"custom_reward_function.path={scorers}", "custom_reward_function.name=constant",
             f"actor_rollout_ref.model.path={TINY}", "reward_model.num_workers=0", "actor_rollout_ref.rollout.n=4"]
    cfg = tiny_config(lines)
    tok = AutoTokenizer.from_pretrained(TINY)
    plan = Plan.from_config(cfg, total_steps=1, stop_token_ids=stop_token_ids(TINY, tok))
    assert plan.overlong == {"enable": True, "len": 4, "penalty_factor": 0.5, "log": True, "max_resp_len": 7}
    ds = build_dataset(cfg.data, tok, "train")
    items = [ds[i] for i in range(6)]
    params = plan.sampling.params(0, 0)
    assert params["max_new_tokens"] == 8  # the sampling budget (data.max_response_length), not max_resp_len
    mgr = RewardManager.from_config(cfg, tok)
    batch, m = generate_scored(_engine_rollout(), mgr, tok, items, list(range(6)), params,
                               max_prompt_length=cfg.data.max_prompt_length, overlong=plan.overlong)
    L = batch.response_length.tolist()
    assert len(set(L)) > 1, L  # stop tokens: lengths differ, so the penalty varies
    want = [1.0 + min(-(n - (7 - 4)) / 4 * 0.5, 0.0) for n in L]
    assert batch.scores.tolist() == pytest.approx(want, abs=1e-6)
    for i, n in enumerate(L):
        assert batch.token_level_scores[i, n - 1].item() == pytest.approx(want[i], abs=1e-6)
        assert batch.token_level_scores[i].abs().sum().item() == pytest.approx(abs(want[i]), abs=1e-6)
    pens = [w - 1.0 for w in want]
    assert m["reward/overlong_reward_mean"] == pytest.approx(math.fsum(pens) / len(pens), abs=1e-6)
    assert m["reward/overlong_fraction"] == pytest.approx(sum(p < 0 for p in pens) / len(pens))
