"""Rollout-only, dump and train-only replay (trainer/debug.py, trainer.debug.*)."""

import json
import os
from pathlib import Path

import pytest
import torch

from trainer.batch import RolloutBatch
from tests.support.tiny import tiny_config
from trainer.debug import dump_batch, dumped_steps, load_batch, replay_batch

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")


def small_batch():
    b = 3
    return RolloutBatch.from_tokens(
        torch.tensor([[0, 7, 8], [9, 9, 9], [0, 0, 4]]), torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 6]]),
        torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]]), torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]]),
        meta={"ground_truth": ["3", "4", {"a": [1, 2]}], "messages": [[{"role": "user", "content": "hi"}], [], []]},
        rollout_log_probs=torch.randn(b, 3), group_ids=torch.tensor([0, 0, 1]), scores=torch.tensor([1.0, 0.0, 0.5]),
        step_ids=torch.tensor([[0, 0, -1], [0, -1, -1], [0, 1, 1]]))


def test_dump_roundtrip_is_exact(tmp_path):
    b = small_batch()
    dump_batch(b, str(tmp_path), 3)
    back = load_batch(str(tmp_path / "step_000003"))
    assert back.present_fields() == b.present_fields()
    for name in [f for f in b.present_fields() if f != "meta"]:
        x, y = getattr(b, name), getattr(back, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert back.get_meta("ground_truth") == ["3", "4", {"a": [1, 2]}]
    assert back.get_meta("messages")[0] == [{"role": "user", "content": "hi"}]


def test_replay_picks_its_step_else_cycles_and_explains_errors(tmp_path):
    b = small_batch()
    for s in (1, 2):
        b.scores = torch.full((3,), float(s))
        dump_batch(b, str(tmp_path), s)
    assert [os.path.basename(p) for p in dumped_steps(str(tmp_path))] == ["step_000001", "step_000002"]
    assert float(replay_batch(str(tmp_path), 2).scores[0]) == 2.0
    assert float(replay_batch(str(tmp_path), 3).scores[0]) == 1.0  # step 3: no own dump, cycles to the first
    # a half-written dump (no JSON yet) is not picked up; an empty directory is a clear error
    (tmp_path / "step_000009.safetensors").write_bytes(b"partial")
    assert len(dumped_steps(str(tmp_path))) == 2
    with pytest.raises(FileNotFoundError, match="dump_batch_path"):
        replay_batch(str(tmp_path / "empty"), 1)
    (tmp_path / "step_000002.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read the dumped batch"):
        load_batch(str(tmp_path / "step_000002"))


@pytest.fixture(scope="module", autouse=True)
def _ray(shared_ray):
    yield  # one embedded Ray cluster for the module's runs (tests/conftest.py: shared_ray)


BASE = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_response_length=6", f"actor_rollout_ref.model.path={TINY}", "trainer.logger=[console]",
        "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false"]


@pytest.mark.slow
def test_rollout_only_dumps_then_train_only_replays(tmp_path):
    from trainer.main import train

    dump = tmp_path / "dump"
    out = train(tiny_config(BASE + [f"trainer.default_local_dir={tmp_path / 'a'}", "trainer.debug.rollout_only=true",
                                    f"trainer.debug.dump_batch_path={dump}"]))
    h1 = out["history"]
    assert [h["step"] for h in h1] == [1, 2]
    assert not any(k.startswith(("actor/", "timing_s/update", "critic/advantages/")) for h in h1 for k in h)  # nothing was trained
    assert len(dumped_steps(str(dump))) == 2
    out = train(tiny_config(BASE + [f"trainer.default_local_dir={tmp_path / 'b'}", "trainer.debug.train_only=true",
                                    f"trainer.debug.dump_batch_path={dump}"]))
    h2 = out["history"]
    for a, b in zip(h1, h2):
        assert b["critic/score/mean"] == a["critic/score/mean"]  # the same batches, replayed
        assert "actor/pg_loss" in b and "timing_s/gen" in b
    # the replayed batch trains exactly like a live step on the same batch: the loss is a function of it
    assert all(torch.isfinite(torch.tensor(h["actor/pg_loss"])) for h in h2)
