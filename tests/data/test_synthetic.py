"""The shipped synthetic arithmetic task: determinism, disjoint splits, verl rows, scorer agreement."""

import pyarrow.parquet as pq
import pytest

from trainer.data import synthetic
from trainer.data.dataset import check_row
from trainer.rewards.scorers import arith_score, compute_score


def test_deterministic_under_seed_and_seed_matters():
    a = synthetic.make_rows(200, "train", seed=5)
    b = synthetic.make_rows(200, "train", seed=5)
    c = synthetic.make_rows(200, "train", seed=6)
    assert a == b
    assert [r["prompt"] for r in a] != [r["prompt"] for r in c]


def test_splits_never_overlap_whatever_the_seed():
    # The split is a hash of the problem text, so a train set from one seed and a held-out set from
    # another still share nothing.
    train = {r["prompt"][0]["content"] for r in synthetic.make_rows(3000, "train", seed=1)}
    test = {r["prompt"][0]["content"] for r in synthetic.make_rows(500, "test", seed=2)}
    assert len(train) == 3000 and len(test) == 500
    assert train.isdisjoint(test)


def test_test_split_does_not_depend_on_train_size():
    assert synthetic.make_rows(50, "test", seed=0) == synthetic.make_rows(50, "test", seed=0)


def test_rows_are_valid_verl_rows_and_ground_truth_is_the_arithmetic():
    for r in synthetic.make_rows(300, "train", seed=0, ops=("+", "-", "*"), min_digits=1, max_digits=3):
        check_row(r)  # raises on a malformed row
        e = r["extra_info"]
        content = r["prompt"][0]["content"]
        assert content == f"{e['a']}{e['op']}{e['b']}="
        # independent recomputation: Python's own arithmetic on the operands
        expect = {"+": e["a"] + e["b"], "-": e["a"] - e["b"], "*": e["a"] * e["b"]}[e["op"]]
        assert r["reward_model"]["ground_truth"] == str(expect)
        assert r["data_source"] == "coxswain/arith"
        # the dispatch routes the row to the arithmetic scorer, which accepts the true answer
        assert compute_score(r["data_source"], f" {expect} and more", r["reward_model"]["ground_truth"])["score"] == 1.0
        assert arith_score(str(expect + 1), r["reward_model"]["ground_truth"])["score"] == 0.0


def test_digits_respected():
    for r in synthetic.make_rows(100, "train", seed=0, ops=("+",), min_digits=3, max_digits=3):
        e = r["extra_info"]
        assert 100 <= e["a"] <= 999 and 100 <= e["b"] <= 999


def test_asking_for_more_problems_than_exist_is_a_clear_error():
    with pytest.raises(ValueError, match="only about"):
        synthetic.make_rows(100, "test", ops=("+",), min_digits=1, max_digits=1)  # 100 problems, ~10 held out


def test_write_parquet_round_trip(tmp_path):
    tr, te = synthetic.write(str(tmp_path), n_train=64, n_test=16, seed=3)
    assert pq.read_table(tr).to_pylist() == synthetic.make_rows(64, "train", seed=3)
    assert pq.read_table(te).num_rows == 16
