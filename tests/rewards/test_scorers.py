"""Golden tests for the built-in scorers and the data_source dispatch."""

import os
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.rewards import scorers as S


# ---------------------------------------------------------------------------------------------
# math (math-verify)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "response,gold,ok",
    [
        ("so the answer is \\boxed{0.5}", "\\frac{1}{2}", True),  # 0.5 == 1/2 numerically
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12", True),  # \dfrac and \frac12 shorthand
        ("The final answer is 5.", "5", True),  # no box: "final answer is"
        ("\\boxed{1+x^2}", "x^2+1", True),  # symbolic equality, not string
        ("\\boxed{x=5}", "5", True),  # an equation's right-hand side
        ("first \\boxed{3} then corrected: \\boxed{4}", "4", True),  # the LAST box counts
        ("first \\boxed{4} then corrected: \\boxed{3}", "4", False),
        ("\\boxed{\\sqrt{2}}", "\\sqrt 2", True),
        ("\\boxed{(1, 2)}", "(1,2)", True),
        ("\\boxed{3}", "4", False),
        ("I do not know", "4", False),
    ],
)
def test_math_score(response, gold, ok):
    r = S.math_score(response, gold)
    assert r["score"] == float(ok) and r["acc"] == float(ok) and r["verifier"] == "math_verify"


def test_math_score_fallback_without_math_verify(monkeypatch):
    monkeypatch.setattr(S, "_math_verify_equal", lambda *a, **k: None)
    r = S.math_score("so \\boxed{\\dfrac{1}{2}}.", "\\frac{1}{2}")
    assert r == {"score": 1.0, "acc": 1.0, "pred": "\\dfrac{1}{2}", "verifier": "string"}
    assert S.math_score("so \\boxed{0.5}", "\\frac{1}{2}")["score"] == 0.0  # strings only: no numerics


def test_last_boxed():
    assert S.last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"  # nested braces kept
    assert S.last_boxed("\\boxed 7$") == "7"
    assert S.last_boxed("\\fbox{y}") == "y"
    assert S.last_boxed("\\boxed{unbalanced") is None
    assert S.last_boxed("nothing") is None


def test_math_dapo_plus_minus_one():
    assert S.math_dapo_score("work...\nAnswer: 34", "34") == {"score": 1.0, "acc": 1.0, "pred": "34"}
    assert S.math_dapo_score("work...\nAnswer: 35", "34")["score"] == -1.0  # DAPO: wrong is -1, not 0
    assert S.math_dapo_score("no answer line", "34")["score"] == -1.0
    assert S.math_dapo_score("so \\boxed{\\frac{3}{4}}", "0.75")["acc"] == 1.0  # falls back to the box


# ---------------------------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------------------------
def test_gsm8k_strict_and_flexible_extraction():
    assert S.gsm8k_extract("so #### 12 and later #### 1,234", "strict") == "1234"  # last marker, comma dropped
    assert S.gsm8k_extract("the answer is 42", "strict") is None  # strict needs "#### "
    assert S.gsm8k_extract("the answer is 42.", "flexible") == "42."
    assert S.gsm8k_extract("3 apples and -5 pears.", "flexible") == "-5"
    assert S.gsm8k_extract("no digits . here", "flexible") is None  # a lone "." is not a number
    # only the last 300 characters are read: a marker further back is not seen
    assert S.gsm8k_extract("#### 7" + "x" * 300, "strict") is None
    assert S.gsm8k_extract("#### 7" + "x" * 294, "strict") == "7"


def test_gsm8k_score():
    assert S.gsm8k_score("... #### 72", "72")["score"] == 1.0
    assert S.gsm8k_score("... #### 72.0", "72")["score"] == 1.0  # numeric equality (a named deviation)
    assert S.gsm8k_score("... #### 71", "72") == {"score": 0.0, "acc": 0.0, "pred": "71"}
    assert S.gsm8k_score("... #### 71", "72", format_score=0.1)["score"] == 0.1  # found but wrong
    assert S.gsm8k_score("no marker 72", "72", format_score=0.1)["score"] == 0.0  # not found
    assert S.gsm8k_score("it is 72.", "72", method="flexible")["score"] == 1.0
    with pytest.raises(ValueError):
        S.gsm8k_extract("x", "loose")


