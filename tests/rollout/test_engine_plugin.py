"""A rollout engine that the package does not know trains a step, named only in the config
(``actor_rollout_ref.rollout.name=plugin_engine:TinyEngine``, tests/rollout/plugin_engine.py): the registry
loads it in the driver (its capabilities: object store only, so the plain engine rollout) and in each rollout
worker, the step's responses are its samples, and the weight syncs into it are verified against its own
checksum of what it holds.

The spec is ``plugin_engine:TinyEngine`` with tests/rollout on PYTHONPATH, as a user's own module would be:
``tests.rollout.plugin_engine`` would not import in a Ray worker here, because an installed wheel (verl's)
ships a top-level ``tests`` package that shadows this directory outside pytest."""

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.support.tiny import tiny_config
from trainer.hf_io import iter_safetensors
from trainer.rollout.engine import checksum_named_tensors

HERE = Path(__file__).resolve().parent
TINY = str(HERE.parents[1] / "recipes" / "cpu" / "tiny_model")
pytestmark = pytest.mark.slow

# one step of the tiny recipe, small: 8 prompts x 4 responses, no evaluation
BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=6",
        f"actor_rollout_ref.model.path={TINY}", "trainer.logger=[console]", "trainer.total_training_steps=1",
        "trainer.test_freq=-1", "trainer.val_before_train=false"]


@pytest.fixture
def plugin_path(monkeypatch):
    """tests/rollout importable in the driver and (through PYTHONPATH, which Ray hands its workers) in the
    workers; Ray started afresh so that its workers see it."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    yield
    if ray.is_initialized():
        ray.shutdown()


def test_a_plugin_engine_named_in_the_config_trains_a_step(tmp_path, plugin_path):
    from trainer.main import train

    log = tmp_path / "engine.jsonl"
    cfg = tiny_config(BASE + ["actor_rollout_ref.rollout.name=plugin_engine:TinyEngine",
                              f"+actor_rollout_ref.rollout.engine_kwargs.log={log}",
                              f"trainer.default_local_dir={tmp_path / 'run'}"])
    out = train(cfg)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    step = out["history"][-1]

    # its generate made the step's batch, in the rollout workers' processes (not the driver's)
    gens = [e for e in events if e["event"] == "generate"]
    assert {e["pid"] for e in events} and os.getpid() not in {e["pid"] for e in events}
    assert sum(e["prompts"] for e in gens) == 8 and sum(e["responses"] for e in gens) == 32
    tokens = sum(e["tokens"] for e in gens)
    assert step["response_length/mean"] == pytest.approx(tokens / 32)

    # the weight syncs went into it, and each was verified against its own checksum: first the checkpoint,
    # after the update the trained weights, which are the run's export
    sums = [e["checksum"] for e in events if e["event"] == "weights_checksum"]
    ignore = {"lm_head.weight"}  # tied embeddings: the engines hold no separate lm_head
    start = checksum_named_tensors(iter_safetensors(TINY, lambda n: n not in ignore))
    export = load_file(os.path.join(out["run_dir"], "hf_export", "model.safetensors"))
    trained = checksum_named_tensors((n, t.float()) for n, t in export.items() if n not in ignore)
    assert sums[0] == start and sums[-1] == trained and trained != start
    n_weights = len([n for n in export if n not in ignore])
    pushed = [e["names"] for e in events if e["event"] == "update_weights"]
    assert sum(pushed) == 2 * n_weights * len({e["pid"] for e in events})  # two full syncs into every engine
    assert step["sync/verified"] == 1.0
