"""The training loop with ``actor_rollout_ref.rollout.name=sglang`` on CPU: the tiny GRPO recipe, 3 steps, the
rollout workers each holding a real ``sglang.Engine`` (SGLang's CPU path), synced from the actor every step;
colocated (an engine per actor slot; weights through the object store) and split (the engine on its own slot:
``trainer.placement=split``; weights broadcast from actor rank 0 over a gloo group, SGLang's
``update_weights_from_distributed``: ``rollout.weight_sync=distributed_group``).
The model is the recipe's tiny Qwen2 with its MLP's intermediate size made 200 (random weights, the same
tokenizer): not a multiple of 32, so SGLang's CPU path pads it (to 224) and every push lands in a padded tensor.
Runs in the SGLang CPU venv (tests/rollout/sglang_cpu_support.py), the run itself in a child process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trainer.rollout import sglang_cpu

ROOT = str(sglang_cpu.REPO_ROOT)
INTERMEDIATE = 200


def unaligned_model(path: str) -> str:
    """The recipe's tiny model with intermediate_size=INTERMEDIATE (seeded random weights) and its tokenizer."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src = os.path.join(ROOT, "recipes", "cpu", "tiny_model")
    cfg = AutoConfig.from_pretrained(src)
    assert cfg.intermediate_size % 32 == 0 and INTERMEDIATE % 32  # the recipe's model is aligned; this one is not
    cfg.intermediate_size = INTERMEDIATE
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)
    for f in os.listdir(src):
        if f.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or f.endswith(".jinja"):
            shutil.copy(os.path.join(src, f), path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_tiny_grpo_with_sglang_rollout_trains(tmp_path, placement):
    from tests.rollout.sglang_cpu_support import require_sglang_here

    require_sglang_here()
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    model = unaligned_model(str(tmp_path / "model"))
    p = subprocess.run([sys.executable, "-m", "trainer.main", "--config", "recipes/cpu/tiny_grpo.yaml", "--config", "recipes/cpu/fp32.yaml",
                        "actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.model.path={model}",
                        "trainer.total_training_steps=3", "trainer.test_freq=-1",
                        "trainer.save_freq=-1", "trainer.logger=[console,mlflow]",
                        "trainer.experiment_name=tiny_grpo_sglang", f"trainer.default_local_dir={tmp_path}/run",
                        f"trainer.placement={placement}", "trainer.val_before_train=false",
                        # split: actor rank 0 broadcasts to the engine over a gloo group (SGLang's
                        # update_weights_from_distributed); colocated: the object store (update_weights_from_tensor)
                        *(["actor_rollout_ref.rollout.weight_sync=distributed_group"] if placement == "split" else [])],
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
    assert [x.step for x in c.get_metric_history(r.info.run_id, "actor/pg_loss")] == [1, 2, 3]
    assert m["actor/grad_norm"] > 0
    # every sync verified (checksums of what each engine was given; for split also the probe rows read
    # back from SGLang: this is a Qwen2 model, which 0.5.21 cannot read back, so there the checksums)
    assert m["sync/verified"] == 1.0
    assert m.get("sync/group", 0.0) == (1.0 if placement == "split" else 0.0)
