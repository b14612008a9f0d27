"""Arithmetic with a calculator tool: the policy may call ``calculator`` and then states the answer.

Task: an expression over integers with ``+ - * /`` and parentheses, e.g. ``(17 - 4) * 6 / 4``; its
exact value is a rational number (``ground_truth`` is ``"39/2"`` or ``"-7"``). The policy calls

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "(17 - 4) * 6 / 4"}}
    </tool_call>

(any number of times, over any number of turns) and ends with a message without tool calls that holds
``<answer>39/2</answer>`` (or, failing a tag, ends its text with the number). Reward 1 when the stated
value equals the true value exactly (as fractions: ``19.5`` and ``39/2`` both count), else 0.

The calculator never calls ``eval``: :func:`evaluate` is a recursive-descent parser over the grammar

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := ("+" | "-") factor | INTEGER | "(" expr ")"

computing in exact ``fractions.Fraction``. Anything else (names, ``**``, attributes, floats) is a
syntax error, and size limits (expression length, nesting depth, digits of operands and of every
intermediate value) bound the work a sampled expression can cause.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction

from trainer.envs.base import StepResult, Tool, ToolEnvironment

DATA_SOURCE = "coxswain/calculator"
MAX_CHARS = 256  # longest expression the tool accepts
MAX_DEPTH = 32  # deepest nesting of parentheses / unary signs
MAX_DIGITS = 64  # longest integer literal, and digits of any intermediate numerator/denominator

SYSTEM_PROMPT = (
    "You can use a calculator. To call it, write\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2*3"}}\n</tool_call>\n'
    "The result comes back in a tool message. When you know the answer, reply without a tool call "
    "and put the exact value in <answer></answer>, e.g. <answer>-7/2</answer>."
)


class CalcError(ValueError):
    """The expression is not valid or too large."""


_TOKEN_RE = re.compile(r"\s*(?:(\d+)|(\S))")


def _tokenize(expr: str) -> list[str]:
    toks = []
    for m in _TOKEN_RE.finditer(expr):
        num, op = m.group(1), m.group(2)
        if num is not None:
            if len(num) > MAX_DIGITS:
                raise CalcError(f"integer with more than {MAX_DIGITS} digits")
            toks.append(num)
        elif op is not None:
            if op not in "+-*/()":
                raise CalcError(f"unexpected character {op!r}: only integers, + - * / and parentheses are allowed")
            toks.append(op)
    return toks


def _check_size(x: Fraction) -> Fraction:
    if len(str(abs(x.numerator))) > MAX_DIGITS or len(str(x.denominator)) > MAX_DIGITS:
        raise CalcError(f"a value has more than {MAX_DIGITS} digits")
    return x


def evaluate(expr: str) -> Fraction:
    """Exact value of an integer arithmetic expression; :class:`CalcError` on anything else."""
    if not isinstance(expr, str):
        raise CalcError("expression must be a string")
    if len(expr) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    toks = _tokenize(expr)
    if not toks:
        raise CalcError("empty expression")
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def take():
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def expr_(depth):
        x = term(depth)
        while peek() in ("+", "-"):
            op = take()
            y = term(depth)
            x = _check_size(x + y if op == "+" else x - y)
        return x

    def term(depth):
        x = factor(depth)
        while peek() in ("*", "/"):
            op = take()
            y = factor(depth)
            if op == "/" and y == 0:
                raise CalcError("division by zero")
            x = _check_size(x * y if op == "*" else x / y)
        return x

    def factor(depth):
        if depth > MAX_DEPTH:
            raise CalcError(f"nesting deeper than {MAX_DEPTH}")
        t = peek()
        if t is None:
            raise CalcError("expression ends too early")
        if t in ("+", "-"):
            take()
            x = factor(depth + 1)
            return x if t == "+" else -x
        if t == "(":
            take()
            x = expr_(depth + 1)
            if peek() != ")":
                raise CalcError("missing ')'")
            take()
            return x
        if t.isdigit():
            take()
            return Fraction(int(t))
        raise CalcError(f"unexpected {t!r}")

    value = expr_(0)
    if pos != len(toks):
        raise CalcError(f"unexpected {toks[pos]!r} after a complete expression")
    return value


def format_value(x: Fraction) -> str:
    """``"7"``, ``"-7/2"``: the exact value as the tool prints it."""
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def calculator(expression: str) -> str:
    try:
        return format_value(evaluate(expression))
    except CalcError as e:
        return f"Error: {e}"


CALCULATOR_TOOL = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression over integers with + - * / and parentheses, exactly.",
    parameters={"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. (3+4)*5/2"}},
                "required": ["expression"], "additionalProperties": False},
    fn=calculator,
)

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?(?:\s*/\s*-?\d+)?")


def parse_answer(text: str) -> Fraction | None:
    """The value in the last ``<answer>...</answer>``, else the last number of the text; None if none."""
    tags = _ANSWER_RE.findall(text)
    candidates = [tags[-1]] if tags else _NUMBER_RE.findall(text)[-1:]
    if not candidates:
        return None
    s = candidates[0].strip().replace(" ", "")
    if len(s) > 2 * MAX_DIGITS + 2:
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


class CalculatorEnv(ToolEnvironment):
    """One arithmetic task; see the module docstring."""

    def __init__(self):
        super().__init__([CALCULATOR_TOOL])
        self.truth: Fraction | None = None

    def reset(self, task: dict, seed: int | None = None) -> list[dict]:
        self.truth = Fraction(str(task["reward_model"]["ground_truth"]))
        if task.get("prompt"):
            return [dict(m) for m in task["prompt"]]
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"Compute {task['extra_info']['expression']}."}]

    def final_answer(self, text: str) -> StepResult:
        got = parse_answer(text)
        ok = got is not None and got == self.truth
        return StepResult(None, 1.0 if ok else 0.0, True, {"success": ok, "answer": None if got is None else format_value(got)})


def random_expression(rng: random.Random, num_ops: int, max_int: int) -> str:
    """A random expression with ``num_ops`` binary operators over integers in [0, max_int]."""
    if num_ops == 0:
        return str(rng.randint(0, max_int))
    left = rng.randint(0, num_ops - 1)
    a = random_expression(rng, left, max_int)
    b = random_expression(rng, num_ops - 1 - left, max_int)
    op = rng.choice("+-*/")
    a = f"({a})" if left and rng.random() < 0.7 else a
    b = f"({b})" if num_ops - 1 - left else b
    return f"{a} {op} {b}"


def make_tasks(num: int, seed: int = 0, *, min_ops: int = 1, max_ops: int = 3, max_int: int = 20,
               split: str = "train") -> list[dict]:
    """``num`` calculator tasks as dataset rows (verl's row format), from ``random.Random(seed)``."""
    rng = random.Random(f"calculator:{seed}:{split}")
    rows = []
    while len(rows) < num:
        expr = random_expression(rng, rng.randint(min_ops, max_ops), max_int)
        try:
            value = evaluate(expr)
        except CalcError:  # a division by zero: draw again
            continue
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"Compute {expr}."}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": format_value(value)},
            "extra_info": {"split": split, "index": len(rows), "expression": expr},
        })
    return rows
