"""An OpenAI-compatible HTTP server over the native engine.

    python -m trainer.serve --model DIR [--port 8000 | --port 0] [--host 127.0.0.1]
        [--api-key-env COXSWAIN_API_KEY] [--served-model-name NAME] [--max-batch-size 32]
        [--max-seq-len N] [--batch-wait-ms 5] [--batch-max-wait-ms 50] [--dtype float32] [--device cpu]
        [--threads N]

The OpenAI protocol adapter on the shared skeleton (:mod:`trainer.serving.app`); ``python -m trainer.serve``
is its command line (:mod:`trainer.serve` re-exports this module). Serves any HF-format checkpoint the
native engine reads (Llama / Qwen2 / Qwen3, Coxswain's own exports included). It is the local judge for
ADCA (launched by :mod:`trainer.rewards.judge_server`, queried by :mod:`trainer.rewards.judge`), an eval
endpoint and a way to poke at a trained model. ``--port 0`` binds a free port; the server prints one line
``coxswain-serve: listening on http://HOST:PORT/v1 (model NAME)`` once it accepts requests.

Endpoints (aiohttp; bound to 127.0.0.1 unless ``--host`` says otherwise):
  GET  /health                 ``{"status": "ok", ...counters}`` (no key needed; no model output in it)
  GET  /v1/models              the one served model
  POST /v1/chat/completions    messages -> the tokenizer's chat template (add_generation_prompt) -> engine
  POST /v1/completions         prompt: a string, a list of strings, a list of token ids, or a list of those

Authentication: the key is read once from the environment variable named by ``--api-key-env``
(default ``COXSWAIN_API_KEY``). When it is set and non-empty, every ``/v1/*`` request must carry
``Authorization: Bearer <key>`` (compared in constant time), else 401. When it is unset the server
says so at start and accepts every request.

Request fields and their meaning here:
  temperature (default 1; 0 = greedy), top_p (default 1), top_k (vLLM extension; 0 or -1 = off),
  max_tokens / max_completion_tokens (default: the rest of the context, ``max_seq_len - prompt``),
  n (samples per prompt), stop (a string or list of strings: the text is cut before the first one and
  finish_reason is "stop"), stop_token_ids (extension; added to the model's EOS ids), ignore_eos
  (extension), seed, logprobs, chat_template_kwargs (extension, passed to the chat template),
  stream (the whole answer comes as one server-sent-event chunk followed by ``[DONE]``: generation is
  not incremental). Fields that would change the output and are not implemented (presence /
  frequency penalties, logit_bias, top_logprobs > 0, echo, response_format other than text, tools)
  are a 400, never silently ignored; other fields (user, metadata, ...) are ignored.
  Log-probs are the engine's: ``log_softmax(logits / T)[token]`` over the full vocabulary (T = 1 when
  greedy), see :mod:`trainer.rollout.engine`. They cover the tokens of the returned text; the EOS /
  stop token that ended a response is generated (and counted in ``usage.completion_tokens``) but is
  not part of the text, so it has no log-prob entry. Completions' ``logprobs`` returns ``tokens``,
  ``token_logprobs`` and ``text_offset``; ``top_logprobs`` is null (the engine returns only the
  sampled token's log-prob).

Batching (:mod:`trainer.rollout.async_engine`). Handlers validate and tokenize, then put one item per prompt (``n`` samples each) on an
asyncio queue and await a future. One batcher task takes the first waiting item, waits until no new
item has arrived for ``--batch-wait-ms`` (at most ``--batch-max-wait-ms`` in all: a burst of requests
arrives over many connections), drains the queue up to ``--max-batch-size`` samples, and runs
ONE ``engine.generate`` call for them in a single worker thread (the engine is not thread-safe and
runs one call at a time; the event loop keeps accepting requests meanwhile, and they form the next
batch). A failing batch is re-run one item at a time so one bad request cannot fail the others.
Items whose client has gone away are dropped before they reach the engine.

Seeds. The batcher hands the engine one SamplingParams per request, and the native engine keys a
request's random stream by that request's own seed (``request_keyed_seeds``), not by its position in
the call: a seeded request's samples equal ``NativeEngine.generate([prompt], SamplingParams(seed=s,
n=n, ...))`` whatever else is in flight, and seeded requests batch with each other. Up to float
rounding across batch shapes, greedy output does not depend on the batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from trainer.rollout.async_engine import EngineStats as ServerStats
from trainer.rollout.engine import GenerationOutput, SamplingParams
from trainer.rollout.generate import eos_token_ids
from trainer.serving.app import (parse_json_body, EngineServer, add_engine_args, bearer_ok, json_error, load_engine, run_app,
                                 run_until_signal, serve, serve_until_signal, served_model_name, read_capped, request_limits)
from trainer.net import OPENAI_READY_PREFIX as READY_PREFIX

__all__ = ["DEFAULT_API_KEY_ENV", "READY_PREFIX", "APIError", "RequestParams", "parse_params", "parse_messages",
           "token_pieces", "apply_stop_strings", "ModelServer", "ServerStats", "build_parser", "build_server",
           "bearer_ok", "run_app", "run_until_signal", "serve", "main"]

DEFAULT_API_KEY_ENV = "COXSWAIN_API_KEY"


# --------------------------------------------------------------------------------------------------
# errors in the OpenAI shape
# --------------------------------------------------------------------------------------------------
# apply_chat_template's own keywords: a request's chat_template_kwargs are template variables only
RENDER_ARGS = frozenset({"tokenize", "return_tensors", "return_dict", "padding", "truncation", "max_length",
                         "add_generation_prompt", "continue_final_message", "return_assistant_tokens_mask",
                         "tokenizer_kwargs"})


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> web.Response:
        return json_error(self.status, self.message, type=self.type, param=self.param, code=self.code)


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# --------------------------------------------------------------------------------------------------
# request parsing (pure functions over the JSON body)
# --------------------------------------------------------------------------------------------------
def _number(body: dict, key: str, default, *, kind=float, lo=None, hi=None, lo_open=False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and isinstance(v, float) and not v.is_integer()):
        raise _bad(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {v!r}", key)
    if not math.isfinite(v):
        raise _bad(f"'{key}' must be a finite number, got {v!r}", key)
    v = kind(v)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise _bad(f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {v}", key)
    if hi is not None and v > hi:
        raise _bad(f"'{key}' must be <= {hi}, got {v}", key)
    return v


def _unsupported(body: dict) -> None:
    # Fields that change the output: refuse them rather than return something the client did not ask for.
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = body.get(key)
        if v not in (None, 0, 0.0) and not (key == "repetition_penalty" and v == 1):
            raise _bad(f"'{key}' is not supported by this server", key)
    if body.get("logit_bias"):
        raise _bad("'logit_bias' is not supported by this server", "logit_bias")
    if body.get("tools") or body.get("functions"):
        raise _bad("tool calling is not supported by this server", "tools")
    rf = body.get("response_format")
    if rf and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise _bad("'response_format' other than text is not supported by this server", "response_format")


@dataclass
class RequestParams:
    """The sampling side of a request, engine-independent."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False
    stream: bool = False


