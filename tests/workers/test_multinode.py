"""Coxswain on a Ray cluster of two nodes (two raylets on this machine, 2 CPU slots each: see
``tests/support/ray_nodes.py``), with ``trainer.nnodes=2 trainer.n_gpus_per_node=2``: the actor at TP=2 x DP=2 and
four colocated engines (not hybrid: each engine is its own process, so the weight sync crosses nodes
through the object store, by reference).

* Placement: each TP pair on one node, the two DP replicas on different nodes, engine i on actor rank
  i's node, torch.distributed's rendezvous at rank 0's node IP, the driver on the head node.
* A worker node's raylet SIGKILLed inside step 2: the run stops within a bounded time with an error
  naming the node and the step, leaves no process behind, and once the node is back
  ``trainer.resume_mode=auto`` finishes the run.
* That run (step 1 before the loss, step 2 after the resume) equals the same run on one node (an embedded cluster,
  ``nnodes=1 n_gpus_per_node=4``): the same metrics every step, the same bytes through the driver, the same
  exported weights, to 1e-6 (the two worlds reduce in another order). The bit-for-bit resume against an
  uninterrupted run is tests/test_controller.py's.
  (A SIGKILLed driver's resume is the same code on one node or several: tests/test_controller.py's; this
  module keeps the failure only a cluster has, one run fewer for the suite.)

* ``rollout.mode=server``: the HTTP servers on other nodes than the trainer; one server node's raylet
  SIGKILLed mid-step: the fleet drops that server, retries its requests on the other, and the run finishes.

One cluster serves the module; every run is a separate driver process (``bash recipes/cpu/run_tiny_grpo.sh``).
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.ray_nodes import RayNodes, _cmdline
from tests.support.tiny import UNHURRIED, checkpoint_history, stable_history

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

STEPS = 2
BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=6",
        "trainer.logger=[console]", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "actor_rollout_ref.hybrid_engine=false",
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", *UNHURRIED]
MULTI = ["trainer.nnodes=2", "trainer.n_gpus_per_node=2"]
SINGLE = ["trainer.nnodes=1", "trainer.n_gpus_per_node=4"]
WORKER_TITLES = ("ray::TrainWorker", "ray::RolloutWorker", "ray::HybridWorker")


def driver(args, env, log) -> subprocess.Popen:
    """The recipe script, as the Slurm template and the KubeRay entrypoint run it, in its own session."""
    return subprocess.Popen(["bash", "recipes/cpu/run_tiny_grpo.sh", "--config", "recipes/cpu/fp32.yaml", *args], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def tail(text: str, n: int = 4000) -> str:
    """The end of a driver's log without the lines Ray copies from a dying raylet's own log (its state dumps
    run to hundreds of lines and would push the driver's error out of a failure message)."""
    keep = [ln for ln in text.splitlines() if "(raylet)" not in ln and "[state-dump]" not in ln]
    return "\n".join(keep)[-n:]


def run_to_end(args, env, log_path, timeout=420) -> str:
    with open(log_path, "w") as log:
        rc = driver(args, env, log).wait(timeout)
    text = Path(log_path).read_text()
    assert rc == 0, tail(text)
    return text


def kill_after_checkpoint(p: subprocess.Popen, run_dir: Path, log_path: Path, step: int = 1) -> None:
    """Wait until checkpoint ``step`` is complete (the driver is then inside step ``step + 1``)."""
    latest, t0 = run_dir / "latest_checkpointed_iteration.txt", time.time()
    while not (latest.exists() and latest.read_text().strip() == str(step)):
        assert p.poll() is None and time.time() - t0 < 420, tail(log_path.read_text())
        time.sleep(0.05)


def assert_same_history(a, b):
    """The same steps and metrics (histories without the timings), to 1e-6: one node's and two nodes' worlds
    reduce in another order."""
    assert [h["step"] for h in a] == [h["step"] for h in b] == list(range(1, STEPS + 1))
    for ha, hb in zip(a, b):
        assert ha.keys() == hb.keys(), set(ha) ^ set(hb)
        for k in ha:
            assert hb[k] == pytest.approx(ha[k], rel=1e-6, abs=1e-9), (ha["step"], k, ha[k], hb[k])


def weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "hf_export" / "model.safetensors"))


def job_workers(nodes: RayNodes) -> list[tuple[int, str]]:
    """The cluster's processes that are a run's workers (Ray's own daemons and idle workers excluded)."""
    return [(p, _cmdline(p)[:60]) for p in nodes.own_pids() if _cmdline(p).startswith(WORKER_TITLES)]


