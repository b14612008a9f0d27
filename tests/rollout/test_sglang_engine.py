"""The SGLang engine adapter (pinned sglang==0.5.21).

CPU part: the pure functions, on payloads shaped exactly as sglang 0.5.21 returns them, and the
engine's own bookkeeping (weight sessions, running checksum, sleep/wake, flush, abort) driven through
a stand-in for ``sglang.Engine`` that holds real weight tensors -- so the checksum is compared
against what the stand-in actually holds, not against the adapter's own records.

GPU part (``@pytest.mark.gpu``, needs CUDA and sglang): the real engine on tiny random models against
transformers: greedy outputs, temperature-scaled log-probs, stop tokens, weight updates, sleep/wake
with the memory saver (weights lost and re-pushed: GPU only, the memory saver needs CUDA).

CPU part (``test_cpu_*``): the real engine on SGLang's CPU path, one engine for the module, in the
SGLang CPU venv (run there by tests/rollout/test_sglang_cpu_suite.py; see sglang_cpu_support.py):
greedy and stop tokens vs transformers, log-probs at T=1 / 0.7 / top-k+top-p / greedy, bucketed
weight pushes verified three ways (outputs, checksum, read-back) and restored exactly, sleep/wake
right after generate (CPU form), flush and abort.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import types
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from trainer.rollout.engine import GenerationOutput, SamplingParams, checksum_named_tensors, iter_buckets
from trainer.rollout import sglang_engine as se
from trainer.rollout import weights as wf

from .conftest import make_hf_model, save_model


# --------------------------------------------------------------------------------------------------
# SGLang 0.5.21 result dicts, as Engine.generate(input_ids=[[...], ...], return_logprob=True) returns them
# with skip_tokenizer_init=True: managers/tokenizer_manager.py _handle_batch_output, the
# BatchTokenIDOutput branch (~2539) builds {"output_ids", "meta_info"}; meta_info is built at ~2372
# ("id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions"), extended by
# add_logprob_to_meta_info (~2711: "input_token_logprobs", "output_token_logprobs" as
# (logprob, token_id, None) tuples from detokenize_logprob_tokens ~2910, "output_token_logprobs_length")
# and at ~2419 ("reasoning_tokens", "completion_tokens", "cached_tokens"). finish_reason dicts are the
# to_json() of FINISH_MATCHED_TOKEN / FINISH_LENGTH / FINISH_ABORT (managers/schedule_batch.py ~270-330).
# --------------------------------------------------------------------------------------------------
def sglang_result(rid, prompt_len, output_ids, finish_reason, logprobs=None):
    logprobs = [-0.5 - 0.1 * k for k in range(len(output_ids))] if logprobs is None else logprobs
    toks = [(lp, t, None) for lp, t in zip(logprobs, output_ids)]
    return {
        "output_ids": list(output_ids),
        "meta_info": {
            "id": rid,
            "finish_reason": finish_reason,
            "prompt_tokens": prompt_len,
            "weight_version": "default",
            "num_retractions": 0,
            "input_token_logprobs": [],
            "output_token_logprobs": toks,
            "output_token_logprobs_length": len(toks),
            "reasoning_tokens": 0,
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
        },
    }


def stop_reason(tok):  # FINISH_MATCHED_TOKEN.to_json()
    return {"type": "stop", "matched": tok}


def length_reason(n):  # FINISH_LENGTH.to_json()
    return {"type": "length", "length": n}


ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}  # FINISH_ABORT().to_json()


def abort_queued_result(rid):
    """A request aborted while still queued: tokenizer_manager.py _handle_abort_req (~3370) answers
    with no tokens and this finish reason (the scheduler sends no reason of its own, scheduler.py ~5465)."""
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {"id": rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                      "weight_version": "default", "e2e_latency": 0.01, "input_token_logprobs": [],
                      "output_token_logprobs": [], "output_token_logprobs_length": 0, "completion_tokens": 0},
    }


# The fields of sglang 0.5.21 sampling/sampling_params.py SamplingParams (API part), copied from the source.
SGLANG_SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
    "custom_params",
}


# --------------------------------------------------------------------------------------------------
# Sampling parameters and the n-expansion
# --------------------------------------------------------------------------------------------------
def test_sampling_params_dict_fields_and_values():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=None, max_new_tokens=33, stop_token_ids=[5, 2])
    d = se.sampling_params_dict(sp, sampling_seed=123)
    assert set(d) <= SGLANG_SAMPLING_FIELDS  # every key is a real SGLang field (a typo would raise there)
    assert d == {"n": 1, "max_new_tokens": 33, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0,
                 "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
                 "ignore_eos": False, "stop_token_ids": [5, 2], "no_stop_trim": True, "sampling_seed": 123}
    assert se.sampling_params_dict(SamplingParams(), 0)["stop_token_ids"] is None


@pytest.mark.parametrize("top_k,expected", [(None, -1), (0, -1), (1, 1), (5, 5)])
def test_top_k_mapping(top_k, expected):
    assert se.sglang_top_k(top_k) == expected
    assert se.sampling_params_dict(SamplingParams(temperature=1.0, top_k=top_k), 0)["top_k"] == expected


def test_greedy_is_top_k_one_at_temperature_one():
    # T = 0 -> SGLang's own greedy form (temperature 1, top_k 1): argmax, log-prob at T = 1.
    d = se.sampling_params_dict(SamplingParams(temperature=0.0, top_k=7, top_p=0.5), 0)
    assert (d["temperature"], d["top_k"], d["top_p"]) == (1.0, 1, 1.0)


def test_request_seed():
    s = {(i, j): se.request_seed(7, i, j) for i in range(4) for j in range(4)}
    assert len(set(s.values())) == 16  # samples and prompts all get different streams
    assert all(0 <= v < 2**63 for v in s.values())  # SGLang's range check (sampling_params.py ~282)
    assert se.request_seed(7, 2, 3) == s[(2, 3)] and se.request_seed(8, 2, 3) != s[(2, 3)]
    assert se.request_seed(None, 0, 0) != se.request_seed(None, 0, 0)  # fresh randomness, never SGLang's fixed 42


def test_expand_requests_n_per_prompt_and_back():
    prompts = [[1, 2, 3], [4], [5, 6]]
    params = [SamplingParams(n=2, seed=1), SamplingParams(n=1, temperature=0), SamplingParams(n=3, seed=1)]
    req = se.expand_requests(prompts, params, rid_prefix="call")
    assert req.index == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    assert req.input_ids == [[1, 2, 3], [1, 2, 3], [4], [5, 6], [5, 6], [5, 6]]
    assert req.rids == ["call-0-0", "call-0-1", "call-1-0", "call-2-0", "call-2-1", "call-2-2"]
    assert [d["sampling_seed"] for d in req.sampling_params[3:]] == [se.request_seed(1, 2, j) for j in range(3)]
    assert all(d["n"] == 1 for d in req.sampling_params)
    assert req.sampling_params[2]["top_k"] == 1  # the greedy prompt keeps its own params
    # Results come back in request order; each lands at [i][j].
    outs = [sglang_result(rid, len(p), [10 * i + j, 1], stop_reason(1)) for rid, p, (i, j) in zip(req.rids, req.input_ids, req.index)]
    grouped = se.group_outputs(outs, req)
    assert [[o.token_ids[0] for o in g] for g in grouped] == [[0, 1], [10], [20, 21, 22]]
    # One SamplingParams for all prompts; a length mismatch and an empty prompt are errors.
    assert se.expand_requests(prompts, SamplingParams(n=2)).num_samples == [2, 2, 2]
    with pytest.raises(ValueError, match="3 prompts but 2"):
        se.expand_requests(prompts, params[:2])
    with pytest.raises(ValueError, match="empty"):
        se.expand_requests([[1], []], SamplingParams())


def test_group_outputs_checks_ids_and_count():
    req = se.expand_requests([[1], [2]], SamplingParams(), rid_prefix="x")
    good = [sglang_result("x-0-0", 1, [3], length_reason(1)), sglang_result("x-1-0", 1, [4], length_reason(1))]
    assert [g[0].token_ids for g in se.group_outputs(good, req)] == [[3], [4]]
    with pytest.raises(ValueError, match="expected"):
        se.group_outputs(good[::-1], req)
    with pytest.raises(ValueError, match="2 requests sent but 1"):
        se.group_outputs(good[:1], req)


# --------------------------------------------------------------------------------------------------
# Output mapping
# --------------------------------------------------------------------------------------------------
def test_stop_token_is_included_with_its_logprob():
    out = se.to_generation_output(sglang_result("r", 4, [7, 8, 2], stop_reason(2), [-0.1, -0.2, -0.3]))
    assert out == GenerationOutput([7, 8, 2], [-0.1, -0.2, -0.3], "stop")


def test_length_finish():
    out = se.to_generation_output(sglang_result("r", 4, [7, 8, 9, 9], length_reason(4)))
    assert out.finish_reason == "length" and out.token_ids == [7, 8, 9, 9] and len(out.logprobs) == 4


def test_abort_running_and_queued():
    out = se.to_generation_output(sglang_result("r", 4, [7, 8], ABORT_RUNNING))
    assert (out.token_ids, out.finish_reason) == ([7, 8], "abort")
    out = se.to_generation_output(abort_queued_result("q"))
    assert out == GenerationOutput([], [], "abort")
    # An aborted request that has fewer log-probs than tokens is cut to the tokens that have one.
    res = sglang_result("r", 4, [7, 8, 9], ABORT_RUNNING)
    res["meta_info"]["output_token_logprobs"] = res["meta_info"]["output_token_logprobs"][:2]
    assert se.to_generation_output(res).token_ids == [7, 8]


def test_output_mapping_errors():
    res = sglang_result("r", 4, [7, 8, 9], length_reason(3))
    res["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(ValueError, match="3 output tokens but 2 log-probs"):
        se.to_generation_output(res)
    res = sglang_result("r", 4, [7, 8], length_reason(2))
    res["meta_info"]["output_token_logprobs"][1] = (-0.3, 99, None)
    with pytest.raises(ValueError, match="token ids differ"):
        se.to_generation_output(res)
    with pytest.raises(ValueError, match="last output token is 8"):  # a trimmed stop token would be caught
        se.to_generation_output(sglang_result("r", 4, [7, 8], stop_reason(2)))
    with pytest.raises(ValueError, match="unfinished"):
        se.to_generation_output(sglang_result("r", 4, [7], None))
    with pytest.raises(ValueError, match="unknown"):
        se.to_generation_output(sglang_result("r", 4, [7], {"type": "weird"}))


# --------------------------------------------------------------------------------------------------
# Engine arguments
# --------------------------------------------------------------------------------------------------
def test_engine_args():
    a = se.engine_args(model_path="/m", tp_size=2, mem_fraction_static=0.4, dtype="float", seed=3, deterministic=True,
                       engine_kwargs={"attention_backend": "triton", "log_level": "info"})
    assert a == {"model_path": "/m", "tp_size": 2, "mem_fraction_static": 0.4, "dtype": "float32", "random_seed": 3,
                 "skip_tokenizer_init": True, "enable_memory_saver": True, "enable_deterministic_inference": True,
                 "log_level": "info", "attention_backend": "triton"}
    for bad, match in [({"dp_size": 2}, "dp_size"), ({"skip_tokenizer_init": False}, "skip_tokenizer_init"),
                       ({"bucket_bytes": 1}, "SGLangEngine arguments")]:
        with pytest.raises(ValueError, match=match):
            se.engine_args(model_path="/m", engine_kwargs=bad)
    with pytest.raises(ValueError, match="auto"):
        se.engine_args(model_path="/m", dtype="auto")
    assert se.resolve_dtype("half") is torch.float16 and se.resolve_dtype(torch.bfloat16) is torch.bfloat16


def test_check_logprob_env():
    se.check_logprob_env({})
    se.check_logprob_env({"SGLANG_RETURN_ORIGINAL_LOGPROB": "0"})
    for v in ("1", "true", "True"):
        with pytest.raises(ValueError, match="before the temperature"):
            se.check_logprob_env({"SGLANG_RETURN_ORIGINAL_LOGPROB": v})


def test_from_config_maps_rollout_names():
    class Capture(se.SGLangEngine):
        def __init__(self, model_path, **kw):
            self.model_path, self.kw = model_path, kw

    e = Capture.from_config(model_path="/m", tensor_model_parallel_size=2, gpu_memory_utilization=0.6, dtype="bfloat16",
                            seed=5, max_num_seqs=64, max_num_batched_tokens=4096, enforce_eager=True,
                            engine_kwargs={"deterministic": True, "attention_backend": "fa3", "max_running_requests": 32})
    assert e.model_path == "/m"
    assert e.kw == {"tp_size": 2, "mem_fraction_static": 0.6, "dtype": "bfloat16", "seed": 5, "deterministic": True,
                    "engine_kwargs": {"max_running_requests": 32, "chunked_prefill_size": 4096,
                                      "disable_cuda_graph": True, "attention_backend": "fa3"}}
    e = Capture.from_config(model_path="/m", enable_chunked_prefill=False, max_num_batched_tokens=4096)
    assert e.kw["engine_kwargs"] == {"chunked_prefill_size": -1}


# --------------------------------------------------------------------------------------------------
# Weights: checkpoint index, validation, bucketing, flattening, checksum
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """arch -> (hf model, dir). qwen2 has tied embeddings (conftest), llama does not."""
    out = {}
    for arch in ("qwen2", "llama"):
        hf = make_hf_model(arch)
        out[arch] = (hf, save_model(hf, tmp_path_factory.mktemp(arch)))
    return out


def hf_weights(hf, tied: bool) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if tied:
        sd.pop("lm_head.weight")
    return sd


def test_read_checkpoint_index(ckpts):
    for arch, tied in (("qwen2", True), ("llama", False)):
        hf, path = ckpts[arch]
        specs, skip = wf.read_checkpoint_index(path)
        want = hf_weights(hf, tied)
        assert {n: s.shape for n, s in specs.items()} == {n: tuple(t.shape) for n, t in want.items()}
        assert ("lm_head.weight" in skip) == tied


def test_validate_named_tensors(ckpts):
    hf, path = ckpts["qwen2"]
    specs, skip = wf.read_checkpoint_index(path)
    w = hf_weights(hf, tied=False)  # includes the tied lm_head: skipped like the native engine does
    got = wf.validate_named_tensors(w.items(), specs, skip)
    assert [n for n, _ in got] == [n for n in w if n != "lm_head.weight"]
    with pytest.raises(KeyError, match="unknown weight 'model.nope'"):
        wf.validate_named_tensors([("model.nope", torch.zeros(1))], specs, skip)
    name = "model.layers.0.self_attn.k_proj.weight"  # [32, 64] (GQA): its transpose is a wrong shape
    with pytest.raises(ValueError, match=r"shape \(64, 32\) != expected \(32, 64\)"):
        wf.validate_named_tensors([(name, w[name].T)], specs, skip)
    with pytest.raises(ValueError, match="twice"):
        wf.validate_named_tensors([(name, w[name]), (name, w[name])], specs, skip)
    with pytest.raises(ValueError, match="floating"):
        wf.validate_named_tensors([(name, w[name].long())], specs, skip)


def test_bucket_sizes_are_measured_after_the_cast():
    # bf16 sizes: a 10 el = 20 B, b 12 el = 24 B, c 5 el = 10 B, d 100 el = 200 B, e 2 el = 4 B; limit 64 B.
    # a+b+c = 54 <= 64, +d would be 254 -> [a,b,c]; d alone (200 > 64, a lone larger tensor); d+e -> [d]; [e].
    # Measured in fp32 (40, 48, ...) a+b = 88 > 64 would already split: the cast halves what is sent.
    ts = [(n, torch.randn(k)) for n, k in (("a", 10), ("b", 12), ("c", 5), ("d", 100), ("e", 2))]
    got = [[n for n, _ in b] for b in wf.iter_cast_buckets(ts, torch.bfloat16, 64)]
    assert got == [["a", "b", "c"], ["d"], ["e"]]
    assert [[n for n, _ in b] for b in iter_buckets(ts, 64)][0] == ["a"]  # the fp32-measured grouping differs


@pytest.mark.parametrize("seed", range(5))
def test_buckets_cover_stream_in_order_and_bound_the_peak(seed):
    g = torch.Generator().manual_seed(seed)
    ts = [(f"t{k}", torch.randn(int(torch.randint(1, 300, (1,), generator=g)), generator=g)) for k in range(40)]
    limit = int(torch.randint(50, 400, (1,), generator=g))
    buckets = list(wf.iter_cast_buckets(ts, torch.float16, limit))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in ts]
    sizes = [sum(2 * t.numel() for _, t in b) for b in buckets]
    for b, s in zip(buckets, sizes):
        assert s <= limit or len(b) == 1  # over the limit only as a lone tensor
    # Greedy packing: no bucket could have taken the next tensor.
    for b, nxt, s in zip(buckets, buckets[1:], sizes):
        assert s + 2 * nxt[0][1].numel() > limit
    assert max(sizes) <= max(limit, max(2 * t.numel() for _, t in ts))  # the peak of one flat buffer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_flatten_bucket_matches_sglang_layout(dtype):
    g = torch.Generator().manual_seed(0)
    named = [("w", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g)),  # odd element count
             ("e", torch.randn(0, 4, generator=g)), ("x", torch.randn(2, 2, 3, generator=g).double())]
    flat, metas = wf.flatten_bucket(named, dtype)
    # SGLang's FlattenedTensorBucket (weight_sync/tensor_bucket.py): each tensor's .flatten().view(uint8),
    # concatenated; metadata offsets in bytes. Reference built that way from independently cast tensors.
    ref = torch.cat([t.to(dtype).flatten().view(torch.uint8) for _, t in named])
    assert flat.dtype == torch.uint8 and torch.equal(flat, ref)
    size = torch.empty((), dtype=dtype).element_size()
    off = 0
    for m, (name, t) in zip(metas, named):
        assert (m.name, m.shape, m.dtype, m.start_idx, m.numel) == (name, tuple(t.shape), dtype, off, t.numel() * size)
        assert m.end_idx == off + m.numel and m.start_idx % size == 0  # aligned, so .view(dtype) can read it back
        off = m.end_idx
    for (name, t), (n2, back) in zip(named, wf.unflatten_bucket(flat, metas)):
        assert n2 == name and back.dtype == dtype and torch.equal(back, t.to(dtype))
    with pytest.raises(ValueError, match="empty"):
        wf.flatten_bucket([], dtype)


def test_combine_digests_equals_checksum_named_tensors():
    from trainer.rollout.engine import tensor_digest

    g = torch.Generator().manual_seed(3)
    named = [(f"p{k}", torch.randn(k + 1, 3, generator=g)) for k in range(6)]
    for dt in (None, torch.bfloat16):
        digests = {n: tensor_digest(n, t, dt) for n, t in reversed(named)}
        assert wf.combine_digests(digests) == checksum_named_tensors(named, dtype=dt)


def test_readback_compares_the_unpadded_region_and_wants_zero_padding():
    """SGLang may hold ``down_proj`` with its intermediate size padded (columns beyond the model's): the rows read
    back are compared on the model's region, and the padding must be zero."""
    want = torch.randn(4, 200, generator=torch.Generator().manual_seed(0))
    padded = torch.zeros(4, 224)
    padded[:, :200] = want
    assert wf.readback_error(want.clone(), want) == 0.0
    assert wf.readback_error(padded, want) == 0.0
    off = padded.clone()
    off[1, 3] += 0.5
    assert wf.readback_error(off, want) == pytest.approx(0.5)
    dirty = padded.clone()
    dirty[2, 210] = 1e-3  # a padding column that is not zero would add to every output
    assert wf.readback_error(dirty, want) == float("inf")
    assert wf.readback_error(want[:, :150], want) == float("inf")  # shorter: not the same tensor
    assert wf.readback_error(want.flatten(), want) == float("inf")


def test_default_probe_names(ckpts):
    specs, _ = wf.read_checkpoint_index(ckpts["llama"][1])
    assert wf.default_probe_names(specs) == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                             "model.layers.1.mlp.down_proj.weight", "model.norm.weight"]


