"""Calculator environment: the evaluator against an independent Fraction reference, its safety
(no eval; anything but integers, + - * / and parentheses is an error observation), tool-call parsing
errors as observations, and the final-answer reward."""

from __future__ import annotations

import ast
import builtins
from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from trainer.envs import ENVIRONMENTS, env_factory, task_maker
from trainer.envs.base import parse_tool_calls
from trainer.envs.calculator import CalcError, CalculatorEnv, calculator, evaluate, format_value, make_tasks, parse_answer


def ast_reference(expr: str) -> Fraction:
    """Reference value: Python's own parser (ast, no evaluation) walked with exact Fractions."""
    def walk(n):
        if isinstance(n, ast.Expression):
            return walk(n.body)
        if isinstance(n, ast.Constant) and type(n.value) is int:
            return Fraction(n.value)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            v = walk(n.operand)
            return -v if isinstance(n.op, ast.USub) else v
        if isinstance(n, ast.BinOp):
            a, b = walk(n.left), walk(n.right)
            return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}[type(n.op)] if not isinstance(n.op, ast.Div) else a / b
        raise TypeError(type(n).__name__)
    return walk(ast.parse(expr.strip(), mode="eval"))  # Python reads leading spaces as an indent


@st.composite
def expressions(draw, depth=0):
    """Random expression strings: integers, unary signs, + - * /, parentheses, random spaces."""
    kind = draw(st.sampled_from(["int", "int", "bin", "bin", "neg", "paren"] if depth < 4 else ["int"]))
    sp = draw(st.sampled_from(["", " ", "  "]))
    if kind == "int":
        return str(draw(st.integers(0, 10**6)))
    if kind == "neg":
        return draw(st.sampled_from(["-", "+"])) + sp + draw(expressions(depth + 1))
    if kind == "paren":
        return "(" + sp + draw(expressions(depth + 1)) + sp + ")"
    return draw(expressions(depth + 1)) + sp + draw(st.sampled_from("+-*/")) + sp + draw(expressions(depth + 1))


@settings(max_examples=400, deadline=None)
@given(st.tuples(st.sampled_from(["", " ", "\t"]), expressions(), st.sampled_from(["", " ", "\n"])).map("".join))
def test_evaluate_matches_fraction_reference(expr):
    try:
        want = ast_reference(expr)
    except ZeroDivisionError:
        with pytest.raises(CalcError, match="division by zero"):
            evaluate(expr)
        assert calculator(expr) == "Error: division by zero"
        return
    got = evaluate(expr)
    assert got == want
    assert calculator(expr) == format_value(want) and Fraction(calculator(expr)) == want


def test_golden_values():
    # 7 / 2 = 7/2; -(3 - 10) * 2 = 14; 1/3 + 1/6 = 1/2; 2 * -3 = -6 (unary minus binds tighter)
    assert [calculator(e) for e in ("7 / 2", "-(3 - 10) * 2", "1/3 + 1/6", "2 * -3", " 42 ")] == ["7/2", "14", "1/2", "-6", "42"]


@pytest.mark.parametrize("expr", [
    "__import__('os')", "__import__('os').system('echo hi')", "2**10", "1.5 + 1", "a + 1", "().__class__",
    "open('/etc/passwd')", "1 +", "(1 + 2", "1 + 2)", "", "   ", "3 // 2", "1e3", "[1]", "lambda: 1", "2 % 3",
    "9" * 65, "(" * 40 + "1" + ")" * 40, "1+" * 200 + "1", "99999999999999999 * " * 5 + "9",
])
def test_anything_else_is_an_error_observation(expr, monkeypatch):
    # eval/exec are never reached: make them fail loudly while the calculator runs
    def boom(*a, **k):
        raise AssertionError("eval/exec called")
    monkeypatch.setattr(builtins, "eval", boom)
    monkeypatch.setattr(builtins, "exec", boom)
    with pytest.raises(CalcError):
        evaluate(expr)
    assert calculator(expr).startswith("Error: ")
    env = CalculatorEnv()
    env.reset(make_tasks(1, seed=0)[0])
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": %s}}</tool_call>' % __import__("json").dumps(expr)
    r = env.step(call)
    assert not r.done and r.reward == 0.0 and len(r.observation) == 1
    assert r.observation[0]["role"] == "tool" and r.observation[0]["content"].startswith("Error: ")