@settings(max_examples=60, deadline=None)
@given(n=st.integers(-10**7, 10**7))
def test_gsm8k_any_integer_with_thousands_separators(n):
    formatted = f"{n:,}"
    assert S.gsm8k_score(f"reasoning\n#### {formatted}", str(n))["score"] == 1.0
    assert S.gsm8k_score(f"reasoning\n#### {n + 1:,}", str(n))["score"] == 0.0


# ---------------------------------------------------------------------------------------------
# countdown
# ---------------------------------------------------------------------------------------------
GT = {"target": 24, "numbers": [4, 6, 1, 5]}


@pytest.mark.parametrize(
    "answer,score",
    [
        ("<answer>4 * 6</answer>", 1.0),  # 24 with two of the four numbers (each at most once)
        ("<answer>(5 + 1) * 4</answer>", 1.0),  # 6*4 = 24
        ("<answer>6 / (5 / 4 - 1)</answer>", 1.0),  # 5/4-1 = 1/4 exactly; 6/(1/4) = 24 (rational arithmetic)
        ("<answer>4 * 6 = 24</answer>", 1.0),  # a trailing "= target" is tolerated
        ("<answer>4 * 5</answer>", 0.1),  # 20: valid but wrong -> format score
        ("<answer>6 * 4 * 1 * 1</answer>", 0.1),  # 1 used twice
        ("<answer>24</answer>", 0.1),  # 24 is not one of the numbers
        ("<answer>6 ** 2 - 12</answer>", 0.1),  # powers are not allowed
        ("<answer>4 / (5 - 5)</answer>", 0.1),  # 5 twice, and a division by zero
        ("<answer>4.0 * 6</answer>", 0.1),  # floats are not allowed
        ("no tags 4*6", 0.0),  # no answer at all
        ("<answer>1</answer> then <answer>4*6</answer>", 1.0),  # the last answer counts
    ],
)
def test_countdown_golden(answer, score):
    assert S.countdown_score(answer, GT)["score"] == score


def test_countdown_use_all_and_json_ground_truth():
    assert S.countdown_score("<answer>4*6</answer>", GT, use_all=True)["score"] == 0.1  # 1 and 5 unused
    assert S.countdown_score("<answer>1*2*3*4</answer>", {"target": 24, "numbers": [1, 2, 3, 4]}, use_all=True)["score"] == 1.0
    assert S.countdown_score("<answer>(5-1)*6</answer>", '{"target": 24, "numbers": [4, 6, 1, 5]}')["score"] == 1.0


def test_countdown_never_evaluates_code(tmp_path):
    marker = tmp_path / "pwned"
    for payload in (
        f"__import__('os').system('touch {marker}')",
        f"open('{marker}', 'w')",
        "(lambda: 1)()",
        "[x for x in (1,)]",
        "().__class__.__bases__[0].__subclasses__()",
        "9" * 300,  # over the length cap
        "(" * 200 + "1" + ")" * 200,
    ):
        r = S.countdown_score(f"<answer>{payload}</answer>", GT)
        assert r["score"] == 0.1 and r["acc"] == 0.0
    assert not marker.exists()


@settings(max_examples=80, deadline=None)
@given(nums=st.lists(st.integers(1, 50), min_size=2, max_size=5), ops=st.lists(st.sampled_from("+-*/"), min_size=4, max_size=4))
def test_countdown_left_fold_matches_fraction_reference(nums, ops):
    """Build ((n0 op n1) op n2) ...; its exact value (Fraction, computed here) is the target."""
    expr, val = str(nums[0]), Fraction(nums[0])
    for n, op in zip(nums[1:], ops):
        if op == "/" and n == 0:
            continue
        val = {"+": val + n, "-": val - n, "*": val * n, "/": val / n}[op]
        expr = f"({expr} {op} {n})"
    if val.denominator != 1:
        return  # countdown targets are integers
    r = S.countdown_score(f"<answer>{expr}</answer>", {"target": int(val), "numbers": nums})
    assert r["score"] == 1.0


