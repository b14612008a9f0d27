"""rollout.mode=server: the loop drives an HTTP fleet (native servers behind the real sglang-router)
instead of Ray rollout workers; weights are pushed to every server and verified per server."""

import math
from pathlib import Path

import pytest

from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")
pytestmark = pytest.mark.slow

BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "data.max_response_length=6", f"actor_rollout_ref.model.path={TINY}", "trainer.logger=[console]",
        "trainer.total_training_steps=2", "trainer.test_freq=2", "data.val_batch_size=64"]


@pytest.fixture(scope="module", autouse=True)
def _ray():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


def test_server_mode_trains_and_matches_the_in_worker_engines_greedy_eval(tmp_path):
    from trainer.main import train

    fleet = train(load_config(BASE + [f"trainer.default_local_dir={tmp_path / 'fleet'}",
                                      "actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.num_engines=2"]))
    h = fleet["history"]
    assert [x["step"] for x in h] == [0, 1, 2]
    assert h[1]["sync/verified"] == 1.0 and h[2]["sync/verified"] == 1.0  # per-server checksums after each update
    assert math.isfinite(h[2]["actor/pg_loss"]) and 0.0 <= h[2]["reward/acc"] <= 1.0
    # the fleet's logs are in the run directory
    assert any((Path(fleet["run_dir"]) / "fleet_logs").glob("router*.log"))
    # greedy eval before training: the same model and prompts through the router as through the
    # in-worker engines, so the same answers
    sync = train(load_config(BASE + [f"trainer.default_local_dir={tmp_path / 'sync'}", "trainer.total_training_steps=1",
                                     "trainer.test_freq=-1"]))
    assert sync["history"][0]["val/acc"] == h[0]["val/acc"]
