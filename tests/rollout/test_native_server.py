"""The SGLang-protocol pure functions, both sides: the server's request parsing and response building
(``trainer.serving.sglang_native``, the weight codec ``trainer.wire``) and the fleet client's
payloads and response parsing (``trainer.rollout.fleet``), against the shapes of SGLang v0.5.8 written out by hand here (from
``io_struct.GenerateReqInput``, ``sampling_params.SamplingParams``, ``schedule_batch`` finish reasons and
``tokenizer_manager``'s meta_info), and against each other. No process, no model.
"""

from __future__ import annotations

import base64
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.rollout.engine import GenerationOutput, SamplingParams
from trainer.rollout.fleet_client import (FleetError, generate_payload, parse_generate_response, parse_output, prompt_seed,
                                   sglang_sampling_params)
from trainer.serving.sglang_native import (ProtocolError, finish_reason_json, generate_response, output_json,
                                           parse_generate_request, parse_sampling_params)
from trainer.wire import parse_update_weights_from_tensor, safetensors_to_tensors, tensors_to_safetensors

V, SEQ, EOS = 16, 64, (1,)


def parse(body, **kw):
    return parse_generate_request(body, vocab_size=V, max_seq_len=SEQ, eos_token_ids=kw.pop("eos", EOS), **kw)


# ---- sampling_params ---------------------------------------------------------------------------------
def test_sampling_params_defaults_are_sglangs():
    # SGLang SamplingParams(): max_new_tokens 128, temperature 1, top_p 1, top_k -1 (off), n 1, no seed;
    # the model's EOS (1) stops unless ignore_eos.
    assert parse_sampling_params({}, eos_token_ids=EOS) == SamplingParams(
        n=1, temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=128, stop_token_ids=(1,), seed=None)
    assert parse_sampling_params(None) == SamplingParams(max_new_tokens=128)


def test_sampling_params_mapping():
    sp = parse_sampling_params({"max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "n": 3,
                                "stop_token_ids": [9, 4], "sampling_seed": 11, "skip_special_tokens": False,
                                "no_stop_trim": True, "min_p": 0.0, "repetition_penalty": 1.0, "stop": []},
                               eos_token_ids=EOS)
    assert sp == SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=7, stop_token_ids=(1, 4, 9), seed=11)


def test_greedy_and_ignore_eos():
    # SGLang: temperature < 1e-6 is greedy (it runs top_k = 1 at T = 1); the engine's greedy is T = 0.
    sp = parse_sampling_params({"temperature": 0, "top_k": 3, "top_p": 0.5})
    assert sp.greedy and sp.top_k is None and sp.top_p == 1.0
    # ignore_eos turns every token stop off, the listed stop_token_ids included (_check_token_based_finish).
    assert parse_sampling_params({"ignore_eos": True, "stop_token_ids": [5]}, eos_token_ids=EOS).stop_token_ids == ()


@pytest.mark.parametrize("sp, msg", [
    ({"top_k": 0}, "top_k must be -1"),
    ({"top_p": 0}, "top_p must be in"),
    ({"temperature": -1}, "non-negative"),
    ({"n": 0}, ">= 1"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"stop": ["\n"]}, "stop"),
    ({"regex": "a+"}, "regex"),
    ({"logit_bias": {"3": 1.0}}, "logit_bias"),
    ({"max_new_tokens": 1.5}, "integer"),
    ({"sampling_seed": "7"}, "integer"),
    ({"bogus": 1}, "unknown sampling_params"),
])
def test_sampling_params_refused(sp, msg):
    with pytest.raises(ProtocolError, match=msg):
        parse_sampling_params(sp)


