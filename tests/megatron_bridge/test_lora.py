"""LoRA on the bridge's megatron model (:mod:`megatron_bridge.lora`), on real megatron-core with gloo.

One tiny Qwen2 (hidden 64, 4 query / 2 kv heads: GQA, SwiGLU, qkv bias, 2 layers), adapters of rank 8 and
alpha 16 (scale 2) on every decoder linear. One two-rank job runs it at TP=1, TP=2 and TP=2 with sequence
parallelism (right-padded rows of odd width, so SP pads them), and a Qwen2-MoE at TP=1, TP=2 + SP and EP=2,
and hands back logits, log-probs, adapters and their gradients; the tests below check them:

* ``B = 0`` (the init) leaves the logits bit for bit the base model's; a random ``B`` moves them; under
  ``adapters_disabled`` they are the base's bit for bit again (the reference policy's path).
* only the adapters require grad, and a backward reaches all of them and nothing else (also with full
  activation recompute, where the frozen embedding would otherwise cut the graph).
* TP=2 and TP=2+SP hold the same initial adapter as TP=1 (bit for bit) and give the same logits and adapter
  gradients (TP shards merged) within 1e-5.
* transformers + peft, with the adapter written by ``lora_state_to_peft`` + ``peft_adapter_config`` and
  loaded by ``PeftModel.from_pretrained``, gives the same log-probs, and the same adapter gradients once
  converted back (the fused layers' shared ``A`` gets the sum of peft's per-part gradients).
* a model whose base weights are ``merged_weight`` gives the LoRA model's logits (TP=1 and TP=2 shards).
* a TP=2 checkpoint (``megatron_bridge.checkpoint``) loads at TP=1 with the same adapters (the split
  factors are saved as shards, ``linear_fc1``'s ``B`` as gate/up halves).
* MoE: adapters on the routed experts (split over the expert-TP group at TP=2, over ranks at EP=2) and on the
  shared expert give TP=1's logits and gradients.

Every TP/EP comparison fails by 0.1 or more if any one of the module's communications (the ``u`` all-reduce /
reduce-scatter / gather, the replicated factor's gradient all-reduce) is dropped: checked by hand, one at a time.
"""

import json

import pytest
import torch

from bridge_tiny import VOCAB, make_hf, random_seqs
from megatron_bridge import lora

RANK, ALPHA, SEED = 8, 16, 3
LENGTHS = [9, 4, 7]  # right-padded to width 9 (odd: sequence parallelism pads it to 10)
HF_KW = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
# Qwen2-MoE: 4 routed experts (top 2) and a gated shared expert; make_hf draws a far-from-uniform router, so the
# rounding differences between layouts flip no expert choice
MOE_KW = dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, norm_topk_prob=False)
MOE_LAYOUTS = {"moe_tp1": dict(tp=1), "moe_tp2_sp": dict(tp=2), "moe_ep2": dict(tp=1, ep=2)}


def _random_b(full: dict, seed: int = 11) -> dict:
    """The TP=1 adapter with every ``B`` replaced by N(0, 0.05^2) draws (same values at every layout)."""
    g = torch.Generator().manual_seed(seed)
    return {k: (0.05 * torch.randn(v.shape, generator=g) if k.endswith("lora_B.weight") else v.clone())
            for k, v in sorted(full.items())}


