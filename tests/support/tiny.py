"""The tiny CPU job's config for tests: ``recipes/cpu/tiny_grpo.yaml`` (the settings the shipped recipe
uses on top of verl's defaults) plus a test's own overrides."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from trainer.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_MODEL = os.path.join(ROOT, "recipes", "cpu", "tiny_model")
TINY_YAML = os.path.join(ROOT, "recipes", "cpu", "tiny_grpo.yaml")
# the recipe keeps verl's bf16 defaults; the tests' references are fp32 (recipes/cpu/fp32.yaml)
FP32_YAML = os.path.join(ROOT, "recipes", "cpu", "fp32.yaml")
# Runs that a test compares with each other (resume = uninterrupted, TP=2 = TP=1, ...) must not differ by a scorer
# call that a loaded 2-core machine starved past reward_model.timeout (10 s: a hang guard; the arithmetic scorer
# takes microseconds): seen under the suite's -n 2 at load 23, one sample of 32 scored 0 as "timed out".
UNHURRIED = ["reward_model.timeout=120"]
TINY_ARGS = ["--config", TINY_YAML, "--config", FP32_YAML, *UNHURRIED]


def tiny_config(overrides=(), **kw):
    return load_config([*TINY_ARGS, *overrides], **kw)


# A driver in its own process (and session), for tests that SIGKILL it.
DRIVER_SCRIPT = """
import json, sys
from trainer.config import load_config
from trainer.main import train
out = train(load_config(["--config", "recipes/cpu/tiny_grpo.yaml", "--config", "recipes/cpu/fp32.yaml", "reward_model.timeout=120",
                         *json.loads(sys.argv[1])]))
"""


def start_driver(args, env, log) -> subprocess.Popen:
    """``trainer.main.train`` on the tiny recipe plus ``args``, in a new process group."""
    return subprocess.Popen([sys.executable, "-c", DRIVER_SCRIPT, json.dumps(args)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def joining_this_cluster(env: dict) -> dict:
    """``env`` plus ``RAY_ADDRESS`` of the Ray cluster this process is connected to (a module's shared embedded
    cluster): a driver started with it joins that cluster, as a driver does on a Slurm or KubeRay cluster, and
    does not pay an embedded cluster's start (about 8 s of a tiny run on a 2-core machine). A SIGKILLed driver's
    workers are ended by Ray (its job is dead); the cluster stays up for the next driver."""
    import ray

    assert ray.is_initialized(), "start the module's cluster first (an in-process run on shared_ray)"
    return dict(env, RAY_ADDRESS=ray.get_runtime_context().gcs_address)


def start_cli(args, env, log) -> subprocess.Popen:
    """``python -m trainer.main`` with a script's own arguments (no tiny recipe under them), in a new process group."""
    return subprocess.Popen([sys.executable, "-m", "trainer.main", *args], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def sigkill_after_checkpoint(p: subprocess.Popen, run_dir, step: int, log_path, timeout_s: float = 600) -> None:
    """Wait until checkpoint ``step`` of ``run_dir`` is complete (verl's tracker file names it; the driver is then
    inside step ``step + 1``), then SIGKILL the driver's process group (it was started in its own session)."""
    latest, t0 = Path(run_dir) / "latest_checkpointed_iteration.txt", time.time()
    while not (latest.exists() and latest.read_text().strip() == str(step)):
        assert p.poll() is None and time.time() - t0 < timeout_s, Path(log_path).read_text()[-3000:]
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def checkpoint_history(run_dir) -> list:
    """The metrics history in the newest checkpoint of ``run_dir``."""
    from trainer.checkpoint import CheckpointManager, load_driver_state

    return load_driver_state(CheckpointManager(str(run_dir)).find_latest())["history"]


# metrics that measure time or speed: two runs of the same steps differ in them and in nothing else
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", "sync/seconds", "sync/gbps", "reward/time_s")


def stable_history(run_dir) -> list:
    """:func:`checkpoint_history` without the :data:`VOLATILE` metrics: what an exact resume must reproduce."""
    return [{k: v for k, v in h.items() if not k.startswith(VOLATILE)} for h in checkpoint_history(run_dir)]


@torch.no_grad()
def rollout_logp_under(model_dir: str, batch) -> torch.Tensor:
    """log p(response token) under the HF model at ``model_dir``, temperature 1, on the batch's grid."""
    from transformers import AutoModelForCausalLM

    return logp_under(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), batch)


@torch.no_grad()
def logp_under(m, batch) -> torch.Tensor:
    """log p(response token) under a HF causal LM (or a peft model around one), temperature 1, on the batch's grid."""
    P = batch.prompt_width
    out = torch.zeros(batch.responses.shape)
    for i in range(batch.num_samples):
        real = batch.attention_mask[i].bool()
        ids = batch.input_ids[i][real]
        n_p = int(real[:P].sum())
        logp = torch.log_softmax(m(ids[None]).logits[0].float(), -1)
        r = ids[n_p:]
        out[i, :len(r)] = logp[n_p - 1:-1].gather(-1, r[:, None])[:, 0]
    return out


def tiny_moe_twin(path: Path, router_std: float = 1.0, experts: int = 4, expert_std: float | None = None,
                  tied: bool = True, base_model: str = TINY_MODEL, max_positions: int | None = None) -> str:
    """A random Qwen3-MoE twin of the tiny model, or of ``base_model`` (same tokenizer): 4 experts, top-2, 2 layers;
    ``tied``: the output head is the embedding (SGLang 0.5.21's Qwen3-MoE cannot load that: the SGLang tests untie
    it); ``max_positions``: the base model's by default."""
    import shutil

    from transformers import AutoModelForCausalLM, Qwen3MoeConfig  # heavy: only the MoE tests build one

    base = json.loads((Path(base_model) / "config.json").read_text())
    cfg = Qwen3MoeConfig(vocab_size=base["vocab_size"], hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                         num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=max_positions or base["max_position_embeddings"], tie_word_embeddings=tied,
                         eos_token_id=base.get("eos_token_id"), bos_token_id=base.get("bos_token_id"))
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, router_std)  # 1.0: a router far from uniform; small: near-ties everywhere
            elif expert_std is not None and ".experts." in n:
                p.normal_(0, expert_std)  # experts that differ enough for the choice to matter
    m.save_pretrained(path)
    path = Path(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(Path(base_model) / f, path / f)
    return str(path)