def parse_params(body: dict, *, chat: bool) -> RequestParams:
    """Validate the sampling fields of a (chat) completion request body."""
    _unsupported(body)
    p = RequestParams()
    p.n = _number(body, "n", 1, kind=int, lo=1, hi=256)
    p.temperature = _number(body, "temperature", 1.0, lo=0.0)
    p.top_p = _number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k = _number(body, "top_k", 0, kind=int, lo=-1)
    p.top_k = 0 if top_k == -1 else top_k
    mt = body.get("max_completion_tokens") if body.get("max_completion_tokens") is not None else body.get("max_tokens")
    p.max_tokens = _number({"max_tokens": mt}, "max_tokens", None, kind=int, lo=1)
    stop = body.get("stop")
    if stop is None:
        p.stop = ()
    elif isinstance(stop, str):
        p.stop = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        p.stop = tuple(s for s in stop if s)
    else:
        raise _bad("'stop' must be a string or a list of strings", "stop")
    sti = body.get("stop_token_ids") or []
    if not isinstance(sti, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in sti):
        raise _bad("'stop_token_ids' must be a list of integers", "stop_token_ids")
    p.stop_token_ids = tuple(sti)
    p.ignore_eos = bool(body.get("ignore_eos", False))
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("'seed' must be an integer", "seed")
    p.seed = seed
    p.stream = bool(body.get("stream", False))
    if chat:
        p.logprobs = bool(body.get("logprobs", False))
        if _number(body, "top_logprobs", 0, kind=int, lo=0) > 0:
            raise _bad("'top_logprobs' > 0 is not supported: the engine returns only the sampled token's log-prob",
                       "top_logprobs")
    else:
        lp = body.get("logprobs")
        if lp is not None:
            _number(body, "logprobs", None, kind=int, lo=0)  # type check; top alternatives are not returned
            p.logprobs = True
        if body.get("echo"):
            raise _bad("'echo' is not supported by this server", "echo")
    return p