def lora_job(src: str, moe_src: str, seqs: list, adv: torch.Tensor, ckpt: str):
    import torch.distributed as dist
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_bridge.checkpoint import load_checkpoint, save_checkpoint
    from megatron_bridge.convert import iter_local_params, load_hf_weights
    from megatron_bridge.hf_config import read_hf_config
    from megatron_bridge.launch import set_parallel
    from megatron_bridge.logprobs import head_outputs, model_inputs, pad_sequences, run_model
    from megatron_bridge.model import build_model

    hf = read_hf_config(src)
    inp = model_inputs(pad_sequences(seqs, side="right"))

    def forward(model):
        out = run_model(model, inp)  # [B, S, V/tp]
        lp = head_outputs(model, out, inp)["logprobs"]  # [B, S]
        with torch.no_grad():
            logits = gather_from_tensor_model_parallel_region(out.detach())[..., :VOCAB]  # [B, S, V]
        return logits.clone(), lp

    def loss_of(lp):
        return -(adv * lp * inp.token_valid).sum()

    def fresh(path=src, **kw):
        m = build_model(read_hf_config(path), use_te=False, **kw)  # LoRA wraps the local spec's linears
        load_hf_weights(m, path)
        return m

    def with_lora(path=src, **kw):
        return lora.apply_lora(fresh(path, **kw), rank=RANK, alpha=ALPHA, seed=SEED)

    def merged_logits(model, **kw):
        merged = lora.merged_local_weights(model)  # this rank's shards of W + s B A
        base = fresh(**kw)
        with torch.no_grad():
            for _, can, p in iter_local_params(base):
                if can in merged:
                    p.copy_(merged[can])
            return forward(base)[0]

    out = {}
    # ---- TP=1: the base model, then the same model with adapters
    set_parallel(tp=1)
    model = fresh()
    with torch.no_grad():
        out["base"] = forward(model)[0]
    trainable_before = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora.apply_lora(model, rank=RANK, alpha=ALPHA, seed=SEED)
    with torch.no_grad():
        out["zero_b"] = forward(model)[0]
    init = lora.adapter_state_dict(model, full=True)
    out["init"] = init
    state = _random_b(init)
    lora.load_adapter_state(model, state)
    out["state"] = state
    logits, lp = forward(model)
    loss_of(lp).backward()
    out["lora"], out["lp"] = logits, lp.detach()
    out["grads"] = lora.adapter_grads(model, full=True)
    adapters = {id(p) for p in lora.lora_parameters(model)}
    out["requires_grad"] = {n: p.requires_grad for n, p in model.named_parameters()}
    out["with_grad"] = sorted(n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0)
    out["n_adapters"] = (len(adapters), sum(p.numel() for p in lora.lora_parameters(model)), trainable_before)
    with torch.no_grad(), lora.adapters_disabled(model):
        out["disabled"] = forward(model)[0]
    with torch.no_grad():
        out["reenabled"] = forward(model)[0]
        for _, m in lora.lora_modules(model):
            m.lora_dropout = 0.5
        model.eval()  # dropout is a training-time operation
        out["dropout_eval"] = forward(model)[0]
        model.train()
        out["dropout_train"] = forward(model)[0]
        for _, m in lora.lora_modules(model):
            m.lora_dropout = 0.0
    out["merged"] = merged_logits(model)
    out["bad_target"] = None
    try:
        lora.apply_lora(fresh(), rank=RANK, target_modules=["q_proj"])  # an HF name: matches nothing here
    except ValueError as e:
        out["bad_target"] = str(e)
    # full activation recompute: the same gradients (the frozen embedding's output is marked to need grad)
    rc = with_lora(recompute={"recompute_granularity": "full", "recompute_method": "uniform",
                              "recompute_num_layers": 1})
    lora.load_adapter_state(rc, state)
    loss_of(forward(rc)[1]).backward()
    out["grads_recompute"] = lora.adapter_grads(rc, full=True)

    # ---- TP=2 and TP=2 + sequence parallelism, from the same HF weights and the same adapter
    for name, kw in (("tp2", {}), ("tp2_sp", {"sequence_parallel": True})):
        set_parallel(tp=2)
        model = with_lora(**kw)
        out[name + "_init"] = lora.adapter_state_dict(model, full=True)
        out[name + "_local_shapes"] = {k: tuple(v.shape) for k, v in lora.adapter_state_dict(model).items()}
        lora.load_adapter_state(model, state)
        logits, lp = forward(model)
        loss_of(lp).backward()
        out[name] = logits
        out[name + "_grads"] = lora.adapter_grads(model, full=True)
        out[name + "_merged"] = merged_logits(model, **kw)
        if name == "tp2":
            save_checkpoint(ckpt, model)
    # ---- the TP=2 checkpoint, loaded at TP=1 into a model with another adapter
    set_parallel(tp=1)
    model = lora.apply_lora(fresh(), rank=RANK, alpha=ALPHA, seed=SEED + 1)
    first = next(iter(state))  # an A: another seed draws another one
    out["reseeded_differs"] = not torch.equal(lora.adapter_state_dict(model)[first], state[first])
    load_checkpoint(ckpt, model)
    out["from_ckpt"] = lora.adapter_state_dict(model, full=True)

    # ---- mixture of experts: TP=2 (experts split over the expert-TP group: the dispatcher gathers their inputs
    # and reduces their partial outputs; megatron trains MoE under TP only with sequence parallelism) and EP=2
    # (each rank holds 2 of the 4 experts) against TP=1
    moe_state = None
    for name, layout in MOE_LAYOUTS.items():
        set_parallel(**layout)
        model = with_lora(moe_src, sequence_parallel=layout["tp"] > 1)
        if moe_state is None:
            moe_state = _random_b(lora.adapter_state_dict(model, full=True))
            out["moe_state_names"] = sorted(moe_state)
        lora.load_adapter_state(model, moe_state)  # at EP=2 this rank's experts only
        logits, lp = forward(model)
        loss_of(lp).backward()
        out[name] = logits
        out[name + "_grads"] = lora.adapter_grads(model, full=True)  # at EP=2 this rank's experts only
    keep = ("tp2", "tp2_grads", "tp2_sp", "tp2_sp_grads", *MOE_LAYOUTS, *(n + "_grads" for n in MOE_LAYOUTS))
    return out if dist.get_rank() == 0 else {k: out[k] for k in keep}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from megatron_bridge.launch import spawn

    d = tmp_path_factory.mktemp("lora")
    src, moe_src = str(d / "qwen2"), str(d / "qwen2_moe")
    hf_model = make_hf("qwen2", src, seed=5, **HF_KW)
    make_hf("qwen2_moe", moe_src, seed=6, **MOE_KW)
    seqs = random_seqs(LENGTHS, seed=2)
    adv = torch.randn(len(seqs), max(LENGTHS), generator=torch.Generator().manual_seed(9))  # [B, S]
    results = spawn(lora_job, 2, src, moe_src, seqs, adv, str(d / "ckpt"))
    return {"out": results[0], "ranks": results, "src": src, "seqs": seqs, "adv": adv, "hf_model": hf_model}


