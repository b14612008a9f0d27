"""Virtual pipeline stages (megatron's interleaved 1F1B): PP=2 x VPP=2 must reproduce PP=1 and PP=2
for log-probs (padded left / right and packed micro-batches), for train steps (loss, grad norm,
parameters; policy with tied embeddings, whose embedding and output copies sit on different ranks'
different chunks, and critic), and a checkpoint written at PP2 x VPP2 must resume at PP=1 with its
optimizer state (the next step equals the one PP2 x VPP2 takes itself)."""

import pytest
import torch

from bridge_tiny import loss_micro_batches, make_hf, policy_loss, random_seqs, value_loss

LAYOUTS = (("pp1", 1, 1), ("pp2", 2, 1), ("pp2vpp2", 2, 2))


def vpp_job(src: str, seqs, ckpt: str):
    import torch.distributed as dist

    from bridge_tiny import gather_hf
    from megatron_bridge.checkpoint import load_checkpoint, save_checkpoint
    from megatron_bridge.convert import load_hf_weights
    from megatron_bridge.hf_config import read_hf_config
    from megatron_bridge.launch import set_parallel
    from megatron_bridge.logprobs import compute_logprobs
    from megatron_bridge.model import build_model, chunks, unwrap
    from megatron_bridge.train import OptimConfig, make_trainer, train_step

    hf = read_hf_config(src)
    mbs = loss_micro_batches(seqs, seed=3)
    fwd = [{k: mb[k] for k in ("input_ids", "attention_mask", "cu_seqlens") if k in mb} for mb in mbs]
    out = {}
    for lname, pp, vpp in LAYOUTS:
        set_parallel(tp=1, pp=pp, vpp=vpp)
        model = build_model(hf)
        load_hf_weights(model, src)
        cs = chunks(model)
        out[(lname, "n_chunks")] = len(cs)
        out[(lname, "layers")] = sorted(unwrap(c).layer_offset for c in cs)
        out[(lname, "logprobs")] = compute_logprobs(model, fwd, temperature=0.8, with_entropy=True)
        for role in ("policy", "critic"):
            m = model if role == "policy" else build_model(hf, value_head=True)
            if role == "critic":
                load_hf_weights(m, src)
            opt = OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.05) if role == "policy" else \
                OptimConfig(optimizer="adam", lr=1e-2)
            tr = make_trainer(m, opt)
            fn = policy_loss if role == "policy" else value_loss
            hist = [train_step(tr, mbs, fn, with_entropy=role == "policy", temperature=0.9) for _ in range(2)]
            if role == "critic" and lname == "pp2vpp2":
                save_checkpoint(ckpt, tr.model, tr.optimizer, tr.scheduler, extra={"step": 2})
                hist.append(train_step(tr, mbs, fn))  # the step a resume must reproduce
            out[(lname, role)] = (hist, gather_hf(tr.model))
    # resume the PP2 x VPP2 critic checkpoint at PP=1 (layout-free, optimizer state included)
    set_parallel(tp=1, pp=1)
    m = build_model(hf, value_head=True)
    tr = make_trainer(m, OptimConfig(optimizer="adam", lr=1e-2))
    extra = load_checkpoint(ckpt, tr.model, tr.optimizer, tr.scheduler)
    out["resumed"] = (extra, train_step(tr, mbs, value_loss), gather_hf(tr.model))
    return out if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_pp2_vpp2_matches_pp1_and_resumes_at_pp1(tmp_path):
    from megatron_bridge.launch import spawn

    src = str(tmp_path / "m")
    make_hf("qwen2", src, num_key_value_heads=2, tie_word_embeddings=True, num_hidden_layers=4)
    seqs = random_seqs([6, 9, 4, 11, 5, 7, 3], seed=5)
    out = spawn(vpp_job, 2, src, seqs, str(tmp_path / "ckpt"))[0]
    # the interleaved layout really is in place: two chunks on rank 0 holding layers 0 and 2
    assert out[("pp2vpp2", "n_chunks")] == 2 and out[("pp2vpp2", "layers")] == [0, 2]
    assert out[("pp2", "n_chunks")] == 1 and out[("pp2", "layers")] == [0]
    ref = out[("pp1", "logprobs")]
    for lname in ("pp2", "pp2vpp2"):
        for a, b in zip(out[(lname, "logprobs")], ref):
            for k in ("logprobs", "entropy"):
                assert torch.allclose(a[k], b[k], atol=1e-5, rtol=0), (lname, k, float((a[k] - b[k]).abs().max()))
    init = None
    for role in ("policy", "critic"):
        ref_hist, ref_params = out[("pp1", role)]
        assert ref_hist[0]["loss"] != ref_hist[1]["loss"]
        for lname in ("pp2", "pp2vpp2"):
            hist, params = out[(lname, role)]
            for a, b in zip(hist, ref_hist):
                assert abs(a["loss"] - b["loss"]) < 1e-5, (lname, role, a, b)
                assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * max(1.0, b["grad_norm"]), (lname, role, a, b)
            if lname == "pp2vpp2" and role == "critic":
                continue  # it took a third step (below)
            assert sorted(params) == sorted(ref_params)
            worst = max(float((params[k] - ref_params[k]).abs().max()) for k in params)
            assert worst < 1e-5, (lname, role, worst)
        if role == "policy":
            from safetensors.torch import load_file

            init = load_file(f"{src}/model.safetensors")
            moved = max(float((ref_params[k] - init[k]).abs().max()) for k in ref_params if k in init)
            assert moved > 1e-3 and ref_hist[0]["grad_norm"] > 0.05  # trained, with clipping active
    extra, m3, params3 = out["resumed"]
    hist, params = out[("pp2vpp2", "critic")]
    assert extra == {"step": 2}
    assert abs(m3["loss"] - hist[2]["loss"]) < 1e-5 and abs(m3["grad_norm"] - hist[2]["grad_norm"]) < 1e-5
    worst = max(float((params3[k] - params[k]).abs().max()) for k in params)
    assert worst < 1e-5, worst
