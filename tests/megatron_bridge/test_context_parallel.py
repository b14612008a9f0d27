"""Context parallelism on the bridge's attention: CP=2 must reproduce CP=1 (each rank holding two of
each sequence's four load-balanced chunks) for log-probs and entropy (padded left / right and packed
micro-batches, sequences of lengths that need padding, one shorter than the four chunks), for train
steps (loss, grad norm, parameters; policy with clipping, critic with Adam), and through a checkpoint
written at CP=2 and resumed at CP=1."""

import pytest
import torch

from bridge_tiny import loss_micro_batches, make_case, make_hf, policy_loss, random_seqs, value_loss


def cp_job(src: str, seqs, ckpt: str):
    import torch.distributed as dist

    from bridge_tiny import gather_hf
    from megatron_bridge.checkpoint import load_checkpoint, save_checkpoint
    from megatron_bridge.convert import load_hf_weights
    from megatron_bridge.hf_config import read_hf_config
    from megatron_bridge.launch import set_parallel
    from megatron_bridge.logprobs import compute_logprobs
    from megatron_bridge.model import build_model
    from megatron_bridge.train import OptimConfig, make_trainer, train_step

    import megatron_bridge.context_parallel as cpm

    calls = []  # the CP attention really runs, on half of each padded sequence per rank
    real_attention = cpm.attention
    cpm.attention = lambda q, k, v, plan, scale: calls.append((q.shape[0], int(plan.padded_cu[-1]))) or \
        real_attention(q, k, v, plan, scale)
    hf = read_hf_config(src)
    mbs = loss_micro_batches(seqs, seed=11)
    fwd = [{k: mb[k] for k in ("input_ids", "attention_mask", "cu_seqlens") if k in mb} for mb in mbs]
    out = {}
    for lname, cp in (("cp1", 1), ("cp2", 2)):
        calls.clear()
        set_parallel(tp=1, pp=1, cp=cp)
        model = build_model(hf)
        load_hf_weights(model, src)
        out[(lname, "logprobs")] = compute_logprobs(model, fwd, temperature=0.7, with_entropy=True)
        out[(lname, "calls")] = list(calls)
        for role in ("policy", "critic"):
            m = model if role == "policy" else build_model(hf, value_head=True)
            if role == "critic":
                load_hf_weights(m, src)
            opt = OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.05) if role == "policy" else \
                OptimConfig(optimizer="adam", lr=1e-2)
            tr = make_trainer(m, opt)
            fn = policy_loss if role == "policy" else value_loss
            hist = [train_step(tr, mbs, fn, with_entropy=role == "policy", temperature=0.9) for _ in range(2)]
            if role == "critic" and lname == "cp2":
                save_checkpoint(ckpt, tr.model, tr.optimizer, tr.scheduler, extra={"step": 2})
                hist.append(train_step(tr, mbs, fn))  # the step a resume must reproduce
            out[(lname, role)] = (hist, gather_hf(tr.model))
    set_parallel(tp=1, pp=1)  # CP=1, DP=2
    m = build_model(hf, value_head=True)
    tr = make_trainer(m, OptimConfig(optimizer="adam", lr=1e-2))
    extra = load_checkpoint(ckpt, tr.model, tr.optimizer, tr.scheduler)
    out["resumed"] = (extra, train_step(tr, mbs, value_loss), gather_hf(tr.model))
    return out if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_cp2_matches_cp1_and_resumes_at_cp1(tmp_path):
    from megatron_bridge.context_parallel import build_plan
    from megatron_bridge.launch import spawn
    from megatron_bridge.logprobs import model_inputs, pack_sequences

    # the split itself: lengths 6 and 3 pad to 8 and 4; rank 0 holds chunks 0 and 3 of each sequence
    row = pack_sequences([[1, 2, 3, 4, 5, 6], [7, 8, 9]], max_tokens=64)[0]
    plan = build_plan(model_inputs(row), cp=2, rank=0, group=None)
    assert plan.ids.tolist() == [[1, 2, 0, 0, 7, 0]] and plan.positions.tolist() == [[0, 1, 6, 7, 0, 3]]
    assert plan.cu_local.tolist() == [0, 4, 6] and plan.padded_cu.tolist() == [0, 8, 12]

    src = str(tmp_path / "m")
    make_case("qwen3_qknorm_gqa1_untied", src)  # q/k norm, GQA 4:1, head_dim != hidden / heads
    seqs = random_seqs([6, 9, 3, 11, 5, 7, 2], seed=8)
    out = spawn(cp_job, 2, src, seqs, str(tmp_path / "ckpt"))[0]
    # 3 layers x 3 micro-batches of CP attention, each rank's queries half of the padded tokens
    calls = out[("cp2", "calls")]
    assert out[("cp1", "calls")] == [] and len(calls) == 9 and all(2 * q == t for q, t in calls), calls
    for a, b in zip(out[("cp2", "logprobs")], out[("cp1", "logprobs")]):
        for k in ("logprobs", "entropy"):
            assert a[k].shape == b[k].shape
            assert torch.allclose(a[k], b[k], atol=1e-5, rtol=0), (k, float((a[k] - b[k]).abs().max()))
    for role in ("policy", "critic"):
        ref_hist, ref_params = out[("cp1", role)]
        hist, params = out[("cp2", role)]
        assert ref_hist[0]["loss"] != ref_hist[1]["loss"]
        for a, b in zip(hist, ref_hist):
            assert abs(a["loss"] - b["loss"]) < 1e-5, (role, a, b)
            assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * max(1.0, b["grad_norm"]), (role, a, b)
        if role == "policy":
            assert ref_hist[0]["grad_norm"] > 0.05  # clipping was active
            worst = max(float((params[k] - ref_params[k]).abs().max()) for k in params)
            assert sorted(params) == sorted(ref_params) and worst < 1e-5, worst
    extra, m3, params3 = out["resumed"]
    hist, params = out[("cp2", "critic")]
    assert extra == {"step": 2}
    assert abs(m3["loss"] - hist[2]["loss"]) < 1e-5 and abs(m3["grad_norm"] - hist[2]["grad_norm"]) < 1e-5
    worst = max(float((params3[k] - params[k]).abs().max()) for k in params)
    assert worst < 1e-5, worst