def _maxdiff(a, b) -> float:
    return float((a - b).abs().max())


@pytest.mark.slow
def test_zero_b_is_the_base_model_and_disabled_adapters_are_too(job):
    o = job["out"]
    assert torch.equal(o["zero_b"], o["base"])  # B = 0: h = W x + s * B A x adds exact zeros
    assert _maxdiff(o["lora"], o["base"]) > 1e-2  # a random B moves every layer's output
    assert torch.equal(o["disabled"], o["base"])  # adapters off: the base model, bit for bit
    assert torch.equal(o["reenabled"], o["lora"])  # and back on after the context
    assert torch.equal(o["dropout_eval"], o["lora"])  # dropout only while training
    assert _maxdiff(o["dropout_train"], o["lora"]) > 1e-3
    assert "q_proj" in o["bad_target"]


@pytest.mark.slow
def test_only_the_adapters_train(job):
    o = job["out"]
    n_modules, n_params, trainable_before = o["n_adapters"]
    # 2 layers x 4 linears, an A and a B each; qkv: 64 in, 128 out (4 q + 2 k + 2 v heads of 16), fc1: 64 -> 192,
    # proj: 64 -> 64, fc2: 96 -> 64; rank 8: 8 * per layer (64+128 + 64+192 + 64+64 + 96+64) = 8 * 736
    assert n_modules == 16 and n_params == 2 * 8 * 736
    # before apply_lora every base parameter trained: embedding and output 256 x 64 each (vocab 250 padded), per
    # layer 2 norms of 64, qkv 128 x 64 + bias 128, proj 64 x 64, fc1 192 x 64, fc2 64 x 96; the final norm 64
    assert trainable_before == 2 * 256 * 64 + 2 * (128 + 128 * 65 + 64 * 64 + 192 * 64 + 64 * 96) + 64
    trainable = sorted(n for n, rg in o["requires_grad"].items() if rg)
    assert trainable == sorted(o["state"])  # at TP=1, PP=1 the parameter names are the canonical names
    assert o["with_grad"] == trainable  # every adapter got a non-zero gradient, nothing else got one
    worst = max(_maxdiff(o["grads_recompute"][k], o["grads"][k]) for k in o["grads"])
    assert worst < 1e-6, worst  # recompute: same gradients (none would be 0 without the embedding hook)


