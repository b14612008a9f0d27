"""LoRA on the HF-model actors (peft, trainer/strategies/hf_lora.py: DeepSpeed ZeRO-2, and FSDP2 with Ulysses SP=2
on packed rows) in the training loop, on a real local Ray cluster with two ranks, against LoRA on the megatron actor
with the same keys and seed:

* the same start: the two draw the same adapters (the megatron init split into peft's parts), so one GRPO step
  with a KL loss (the reference is each actor with its adapters off: no reference group) gives the same losses, KL,
  entropy and gradient norm; every sync moves only the adapters (the same bytes from both), verified, and the
  engines compute what the DeepSpeed actor computes;
* only the adapters train (the optimizer holds exactly their elements, counted here from config.json);
* the export (each strategy's): the merged HF weights are ``W + (alpha / r) B A`` of the exported peft adapter,
  computed here from the files, and ``PeftModel.from_pretrained`` on that adapter gives the merged model's logits;
* (DeepSpeed) a checkpoint holds the adapters and their Adam state, not the base, and a run resumed from step 1's checkpoint
  gives the uninterrupted run's step 2 and adapters bit for bit.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.tiny import TINY_MODEL, stable_history, tiny_config

pytestmark = pytest.mark.slow

RANK, ALPHA = 4, 8  # scale 2
BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=6",
        "trainer.logger=[mlflow]", "trainer.test_freq=-1", "trainer.val_before_train=false",
        f"actor_rollout_ref.model.lora.rank={RANK}", f"actor_rollout_ref.model.lora.alpha={ALPHA}",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.optim.lr=1e-3"]
DS = ["actor_rollout_ref.actor.strategy=deepspeed", "actor_rollout_ref.actor.deepspeed_config.zero_stage=2"]
FSDP = ["actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.fsdp_config.dtype=fp32",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=true"]


def peft_elements() -> int:
    """Every HF projection's ``r x (in + out)`` (peft: an adapter per q, k, v, o, gate, up, down), from config.json."""
    c = json.loads((Path(TINY_MODEL) / "config.json").read_text())
    H, F, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or H // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = [(H, q), (H, kv), (H, kv), (q, H), (H, F), (H, F), (F, H)]
    return L * sum(RANK * (i + o) for i, o in shapes)


def run(d: Path, name: str, *overrides):
    from trainer.main import train

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{d}/mlflow.db")
        return train(tiny_config(BASE + [f"trainer.default_local_dir={d / name}", *overrides]))


@pytest.fixture(scope="module", autouse=True)
def _ray(shared_ray):
    yield


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds_lora")
    mg = run(d, "megatron", "trainer.total_training_steps=1")["history"]
    ds = run(d, "deepspeed", *DS, "trainer.total_training_steps=2", "trainer.save_freq=1")["history"]
    fs = run(d, "fsdp2", *FSDP, "trainer.total_training_steps=1")["history"]
    return d, mg, {"deepspeed": ds, "fsdp2": fs}


@pytest.mark.parametrize("strategy", ["deepspeed", "fsdp2"])
def test_peft_lora_trains_like_megatron_lora_and_syncs_only_the_adapters(runs, strategy):
    d, mg, hists = runs
    hist = hists[strategy]
    assert [h["step"] for h in hist] == ([1, 2] if strategy == "deepspeed" else [1])
    a, b = mg[0], hist[0]
    assert a["critic/score/mean"] == b["critic/score/mean"]  # the same samples (the engines start from the base)
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/ppo_kl"):
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), (k, b[k], a[k])
    assert b["actor/grad_norm"] > 0
    n = peft_elements()
    for h in hist:
        # the adapters only: in the optimizer, and through every sync (fp32: 4 bytes each; megatron's stream, in
        # peft's layout, is as large), verified, into engines that compute what the DeepSpeed actor computes
        assert h["actor/lora/adapter_params"] == h["actor/lora/optimizer_params"] == n
        assert h["actor/lora/adapters"] == 7 * json.loads((Path(TINY_MODEL) / "config.json").read_text())["num_hidden_layers"]
        assert h["actor/lora/frozen_with_grad"] == 0
        assert h["sync/verified"] == 1.0 and h["sync/bytes"] == 4 * n == a["sync/bytes"]
        assert abs(h["mismatch/mismatch_kl"]) < 1e-6, h["mismatch/mismatch_kl"]
    placement = json.loads((d / strategy / "placement.json").read_text())
    assert "ref" not in placement["groups"]  # the reference is the actor with its adapters off


