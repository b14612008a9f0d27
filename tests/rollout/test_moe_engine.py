"""The native engine runs mixture-of-experts models (Qwen3-MoE with renormalised top-k weights,
Qwen2-MoE with a gated shared expert): its log-probs equal a full transformers forward, greedy decoding
equals transformers' generate, and continuous batching changes nothing."""

import pytest
import torch

from trainer.rollout.engine import SamplingParams
from trainer.rollout.native import NativeEngine

from .conftest import MOE_ARCHS, VOCAB, make_hf_model, save_model


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    out = {}
    for arch in MOE_ARCHS:
        hf = make_hf_model(arch)
        out[arch] = (hf, save_model(hf, tmp_path_factory.mktemp(arch)))
    return out


def prompts(seed=0, lens=(5, 1, 9, 3)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("arch", list(MOE_ARCHS))
def test_moe_logprobs_and_greedy_equal_transformers(moe_models, arch):
    hf, path = moe_models[arch]
    eng = NativeEngine(path, max_batch_size=4, max_seq_len=64)
    ps = prompts()
    outs = eng.generate(ps, SamplingParams(max_new_tokens=6, temperature=0.0))
    for p, o in zip(ps, outs):
        resp = o[0].token_ids
        with torch.inference_mode():
            want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                               max_new_tokens=6, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            logits = hf(torch.tensor([p + resp])).logits[0].float()  # [L, V]
        assert resp == want
        lp = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(-1, torch.tensor(resp)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(o[0].logprobs), lp, atol=1e-4), (arch, o[0].logprobs, lp.tolist())
    # one prompt at a time gives the same tokens (continuous batching mixes rows in the experts' batches)
    alone = [eng.generate([p], SamplingParams(max_new_tokens=6, temperature=0.0))[0][0].token_ids for p in ps]
    assert alone == [o[0].token_ids for o in outs]
    with pytest.raises(ValueError, match="compile_decode does not support mixture-of-experts"):
        NativeEngine(path, max_batch_size=4, max_seq_len=64, compile_decode=True)


@pytest.mark.parametrize("arch", list(MOE_ARCHS))
def test_routed_experts_are_the_routers_topk_and_replay(moe_models, arch):
    """``return_routed_experts`` (routing replay, R3): every input token's experts per layer are the
    top-k of transformers' router logits on the whole sequence; a forward replaying them gives the
    same logits, and replaying other experts changes them (the gate weights stay the router's)."""
    hf, path = moe_models[arch]
    eng = NativeEngine(path, max_batch_size=3, max_seq_len=64)
    ps = prompts(1)
    outs = eng.generate(ps, SamplingParams(n=2, max_new_tokens=7, temperature=1.0, seed=3, return_routed_experts=True))
    k, n_layers = hf.config.num_experts_per_tok, hf.config.num_hidden_layers
    for p, per in zip(ps, outs):
        for o in per:
            ids = p + o.token_ids
            r = o.routed_experts
            assert r.dtype == torch.int16 and tuple(r.shape) == (len(ids) - 1, n_layers, k)
            with torch.inference_mode():
                logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits  # per layer [L, E]
            for li, rl in enumerate(logits):
                want = torch.topk(rl.float().reshape(len(ids), -1)[:-1], k, dim=-1).indices
                assert torch.equal(r[:, li].long().sort(-1).values, want.sort(-1).values), (arch, li)
    # without the flag: nothing recorded
    assert eng.generate(ps[:1], SamplingParams(max_new_tokens=3))[0][0].routed_experts is None
    model, o = eng.model, outs[0][0]
    ids = torch.tensor([ps[0] + o.token_ids])
    route = torch.full((1, ids.shape[1], n_layers, k), -1, dtype=torch.long)
    route[0, :-1] = o.routed_experts.long()
    base = model.forward(ids)
    assert torch.equal(model.forward(ids, routing=route), base)
    other = route.clone()
    other[0, :-1] = (other[0, :-1] + 1) % hf.config.num_experts  # every token to other experts
    moved = model.forward(ids, routing=other)
    assert (moved - base).abs().max() > 1e-3
