"""The plain-torch decoder computes the same logits as transformers, through every path it has:
full forward, right-padded prefill, prefill into the cache and per-row decode."""

import json
import os

import pytest
import torch

from trainer.rollout.hf_model import CausalLM, KVCache, ModelConfig, decode_attention, decode_step, rope_inv_freq

from .conftest import ARCHS, VOCAB, make_hf_model, save_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for arch in ARCHS:
        hf = make_hf_model(arch)
        path = save_model(hf, tmp_path_factory.mktemp(arch))
        out[arch] = (hf, CausalLM.from_pretrained(path))
    return out


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_full_forward_matches_transformers(models, arch):
    hf, ours = models[arch]
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert torch.allclose(ours.forward(ids), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_padded_prefill_does_not_leak(models, arch):
    # Right-padded rows of lengths 11, 4, 7: each row's logits equal an unpadded forward of that row
    # alone. The pad ids are garbage on purpose (random tokens), so a leak would change the numbers.
    hf, ours = models[arch]
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([11, 4, 7])
    out = ours.forward(ids, lengths)
    for r in range(3):
        n = int(lengths[r])
        assert torch.allclose(out[r, :n], hf_logits(hf, ids[r, :n].tolist()), atol=1e-5, rtol=0)


def random_prompts(g: torch.Generator, lengths) -> tuple[list[list[int]], torch.Tensor]:
    """Random prompts of the given lengths and their right-padded ``[n, max_len]`` token tensor."""
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    tokens = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    return prompts, tokens


@pytest.mark.parametrize("arch", list(ARCHS))
def test_cache_prefill_and_per_row_decode(models, arch):
    # Prefill three prompts of different lengths into non-contiguous slots (2, 0, 1), one prompt twice
    # (rows map [0, 1, 2, 1] -> slots [2, 0, 1, 3]), then decode three steps with every row at its
    # own position. Each step's logits equal HF's full forward over that row's whole sequence.
    hf, ours = models[arch]
    g = torch.Generator().manual_seed(3)
    prompts, tokens = random_prompts(g, (9, 3, 6))
    cache = KVCache(ours.cfg, max_batch=4, max_len=32, dtype=torch.float32)
    rows, slots = torch.tensor([0, 1, 2, 1]), torch.tensor([2, 0, 1, 3])
    with torch.inference_mode():
        last = ours.prefill(cache, tokens, torch.tensor([9, 3, 6]), slots, rows)
    for i, p in enumerate(prompts):
        assert torch.allclose(last[i], hf_logits(hf, p)[-1], atol=1e-5, rtol=0)
    seqs = {s: list(prompts[r]) for r, s in zip(rows.tolist(), slots.tolist())}  # slot -> sequence so far
    for step in range(3):
        nxt = torch.randint(0, VOCAB, (4,), generator=g)
        for s in range(4):
            seqs[s].append(int(nxt[s]))
        pos = torch.tensor([len(seqs[s]) - 1 for s in range(4)])
        with torch.inference_mode():
            logits = ours.decode(cache, nxt, pos)
        for s in range(4):
            assert torch.allclose(logits[s], hf_logits(hf, seqs[s])[-1], atol=1e-5, rtol=0), (step, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_against_a_float64_reference(dtype):
    # decode_attention: G query heads per kv head folded into query rows, each row b masked to cache
    # positions <= pos[b]. Reference: float64, K/V repeated per query head, masked positions dropped
    # outright (not -inf). bf16: HF's eager order (bf16 scores, fp32 softmax), so bf16 rounding only.
    g = torch.Generator().manual_seed(3)
    B, K, G, L, D = 3, 2, 3, 7, 8
    q, k, v = (torch.randn(*s, generator=g) for s in ((B, K, G, D), (B, K, L, D), (B, K, L, D)))
    pos = torch.tensor([0, 4, 6])
    allowed = (torch.arange(L)[None, :] <= pos[:, None])[:, None, None, :]
    k[0, :, 1:] = float("nan")  # beyond row 0's position: must never reach its output
    out = decode_attention(q.to(dtype), k.to(dtype), v.to(dtype), allowed)
    assert out.shape == (B, K, G, D) and out.dtype == dtype
    for b in range(B):
        n = int(pos[b]) + 1
        qd, kd, vd = q[b].double(), k[b, :, :n].double(), v[b, :, :n].double()
        ref = torch.softmax(qd @ kd.transpose(-1, -2) / D ** 0.5, -1) @ vd  # [K, G, D]
        tol = 1e-6 if dtype == torch.float32 else 5e-2
        assert torch.allclose(out[b].double(), ref, atol=tol, rtol=0), b
    # a wrong mask (row 0 sees everything) is caught: its NaN keys poison the output
    assert torch.isnan(decode_attention(q, k, v, torch.ones_like(allowed))[0]).all()


@pytest.mark.parametrize("gemm_template", [False, True])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_static_decode_step_matches_transformers(models, arch, gemm_template):
    # decode_step (the compiled engine's step, run eagerly here): 3 real rows at different positions
    # padded to a bucket of 4 (the padding row: token 0 at position 0 of free slot 3), attention over
    # the cache's full length. Real rows' logits equal HF's full forward; the padding row writes only
    # its own slot's position 0; the real rows' cache writes equal the eager decode's.
    # gemm_template: the decode_gemm="cpp" layout (linears as (W x^T)^T, keys cached transposed,
    # filled by the same prefill): the same function.
    hf, ours = models[arch]
    g = torch.Generator().manual_seed(5)
    prompts, tokens = random_prompts(g, (8, 2, 5))
    caches = [KVCache(ours.cfg, max_batch=4, max_len=24, dtype=torch.float32, keys_transposed=t)
              for t in (gemm_template, False)]
    with torch.inference_mode():
        for c in caches:
            ours.prefill(c, tokens, torch.tensor([8, 2, 5]), torch.arange(3), torch.arange(3))
        seqs = [list(p) for p in prompts]
        for step in range(3):
            nxt = torch.randint(0, VOCAB, (3,), generator=g)
            for s in range(3):
                seqs[s].append(int(nxt[s]))
            pos = torch.tensor([len(q) - 1 for q in seqs])
            before = [caches[0].keys(li)[3].clone() for li in range(ours.cfg.num_layers)]
            logits = decode_step(ours.cfg, ours.decode_weights(), caches[0].k, caches[0].v,
                                 torch.cat([nxt, torch.zeros(1, dtype=torch.long)]),
                                 torch.cat([pos, torch.zeros(1, dtype=torch.long)]), ours.cos, ours.sin,
                                 gemm_template=gemm_template)
            eager = ours.decode(caches[1], nxt, pos)
            assert logits.shape == (4, VOCAB)
            for s in range(3):
                assert torch.allclose(logits[s], hf_logits(hf, seqs[s])[-1], atol=1e-5, rtol=0), (step, s)
            assert torch.allclose(logits[:3], eager, atol=1e-5, rtol=0)
            for li in range(ours.cfg.num_layers):
                assert torch.allclose(caches[0].keys(li)[:3], caches[1].k[li][:3], atol=1e-5, rtol=0)
                assert torch.allclose(caches[0].v[li][:3], caches[1].v[li][:3], atol=1e-5, rtol=0)
                assert torch.equal(caches[0].keys(li)[3, :, 1:], before[li][:, 1:])  # padding: position 0 only
    if gemm_template:  # the eager decode cannot read a transposed-key cache, and says so
        with pytest.raises(ValueError, match="keys_transposed=False"):
            ours.decode(caches[0], nxt, pos)


def test_llama_biases_and_sharded_checkpoint(tmp_path):
    # attention_bias + mlp_bias (every projection has a bias) saved as several shards with an index.
    hf = make_hf_model("llama", attention_bias=True, mlp_bias=True, rope_scaling=None)
    path = save_model(hf, tmp_path, max_shard_size="40KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    ours = CausalLM.from_pretrained(path)
    assert ours.cfg.qkv_bias and ours.cfg.o_bias and ours.cfg.mlp_bias
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(ours.forward(ids), hf(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "linear", "factor": 3.0},
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}],
)
def test_rope_inv_freq_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=512)
    ours = ModelConfig.from_hf_dict(cfg.to_dict())
    inv = rope_inv_freq(ours)  # trainer.hf_io's, re-exported; no supported type scales the attention
    if scaling is None:
        ref, scale = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128)), 1.0
    else:
        ref, scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg)
    assert scale == 1.0  # HF's attention factor: 1 for every supported type, so ours has none
    assert torch.allclose(inv, ref, rtol=1e-6, atol=0)
    if scaling and scaling["rope_type"] == "llama3":
        # The recipe must actually bend the spectrum: the lowest frequency is divided by `factor`,
        # the highest is kept.
        base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
        assert torch.isclose(inv[-1], base[-1] / 8.0) and torch.isclose(inv[0], base[0])