# ---- /generate requests -----------------------------------------------------------------------------
def test_single_and_batch_shapes():
    r = parse({"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 4}, "rid": "abc"})
    assert r.is_single and r.prompts == [[3, 4]] and r.rids == [["abc"]] and r.return_logprob == [False]
    # A batch, with SGLang's string-rid expansion over the prompt-major expanded batch: f"{rid}_{k}".
    r = parse({"input_ids": [[3], [4, 5]], "sampling_params": {"n": 2}, "rid": "x", "return_logprob": True})
    assert not r.is_single and r.rids == [["x_0", "x_1"], ["x_2", "x_3"]] and r.return_logprob == [True, True]
    # One prompt with n > 1 is a batch in SGLang (a list of n outputs comes back).
    assert not parse({"input_ids": [3], "sampling_params": {"n": 2}}).is_single
    # Per-prompt sampling_params and return_logprob lists.
    r = parse({"input_ids": [[3], [4]], "sampling_params": [{"temperature": 0}, {"sampling_seed": 5}],
               "return_logprob": [True, False]})
    assert r.params[0].greedy and r.params[1].seed == 5 and r.return_logprob == [True, False]


def test_text_needs_a_tokenizer():
    with pytest.raises(ProtocolError, match="skip-tokenizer-init"):
        parse({"text": "1+1="})
    r = parse({"text": ["12", "3"]}, encode=lambda s: [int(c) + 2 for c in s])
    assert r.prompts == [[3, 4], [5]] and not r.is_single


def test_router_reserialised_body_is_accepted():
    # What sglang-router 0.3.2 forwards (observed on the wire): GenerateReqInput's defaults spelled out.
    body = {"model": None, "input_ids": [[1, 2], [3]], "sampling_params": {"temperature": 0.7, "max_new_tokens": 3,
            "top_p": 0.9, "top_k": -1, "stop_token_ids": [1], "n": 1, "sampling_seed": 5}, "return_logprob": True,
            "logprob_start_len": -1, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
            "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
            "return_entropy": False}
    r = parse(body)
    assert r.prompts == [[1, 2], [3]] and r.params[0] == SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=3,
                                                                        stop_token_ids=(1,), seed=5)


@pytest.mark.parametrize("body, msg", [
    ({}, "Either text or input_ids"),
    ({"input_ids": []}, "cannot be empty"),
    ({"input_ids": [3, 16]}, "outside"),
    ({"input_ids": [[3], []]}, "non-empty"),
    ({"input_ids": [3], "stream": True}, "stream"),
    ({"input_ids": [3], "image_data": "x.png"}, "image_data"),
    ({"input_ids": [3], "lora_path": "a"}, "lora_path"),
    ({"input_ids": [3], "return_logprob": True, "logprob_start_len": 0}, "logprob_start_len"),
    ({"input_ids": [3], "return_logprob": True, "top_logprobs_num": 2}, "top_logprobs_num"),
    ({"input_ids": [[3], [4]], "sampling_params": [{"n": 1}, {"n": 2}]}, "parallel_sample_num"),
    ({"input_ids": [[3], [4]], "sampling_params": [{}]}, "1 entries for 2 prompts"),
    ({"input_ids": [3] * 64}, "context length"),
    ({"input_ids": [3] * 10, "sampling_params": {"max_new_tokens": 55}}, "maximum context length of 64"),
    ({"input_ids": [[3], [4]], "rid": ["a"]}, "rid"),
])
def test_generate_request_refused(body, msg):
    with pytest.raises(ProtocolError, match=msg):
        parse(body)


def test_context_limit_is_inclusive():
    # prompt + max_new_tokens == max_seq_len is allowed (the engine's limit; SGLang's needs <).
    assert parse({"input_ids": [3] * 10, "sampling_params": {"max_new_tokens": 54}}).params[0].max_new_tokens == 54
    # No max_new_tokens: SGLang's default 128, which stops at the context's end instead of failing.
    assert parse({"input_ids": [3] * 10}).params[0].max_new_tokens == 54
    assert parse({"input_ids": [3] * 10}, eos=()).params[0].max_new_tokens == 54


# ---- responses ----------------------------------------------------------------------------------------
def test_finish_reasons_are_sglangs():
    assert finish_reason_json(GenerationOutput([5, 1], [-1.0, -2.0], "stop")) == {"type": "stop", "matched": 1}
    assert finish_reason_json(GenerationOutput([5, 6, 7], [-1.0] * 3, "length")) == {"type": "length", "length": 3}
    assert finish_reason_json(GenerationOutput([], [], "abort")) == {
        "type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def test_output_object_golden():
    out = GenerationOutput([7, 1], [-0.25, -1.5], "stop")
    got = output_json(out, rid="r0", prompt=[3, 4, 5], return_logprob=True, text="5", weight_version="v1",
                      e2e_latency=0.5)
    # SGLang v0.5.8 tokenizer_manager: text, output_ids, meta_info{id, finish_reason, prompt_tokens,
    # weight_version, total_retractions, input/output_token_logprobs, completion_tokens, cached_tokens,
    # e2e_latency}; logprob_start_len -1 gives one input entry [None, last prompt id, None].
    assert got == {"text": "5", "output_ids": [7, 1], "meta_info": {
        "id": "r0", "finish_reason": {"type": "stop", "matched": 1}, "prompt_tokens": 3, "weight_version": "v1",
        "total_retractions": 0, "input_token_logprobs": [[None, 5, None]],
        "output_token_logprobs": [[-0.25, 7, None], [-1.5, 1, None]], "completion_tokens": 2, "cached_tokens": 0,
        "e2e_latency": 0.5}}
    assert json.loads(json.dumps(got)) == got  # plain JSON
    no_lp = output_json(out, rid="r0", prompt=[3], return_logprob=False)
    assert "text" not in no_lp and "output_token_logprobs" not in no_lp["meta_info"]


def test_generate_response_single_vs_list_and_text_trim():
    req = parse({"input_ids": [[3], [4]], "sampling_params": {"n": 2}, "rid": "q", "return_logprob": True})
    outs = [[GenerationOutput([5, 1], [-1.0, -2.0], "stop"), GenerationOutput([6], [-3.0], "length")],
            [GenerationOutput([7, 8], [-1.0, -1.0], "length"), GenerationOutput([1], [-0.5], "stop")]]
    resp = generate_response(req, outs, decode=lambda ids: "".join(str(i) for i in ids))
    assert [r["meta_info"]["id"] for r in resp] == ["q_0", "q_1", "q_2", "q_3"]  # prompt-major
    assert [r["output_ids"] for r in resp] == [[5, 1], [6], [7, 8], [1]]  # the stop token stays in output_ids
    assert [r["text"] for r in resp] == ["5", "6", "78", ""]  # ... and leaves the text
    single = parse({"input_ids": [3]})
    assert isinstance(generate_response(single, [[outs[0][1]]]), dict)


# ---- the client side and the round trip -----------------------------------------------------------------
def test_client_payload_is_sglangs():
    sp = SamplingParams(n=2, temperature=0.5, top_p=0.8, top_k=None, max_new_tokens=9, stop_token_ids=(1, 2), seed=3)
    assert generate_payload([4, 5], sp) == {
        "input_ids": [4, 5], "sampling_params": {"max_new_tokens": 9, "temperature": 0.5, "top_p": 0.8, "top_k": -1,
                                                 "n": 2, "stop_token_ids": [1, 2], "ignore_eos": False, "sampling_seed": 3},
        "return_logprob": True, "logprob_start_len": -1, "stream": False}
    # no stop ids = "no stop": ignore_eos, so a server's EOS does not stop it either; a seed override
    p = sglang_sampling_params(SamplingParams(max_new_tokens=4), seed=8)
    assert p["ignore_eos"] is True and p["stop_token_ids"] == [] and p["sampling_seed"] == 8


def test_parse_sglang_response():
    # A response as SGLang v0.5.8 sends it (text present, two samples of one prompt).
    body = [{"text": "ab", "output_ids": [11, 12], "meta_info": {
                "id": "a", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "weight_version": "default",
                "total_retractions": 0, "input_token_logprobs": [[None, 9, None]],
                "output_token_logprobs": [[-0.5, 11, None], [-0.25, 12, None]], "completion_tokens": 2,
                "cached_tokens": 2, "e2e_latency": 0.01}},
            {"text": "", "output_ids": [2], "meta_info": {
                "id": "b", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3,
                "output_token_logprobs": [[-0.125, 2, "</s>"]], "completion_tokens": 1}}]
    assert parse_generate_response(body, 2) == [GenerationOutput([11, 12], [-0.5, -0.25], "length"),
                                                 GenerationOutput([2], [-0.125], "stop")]
    with pytest.raises(FleetError, match="expected 1 outputs"):
        parse_generate_response(body, 1)
    with pytest.raises(FleetError, match="missing"):
        parse_output({"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}})
    with pytest.raises(FleetError, match="disagree"):
        parse_output({"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"},
                                                      "output_token_logprobs": [[-1.0, 2, None]]}})
    with pytest.raises(FleetError, match="unknown finish_reason"):
        parse_output({"meta_info": {"finish_reason": {"type": "eos"}, "output_token_logprobs": []}})


params_st = st.builds(
    SamplingParams, n=st.integers(1, 4), temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_p=st.sampled_from([0.2, 0.9, 1.0]), top_k=st.sampled_from([None, 1, 5]), max_new_tokens=st.integers(1, 50),
    stop_token_ids=st.lists(st.integers(0, V - 1), max_size=3).map(lambda x: tuple(sorted(set(x)))),
    seed=st.one_of(st.none(), st.integers(0, 2**62)))


@settings(max_examples=200, deadline=None)
@given(params_st)
def test_client_server_round_trip(sp):
    # What the client sends is parsed by the server back into the same SamplingParams (for a server whose
    # model has no EOS; greedy drops top-k/top-p, which greedy ignores).
    req = parse(json.loads(json.dumps(generate_payload([3, 4], sp))), eos=())
    got = req.params[0]
    want = sp if not sp.greedy else SamplingParams(n=sp.n, temperature=0.0, max_new_tokens=sp.max_new_tokens,
                                                   stop_token_ids=sp.stop_token_ids, seed=sp.seed)
    assert got == want and req.return_logprob == [True] and req.is_single == (sp.n == 1)
    # ... and the server's answer parses back into the engine's outputs.
    outs = [GenerationOutput([int(t) for t in range(2, 2 + k)], [-0.5 * (k + 1)] * k, "length") for k in range(1, sp.n + 1)]
    body = json.loads(json.dumps(generate_response(req, [outs])))
    assert parse_generate_response(body, sp.n) == outs


def test_prompt_seed():
    # Distinct per index and seed, deterministic, 62-bit (fits SGLang's int64 sampling_seed check).
    seeds = {prompt_seed(s, i) for s in range(5) for i in range(50)}
    assert len(seeds) == 250 and all(0 <= x < 2**62 for x in seeds)
    assert prompt_seed(7, 3) == prompt_seed(7, 3)


# ---- weights over HTTP --------------------------------------------------------------------------------------
def test_safetensors_blobs_round_trip():
    named = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.arange(5, dtype=torch.bfloat16))]
    back = dict(safetensors_to_tensors(tensors_to_safetensors(named)))
    assert set(back) == {"a.weight", "b.bias"}
    assert torch.equal(back["a.weight"], named[0][1]) and back["b.bias"].dtype == torch.bfloat16
    with pytest.raises(ProtocolError, match="safetensors"):
        safetensors_to_tensors(b"not a blob")


