"""rollout.mode=server: the loop drives an HTTP fleet (native servers behind the real sglang-router)
instead of Ray rollout workers; weights are pushed to every server and verified per server."""

import math
from pathlib import Path

import pytest

from tests.support.tiny import tiny_config
from trainer.generation import val_core_acc

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")
pytestmark = pytest.mark.slow

BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "data.max_response_length=6", f"actor_rollout_ref.model.path={TINY}", "trainer.logger=[console]",
        "trainer.total_training_steps=2", "trainer.test_freq=2", "data.val_batch_size=64"]


@pytest.fixture(scope="module", autouse=True)
def _ray(shared_ray):
    yield  # one embedded Ray cluster for the module's runs (tests/conftest.py: shared_ray)


def test_server_mode_trains_and_matches_the_in_worker_engines_greedy_eval(tmp_path):
    from trainer.main import train

    fleet = train(tiny_config(BASE + [f"trainer.default_local_dir={tmp_path / 'fleet'}",
                                      "actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.num_engines=1"]))
    h = fleet["history"]
    assert [x["step"] for x in h] == [0, 1, 2]
    assert h[1]["sync/verified"] == 1.0 and h[2]["sync/verified"] == 1.0  # per-server checksums after each update
    assert math.isfinite(h[2]["actor/pg_loss"]) and 0.0 <= h[2]["reward/acc"] <= 1.0
    # the fleet's logs are in the run directory
    assert any((Path(fleet["run_dir"]) / "fleet_logs").glob("router*.log"))
    # greedy eval before training: the same model and prompts through the router as through the
    # in-worker engines, so the same answers
    sync = train(tiny_config(BASE + [f"trainer.default_local_dir={tmp_path / 'sync'}", "trainer.total_training_steps=1",
                                     "trainer.test_freq=-1"]))
    assert val_core_acc(sync["history"][0]) == val_core_acc(h[0]) is not None


def test_multi_turn_through_the_fleet_equals_the_in_worker_agent_loop(tmp_path):
    """The agent loop on the driver over the router (FleetRollout) and inside a rollout worker over its
    own engine: per-turn seeds are sent as they are, so the episodes are the same token for token."""
    from trainer.envs import task_maker
    from trainer.workers.rollouts import FleetRollout
    from trainer.workers.rollout_worker import RolloutWorker

    agent = str(ROOT / "recipes" / "cpu" / "tiny_agent_model")
    tasks = task_maker("hanoi")(3, seed=0)
    params = dict(n=2, temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=16, stop_token_ids=[2], seed=11)
    mt = dict(environment="hanoi", max_assistant_turns=3, max_user_turns=3, max_tokens_per_trajectory=512,
              concurrency=4, max_response_length=160)
    local = RolloutWorker(model_path=agent, max_batch_size=16, max_seq_len=512).generate_multi_turn(tasks, params, mt)
    fleet = FleetRollout(agent, num_servers=2, threads_per_server=1, max_batch_size=16, max_seq_len=512,
                         dtype="float32", tokenizer_path=None, log_dir=str(tmp_path / "logs"))
    try:
        remote = fleet.play(tasks, params, mt)
        # the Rollout protocol's view of the fleet: one checksum per server, all the same start weights
        sums = fleet.engine_checksums()
        assert len(sums) == 2 and len(set(sums)) == 1 and len(set(fleet.pids())) == 2
    finally:
        fleet.shutdown()
    assert len(local) == len(remote) == 6
    assert sum(t.num_turns for t in local) > 6  # multi-turn episodes, not one turn each
    for a, b in zip(local, remote):
        assert a.response_ids == b.response_ids and a.loss_mask == b.loss_mask and a.step_ids == b.step_ids
        assert a.messages == b.messages and a.finish_reason == b.finish_reason
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-5
