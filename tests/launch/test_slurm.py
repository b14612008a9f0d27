"""``launch/slurm/ray_cluster.sbatch`` under a real Slurm: Debian's slurm-wlm (munged, slurmctld and two
slurmd nodes on this host, ``tests/support/slurm_local.py``).

* ``sbatch --nodes=2`` of the tiny recipe: the template starts Ray on both nodes (waiting on the GCS, not
  sleeping), runs ``recipes/cpu/run_tiny_grpo.sh`` on the head with ``trainer.nnodes=2``; the job
  COMPLETES with exit code 0, its output file says the cluster was ready and the run done, the run
  directory holds the config, the placement over both nodes, a checkpoint and the HF export, and no
  Ray process outlives the job.
* A node whose ``ray start`` never joins: the job FAILS within the template's wait (``RAY_WAIT_S``) with
  a message naming the node that did not join, and leaves nothing behind.

Without Slurm installed the tests skip with the reason, except under CI (``CI=true``), where they fail:
``.ci/run`` installs slurm-wlm.
"""

import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest

from tests.support.ray_nodes import free_port
from tests.support.slurm_local import LocalSlurm, missing

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
SBATCH = "launch/slurm/ray_cluster.sbatch"
RECIPE_ARGS = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=6",
               "trainer.logger=[console,mlflow]", "trainer.test_freq=-1", "trainer.val_before_train=false",
               "trainer.total_training_steps=2", "trainer.save_freq=2"]


@pytest.fixture(scope="module")
def slurm():
    why = missing()
    if why:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI runs the Slurm template test, but {why}. .ci/run installs slurm-wlm with apt-get; "
                        f"see its output for why that failed.")
        pytest.skip(why)
    with LocalSlurm(nodes=2, cpus=2) as s:
        yield s


def job_env(slurm: LocalSlurm, tmp: Path, **extra) -> dict:
    ray_tmp = slurm.path("ray")  # short (Ray's socket paths), and not /tmp/ray: no other ray.init() may find it
    env = slurm.env(N_GPUS_PER_NODE="2", RAY_NUM_GPUS="0", RAY_PORT=str(free_port()), RAY_TMPDIR=ray_tmp,
                    RAY_AUTH_TOKEN_PATH=str(tmp / "ray_token"), RAY_WAIT_S="60", COXSWAIN_DIR=str(ROOT),
                    MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/mlflow.db", RAY_LOG_DIR=str(tmp / "ray-logs"))
    return {**env, **extra}


def sbatch(slurm: LocalSlurm, tmp: Path, env: dict, *args, timeout_s=420) -> tuple[dict, str, float]:
    out = tmp / "job.out"
    t0 = time.monotonic()
    res = slurm.run(["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=2",
                     f"--output={out}", f"--chdir={ROOT}", SBATCH, "recipes/cpu/run_tiny_grpo.sh", "--config", "recipes/cpu/fp32.yaml", *args],
                    env=env, timeout_s=60)
    job = res.stdout.strip().split(";")[0]
    assert job.isdigit(), (res.returncode, res.stdout, res.stderr, slurm.logs())
    while (state := slurm.job_state(job)).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", None):
        assert time.monotonic() - t0 < timeout_s, (state, out.read_text()[-3000:] if out.exists() else "")
        time.sleep(0.5)  # (sbatch --wait polls every 10 s or so)
    took = time.monotonic() - t0
    return state, out.read_text() if out.exists() else "", took


def ray_left(slurm: LocalSlurm) -> list[str]:
    from tests.support.ray_nodes import _cmdline

    return [_cmdline(p)[:100] for p in slurm.own_pids() if "ray" in _cmdline(p).lower()]


def wait_nothing_left(slurm: LocalSlurm, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while ray_left(slurm):
        assert time.monotonic() < deadline, ray_left(slurm)
        time.sleep(0.5)


def test_sbatch_runs_the_recipe_over_two_nodes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    state, log, took = sbatch(slurm, tmp_path, job_env(slurm, tmp_path), *RECIPE_ARGS, f"trainer.default_local_dir={run_dir}")
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (state, log[-4000:])
    assert state["NodeList"] == "cx[1-2]" and state["NumNodes"] == "2"
    assert "ray cluster ready at" in log and "2 of 2 nodes alive" in log, log[-4000:]
    assert "done: 2 steps" in log and "exited with 0" in log
    assert (tmp_path / "ray-logs" / "ray-head-cx1.log").exists() and (tmp_path / "ray-logs" / "ray-worker-cx2.log").exists()
    for f in ("config.yaml", "placement.json", "report.png", "hf_export/model.safetensors",
              "global_step_2/actor", "latest_checkpointed_iteration.txt"):
        assert (run_dir / f).exists(), (f, sorted(p.name for p in run_dir.iterdir()))
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    pm = json.loads((run_dir / "placement.json").read_text())
    assert pm["nnodes"] == 2 and pm["driver"]["is_head"]
    assert len({a["node_id"] for a in pm["groups"]["actor"]}) == 2  # the DP ranks on both Slurm nodes
    assert "127.0.0.2" in {a["ip"] for a in pm["groups"]["actor"]}
    wait_nothing_left(slurm)  # the node daemons ended with the job
    print(f"sbatch: {took:.0f} s")  # job to COMPLETED


def test_a_node_that_does_not_join_fails_the_job_fast_with_its_name(slurm, tmp_path):
    # a `ray` on PATH that hangs for the worker node (as a node that cannot reach the head would); the head starts
    shim = tmp_path / "bin"
    shim.mkdir()
    real = shutil.which("ray")
    (shim / "ray").write_text(f'#!/usr/bin/env bash\ncase " $* " in *" --address="*) exec sleep 600;; esac\n'
                              f'exec "{real}" "$@"\n')
    (shim / "ray").chmod(stat.S_IRWXU)
    env = job_env(slurm, tmp_path, RAY_WAIT_S="10", PATH=f"{shim}:{os.environ['PATH']}")
    state, log, took = sbatch(slurm, tmp_path, env, *RECIPE_ARGS, f"trainer.default_local_dir={tmp_path / 'run'}")
    assert state["JobState"] == "FAILED" and state["ExitCode"] == "1:0", (state, log[-3000:])
    assert "1 of 2 Ray nodes joined" in log and "1 did not: cx2 (127.0.0.2)" in log and "timed out after 10 s" in log, log
    assert "error: not every node joined the Ray cluster" in log
    assert "running recipes/cpu/run_tiny_grpo.sh" not in log  # the recipe never started
    # not held by the hung node (its `ray start` sleeps 600 s): the head's start, the 10 s wait and the teardown.
    # 90 s failed once on a loaded 2-core machine (the head alone is 20-40 s there); 300 s still tells the two apart
    assert took < 300, took
    wait_nothing_left(slurm)
