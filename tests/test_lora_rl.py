"""LoRA RL on the megatron actor end to end (``actor_rollout_ref.model.lora.*``, docs/strategies.md#lora), on a
real local Ray cluster with the tiny model, fp32:

* a cluster whose actor starts from a random peft adapter (``lora.adapter_path``) and runs a KL loss: its reference
  is the actor with the adapters off (no reference ranks), equal bit for bit to a separate reference group's
  log-probs on the same batch, before and after an update (the base stays frozen); the actor's log-probs equal
  peft's on transformers with that adapter; an update steps only the adapters (the optimizer's parameters and Adam
  state count exactly the adapters' elements, counted here from config.json; no base parameter has a gradient);
* the engines' verified sync and the export: the merged HF weights are ``W + (alpha / r) B A`` of the exported peft
  adapter, computed here from the files; the peft adapter directory and the merged model give the actor's
  log-probs within 1e-5;
* resume: 2 steps uninterrupted equal a run resumed from their step-1 checkpoint (metrics, adapters, merged
  export, bit for bit); the same steps at TP=2 with adapter-only syncs: both steps' losses and
  gradient norms (1e-4) and the trained adapters (1e-4, a tenth of an Adam step), engines that compute the TP=2
  actor's log-probs, only the adapters moved;
* the shipped LoRA recipe runs 2 steps with LoRA active (metrics ``actor/lora/*``), no reference group, verified
  syncs.
"""

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.batches import random_batch
from tests.support.tiny import TINY_MODEL, TINY_YAML, logp_under, stable_history, tiny_config
from trainer.plan import ForwardSettings

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
LORA_YAML = str(ROOT / "recipes" / "cpu" / "tiny_lora_grpo.yaml")
RANK, ALPHA = 4, 8  # scale 2
FWD = ForwardSettings(micro_batch_size=8)
BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=6",
        "trainer.logger=[mlflow]", "data.val_batch_size=64", f"actor_rollout_ref.model.lora.rank={RANK}",
        f"actor_rollout_ref.model.lora.alpha={ALPHA}", "actor_rollout_ref.model.lora.merge=true",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.optim.lr=1e-3"]


def adapter_elements(rank: int) -> int:
    """Every decoder linear's ``r x (in + out)``, from the tiny model's config.json (TP=1: one rank holds all)."""
    c = json.loads((Path(TINY_MODEL) / "config.json").read_text())
    H, F, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or H // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = (H + q + 2 * kv) + (q + H) + (H + 2 * F) + (F + H)  # qkv, proj, fc1 (gate+up), fc2
    return L * rank * per_layer


def peft_sync_elements(rank: int) -> int:
    """What an adapter-only sync moves: peft's layout, ``r x (in + out)`` per HF projection (a fused layer's ``A``
    once for each of its parts), from config.json."""
    c = json.loads((Path(TINY_MODEL) / "config.json").read_text())
    H, F, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or H // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = (H + q) + 2 * (H + kv) + (q + H) + 2 * (H + F) + (F + H)  # q, k, v, o, gate, up, down
    return L * rank * per_layer


def hidden_size() -> int:
    return json.loads((Path(TINY_MODEL) / "config.json").read_text())["hidden_size"]


def full_sync_elements() -> int:
    """What a full sync moves: every tensor of the checkpoint (the tied lm_head is not one)."""
    from safetensors import safe_open

    with safe_open(str(Path(TINY_MODEL) / "model.safetensors"), "pt") as f:
        return sum(f.get_slice(k).get_shape().numel() if hasattr(f.get_slice(k).get_shape(), "numel")
                   else int(torch.tensor(f.get_slice(k).get_shape()).prod()) for k in f.keys())


