"""Activation recompute (``enable_gradient_checkpointing`` / ``override_transformer_config.recompute_*``)
is megatron-core's own, running on CPU through the bridge's RNG shim: full (uniform, 1 layer per
checkpoint, and block) and selective recompute give exactly the gradients of no recompute, on a model
shape of its own (Llama, 4 query / 2 kv heads, 3 layers); the loop's settings resolve as verl's."""

import pytest
import torch

from bridge_tiny import make_hf, random_seqs

pytestmark = pytest.mark.slow

SETTINGS = {
    "none": None,
    "full uniform 1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full block 2": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
    "selective": {"recompute_granularity": "selective"},
}


def job(src):
    from megatron_bridge.convert import load_hf_weights
    from megatron_bridge.hf_config import read_hf_config
    from megatron_bridge.logprobs import pad_sequences
    from megatron_bridge.model import build_model
    from megatron_bridge.train import OptimConfig, make_trainer, train_step

    hf = read_hf_config(src)
    mbs = [pad_sequences(random_seqs(lens, seed=i)) for i, lens in enumerate([[5, 11, 3], [8, 2]])]

    def loss_fn(outs, mb):
        m = mb["attention_mask"].float()
        return -(outs["logprobs"] * m).sum() / m.sum(), {}

    out = {}
    for name, rc in SETTINGS.items():
        model = build_model(hf, recompute=rc)
        load_hf_weights(model, src)
        tr = make_trainer(model, OptimConfig(optimizer="sgd", lr=1e-1, weight_decay=0.0, clip_grad=0.0))
        m = train_step(tr, mbs, loss_fn)
        out[name] = (m["loss"], m["grad_norm"], {n: p.detach().clone() for n, p in model.named_parameters()},
                     model.config.recompute_granularity)
    return out


def test_recompute_gives_the_same_gradients(tmp_path):
    from megatron_bridge.launch import spawn

    src = str(tmp_path / "m")
    make_hf("llama", src, seed=7, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=48,
            intermediate_size=72)
    out = spawn(job, 1, src)[0]
    loss0, gn0, params0, g0 = out["none"]
    assert g0 is None and gn0 > 0
    for name in ("full uniform 1", "full block 2", "selective"):
        loss, gn, params, g = out[name]
        assert g == SETTINGS[name]["recompute_granularity"]  # megatron built it with recompute on
        assert loss == pytest.approx(loss0, rel=1e-6) and gn == pytest.approx(gn0, rel=1e-5), name
        for n in params0:  # the SGD step moved every weight the same way
            torch.testing.assert_close(params[n], params0[n], atol=1e-6, rtol=0, msg=f"{name}: {n}")


def test_recompute_settings_resolve_like_verl():
    from trainer.config import recompute_settings
    from tests.support.tiny import tiny_config

    c = tiny_config(["actor_rollout_ref.model.enable_gradient_checkpointing=true"])
    m = c.actor_rollout_ref.actor.megatron
    assert recompute_settings(True, m) == SETTINGS["full uniform 1"]
    assert recompute_settings(False, m) is None
    c = tiny_config(["actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=selective",
                     "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_modules=[core_attn]"])
    assert recompute_settings(False, c.actor_rollout_ref.actor.megatron) == {"recompute_granularity": "selective",
                                                                             "recompute_modules": ["core_attn"]}
