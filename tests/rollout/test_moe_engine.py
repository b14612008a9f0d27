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
