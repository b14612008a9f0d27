"""Rule-based scorers: ``score(solution_str, ground_truth, extra_info=None) -> float | dict``.

Every scorer is a pure function of the response text (the generated part only, not the prompt) and
the row's ``reward_model.ground_truth``. A dict result always carries ``score`` (the reward) and
``acc`` (1.0 correct / 0.0 not, what validation reports) plus diagnostics such as ``pred``.
``SCORERS`` maps verl's ``data_source`` names to scorers; :func:`compute_score` is the dispatch that
the reward manager calls (verl's ``default_compute_score`` signature).

Scorers and their semantics
---------------------------
* ``math_score`` (MATH, MATH-500, numina): the final answer is found and compared by the
  ``math-verify`` library (Hugging Face): the last ``\\boxed{}`` first, then "final answer is ...",
  then a bare expression; equivalence is symbolic/numeric (``0.5 == \\frac{1}{2}``, ``x=5 == 5``,
  intervals, sets, percentages). 1.0 / 0.0. Without math-verify installed it falls back to comparing
  the last ``\\boxed{}`` after light LaTeX normalisation (named in ``extra``: ``verifier``).
* ``math_dapo_score`` (DAPO-Math-17k, ``math_dapo``): DAPO's prompt asks for a last line
  ``Answer: X``; that is extracted (falling back to ``\\boxed{}``) and compared with math-verify. The
  reward is +1 / -1 as in the DAPO recipe (``acc`` is 1 / 0).
* ``gsm8k_score`` (``openai/gsm8k``): verl's semantics. ``strict`` takes the last ``#### <number>``,
  ``flexible`` the last number anywhere; both look only at the last 300 characters, drop ``,`` and
  ``$``; correct -> ``score`` (1.0), found but wrong -> ``format_score`` (0.0), none -> 0.
  Deviation: the comparison is numeric (``18.0`` == ``18``, and ``18.`` == ``18``, which verl's string
  equality scores as wrong).
* ``countdown_score`` (``countdown``, TinyZero): the last ``<answer>...</answer>`` must hold an
  arithmetic expression over the given ``numbers`` (each used at most once; ``use_all=True`` requires
  all) with ``+ - * /`` and parentheses that equals ``target`` exactly (rational arithmetic). The
  expression is parsed with ``ast`` and evaluated by a walker that accepts only integer literals and
  those operators: no ``eval``, no names, no calls, no powers. Correct 1.0; an answer that is present
  but wrong or invalid gets ``format_score`` 0.1 (TinyZero's shaping); no answer 0.
* ``arith_score`` (``coxswain/arith``, the shipped synthetic task, ``trainer.data.synthetic``): the
  prompt ends in ``=`` and the answer is the integer that starts the response (leading spaces
  allowed, anything after it ignored, so the tiny model need not learn to stop). 1.0 / 0.0.
* ``code_score`` (codecontests, apps, taco, mbpp, humaneval, ...): the last fenced code block (or the
  whole response) runs in ``trainer.rewards.sandbox`` against the tests: ``{"inputs", "outputs"}``
  stdin/stdout cases, ``{"fn_name", "inputs", "outputs"}`` call cases, or assert snippets
  (``test_list`` / ``tests`` / ``test`` + ``entry_point`` / a plain string). 1.0 only when every test
  passes; ``pass_rate``, ``status`` and ``reason`` (e.g. ``blocked``, ``cpu_limit``) are reported.
"""

from __future__ import annotations

import ast
import json
import re
import threading
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, Callable

# ----------------------------------------------------------------------------------------------
# shared extraction helpers
# ----------------------------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None.
    ``\\boxed 5`` (no braces) gives ``5``."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx + (6 if text.startswith("\\boxed", idx) else 5) :]
    if rest.startswith(" "):  # "\boxed 5": the argument is the next token
        tok = rest.split()[0].split("$")[0] if rest.split() else ""
        return tok or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for j, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:j]
    return None  # unbalanced


def _in_main_thread() -> bool:
    # math-verify's timeouts use signal.alarm, which only works in the main thread.
    return threading.current_thread() is threading.main_thread()


