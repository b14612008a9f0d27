"""R3 routing replay through the real SGLang engine (its CPU path): SGLang's captured routes
(``enable_return_routed_experts``, ``meta_info["routed_experts"]``) decoded by the adapter into the engine
contract's ``routed_experts`` (``[prompt + sampled - 1, layers, top_k]``), checked against the experts
transformers' own fp32 forward routes the same tokens to. Runs in the SGLang CPU venv
(tests/rollout/sglang_cpu_support.py)."""

from __future__ import annotations

import pytest
import torch

from trainer.rollout import sglang_engine as se
from trainer.rollout.engine import SamplingParams

LAYERS, EXPERTS, TOP_K, VOCAB = 3, 8, 3, 101  # not the shipped tiny MoE's shape (2 layers, 4 experts, top-2, 16)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from .sglang_cpu_support import require_sglang_here

    require_sglang_here()
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=False, max_position_embeddings=128,
                         tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(3)
    hf = Qwen3MoeForCausalLM(cfg).float().eval()
    path = tmp_path_factory.mktemp("moe")
    hf.save_pretrained(path, safe_serialization=True)
    e = se.SGLangEngine(str(path), device="cpu", dtype="float32", engine_kwargs={"enable_return_routed_experts": True})
    yield hf, e, str(path)
    e.shutdown()


def hf_topk(hf, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' routing of ``tokens``: (top-k expert ids sorted, [T, layers, k]; the gap between the k-th
    and (k+1)-th router logit, [T, layers]: near zero, a rounding difference may pick the other expert)."""
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    logits = torch.stack([r.reshape(len(tokens), -1) for r in out.router_logits], 1).float()  # [T, layers, E]
    top = logits.topk(TOP_K + 1, dim=-1)
    return top.indices[..., :TOP_K].sort(-1).values, top.values[..., TOP_K - 1] - top.values[..., TOP_K]


@pytest.mark.slow
def test_sglang_returns_the_experts_transformers_routes_each_input_token_to(moe):
    hf, e, _ = moe
    assert e.routes == se.RouteShape(LAYERS, TOP_K)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 1, 9)]
    outs = e.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=7, return_routed_experts=True))
    rows = checked = shifted = 0
    for prompt, samples in zip(prompts, outs):
        for o in samples:
            tokens = prompt + o.token_ids[:-1]  # every input token: the last sampled one is never fed back
            assert o.routed_experts.dtype == torch.int16 and o.routed_experts.shape == (len(tokens), LAYERS, TOP_K)
            want, gap = hf_topk(hf, tokens)
            got = o.routed_experts.long().sort(-1).values
            clear = gap > 1e-4  # a tie closer than fp32 rounding between two forwards may go either way
            assert torch.equal(got[clear], want[clear]), (prompt, o.token_ids)
            rows, checked = rows + gap.numel(), checked + int(clear.sum())
            shifted += int((got[1:] != want[:-1]).any(-1).sum())  # control: one token off would be caught
    assert checked >= 0.97 * rows and rows >= 3 * 2 * LAYERS * 6  # nearly every (token, layer) compared
    assert shifted > rows // 4


@pytest.mark.slow
def test_routes_only_when_asked_and_refused_where_not_captured(moe):
    hf, e, path = moe
    plain = e.generate([[3, 4, 5]], SamplingParams(max_new_tokens=3, temperature=0))[0][0]
    assert plain.routed_experts is None
    # an engine started without the capture refuses the request instead of returning no routes
    off = se.SGLangEngine.__new__(se.SGLangEngine)
    off.routes, off.model_path = None, path
    with pytest.raises(ValueError, match="enable_rollout_routing_replay"):
        se.SGLangEngine.generate(off, [[3, 4]], SamplingParams(max_new_tokens=2, return_routed_experts=True))