def _message_text(content: Any, i: int) -> str:
    """A chat message's content as text (a string, or a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
        return "".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a 'role'", "messages")
        out.append({"role": m["role"], "content": _message_text(m.get("content"), i)})
    return out


# --------------------------------------------------------------------------------------------------
# text post-processing: token pieces, stop strings
# --------------------------------------------------------------------------------------------------
def token_pieces(decode, ids: list[int]) -> list[str]:
    """The text each token adds (incremental detokenization, as streaming servers do it).

    Each step decodes from the start of the previously emitted piece: ``prefix = decode(ids[a:b])`` and
    ``new = decode(ids[a:k+1])``; the token's piece is ``new[len(prefix):]``. Decoding from a token
    already emitted keeps context-dependent spacing (a SentencePiece leading space) right. A token
    whose text ends in an incomplete UTF-8 character gets "" and the token completing the character
    gets all of it; bytes still incomplete at the end go to the last token.
    """
    pieces: list[str] = []
    a = b = 0  # ids[a:b] is the last emitted piece's context; ids[b:] not yet emitted
    for k in range(len(ids)):
        prefix = decode(ids[a:b]) if b > a else ""
        new = decode(ids[a:k + 1])
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            pieces.append(new[len(prefix):])
            a, b = b, k + 1
        else:
            pieces.append("")
    if ids and b < len(ids):
        pieces[-1] += decode(ids[a:])[len(decode(ids[a:b])) if b > a else 0:]
    return pieces


def apply_stop_strings(pieces: list[str], stop: tuple[str, ...]) -> tuple[int, str, bool]:
    """``(kept_tokens, text, stopped)``: the text up to (excluding) the first occurrence of any stop
    string, and the number of tokens whose piece starts before that point. Without a hit: all tokens
    and the joined pieces."""
    text = ""
    starts: list[int] = []
    longest = max((len(s) for s in stop), default=0)
    for piece in pieces:
        starts.append(len(text))
        text += piece
        if stop and piece:
            lo = max(0, starts[-1] - longest + 1)  # a new match must end inside this piece
            hits = [p for p in (text.find(s, lo) for s in stop) if p >= 0]
            if hits:
                cut = min(hits)
                return sum(1 for s in starts if s < cut), text[:cut], True
    return len(pieces), text, False


# --------------------------------------------------------------------------------------------------
# the server
# --------------------------------------------------------------------------------------------------
class ModelServer(EngineServer):
    """The OpenAI routes over the shared skeleton (engine, batcher, key: :class:`~trainer.serving.app.EngineServer`)."""

    ready_prefix = READY_PREFIX
    url_path = "/v1"

    def __init__(self, engine, tokenizer, *, model_name: str, model_dir: str | None = None, eos_ids=(),
                 api_key: str | None = None, max_batch_samples: int = 32, batch_wait_s: float = 0.005,
                 batch_max_wait_s: float = 0.05, max_request_bytes: int = 64 << 20, max_samples_per_request: int = 4096,
                 allow_request_chat_template: bool = False, render_timeout_s: float = 10.0):
        super().__init__(engine, model_name=model_name, api_key=api_key, max_batch_samples=max_batch_samples,
                         batch_wait_s=batch_wait_s, batch_max_wait_s=batch_max_wait_s, max_request_bytes=max_request_bytes,
                         max_samples_per_request=max_samples_per_request)
        self.allow_request_chat_template = allow_request_chat_template
        self.render_timeout_s = render_timeout_s
        self.tokenizer = tokenizer
        self.model_aliases = {model_name} | ({model_dir, os.path.abspath(model_dir)} if model_dir else set())
        self.eos_ids = tuple(int(e) for e in eos_ids)

    # ---- skeleton hooks ----------------------------------------------------------------------------
    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/health", self.health)
        router.add_get("/v1/models", self.models)
        router.add_post("/v1/chat/completions", self.chat_completions)
        router.add_post("/v1/completions", self.completions)

    def needs_auth(self, request: web.Request) -> bool:
        return request.path.startswith("/v1/")

    def unauthorized(self) -> web.Response:
        return APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                        type_="authentication_error", code="invalid_api_key").response()

    def error_response(self, exc: Exception) -> web.Response | None:
        if not isinstance(exc, APIError):
            return None
        if exc.status >= 500:
            self.stats.errors += 1
        return exc.response()

    def internal_error(self, exc: Exception) -> web.Response:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error").response()

    # ---- simple endpoints -------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model_name, **self.counters()})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": int(self.stats.started), "owned_by": "coxswain",
             "max_model_len": self.max_seq_len}]})

    # ---- helpers ----------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict:
        try:
            body = parse_json_body(await read_capped(request, self.max_request_bytes))
        except ValueError as e:
            raise _bad(str(e))
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad(f"'model' must be a string, got {type(model).__name__}")
        if model is not None and model not in self.model_aliases:
            raise APIError(404, f"model {model!r} is not served here; this server serves {self.model_name!r}",
                           code="model_not_found")
        return body

    def _check_samples(self, n_prompts: int, p) -> None:
        if n_prompts * p.n > self.max_samples_per_request:
            raise APIError(413, f"this request asks for {n_prompts * p.n} samples (prompts x n); the server takes at "
                           f"most {self.max_samples_per_request} per request (--max-samples-per-request)")

    def _check_prompt(self, ids: list[int], what: str) -> None:
        if not ids:
            raise _bad(f"{what} is empty after tokenization", "prompt")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise _bad(f"{what} has token ids outside [0, {self.vocab_size})", "prompt")
        if len(ids) >= self.max_seq_len:
            raise _bad(f"{what} has {len(ids)} tokens; the context is {self.max_seq_len} tokens "
                       f"(--max-seq-len), which leaves no room for a response", "prompt")

    def _sampling(self, p: RequestParams, prompt_len: int) -> SamplingParams:
        room = self.max_seq_len - prompt_len
        max_new = min(p.max_tokens, room) if p.max_tokens is not None else room
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
        # A stop string that is exactly one token's text also stops the engine early (same result,
        # less compute); the text is cut at the string below either way.
        for s in p.stop:
            ids = self.tokenizer.encode(s, add_special_tokens=False)
            if len(ids) == 1 and self.tokenizer.decode(ids) == s:
                stop_ids.add(int(ids[0]))
        return SamplingParams(n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or None,
                              max_new_tokens=max(1, max_new), stop_token_ids=tuple(sorted(stop_ids)), seed=p.seed)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _finish(self, out: GenerationOutput, p: RequestParams, sp: SamplingParams) -> dict:
        """Text, finish reason and per-token log-prob entries of one engine output."""
        ids, lps = list(out.token_ids), list(out.logprobs)
        finish = out.finish_reason
        if finish == "stop" and ids and ids[-1] in sp.stop_token_ids:
            ids, lps = ids[:-1], lps[:-1]  # the stop token is generated but is not part of the text
        if p.stop or p.logprobs:
            pieces = token_pieces(self._decode, ids)
            kept, text, hit = apply_stop_strings(pieces, p.stop)
            if hit:
                finish = "stop"
                ids, lps, pieces = ids[:kept], lps[:kept], pieces[:kept]
            else:
                text = self._decode(ids)  # the same text as without stop strings or logprobs
        else:
            text, pieces = self._decode(ids), None
        return {"text": text, "finish_reason": finish, "ids": ids, "logprobs": lps, "pieces": pieces,
                "completion_tokens": len(out.token_ids)}

    async def _generate(self, prompts: list[list[int]], p: RequestParams):
        self.stats.requests += 1
        self.stats.prompts += len(prompts)
        sps = [self._sampling(p, len(ids)) for ids in prompts]
        try:
            outs = await asyncio.gather(*(self.batcher.submit(ids, sp) for ids, sp in zip(prompts, sps)))
        except ValueError as e:  # the engine refused an input the checks above did not catch
            raise _bad(str(e))
        return sps, outs

    @staticmethod
    def _usage(prompts, finished) -> dict:
        pt = sum(len(x) for x in prompts)
        ct = sum(f["completion_tokens"] for f in finished)
        return {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}

    # ---- /v1/chat/completions ---------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        p = parse_params(body, chat=True)
        messages = parse_messages(body)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise _bad("this model's tokenizer has no chat template; use /v1/completions", "messages")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        steering = sorted(k for k in kwargs if k in RENDER_ARGS)
        if steering:  # these change what apply_chat_template returns (tensors, a dict, text), not the template
            raise _bad(f"'chat_template_kwargs' may not set {steering}: they are the renderer's own arguments, "
                       f"which the server sets; send template variables only", "chat_template_kwargs")
        if ("chat_template" in kwargs or "chat_template" in body) and not self.allow_request_chat_template:
            raise APIError(403, "this server renders only its model's own chat template; a template sent with the "
                           "request runs code on the server (the operator may allow it: --allow-request-chat-template)",
                           param="chat_template")
        if "chat_template" in body:
            kwargs = {**kwargs, "chat_template": body["chat_template"]}

        def render():
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)

        try:  # off the event loop, with a time limit: /health keeps answering whatever the template does
            enc = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, render), self.render_timeout_s)
        except asyncio.TimeoutError:
            raise _bad(f"the chat template took more than {self.render_timeout_s:.0f} s on these messages", "messages")
        except Exception as e:  # noqa: BLE001 - a template error is the request's problem
            raise _bad(f"the chat template failed on these messages: {e}", "messages")
        ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        if not all(isinstance(t, int) for t in ids):  # a template variable that made the renderer return other than ids
            raise _bad("the chat template with these 'chat_template_kwargs' did not give token ids", "chat_template_kwargs")
        self._check_prompt(ids, "the templated conversation")
        self._check_samples(1, p)
        sps, outs = await self._generate([ids], p)
        finished = [self._finish(o, p, sps[0]) for o in outs[0]]
        choices = []
        for j, f in enumerate(finished):
            lp = None
            if p.logprobs:
                lp = {"content": [{"token": piece, "logprob": float(v), "bytes": list(piece.encode("utf-8")),
                                   "top_logprobs": []} for piece, v in zip(f["pieces"], f["logprobs"])]}
            choices.append({"index": j, "message": {"role": "assistant", "content": f["text"]}, "logprobs": lp,
                            "finish_reason": f["finish_reason"]})
        resp = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": self._usage([ids], finished)}
        if p.stream:
            return await self._stream_chat(request, resp)
        return web.json_response(resp)

    async def _stream_chat(self, request: web.Request, resp: dict) -> web.StreamResponse:
        sr = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await sr.prepare(request)
        base = {k: resp[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
        for c in resp["choices"]:
            for delta, fin in (({"role": "assistant", "content": ""}, None),
                               ({"content": c["message"]["content"]}, None), ({}, c["finish_reason"])):
                chunk = base | {"choices": [{"index": c["index"], "delta": delta, "logprobs": None, "finish_reason": fin}]}
                await sr.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await sr.write(b"data: [DONE]\n\n")
        await sr.write_eof()
        return sr

    # ---- /v1/completions ----------------------------------------------------------------------------
    def _completion_prompts(self, body: dict) -> list[list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            items: list = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            items = [prompt]
        elif isinstance(prompt, list) and prompt:
            items = prompt
        else:
            raise _bad("'prompt' must be a string, a list of strings, a list of token ids, or a list of those", "prompt")
        out = []
        for i, it in enumerate(items):
            if isinstance(it, str):
                ids = list(self.tokenizer(it, add_special_tokens=True)["input_ids"])
            elif isinstance(it, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in it):
                ids = list(it)
            else:
                raise _bad(f"prompt[{i}] must be a string or a list of token ids", "prompt")
            self._check_prompt(ids, f"prompt[{i}]")
            out.append(ids)
        return out

    async def completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        p = parse_params(body, chat=False)
        if p.stream:
            raise _bad("'stream' is supported on /v1/chat/completions only", "stream")
        prompts = await asyncio.get_running_loop().run_in_executor(None, self._completion_prompts, body)  # tokenizing: off the loop
        self._check_samples(len(prompts), p)
        sps, outs = await self._generate(prompts, p)
        choices, finished_all = [], []
        for i, outs_i in enumerate(outs):
            for o in outs_i:
                f = self._finish(o, p, sps[i])
                finished_all.append(f)
                lp = None
                if p.logprobs:
                    offs, pos = [], 0
                    for piece in f["pieces"]:
                        offs.append(pos)
                        pos += len(piece)
                    lp = {"tokens": f["pieces"], "token_logprobs": [float(v) for v in f["logprobs"]],
                          "top_logprobs": None, "text_offset": offs}
                choices.append({"index": len(choices), "text": f["text"], "logprobs": lp,
                                "finish_reason": f["finish_reason"]})
        return web.json_response({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                                  "created": int(time.time()), "model": self.model_name, "choices": choices,
                                  "usage": self._usage(prompts, finished_all)})


# --------------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trainer.serve", description=__doc__.split("\n")[0])
    add_engine_args(ap, port=8000)
    ap.add_argument("--api-key-env", default=DEFAULT_API_KEY_ENV, help="env var holding the API key; unset = no auth")
    ap.add_argument("--allow-request-chat-template", action="store_true",
                    help="render chat templates sent with a request (they run on the server; off by default)")
    return ap


def build_server(a: argparse.Namespace) -> ModelServer:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.model)
    engine = load_engine(a)
    return ModelServer(engine, tokenizer, model_name=served_model_name(a), model_dir=a.model,
                       eos_ids=eos_token_ids(a.model, tokenizer), api_key=os.environ.get(a.api_key_env) or None,
                       max_batch_samples=a.max_batch_size, batch_wait_s=a.batch_wait_ms / 1000.0,
                       batch_max_wait_s=a.batch_max_wait_ms / 1000.0, **request_limits(a),
                       allow_request_chat_template=a.allow_request_chat_template)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    server = build_server(a)
    if server.api_key is None:
        loopback = a.host in ("127.0.0.1", "localhost", "::1")
        print(f"coxswain-serve: ${a.api_key_env} is not set: requests are not authenticated"
              + ("" if loopback else f" (and --host {a.host} is reachable from other machines)"),
              file=sys.stderr, flush=True)

    serve_until_signal(server, a.host, a.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