# ---------------------------------------------------------------------------------------------
# the synthetic task
# ---------------------------------------------------------------------------------------------
def test_arith_score():
    assert S.arith_score("46", "46")["score"] == 1.0
    assert S.arith_score("  46 is it", "46")["score"] == 1.0  # leading space and trailing text allowed
    assert S.arith_score("-12", "-12")["score"] == 1.0
    assert S.arith_score("460", "46")["score"] == 0.0  # the whole leading integer must match
    assert S.arith_score("4 6", "46")["score"] == 0.0
    assert S.arith_score("answer: 46", "46")["score"] == 0.0  # the integer must come first
    assert S.arith_score("", "46") == {"score": 0.0, "acc": 0.0, "pred": ""}


# ---------------------------------------------------------------------------------------------
# code
# ---------------------------------------------------------------------------------------------
def test_extract_code():
    assert S.extract_code("x\n```python\ndef f(): return 1\n```\nthen\n```py\ndef g(): return 2\n```") == "def g(): return 2\n"
    assert S.extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert S.extract_code("def f(): pass") == "def f(): pass"


def test_code_ground_truth_formats():
    io = S.code_tests_from_ground_truth('{"inputs": ["1\\n"], "outputs": ["2\\n"]}')
    assert io == {"mode": "io", "inputs": ["1\n"], "outputs": ["2\n"]}
    call = S.code_tests_from_ground_truth({"fn_name": "f", "inputs": [[1]], "outputs": [2]})
    assert call["mode"] == "call" and call["fn_name"] == "f"
    mbpp = S.code_tests_from_ground_truth({"test_list": ["assert f(1) == 2"], "test_setup_code": "import math"})
    assert mbpp == {"mode": "assert", "tests": ["assert f(1) == 2"], "setup": "import math"}
    he = S.code_tests_from_ground_truth({"test": "def check(c):\n    assert c(1) == 2", "entry_point": "f"})
    assert he["tests"][0].endswith("check(f)\n")
    with pytest.raises(ValueError, match="unrecognised"):
        S.code_tests_from_ground_truth({"foo": 1})


def test_code_score_passes_and_fails_in_sandbox():
    good = "Here:\n```python\ndef f(x):\n    return x * 2\n```"
    bad = "```python\ndef f(x):\n    return x + 2\n```"
    tests = {"test_list": ["assert f(1) == 2", "assert f(5) == 10"]}
    r = S.code_score(good, tests)
    assert r["score"] == 1.0 and r["pass_rate"] == 1.0 and r["status"] == "passed"
    r = S.code_score(bad, tests)
    # f(1) = 3 != 2 fails, f(5) = 7 != 10 fails
    assert r["score"] == 0.0 and r["pass_rate"] == 0.0 and r["status"] == "failed" and "AssertionError" in r["reason"]
    io = {"inputs": ["3\n", "10\n"], "outputs": ["9\n", "100\n"]}
    assert S.code_score("```python\nn = int(input())\nprint(n * n)\n```", io)["score"] == 1.0


# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------
def test_dispatch_names_prefixes_and_unknown():
    assert S.get_scorer("openai/gsm8k") is S.gsm8k_score
    for name in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval"):
        assert S.get_scorer(name) is S.math_score
    assert S.get_scorer("math_dapo") is S.math_dapo_score
    assert S.get_scorer("countdown") is S.countdown_score
    assert S.get_scorer("coxswain/arith") is S.arith_score
    for name in ("codecontests", "apps", "taco", "mbpp", "openai_humaneval"):
        assert S.get_scorer(name) is S.code_score
    assert S.get_scorer("numina_olympiads") is S.math_score
    with pytest.raises(NotImplementedError, match="'my/unknown-source' has no scorer"):  # as verl's default_compute_score
        S.get_scorer("my/unknown-source")
    # verl's keyword signature
    r = S.compute_score(data_source="openai/gsm8k", solution_str="#### 3", ground_truth="3", extra_info=None)
    assert r["score"] == 1.0