@pytest.mark.slow
def test_tp2_and_sequence_parallel_equal_tp1(job):
    o = job["out"]
    for name in ("tp2", "tp2_sp"):
        init = o[name + "_init"]
        assert sorted(init) == sorted(o["init"]) and all(torch.equal(init[k], o["init"][k]) for k in init), name
        shapes = o[name + "_local_shapes"]
        qkv = "decoder.layers.0.self_attention.linear_qkv"
        proj = "decoder.layers.0.self_attention.linear_proj"
        assert shapes[qkv + ".lora_A.weight"] == (8, 64) and shapes[qkv + ".lora_B.weight"] == (64, 8)  # B split
        assert shapes[proj + ".lora_A.weight"] == (8, 32) and shapes[proj + ".lora_B.weight"] == (64, 8)  # A split
    for rank_out in job["ranks"]:  # every TP rank holds the same full logits and merged gradients
        for name in ("tp2", "tp2_sp"):
            assert _maxdiff(rank_out[name], o["lora"]) < 1e-5, name
            g = rank_out[name + "_grads"]
            scale = max(float(v.abs().max()) for v in o["grads"].values())
            worst = max(_maxdiff(g[k], o["grads"][k]) for k in o["grads"])
            assert worst < 1e-5 * max(1.0, scale), (name, worst, scale)


@pytest.mark.slow
def test_moe_experts_tp2_and_ep2_equal_tp1(job):
    o = job["out"]
    names = o["moe_state_names"]
    experts = [n for n in names if ".mlp.experts.local_experts." in n]
    shared = [n for n in names if ".mlp.shared_experts." in n]
    assert len(experts) == 2 * 4 * 2 * 2 and len(shared) == 2 * 2 * 2  # layers x experts x (fc1, fc2) x (A, B)
    ref = o["moe_tp1_grads"]
    scale = max(float(v.abs().max()) for v in ref.values())
    assert min(float(ref[n].abs().max()) for n in experts) > 0  # every expert's adapter got a gradient
    for name in ("moe_tp2_sp", "moe_ep2"):
        grads = {}
        for rank_out in job["ranks"]:
            assert _maxdiff(rank_out[name], o["moe_tp1"]) < 1e-5, name
            grads.update(rank_out[name + "_grads"])  # EP=2: each rank holds half of the experts
        assert sorted(grads) == names
        if name == "moe_ep2":
            # EP=2 on 2 ranks is also DP=2, both ranks with the same batch: the all-to-all brings an expert the
            # tokens of both copies, so its gradient is twice TP=1's (megatron's DDP divides by DP at the
            # all-reduce, as for the base experts' weights); everything else is its rank's own batch
            grads = {k: v / 2 if k in experts else v for k, v in grads.items()}
        worst = max(_maxdiff(grads[k], ref[k]) for k in names)
        assert worst < 1e-5 * max(1.0, scale), (name, worst, scale)


@pytest.mark.slow
def test_merged_weights_equal_base_plus_lora(job):
    o = job["out"]
    assert _maxdiff(o["merged"], o["lora"]) < 1e-5
    assert _maxdiff(o["tp2_merged"], o["lora"]) < 1e-5  # merged TP shards: W_t + s B_t A / W_t + s B A_t
    assert _maxdiff(o["tp2_sp_merged"], o["lora"]) < 1e-5


@pytest.mark.slow
def test_tp2_checkpoint_loads_at_tp1(job):
    o = job["out"]
    assert o["reseeded_differs"]
    got = o["from_ckpt"]
    assert sorted(got) == sorted(o["state"]) and all(torch.equal(got[k], o["state"][k]) for k in got)