# --------------------------------------------------------------------------------------------------
# The engine's bookkeeping, through a stand-in for sglang.Engine
# --------------------------------------------------------------------------------------------------
@dataclass
class FakeFlatMeta:  # the fields of sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FakeEngine:
    """Holds real weights (loaded from the checkpoint in the engine dtype) and answers the 0.5.21
    calls the adapter makes with 0.5.21's return shapes; rejects updates outside a session as
    0.5.21 does (scheduler_components/weight_updater.py ~219); loses released weights unless the
    CPU backup is on."""

    def __init__(self, **kw):
        self.kw = kw
        dt = se.DTYPES[kw["dtype"]]
        self.weights = {n: t.to(dt) for n, t in load_file(f"{kw['model_path']}/model.safetensors").items()}
        self.session = False
        self.released: set[str] = set()
        self.calls: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = types.SimpleNamespace(abort_request=lambda rid="", abort_all=False: self.calls.append(f"abort:{rid!r}:{abort_all}"))

    def begin_weight_update(self, selector="all"):
        self.calls.append("begin")
        ok = not self.session
        self.session = True
        return ok, "Success" if ok else "a weight-update session is already open"

    def end_weight_update(self):
        self.calls.append("end")
        ok, self.session = self.session, False
        return ok, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append("update")
        if not self.session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        assert load_format == "flattened_bucket" and not flush_cache
        assert len(named_tensors) == self.kw["tp_size"]  # one payload per TP rank
        payload = named_tensors[0]  # the stand-in serializer passes objects through
        assert "weights" not in self.released, "writing into released weights"
        for m in payload["metadata"]:
            src = payload["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)
            self.weights[m.name].copy_(src)
        return True, "Success"

    def release_memory_occupation(self, tags=None):
        self.calls.append(f"release:{','.join(tags)}")
        self.released.update(tags)
        if "weights" in tags and not self.kw.get("enable_weights_cpu_backup"):
            for t in self.weights.values():
                t.fill_(float("nan"))  # contents gone

    def resume_memory_occupation(self, tags=None):
        self.calls.append(f"resume:{','.join(tags)}")
        self.released.difference_update(tags)

    def flush_cache(self):
        self.calls.append("flush")
        return types.SimpleNamespace(success=True, message="")

    def generate(self, input_ids, sampling_params, return_logprob, rid):
        assert not self.released and return_logprob
        self.calls.append("generate")
        # A response that depends on the weights: token = round(first embedding entry) mod 5, then stop 1.
        tok = int(abs(float(self.weights["model.embed_tokens.weight"][0, 0])) * 10) % 5 + 2
        return [sglang_result(r, len(p), [tok, 1], stop_reason(1)) for r, p in zip(rid, input_ids)]

    def get_weights_by_name(self, name, truncate_size=100):
        return self.weights[name].to(torch.float32).tolist()[:truncate_size]


@pytest.fixture
def fake_sglang(monkeypatch):
    mods = {name: types.ModuleType(name) for name in
            ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.utils.patch_torch",
             "sglang.srt.weight_sync", "sglang.srt.weight_sync.tensor_bucket")}
    mods["sglang"].__version__ = se.SGLANG_VERSION
    mods["sglang"].Engine = FakeEngine
    mods["sglang.srt.utils"].MultiprocessingSerializer = types.SimpleNamespace(serialize=lambda obj: obj)
    mods["sglang.srt.utils.patch_torch"].monkey_patch_torch_reductions = lambda: None
    mods["sglang.srt.weight_sync.tensor_bucket"].FlattenedTensorMetadata = FakeFlatMeta
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods


def held_checksum(fake: FakeEngine) -> str:
    """What the stand-in actually holds, hashed independently of the adapter's records (a tied
    checkpoint stores no lm_head, so there is nothing to leave out)."""
    return checksum_named_tensors(fake.weights.items())


def test_missing_sglang_names_the_extra(ckpts, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # makes `import sglang` raise ImportError
    with pytest.raises(ImportError, match=r"coxswain\[sglang\].*sglang==0\.5\.21.*sglang_cpu install"):
        se.SGLangEngine(device="cuda", model_path=ckpts["qwen2"][1])


def test_engine_constructs_sglang_with_exact_args(ckpts, fake_sglang):
    e = se.SGLangEngine(device="cuda", model_path=ckpts["qwen2"][1], tp_size=2, dtype="bfloat16", seed=9, engine_kwargs={"attention_backend": "triton"})
    assert e.engine.kw == {"model_path": ckpts["qwen2"][1], "tp_size": 2, "mem_fraction_static": 0.5, "dtype": "bfloat16",
                           "random_seed": 9, "skip_tokenizer_init": True, "enable_memory_saver": True,
                           "enable_deterministic_inference": False, "log_level": "error", "attention_backend": "triton"}
    fake_sglang["sglang"].__version__ = "0.4.0"
    with pytest.warns(UserWarning, match="0.5.21"):
        se.SGLangEngine(device="cuda", model_path=ckpts["qwen2"][1])


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_running_checksum_tracks_what_the_engine_holds(ckpts, fake_sglang, arch):
    hf, path = ckpts[arch]
    e = se.SGLangEngine(path, device="cuda", dtype="bfloat16", bucket_bytes=20_000)
    fake = e.engine
    # At start: the checkpoint, in the engine dtype, tied lm_head left out.
    assert e.weights_checksum() == held_checksum(fake) == checksum_named_tensors(hf_weights(hf, arch == "qwen2").items(), dtype=torch.bfloat16)
    # A partial push in fp32 (cast on the way), then the rest from another model in reverse order.
    other = hf_weights(make_hf_model(arch, seed=5), arch == "qwen2")
    names = list(other)
    written = e.update_weights([(n, other[n]) for n in names[:3]])
    assert written == names[:3] and e.weights_checksum() == held_checksum(fake)
    e.update_weights([(n, other[n]) for n in reversed(names[3:])])
    assert e.weights_checksum() == held_checksum(fake) == checksum_named_tensors(other.items(), dtype=torch.bfloat16)
    # Each update_weights call is one session; several flat buckets inside it (bucket_bytes 20 kB).
    assert fake.calls[0] == "begin" and fake.calls.count("begin") == fake.calls.count("end") == 2
    assert fake.calls.count("update") > 2
    # The prefix cache is flushed once, before the next generation.
    e.generate([[1, 2]], SamplingParams())
    assert fake.calls[-2:] == ["flush", "generate"]
    e.generate([[1, 2]], SamplingParams())
    assert fake.calls[-2:] == ["generate", "generate"]
    # Read-back of the probe parameters: exact after pushes; a corrupted parameter is caught.
    assert set(e.verify_weights_on_gpu(rows=2).values()) == {0.0}
    fake.weights[e.probe_names[0]][0, 0] += 1.0
    assert e.verify_weights_on_gpu(rows=2)[e.probe_names[0]] > 0.5


def test_a_bad_name_pushes_nothing(ckpts, fake_sglang):
    e = se.SGLangEngine(device="cuda", model_path=ckpts["llama"][1], dtype="float32")
    before = held_checksum(e.engine)
    w = hf_weights(make_hf_model("llama", seed=2), False)
    with pytest.raises(KeyError):
        e.update_weights(list(w.items())[:2] + [("model.unknown", torch.zeros(1))])
    assert held_checksum(e.engine) == before == e.weights_checksum() and "update" not in e.engine.calls


def test_sleep_wake_and_lost_weights(ckpts, fake_sglang):
    hf, path = ckpts["llama"]
    e = se.SGLangEngine(path, device="cuda", dtype="float32")
    fake = e.engine
    first = e.generate([[3, 4]], SamplingParams(n=2))
    e.sleep()
    assert fake.calls[-1] == "release:kv_cache,weights,cuda_graph"
    # Weights released without a CPU backup: no generation, no checksum until every weight is pushed again.
    with pytest.raises(RuntimeError, match="released the engine's weights"):
        e.generate([[3, 4]], SamplingParams())
    with pytest.raises(RuntimeError, match="released the engine's weights"):
        e.weights_checksum()
    w = hf_weights(hf, False)
    items = list(w.items())
    e.update_weights(items[:4])
    assert "resume:weights" in fake.calls and fake.released == {"kv_cache", "cuda_graph"}  # pushed while asleep
    with pytest.raises(RuntimeError, match=f"{len(items) - 4} of {len(items)} weights"):
        e.wake()
    e.update_weights(items[4:])
    e.wake()
    assert fake.released == set() and fake.calls[-1] == "resume:kv_cache,cuda_graph"
    assert e.weights_checksum() == held_checksum(fake)
    assert e.generate([[3, 4]], SamplingParams(n=2)) == first


@pytest.mark.parametrize("kw", [dict(release_weights_on_sleep=False), dict(engine_kwargs={"enable_weights_cpu_backup": True})])
def test_sleep_wake_keeps_weights(ckpts, fake_sglang, kw):
    e = se.SGLangEngine(device="cuda", model_path=ckpts["llama"][1], dtype="float32", **kw)
    first, ck = e.generate([[3, 4]], SamplingParams()), e.weights_checksum()
    e.sleep()
    e.sleep()  # idempotent
    assert sum(c.startswith("release") for c in e.engine.calls) == 1
    assert e.generate([[3, 4]], SamplingParams()) == first  # generating wakes the engine
    assert e.weights_checksum() == ck == held_checksum(e.engine)


def test_abort_is_handed_to_the_running_loop_until_the_call_returns(ckpts, fake_sglang):
    e = se.SGLangEngine(device="cuda", model_path=ckpts["llama"][1], dtype="float32")
    e.abort()  # nothing running: nothing sent
    assert not any(c.startswith("abort") for c in e.engine.calls)
    loop = e.engine.loop
    t = threading.Thread(target=loop.run_forever)
    t.start()
    try:
        while not loop.is_running():
            pass
        with e._gen_lock:  # as generate() marks its call
            e._gen_epoch += 1
            e._generating = True
        e.abort()
        e.abort()  # a second abort of the same call adds no second ticker
        time.sleep(0.3)  # ~6 ticks of 50 ms: re-sent while the call runs
        sent = sum(c == "abort:'':True" for c in e.engine.calls)
        with e._gen_lock:  # the call returns
            e._generating = False
        time.sleep(0.2)
        after = sum(c == "abort:'':True" for c in e.engine.calls)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=5)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(timeout=5)
    assert 3 <= sent <= 8, sent
    assert after - sent <= 1  # at most the tick already due; then it stops
    assert set(e.engine.calls) == {"abort:'':True"}


