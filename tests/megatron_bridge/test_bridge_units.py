"""Single-process tests of the bridge's pure parts: config mapping, conversion, log-prob math, batching."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge_tiny import CASES, VOCAB, make_case, make_hf
from megatron_bridge.convert import (
    HFCheckpoint,
    _fuse_qkv,
    hf_to_megatron_shards,
    megatron_shards_to_hf,
    tp_merge,
    tp_shard,
)
from megatron_bridge.hf_config import (
    padded_vocab_size,
    pipeline_layout,
    read_hf_config,
    rope_inv_freq,
    transformer_config_kwargs,
)
from megatron_bridge.logprobs import (
    pack_sequences,
    packed_inputs,
    pad_sequences,
    padded_inputs,
    unpack,
    vocab_parallel_logprobs,
)

# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("case", list(CASES))
def test_config_mapping_and_rope_match_transformers(tmp_path, case):
    model = make_case(case, str(tmp_path))
    hf = read_hf_config(str(tmp_path))
    kind, kw = CASES[case]
    assert hf.model_type == kind
    assert hf.num_kv_heads == kw["num_key_value_heads"]
    assert hf.tie_word_embeddings == kw["tie_word_embeddings"]
    assert hf.qkv_bias == (kind == "qwen2") and hf.qk_norm == (kind == "qwen3")
    assert hf.head_dim == kw.get("head_dim", 64 // 4)
    # inverse frequencies bit-identical to the ones transformers built into the model
    assert torch.equal(rope_inv_freq(hf), model.model.rotary_emb.inv_freq)
    tc = transformer_config_kwargs(hf, tp=2)
    assert tc["num_query_groups"] == hf.num_kv_heads and tc["kv_channels"] == hf.head_dim
    assert tc["add_qkv_bias"] == hf.qkv_bias and tc["qk_layernorm"] == hf.qk_norm
    assert tc["normalization"] == "RMSNorm" and tc["gated_linear_unit"] and not tc["add_bias_linear"]
    assert tc["layernorm_epsilon"] == hf.rms_norm_eps


def test_old_style_rope_keys_are_read():
    raw = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
           "rope_scaling": {"type": "linear", "factor": 4.0}}
    hf = read_hf_config(raw)
    assert hf.rope_theta == 500000.0 and hf.rope_type == "linear" and hf.num_kv_heads == 2
    # linear: 1 / theta^(2i/d) / factor, d = 4 -> i=0: 1/4, i=1: theta^-0.5 / 4
    inv = rope_inv_freq(hf)
    assert torch.allclose(inv, torch.tensor([0.25, 500000.0 ** -0.5 / 4]), rtol=1e-6)


@pytest.mark.parametrize("patch,msg", [
    ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "sliding"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "SwiGLU"),
    ({"model_type": "gpt2"}, "gpt2"),
])
def test_unsupported_configs_are_refused(patch, msg):
    raw = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2}
    raw.update(patch)
    with pytest.raises(NotImplementedError, match=msg):
        read_hf_config(raw)


def test_padded_vocab_and_layouts():
    # lcm(128, tp) multiples: 250 -> 256 at tp 1, 2, 4 (TP-independent shapes), 384 at tp 3 (lcm 384)
    assert [padded_vocab_size(250, t) for t in (1, 2, 4, 3)] == [256, 256, 256, 384]
    assert padded_vocab_size(256, 8) == 256 and padded_vocab_size(257, 1) == 384
    assert padded_vocab_size(250, 2, vocab_multiple=1) == 250
    assert pipeline_layout(4, 2, None) == [2, 2]
    assert pipeline_layout(3, 2, [2, 1]) == [2, 1]
    with pytest.raises(ValueError):
        pipeline_layout(3, 2, None)
    with pytest.raises(ValueError):
        pipeline_layout(3, 2, [3, 0])
    hf = read_hf_config({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                         "num_hidden_layers": 3, "num_attention_heads": 2})
    kw = transformer_config_kwargs(hf, pp=2, pp_layers=[1, 2])
    assert kw["pipeline_model_parallel_layout"] == [["embedding", "decoder"], ["decoder", "decoder", "loss"]]


# --------------------------------------------------------------------------------------- conversion


def test_qkv_fusion_matches_loop_reference():
    """Fused rows must be, group by group: that group's query heads, its key head, its value head."""
    hf = read_hf_config({"model_type": "llama", "vocab_size": 10, "hidden_size": 12, "intermediate_size": 8,
                         "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 2,
                         "head_dim": 3})
    H, hd, nh, ng = 12, 3, 6, 2
    q = torch.randn(nh * hd, H, dtype=torch.float64)
    k = torch.randn(ng * hd, H, dtype=torch.float64)
    v = torch.randn(ng * hd, H, dtype=torch.float64)
    rows = []
    for g in range(ng):
        for h in range(g * (nh // ng), (g + 1) * (nh // ng)):  # HF: query head h uses kv head h // (nh/ng)
            rows += [q[h * hd + d] for d in range(hd)]
        rows += [k[g * hd + d] for d in range(hd)]
        rows += [v[g * hd + d] for d in range(hd)]
    assert torch.equal(_fuse_qkv(q, k, v, hf), torch.stack(rows))


@pytest.mark.parametrize("ng,per", [(2, 3), (1, 4), (4, 1)])
def test_grouped_qkv_split_inverts_the_fusion(ng, per):
    """The training attention's split of the fused projection output: the inverse of the fusion
    above, head by head (so query head h = HF query head h, key/value g = HF kv head g), and an
    exact re-indexing (the same values as megatron's own split, on any layout of groups)."""
    from megatron_bridge.attention import grouped_qkv_split

    hd, s, b = 5, 3, 2
    nh = ng * per
    q = torch.randn(s, b, nh, hd, dtype=torch.float64)
    k = torch.randn(s, b, ng, hd, dtype=torch.float64)
    v = torch.randn(s, b, ng, hd, dtype=torch.float64)
    cols = []  # the fused output, built head by head in the layout the fusion writes
    for g in range(ng):
        cols += [q[:, :, h] for h in range(g * per, (g + 1) * per)] + [k[:, :, g], v[:, :, g]]
    mixed = torch.cat(cols, dim=-1)  # [s, b, ng * (per + 2) * hd]
    q2, k2, v2 = grouped_qkv_split(mixed, ng, per, hd)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_glu_shard_layout_golden():
    # gate rows 0..3, up rows 10..13 (one column). TP=2: rank 0 holds [g0 g1 u0 u1], rank 1 [g2 g3 u2 u3]
    full = torch.tensor([0., 1, 2, 3, 10, 11, 12, 13])[:, None]
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert tp_shard(name, full, 2, 0).flatten().tolist() == [0, 1, 10, 11]
    assert tp_shard(name, full, 2, 1).flatten().tolist() == [2, 3, 12, 13]


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), rows=st.integers(1, 3), cols=st.integers(1, 3),
       name=st.sampled_from(["embedding.word_embeddings.weight", "decoder.layers.3.mlp.linear_fc1.weight",
                             "decoder.layers.0.self_attention.linear_proj.weight",
                             "decoder.layers.1.self_attention.linear_qkv.bias",
                             "decoder.final_layernorm.weight"]))
