"""``launch/k8s/raycluster.yaml`` (a KubeRay RayJob) checked against the code it launches:

* it parses, and is a ``ray.io/v1`` RayJob whose entrypoint is ``bash RECIPE trainer.nnodes=N
  trainer.n_gpus_per_node=G``: the form the Slurm template and the multi-node test run;
* its head and worker pods start with ``ray start`` flags that exist (``rayStartParams`` are passed to
  ``ray start`` by KubeRay; checked against Ray's own CLI), as the multi-node test's nodes do;
* the resources agree: N worker replicas with G GPUs each (``num-gpus`` = ``nvidia.com/gpu``), a head
  without GPUs (no rank lands there, so ``trainer.nnodes`` counts the workers);
* the recipe, resolved with the entrypoint's overrides and the job's environment (``--print-config``, the
  real command line), has those N and G, tensor-parallel groups that fit one node (the placement rule of
  ``trainer.workers.cluster.check_node_layout``), an MLflow logger with ``MLFLOW_TRACKING_URI`` in the
  job's environment, and its model, data and checkpoint paths on the volume every pod mounts;
* no pod sets ``RAY_ADDRESS`` (Ray's job supervisor gives the driver its cluster's address).
"""

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "launch" / "k8s" / "raycluster.yaml"


@pytest.fixture(scope="module")
def job():
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    assert len(docs) == 1
    return docs[0]


def containers(pod_group):
    return pod_group["template"]["spec"]["containers"]


def overrides(job) -> tuple[str, dict]:
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "bash" and (ROOT / argv[1]).is_file(), argv
    return argv[1], dict(a.split("=", 1) for a in argv[2:])


def test_a_rayjob_running_a_recipe(job):
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    recipe, ov = overrides(job)
    assert recipe.startswith("recipes/") and {"trainer.nnodes", "trainer.n_gpus_per_node"} <= set(ov)
    # the same entrypoint form as launch/slurm/ray_cluster.sbatch's driver step
    sbatch = (ROOT / "launch" / "slurm" / "ray_cluster.sbatch").read_text()
    assert 'bash "$RECIPE" trainer.nnodes=' in sbatch and "trainer.n_gpus_per_node=" in sbatch


def test_ray_start_params_are_ray_start_flags(job):
    from ray.scripts.scripts import start

    flags = {o.lstrip("-") for p in start.params for o in p.opts}
    spec = job["spec"]["rayClusterSpec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        unknown = set(group["rayStartParams"]) - flags
        assert not unknown, unknown
    # the multi-node test starts its nodes with the same slot flags
    nodes_src = (ROOT / "tests" / "support" / "ray_nodes.py").read_text()
    assert '"--num-cpus"' in nodes_src and '"start", "--head"' in nodes_src and '"start", "--address"' in nodes_src


def test_resources_match_the_entrypoint(job):
    _, ov = overrides(job)
    nnodes, per_node = int(ov["trainer.nnodes"]), int(ov["trainer.n_gpus_per_node"])
    spec = job["spec"]["rayClusterSpec"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    gpu_groups = [g for g in spec["workerGroupSpecs"] if int(g["rayStartParams"].get("num-gpus", 0)) > 0]
    assert sum(g["replicas"] for g in gpu_groups) == nnodes
    for g in gpu_groups:
        assert g.get("minReplicas", g["replicas"]) == g["replicas"] == g.get("maxReplicas", g["replicas"])
        assert int(g["rayStartParams"]["num-gpus"]) == per_node
        (c,) = containers(g)
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == per_node
        assert int(g["rayStartParams"]["num-cpus"]) <= int(c["resources"]["limits"]["cpu"])
    for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        for c in containers(g):
            assert "RAY_ADDRESS" not in {e["name"] for e in c.get("env", [])}


def test_the_recipe_resolves_consistently_with_the_manifest(job, tmp_path):
    from omegaconf import OmegaConf

    from trainer.workers.cluster import check_node_layout

    recipe, ov = overrides(job)
    env_vars = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env_vars["MLFLOW_TRACKING_URI"].startswith(("http://", "https://"))
    # every path the recipe reads or writes is on the volume all pods mount
    spec = job["spec"]["rayClusterSpec"]
    mounts = [{m["mountPath"] for c in containers(g) for m in c.get("volumeMounts", [])}
              for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]]
    shared = set.intersection(*mounts) - {"/dev/shm"}
    for k in ("MODEL_PATH", "TRAIN_FILE", "TEST_FILE", "CKPTS_DIR"):
        assert any(env_vars[k].startswith(m + "/") for m in shared), (k, env_vars[k], shared)
    env = {**os.environ, **env_vars, "CKPTS_DIR": str(tmp_path)}  # resolve here, writing the config to tmp
    out = subprocess.run(["bash", recipe, *(f"{k}={v}" for k, v in ov.items()), "--print-config"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = OmegaConf.load(tmp_path / "config.yaml")
    assert cfg.trainer.nnodes == int(ov["trainer.nnodes"]) and cfg.trainer.n_gpus_per_node == int(ov["trainer.n_gpus_per_node"])
    assert cfg.trainer.device == "cuda" and "mlflow" in cfg.trainer.logger
    assert cfg.actor_rollout_ref.model.path == env_vars["MODEL_PATH"] and cfg.trainer.default_local_dir == str(tmp_path)
    check_node_layout(cfg)  # TP groups within a node
    assert cfg.trainer.resume_mode == "auto"  # a restarted job continues from its newest checkpoint
