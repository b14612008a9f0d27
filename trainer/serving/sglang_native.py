"""The native engine behind SGLang's own HTTP protocol, so a CPU fleet and a GPU SGLang fleet look alike.

    python -m trainer.rollout.native_server --model DIR [--port 0] [--host 127.0.0.1] [--threads N]
        [--max-batch-size 32] [--max-seq-len N] [--batch-wait-ms 5] [--batch-max-wait-ms 50]
        [--dtype float32] [--device cpu] [--skip-tokenizer-init] [--api-key-env NAME]

The SGLang protocol adapter on the shared skeleton (:mod:`trainer.serving.app`);
``python -m trainer.rollout.native_server`` is its command line (an alias that runs this module).
Prints one line ``coxswain-native-server: listening on http://HOST:PORT (model NAME)`` once it accepts
requests (``--port 0`` binds a free port). ``sglang-router`` can route to it like to any SGLang worker.

Protocol: the subset of SGLang's native HTTP API that a rollout fleet needs, with SGLang's request and
response shapes, pinned to **SGLang v0.5.8** (``python/sglang/srt/entrypoints/http_server.py``,
``managers/io_struct.py:GenerateReqInput``, ``sampling/sampling_params.py``, ``managers/schedule_batch.py``
finish reasons, ``managers/tokenizer_manager.py`` meta_info) and checked against what sglang-router
0.3.2 sends and reads (it re-serialises ``/generate`` bodies, keeping only GenerateReqInput's fields,
and reads ``/server_info`` and ``/model_info`` when a worker registers). Re-checked against SGLang
v0.5.21 (the ``[sglang]`` extra's pin): the same shapes, except that its meta_info calls
``total_retractions`` ``num_retractions`` (no client reads it).

  GET  /health, /health_generate       200 with an empty body (the second runs a 1-token generation)
  GET  /server_info, /get_server_info   server args, scheduler info, internal_states, version
  GET  /model_info, /get_model_info     model_path, tokenizer_path, is_generation, weight_version, ...
  POST /generate                        see below
  POST /update_weights_from_disk        {"model_path": DIR, "weight_version"?, ...} -> {"success", "message",
                                        "num_paused_requests"}; reads DIR's *.safetensors (a partial set is fine)
  POST /flush_cache                     200 "Cache flushed..." (a no-op: every engine call prefills afresh)
  POST /abort_request                   {"rid": ID} or {"abort_all": true}
  POST /pause_generation                {"mode": "abort" | "retract" | "in_place"}; /continue_generation
  POST /update_weights_from_tensor      SGLang's same-host form: {"serialized_named_tensors": [payload],
                                        "load_format": "flattened_bucket"} (trainer.wire), so that one
                                        fleet client pushes to real SGLang servers and to these alike
  POST /begin_weight_update, /end_weight_update   SGLang 0.5.21's bracket around a push (acknowledged)
  POST /get_weights_by_name             {"name", "truncate_size"} -> the first rows (float32 lists) or null
  Coxswain extensions (not in SGLang):
  POST /update_weights_from_tensor      a safetensors blob: see "Weights over HTTP" below
  GET  /weights_checksum                {"checksum": checksum_named_tensors(weights), "weight_version"}
  GET  /weights_safetensors             every weight as one safetensors blob (a restarted fleet server
                                        copies a live peer's weights with it)

/generate request (GenerateReqInput): ``input_ids`` (one list of ids, or a list of them; ``text`` too
when a tokenizer is loaded), ``sampling_params`` (a dict, or one per prompt, all with the same ``n``),
``return_logprob`` (bool or per prompt), ``logprob_start_len`` (-1 only: no prompt log-probs),
``top_logprobs_num`` (0 only), ``return_text_in_logprobs``, ``rid``, ``stream`` (false only). Fields
that would change the output and are not implemented (multimodal data, LoRA, hidden states, custom
logit processors, sessions, ...) are a 400 unless at their default; other fields are ignored, as
SGLang's request model ignores unknown ones.

sampling_params: ``max_new_tokens`` (default 128, capped at the context's end when not given), ``temperature`` (default 1; 0 = greedy, which SGLang
runs as top_k = 1 at T = 1: the log-probs are then at T = 1, as the native engine's are), ``top_p``,
``top_k`` (-1 = off, else >= 1), ``stop_token_ids``, ``ignore_eos``, ``n``, ``sampling_seed``;
``skip_special_tokens``, ``spaces_between_special_tokens``, ``no_stop_trim`` and ``stream_interval``
only shape the text and are accepted; penalties, ``min_p``, ``min_new_tokens``, ``logit_bias``, stop
strings / regexes and constrained decoding must stay at their defaults (400 otherwise). An unknown key
is a 400 (SGLang's ``SamplingParams(**d)`` raises too). Stops, as in SGLang's ``check_finished``: the
response ends on any of ``stop_token_ids`` or the model's EOS ids (``trainer.hf_io.stop_token_ids``:
the tokenizer's, generation_config's and config's ``eos_token_id``, the trainer's own rule); ``ignore_eos: true`` turns ALL token stops off, the listed ones included.

/generate response: one object for one prompt with ``n == 1``, else a list of ``len(prompts) * n``
objects, prompt-major (prompt 0's n samples first), as SGLang returns them:
``{"text"?, "output_ids": [...], "meta_info": {"id", "finish_reason", "prompt_tokens",
"weight_version", "total_retractions", ["input_token_logprobs", "output_token_logprobs"],
"completion_tokens", "cached_tokens", "e2e_latency"}}``. ``output_token_logprobs`` is SGLang's list of
``[logprob, token_id, text_or_null]`` triples (text only with ``return_text_in_logprobs`` and a
tokenizer); ``input_token_logprobs`` with ``logprob_start_len == -1`` is ``[[null, last_prompt_id,
null]]``, as SGLang's. finish_reason: ``{"type": "stop", "matched": token_id}``, ``{"type": "length",
"length": n_tokens}`` or ``{"type": "abort", "message", "status_code", "err_type"}``. ``output_ids``
ends with the stop token that ended the response (SGLang's ``finished_len`` keeps it); ``text`` drops
it (SGLang trims the matched stop unless ``no_stop_trim``) and is absent with ``--skip-tokenizer-init``.
The log-probs are the engine's (``trainer.rollout.engine``: ``log_softmax(logits / T)`` over the full
vocabulary; top-k/top-p are not reflected), SGLang's ``return_logprob`` definition. Errors: 400
``{"error": {"message": ...}}`` like SGLang's ``_create_error_response``.

Deviations from SGLang v0.5.8, named:
* ``sampling_seed`` is always honoured (SGLang needs ``--enable-deterministic-inference``). The engine
  keys a request's random stream by (seed, sample index), so with ``n > 1`` the samples differ; SGLang
  hashes (seed, position) only, so its n samples of a seeded request are identical.
* When the token that reaches ``max_new_tokens`` is also a stop token, the finish reason is "stop"
  (the engine checks stops first); SGLang checks the length first and says "length".
* The context check allows ``prompt + max_new_tokens == --max-seq-len`` (SGLang's needs ``<``).
* ``pause_generation`` with mode "retract" or "in_place" lets the running engine call finish (it
  cannot be suspended) and holds new requests until ``continue_generation``; "abort" aborts it.
* ``/abort_request`` with a ``rid`` answers that request at once with an empty "abort" output; if it
  is already inside an engine call, the call still computes it (the engine aborts whole calls only;
  ``abort_all`` does that).

Weights over HTTP. SGLang's ``/update_weights_from_tensor`` carries tensors pickled with torch's
multiprocessing reductions (CUDA IPC handles), so it only works between processes on one machine. Here
the same endpoint carries tensor BYTES as safetensors: either the raw blob as the body with
``Content-Type: application/octet-stream`` (optional query ``?weight_version=V``), or SGLang's JSON
shape ``{"serialized_named_tensors": [base64 safetensors blob, ...], "load_format": "safetensors",
"weight_version"?}`` (the codec: :mod:`trainer.wire`). Names are HF names; a blob may hold any subset (a bucket). Another
``load_format`` is a 400 saying so. Weight updates and checksums wait for the running engine call and
run between calls, so no call sees a half-applied bucket; a fleet drains requests before a multi-bucket
push (``trainer.rollout.fleet``).

Batching: handlers hand each prompt (``n`` samples) to :class:`trainer.rollout.async_engine.Batcher`,
so concurrent requests share engine calls, and a seeded request's samples do not depend on what else
shares its call (the native engine keys seeded streams per request).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from aiohttp import web

from trainer.rollout.engine import GenerationOutput, SamplingParams, encode_routes
from trainer.serving.app import (parse_json_body, EngineServer, add_engine_args, error_body, json_error, load_engine,
                                 model_dir_arg, path_problem, read_capped, request_limits, serve, serve_until_signal, served_model_name)
from trainer.net import SGLANG_NATIVE_READY_PREFIX as READY_PREFIX
from trainer.wire import (WEIGHTS_CONTENT_TYPE, ProtocolError, parse_update_weights_from_tensor,
                                  flattened_bucket_to_tensors, safetensors_to_tensors, tensors_to_safetensors)

__all__ = ["READY_PREFIX", "SGLANG_PROTOCOL_VERSION", "DEFAULT_MAX_NEW_TOKENS", "ProtocolError",
           "parse_sampling_params", "GenerateRequest", "parse_generate_request", "finish_reason_json", "output_json",
           "generate_response", "error_body", "tensors_to_safetensors", "safetensors_to_tensors",
           "parse_update_weights_from_tensor", "NativeSGLangServer", "build_parser", "build_server", "serve", "main"]

SGLANG_PROTOCOL_VERSION = "0.5.8"  # the SGLang release whose native HTTP shapes this server speaks
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default


# --------------------------------------------------------------------------------------------------
# request parsing: pure functions over the JSON body
# --------------------------------------------------------------------------------------------------
# sampling_params keys, by how they are treated.
_SP_HONOURED = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "n", "sampling_seed"}
_SP_TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
# Output-changing keys that must stay at SGLang's default (value None / empty also accepted).
_SP_DEFAULTS = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                "min_new_tokens": 0, "stop": None, "stop_regex": None, "json_schema": None, "regex": None,
                "ebnf": None, "structural_tag": None, "custom_params": None, "logit_bias": None}

# GenerateReqInput fields that change the output and are not implemented: must be falsy (None, False,
# 0, empty). Everything not listed here or handled below is ignored (log_metrics, no_logs, priority, ...).
_REQ_MUST_BE_UNSET = ("input_embeds", "image_data", "video_data", "audio_data", "token_ids_logprob",
                      "return_hidden_states", "session_params", "lora_path", "lora_id",
                      "custom_logit_processor", "bootstrap_host", "bootstrap_room", "return_bytes",
                      "return_entropy", "return_prompt_token_ids", "background", "positional_embed_overrides")


def _int(v: Any, what: str, lo: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ProtocolError(f"{what} must be an integer, got {v!r}")
    v = int(v)
    if lo is not None and v < lo:
        raise ProtocolError(f"{what} must be >= {lo}, got {v}")
    return v


def _float(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProtocolError(f"{what} must be a finite number, got {v!r}")
    return float(v)


def parse_sampling_params(sp: dict | None, *, eos_token_ids: Sequence[int] = ()) -> SamplingParams:
    """SGLang ``sampling_params`` dict -> the engine's :class:`SamplingParams` (stop ids include EOS
    unless ``ignore_eos``; see the module docstring). Raises :class:`ProtocolError`."""
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise ProtocolError(f"sampling_params must be an object, got {type(sp).__name__}")
    unknown = set(sp) - _SP_HONOURED - _SP_TEXT_ONLY - set(_SP_DEFAULTS)
    if unknown:
        raise ProtocolError(f"unknown sampling_params key(s): {sorted(unknown)}")
    for key, default in _SP_DEFAULTS.items():
        v = sp.get(key)
        if v is not None and v != default and not (isinstance(v, (list, dict, str)) and not v):
            raise ProtocolError(f"sampling_params.{key}={v!r} is not supported by this server (only {default!r})")
    max_new = sp.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    max_new = DEFAULT_MAX_NEW_TOKENS if max_new is None else _int(max_new, "sampling_params.max_new_tokens", lo=1)
    temperature = _float(sp.get("temperature", 1.0), "sampling_params.temperature")
    if temperature < 0:
        raise ProtocolError(f"temperature must be non-negative, got {temperature}.")
    top_p = _float(sp.get("top_p", 1.0), "sampling_params.top_p")
    if not 0.0 < top_p <= 1.0:
        raise ProtocolError(f"top_p must be in (0, 1], got {top_p}.")
    top_k = _int(sp.get("top_k", -1), "sampling_params.top_k")
    if top_k != -1 and top_k < 1:
        raise ProtocolError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    n = _int(sp.get("n", 1), "sampling_params.n", lo=1)
    seed = sp.get("sampling_seed")
    seed = None if seed is None else _int(seed, "sampling_params.sampling_seed")
    sti = sp.get("stop_token_ids") or []
    if not isinstance(sti, list):
        raise ProtocolError("sampling_params.stop_token_ids must be a list of integers")
    stop_ids = {_int(t, "sampling_params.stop_token_ids[]") for t in sti}
    ignore_eos = sp.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ProtocolError("sampling_params.ignore_eos must be a boolean")
    # SGLang's _check_token_based_finish: ignore_eos switches every token stop off, listed ones too.
    stops = () if ignore_eos else tuple(sorted(stop_ids | {int(e) for e in eos_token_ids}))
    if temperature < 1e-6:  # SGLang: greedy (it sets top_k = 1 and T = 1)
        temperature, top_p, top_k = 0.0, 1.0, -1
    return SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=None if top_k == -1 else top_k,
                          max_new_tokens=max_new, stop_token_ids=stops, seed=seed)


@dataclass
class GenerateRequest:
    """A parsed ``/generate`` body: one entry per prompt (each sampled ``params[i].n`` times)."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    rids: list[list[str]]  # rids[i][j]: meta_info.id of sample j of prompt i
    return_logprob: list[bool]
    is_single: bool  # one prompt and n == 1: the response is one object, not a list
    return_text_in_logprobs: bool = False
    no_stop_trim: list[bool] = field(default_factory=list)