def test_evaluate_rejects_non_strings():
    with pytest.raises(CalcError):
        evaluate(12)


@pytest.mark.parametrize("text,err", [
    ("<tool_call>not json</tool_call>", "not valid JSON"),
    ('<tool_call>["calculator"]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'"),
    ('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>', "missing required argument(s): expression"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1", "x": 2}}</tool_call>', "unknown argument(s): x"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": 12}}</tool_call>', "must be of type string"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "'arguments' must be a JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+', "never closed"),
])
def test_malformed_calls_give_error_observations(text, err):
    env = CalculatorEnv()
    env.reset(make_tasks(1, seed=0)[0])
    r = env.step(text)
    assert not r.done and r.reward == 0.0
    assert [m["role"] for m in r.observation] == ["tool"]
    assert r.observation[0]["content"].startswith("Error: ") and err in r.observation[0]["content"]


def test_several_calls_answered_in_order_and_capped():
    env = CalculatorEnv()
    env.reset(make_tasks(1, seed=0)[0])
    calls = "".join('<tool_call>{"name": "calculator", "arguments": {"expression": "%d*2"}}</tool_call>' % k for k in range(10))
    r = env.step("thinking... " + calls)
    outs = [m["content"] for m in r.observation]
    assert outs[:8] == [str(2 * k) for k in range(8)]  # max_calls_per_turn = 8
    assert all(o.startswith("Error: at most 8") for o in outs[8:]) and len(outs) == 10
    # arguments given as a JSON string (some models do this) are accepted
    assert parse_tool_calls('<tool_call>{"name": "c", "arguments": "{\\"a\\": 1}"}</tool_call>')[0].arguments == {"a": 1}


def test_final_answer_reward():
    row = {"reward_model": {"ground_truth": "39/2"}, "extra_info": {"expression": "(17 - 4) * 6 / 4"}}
    assert evaluate(row["extra_info"]["expression"]) == Fraction(39, 2)
    for text, ok in [("<answer>39/2</answer>", True), ("so it is 19.5", True), ("<answer> 78/4 </answer>", True),
                     ("<answer>19</answer> or 39/2", False), ("<answer>-39/2</answer>", False), ("no idea", False),
                     ("<answer>1/0</answer>", False)]:
        env = CalculatorEnv()
        msgs = env.reset(row)
        assert msgs[-1]["content"] == "Compute (17 - 4) * 6 / 4."
        r = env.step(text)
        assert r.done and r.observation is None and r.reward == (1.0 if ok else 0.0) and r.info["success"] is ok
    assert parse_answer("x") is None and parse_answer("-3") == -3


def test_make_tasks_seeded_and_correct():
    a, b, c = make_tasks(20, seed=1), make_tasks(20, seed=1), make_tasks(20, seed=2)
    assert a == b and a != c
    for row in a:
        assert Fraction(row["reward_model"]["ground_truth"]) == ast_reference(row["extra_info"]["expression"])
        assert row["data_source"] == "coxswain/calculator" and row["prompt"][-1]["role"] == "user"
    assert ENVIRONMENTS["calculator"] is CalculatorEnv and env_factory("calculator") is CalculatorEnv
    assert env_factory("trainer.envs.calculator:CalculatorEnv") is CalculatorEnv
    assert task_maker("calculator") is make_tasks
    with pytest.raises(ValueError, match="Did you mean 'calculator'"):
        env_factory("calculater")
    assert CalculatorEnv().tools()[0]["function"]["name"] == "calculator"