@pytest.mark.slow
def test_peft_on_transformers_gives_the_same_logprobs_and_gradients(job, tmp_path):
    from peft import PeftModel
    from safetensors.torch import save_file

    from megatron_bridge.hf_config import read_hf_config

    o, seqs, adv = job["out"], job["seqs"], job["adv"]
    hf = read_hf_config(job["src"])
    d = tmp_path / "adapter"
    d.mkdir()
    cfg = lora.peft_adapter_config(o["state"], hf, rank=RANK, alpha=ALPHA, base_model_name_or_path=job["src"])
    assert cfg["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(lora.lora_state_to_peft(o["state"], hf), str(d / "adapter_model.safetensors"))
    model = PeftModel.from_pretrained(job["hf_model"], str(d), is_trainable=True)
    model.train()
    loss, worst_lp = 0.0, 0.0
    for i, s in enumerate(seqs):  # each sequence alone: no padding on the transformers side
        logp = torch.log_softmax(model(input_ids=torch.tensor([s])).logits[0].float(), -1)  # [L, V]
        lp = logp[:-1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0]  # [L-1]: tokens 1..L-1
        worst_lp = max(worst_lp, _maxdiff(lp.detach(), o["lp"][i, 1:len(s)]))
        loss = loss - (adv[i, 1:len(s)] * lp).sum()
    assert worst_lp < 1e-5, worst_lp
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
    assert len(grads) == 2 * 2 * 7  # 2 layers x q, k, v, o, gate, up, down x A, B
    back = lora.peft_to_lora_state(grads, hf, combine_a="sum")
    assert sorted(back) == sorted(o["grads"])
    scale = max(float(v.abs().max()) for v in o["grads"].values())
    worst = max(_maxdiff(back[k], o["grads"][k]) for k in back)
    assert worst < 1e-5 * max(1.0, scale), (worst, scale)


# ---------------------------------------------------------------------------------------------------
# pure: layouts and names, no process group


def _hf(**kw):
    from trainer.hf_io import ArchConfig

    base = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16)
    base.update(kw)
    return ArchConfig(**base)


def test_peft_layout_golden_and_roundtrip():
    """q/k/v and gate/up rows of B go where convert.py puts the base weight's; A is copied to each part."""
    from megatron_bridge.convert import _fuse_qkv

    hf = _hf()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, RANK, generator=g) for n in (64, 32, 32))  # per-part B rows
    gate, up = torch.randn(96, RANK, generator=g), torch.randn(96, RANK, generator=g)
    a_qkv, a_fc1 = torch.randn(RANK, 64, generator=g), torch.randn(RANK, 64, generator=g)
    p = "decoder.layers.1."
    state = {p + "self_attention.linear_qkv.lora_A.weight": a_qkv,
             p + "self_attention.linear_qkv.lora_B.weight": _fuse_qkv(q, k, v, hf),
             p + "mlp.linear_fc1.lora_A.weight": a_fc1,
             p + "mlp.linear_fc1.lora_B.weight": torch.cat([gate, up])}
    peft = lora.lora_state_to_peft(state, hf)
    h = "base_model.model.model.layers.1."
    assert torch.equal(peft[h + "self_attn.k_proj.lora_B.weight"], k)
    assert torch.equal(peft[h + "self_attn.v_proj.lora_A.weight"], a_qkv)
    assert torch.equal(peft[h + "mlp.up_proj.lora_B.weight"], up)
    assert torch.equal(peft[h + "mlp.gate_proj.lora_A.weight"], a_fc1)
    # rows of the fused B, group 0 of 2: 2 query heads of 16, then k, then v (convert._fuse_qkv's interleave)
    fused = state[p + "self_attention.linear_qkv.lora_B.weight"]
    assert torch.equal(fused[32:48], k[:16]) and torch.equal(fused[64:96], q[32:])
    back = lora.peft_to_lora_state(peft, hf)
    assert sorted(back) == sorted(state) and all(torch.equal(back[n], state[n]) for n in state)
    # the adapted modules are not every q/k/v/gate/up of the model: peft gets a regex of exactly these
    cfg = lora.peft_adapter_config(state, hf, rank=RANK, alpha=ALPHA)
    assert isinstance(cfg["target_modules"], str)
    import re

    assert re.fullmatch(cfg["target_modules"], "model.layers.1.self_attn.q_proj")
    assert not re.fullmatch(cfg["target_modules"], "model.layers.0.self_attn.q_proj")
    # peft adapters with their own A per part have no fused equivalent; a q-only adapter has one (B_k = B_v = 0)
    bad = dict(peft)
    bad[h + "self_attn.k_proj.lora_A.weight"] = bad[h + "self_attn.k_proj.lora_A.weight"] + 1
    with pytest.raises(ValueError, match="different lora_A"):
        lora.peft_to_lora_state(bad, hf)
    q_only = {h + "self_attn.q_proj.lora_A.weight": a_qkv, h + "self_attn.q_proj.lora_B.weight": q}
    fused_q = lora.peft_to_lora_state(q_only, hf)[p + "self_attention.linear_qkv.lora_B.weight"]
    assert torch.equal(fused_q, _fuse_qkv(q, torch.zeros_like(k), torch.zeros_like(v), hf))


