"""GPU-only checks (skipped with a reason on CPU): the transformer-engine layer spec with real THD
packed attention, nccl, bf16 training, the distributed optimizer, and TE <-> local checkpoint loading.

Run on a lent GPU: ``python -m pytest tests/megatron_bridge/test_bridge_gpu.py -m gpu -q``.
"""

import pytest
import torch

from bridge_tiny import CASES, hf_reference, make_case, random_seqs

pytestmark = pytest.mark.gpu

SEQS_LENS = [9, 3, 14, 6]


def _ngpu() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def te_parity_job(dirs, seqs):
    from megatron_bridge.convert import load_hf_weights
    from megatron_bridge.hf_config import read_hf_config
    from megatron_bridge.logprobs import compute_logprobs, pack_sequences, pad_sequences
    from megatron_bridge.model import build_model

    out = {}
    for case, d in dirs.items():
        hf = read_hf_config(d)
        model = build_model(hf)
        assert model.uses_te, "TE spec expected with CUDA + transformer-engine"
        load_hf_weights(model, d)
        left = pad_sequences(seqs, side="left")
        packs = pack_sequences(seqs, max_tokens=20)
        r_left = compute_logprobs(model, [left], temperature=0.7, with_entropy=True)[0]
        r_pk = compute_logprobs(model, [{k: p[k] for k in ("input_ids", "cu_seqlens")} for p in packs],
                                temperature=0.7, with_entropy=True)
        per = [None] * len(seqs)
        from megatron_bridge.logprobs import unpack

        for p, r in zip(packs, r_pk):
            for j, lp in zip(p["index"].tolist(), unpack(r["logprobs"], p["cu_seqlens"])):
                per[j] = lp[1:]
        out[case] = ([r_left["logprobs"][i][left["attention_mask"][i]][1:] for i in range(len(seqs))], per)
    return out


@pytest.mark.skipif(_ngpu() < 1, reason="needs a CUDA GPU")
def test_te_spec_logprob_parity_padded_and_thd(tmp_path):
    pytest.importorskip("transformer_engine")
    from megatron_bridge.launch import spawn

    seqs = random_seqs(SEQS_LENS, seed=3)
    dirs, refs = {}, {}
    for case in CASES:
        d = str(tmp_path / case)
        refs[case] = hf_reference(make_case(case, d), seqs, 0.7)
        dirs[case] = d
    out = spawn(te_parity_job, 1, dirs, seqs)[0]
    for case, (left, packed) in out.items():
        for (rlp, _), a, b in zip(refs[case], left, packed):
            assert float((a - rlp).abs().max()) < 1e-4, case
            assert float((b - rlp).abs().max()) < 1e-4, case


def bf16_train_job(src, seqs):
    from megatron_bridge.convert import load_hf_weights
    from megatron_bridge.hf_config import read_hf_config
    from megatron_bridge.logprobs import pad_sequences
    from megatron_bridge.model import build_model
    from megatron_bridge.train import OptimConfig, make_trainer, train_step

    hf = read_hf_config(src)
    model = build_model(hf, params_dtype=torch.bfloat16)
    load_hf_weights(model, src)
    tr = make_trainer(model, OptimConfig(optimizer="adam", lr=1e-3, clip_grad=1.0))
    mb = pad_sequences(seqs, side="left")

    def loss(outs, m):
        mask = m["attention_mask"].float()
        return -(outs["logprobs"] * mask).sum() / mask.sum(), {}

    return [train_step(tr, [mb], loss) for _ in range(4)]


@pytest.mark.skipif(_ngpu() < 1, reason="needs a CUDA GPU")
def test_bf16_train_step_te(tmp_path):
    pytest.importorskip("transformer_engine")
    from megatron_bridge.launch import spawn

    src = str(tmp_path / "m")
    make_case("qwen3_qknorm_gqa1_untied", src)
    hist = spawn(bf16_train_job, 1, src, random_seqs(SEQS_LENS, seed=1))[0]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    assert hist[-1]["loss"] < hist[0]["loss"]  # fitting the same batch must lower its NLL


def tp2_job(src, seqs, use_dist_opt):
    from bridge_tiny import gather_hf
    from megatron_bridge.convert import load_hf_weights
    from megatron_bridge.hf_config import read_hf_config
    from megatron_bridge.launch import set_parallel
    from megatron_bridge.logprobs import pad_sequences
    from megatron_bridge.model import build_model
    from megatron_bridge.train import OptimConfig, make_trainer, train_step

    hf = read_hf_config(src)
    mb = pad_sequences(seqs, side="right")

    def loss(outs, m):
        mask = m["attention_mask"].float()
        return -(outs["logprobs"] * mask).sum() / mask.sum(), {}

    res = {}
    for name, tp, dist_opt in (("tp1", 1, False), ("tp2", 2, False), ("dp2_distopt", 1, use_dist_opt)):
        set_parallel(tp=tp)
        m = build_model(hf)
        load_hf_weights(m, src)
        tr = make_trainer(m, OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.0, use_distributed_optimizer=dist_opt))
        h = [train_step(tr, [mb], loss) for _ in range(2)]
        res[name] = (h, {k: v.float().cpu() for k, v in gather_hf(tr.model).items()})
    return res


@pytest.mark.skipif(_ngpu() < 2, reason="needs 2 CUDA GPUs (nccl TP=2, distributed optimizer)")
def test_nccl_tp2_and_distributed_optimizer_match_tp1(tmp_path):
    from megatron_bridge.launch import spawn

    src = str(tmp_path / "m")
    make_case("llama_gqa2_untied_llama3rope", src)
    res = spawn(tp2_job, 2, src, random_seqs(SEQS_LENS, seed=2), True)[0]
    ref_h, ref_p = res["tp1"]
    for name in ("tp2", "dp2_distopt"):
        h, p = res[name]
        assert all(abs(a["loss"] - b["loss"]) < 1e-4 for a, b in zip(h, ref_h)), name
        assert max(float((p[k] - ref_p[k]).abs().max()) for k in ref_p) < 1e-4, name


def te_ckpt_job(src, root, seqs):
    from megatron_bridge.checkpoint import load_checkpoint, save_checkpoint
    from megatron_bridge.convert import load_hf_weights
    from megatron_bridge.hf_config import read_hf_config
    from megatron_bridge.logprobs import compute_logprobs, pad_sequences
    from megatron_bridge.model import build_model

    hf = read_hf_config(src)
    te = build_model(hf, use_te=True)
    load_hf_weights(te, src)
    save_checkpoint(f"{root}/ck", te)
    local = build_model(hf, use_te=False)
    load_checkpoint(f"{root}/ck", local)
    mb = pad_sequences(seqs, side="right")
    return [compute_logprobs(m, [mb])[0]["logprobs"] for m in (te, local)]


@pytest.mark.skipif(_ngpu() < 1, reason="needs a CUDA GPU")
def test_te_checkpoint_loads_into_local_spec(tmp_path):
    pytest.importorskip("transformer_engine")
    from megatron_bridge.launch import spawn

    src = str(tmp_path / "m")
    make_case("qwen2_bias_gqa2_tied", src)
    a, b = spawn(te_ckpt_job, 1, src, str(tmp_path), random_seqs(SEQS_LENS, seed=5))[0]
    assert float((a - b).abs().max()) < 1e-4