def _per_prompt(v: Any, b: int, what: str) -> list:
    if isinstance(v, list):
        if len(v) != b:
            raise ProtocolError(f"{what} has {len(v)} entries for {b} prompts")
        return list(v)
    return [v] * b


def parse_generate_request(body: Any, *, vocab_size: int, max_seq_len: int, eos_token_ids: Sequence[int] = (),
                           encode: Callable[[str], list[int]] | None = None) -> GenerateRequest:
    """Validate a ``/generate`` body (SGLang v0.5.8 ``GenerateReqInput``); see the module docstring."""
    if not isinstance(body, dict):
        raise ProtocolError("the body must be a JSON object")
    for key in _REQ_MUST_BE_UNSET:
        if body.get(key):
            raise ProtocolError(f"'{key}' is not supported by this server")
    if body.get("stream"):
        raise ProtocolError("'stream' is not supported by this server; send stream=false")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ProtocolError("Either text or input_ids should be provided.")
    if text is not None:
        if encode is None:
            raise ProtocolError("'text' needs a tokenizer; this server runs with --skip-tokenizer-init: send input_ids")
        if isinstance(text, str):
            single, raw = True, [encode(text)]
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            single, raw = False, [encode(t) for t in text]
        else:
            raise ProtocolError("'text' must be a string or a non-empty list of strings")
    else:
        if not isinstance(ids, list) or not ids:
            raise ProtocolError("input_ids cannot be empty.")
        single = not isinstance(ids[0], list)
        raw = [ids] if single else ids
    prompts = []
    for i, p in enumerate(raw):
        if not isinstance(p, list) or not p:
            raise ProtocolError(f"prompt {i} must be a non-empty list of token ids")
        p = [_int(t, f"input_ids[{i}][]") for t in p]
        if min(p) < 0 or max(p) >= vocab_size:
            raise ProtocolError(f"prompt {i} has token ids outside [0, {vocab_size})")
        prompts.append(p)
    b = len(prompts)
    sp_raw = body.get("sampling_params")
    sps = _per_prompt(sp_raw, b, "sampling_params")
    params = [parse_sampling_params(sp, eos_token_ids=eos_token_ids) for sp in sps]
    if len({p.n for p in params}) > 1:
        raise ProtocolError("The parallel_sample_num should be the same for all samples in sample params.")
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if len(p) >= max_seq_len:
            raise ProtocolError(f"The input ({len(p)} tokens) is longer than the model's context length ({max_seq_len} tokens).")
        if (sps[i] or {}).get("max_new_tokens") is None:
            # SGLang checks only an explicit max_new_tokens; its default stops at the context's end.
            params[i] = sp = replace(sp, max_new_tokens=min(sp.max_new_tokens, max_seq_len - len(p)))
        if len(p) + sp.max_new_tokens > max_seq_len:
            raise ProtocolError(
                f"Requested token count exceeds the model's maximum context length of {max_seq_len} tokens. "
                f"You requested a total of {len(p) + sp.max_new_tokens} tokens: {len(p)} tokens from the input "
                f"messages and {sp.max_new_tokens} tokens for the completion (prompt {i}).")
    routes = body.get("return_routed_experts", False)
    if not isinstance(routes, bool):
        raise ProtocolError(f"return_routed_experts must be true or false, got {routes!r}")
    if routes:  # R3: each input token's experts in meta_info.routed_experts (SGLang's base64 int32 form)
        params = [replace(p, return_routed_experts=True) for p in params]
    n = params[0].n
    lp = [bool(x) for x in _per_prompt(body.get("return_logprob", False), b, "return_logprob")]
    for s in _per_prompt(body.get("logprob_start_len"), b, "logprob_start_len"):
        if s is not None and s != -1:
            raise ProtocolError("logprob_start_len other than -1 (prompt log-probs) is not supported by this server")
    for k in _per_prompt(body.get("top_logprobs_num"), b, "top_logprobs_num"):
        if k:
            raise ProtocolError("top_logprobs_num > 0 is not supported: the engine returns only the sampled token's log-prob")
    rid = body.get("rid")
    if rid is None:
        rids = [[uuid.uuid4().hex for _ in range(n)] for _ in range(b)]
    elif isinstance(rid, str) and single and n == 1:
        rids = [[rid]]
    elif isinstance(rid, str):
        # SGLang: a string rid on a batch becomes f"{rid}_{k}" over the expanded (prompt-major) batch.
        rids = [[f"{rid}_{i * n + j}" for j in range(n)] for i in range(b)]
    elif isinstance(rid, list) and len(rid) == b and all(isinstance(r, str) for r in rid):
        rids = [[r] if n == 1 else [f"{r}_{j}" for j in range(n)] for r in rid]
    else:
        raise ProtocolError("The rid should be a string or a list of strings (one per prompt).")
    no_trim = [bool((sp or {}).get("no_stop_trim", False)) for sp in sps]
    return GenerateRequest(prompts=prompts, params=params, rids=rids, return_logprob=lp, is_single=single and n == 1,
                           return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)), no_stop_trim=no_trim)