def _math_verify_equal(gold: str, pred_text: str, timeout_s: int = 5) -> tuple[bool, str] | None:
    """(equal, extracted prediction) using math-verify, or None when the library is missing."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    t = timeout_s if _in_main_thread() else None
    gold_text = gold if ("$" in gold or "\\boxed" in gold) else f"${gold}$"
    g = parse(gold_text, parsing_timeout=t)
    p = parse(pred_text, parsing_timeout=t)
    if not g or not p:
        return False, (p[-1] if p else "")
    return bool(verify(g, p, timeout_seconds=t)), str(p[-1])


_LATEX_NOISE = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\ |\$|\s+|\\text\{\s*\}|\^\{?\\circ\}?|\\%|%")


def _normalize_latex(s: str) -> str:
    """Light normalisation for the no-math-verify fallback only."""
    s = s.strip().rstrip(".")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    m = re.fullmatch(r"\\text\{(.*)\}", s)
    if m:
        s = m.group(1)
    return _LATEX_NOISE.sub("", s)


def _as_text(ground_truth: Any) -> str:
    if isinstance(ground_truth, (list, tuple)) and ground_truth:
        ground_truth = ground_truth[0]
    return str(ground_truth).strip()


# ----------------------------------------------------------------------------------------------
# math
# ----------------------------------------------------------------------------------------------
def math_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None, clip_chars: int = 4096) -> dict:
    """MATH-style answers compared with math-verify. See the module docstring."""
    text = solution_str[-clip_chars:] if len(solution_str) > clip_chars else solution_str
    gold = _as_text(ground_truth)
    res = _math_verify_equal(gold, text)
    if res is None:  # fallback: the last \boxed{} after light normalisation
        pred = last_boxed(text)
        ok = pred is not None and _normalize_latex(pred) == _normalize_latex(last_boxed(gold) or gold)
        return {"score": float(ok), "acc": float(ok), "pred": pred or "", "verifier": "string"}
    ok, pred = res
    return {"score": float(ok), "acc": float(ok), "pred": pred, "verifier": "math_verify"}


_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")


def math_dapo_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """DAPO-style: the last ``Answer: X`` line (else the last ``\\boxed{}``); reward +1 / -1."""
    tail = solution_str[-1000:]
    found = _ANSWER_LINE.findall(tail)
    pred = found[-1].strip() if found else last_boxed(tail)
    gold = _as_text(ground_truth)
    ok = False
    if pred:
        pred = pred.strip().rstrip(".").strip()
        res = _math_verify_equal(gold, pred if ("$" in pred or "\\boxed" in pred) else f"${pred}$")
        if res is None:
            ok = _normalize_latex(pred) == _normalize_latex(gold)
        else:
            ok = res[0]
    return {"score": 1.0 if ok else -1.0, "acc": float(ok), "pred": pred or ""}


# ----------------------------------------------------------------------------------------------
# GSM8K
# ----------------------------------------------------------------------------------------------
_GSM8K_CLIP = 300  # verl looks only at the tail: the answer is at the end, and regexes stay fast
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def gsm8k_extract(solution_str: str, method: str = "strict") -> str | None:
    """The answer string: last ``#### N`` (strict) or last number (flexible), commas and $ removed."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    s = solution_str[-_GSM8K_CLIP:]
    if method == "strict":
        found = _STRICT.findall(s)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for cand in reversed(_NUMBER.findall(s)):
        if cand not in ("", "."):
            return cand.replace(",", "").replace("$", "")
    return None


def _num(s: str) -> Decimal | None:
    try:
        return Decimal(s.replace(",", "").replace("$", "").strip().rstrip("."))
    except (InvalidOperation, ValueError):
        return None


def gsm8k_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict:
    """verl's GSM8K rule with numeric equality. See the module docstring."""
    pred = gsm8k_extract(solution_str, method)
    if pred is None:
        return {"score": 0.0, "acc": 0.0, "pred": ""}
    gold = _as_text(ground_truth)
    a, b = _num(pred), _num(gold)
    ok = (a == b) if (a is not None and b is not None) else (pred == gold.replace(",", ""))
    return {"score": score if ok else format_score, "acc": float(ok), "pred": pred}


# ----------------------------------------------------------------------------------------------
# countdown
# ----------------------------------------------------------------------------------------------
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_MAX_EXPR_CHARS = 256  # a countdown equation is short; bounds parse depth and work


class _Unsafe(ValueError):
    pass


def safe_arith_eval(expr: str) -> tuple[Fraction, list[int]]:
    """Evaluate ``+ - * /`` over integer literals exactly; returns (value, literals used).

    Raises ``ValueError`` on anything else (names, calls, attributes, powers, floats, strings, ...) and
    on division by zero. Nothing is passed to ``eval``: the ``ast`` is walked node by node."""
    if len(expr) > _MAX_EXPR_CHARS:
        raise _Unsafe("expression too long")
    tree = ast.parse(expr.strip(), mode="eval")
    used: list[int] = []

    def ev(node) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if b == 0:
                raise _Unsafe("division by zero")
            return a / b
        raise _Unsafe(f"not allowed in a countdown equation: {type(node).__name__}")

    return ev(tree), used