def test_tp_shard_merge_roundtrip(tp, rows, cols, name):
    shape = (2 * tp * rows, tp * cols) if not name.endswith("bias") else (2 * tp * rows,)
    full = torch.randn(shape)
    shards = [tp_shard(name, full, tp, r) for r in range(tp)]
    assert torch.equal(tp_merge(name, shards), full)


@pytest.mark.parametrize("case", list(CASES))
def test_offline_roundtrip_tp2_pp2_bit_identical(tmp_path, case):
    make_case(case, str(tmp_path))
    hf = read_hf_config(str(tmp_path))
    ck = HFCheckpoint(str(tmp_path))
    pp_layers = None if hf.num_layers % 2 == 0 else [1, 2]
    shards = hf_to_megatron_shards(ck.get, hf, tp=2, pp=2, pp_layers=pp_layers)
    # vocab padded to 256 rows and split in two
    assert shards[(0, 1)]["embedding.word_embeddings.weight"].shape[0] == 128
    back = megatron_shards_to_hf(shards, hf)
    assert sorted(back) == sorted(ck.keys())
    for k in ck.keys():
        assert torch.equal(back[k], ck.get(k)), k


def test_sharded_index_reader_equals_single_file(tmp_path):
    model = make_hf("qwen2", str(tmp_path / "one"))
    model.save_pretrained(str(tmp_path / "many"), max_shard_size="20KB")
    idx = json.load(open(tmp_path / "many" / "model.safetensors.index.json"))
    assert len(set(idx["weight_map"].values())) > 1
    a, b = HFCheckpoint(str(tmp_path / "one")), HFCheckpoint(str(tmp_path / "many"))
    assert sorted(a.keys()) == sorted(b.keys())
    assert all(torch.equal(a.get(k), b.get(k)) for k in a.keys())