# --------------------------------------------------------------------------------------------------
# response building: pure functions
# --------------------------------------------------------------------------------------------------
def finish_reason_json(out: GenerationOutput, message: str = "Aborted") -> dict:
    """SGLang's ``BaseFinishReason.to_json()`` for one engine output."""
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": int(out.token_ids[-1])}
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.token_ids)}
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def output_json(out: GenerationOutput, *, rid: str, prompt: Sequence[int], return_logprob: bool,
                text: str | None = None, token_texts: Sequence[str | None] | None = None,
                weight_version: str | None = None, e2e_latency: float = 0.0) -> dict:
    """One SGLang ``/generate`` output object. ``text`` None = key absent (``--skip-tokenizer-init``)."""
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish_reason_json(out), "prompt_tokens": len(prompt),
                            "weight_version": weight_version, "total_retractions": 0}
    if return_logprob:
        texts = token_texts if token_texts is not None else [None] * len(out.token_ids)
        meta["input_token_logprobs"] = [[None, int(prompt[-1]), None]]  # logprob_start_len == -1 (SGLang)
        meta["output_token_logprobs"] = [[float(lp), int(t), s] for lp, t, s in zip(out.logprobs, out.token_ids, texts)]
    if out.routed_experts is not None:
        meta["routed_experts"] = encode_routes(out.routed_experts)
    meta["completion_tokens"] = len(out.token_ids)
    meta["cached_tokens"] = 0
    meta["e2e_latency"] = e2e_latency
    obj: dict[str, Any] = {}
    if text is not None:
        obj["text"] = text
    obj["output_ids"] = [int(t) for t in out.token_ids]
    obj["meta_info"] = meta
    return obj