def countdown_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    format_score: float = 0.1,
    score: float = 1.0,
    use_all: bool = False,
) -> dict:
    """TinyZero's countdown rule with a safe evaluator. See the module docstring."""
    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    target = Fraction(int(gt["target"]))
    numbers = [int(x) for x in gt["numbers"]]
    found = _ANSWER_TAG.findall(solution_str)
    if not found:
        return {"score": 0.0, "acc": 0.0, "pred": ""}
    eq = found[-1].strip()
    eq = eq.split("=")[0].strip() if eq.count("=") == 1 else eq  # "(1+2)*3 = 9" -> the left side
    try:
        value, used = safe_arith_eval(eq)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return {"score": format_score, "acc": 0.0, "pred": eq[:100]}
    pool = list(numbers)
    for u in used:  # each given number at most once
        if abs(u) in pool:
            pool.remove(abs(u))
        else:
            return {"score": format_score, "acc": 0.0, "pred": eq[:100]}
    if use_all and pool:
        return {"score": format_score, "acc": 0.0, "pred": eq[:100]}
    ok = value == target
    return {"score": score if ok else format_score, "acc": float(ok), "pred": eq[:100]}


# ----------------------------------------------------------------------------------------------
# the shipped synthetic task
# ----------------------------------------------------------------------------------------------
_LEADING_INT = re.compile(r"\s*(-?\d+)")


def arith_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """``12+34=`` -> the response must start with ``46``. See the module docstring."""
    m = _LEADING_INT.match(solution_str)
    pred = m.group(1) if m else ""
    ok = bool(m) and int(pred) == int(_as_text(ground_truth))
    return {"score": float(ok), "acc": float(ok), "pred": pred}


# ----------------------------------------------------------------------------------------------
# code
# ----------------------------------------------------------------------------------------------
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)


def extract_code(solution_str: str) -> str:
    """The last ```python fenced block, else the last fenced block, else the whole response."""
    blocks = _FENCE.findall(solution_str)
    py = [b for lang, b in blocks if lang.lower() in ("python", "py", "python3")]
    if py:
        return py[-1]
    if blocks:
        return blocks[-1][1]
    return solution_str


def code_tests_from_ground_truth(ground_truth: Any, extra_info: dict | None = None) -> dict:
    """Normalise the common code-test formats to ``run_code`` keyword arguments."""
    gt = ground_truth
    if isinstance(gt, (bytes, bytearray)):
        gt = gt.decode()
    if isinstance(gt, str):
        s = gt.strip()
        if s[:1] in "{[":
            try:
                gt = json.loads(s)
            except ValueError:
                gt = s
    if isinstance(gt, dict):
        if "inputs" in gt and "outputs" in gt:
            if gt.get("fn_name"):
                return {"mode": "call", "fn_name": gt["fn_name"], "inputs": list(gt["inputs"]), "outputs": list(gt["outputs"])}
            return {"mode": "io", "inputs": [str(x) for x in gt["inputs"]], "outputs": list(gt["outputs"])}
        setup = gt.get("test_setup_code") or gt.get("setup") or ""
        if "test_list" in gt or "tests" in gt:
            tests = gt.get("test_list") or gt.get("tests")
            tests = [tests] if isinstance(tests, str) else list(tests)
            return {"mode": "assert", "tests": tests, "setup": setup}
        if "test" in gt:
            entry = gt.get("entry_point") or (extra_info or {}).get("entry_point")
            test = gt["test"] + (f"\ncheck({entry})\n" if entry else "")
            return {"mode": "assert", "tests": [test], "setup": setup}
        raise ValueError(f"unrecognised code ground_truth keys {sorted(gt)}; expected inputs/outputs[/fn_name], test_list, tests or test")
    if isinstance(gt, (list, tuple)):
        return {"mode": "assert", "tests": [str(t) for t in gt]}
    entry = (extra_info or {}).get("entry_point")
    return {"mode": "assert", "tests": [str(gt) + (f"\ncheck({entry})\n" if entry and "def check" in str(gt) else "")]}