@pytest.mark.parametrize("strategy", ["deepspeed", "fsdp2"])
def test_export_is_the_merged_model_and_a_peft_adapter(runs, strategy):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    d, _, _ = runs
    out = d / strategy / "hf_export"
    merged, base = load_file(str(out / "model.safetensors")), load_file(os.path.join(TINY_MODEL, "model.safetensors"))
    adapter = load_file(str(out / "lora_adapter" / "adapter_model.safetensors"))
    cfg = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (RANK, ALPHA, "LORA")
    moved = 0
    for k, w in base.items():
        stem = "base_model.model." + k[: -len(".weight")]
        if stem + ".lora_A.weight" in adapter:
            A, B = adapter[stem + ".lora_A.weight"].double(), adapter[stem + ".lora_B.weight"].double()
            want = w.double() + (ALPHA / RANK) * B @ A
            moved += int(not torch.equal(merged[k], w))
        else:
            want = w.double()
        assert torch.allclose(merged[k].double(), want, atol=1e-6), k
    assert moved > 0  # the adapters trained
    vocab = json.loads((Path(TINY_MODEL) / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32),
                                   str(out / "lora_adapter")).eval()
    mm = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = pm(ids).logits, mm(ids).logits  # float32 logits of tens: rounding of 1e-5 absolute
        assert ((a - b).abs() / b.abs().clamp(min=1.0)).max() < 1e-5


def test_checkpoint_holds_the_adapters_and_resumes_exactly(runs, capfd):
    d, _, ds = runs
    ckpt = d / "deepspeed" / "global_step_1" / "actor"
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    base = os.path.getsize(os.path.join(TINY_MODEL, "model.safetensors"))
    # the adapters and their two Adam moments (fp32), not the base: well under the base model's bytes
    assert 3 * 4 * peft_elements() < size < base / 2, (size, base)
    # a run that starts from step 1's checkpoint trains step 2 exactly as the uninterrupted run did
    resumed = d / "resumed"
    resumed.mkdir()
    shutil.copytree(d / "deepspeed" / "global_step_1", resumed / "global_step_1")
    (resumed / "latest_checkpointed_iteration.txt").write_text("1")
    out = run(d, "resumed", *DS, "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.resume_mode=auto")
    assert "resumed from" in capfd.readouterr().out  # step 1 came from the checkpoint, not from training it again
    assert [h["step"] for h in out["history"]] == [1, 2]

    assert stable_history(resumed)[-1] == stable_history(d / "deepspeed")[-1]
    f = "hf_export/lora_adapter/adapter_model.safetensors"
    wa, wb = load_file(str(d / "deepspeed" / f)), load_file(str(resumed / f))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


MISSING_ADAPTER_PROBE = """
import sys
from trainer.lora import LoRASettings
from trainer.strategies.deepspeed import DeepSpeedStrategy
def strategy(targets, port):
    s = LoRASettings(rank=4, alpha=8, target_modules=targets)
    return DeepSpeedStrategy(role="actor", rank=0, world_size=1, master_addr="127.0.0.1", master_port=port,
                             model_path=sys.argv[1], zero_stage=2, optim=dict(lr=1e-3), lora=s.as_dict())
strategy(("linear_qkv",), int(sys.argv[3])).save(sys.argv[2])
try:
    strategy(("linear_qkv", "linear_fc2"), int(sys.argv[3])).load(sys.argv[2])
except KeyError as e:
    print("refused:", e)
"""


def test_a_checkpoint_without_an_adapter_is_refused_before_it_loads(tmp_path):
    """A LoRA checkpoint is loaded non-strictly (it holds no base weights): one saved with fewer target_modules must
    be refused by name, not leave the missing adapters at their init (DeepSpeed, one rank, in a child process)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-c", MISSING_ADAPTER_PROBE, TINY_MODEL, str(tmp_path / "ckpt"), str(port)],
                       cwd=root, env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "refused:" in p.stdout and "the LoRA checkpoint has no" in p.stdout and "down_proj.lora_A" in p.stdout, p.stdout