def generate_response(req: GenerateRequest, outs: Sequence[Sequence[GenerationOutput]], *,
                      decode: Callable[[list[int]], str] | None = None, weight_version: str | None = None,
                      e2e_latency: float = 0.0) -> dict | list[dict]:
    """The ``/generate`` response: one object when ``req.is_single``, else a prompt-major list."""
    items = []
    for i, outs_i in enumerate(outs):
        for j, o in enumerate(outs_i):
            text = token_texts = None
            if decode is not None:
                ids = list(o.token_ids)
                if o.finish_reason == "stop" and not req.no_stop_trim[i]:
                    ids = ids[:-1]  # SGLang trims the matched stop token from the text
                text = decode(ids)
                if req.return_text_in_logprobs:
                    token_texts = [decode([t]) for t in o.token_ids]
            items.append(output_json(o, rid=req.rids[i][j], prompt=req.prompts[i], return_logprob=req.return_logprob[i],
                                     text=text, token_texts=token_texts, weight_version=weight_version,
                                     e2e_latency=e2e_latency))
    return items[0] if req.is_single else items


# --------------------------------------------------------------------------------------------------
# the server
# --------------------------------------------------------------------------------------------------
class _SerialEngine:
    """The engine with one lock around every call that reads or writes weights, so a weight update or a
    checksum runs between engine calls (never inside one); ``abort`` bypasses it on purpose."""

    def __init__(self, engine):
        self.engine = engine
        self.lock = threading.Lock()
        self.request_keyed_seeds = bool(getattr(engine, "request_keyed_seeds", False))

    def generate(self, prompts, params):
        with self.lock:
            return self.engine.generate(prompts, params)

    def abort(self) -> None:
        self.engine.abort()

    def locked(self, fn, *args):
        with self.lock:
            return fn(*args)


