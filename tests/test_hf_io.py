"""trainer.hf_io: one config reader, RoPE, safetensors reader and stop-id rule for the bridge and the engines."""

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

from megatron_bridge.convert import HFCheckpoint
from megatron_bridge.hf_config import read_hf_config
from trainer import hf_io
from trainer.hf_io import (
    ArchConfig,
    SafetensorsDir,
    UnsupportedConfig,
    iter_safetensors,
    read_config,
    rope_inv_freq,
    stop_token_ids,
)
from trainer.rollout.generate import eos_token_ids
from trainer.rollout.hf_model import ModelConfig, iter_checkpoint_tensors

BASE = dict(model_type="llama", vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2)


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)


# ------------------------------------------------------------------------------------------ config


def test_one_reader_for_both_consumers():
    assert ModelConfig is ArchConfig and HFCheckpoint is SafetensorsDir


@pytest.mark.parametrize("raw,theta,scaling", [
    # The engine refused this before ("partial_rotary_factor != 1"), the bridge accepted it.
    ({**BASE, "partial_rotary_factor": None}, 10000.0, {"rope_type": "default"}),
    # transformers v5 per-layer-type rope: the bridge read it as default rope with theta 10000 (wrong
    # angles, silently), the engine as linear with theta 1e6.
    ({**BASE, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}},
     1e6, {"rope_type": "linear", "factor": 2.0}),
    # v4 rope_theta + rope_scaling next to a v5 rope_parameters: the bridge dropped the scaling.
    ({**BASE, "rope_parameters": {"rope_theta": 5e5}, "rope_scaling": {"type": "linear", "factor": 4.0}},
     5e5, {"rope_type": "linear", "factor": 4.0}),
    # llama3 without original_max_position_embeddings and max_position_embeddings: the bridge failed
    # building its rope table (None / low_freq_factor), the engine took 2048.
    ({**BASE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 2048}),
])
def test_configs_one_consumer_refused_now_read_alike(tmp_path, raw, theta, scaling):
    write_json(tmp_path / "config.json", raw)
    bridge, engine = read_hf_config(str(tmp_path)), ModelConfig.from_pretrained(str(tmp_path))
    assert bridge == engine == ModelConfig.from_hf_dict(raw) == read_hf_config(raw)
    assert engine.rope_theta == theta and engine.rope_scaling == scaling
    assert torch.equal(rope_inv_freq(bridge), rope_inv_freq(engine))


@pytest.mark.parametrize("kind,kw", [
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 16}, eos_token_id=[2, 5], torch_dtype="bfloat16")),
    ("qwen2", dict(tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    ("qwen3", dict(head_dim=24, rope_theta=5000.0)),
])
def test_transformers_configs_read_alike(tmp_path, kind, kw):
    import transformers as tf

    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config}[kind]
    cls(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, **kw).save_pretrained(str(tmp_path))
    cfg = read_config(str(tmp_path))
    assert cfg == read_hf_config(str(tmp_path)) == ModelConfig.from_pretrained(str(tmp_path))
    assert (cfg.model_type, cfg.num_heads, cfg.num_kv_heads, cfg.num_groups) == (kind, 4, 2, 2)
    assert cfg.head_dim == kw.get("head_dim", 16) and cfg.qkv_bias == (kind == "qwen2") and cfg.qk_norm == (kind == "qwen3")
    assert cfg.rope_theta == kw.get("rope_theta", 10000.0) and cfg.max_position_embeddings == 128
    if kind == "llama":
        assert cfg.eos_token_id == (2, 5) and cfg.torch_dtype == torch.bfloat16 and cfg.rope_type == "llama3"


@pytest.mark.parametrize("patch,field", [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1.0}}, "rope type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"quantization_config": {"quant_method": "gptq"}}, "gptq"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_both_consumers_refuse_the_same_configs(patch, field):
    raw = {**BASE, **patch}
    for read in (read_hf_config, ModelConfig.from_hf_dict, read_config):
        with pytest.raises(UnsupportedConfig, match=field) as e:
            read(raw)
        assert isinstance(e.value, ValueError) and isinstance(e.value, NotImplementedError)


@pytest.mark.parametrize("patch", [{"attention_bias": True}, {"mlp_bias": True}])
def test_bridge_refuses_biases_the_engine_runs(patch):
    cfg = ModelConfig.from_hf_dict({**BASE, **patch})
    assert cfg.o_bias or cfg.mlp_bias
    with pytest.raises(NotImplementedError, match=next(iter(patch)) + ".*megatron bridge"):
        read_hf_config({**BASE, **patch})


# ------------------------------------------------------------------------------------------- RoPE