def wait_no_workers(nodes: RayNodes, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while job_workers(nodes):
        assert time.monotonic() < deadline, f"workers left behind: {job_workers(nodes)}"
        time.sleep(0.25)


def session_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def nodes():
    with RayNodes(workers=1, cpus=2) as c:
        yield c


@pytest.fixture(scope="module")
def runs(nodes, tmp_path_factory):
    """The run on one node (an embedded Ray cluster), and the same run on the two-node cluster whose worker node's
    raylet is SIGKILLed inside step 2 and which, once the node is back, resumes to its end (``lost``: what the
    loss did, for the test that asserts on it). One multi-node run serves the placement, the equality with one
    node and the lost node's resume (an uninterrupted multi-node run as well was one more two-node run: this fixture's
two runs took 216 s in a loaded -n 2 run of the suite)."""
    d = tmp_path_factory.mktemp("multinode")
    single_env = {k: v for k, v in nodes.base_env().items() if not k.startswith("RAY_AUTH")}
    run_to_end(BASE + SINGLE + [f"trainer.default_local_dir={d / 'single'}"], single_env, d / "single.log")
    multi, log_path = d / "multi", d / "lost.log"
    args = BASE + MULTI + [f"trainer.default_local_dir={multi}"]
    with open(log_path, "w") as log:
        p = driver(args, nodes.env(), log)
        kill_after_checkpoint(p, multi, log_path)
        t0 = time.monotonic()
        nodes.kill_node(1)  # node 127.0.0.2: actor ranks 2-3 and engines 2-3 go with it
        rc = p.wait(120)
        took = time.monotonic() - t0
    wait_no_workers(nodes)  # nothing left on the surviving head node
    deadline = time.monotonic() + 15  # nor of the driver's own processes (scorer pool: they watch their parent)
    while not session_gone(p.pid):
        assert time.monotonic() < deadline, subprocess.run(["ps", "-o", "pid,args", "-g", str(p.pid)],
                                                           capture_output=True, text=True).stdout
        time.sleep(0.2)
    print(f"node lost -> driver exited in {took:.1f} s")
    lost = {"rc": rc, "took": took, "log": log_path.read_text()}
    nodes.add_node(1)  # the node is back (a new Ray node id, the same address)
    lost["resume_log"] = run_to_end(args + ["trainer.resume_mode=auto"], nodes.env(), d / "lost_resume.log")
    return d, lost


def test_placement_follows_the_nodes(nodes, runs):
    import json

    runs, _ = runs
    pm = json.loads((runs / "multi" / "placement.json").read_text())  # the resumed run's, on the node that came back
    head = next(n for n in nodes.nodes() if n["head"] and n["alive"])
    assert pm["driver"]["is_head"] and pm["driver"]["node_id"] == head["node_id"]
    actor = pm["groups"]["actor"]
    assert [a["rank"] for a in actor] == [0, 1, 2, 3] and {a["tp_size"] for a in actor} == {2}
    tp_groups = {}
    for a in actor:
        tp_groups.setdefault(a["dp_rank"], set()).add(a["node_id"])
    assert all(len(s) == 1 for s in tp_groups.values()), tp_groups  # a TP group never spans nodes
    assert len({next(iter(s)) for s in tp_groups.values()}) == 2  # the DP replicas are on both nodes
    assert {a["ip"] for a in actor} == {head["ip"], "127.0.0.2"}
    assert actor[0]["node_id"] == head["node_id"]  # rank 0 next to the driver
    assert pm["rendezvous"]["actor"].rsplit(":", 1)[0] == actor[0]["ip"]  # the rendezvous on rank 0's node
    engines = pm["groups"]["rollout"]
    assert [e["node_id"] for e in engines] == [a["node_id"] for a in actor]  # each engine on its actor rank's node
    single = json.loads((runs / "single" / "placement.json").read_text())
    assert len({a["node_id"] for a in single["groups"]["actor"]}) == 1 and single["rendezvous"]["actor"].startswith("127.0.0.1:")


def test_a_lost_node_stops_the_run_with_its_name_then_resume_continues(runs):
    _, lost = runs
    err = [ln for ln in lost["log"].splitlines() if ln.startswith("error during")]
    assert lost["rc"] == 1 and err, tail(lost["log"])
    assert lost["took"] < 90, lost["took"]  # Ray's node-failure detection (~15 s) plus teardown, not a hang
    assert f"error during step 2 of {STEPS}" in err[0] and "node 127.0.0.2" in err[0] and "left the Ray cluster" in err[0], err
    assert "trainer.resume_mode=auto" in err[0] and "global_step_1" in err[0]  # what a rerun resumes from
    assert "resumed from" in lost["resume_log"] and "global_step_1" in lost["resume_log"]


def test_the_resumed_multinode_run_equals_the_single_node_run(runs):
    """Step 1 of the multi-node run before its node was lost, step 2 after the resume: the single-node run's
    metrics (1e-6: the two worlds reduce in another order) and weights."""
    runs, _ = runs
    single, multi = stable_history(runs / "single"), stable_history(runs / "multi")
    assert_same_history(single, multi)
    last = multi[-1]
    assert last["sync/verified"] == 1.0 and last["actor/grad_norm"] > 0
    # the batch reaches the ranks by reference: the same bytes through the driver as on one node, every step
    assert [h["dataplane/driver_bytes_out"] for h in multi] == [h["dataplane/driver_bytes_out"] for h in single]
    assert all(h["dataplane/driver_bytes_out"] > 0 for h in multi)
    wa, wb = weights(runs / "single"), weights(runs / "multi")
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], rtol=1e-6, atol=1e-8) for k in wa)