def test_update_weights_from_tensor_json():
    blob = tensors_to_safetensors([("w", torch.ones(2))])
    blobs, version = parse_update_weights_from_tensor(
        {"serialized_named_tensors": [base64.b64encode(blob).decode()], "load_format": "safetensors", "weight_version": 3})
    assert blobs == [blob] and version == "3"
    # SGLang's default (in-process, pickled tensors) format: refused, naming the formats taken.
    with pytest.raises(ProtocolError, match="flattened_bucket"):
        parse_update_weights_from_tensor({"serialized_named_tensors": ["x"], "load_format": None})
    with pytest.raises(ProtocolError, match="base64"):
        parse_update_weights_from_tensor({"serialized_named_tensors": ["@@@"], "load_format": "safetensors"})


def test_routed_experts_round_trip_in_sglangs_form():
    """R3 over HTTP: the client asks with SGLang's ``return_routed_experts``; the server hands the flag to the engine
    and answers each sample's routes in ``meta_info.routed_experts`` (base64 int32, SGLang's form); the client
    decodes them to the model's shape, checking that every input token (prompt + sampled - 1) is covered."""
    from trainer.rollout.engine import RouteShape

    sp = SamplingParams(n=2, max_new_tokens=3, stop_token_ids=(1,), seed=4, return_routed_experts=True)
    body = json.loads(json.dumps(generate_payload([3, 4, 5], sp)))
    assert body["return_routed_experts"] is True and "return_routed_experts" not in generate_payload([3], SamplingParams())
    req = parse(body)
    assert req.params[0].return_routed_experts
    g = torch.Generator().manual_seed(0)
    outs = [GenerationOutput([7, 8, 1], [-1.0, -2.0, -0.5], "stop", torch.randint(0, 8, (3 + 3 - 1, 2, 2), generator=g,
                                                                                     dtype=torch.int16)),
            GenerationOutput([9], [-0.25], "length", torch.randint(0, 8, (3 + 1 - 1, 2, 2), generator=g, dtype=torch.int16))]
    reply = json.loads(json.dumps(generate_response(req, [outs])))
    assert base64.b64decode(reply[0]["meta_info"]["routed_experts"]) == outs[0].routed_experts.int().numpy().tobytes()
    got = parse_generate_response(reply, 2, RouteShape(layers=2, top_k=2, prompt_len=3))
    for a, b in zip(got, outs):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert a.routed_experts.dtype == torch.int16 and torch.equal(a.routed_experts, b.routed_experts)
    with pytest.raises(FleetError, match="5 rows of 2 layers x top-2 int32, but 6 input tokens"):  # a prompt of 4: 6 rows
        parse_generate_response(reply, 2, RouteShape(layers=2, top_k=2, prompt_len=4))
    del reply[1]["meta_info"]["routed_experts"]
    with pytest.raises(FleetError, match="the reply has none"):
        parse_generate_response(reply, 2, RouteShape(layers=2, top_k=2, prompt_len=3))
    with pytest.raises(ProtocolError, match="return_routed_experts must be true or false"):
        parse({"input_ids": [3], "return_routed_experts": "yes"})
