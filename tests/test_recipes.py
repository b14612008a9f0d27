"""The shipped recipes: each large-scale DAPO script (Qwen2.5-32B dense; Qwen3-30B-A3B mixture of
experts) resolves as written, and its CPU twin, which runs that very script at a tiny model's size with
the CPU-only lines overridden, runs 2 steps through the whole loop: dynamic sampling, overlong shaping,
rollout IS, packed token-budget micro-batches, recompute, TP=2 with sequence parallelism (dense) or
experts over 2 ranks (MoE), MLflow, and a checkpoint in verl's layout."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIG, TWIN = ROOT / "recipes" / "run_dapo_qwen2.5_32b.sh", ROOT / "recipes" / "cpu" / "run_dapo_tiny.sh"
MOE_BIG, MOE_TWIN = ROOT / "recipes" / "run_dapo_qwen3_30b_a3b.sh", ROOT / "recipes" / "cpu" / "run_dapo_moe_tiny.sh"
PAIRS = {"dense": (BIG, TWIN), "moe": (MOE_BIG, MOE_TWIN)}
def _argv(script: Path, tmp_path: Path) -> list[str]:
    """The script's python argv, recorded by shadowing python / python3 with a shell function."""
    out = tmp_path / f"{script.stem}.json"
    rec = f'command python3 -c "import json,sys; json.dump(sys.argv[1:], open(\'{out}\',\'w\'))" "$@"'
    subprocess.run(["bash", "-c", f"python3() {{ {rec}; }}; python() {{ {rec}; }}; export -f python3 python; bash {script}"],
                   check=True, cwd=tmp_path)
    argv = json.loads(out.read_text())
    assert argv[:2] == ["-m", "trainer.main"]
    return argv[2:]


@pytest.mark.parametrize("kind", list(PAIRS))
def test_big_script_resolves_and_its_twin_runs_it(tmp_path, kind):
    from trainer.config import load_config

    big_script, twin_script = PAIRS[kind]
    big_argv = _argv(big_script, tmp_path)
    cfg = load_config(big_argv)  # the GPU recipe resolves here (only a run checks the hardware)
    # the twin's argv is the big script's, every line of it, followed by its CPU overrides
    twin_argv = _argv(twin_script, tmp_path)
    assert [a.split("=", 1)[0] for a in twin_argv[:len(big_argv)]] == [a.split("=", 1)[0] for a in big_argv]
    assert len(twin_argv) > len(big_argv)
    if kind == "moe":
        assert cfg.actor_rollout_ref.actor.megatron.expert_model_parallel_size == 8
        assert cfg.reward_model.reward_kwargs.overlong_buffer_cfg.len == 4096


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


@pytest.mark.slow
def test_moe_twin_runs_two_steps(tmp_path):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db", CKPTS_DIR=str(tmp_path / "run"))
    p = subprocess.run(["bash", str(MOE_TWIN), "trainer.total_training_steps=2"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    run = tmp_path / "run"
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    r = c.search_runs([c.get_experiment_by_name("DAPO-MoE").experiment_id])[0]
    assert r.data.params["actor_rollout_ref.actor.megatron.expert_model_parallel_size"] == "2"
    m = r.data.metrics
    assert m["actor/grad_norm"] > 0 and m["sync/verified"] == 1.0
    assert [x.step for x in c.get_metric_history(r.info.run_id, "actor/pg_loss")] == [1, 2]
    # the trained MoE exports as a HF Qwen3-MoE checkpoint that transformers loads
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(run / "hf_export")
    assert hf.config.model_type == "qwen3_moe"
