"""The shipped recipes: the 32B DAPO script's CPU twin sets the same keys (values scaled to the tiny
model; the differences are listed) and runs 2 steps through the whole loop on CPU: dynamic sampling,
overlong shaping, rollout IS, packed token-budget micro-batches, recompute and TP=2 with sequence
parallelism, MLflow, and a checkpoint in verl's layout."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIG, TWIN = ROOT / "recipes" / "run_dapo_qwen2.5_32b.sh", ROOT / "recipes" / "cpu" / "run_dapo_tiny.sh"
# lines of the 32B script the twin leaves out (GPU engine settings; data files: the shipped task) and
# the twin's own (the CPU engine's precision, float32 weights, the CPU device is in both)
ONLY_BIG = {"data.train_files", "data.val_files", "actor_rollout_ref.rollout.gpu_memory_utilization",
            "actor_rollout_ref.rollout.enable_chunked_prefill", "actor_rollout_ref.rollout.max_num_batched_tokens"}
ONLY_TWIN = {"actor_rollout_ref.actor.megatron.dtype", "actor_rollout_ref.rollout.dtype"}


def _argv(script: Path, tmp_path: Path) -> list[str]:
    """The script's python argv, recorded by shadowing python / python3 with a shell function."""
    out = tmp_path / f"{script.stem}.json"
    rec = f'command python3 -c "import json,sys; json.dump(sys.argv[1:], open(\'{out}\',\'w\'))" "$@"'
    subprocess.run(["bash", "-c", f"python3() {{ {rec}; }}; python() {{ {rec}; }}; export -f python3 python; bash {script}"],
                   check=True, cwd=tmp_path)
    argv = json.loads(out.read_text())
    assert argv[:2] == ["-m", "trainer.main"]
    return argv[2:]


def test_twin_sets_the_32b_scripts_keys(tmp_path):
    keys = lambda argv: {a.split("=", 1)[0].lstrip("+~") for a in argv}  # noqa: E731
    big, twin = keys(_argv(BIG, tmp_path)), keys(_argv(TWIN, tmp_path))
    assert big - ONLY_BIG == twin - ONLY_TWIN, (sorted((big - ONLY_BIG) ^ (twin - ONLY_TWIN)))


@pytest.mark.slow
def test_twin_runs_two_steps(tmp_path):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db", CKPTS_DIR=str(tmp_path / "run"))
    p = subprocess.run(["bash", str(TWIN), "trainer.total_training_steps=2"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    run = tmp_path / "run"
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "2"  # the last step is saved
    assert (run / "global_step_2" / "actor").is_dir()
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    r = c.search_runs([c.get_experiment_by_name("DAPO").experiment_id])[0]
    assert r.data.params["actor_rollout_ref.actor.megatron.tensor_model_parallel_size"] == "2"
    assert r.data.params["actor_rollout_ref.actor.megatron.sequence_parallel"] == "True"
    m = r.data.metrics
    # dynamic sampling ran (at least one generation batch per step), the IS weights and mismatch metrics
    # were computed from the sampler's log-probs, and the actor trained with clip-higher's bounds
    assert m["filter/gen_batches"] >= 1 and 0 < m["filter/kept_group_fraction"] <= 1
    assert "mismatch/mismatch_kl" in m and "actor/pg_clipfrac" in m and m["actor/grad_norm"] > 0
    assert [x.step for x in c.get_metric_history(r.info.run_id, "actor/pg_loss")] == [1, 2]