# ---------------------------------------------------------------------------------------- log-probs


def _reference_logp_entropy(logits, labels, vocab, T):
    """float64 per-position loop: log_softmax over the first ``vocab`` columns of logits / T."""
    N = logits.shape[0]
    lp, ent = torch.empty(N, dtype=torch.float64), torch.empty(N, dtype=torch.float64)
    for i in range(N):
        z = logits[i, :vocab].double() / T
        m = max(z.tolist())
        lse = m + math.log(sum(math.exp(float(x) - m) for x in z))
        lp[i] = float(z[labels[i]]) - lse
        ent[i] = -sum(math.exp(float(x) - lse) * (float(x) - lse) for x in z)
    return lp, ent


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 6), vocab=st.integers(2, 40), pad=st.integers(0, 9),
       T=st.sampled_from([1.0, 0.7, 1.3]), scale=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 99))
def test_vocab_logprobs_match_float64_loop(n, vocab, pad, T, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab + pad, generator=g) * scale  # padding columns hold junk
    labels = torch.randint(0, vocab, (n,), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, labels, vocab_size=vocab, temperature=T, with_entropy=True)
    rlp, rent = _reference_logp_entropy(logits, labels, vocab, T)
    assert torch.allclose(lp.double(), rlp, atol=2e-5 * scale) and torch.allclose(ent.double(), rent, atol=2e-5 * scale)


def test_vocab_logprobs_slices_add_up_without_group():
    """A slice owning no label contributes 0 to the target and its share of the partition sum:
    recombining two slices by hand (what the TP all-reduce does) gives the full answer."""
    logits = torch.randn(5, 12, dtype=torch.float64)
    labels = torch.tensor([0, 5, 6, 11, 3])
    full, _ = vocab_parallel_logprobs(logits, labels)
    m = logits.amax(-1)
    z = sum(torch.exp(logits[:, s:s + 6] - m[:, None]).sum(-1) for s in (0, 6))
    tgt = logits.gather(-1, labels[:, None])[:, 0]
    assert torch.allclose(full, tgt - m - torch.log(z))


def test_vocab_logprobs_gradient_is_onehot_minus_softmax():
    logits = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([1, 4, 0])
    T = 0.5
    lp, ent = vocab_parallel_logprobs(logits, labels, vocab_size=5, temperature=T, with_entropy=True)
    lp.sum().backward()
    p = torch.softmax(logits.detach()[:, :5] / T, -1)
    expect = torch.zeros(3, 7, dtype=torch.float64)
    expect[:, :5] = (torch.nn.functional.one_hot(labels, 5) - p) / T  # d logp / d z = (1_y - p) / T
    assert torch.allclose(logits.grad, expect)
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_logprobs(x, labels, vocab_size=5, temperature=T, with_entropy=True)[1],
        (logits.detach().clone().requires_grad_(),))


# ----------------------------------------------------------------------------------------- batching


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 7), min_size=1, max_size=4), side=st.sampled_from(["left", "right"]),
       extra=st.integers(0, 3))