def _inv_freq_f64(d, theta, scaling):
    """Hand formula, float64, one frequency at a time."""
    out = []
    for i in range(d // 2):
        f = theta ** (-2.0 * i / d)
        kind = scaling.get("rope_type", "default")
        if kind == "linear":
            f /= scaling["factor"]
        elif kind == "llama3":
            L, lo, hi, k = (scaling["original_max_position_embeddings"], scaling["low_freq_factor"],
                            scaling["high_freq_factor"], scaling["factor"])
            w = 2 * math.pi / f
            if w > L / lo:
                f /= k
            elif w >= L / hi:
                s = (L / w - lo) / (hi - lo)
                f = (1 - s) * f / k + s * f
        out.append(f)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 3.0},
    # L = 256: the 32 frequencies of head_dim 64 at theta 5e5 fall in all three llama3 bands
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
])
def test_rope_inv_freq_against_float64_formula(scaling):
    cfg = read_config({**BASE, "hidden_size": 256, "head_dim": 64, "rope_theta": 5e5, "rope_scaling": scaling})
    inv = rope_inv_freq(cfg)
    ref = _inv_freq_f64(64, 5e5, cfg.rope_scaling)
    assert inv.dtype == torch.float32 and inv.shape == (32,)
    assert torch.allclose(inv.double(), ref, rtol=2e-6, atol=0)
    if scaling and scaling["rope_type"] == "llama3":
        w = 2 * math.pi / ref
        bands = {"kept": w < 256 / 4, "blended": (w >= 256 / 4) & (w <= 256), "scaled": w > 256}
        assert all(b.any() for b in bands.values()), bands


# ------------------------------------------------------------------------------------ safetensors


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.w{j}": torch.randn(3 + i, 5, generator=g) for i in range(4) for j in range(2)} | {
        "model.norm.weight": torch.randn(5, generator=g).to(torch.bfloat16)}


def _save_single_and_sharded(tmp_path):
    t = _tensors()
    one, many = tmp_path / "one", tmp_path / "many"
    one.mkdir(), many.mkdir()
    save_file(t, str(one / "model.safetensors"))
    names = sorted(t)
    shards = [names[:3], names[3:6], names[6:]]
    weight_map = {}
    for k, part in enumerate(shards):
        fn = f"model-{k + 1:05d}-of-00003.safetensors"
        save_file({n: t[n] for n in part}, str(many / fn))
        weight_map.update({n: fn for n in part})
    write_json(many / hf_io.INDEX_FILE, {"metadata": {}, "weight_map": weight_map})
    # a stray file the index does not list is not read (the index is authoritative, as in transformers)
    save_file({"stray": torch.zeros(1)}, str(many / "leftover.safetensors"))
    return t, str(one), str(many)


def test_sharded_read_equals_single_file_read(tmp_path):
    t, one, many = _save_single_and_sharded(tmp_path)
    a, b = dict(iter_safetensors(one)), dict(iter_safetensors(many))
    assert sorted(a) == sorted(b) == sorted(t)
    assert all(torch.equal(a[n], b[n]) and a[n].dtype == b[n].dtype == t[n].dtype for n in t)
    sa, sb = SafetensorsDir(one), SafetensorsDir(many)
    assert len(sb.files) == 3 and "stray" not in sb
    assert all(torch.equal(sa.get(n), sb.get(n)) and sa.spec(n) == sb.spec(n) for n in t)
    assert sb.spec("model.norm.weight") == ((5,), "BF16")
    # name filters: a collection or a predicate, the same tensors from either layout
    want = ["model.layers.2.w1", "model.norm.weight"]
    assert sorted(n for n, _ in iter_safetensors(many, want)) == want
    pick = lambda n: n.endswith("w0")  # noqa: E731
    fa, fb = dict(iter_safetensors(one, pick)), dict(iter_safetensors(many, pick))
    assert sorted(fa) == sorted(fb) == [f"model.layers.{i}.w0" for i in range(4)]
    assert dict(iter_checkpoint_tensors(many)).keys() == b.keys()  # the engine's name for the same reader
    with pytest.raises(KeyError, match="model.nope"):
        iter_safetensors(one, ["model.nope"])


def test_no_safetensors_is_a_clear_error(tmp_path):
    torch.save({"w": torch.zeros(1)}, str(tmp_path / "pytorch_model.bin"))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors.*pytorch_model\.bin.*save_pretrained"):
        iter_safetensors(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        SafetensorsDir(str(tmp_path / "missing"))


# ------------------------------------------------------------------------------------------- stops


def _word_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2, "hi": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def test_stop_ids_are_the_union_of_tokenizer_generation_config_and_config(tmp_path):
    tok = _word_tokenizer(tmp_path)
    assert tok.eos_token_id == 1
    write_json(tmp_path / "config.json", {**BASE, "eos_token_id": 7})
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [9, 3]})  # differs from the tokenizer's
    assert stop_token_ids(str(tmp_path), tok) == [1, 3, 7, 9]
    assert eos_token_ids(str(tmp_path), tok) == [1, 3, 7, 9]  # the servers' / CLI's name: the same rule
    assert stop_token_ids(str(tmp_path)) == [3, 7, 9]
    write_json(tmp_path / "generation_config.json", {"eos_token_id": 1})  # int form, overlapping the tokenizer
    assert stop_token_ids(str(tmp_path), tok) == [1, 7]
    os.remove(tmp_path / "generation_config.json")
    write_json(tmp_path / "config.json", {**BASE, "eos_token_id": None})
    assert stop_token_ids(str(tmp_path), tok) == [1]
    assert stop_token_ids(str(tmp_path)) == []