class NativeSGLangServer(EngineServer):
    """The SGLang routes over the shared skeleton (:class:`~trainer.serving.app.EngineServer`); see the
    module docstring."""

    ready_prefix = READY_PREFIX
    client_max_size = 1 << 33  # a weight push carries a whole bucket

    def __init__(self, engine, *, model_path: str, served_model_name: str, eos_token_ids: Sequence[int] = (),
                 tokenizer=None, max_batch_samples: int = 32, batch_wait_s: float = 0.005,
                 batch_max_wait_s: float = 0.05, api_key: str | None = None, server_args: dict | None = None,
                 allow_unauthenticated_control: bool = False, open_generation: bool = False,
                 weights_root: str | None = None, max_request_bytes: int = 64 << 20, max_samples_per_request: int = 4096):
        super().__init__(engine, model_name=served_model_name, api_key=api_key, max_batch_samples=max_batch_samples,
                         batch_wait_s=batch_wait_s, batch_max_wait_s=batch_max_wait_s, max_request_bytes=max_request_bytes,
                         max_samples_per_request=max_samples_per_request)
        self.engine = _SerialEngine(engine)  # the batcher's calls and weight reads/writes take turns
        self.model_path = model_path
        self.eos_token_ids = tuple(int(e) for e in eos_token_ids)
        self.tokenizer = tokenizer
        self.server_args = dict(server_args or {})
        self.weight_version = "default"  # SGLang's ServerArgs.weight_version default
        self.weight_updates = 0
        self.allow_unauthenticated_control = allow_unauthenticated_control
        self.open_generation = open_generation  # generation needs no key (a fleet's servers behind its router)
        # update_weights_from_disk reads only below this directory (default: the one holding --model)
        self.weights_root = os.path.realpath(weights_root or os.path.dirname(os.path.abspath(model_path)))
        self._resume: asyncio.Event | None = None  # cleared while paused
        self._waiting: dict[str, set[asyncio.Task]] = {}  # rid -> tasks not yet answered

    @property
    def served_model_name(self) -> str:
        return self.model_name

    # ---- skeleton hooks ----------------------------------------------------------------------------
    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for p in ("/server_info", "/get_server_info"):
            r.add_get(p, self.server_info)
        for p in ("/model_info", "/get_model_info"):
            r.add_get(p, self.model_info)
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/begin_weight_update", self.weight_update_bracket)
        r.add_post("/end_weight_update", self.weight_update_bracket)
        r.add_post("/get_weights_by_name", self.get_weights_by_name)
        r.add_get("/weights_checksum", self.weights_checksum)
        r.add_get("/weights_safetensors", self.weights_safetensors)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)

    async def _on_startup(self, app) -> None:
        self._resume = asyncio.Event()
        self._resume.set()
        await super()._on_startup(app)

    def needs_auth(self, request: web.Request) -> bool:
        if request.path in CONTROL_PATHS:
            return True
        return request.path != "/health" and not self.open_generation

    def refuse(self, request: web.Request) -> web.Response | None:
        # without a key, the weight and control endpoints are off unless the operator opened them
        if self.api_key is None and request.path in CONTROL_PATHS and not self.allow_unauthenticated_control:
            return web.json_response(
                {"success": False, "message": "this server was started without an API key: weight and control "
                 "endpoints are off. Start it with --api-key-env VAR (VAR holding the key), or pass "
                 "--allow-unauthenticated-control on a host you trust"}, status=403)
        return None

    def error_response(self, exc: Exception) -> web.Response | None:
        return json_error(400, str(exc)) if isinstance(exc, ProtocolError) else None

    async def _json(self, request: web.Request) -> Any:
        # weight pushes may be large (authenticated, a bucket); everything else is capped
        cap = self.client_max_size if request.path in CONTROL_PATHS else self.max_request_bytes
        raw = await read_capped(request, cap)
        if not raw:
            return {}
        try:
            body = parse_json_body(raw)
        except ValueError as e:
            raise ProtocolError(str(e)) from e
        if not isinstance(body, dict):
            raise ProtocolError("the body must be a JSON object")
        return body

    async def _in_engine_thread(self, fn, *args):
        # Weight reads/writes run between engine calls (the lock), off the event loop.
        return await asyncio.get_running_loop().run_in_executor(None, self.engine.locked, fn, *args)

    # ---- health and info ------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        try:
            await asyncio.wait_for(self.batcher.submit([0], SamplingParams(temperature=0.0, max_new_tokens=1)), 20)
        except Exception:  # noqa: BLE001 - any failure is "unhealthy"
            return web.Response(status=503)
        return web.Response(status=200)

    async def server_info(self, request: web.Request) -> web.Response:
        internal = {**self.counters(), "paused": not self._resume.is_set(), "weight_updates": self.weight_updates}
        body = {"model_path": self.model_path, "tokenizer_path": self.model_path if self.tokenizer else None,
                "served_model_name": self.served_model_name, "skip_tokenizer_init": self.tokenizer is None,
                "tp_size": 1, "dp_size": 1, "context_length": self.max_seq_len, "weight_version": self.weight_version,
                "tie_word_embeddings": bool(getattr(self.engine.engine.config, "tie_word_embeddings", False)),
                **self.server_args, "max_req_input_len": self.max_seq_len - 1, "max_total_num_tokens":
                self.max_seq_len * self.max_batch_samples, "internal_states": [internal],
                "version": f"coxswain-native (sglang {SGLANG_PROTOCOL_VERSION} protocol)"}
        return web.json_response(body)

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.engine.engine.config
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path if self.tokenizer else None,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": self.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None), "architectures": None})

    # ---- generation -------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def _submit(self, rid: str, prompt: list[int], params: SamplingParams) -> list[GenerationOutput]:
        await self._resume.wait()  # paused: hold new work until /continue_generation
        task = asyncio.ensure_future(self.batcher.submit(prompt, params))
        self._waiting.setdefault(rid, set()).add(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and not asyncio.current_task().cancelling():
                # /abort_request cancelled it before the engine ran it: SGLang answers with an abort.
                return [GenerationOutput([], [], "abort")] * params.n
            task.cancel()  # our caller went away: drop the item before it reaches the engine
            raise
        finally:
            tasks = self._waiting.get(rid)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    self._waiting.pop(rid, None)

    async def generate(self, request: web.Request) -> web.Response:
        t0 = time.time()
        body = await self._json(request)
        req = parse_generate_request(body, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len,
                                     eos_token_ids=self.eos_token_ids,
                                     encode=self._encode if self.tokenizer is not None else None)
        samples = sum(p.n for p in req.params)
        if samples > self.max_samples_per_request:
            return json_error(413, f"this request asks for {samples} samples (prompts x n); the server takes at most "
                                   f"{self.max_samples_per_request} per request (--max-samples-per-request)")
        self.stats.requests += 1
        self.stats.prompts += len(req.prompts)
        try:
            outs = await asyncio.gather(*(self._submit(req.rids[i][0], p, sp)
                                          for i, (p, sp) in enumerate(zip(req.prompts, req.params))))
        except ValueError as e:  # the engine refused an input the checks did not catch
            raise ProtocolError(str(e)) from e
        return web.json_response(generate_response(
            req, outs, decode=self._decode if self.tokenizer is not None else None,
            weight_version=self.weight_version, e2e_latency=time.time() - t0))

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if body.get("abort_all"):
            # requests still waiting for an engine call are answered with an empty abort; the running call
            # returns its unfinished samples with "abort" and the tokens sampled so far (a partial rollout
            # continues them), so its requests are not cancelled
            self.batcher.abort_waiting()
            self.engine.abort()
        else:
            for t in list(self._waiting.get(str(body.get("rid") or ""), ())):
                t.cancel()
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise ProtocolError(f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
        self._resume.clear()
        if mode == "abort":
            for tasks in list(self._waiting.values()):
                for t in tasks:
                    t.cancel()
            self.engine.abort()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self._resume.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
                                 "or waiting requests, the operation will not be performed.)\n")

    # ---- weights ------------------------------------------------------------------------------------
    def _load(self, named: list) -> list[str]:
        names = self.engine.engine.update_weights(named)
        self.weight_updates += 1
        return names

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        from trainer.rollout.hf_model import iter_checkpoint_tensors

        body = await self._json(request)
        path = body.get("model_path") if isinstance(body, dict) else None
        problem = path_problem(path)
        if problem:  # before any look at the file system (a NUL byte makes every os call raise)
            return web.json_response({"success": False, "message": f"model_path {problem}", "num_paused_requests": 0},
                                     status=400)
        if os.path.commonpath([os.path.realpath(path), self.weights_root]) != self.weights_root:
            # said before any look at the path: the answer must not tell whether it exists
            return web.json_response({"success": False, "message": f"model_path is outside the allowed root "
                                      f"{self.weights_root} (--weights-root)", "num_paused_requests": 0}, status=403)
        if not isinstance(path, str) or not os.path.isdir(path):
            return web.json_response({"success": False, "message": f"model_path {path!r} is not a directory",
                                      "num_paused_requests": 0}, status=400)
        try:
            names = await self._in_engine_thread(lambda: self._load(list(iter_checkpoint_tensors(path))))
        except Exception as e:  # noqa: BLE001 - unknown names / shapes: the request's problem
            return web.json_response({"success": False, "message": f"Failed to update weights: {e}",
                                      "num_paused_requests": 0}, status=400)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": f"Succeeded to update model weights ({len(names)} tensors).",
                                  "num_paused_requests": 0})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        if request.content_type == WEIGHTS_CONTENT_TYPE:
            blobs, version = [await request.read()], request.query.get("weight_version")
            named = safetensors_to_tensors(blobs[0])
        else:
            body = await self._json(request)
            blobs, version = parse_update_weights_from_tensor(body)
            if body.get("load_format") == "flattened_bucket":
                # SGLang's same-host form: one payload per TP rank, all the same bucket; this server is one rank
                named = flattened_bucket_to_tensors(blobs[0]) if blobs else []
            else:
                named = [nt for blob in blobs for nt in safetensors_to_tensors(blob)]
        try:
            names = await self._in_engine_thread(self._load, named)
        except Exception as e:  # noqa: BLE001
            return web.json_response({"success": False, "message": f"Failed to update weights: {e}"}, status=400)
        if version is not None:
            self.weight_version = version
        return web.json_response({"success": True, "message": f"Succeeded to update model weights ({len(names)} tensors)."})

    async def weight_update_bracket(self, request: web.Request) -> web.Response:
        """SGLang 0.5.21's ``/begin_weight_update`` / ``/end_weight_update`` around a tensor push: this engine
        applies each bucket whole under its own lock, so there is nothing to open or close; answered so that one
        fleet client speaks SGLang's weight protocol to both kinds of server."""
        await self._json(request)
        return web.json_response({"success": True, "message": ""})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's ``/get_weights_by_name {"name", "truncate_size"}``: the first ``truncate_size`` rows of an
        HF-named parameter as nested lists (float32), or null for a name the model does not hold."""
        body = await self._json(request)
        name, rows = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str) or type(rows) is not int or not 1 <= rows <= 1 << 31:
            raise ProtocolError("the body must be {'name': str, 'truncate_size': int in [1, 2^31]}")

        def read():
            t = next((t for n, t in self.engine.engine.model.hf_tensors() if n == name), None)
            return None if t is None else t.detach()[:rows].to(torch.float32).tolist()

        return web.json_response(await self._in_engine_thread(read))

    async def weights_checksum(self, request: web.Request) -> web.Response:
        checksum = await self._in_engine_thread(self.engine.engine.weights_checksum)
        return web.json_response({"checksum": checksum, "weight_version": self.weight_version})

    async def weights_safetensors(self, request: web.Request) -> web.Response:
        blob = await self._in_engine_thread(lambda: tensors_to_safetensors(self.engine.engine.model.hf_tensors()))
        return web.Response(body=blob, content_type=WEIGHTS_CONTENT_TYPE,
                            headers={"X-Weight-Version": self.weight_version})


# the endpoints that change or read out the weights, or steer the engine: never open without a key
# unless the operator says so
CONTROL_PATHS = frozenset({"/update_weights_from_disk", "/update_weights_from_tensor", "/weights_safetensors",
                           "/begin_weight_update", "/end_weight_update", "/get_weights_by_name",
                           "/weights_checksum", "/pause_generation", "/continue_generation", "/abort_request",
                           "/flush_cache"})


# --------------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------------
class _DropHTTP2Preface(logging.Filter):
    # sglang-router probes each worker for gRPC (an HTTP/2 preface) before falling back to HTTP;
    # aiohttp logs each probe as a bad request. Drop those records, keep every other error.
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI" in str(exc))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trainer.rollout.native_server", description=__doc__.split("\n")[0])
    add_engine_args(ap, port=30000)
    ap.add_argument("--skip-tokenizer-init", action="store_true",
                    help="as SGLang's: no tokenizer, no 'text' in responses, input_ids only")
    ap.add_argument("--api-key-env", default=None, help="env var holding a Bearer key required on all but /health")
    ap.add_argument("--allow-unauthenticated-control", action="store_true",
                    help="without a key, still serve the weight and control endpoints (off by default)")
    ap.add_argument("--open-generation", action="store_true",
                    help="with a key, let generation and info requests through without it (the key still guards "
                         "the weight and control endpoints); the fleet uses it behind its router")
    ap.add_argument("--weights-root", default=None, type=model_dir_arg,
                    help="update_weights_from_disk reads only below this directory (default: the one holding --model)")
    return ap


def build_server(a: argparse.Namespace) -> NativeSGLangServer:
    import torch

    from trainer.rollout.generate import eos_token_ids

    tokenizer = None
    if not a.skip_tokenizer_init:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.model)
    engine = load_engine(a)
    return NativeSGLangServer(
        engine, model_path=a.model, served_model_name=served_model_name(a),
        eos_token_ids=eos_token_ids(a.model, tokenizer), tokenizer=tokenizer, max_batch_samples=a.max_batch_size,
        batch_wait_s=a.batch_wait_ms / 1000.0, batch_max_wait_s=a.batch_max_wait_ms / 1000.0, **request_limits(a),
        api_key=(os.environ.get(a.api_key_env) or None) if a.api_key_env else None,
        allow_unauthenticated_control=a.allow_unauthenticated_control, open_generation=a.open_generation,
        weights_root=a.weights_root,
        server_args={"host": a.host, "dtype": a.dtype, "device": a.device, "max_running_requests": a.max_batch_size,
                     "threads": torch.get_num_threads()})


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.getLogger("aiohttp.server").addFilter(_DropHTTP2Preface())
    server = build_server(a)
    if server.api_key is None:
        print("native_server: no API key (--api-key-env): weight and control endpoints are "
              + ("OPEN to anyone who can reach this port" if a.allow_unauthenticated_control else
                 "off; generation only"), file=sys.stderr, flush=True)
    serve_until_signal(server, a.host, a.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