def random_peft_adapter(path: Path, seed: int = 5) -> str:
    """A peft LoRA directory on the tiny model with random A and B (fused parts share A: what megatron holds)."""
    from megatron_bridge.export import canonical_shape
    from megatron_bridge.hf_config import padded_vocab_size, read_hf_config
    from megatron_bridge.lora import adaptable_modules, lora_state_to_peft, peft_adapter_config

    hf = read_hf_config(TINY_MODEL)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for m in adaptable_modules(hf):
        out, inp = canonical_shape(m + ".weight", hf, padded_vocab_size(hf.vocab_size, 1, 128))
        state[m + ".lora_A.weight"] = torch.randn(RANK, inp, generator=g) / inp ** 0.5
        state[m + ".lora_B.weight"] = 0.03 * torch.randn(out, RANK, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    save_file(lora_state_to_peft(state, hf), str(path / "adapter_model.safetensors"))
    cfg = peft_adapter_config(state, hf, rank=RANK, alpha=ALPHA, base_model_name_or_path=TINY_MODEL)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return str(path)


def rel_err(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest ``|a - b| / max(1, |a|)`` over the response tokens: float32 log-probs of tens of nats carry
    absolute rounding of 1e-5 (the merged export computes (W + sBA)x, the actor Wx + sB(Ax))."""
    return float(((a - b).abs() / a.abs().clamp(min=1.0))[mask].max())


def peft_model(adapter_dir: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@pytest.fixture(scope="module", autouse=True)
def _ray(shared_ray):
    yield


# The whole-run tests first: the module-scoped cluster below holds both CPU slots until the module ends, so a
# run after its tests could not be placed.
def _run(tmp_path, *overrides, name):
    from trainer.main import train

    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    return train(tiny_config(BASE + [f"trainer.default_local_dir={tmp_path / name}", "trainer.test_freq=-1",
                                     "trainer.val_before_train=false", "trainer.save_freq=1", *overrides]))


def test_resume_from_step_1_is_exact(tmp_path):
    """2 steps in one run equal a run resumed from that run's step-1 checkpoint (``trainer.resume_mode=resume_path``):
    the checkpoint holds the adapters and their Adam state (a resume without them would step from fresh moments),
    and the adapters and the merged export come out bit for bit. What is LoRA's own is the adapter checkpoint's
    save and load; the SIGKILLed driver's resume is strategy-independent and is tests/test_controller.py's (and
    test_async's, test_async_fully's, test_multinode's): a killed driver here cost two more driver start-ups."""
    _run(tmp_path, "trainer.total_training_steps=2", name="whole")
    _run(tmp_path, "trainer.total_training_steps=2", "trainer.resume_mode=resume_path",
         f"trainer.resume_from_path={tmp_path / 'whole' / 'global_step_1'}", name="cut")
    # it began at step 2: a run that started afresh would have saved its own step 1
    assert not (tmp_path / "cut" / "global_step_1").exists() and (tmp_path / "cut" / "global_step_2").is_dir()
    a, b = stable_history(tmp_path / "whole"), stable_history(tmp_path / "cut")
    assert [h["step"] for h in a] == [1, 2] == [h["step"] for h in b] and a == b
    # the checkpoint that resumed exactly holds the adapters and their Adam state, not the frozen base (model.path's):
    # under half the fp32 base model's bytes (the base alone would be all of them; measured 0.49 MB of 1.63 MB)
    actor_dir = tmp_path / "whole" / "global_step_1" / "actor"
    ckpt = sum(f.stat().st_size for f in actor_dir.rglob("*") if f.is_file())
    assert 3 * 4 * adapter_elements(RANK) < ckpt < 4 * full_sync_elements() / 2, (ckpt, full_sync_elements())
    for f in ("model.safetensors", "lora_adapter/adapter_model.safetensors"):
        wa, wb = load_file(str(tmp_path / "whole" / "hf_export" / f)), load_file(str(tmp_path / "cut" / "hf_export" / f))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), f

    # the same 2 steps with the adapters split over two tensor-parallel ranks and adapter-only syncs (each engine
    # merges the TP-gathered adapters itself): the same losses, gradient norms and adapters as TP=1 at both steps,
    # and engines that hold what the TP=2 actor computes (the rollout vs trainer KL at float32 rounding, where a
    # mis-gathered adapter shard gives 1e-3 and more). Step 2 samples from the synced TP=2 policy. (Before the
    # factors were contiguous copies, torch's fused Adam stepped the row-parallel A, a strided view, against other
    # elements' gradients: step 2's pg_loss was 2.4% off and the A of linear_proj / linear_fc2 up to two Adam
    # steps, 1.5e-3, away from TP=1's.)
    tp = _run(tmp_path, "trainer.total_training_steps=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
              "actor_rollout_ref.model.lora.merge=false", name="tp2_adapters")["history"]
    assert [h["step"] for h in tp] == [1, 2]
    for step in (0, 1):
        for k in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"):
            assert abs(tp[step][k] - a[step][k]) < 1e-4 * max(1.0, abs(a[step][k])), (step + 1, k, tp[step][k], a[step][k])
    for h in tp:
        assert h["sync/verified"] == 1.0 and h["sync/bytes"] == 4 * peft_sync_elements(RANK) < 0.2 * a[0]["sync/bytes"]
        assert abs(h["mismatch/mismatch_kl"]) < 1e-6, h["mismatch/mismatch_kl"]
    f = "lora_adapter/adapter_model.safetensors"
    wa, wt = load_file(str(tmp_path / "whole" / "hf_export" / f)), load_file(str(tmp_path / "tp2_adapters" / "hf_export" / f))
    worst = max(float((wa[k] - wt[k]).abs().max()) for k in wa)
    assert wa.keys() == wt.keys() and worst < 1e-4, worst  # a tenth of one Adam step at lr 1e-3


def test_shipped_lora_recipe_runs_with_lora_active(tmp_path, monkeypatch):
    from trainer.config import load_config
    from trainer.main import train

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    cfg = load_config(["--config", TINY_YAML, "--config", LORA_YAML, "trainer.total_training_steps=2",
                       "trainer.logger=[console]", "trainer.test_freq=-1", f"trainer.default_local_dir={tmp_path / 'run'}"])
    out = train(cfg)
    hist, run_dir = out["history"], Path(out["run_dir"])
    n = adapter_elements(8)
    for h in hist[1:]:
        # two data-parallel ranks (TP=1), each with every adapter; the optimizer holds exactly them
        assert h["actor/lora/adapters"] == 16 and h["actor/lora/optimizer_params"] == n == h["actor/lora/adapter_params"]
        assert h["actor/lora/frozen_with_grad"] == 0 and h["sync/verified"] == 1.0 and "actor/kl_loss" in h
    # lora.merge=false (the recipe's, verl's default): every sync moved the adapters and nothing else, verified
    elements = peft_sync_elements(8)
    moved = [h["sync/bytes"] for h in hist[1:]]
    print(f"adapter sync: {moved} bytes per sync; {elements} adapter elements; full model {full_sync_elements()}")
    assert all(b in (2 * elements, 4 * elements) for b in moved), moved  # bf16 or fp32 adapters
    assert max(moved) < 0.2 * 2 * full_sync_elements()
    groups = json.loads((run_dir / "placement.json").read_text())["groups"]
    assert "ref" not in groups and "actor" in groups  # the KL loss's reference ran on the actor's ranks
    assert (run_dir / "hf_export" / "lora_adapter" / "adapter_model.safetensors").exists()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from trainer.main import resolve_model_paths
    from trainer.workers.cluster import Cluster
    from trainer.workers.roles import RefGroup

    tmp = tmp_path_factory.mktemp("lora")
    adapter = random_peft_adapter(tmp / "start_adapter")
    # adapter-only syncs (verl's default; BASE's runs above send merged weights)
    cfg = tiny_config(BASE + [f"trainer.default_local_dir={tmp / 'run'}", f"actor_rollout_ref.model.lora.adapter_path={adapter}",
                              "actor_rollout_ref.model.lora.merge=false"])
    resolve_model_paths(cfg)
    c = Cluster(cfg, total_steps=1)
    # an independent reference: a group of its own on the base model (what runs without LoRA)
    ref = c._role_group(RefGroup, "ref_check", cfg.actor_rollout_ref.ref, "ref", None, cfg.actor_rollout_ref.model.path)
    yield cfg, c, ref, adapter, tmp
    ref.shutdown()
    c.shutdown()


def test_reference_is_the_actor_with_adapters_off_and_only_adapters_train(cluster):
    from trainer.plan import Plan
    from trainer.workers.dataplane import StepData

    cfg, c, ref, adapter, _ = cluster
    assert c.ref.shares_actor and "ref" not in c.groups()  # no reference ranks were started
    batch = random_batch(16, 6, 6, seed=1)

    def logps():
        data = StepData(batch, c.transport)
        return (c.ref.log_probs(data, FWD).fetch()["ref_log_probs"], ref.log_probs(data, FWD).fetch()["ref_log_probs"],
                c.actor.log_probs_with_entropy(data, FWD)[0].fetch()["old_log_probs"])

    from_actor, from_group, actor = logps()
    mask = batch.response_mask.bool()
    assert torch.equal(from_actor, from_group)  # the adapters-off actor IS the base model, bit for bit (fp32)
    moved = (actor - from_actor)[mask].abs().max()
    peft_err = rel_err(actor, logp_under(peft_model(adapter), batch), mask)
    print(f"adapters on vs off: {moved:.3g}; actor vs peft on transformers: {peft_err:.3g}")
    assert moved > 0.05  # the adapters are on for the actor's own pass
    assert peft_err < 1e-5  # the actor started from the peft adapter: peft on transformers computes the same policy

    data = StepData(batch, c.transport)
    old, _ = c.actor.log_probs_with_entropy(data, FWD)
    ref_lp = c.ref.log_probs(data, FWD)
    settings = replace(Plan.from_config(cfg, total_steps=1).actor_update, mini_batch_size=16, epochs=1, shuffle=False,
                       micro_batch_size=8, temperature=1.0)
    m = c.actor.update(data, settings, [old, ref_lp, data.scatter(c.actor.dp, {"advantages": batch.advantages})], seed=0)
    n = adapter_elements(RANK)  # 4 layers x r x 1440 = 23040 at r=4
    assert m["actor/lora/adapters"] == 16 and m["actor/lora/adapter_params"] == n
    assert m["actor/lora/optimizer_params"] == n  # the optimizer steps the adapters and nothing else
    assert m["actor/lora/optimizer_state"] == 2 * n  # Adam's two moments, for the adapters only
    assert m["actor/lora/frozen_with_grad"] == 0 and m["actor/grad_norm"] > 0 and m["actor/kl_loss"] > 0

    from_actor2, from_group2, actor2 = logps()
    assert torch.equal(from_actor2, from_group2) and torch.equal(from_actor2, from_actor)  # the base did not move
    assert (actor2 - actor)[mask].abs().max() > 1e-4  # the adapters did


def test_sync_is_verified_and_the_export_is_merged_plus_a_peft_adapter(cluster):
    from trainer.workers.dataplane import StepData

    from trainer.rollout.engine import WeightSyncError

    cfg, c, _, _, tmp = cluster
    m = c.rollout.sync_from(c.actor)
    assert m["sync/verified"] == 1.0 and c.rollout.adapters and c.rollout._base_checked
    assert m["sync/bytes"] == 4 * peft_sync_elements(RANK)  # fp32 adapters, nothing else
    # an engine holding another adapter than the actor's is caught by the sync's check
    wrong = [("model.layers.1.mlp.down_proj.lora_B.weight", torch.ones(hidden_size(), RANK))]
    c.rollout.load_bucket([wrong] + [[]] * (c.rollout.size - 1))
    with pytest.raises(WeightSyncError, match=r"rollout engine\(s\) \[0\]"):
        c.rollout.verify(c.actor)
    c.rollout.sync_from(c.actor)  # and the next sync puts the actor's back
    out = tmp / "export"
    c.actor.export(str(out), cfg.actor_rollout_ref.model.path)
    adapter_dir = out / "lora_adapter"
    pc = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (pc["r"], pc["lora_alpha"], pc["base_model_name_or_path"]) == (RANK, ALPHA, os.path.abspath(TINY_MODEL))

    # the merged weights, from the files alone: W + (alpha / r) B A per HF projection; the rest is the base
    merged, base = load_file(str(out / "model.safetensors")), load_file(os.path.join(TINY_MODEL, "model.safetensors"))
    ad = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert merged.keys() == base.keys()
    adapted = 0
    for k, w in base.items():
        a_key = "base_model.model." + k[: -len(".weight")] + ".lora_A.weight"
        if a_key in ad:
            want = w.float() + ALPHA / RANK * ad[a_key.replace("lora_A", "lora_B")].float() @ ad[a_key].float()
            assert (merged[k] - want).abs().max() < 1e-6, k
            adapted += 1
        else:
            assert torch.equal(merged[k], w), k  # embeddings, norms, biases: untouched
    assert adapted == 4 * 7  # q, k, v, o, gate, up, down in each of 4 layers

    batch = random_batch(16, 6, 6, seed=2)
    actor = c.actor.log_probs_with_entropy(StepData(batch, c.transport), FWD)[0].fetch()["old_log_probs"]
    mask = batch.response_mask.bool()
    from transformers import AutoModelForCausalLM

    peft_err = rel_err(actor, logp_under(peft_model(str(adapter_dir)), batch), mask)
    merged_err = rel_err(actor, logp_under(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), batch), mask)
    print(f"exported peft adapter vs actor: {peft_err:.3g}; merged export vs actor: {merged_err:.3g} "
          f"(largest |log p| {actor[mask].abs().max():.3g})")
    assert peft_err < 1e-5 and merged_err < 1e-5
