"""Tests for trainer.algos.filtering: DAPO group filter (golden, loop reference, properties), filter
metric selection, overlong reward shaping (golden)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.algos.filtering import group_filter, overlong_reward_penalty, select_filter_metric


def ref_group_filter(values, index):
    """verl's DAPO loop: keep a uid's trajectories when np.std(vals) > 0 or the group has one member."""
    groups = {}
    for v, u in zip(values.tolist(), index.tolist()):
        groups.setdefault(u, []).append(v)
    with np.errstate(invalid="ignore"):  # np.std of a group holding inf is NaN (and warns)
        keep = {u for u, vals in groups.items() if np.std(vals) > 0 or len(vals) == 1}
    return [i for i, u in enumerate(index.tolist()) if u in keep], len(keep), len(groups)


def test_group_filter_golden():
    # groups (by index):  0: [1, 1] constant -> drop;  1: [0, 1] -> keep (samples 2, 3)
    #                     2: [.5, .5, .5] constant -> drop;  3: [7] singleton -> keep (sample 7)
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 7.0])
    index = torch.tensor([0, 0, 1, 1, 2, 2, 2, 3])
    kept, met = group_filter(values, index)
    assert kept.tolist() == [2, 3, 7] and kept.dtype == torch.long
    assert met == {"filter/kept_groups": 2.0, "filter/total_groups": 4.0, "filter/kept_fraction": 0.5, "filter/kept_samples": 3.0}


def test_group_filter_interleaved_ids_bool_and_nonfinite():
    # ids need not be contiguous nor sorted; a bool metric (acc) works
    acc = torch.tensor([True, False, True, True, False, False])
    uid = torch.tensor([10, 42, 10, 42, 99, 99])  # 10: [T, T] drop, 42: [F, T] keep, 99: [F, F] drop
    kept, met = group_filter(acc, uid)
    assert kept.tolist() == [1, 3] and met["filter/kept_groups"] == 1.0
    # NaN / inf in a group: np.std is NaN there, so verl drops it (unless it is a singleton)
    v = torch.tensor([float("nan"), 1.0, 2.0, float("inf"), float("nan"), 3.0, 4.0])
    i = torch.tensor([0, 0, 1, 1, 2, 3, 3])
    kept, _ = group_filter(v, i)
    want, _, _ = ref_group_filter(v, i)
    assert kept.tolist() == want == [4, 5, 6]


def test_group_filter_errors_and_empty():
    with pytest.raises(ValueError, match=r"\[B\]"):
        group_filter(torch.zeros(3, 2), torch.zeros(3))
    kept, met = group_filter(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert kept.numel() == 0 and met["filter/total_groups"] == 0.0


def test_group_filter_matches_loop_reference():
    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, 40, (300,), generator=g)
    values = torch.randint(0, 2, (300,), generator=g).float()  # 0/1 rewards: many constant groups
    kept, met = group_filter(values, index)
    want, n_keep, n_groups = ref_group_filter(values, index)
    assert kept.tolist() == want
    assert met["filter/kept_groups"] == n_keep and met["filter/total_groups"] == n_groups


@settings(max_examples=100, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(0, 6), st.sampled_from([0.0, 0.5, 1.0, -2.0])), min_size=1, max_size=40)
)
def test_prop_filter_drops_constant_groups_keeps_whole_groups(data):
    index = torch.tensor([u for u, _ in data])
    values = torch.tensor([v for _, v in data])
    kept, met = group_filter(values, index)
    kept_set = set(kept.tolist())
    for u in set(index.tolist()):
        members = [i for i in range(len(data)) if int(index[i]) == u]
        vals = {float(values[i]) for i in members}
        inside = [i in kept_set for i in members]
        assert all(inside) or not any(inside)  # whole groups only
        assert all(inside) == (len(vals) > 1 or len(members) == 1)  # constant groups (of 2+) dropped
    assert kept.tolist() == sorted(kept_set)
    assert met["filter/kept_fraction"] == met["filter/kept_groups"] / met["filter/total_groups"]


def test_select_filter_metric():
    scores = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 2.0]])  # token_level_scores: reward on the last token
    rewards = torch.tensor([[0.9, -0.1, 0.0], [0.0, -0.2, 1.5]])  # after KL / shaping
    fields = {"token_level_scores": scores, "token_level_rewards": rewards, "acc": np.array([True, False]), "score": [1.0, 2.0]}
    # verl's DAPO trainer: seq_reward = sum of token_level_scores, seq_final_reward = sum of token_level_rewards
    assert select_filter_metric("seq_reward", fields).tolist() == [1.0, 2.0]
    torch.testing.assert_close(select_filter_metric("seq_final_reward", fields), torch.tensor([0.8, 1.3]))
    assert select_filter_metric("acc", fields).tolist() == [True, False]
    assert select_filter_metric("score", fields).tolist() == [1.0, 2.0]
    with pytest.raises(KeyError, match=r"'pass_rate'.*available fields: \['acc', 'score', 'token_level_rewards', 'token_level_scores'\]"):
        select_filter_metric("pass_rate", fields)
    with pytest.raises(KeyError, match="sum of 'token_level_scores'"):
        select_filter_metric("seq_reward", {"acc": [1]})
    with pytest.raises(ValueError, match="one value per sample"):
        select_filter_metric("token_level_scores", fields)


def test_overlong_penalty_golden():
    # max_len 20, buffer 4 -> expected length 16; penalty = min(-(L - 16) / 4 * factor, 0)
    # L = 10 -> +1.5 clipped to 0;  16 -> 0;  18 -> -2/4 = -0.5;  19 -> -0.75;  20 -> -1
    L = torch.tensor([10, 16, 18, 19, 20])
    got = overlong_reward_penalty(L, max_response_length=20, overlong_buffer_len=4, penalty_factor=1.0)
    assert got.tolist() == [0.0, 0.0, -0.5, -0.75, -1.0]
    # factor 0.5 halves it: L = 18 -> -0.25
    got = overlong_reward_penalty(L, max_response_length=20, overlong_buffer_len=4, penalty_factor=0.5)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.375, -0.5]
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_reward_penalty(L, max_response_length=20, overlong_buffer_len=0, penalty_factor=1.0)
    with pytest.raises(ValueError, match="max_response_length"):
        overlong_reward_penalty(L, max_response_length=3, overlong_buffer_len=4, penalty_factor=1.0)


@settings(max_examples=50, deadline=None)
@given(max_len=st.integers(2, 4096), data=st.data())
def test_prop_overlong_penalty_matches_formula(max_len, data):
    buf = data.draw(st.integers(1, max_len))
    factor = data.draw(st.floats(0.0, 5.0))
    lens = data.draw(st.lists(st.integers(0, max_len), min_size=1, max_size=20))
    got = overlong_reward_penalty(torch.tensor(lens), max_response_length=max_len, overlong_buffer_len=buf, penalty_factor=factor)
    for L, p in zip(lens, got.tolist()):
        want = min(-(L - (max_len - buf)) / buf * factor, 0.0)
        assert p == pytest.approx(want, rel=1e-6, abs=1e-6)
        assert -factor - 1e-6 <= p <= 0.0