def code_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    cpu_s: int = 4,
    wall_s: float = 8.0,
    mem_mb: int = 1024,
    sandbox_fusion_url: str | None = None,
    memory_limit_mb: int | None = None,
    max_concurrent: int = 64,
) -> dict:
    """Run the extracted code against the tests: in the local sandbox, or in a SandboxFusion service
    when ``sandbox_fusion_url`` is set (verl's ``reward_model.sandbox_fusion.url``). Keep ``wall_s``
    below the reward manager's per-sample timeout so the sandbox, not the manager, reports a slow
    candidate. A host that cannot contain code raises ``SandboxUnavailable`` (counted as an error)."""
    from trainer.rewards.sandbox import SandboxLimits, run_code

    over = (extra_info or {}).get("sandbox") or {}
    lim = SandboxLimits(
        cpu_s=int(over.get("cpu_s", cpu_s)), wall_s=float(over.get("wall_s", wall_s)),
        mem_mb=int(over.get("mem_mb", memory_limit_mb or mem_mb)),
    )
    kw = code_tests_from_ground_truth(ground_truth, extra_info)
    if sandbox_fusion_url:
        from trainer.rewards.sandbox_fusion import run_remote

        r = run_remote(sandbox_fusion_url, extract_code(solution_str), limits=lim, memory_limit_mb=lim.mem_mb,
                       max_concurrent=max_concurrent, **kw)
    else:
        r = run_code(extract_code(solution_str), limits=lim, **kw)
    ok = r.status == "passed"
    return {"score": float(ok), "acc": float(ok), "pass_rate": r.pass_rate, "status": r.status, "reason": r.reason[:300]}


# ----------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------
_CODE_SOURCES = (
    "codecontests", "apps", "codeforces", "taco", "likaixin/TACO-verified", "primeintellect",
    "livecodebench", "mbpp", "openai_humaneval", "humaneval", "coxswain/code",
)

SCORERS: dict[str, Callable] = {
    "openai/gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "math": math_score,
    "math_dapo": math_dapo_score,
    "math_dapo_reasoning": math_dapo_score,
    "BytedTsinghua-SIA/DAPO-Math-17k": math_dapo_score,
    "BytedTsinghua-SIA/AIME-2024": math_dapo_score,
    "countdown": countdown_score,
    "coxswain/arith": arith_score,
    **{name: code_score for name in _CODE_SOURCES},
}
_PREFIXES: tuple[tuple[str, Callable], ...] = (("numina_", math_score), ("aime", math_dapo_score))


def unknown_sources_message(sources) -> str:
    """One line for data sources with no scorer: the known names and the two ways out."""
    names = sorted(SCORERS) + [p + "*" for p, _ in _PREFIXES]
    shown = ", ".join(repr(str(s)[:60]) for s in sorted(sources)[:5]) + (", ..." if len(sources) > 5 else "")
    return (f"data_source {shown} has no scorer (known: {', '.join(names)}). Fix: write the rows' data_source as "
            f"one of those, or register your own scorer with custom_reward_function.path=FILE.py (and .name, default "
            f"compute_score): a function compute_score(data_source, solution_str, ground_truth, extra_info) that may "
            f"call trainer.rewards.scorers.compute_score for the built-in sources.")


def has_scorer(data_source: str) -> bool:
    return data_source in SCORERS or any(str(data_source).startswith(p) for p, _ in _PREFIXES)


def get_scorer(data_source: str) -> Callable:
    """The scorer for a ``data_source``: exact name, then known prefixes. Any other source raises
    NotImplementedError, as verl's ``default_compute_score`` does: scoring it with some default scorer
    would train on rewards that mean nothing for the task."""
    if data_source in SCORERS:
        return SCORERS[data_source]
    for prefix, fn in _PREFIXES:
        if str(data_source).startswith(prefix):
            return fn
    raise NotImplementedError(unknown_sources_message([data_source]))


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  sandbox_fusion_url: str | None = None, memory_limit_mb: int | None = None,
                  max_concurrent: int = 64, **_):
    """verl's ``default_compute_score`` signature: route to the scorer for ``data_source``. The
    sandbox keywords (bound by the reward manager from ``reward_model.sandbox_fusion``) reach the
    code scorer only."""
    fn = get_scorer(data_source)
    if fn is code_score:
        return fn(solution_str, ground_truth, extra_info, sandbox_fusion_url=sandbox_fusion_url,
                  memory_limit_mb=memory_limit_mb, max_concurrent=max_concurrent)
    return fn(solution_str, ground_truth, extra_info)