def test_config_parsing_v4_style_and_errors():
    v4 = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2, rope_theta=1234.0, rope_scaling={"type": "linear", "factor": 2.0})
    c = ModelConfig.from_hf_dict(v4)
    assert c.rope_theta == 1234.0 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.num_kv_heads == 2 and c.head_dim == 4 and not c.qkv_bias
    q2 = ModelConfig.from_hf_dict({**v4, "model_type": "qwen2", "rope_scaling": None})
    assert q2.qkv_bias and not q2.o_bias and q2.rope_scaling == {"rope_type": "default"}
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        ModelConfig.from_hf_dict({**v4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        ModelConfig.from_hf_dict({**v4, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1.0}})
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        ModelConfig.from_hf_dict({**v4, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_hf_dict({**v4, "model_type": "qwen2", "use_sliding_window": True})


def test_load_errors(tmp_path, models):
    hf, ours = models["llama"]
    with pytest.raises(KeyError, match="unknown weight"):
        ours.load_hf_tensors([("model.layers.0.self_attn.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        ours.load_hf_tensors([("model.norm.weight", torch.zeros(3))])
    # A checkpoint missing a tensor is refused, naming it.
    path = save_model(hf, tmp_path / "full")
    from safetensors.torch import load_file, save_file

    sd = load_file(os.path.join(path, "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    os.makedirs(tmp_path / "partial")
    save_file(sd, str(tmp_path / "partial" / "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(tmp_path / "partial" / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="up_proj"):
        CausalLM.from_pretrained(str(tmp_path / "partial"))


def test_bf16_prepacked_matmuls_are_bit_identical(models):
    # The oneDNN-prepacked path is a speed-up only: same bf16 logits as F.linear, bit for bit.
    hf, _ = models["qwen3"]
    plain = CausalLM(ModelConfig.from_hf_dict(hf.config.to_dict()), dtype=torch.bfloat16)
    plain.load_hf_tensors(hf.state_dict().items())
    packed = CausalLM(ModelConfig.from_hf_dict(hf.config.to_dict()), dtype=torch.bfloat16)
    packed.load_hf_tensors(hf.state_dict().items())
    packed.set_prepack(True)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    assert torch.equal(plain.forward(ids), packed.forward(ids))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_cache_decode_matches_bf16_forward(models, arch):
    # bf16 decode runs another attention layout (one query per head, native GQA) than fp32. Its
    # logits must match a bf16 full forward of the same sequences up to bf16 rounding (a wrong head
    # grouping would be off by O(1)); and both must be near the fp32 reference.
    hf, _ = models[arch]
    m = CausalLM(ModelConfig.from_hf_dict(hf.config.to_dict()), dtype=torch.bfloat16)
    m.load_hf_tensors(hf.state_dict().items())
    m.set_prepack(True)
    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 8)]
    T = 8
    tokens = torch.zeros(2, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
    # max_len 16: from 8 keys on, decode reads the whole (masked, zero-filled) cache rather than a slice
    # of it (which the CPU bf16 bmm would copy); max_len 64: always the slice. Both must agree.
    cache = KVCache(m.cfg, max_batch=2, max_len=16, dtype=torch.bfloat16)
    sliced = KVCache(m.cfg, max_batch=2, max_len=64, dtype=torch.bfloat16)
    with torch.inference_mode():
        for c in (cache, sliced):
            m.prefill(c, tokens, torch.tensor([5, 8]), torch.tensor([0, 1]), torch.tensor([0, 1]))
        for _ in range(3):
            nxt = torch.randint(0, VOCAB, (2,), generator=g)
            for i in range(2):
                seqs[i].append(int(nxt[i]))
            logits = m.decode(cache, nxt, torch.tensor([len(s) - 1 for s in seqs]))
            other = m.decode(sliced, nxt, torch.tensor([len(s) - 1 for s in seqs]))
            assert torch.equal(logits, other)  # the masked slots add exact zeros (measured: bit-identical)
            for i, s in enumerate(seqs):
                full = m.forward(torch.tensor([s]))[0, -1]
                ref = hf_logits(hf, s)[-1]
                scale = ref.abs().max()
                assert (logits[i] - full).abs().max() < 0.03 * scale
                assert (logits[i] - ref).abs().max() < 0.05 * scale
