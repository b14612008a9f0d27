"""Environments for the multi-turn agent loop, and the tool-calling interface.

An :class:`Environment` is one episode's state. The agent loop (:mod:`trainer.rollout.multi_turn`)
calls ``reset(task, seed)`` once, which returns the opening chat messages (system / user), then
alternates: the policy samples an assistant message, the loop passes its text to ``step(action_text)``
and appends the :class:`StepResult`'s observation to the conversation, until ``done`` or a budget
runs out. The episode's return is the sum of the step rewards; ``info["success"]`` of the last step
(when given) says whether the task was solved (the batch's ``acc``).

An observation is a string (sent as one message of role ``observation_role``, "user" by default), a
list of chat messages (e.g. ``tool`` messages), or ``None`` (nothing to say: the episode ends).

Tools. A :class:`Tool` has a name, a description and a JSON-schema for its arguments, in the OpenAI
function format that chat templates render (``apply_chat_template(..., tools=[t.schema ...])``).
:class:`ToolEnvironment` parses the assistant's calls in the Hermes / Qwen format::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3*(4+5)"}}
    </tool_call>

runs each (in order) and answers with one ``{"role": "tool", "name": ..., "content": ...}`` message
per call. A call that does not parse, names an unknown tool, has wrong arguments or raises gives an
error text as that call's tool output -- never an exception -- so a bad sample costs the policy a turn,
not the run. A message without any tool call is the final answer and goes to :meth:`ToolEnvironment.
final_answer`. The assistant message stays the raw sampled text (calls included) in the conversation,
so the chat template renders exactly the tokens that were sampled.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

Message = dict[str, Any]


@dataclass
class StepResult:
    """What an environment answers to one assistant message."""

    observation: str | list[Message] | None  # next message(s) for the policy; None = nothing (episode ends)
    reward: float = 0.0  # reward of this step; the episode return is the sum
    done: bool = False  # the episode is over (solved, failed, or out of the env's own budget)
    info: dict = field(default_factory=dict)  # free-form; "success" (bool) is read for the batch's acc


class Environment:
    """One episode of an interactive task. Subclass and implement :meth:`reset` and :meth:`step`.

    An instance serves one trajectory (the loop builds one per trajectory), so it may keep state.
    """

    observation_role: str = "user"  # role of a string observation's message

    def reset(self, task: dict, seed: int | None = None) -> list[Message]:
        """Start an episode for ``task`` (a dataset row); returns the opening messages."""
        raise NotImplementedError

    def step(self, action_text: str) -> StepResult:
        """Answer the assistant's message (its text, the stop token excluded)."""
        raise NotImplementedError

    def tools(self) -> list[dict] | None:
        """Tool schemas (OpenAI function format) for the chat template's ``tools=``; None = no tools."""
        return None

    @classmethod
    def label_steps(cls, query: str, actions: list[str]) -> list[int] | None:
        """A rule-based step judge (ADCA's ``evaluation_type=rule``): one label per assistant message of an
        episode whose opening text is ``query``, +1 (GOOD: it made progress) or -1 (BAD). None = this
        environment has no such rule, or ``query`` is not one of its tasks."""
        return None


@dataclass
class Tool:
    """A function the policy may call: ``tool(**arguments) -> str``."""

    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[..., str]

    def __call__(self, **arguments) -> str:
        return str(self.fn(**arguments))

    @property
    def schema(self) -> dict:
        """The OpenAI function-tool form that chat templates render."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str | None  # None when the call did not parse
    arguments: dict
    error: str | None = None  # why the call cannot run (parse error, bad arguments)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` block in ``text``, in order; a block that does not parse
    into ``{"name": str, "arguments": object}`` comes back with ``error`` set. An opened but never
    closed ``<tool_call>`` (a truncated turn) counts as one malformed call."""
    calls = []
    for m in TOOL_CALL_RE.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, {}, f"tool call is not valid JSON ({e.msg} at char {e.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(None, {}, 'tool call must be a JSON object {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, "tool call 'arguments' must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    if "<tool_call>" in TOOL_CALL_RE.sub("", text):  # what is left after the closed blocks
        calls.append(ToolCall(None, {}, "tool call opened with <tool_call> but never closed with </tool_call>"))
    return calls


def check_arguments(schema: dict, args: dict) -> str | None:
    """A small JSON-schema check of an arguments object (required keys, no unknown keys when
    ``additionalProperties`` is false, primitive types); returns an error text or None."""
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    if schema.get("additionalProperties", True) is False:
        extra = [k for k in args if k not in props]
        if extra:
            return f"unknown argument(s): {', '.join(extra)}"
    types = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}
    for k, v in args.items():
        want = props.get(k, {}).get("type")
        if want in types and (not isinstance(v, types[want]) or (want in ("integer", "number") and isinstance(v, bool))):
            return f"argument '{k}' must be of type {want}, got {type(v).__name__}"
    return None


class ToolEnvironment(Environment):
    """An environment whose assistant turns are tool calls until a final answer.

    Subclasses set ``self.tool_list`` (in ``__init__`` or ``reset``) and implement :meth:`reset` and
    :meth:`final_answer`. ``max_calls_per_turn`` bounds the calls run for one message (the rest are
    answered with an error), so one sample cannot make the environment do unbounded work.
    """

    observation_role = "tool"
    max_calls_per_turn: int = 8

    def __init__(self, tools: list[Tool] | None = None):
        self.tool_list: list[Tool] = list(tools or [])

    def tools(self) -> list[dict] | None:
        return [t.schema for t in self.tool_list] or None

    def final_answer(self, text: str) -> StepResult:
        """Judge a message without tool calls (the episode's answer)."""
        raise NotImplementedError

    def run_call(self, call: ToolCall) -> str:
        """The tool output for one parsed call (an error text when it cannot run)."""
        if call.error:
            return f"Error: {call.error}"
        by_name = {t.name: t for t in self.tool_list}
        tool = by_name.get(call.name)
        if tool is None:
            return f"Error: unknown tool '{call.name}'; available: {', '.join(sorted(by_name)) or 'none'}"
        err = check_arguments(tool.parameters, call.arguments)
        if err:
            return f"Error: {err}"
        try:
            return tool(**call.arguments)
        except Exception as e:  # noqa: BLE001 - a failing tool is an observation for the policy
            return f"Error: {type(e).__name__}: {e}"

    def step(self, action_text: str) -> StepResult:
        calls = parse_tool_calls(action_text)
        if not calls:
            return self.final_answer(action_text)
        msgs = []
        for k, call in enumerate(calls):
            if k >= self.max_calls_per_turn:
                out = f"Error: at most {self.max_calls_per_turn} tool calls per message; this one was not run"
            else:
                out = self.run_call(call)
            msgs.append({"role": "tool", "name": call.name or "invalid", "content": out})
        return StepResult(msgs, 0.0, False, {"tool_calls": len(calls),
                                              "tool_errors": sum(m["content"].startswith("Error:") for m in msgs)})