# --------------------------------------------------------------------------------------------------
# GPU: the real sglang 0.5.21 engine against transformers
# --------------------------------------------------------------------------------------------------
GPU_VOCAB = 128
# triton attention: takes fp32 and is one of the backends deterministic mode accepts
# (arg_groups/choices.py DETERMINISTIC_ATTENTION_BACKEND_CHOICES); TF32 off so fp32 means fp32.
GPU_ENGINE_KW = dict(attention_backend="triton", disable_cuda_graph=True, enable_tf32_matmul=False)


# not a multiple of 32: SGLang's CPU path pads the MLP's intermediate size to 384 (update_config.py,
# adjust_config_with_unaligned_cpu_tp), so pushes, checksums and down_proj's read-back meet a padded tensor
INTERMEDIATE = 360


def gpu_model(arch: str, seed: int):
    # head_dim 64 (hidden 256 / 4 heads) is a size every SGLang kernel takes; no rope scaling, no EOS.
    return make_hf_model(arch, seed=seed, vocab_size=GPU_VOCAB, hidden_size=256, intermediate_size=INTERMEDIATE,
                         num_attention_heads=4, num_key_value_heads=2, rope_scaling=None, tie_word_embeddings=False,
                         max_position_embeddings=2048)  # room for the abort test's long responses