@pytest.mark.parametrize("tp", [2, 4])
def test_adapter_shards_split_like_the_base_weight(tp):
    """B of a column-parallel base splits like its weight (fc1: gate and up blocks), A of a row-parallel base
    like its weight's columns; the other factor is replicated; merging the shards gives the full tensor."""
    g = torch.Generator().manual_seed(1)
    cases = {"decoder.layers.0.self_attention.linear_qkv.lora_B.weight": ("row", (128, RANK)),
             "decoder.layers.0.mlp.linear_fc1.lora_B.weight": ("glu", (192, RANK)),
             "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.lora_B.weight": ("glu", (64, RANK)),
             "decoder.layers.0.mlp.linear_fc2.lora_A.weight": ("col", (RANK, 96)),
             "decoder.layers.0.self_attention.linear_proj.lora_B.weight": ("rep", (64, RANK)),
             "decoder.layers.0.self_attention.linear_qkv.lora_A.weight": ("rep", (RANK, 64))}
    for name, (kind, shape) in cases.items():
        assert lora.adapter_tp_kind(name) == kind, name
        full = torch.randn(shape, generator=g)
        shards = [lora.shard_adapter(name, full, tp, r) for r in range(tp)]
        assert torch.equal(lora.merge_adapter_shards(name, shards), full)
    fc1 = torch.arange(192.0)[:, None].expand(192, RANK)  # rows 0..95 gate, 96..191 up
    s1 = lora.shard_adapter("decoder.layers.0.mlp.linear_fc1.lora_B.weight", fc1, 2, 1)
    assert s1[:, 0].tolist() == list(range(48, 96)) + list(range(144, 192))  # rank 1: [gate_1; up_1]


def test_a_row_parallel_shard_steps_like_its_tp1_columns_under_fused_adam():
    """A row-parallel layer's A shard is a column slice of the full A: a strided view. The factor holds a
    contiguous copy, so torch's fused AdamW (which megatron_bridge.train switches on) steps each element with its
    own gradient; on the view itself it stepped about two thirds of the elements against the wrong sign (the TP=2
    LoRA run that drifted from TP=1 at its second update)."""
    name = "decoder.layers.0.mlp.linear_fc2.lora_A.weight"
    full, grad = torch.randn(RANK, 96), torch.randn(RANK, 96)
    ref = torch.nn.Parameter(full.clone())
    ref.grad = grad.clone()
    torch.optim.AdamW([ref], lr=1e-3, fused=True).step()  # TP=1: the whole A
    for r in range(2):
        shard = lora.shard_adapter(name, full, 2, r)
        factor = lora._Factor(shard)
        assert factor.weight.is_contiguous() and factor.weight.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
        factor.weight.grad = lora.shard_adapter(name, grad, 2, r).contiguous()  # megatron's main_grad: contiguous
        torch.optim.AdamW([factor.weight], lr=1e-3, fused=True).step()
        assert torch.allclose(factor.weight.detach(), lora.shard_adapter(name, ref.detach(), 2, r), atol=1e-7)


def test_target_matching():
    t = lora.is_target
    assert t("decoder.layers.0.self_attention.linear_qkv", lora.DEFAULT_TARGETS)
    assert t("decoder.layers.3.mlp.experts.local_experts.1.linear_fc2", ["linear_fc2"])
    assert t("decoder.layers.3.mlp.shared_experts.linear_fc1", ["linear_fc1"])
    assert not t("output_layer", [])  # empty targets: every decoder linear, never the output layer
    assert t("decoder.layers.1.mlp.linear_fc1", [])
    assert t("decoder.layers.0.mlp.linear_fc1", ["*.layers.0.*"])
    assert not t("decoder.layers.10.mlp.linear_fc1", ["*.layers.0.*"])
    assert not t("decoder.layers.0.self_attention.linear_qkv", lora.DEFAULT_TARGETS, ["*.layers.0.*"])
    assert t("decoder.layers.1.self_attention.linear_qkv", lora.DEFAULT_TARGETS, ["*.layers.0.*", "linear_fc1"])
    assert not t("decoder.layers.1.mlp.linear_fc1", lora.DEFAULT_TARGETS, ["linear_fc1"])
    assert lora.merged_weight(torch.ones(3, 2), torch.ones(1, 2), torch.full((3, 1), 0.5), 4.0).eq(3.0).all()
