"""Export from TP=2 and (uneven) PP=2 layouts to HF directories that transformers loads, the bucketed
weight stream, and the critic value head (checked against transformers' TokenClassification head)."""

import os

import pytest
import torch

from bridge_tiny import make_case, random_seqs

BUCKET = 40_000  # bytes: several tensors per bucket, several buckets per model


def export_job(src: str, out_root: str, seqs):
    import torch.distributed as dist

    from megatron_bridge.convert import load_hf_weights
    from megatron_bridge.export import export_hf, iter_hf_weights
    from megatron_bridge.hf_config import read_hf_config
    from megatron_bridge.launch import set_parallel
    from megatron_bridge.logprobs import compute_logprobs, pad_sequences
    from megatron_bridge.model import build_model

    hf = read_hf_config(src)
    report = {}
    for lname, tp, pp, pp_layers in (("tp2", 2, 1, None), ("pp2", 1, 2, [1, 2])):
        set_parallel(tp=tp, pp=pp)
        model = build_model(hf, pp_layers=pp_layers)
        load_hf_weights(model, src)
        sizes, names = [], []
        for bucket in iter_hf_weights(model, bucket_bytes=BUCKET):
            sizes.append([t.numel() * t.element_size() for _, t in bucket])
            names += [k for k, _ in bucket]
        report[lname] = {"sizes": sizes, "names": names}
        export_hf(model, os.path.join(out_root, lname), source_dir=src, max_shard_bytes=60_000)
    # critic: value head on a TP=2 model, exported with its head
    set_parallel(tp=2, pp=1)
    torch.manual_seed(5)
    critic = build_model(hf, value_head=True)
    load_hf_weights(critic, src)  # a causal-LM checkpoint: the head keeps its fresh init
    mb = pad_sequences(seqs, side="left")
    vals = compute_logprobs(critic, [mb])[0]["values"]
    export_hf(critic, os.path.join(out_root, "critic"), source_dir=src)
    report["critic_values"] = vals
    report["critic_mask"] = mb["attention_mask"]
    return report if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_export_stream_and_critic(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from megatron_bridge.launch import spawn

    src = str(tmp_path / "src")
    make_case("qwen3_qknorm_gqa1_untied", src)  # 3 layers: PP=2 is the uneven split [1, 2]
    with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
        f.write('{"model_max_length": 256}')
    seqs = random_seqs([5, 9, 2], seed=1)
    rep = spawn(export_job, 2, src, str(tmp_path), seqs)[0]
    ref = load_file(os.path.join(src, "model.safetensors"))
    tensor_bytes = {k: v.numel() * v.element_size() for k, v in ref.items()}
    for lname in ("tp2", "pp2"):
        out = str(tmp_path / lname)
        # a sharded export (index + several files), tokenizer/generation files copied, no temp dirs left
        assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
        assert os.path.exists(os.path.join(out, "tokenizer_config.json"))
        assert not [d for d in os.listdir(tmp_path) if ".tmp-" in d]
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        for k, v in ref.items():
            assert torch.equal(loaded[k], v), (lname, k)
        # the stream: every HF tensor exactly once, buckets close as soon as they reach BUCKET bytes
        names, sizes = rep[lname]["names"], rep[lname]["sizes"]
        assert sorted(names) == sorted(ref)
        for b in sizes[:-1]:
            assert sum(b) >= BUCKET and sum(b) - b[-1] < BUCKET
        assert len(sizes) > 3 and max(sum(b) for b in sizes) < sum(tensor_bytes.values()) / 2
    # critic: transformers' token-classification head on the exported weights gives the same values
    crit = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic"), dtype=torch.float32).eval()
    vals, mask = rep["critic_values"], rep["critic_mask"]
    for i, s in enumerate(seqs):
        with torch.no_grad():
            v = crit(torch.tensor([s])).logits[0, :, 0]  # [L] value of the state after token t
        got = vals[i][mask[i]]  # aligned: index t holds V(state after token t-1)
        assert got[0] == 0
        assert torch.allclose(got[1:], v[:-1], atol=1e-5), (got, v)
