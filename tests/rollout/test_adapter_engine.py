"""Adapter-only sync at the engine (:mod:`trainer.rollout.adapters`): the native engine on the tiny model, handed
peft-layout adapters bucket by bucket, holds ``W0 + (alpha / r) B A`` (float64 reference), generates exactly what
an engine loaded with those merged weights generates, reports the checksum of the adapters it holds and of the base
under them, and refuses a full weight."""

import pytest
import torch
from safetensors.torch import load_file

from tests.support.tiny import TINY_MODEL
from trainer.rollout.adapters import AdapterEngine, split_adapter_name
from trainer.rollout.engine import SamplingParams, checksum_named_tensors
from trainer.rollout.native import NativeEngine

RANK, SCALE = 4, 2.0


def engine():
    return NativeEngine.from_rollout(TINY_MODEL, max_batch_size=8, max_seq_len=64, dtype="float32")


def peft_adapters(seed: int) -> dict[str, torch.Tensor]:
    """Random A and B for every q/k/v/o/gate/up/down projection of the tiny model, in peft's HF names."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in sorted(load_file(f"{TINY_MODEL}/model.safetensors").items()):
        if name.endswith(("_proj.weight",)):
            stem = name[: -len(".weight")]
            out[stem + ".lora_A.weight"] = torch.randn(RANK, w.shape[1], generator=g) / w.shape[1] ** 0.5
            out[stem + ".lora_B.weight"] = 0.05 * torch.randn(w.shape[0], RANK, generator=g)
    return out


def test_adapters_merge_into_the_engine_as_w0_plus_scaled_ba():
    base = {n: t.clone() for n, t in engine().hf_views().items()}
    e = AdapterEngine(engine(), scale=SCALE, dtype="float32")
    base_sum = e.base_checksum()
    assert base_sum == checksum_named_tensors(sorted(base.items()))
    for seed in (1, 2):  # two syncs: the second merges over W0, not over the first merge
        ad = peft_adapters(seed)
        names = sorted(ad)
        # buckets that split A from its B (A of every module first): a merge waits for both factors of this sync
        e.update_weights([(n, ad[n]) for n in names if n.endswith("lora_A.weight")])
        e.update_weights([(n, ad[n]) for n in names if n.endswith("lora_B.weight")])
        held, want_all = e.hf_views(), {}
        adapted = 0
        for n, w0 in base.items():
            a = ad.get(n[: -len(".weight")] + ".lora_A.weight")
            if a is None:
                assert torch.equal(held[n], w0), n  # embeddings, norms: untouched
                continue
            b = ad[n[: -len(".weight")] + ".lora_B.weight"]
            want = w0.double() + SCALE * b.double() @ a.double()
            assert (held[n].double() - want).abs().max() < 1e-6, n
            want_all[n] = want.float()
            adapted += 1
        assert adapted == 7 * 4  # q, k, v, o, gate, up, down in each of 4 layers
        assert e.weights_checksum() == checksum_named_tensors(sorted(ad.items()))  # what the actor streamed
        assert e.base_checksum() == base_sum  # the merges are over the base the engine loaded

    # the engine generates what an engine loaded with the float64 reference's merged weights generates (greedy and
    # sampled, same seed): the merge reached every packed weight the decode loop reads
    merged = engine()
    merged.update_weights(list(want_all.items()))
    prompts = [[5, 9, 14, 3], [7, 7, 2]]
    for sp in (SamplingParams(max_new_tokens=8, temperature=0.0), SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)):
        got, want = e.generate(prompts, sp), merged.generate(prompts, sp)
        got, want = [o for g in got for o in g], [o for w in want for o in w]
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        lp_got, lp_want = (torch.tensor([x for o in outs for x in o.logprobs]) for outs in (got, want))
        assert (lp_got - lp_want).abs().max() < 1e-5


def test_a_full_weight_is_refused_and_names_are_parsed():
    e = AdapterEngine(engine(), scale=SCALE, dtype="float32")
    w = e.hf_views()["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(ValueError, match="received the full weight 'model.layers.0.self_attn.q_proj.weight'"):
        e.update_weights([("model.layers.0.self_attn.q_proj.weight", w)])
    assert split_adapter_name("model.layers.1.mlp.down_proj.lora_B.weight") == ("model.layers.1.mlp.down_proj.weight", "B")
    assert split_adapter_name("model.norm.weight") is None
    with pytest.raises(KeyError, match="does not hold"):
        e.update_weights([("model.layers.0.self_attn.nope.lora_A.weight", torch.zeros(RANK, 4))])