def test_padded_inputs_positions_and_mask_match_loop(lens, side, extra):
    seqs = [list(range(100 + 10 * i, 100 + 10 * i + n)) for i, n in enumerate(lens)]
    mb = pad_sequences(seqs, side=side, multiple=max(lens) + extra)
    inp = padded_inputs(mb["input_ids"], mb["attention_mask"])
    B, S = mb["input_ids"].shape
    for b in range(B):
        real = [t for t in range(S) if mb["attention_mask"][b, t]]
        assert [int(inp.position_ids[b, t]) for t in real] == list(range(len(real)))
        for q in range(S):
            for k in range(S):  # allowed iff k is a real token at or before q, or k is q itself
                ok = (k in real and k <= q) or k == q  # (the diagonal only matters for pad rows)
                assert bool(inp.attention_mask[b, 0, q, k]) == (not ok)
        # next-token labels inside the sequence; the first token of each sequence scores nothing
        assert [int(inp.labels[b, t]) for t in real[:-1]] == seqs[b][1:]
        assert [bool(inp.token_valid[b, t]) for t in real] == [False] + [True] * (len(real) - 1)
        assert not any(bool(inp.token_valid[b, t]) for t in range(S) if t not in real)


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 6), min_size=1, max_size=5), cap=st.integers(1, 12))
def test_packing_roundtrip_and_block_diagonal_mask(lens, cap):
    seqs = [[i * 10 + j for j in range(n)] for i, n in enumerate(lens)]
    rows = pack_sequences(seqs, max_tokens=cap)
    assert sorted(i for r in rows for i in r["index"].tolist()) == list(range(len(seqs)))
    for r in rows:
        parts = unpack(r["input_ids"], r["cu_seqlens"])
        assert [p.tolist() for p in parts] == [seqs[i] for i in r["index"].tolist()]
        assert r["input_ids"].shape[1] <= cap or len(parts) == 1
        inp = packed_inputs(r["input_ids"], r["cu_seqlens"], dense_mask=True)
        cu = r["cu_seqlens"].tolist()
        seg = [s for s in range(len(cu) - 1) for _ in range(cu[s], cu[s + 1])]
        T = len(seg)
        for q in range(T):
            assert int(inp.position_ids[0, q]) == q - cu[seg[q]]
            for k in range(T):
                assert bool(inp.attention_mask[0, 0, q, k]) == (not (seg[k] == seg[q] and k <= q))


def test_cpu_shim_can_be_suspended_for_a_block():
    """The hybrid engine's decode loop runs outside the device-rewriting mode; the mode is back (and
    rewriting ``device="cuda"``) afterwards. Run on a thread of its own: the mode is per thread."""
    import threading

    from megatron_bridge import cpu_shims

    if not cpu_shims.needed():
        pytest.skip("CUDA present: the shims are off")
    seen = {}

    def body():
        cpu_shims.install()
        seen["before"] = torch.zeros(1, device="cuda").device.type
        with cpu_shims.suspended():
            seen["inside"] = cpu_shims.active()
            with pytest.raises((RuntimeError, AssertionError)):
                torch.zeros(1, device="cuda")  # no rewriting: a CPU-only torch refuses
        seen["after"] = (cpu_shims.active(), torch.zeros(1, device="cuda").device.type)
        cpu_shims.uninstall_mode()
        with cpu_shims.suspended():  # not active: stays off
            seen["off"] = cpu_shims.active()
        seen["off_after"] = cpu_shims.active()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"before": "cpu", "inside": False, "after": (True, "cpu"), "off": False, "off_after": False}


