"""The training loop with ``actor_rollout_ref.rollout.name=sglang`` on CPU: the tiny GRPO recipe, 2 steps, the
rollout workers each holding a real ``sglang.Engine`` (SGLang's CPU path), synced from the actor every step;
colocated (an engine per actor slot; weights through the object store) and split (the engine on its own slot:
``trainer.placement=split``; weights broadcast from actor rank 0 over a gloo group, SGLang's
``update_weights_from_distributed``: ``rollout.weight_sync=distributed_group``).
The model is the recipe's trained tiny Qwen2 with its MLP widened from 256 to 264 by zero rows (gate, up) and
zero columns (down): the same function (silu(0)*0 = 0, and those weights get zero gradients), so rewards vary
and the policy gets a gradient, but 264 is not a multiple of 32: SGLang's CPU path pads it (to 288) and every
push lands in a padded tensor.
Runs in the SGLang CPU venv (tests/rollout/sglang_cpu_support.py), the run itself in a child process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trainer.rollout import sglang_cpu

ROOT = str(sglang_cpu.REPO_ROOT)
INTERMEDIATE = 264
# 8 prompts x 4 samples a step, a quarter of the recipe's 16 x 8 (a training run's batch) for SGLang's CPU decode
# and the trainer: nothing asserted here needs more samples (the split run's model solves about 15% of its tasks,
# so some group has a reward spread, and a gradient, every step)
SMALL = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]


def unaligned_model(path: str) -> str:
    """The recipe's tiny model with its MLP zero-widened to INTERMEDIATE (the same function), and its tokenizer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    src = os.path.join(ROOT, "recipes", "cpu", "tiny_model")
    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    old = m.config.intermediate_size
    assert old % 32 == 0 and INTERMEDIATE % 32 and INTERMEDIATE > old  # the recipe's model is aligned; this one is not
    m.config.intermediate_size = INTERMEDIATE
    with torch.no_grad():
        for layer in m.model.layers:
            mlp = layer.mlp
            for name in ("gate_proj", "up_proj"):
                w = getattr(mlp, name).weight
                getattr(mlp, name).weight = torch.nn.Parameter(torch.cat([w, w.new_zeros(INTERMEDIATE - old, w.shape[1])]))
            w = mlp.down_proj.weight
            mlp.down_proj.weight = torch.nn.Parameter(torch.cat([w, w.new_zeros(w.shape[0], INTERMEDIATE - old)], 1))
    m.save_pretrained(path, safe_serialization=True)
    for f in os.listdir(src):
        if f.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or f.endswith(".jinja"):
            shutil.copy(os.path.join(src, f), path)
    return path