def test_too_few_nodes_fail_fast_with_the_cluster_listed(nodes, tmp_path):
    """trainer.nnodes=4 on the two-node cluster: a clear error at start-up, not a wait for a placement."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "trainer.main", "--config", "recipes/cpu/tiny_grpo.yaml", "--config", "recipes/cpu/fp32.yaml", *BASE,
                          "trainer.nnodes=4", "trainer.n_gpus_per_node=2", f"trainer.default_local_dir={tmp_path}"],
                         cwd=ROOT, env=nodes.env(), capture_output=True, text=True, timeout=180)
    assert out.returncode != 0 and time.monotonic() - t0 < 100
    assert "trainer.nnodes=4 x trainer.n_gpus_per_node=2 needs 4 Ray nodes" in out.stderr, out.stderr[-3000:]
    assert "127.0.0.2 (CPU 2)" in out.stderr


def test_a_tp_group_that_would_span_nodes_is_refused():
    from tests.support.tiny import tiny_config
    from trainer.config import ConfigError
    from trainer.workers.cluster import check_node_layout

    cfg = tiny_config(["trainer.nnodes=2", "trainer.n_gpus_per_node=2",
                       "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"])
    with pytest.raises(ConfigError, match="would span nodes"):
        check_node_layout(cfg)
    check_node_layout(tiny_config(["trainer.nnodes=1", "trainer.n_gpus_per_node=4",
                                   "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"]))


def test_a_lost_rollout_server_node_is_dropped_and_the_run_goes_on(nodes, tmp_path):
    """rollout.mode=server, split placement: the trainer's two ranks on the head node, the two HTTP servers
    spread over the two other nodes (a host actor each, the router on the driver's node). Node 127.0.0.3's
    raylet is SIGKILLed inside step 2: its server is dropped (not restarted), the requests it held are
    retried on the other one, and the run finishes every step with verified weight pushes (16 steps: the run
    outlasts Ray's verdict on the node by several seconds, or the drop would race the end of the run). (Last in the
    module: it adds the third node and leaves it dead.)"""
    import json

    nodes.add_node(2)
    run, log_path = tmp_path / "fleet", tmp_path / "fleet.log"
    args = BASE + ["trainer.nnodes=1", "trainer.n_gpus_per_node=2", "trainer.placement=split",
                   "actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.num_engines=2",
                   "trainer.total_training_steps=16", f"trainer.default_local_dir={run}"]
    with open(log_path, "w") as log:
        p = driver(args, nodes.env(), log)
        kill_after_checkpoint(p, run, log_path)
        pm = json.loads((run / "placement.json").read_text())
        head = next(n for n in nodes.nodes() if n["head"] and n["alive"])
        assert {a["node_id"] for a in pm["groups"]["actor"]} == {head["node_id"]}  # the trainer on the head
        assert sorted(s["ip"] for s in pm["fleet"]) == ["127.0.0.2", "127.0.0.3"], pm["fleet"]  # a server per node
        nodes.kill_node(2)
        rc = p.wait(300)
    text = log_path.read_text()
    assert rc == 0, tail(text)
    dropped = [ln for ln in text.splitlines() if "dropped: its node 127.0.0.3 left the Ray cluster" in ln]
    assert dropped and "1 server(s) left" in dropped[0], tail(text)
    assert "restarted at" not in text  # the lost node's server is dropped, not restarted
    hist = checkpoint_history(run)
    assert [h["step"] for h in hist] == list(range(1, 17)) and all(h["sync/verified"] == 1.0 for h in hist)
    deadline = time.monotonic() + 30  # the servers (and their host actors) are gone with the run
    while any("native_server" in _cmdline(q) for q in nodes.own_pids()):
        assert time.monotonic() < deadline, [_cmdline(q)[:80] for q in nodes.own_pids() if "native_server" in _cmdline(q)]
        time.sleep(0.5)