@pytest.mark.parametrize("chunk_rows", [1, 3, 64])
@pytest.mark.parametrize("T,pad", [(1.0, 0), (0.7, 3)])
def test_fused_logprobs_match_plain_autograd_across_chunks(monkeypatch, chunk_rows, T, pad):
    """The row-chunked fused pass (ragged last chunk included) gives the values and both gradients of
    the plain float64 autograd formula: d logp / dz and, with entropy_grad, d H / dz; without it the
    entropy is outside autograd."""
    import megatron_bridge.logprobs as lp_mod

    V, vocab, N = 11 + pad, 11, 10
    monkeypatch.setattr(lp_mod, "_LOGIT_CHUNK", chunk_rows * V)
    g = torch.Generator().manual_seed(chunk_rows)
    z = (torch.randn(2, N // 2, V, generator=g, dtype=torch.float64) * 3).requires_grad_()
    labels = torch.randint(0, vocab, (2, N // 2), generator=g)
    w_lp, w_h = torch.randn(2, N // 2, generator=g, dtype=torch.float64), torch.randn(2, N // 2, generator=g, dtype=torch.float64)

    def plain(zz):
        x = zz[..., :vocab] / T
        logp_all = torch.log_softmax(x, -1)
        lp = logp_all.gather(-1, labels[..., None])[..., 0]
        h = -(logp_all.exp() * logp_all).sum(-1)
        return lp, h

    lp, h = vocab_parallel_logprobs(z, labels, vocab_size=vocab, temperature=T, with_entropy=True)
    (gz,) = torch.autograd.grad((lp * w_lp).sum() + (h * w_h).sum(), z)
    z2 = z.detach().clone().requires_grad_()
    rlp, rh = plain(z2)
    (rgz,) = torch.autograd.grad((rlp * w_lp).sum() + (rh * w_h).sum(), z2)
    assert torch.allclose(lp, rlp, atol=1e-12) and torch.allclose(h, rh, atol=1e-12)
    assert torch.allclose(gz, rgz, atol=1e-12) and bool((gz[..., vocab:] == 0).all())
    lp3, h3 = vocab_parallel_logprobs(z, labels, vocab_size=vocab, temperature=T, with_entropy=True, entropy_grad=False)
    assert not h3.requires_grad and torch.allclose(h3, rh, atol=1e-12)
    (g3,) = torch.autograd.grad((lp3 * w_lp).sum(), z)
    (r3,) = torch.autograd.grad((plain(z2)[0] * w_lp).sum(), z2)
    assert torch.allclose(g3, r3, atol=1e-12)
    # the caller's logits are never written (the padding columns are masked on a copy, forward and backward)
    z_in = torch.randn(6, V, generator=g, dtype=torch.float64, requires_grad=True)
    before = z_in.detach().clone()
    lp4, h4 = vocab_parallel_logprobs(z_in, labels.reshape(-1)[:6], vocab_size=vocab, with_entropy=True)
    (lp4.sum() + h4.sum()).backward()
    assert torch.equal(z_in.detach(), before)
    # bf16 logits: gradient in bf16, values in float32, agreeing with the float64 formula to bf16 input rounding
    zb = z.detach().to(torch.bfloat16).requires_grad_()
    lpb, _ = vocab_parallel_logprobs(zb, labels, vocab_size=vocab, temperature=T)
    (gb,) = torch.autograd.grad(lpb.sum(), zb)
    z64 = zb.detach().double().requires_grad_()
    (r64,) = torch.autograd.grad(plain(z64)[0].sum(), z64)
    assert lpb.dtype == torch.float32 and gb.dtype == torch.bfloat16
    assert torch.allclose(lpb.double(), plain(zb.detach().double())[0], atol=1e-5)
    assert torch.allclose(gb.double(), r64, atol=2e-2 / T)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mscale", [1.0, 0.7])
def test_packed_rope_is_megatrons_rope_bit_for_bit(dtype, mscale):
    """``model._thd_rope`` (tables once per forward, the sign on the table, a custom backward) gives
    megatron's own ``_apply_rotary_pos_emb_bshd`` output and input gradient bit for bit, on a packed
    row whose positions restart per sequence; the tables are reused for the same (freqs, cu_seqlens)
    and rebuilt for new ones."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_bridge import model as bm

    bm._install_thd_rope()
    real = bm._MEGATRON_THD_ROPE is not None and rope_utils._apply_rotary_pos_emb_bshd
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 9, 3]
    T, H, D = sum(lens), 3, 16
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    table = torch.arange(32, dtype=torch.float32)[:, None] * inv[None]
    freqs = torch.cat((table, table), dim=-1)[:, None, None, :]  # [32, 1, 1, D] from position 0
    pos = torch.cat([torch.arange(n) for n in lens])
    t = torch.randn(T, H, D, generator=g).to(dtype).requires_grad_()
    want = real(t.unsqueeze(1), freqs[pos], mscale=mscale).squeeze(1)  # megatron, per-token angles
    up = torch.randn(T, H, D, generator=g).to(dtype)
    (gwant,) = torch.autograd.grad(want, t, up)
    got = bm._thd_rope(t, cu, freqs, mscale=mscale)
    (ggot,) = torch.autograd.grad(got, t, up)
    assert torch.equal(got, want) and torch.equal(ggot, gwant)
    assert not torch.equal(got, real(t.unsqueeze(1), freqs[:T], mscale=mscale).squeeze(1))  # positions restart
    tables = bm._ROPE_TABLES[0][1]
    bm._thd_rope(t, cu, freqs, mscale=mscale)
    assert bm._ROPE_TABLES[0][1] is tables  # same forward: reused
    freqs.add_(0.5)  # the same tensor edited in place: the tables follow it
    edited = bm._thd_rope(t, cu, freqs, mscale=mscale)
    assert torch.equal(edited, real(t.unsqueeze(1), freqs[pos], mscale=mscale).squeeze(1))
    freqs.sub_(0.5)
    cu2 = torch.tensor([0, 18], dtype=torch.int32)
    one = bm._thd_rope(t, cu2, freqs, mscale=mscale)  # a new packing: new tables
    assert torch.equal(one, real(t.unsqueeze(1), freqs[:T], mscale=mscale).squeeze(1))