@pytest.mark.slow
def test_tiny_grpo_with_sglang_rollout_trains_split(tmp_path):
    """The engine on its own slot (trainer.placement=split), weights broadcast from actor rank 0 over a gloo group
    (SGLang's update_weights_from_distributed), fp32 on both sides: the sampler's log-probs equal the trainer's.
    (The colocated placement, weights through the object store, is the routing-replay test's R3 run: one SGLang
    start-up less for the suite.)"""
    from tests.rollout.sglang_cpu_support import require_sglang_here

    placement = "split"

    require_sglang_here()
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    model = unaligned_model(str(tmp_path / "model"))
    p = subprocess.run([sys.executable, "-m", "trainer.main", "--config", "recipes/cpu/tiny_grpo.yaml", "--config", "recipes/cpu/fp32.yaml",
                        "actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.model.path={model}",
                        "trainer.total_training_steps=2", "trainer.test_freq=-1",
                        "trainer.save_freq=-1", "trainer.logger=[console,mlflow]",
                        "trainer.experiment_name=tiny_grpo_sglang", f"trainer.default_local_dir={tmp_path}/run",
                        f"trainer.placement={placement}", "trainer.val_before_train=false",
                        "actor_rollout_ref.rollout.weight_sync=distributed_group", *SMALL],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "Multi-thread loading shards" in p.stderr + p.stdout  # SGLang's own model loader ran in the rollout workers
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    r = c.search_runs([c.get_experiment_by_name("coxswain").experiment_id])[0]
    assert r.data.params["actor_rollout_ref.rollout.name"] == "sglang"
    assert r.data.params["trainer.placement"] == placement
    m = r.data.metrics
    # The sampler's log-probs (SGLang) agree with the trainer's recomputation (both fp32, same weights after
    # every sync): the mismatch KL measured ~1e-7 (bound 1e-4).
    assert abs(m["mismatch/mismatch_kl"]) < 1e-4
    assert [x.step for x in c.get_metric_history(r.info.run_id, "actor/pg_loss")] == [1, 2]
    assert m["actor/grad_norm"] > 0
    # every sync verified (checksums of what each engine was given; with the probe rows read
    # back from SGLang: this is a Qwen2 model, which 0.5.21 cannot read back, so there the checksums)
    assert m["sync/verified"] == 1.0
    assert m["sync/group"] == 1.0


TINY_RECIPE = ("--config", "recipes/cpu/tiny_grpo.yaml", "--config", "recipes/cpu/fp32.yaml",
               "actor_rollout_ref.rollout.name=sglang", "trainer.test_freq=-1", "trainer.save_freq=-1",
               "trainer.logger=[mlflow]", "trainer.val_before_train=false")


def _run(tmp_path, name: str, *overrides: str, base: tuple = TINY_RECIPE) -> dict[str, list[float]]:
    """``trainer.main`` (the tiny recipe with SGLang rollout, or ``base``) in a child process; each metric's
    history."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/{name}.db"
    p = subprocess.run([sys.executable, "-m", "trainer.main", *base, *overrides,
                        f"trainer.default_local_dir={tmp_path}/{name}"],
                       cwd=ROOT, env=dict(os.environ, MLFLOW_TRACKING_URI=uri), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    c = MlflowClient(tracking_uri=uri)
    r = c.search_runs([e.experiment_id for e in c.search_experiments()])[0]  # the one run (its project's experiment)
    out = {k: [m.value for m in c.get_metric_history(r.info.run_id, k)] for k in r.data.metrics}
    out["_params"], out["_log"] = r.data.params, p.stdout + p.stderr
    return out


@pytest.mark.slow
def test_routing_replay_through_sglang_cuts_the_moe_mismatch(tmp_path):
    """R3 with SGLang, in the rollout workers (rollout.mode=sync) and as a fleet of SGLang servers (rollout.mode=
    async, verl's router-replay example's setting): a bf16 SGLang engine samples from a MoE
    policy whose router nearly ties (32 experts, small scores); the fp32 actor recomputes the log-probs. Without
    replay the two route many tokens to different experts; with SGLang's captured routes replayed the actor uses
    the engine's experts, and the rollout-vs-trainer KL falls by orders of magnitude.
    The run without replay samples with the native engine in bf16: the mismatch it shows is the routing flips of
    any bf16 sampler against the fp32 actor (measured 220x the R3 run's, as SGLang's own run without replay, 222x),
    and it spares the test one SGLang start-up (about a minute of the test's four)."""
    from tests.rollout.sglang_cpu_support import require_sglang_here
    from tests.support.tiny import tiny_moe_twin

    require_sglang_here()
    moe = tiny_moe_twin(tmp_path / "moe", router_std=0.01, experts=32, expert_std=0.5, tied=False)
    common = [f"actor_rollout_ref.model.path={moe}", "actor_rollout_ref.rollout.dtype=bfloat16",
              "trainer.total_training_steps=2", "data.max_response_length=12"]
    # the run without replay at the recipe's full batch (the native engine samples it in seconds): its mismatch is a
    # per-token mean carried by the few tokens whose experts flip, and 4x the tokens keep that estimate steady
    free = _run(tmp_path, "free", *common, "actor_rollout_ref.rollout.name=native")
    # one slot (one actor rank, one SGLang engine): an SGLang start-up less, and the colocated engine decodes on
    # its own core; the R3 path is the same for every engine (its DP=2 peer is verl's script below)
    r3 = _run(tmp_path, "r3", *common, *SMALL, "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.router_replay.mode=R3",
              "actor_rollout_ref.rollout.enable_rollout_routing_replay=true")
    assert len(r3["actor/pg_loss"]) == 2 and r3["sync/verified"] == [1.0, 1.0]
    # the colocated placement with SGLang in the rollout workers: SGLang's own model loader ran there, and the
    # weights reached the engines through the object store (update_weights_from_tensor), not a process group
    assert "Multi-thread loading shards" in r3["_log"]
    assert r3["_params"]["actor_rollout_ref.rollout.name"] == "sglang"
    assert r3["_params"]["trainer.placement"] == "colocated" and max(r3.get("sync/group", [0.0])) == 0.0
    # (no gradient is asserted: this random MoE policy's groups often score all 0, so a step may have none;
    # the split test's trained model has one every step)
    # k3 = E[ratio - 1 - log ratio] >= 0 per token: the flipped tokens' large log-ratios dominate it
    kl_free, kl_r3 = sum(free["mismatch/mismatch_k3_kl"]), sum(r3["mismatch/mismatch_k3_kl"])
    print("mismatch_k3_kl free", kl_free, "R3", kl_r3)
    assert kl_r3 * 50 < kl_free, (kl_free, kl_r3)
    # verl's router-replay example (R3, rollout.mode=async: a fleet of real SGLang servers started with
    # --enable-return-routed-experts), its own arguments on verl's megatron defaults with only the model, data,
    # sizes and device replaced (the same model and precisions as above)
    fleet = _run_verl_script(tmp_path, "run_qwen30_a3b_megatron_vllm", moe,
                             # kept to measure the mismatch: the sampler's log-probs, with no IS they change no update
                             "actor_rollout_ref.rollout.calculate_log_probs=True",
                             # one server behind the router (a start-up less): two are test_fleet_sglang_servers'
                             "actor_rollout_ref.rollout.num_engines=1")
    kl_fleet = sum(fleet["mismatch/mismatch_k3_kl"])
    print("mismatch_k3_kl SGLang fleet R3 (verl's script)", kl_fleet)
    assert len(fleet["actor/pg_loss"]) == 2 and fleet["sync/verified"] == [1.0, 1.0]
    # a real sglang.launch_server process behind the router (this trainer's fleet; rollout.mode=async is server
    # mode), each step's weights pushed through SGLang's own endpoints
    logs = sorted((tmp_path / "run_qwen30_a3b_megatron_vllm" / "fleet_logs").glob("server-*.log"))
    assert logs and all("sglang/launch_server.py" in p.read_text() for p in logs), logs
    assert fleet["fleet/weight_pushes"][-1] >= 1
    assert kl_fleet * 50 < kl_free, (kl_free, kl_fleet)


# What a tiny CPU run changes in a verl megatron script: model, data, sizes, device (and the precisions: the
# trainer in fp32, the engine in bf16, as the mismatch test above). Every other argument is the script's.
MEGATRON_SIZES = {
    "data.train_files": "null", "data.val_files": "null", "data.max_prompt_length": "64",
    "data.max_response_length": "12", "data.train_batch_size": "4", "actor_rollout_ref.rollout.n": "4",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "8",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "256", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "256",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "256", "actor_rollout_ref.rollout.max_num_batched_tokens": "512",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "1", "actor_rollout_ref.rollout.gpu_memory_utilization": "0.5",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "1", "actor_rollout_ref.ref.megatron.tensor_model_parallel_size": "1",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": "2", "actor_rollout_ref.ref.megatron.expert_model_parallel_size": "2",
    "actor_rollout_ref.actor.megatron.param_offload": "False", "actor_rollout_ref.actor.megatron.optimizer_offload": "False",
    "actor_rollout_ref.actor.megatron.grad_offload": "False", "actor_rollout_ref.ref.megatron.param_offload": "False",
    "trainer.n_gpus_per_node": "2", "trainer.nnodes": "1", "trainer.total_training_steps": "2", "trainer.logger": "[mlflow]",
    "trainer.test_freq": "-1", "trainer.device": "cpu", "actor_rollout_ref.rollout.name": "sglang",
    "actor_rollout_ref.actor.megatron.dtype": "float32", "actor_rollout_ref.ref.megatron.dtype": "float32",
    "actor_rollout_ref.rollout.dtype": "bfloat16",
    # DeepEP (a GPU library) dispatches the script's tokens: on a CPU megatron's all-to-all (the same routing)
    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_enable_deepep": "False",
    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type": "alltoall",
}


def _run_verl_script(tmp_path, name: str, model: str, *extra: str) -> dict[str, list[float]]:
    import json

    args = json.loads(open(os.path.join(ROOT, "tests", "data", "verl_scripts", f"{name}.json")).read())["args"]
    sizes = {**MEGATRON_SIZES, "actor_rollout_ref.model.path": model}
    out, seen = [], set()
    for a in args:
        key = a.split("=", 1)[0].lstrip("+")
        seen.add(key)
        out.append(f"{key}={sizes[key]}" if key in sizes else a)
    out += [f"{k}={v}" for k, v in sizes.items() if k not in seen]
    return _run(tmp_path, name, *out, *extra, base=())  # measured 2.9e-4 vs 1.3e-6 at step 1 (222x), as the native engine (220x)
