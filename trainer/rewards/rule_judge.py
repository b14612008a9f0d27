"""A rule-based step judge behind the OpenAI chat interface: ADCA's ``evaluation_type=rule``.

    python -m trainer.rewards.rule_judge --environment towers [--host 127.0.0.1] [--port 0]

``POST /v1/chat/completions`` takes the messages :func:`trainer.rewards.judge.build_judge_messages` writes,
reads the task and the steps back (:func:`trainer.rewards.judge.parse_judge_prompt`), and answers
``Step i: GOOD`` / ``Step i: BAD`` lines from the environment's own rule
(:meth:`trainer.envs.base.Environment.label_steps`: GOOD = the step made progress). So the judge client's
whole path -- HTTP, retries, the answer's parsing, the stricter retry and the fallback -- runs for real,
with labels that carry information. A prompt it cannot read (not the judge's format, or a task the
environment does not know) gets an answer without labels, which the client treats as any unusable answer.

Also ``GET /v1/models`` and ``GET /health`` (the counters: requests, labelled, unlabelled). Loopback and
no key by default, as the local model judge; it prints the OpenAI server's ready line
(:data:`trainer.net.OPENAI_READY_PREFIX`) so :class:`trainer.rewards.judge_server.JudgeServer` starts it
the same way.
"""

from __future__ import annotations

import argparse
import time
import uuid

from aiohttp import web

from trainer.envs import env_factory
from trainer.net import OPENAI_READY_PREFIX
from trainer.rewards.judge import parse_judge_prompt
from trainer.serving.app import json_error, parse_json_body, read_capped, run_app, run_until_signal

MAX_BODY = 8 << 20  # a judge prompt is a few KB per step


def answer(environment, messages) -> str | None:
    """The judge's answer text for ``messages`` (the last user message is read), or None when it cannot
    label them."""
    users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    parsed = parse_judge_prompt(users[-1]) if users and isinstance(users[-1], str) else None
    if parsed is None:
        return None
    query, actions = parsed
    flags = environment.label_steps(query, actions)
    if flags is None or len(flags) != len(actions):
        return None
    return "\n".join(f"Step {i}: {'GOOD' if f > 0 else 'BAD'}" for i, f in enumerate(flags, start=1))


class RuleJudge:
    """The aiohttp app around :func:`answer` for one environment class."""

    def __init__(self, environment: str, model_name: str = "rule-judge"):
        self.environment = env_factory(environment)
        self.model_name = model_name
        self.counts = {"requests": 0, "labelled": 0, "unlabelled": 0}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    async def chat(self, request: web.Request) -> web.Response:
        self.counts["requests"] += 1
        try:
            body = parse_json_body(await read_capped(request, MAX_BODY))
        except ValueError as e:
            return json_error(400, str(e), type="invalid_request_error")
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list):
            return json_error(400, "'messages' must be a list of chat messages", type="invalid_request_error")
        text = answer(self.environment, messages)
        self.counts["labelled" if text is not None else "unlabelled"] += 1
        content = text if text is not None else "I cannot label these steps: the task or the steps are not readable."
        return web.json_response({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        })

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **self.counts})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m trainer.rewards.rule_judge", description=__doc__.split("\n")[0])
    ap.add_argument("--environment", required=True, help="a shipped environment name or pkg.module:Class")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 = a free port")
    ap.add_argument("--served-model-name", default="rule-judge")
    a = ap.parse_args(argv)
    judge = RuleJudge(a.environment, a.served_model_name)

    def bound(port: int) -> None:
        print(f"{OPENAI_READY_PREFIX}http://{a.host}:{port}/v1 (model {judge.model_name})", flush=True)

    run_until_signal(lambda stop: run_app(judge.app(), a.host, a.port, bound, stop))


if __name__ == "__main__":
    main()