def cp_vpp_job(src: str, seqs):
    import torch.distributed as dist

    from bridge_tiny import gather_hf
    from megatron_bridge.convert import load_hf_weights
    from megatron_bridge.hf_config import read_hf_config
    from megatron_bridge.launch import set_parallel
    from megatron_bridge.logprobs import compute_logprobs
    from megatron_bridge.model import build_model
    from megatron_bridge.train import OptimConfig, make_trainer, train_step

    hf = read_hf_config(src)
    mbs = loss_micro_batches(seqs, seed=4)
    fwd = [{k: mb[k] for k in ("input_ids", "attention_mask", "cu_seqlens") if k in mb} for mb in mbs]
    out = {}
    for lname, par in (("plain", dict()), ("cp2_pp2_vpp2", dict(cp=2, pp=2, vpp=2))):
        set_parallel(tp=1, **par)
        model = build_model(hf)
        load_hf_weights(model, src)
        out[(lname, "logprobs")] = compute_logprobs(model, fwd, temperature=0.7, with_entropy=True)
        tr = make_trainer(model, OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.05))
        out[(lname, "steps")] = [train_step(tr, mbs, policy_loss, with_entropy=True, temperature=0.9) for _ in range(2)]
        out[(lname, "params")] = gather_hf(tr.model)
    return out if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_cp2_with_virtual_pipeline_matches_plain(tmp_path):
    """CP=2 inside an interleaved pipeline (PP=2 x VPP=2, 4 ranks): every micro-batch's per-rank share is
    padded with a dummy sequence to the largest share, so all exchanges between virtual stages have one
    shape; log-probs, entropy and two clipped SGD steps equal the plain layout's."""
    from megatron_bridge.context_parallel import build_plan, local_tokens
    from megatron_bridge.launch import spawn
    from megatron_bridge.logprobs import model_inputs, pack_sequences

    row = model_inputs(pack_sequences([[1, 2, 3, 4, 5, 6], [7, 8, 9]], max_tokens=64)[0])
    assert local_tokens(row, 2) == 6
    plan = build_plan(row, cp=2, rank=1, group=None, pad_local_to=10)  # + a dummy of 8 padded tokens
    assert plan.tokens == 10 and plan.padded_cu.tolist() == [0, 8, 12, 20]
    # rank 1 holds chunks 1 and 2 of each: tokens 3-6 of the first sequence, 8 and 9 of the second, dummy rows
    assert plan.ids.tolist() == [[3, 4, 5, 6, 8, 9, 0, 0, 0, 0]] and int((plan.local_index >= 0).sum()) == 6
    with pytest.raises(ValueError, match="below this micro-batch"):
        build_plan(row, cp=2, rank=0, group=None, pad_local_to=4)

    src = str(tmp_path / "m")
    make_hf("qwen3", src, num_key_value_heads=1, head_dim=32, num_hidden_layers=4, tie_word_embeddings=True)
    seqs = random_seqs([6, 9, 3, 11, 5, 7, 2], seed=9)
    out = spawn(cp_vpp_job, 4, src, seqs)[0]
    for a, b in zip(out[("cp2_pp2_vpp2", "logprobs")], out[("plain", "logprobs")]):
        for k in ("logprobs", "entropy"):
            assert torch.allclose(a[k], b[k], atol=1e-5, rtol=0), (k, float((a[k] - b[k]).abs().max()))
    for a, b in zip(out[("cp2_pp2_vpp2", "steps")], out[("plain", "steps")]):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * max(1, b["grad_norm"])
    p, q = out[("cp2_pp2_vpp2", "params")], out[("plain", "params")]
    assert sorted(p) == sorted(q) and max(float((p[k] - q[k]).abs().max()) for k in p) < 1e-5
