"""Mixture of experts through the bridge: Qwen3-MoE (renormalised top-k) and Qwen2-MoE (shared expert
with a sigmoid gate, qkv bias) converted HF -> megatron-core MoE layers (router in fp32, SequentialMLP
experts, the all-to-all token dispatcher on gloo): log-probs equal transformers' at EP=1 and EP=2
(experts split over two ranks), the streamed export equals the HF checkpoint bit for bit at both, and a
train step at EP=2 equals EP=1 (loss, grad norm, updated weights)."""

import pytest
import torch

from bridge_tiny import hf_reference, make_hf, random_seqs

MOE = {
    "qwen3_moe": dict(num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
}


def loss_fn(outs, mb):
    m = mb["loss_mask"].float()
    return (-(mb["adv"] * outs["logprobs"]) * m).sum() / mb["n_total"], {}


def moe_job(src: str, seqs):
    import torch.distributed as dist

    from bridge_tiny import gather_hf
    from megatron_bridge.convert import load_hf_weights
    from megatron_bridge.hf_config import read_hf_config
    from megatron_bridge.launch import set_parallel
    from megatron_bridge.logprobs import compute_logprobs, model_inputs, pack_sequences, pad_sequences
    from megatron_bridge.model import build_model, unwrap
    from megatron_bridge.train import OptimConfig, make_trainer, train_step

    hf = read_hf_config(src)
    mbs = [pad_sequences(seqs[:3], side="left"), pack_sequences(seqs[3:], max_tokens=64)[0]]
    mbs[1] = {"input_ids": mbs[1]["input_ids"], "cu_seqlens": mbs[1]["cu_seqlens"]}
    g = torch.Generator().manual_seed(4)
    total = sum(int(model_inputs(mb).token_valid.sum()) for mb in mbs)
    for mb in mbs:
        inp = model_inputs(mb)
        mb.update(loss_mask=inp.token_valid, adv=torch.randn(inp.input_ids.shape, generator=g), n_total=float(total))
    out = {}
    for lname, ep in (("ep1", 1), ("ep2", 2)):
        set_parallel(tp=1, pp=1, ep=ep)
        model = build_model(hf)
        load_hf_weights(model, src)
        m = unwrap(model)
        out[(lname, "local")] = (m.num_local_experts, m.expert_offset)
        out[(lname, "export")] = gather_hf(model)
        out[(lname, "logprobs")] = compute_logprobs(model, [{k: mb[k] for k in ("input_ids", "attention_mask", "cu_seqlens")
                                                             if k in mb} for mb in mbs], temperature=0.8)
        tr = make_trainer(model, OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.0))
        out[(lname, "step")] = train_step(tr, mbs, loss_fn, temperature=0.8)
        out[(lname, "trained")] = gather_hf(tr.model)
    return out if dist.get_rank() == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MOE))
def test_moe_matches_transformers_and_ep2_matches_ep1(tmp_path, kind):
    from safetensors.torch import load_file

    from megatron_bridge.launch import spawn
    from megatron_bridge.logprobs import unpack

    src = str(tmp_path / "m")
    model = make_hf(kind, src, **MOE[kind])
    seqs = random_seqs([7, 12, 4, 9, 5, 6], seed=3)
    out = spawn(moe_job, 2, src, seqs)[0]
    assert out[("ep1", "local")] == (4, 0) and out[("ep2", "local")] == (2, 0)  # rank 0 holds experts 0-1 at EP=2
    ckpt = load_file(f"{src}/model.safetensors")
    for lname in ("ep1", "ep2"):
        exp = out[(lname, "export")]
        assert sorted(exp) == sorted(k for k in ckpt if not (k == "lm_head.weight" and model.config.tie_word_embeddings))
        assert all(torch.equal(exp[k], ckpt[k]) for k in exp), lname  # HF -> megatron -> HF bit-identical
    ref = hf_reference(model, seqs, temperature=0.8)
    for lname in ("ep1", "ep2"):
        left, packed = out[(lname, "logprobs")]
        for i, (rlp, _) in enumerate(ref[:3]):  # left-padded rows: the last len-1 positions
            n = len(seqs[i])
            assert torch.allclose(left["logprobs"][i, -n + 1:], rlp, atol=2e-5), (lname, i)
        cu = torch.tensor([0] + [len(s) for s in seqs[3:]]).cumsum(0)
        for got, (rlp, _) in zip(unpack(packed["logprobs"], cu), ref[3:]):
            assert torch.allclose(got[1:], rlp, atol=2e-5), lname
    a, b = out[("ep2", "step")], out[("ep1", "step")]
    assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * max(1, b["grad_norm"])
    t1, t2 = out[("ep1", "trained")], out[("ep2", "trained")]
    moved = max(float((t1[k] - ckpt[k]).abs().max()) for k in t1)
    worst = max(float((t1[k] - t2[k]).abs().max()) for k in t1)
    assert moved > 1e-3 and worst < 1e-5, (moved, worst)
    experts_moved = [k for k in t1 if ".experts." in k and float((t1[k] - ckpt[k]).abs().max()) > 0]
    assert experts_moved  # the experts themselves trained