def gpu_engine(path, **kw):
    pytest.importorskip("sglang", reason=f"needs sglang=={se.SGLANG_VERSION} ({se.INSTALL_HINT})")
    ekw = {**GPU_ENGINE_KW, **kw.pop("engine_kwargs", {})}
    return se.SGLangEngine(path, dtype="float32", mem_fraction_static=0.2, engine_kwargs=ekw, **kw)


def hf_greedy(hf, prompt, max_new):
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logprobs(hf, prompt, response, temperature):
    """log_softmax(logits / T)[y] of each response token from one fp32 forward (CPU), float64 softmax."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + response])).logits[0].double()  # [P+R, V]
    lp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)  # [R, V]
    return lp, lp.gather(1, torch.tensor(response)[:, None]).squeeze(1)  # [R, V], [R]


def gpu_prompts(seed=0, lens=(5, 1, 9, 3)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, GPU_VOCAB, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    out = {}
    for arch, seed in (("qwen2", 0), ("qwen2_b", 1), ("llama", 0)):
        hf = gpu_model(arch.split("_")[0], seed)
        out[arch] = (hf, save_model(hf, tmp_path_factory.mktemp(arch)))
    return out


@pytest.fixture(scope="module")
def qwen_engine(gpu_models):
    e = gpu_engine(gpu_models["qwen2"][1])
    yield e
    e.shutdown()


@pytest.mark.gpu
def test_gpu_greedy_equals_transformers_and_stop_token_included(gpu_models, qwen_engine):
    # fp32 both sides (SGLang on GPU without TF32, transformers on CPU); the tiny models' weights are
    # spread wide (conftest) so greedy meets no near-ties.
    hf, _ = gpu_models["qwen2"]
    prompts = gpu_prompts()
    outs = qwen_engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=16))
    for p, (o,) in zip(prompts, outs):
        assert o.finish_reason == "length" and o.token_ids == hf_greedy(hf, p, 16)
    # Stop on prompt 0's 6th greedy token: the response ends at its first occurrence, token included.
    free = outs[0][0].token_ids
    stop = free[5]
    (o,), = qwen_engine.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=[stop]))
    assert o.finish_reason == "stop" and o.token_ids == free[: free.index(stop) + 1] and len(o.logprobs) == len(o.token_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 1.0), (0.7, None, 1.0), (0.7, 5, 0.9), (0.0, None, 1.0)])
def test_gpu_logprobs_are_full_vocab_log_softmax_over_temperature(gpu_models, qwen_engine, temperature, top_k, top_p):
    # The engine's log-prob of each sampled token vs transformers' log_softmax(logits / T) over the FULL
    # vocabulary (T = 1 for greedy), to 1e-3 (fp32 GPU vs fp32 CPU; bf16 would need ~5e-2).
    hf, _ = gpu_models["qwen2"]
    prompts = gpu_prompts(1)
    outs = qwen_engine.generate(prompts, SamplingParams(n=2, temperature=temperature, top_k=top_k, top_p=top_p,
                                                        max_new_tokens=12, seed=3))
    renorm_gap = 0.0
    for p, samples in zip(prompts, outs):
        for o in samples:
            full, ref = hf_logprobs(hf, p, o.token_ids, temperature or 1.0)
            assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), ref, atol=1e-3)
            if top_k:  # the truncated-and-renormalised log-prob would differ by -log(kept mass)
                kept = full.topk(top_k, dim=-1).values.exp().sum(-1)
                renorm_gap = max(renorm_gap, float(-kept.log().max()))
    if top_k:
        assert renorm_gap > 1e-2  # so the 1e-3 check above does tell the two definitions apart


@pytest.mark.gpu
def test_gpu_update_weights_equals_fresh_engine(gpu_models, tmp_path):
    (hf_b, path_b), (_, path_a) = gpu_models["qwen2_b"], gpu_models["qwen2"]
    prompts = gpu_prompts(2)
    sp = SamplingParams(n=2, temperature=0.8, max_new_tokens=10, seed=11)
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    w = hf_weights(hf_b, tied=False)
    e = gpu_engine(path_a, deterministic=True, bucket_bytes=1 << 20)  # seeds reproduce only in deterministic mode
    try:
        written = e.update_weights(list(w.items()))
        assert sorted(written) == sorted(w)
        assert e.weights_checksum() == checksum_named_tensors(w.items(), dtype=torch.float32)
        pushed = e.generate(prompts, greedy), e.generate(prompts, sp)
    finally:
        e.shutdown()
    fresh_engine = gpu_engine(path_b, deterministic=True)
    try:
        fresh = fresh_engine.generate(prompts, greedy), fresh_engine.generate(prompts, sp)
    finally:
        fresh_engine.shutdown()
    for a, b in zip(pushed, fresh):
        for sa, sb in zip(a, b):
            for oa, ob in zip(sa, sb):
                assert oa.token_ids == ob.token_ids and oa.finish_reason == ob.finish_reason
                assert max(abs(x - y) for x, y in zip(oa.logprobs, ob.logprobs)) < 1e-4
    for p, (o,) in zip(prompts, pushed[0]):
        assert o.token_ids == hf_greedy(hf_b, p, 10)


@pytest.mark.gpu
def test_gpu_sleep_wake_keeps_outputs(gpu_models):
    hf, path = gpu_models["qwen2"]
    prompts = gpu_prompts(3)
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    e = gpu_engine(path)  # default: sleep releases weights too (no CPU backup)
    try:
        before = e.generate(prompts, greedy)
        e.sleep()
        with pytest.raises(RuntimeError, match="released the engine's weights"):
            e.wake()
        e.update_weights(list(hf_weights(hf, tied=False).items()))  # the trainer's sync, while asleep
        e.wake()
        assert e.generate(prompts, greedy) == before
    finally:
        e.shutdown()
    e = gpu_engine(path, engine_kwargs={"enable_weights_cpu_backup": True})
    try:
        before = e.generate(prompts, greedy)
        e.sleep()
        e.wake()
        assert e.generate(prompts, greedy) == before
    finally:
        e.shutdown()


@pytest.mark.gpu
def test_gpu_verify_weights_reads_back(gpu_models):
    # Llama implements get_weights_by_name in 0.5.21 (models/llama.py ~779): exact read-back after a push.
    hf, path = gpu_models["llama"]
    e = gpu_engine(path)
    try:
        w = hf_weights(gpu_model("llama", 7), tied=False)
        e.update_weights(list(w.items()))
        got = e.verify_weights_on_gpu(rows=2)
        assert got and set(got.values()) == {0.0}
    finally:
        e.shutdown()


# --------------------------------------------------------------------------------------------------
# CPU: the real sglang 0.5.21 engine (SGLang's CPU path, trainer/rollout/sglang_cpu) against transformers.
# One engine for the module (start ~25 s); runs in the SGLang CPU venv (tests/rollout/sglang_cpu_support.py).
# Llama: it implements get_weights_by_name, so pushed weights are also read back from the engine.
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_engine(gpu_models):
    from .sglang_cpu_support import require_sglang_here

    require_sglang_here()
    # Small buckets: a full push is several flattened buckets (the llama model is ~1.6 MB in fp32).
    e = se.SGLangEngine(gpu_models["llama"][1], device="cpu", dtype="float32", bucket_bytes=300_000)
    yield e
    e.shutdown()


def same_outputs(a, b) -> bool:
    return [[(o.token_ids, o.finish_reason) for o in s] for s in a] == [[(o.token_ids, o.finish_reason) for o in s] for s in b]


@pytest.mark.slow
def test_cpu_engine_args_are_chosen_by_the_device(cpu_engine):
    assert cpu_engine.device == "cpu" and cpu_engine._weights_survive_sleep  # no memory saver: nothing is lost
    import os

    assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
    args = se.engine_args(model_path="m", device="cpu")
    assert (args["device"], args["attention_backend"], args["enable_memory_saver"]) == ("cpu", "torch_native", False)
    assert "device" not in se.engine_args(model_path="m", device="cuda")


@pytest.mark.slow
def test_cpu_greedy_equals_transformers_and_stop_token_included(gpu_models, cpu_engine):
    hf, _ = gpu_models["llama"]
    prompts = gpu_prompts()
    outs = cpu_engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=16))
    for p, (o,) in zip(prompts, outs):
        assert o.finish_reason == "length" and o.token_ids == hf_greedy(hf, p, 16)
    free = outs[0][0].token_ids
    stop = free[5]  # stop on prompt 0's 6th greedy token: the response ends at its FIRST occurrence, included
    (o,), = cpu_engine.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=[stop]))
    assert o.finish_reason == "stop" and o.token_ids == free[: free.index(stop) + 1] and len(o.logprobs) == len(o.token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 1.0), (0.7, None, 1.0), (0.7, 5, 0.9), (0.0, None, 1.0)])
def test_cpu_logprobs_are_full_vocab_log_softmax_over_temperature(gpu_models, cpu_engine, temperature, top_k, top_p):
    # fp32 engine on CPU vs a float64 softmax of transformers' fp32 logits: 1e-4 (measured ~1e-5). The
    # top-k case also shows the check separates "full vocabulary" from "renormalised over the kept k".
    hf, _ = gpu_models["llama"]
    prompts = gpu_prompts(1)
    outs = cpu_engine.generate(prompts, SamplingParams(n=2, temperature=temperature, top_k=top_k, top_p=top_p,
                                                       max_new_tokens=12, seed=3))
    renorm_gap = 0.0
    for p, samples in zip(prompts, outs):
        assert len(samples) == 2
        for o in samples:
            assert len(o.token_ids) == 12 and len(o.logprobs) == 12
            full, ref = hf_logprobs(hf, p, o.token_ids, temperature or 1.0)
            assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), ref, atol=1e-4)
            if top_k:
                assert all(int(r) < top_k for r in (full > ref[:, None]).sum(-1))  # every token within the top k
                kept = full.topk(top_k, dim=-1).values.exp().sum(-1)
                renorm_gap = max(renorm_gap, float(-kept.log().max()))
    if top_k:
        assert renorm_gap > 1e-2  # so the 1e-4 check above does tell the two definitions apart


@pytest.mark.slow
def test_cpu_update_weights_bucketed_verified_and_restored(gpu_models, cpu_engine):
    # Push model B's weights (several flattened buckets) into the engine holding A: the engine then
    # generates as transformers does with B, its checksum is B's, and get_weights_by_name reads B back.
    # Pushing A back restores A's outputs exactly.
    (hf_a, _), hf_b = gpu_models["llama"], gpu_model("llama", 7)
    prompts = gpu_prompts(2)
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    before = cpu_engine.generate(prompts, greedy)  # also fills the prefix cache with A's keys/values
    w_a, w_b = hf_weights(hf_a, tied=False), hf_weights(hf_b, tied=False)
    assert len(list(wf.iter_cast_buckets(list(w_b.items()), torch.float32, cpu_engine.bucket_bytes))) >= 3
    written = cpu_engine.update_weights(list(w_b.items()))
    assert sorted(written) == sorted(w_b)
    assert cpu_engine.weights_checksum() == checksum_named_tensors(w_b.items(), dtype=torch.float32)
    got = cpu_engine.verify_weights_on_gpu(rows=2)
    assert got and set(got.values()) == {0.0}
    down = next(n for n in got if n.endswith("down_proj.weight"))  # read back on the model's region, padding zero
    assert len(cpu_engine.engine.get_weights_by_name(down, truncate_size=1)[0]) == 384 > INTERMEDIATE  # SGLang padded it
    after = cpu_engine.generate(prompts, greedy)  # the adapter flushed the stale prefix cache first
    for p, (o,) in zip(prompts, after):
        assert o.token_ids == hf_greedy(hf_b, p, 10)
        _, ref = hf_logprobs(hf_b, p, o.token_ids, 1.0)
        assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), ref, atol=1e-4)
    assert not same_outputs(before, after)  # B differs from A, so the comparisons above mean something
    cpu_engine.update_weights(list(w_a.items()))
    assert cpu_engine.weights_checksum() == checksum_named_tensors(w_a.items(), dtype=torch.float32)
    restored = cpu_engine.generate(prompts, greedy)
    assert same_outputs(restored, before)
    assert [o.logprobs for (o,) in restored] == [o.logprobs for (o,) in before]


@pytest.mark.slow
def test_cpu_distributed_update_from_the_trainers_sender(gpu_models, cpu_engine):
    # Split placement's sync (trainer/sync/broadcast.py): this process is the trainer's rank 0.
    # It hosts the store, joins SGLang's weight-update group over gloo (built as SGLang builds it, so the
    # two ends must agree on every key), packs model B into flat buckets and broadcasts them; the engine
    # receives each with update_weights_from_distributed. Then: outputs equal transformers with B, the
    # checksum is B's, and the probe rows the sender kept are read back from SGLang (Llama) and equal.
    # A corrupted byte in the broadcast buffer (after the digests were taken) is caught by the read-back
    # when it hits a probe row.
    from trainer.sync import broadcast as wb

    (hf_a, _), hf_b = gpu_models["llama"], gpu_model("llama", 7)
    prompts = gpu_prompts(5)
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    before = cpu_engine.generate(prompts, greedy)
    w_a, w_b = hf_weights(hf_a, tied=False), hf_weights(hf_b, tied=False)
    store = wb.host_store("127.0.0.1")
    world, name = 1 + cpu_engine.tp_size, "coxswain_weights_test"
    joined = {}
    t = threading.Thread(target=lambda: joined.update(pg=wb.join(store, world, name, "gloo")))
    t.start()
    cpu_engine.init_weight_sync_group("127.0.0.1", store.port, 1, world, group_name=name, backend="gloo")
    t.join(timeout=120)
    pg = joined["pg"]

    def push(weights, corrupt=None):
        buckets = list(wf.iter_cast_buckets(list(weights.items()), torch.float32, cpu_engine.bucket_bytes))
        for bucket in buckets:
            flat, desc = wb.pack(bucket, torch.float32, digests=True)
            if corrupt is not None and corrupt in desc["digests"]:
                m = next(i for i, (n, _) in enumerate(desc["specs"]) if n == corrupt)
                off = sum(4 * torch.Size(s).numel() for _, s in desc["specs"][:m])
                flat[off + 1] ^= 0x40  # a flipped bit in the probe's first row, after hashing
            sender = threading.Thread(target=wb.send, args=(pg, flat))
            sender.start()
            cpu_engine.update_weights_broadcast(desc["specs"], group_name=name, digests=desc["digests"],
                                                probes=desc["probes"])
            sender.join(timeout=120)
        return len(buckets)

    try:
        assert push(w_b) >= 3
        assert cpu_engine.weights_checksum() == checksum_named_tensors(w_b.items(), dtype=torch.float32)
        got = cpu_engine.verify_weights_on_gpu(rows=4)
        assert got and set(got.values()) == {0.0}  # every probe read back from SGLang, exactly B's rows
        for p, (o,) in zip(prompts, cpu_engine.generate(prompts, greedy)):
            assert o.token_ids == hf_greedy(hf_b, p, 10)
        probe = next(n for n in cpu_engine.probe_names if n.endswith("q_proj.weight"))
        push(w_a, corrupt=probe)
        bad = cpu_engine.verify_weights_on_gpu(rows=4)
        assert bad[probe] > 0 and all(v == 0.0 for n, v in bad.items() if n != probe)
        push(w_a)
        assert same_outputs(cpu_engine.generate(prompts, greedy), before)
    finally:
        cpu_engine.destroy_weight_sync_group(name)
        wb.leave(pg)


@pytest.mark.slow
def test_cpu_sleep_wake_right_after_generate(gpu_models, cpu_engine):
    # CPU form: no memory saver, so SGLang frees nothing but the prefix cache and the weights survive.
    # sleep() right after generate() used to meet SGLang's "only when idle" assertion now and then (the
    # scheduler still finishing its batch), which kills the scheduler and this process; the adapter waits
    # for idle first. A push while asleep (the trainer's sync) lands, and generating wakes the engine.
    hf, _ = gpu_models["llama"]
    prompts = gpu_prompts(3)
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    before = cpu_engine.generate(prompts, greedy)
    for _ in range(3):
        cpu_engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8))
        cpu_engine.sleep()
        assert set(cpu_engine._released) == set(se.MEMORY_TAGS)
        cpu_engine.wake()
        assert not cpu_engine._released
    cpu_engine.sleep()
    cpu_engine.update_weights(list(hf_weights(hf, tied=False).items()))
    assert same_outputs(cpu_engine.generate(prompts, greedy), before)  # wakes first
    assert not cpu_engine._released


@pytest.mark.slow
def test_cpu_flush_and_abort(gpu_models, cpu_engine):
    import time

    prompts = gpu_prompts(4, lens=(3, 5))
    cpu_engine.flush_cache()
    max_new = 2000  # the model's 2048 positions; a 2-prompt batch runs ~500 tokens/s here, so ~4 s unaborted
    sp = SamplingParams(temperature=1.0, max_new_tokens=max_new)

    def aborted_after(delay_s):
        result = {}
        t = threading.Thread(target=lambda: result.update(out=cpu_engine.generate(prompts, sp)))
        t.start()
        if delay_s:
            time.sleep(delay_s)
        else:  # "at once": as soon as the call has entered generate (an abort before that has nothing to end)
            deadline = time.monotonic() + 30
            while not cpu_engine._generating:
                assert time.monotonic() < deadline and t.is_alive()
                time.sleep(0.0005)
        cpu_engine.abort()
        t.join(timeout=60)
        assert not t.is_alive()
        return [o for s in result["out"] for o in s]

    def all_aborted(outs):
        assert all(o.finish_reason == "abort" for o in outs), [(o.finish_reason, len(o.token_ids)) for o in outs]
        assert all(len(o.token_ids) < max_new and len(o.logprobs) == len(o.token_ids) for o in outs)

    # Mid-generation: the tokens sampled so far come back, each with its log-prob. The machine's speed sets
    # when "mid" is (not prefilled yet after a short wait on a loaded machine; 2000 tokens done in under a
    # second on a fast one): the waits grow until one lands inside the generation. A call that finished
    # first ('length') only says the wait was too long; one that came back unaborted is never accepted.
    tried = []
    for delay in (0.1, 0.25, 0.5, 1.0, 2.0):
        outs = aborted_after(delay)
        tried.append((delay, [(o.finish_reason, len(o.token_ids)) for o in outs]))
        if all(o.finish_reason == "abort" for o in outs) and any(len(o.token_ids) > 0 for o in outs):
            break
    all_aborted(outs)
    assert any(len(o.token_ids) > 0 for o in outs), tried
    # At once: the abort may land while the call is still entering the engine, where one abort_request
    # alone would be lost; the adapter re-sends it until the call returns.
    all_aborted(aborted_after(0.0))
    # An abort with nothing running is a no-op, and the engine serves the next request normally.
    cpu_engine.abort()
    (o,), = cpu_engine.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=4))
    assert o.finish_reason == "length" and len(o.token_ids) == 4


def test_a_tied_moe_checkpoint_is_refused_before_sglang_starts(tmp_path):
    """SGLang 0.5.21's Qwen3-MoE / Qwen2-MoE ignore tie_word_embeddings: a tied checkpoint would be served from an
    unloaded head (log-probs off by up to 0.8 against transformers, measured, while every weight check passes).
    The adapter and the fleet refuse it with the fix; an untied one, or a tied dense Qwen2, is served."""
    import json

    from trainer.rollout import fleet as fl

    cfg = {"model_type": "qwen3_moe", "tie_word_embeddings": True}
    assert "save the checkpoint untied" in se.model_refusal(cfg, "m")
    assert se.model_refusal({**cfg, "tie_word_embeddings": False}, "m") is None
    assert se.model_refusal({"model_type": "qwen2", "tie_word_embeddings": True}, "m") is None
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="tie_word_embeddings=true, which sglang"):
        se.SGLangEngine(str(tmp_path), device="cpu")
    with pytest.raises(fl.FleetError, match="tie_word_embeddings=true, which sglang"):
        fl.Fleet(str(tmp_path), backend="sglang", log_dir=str(tmp_path / "logs")).start()
