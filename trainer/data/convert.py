"""Convert GSM8K- and MATH-style files you already have on disk to verl's row format.

    python -m trainer.data.convert gsm8k train.jsonl gsm8k_train.parquet
    python -m trainer.data.convert math  test.jsonl  math_test.parquet --split test

Nothing is downloaded. Input: ``.jsonl``, ``.json`` (a list) or ``.parquet``; output: ``.parquet`` or
``.jsonl``, chosen by the extension.

* ``gsm8k`` rows have ``question`` and ``answer``; the ground truth is the text after the last
  ``####`` in ``answer`` with thousands separators removed (``"... #### 1,234"`` -> ``"1234"``). The
  prompt asks for the same ``#### <answer>`` ending, which ``gsm8k_score`` (strict) looks for.
  Data source ``openai/gsm8k``.
* ``math`` rows have ``problem`` and either ``answer`` (MATH-500 style) or ``solution`` (the original
  MATH style; the ground truth is its last ``\\boxed{}``). The prompt asks for a ``\\boxed{}`` answer.
  Data source ``DigitalLearningGmbH/MATH-lighteval``; ``level`` / ``type`` / ``subject`` go to
  ``extra_info``.

A row that cannot be converted (a missing field, no ``####``, no ``\\boxed{}``) is reported with its
row number; ``--on-bad-row skip`` skips and counts such rows, ``error`` (the default) stops.
"""

from __future__ import annotations

import argparse
import json
import sys

from trainer.data.dataset import BadRowError, _Fault, iter_raw_rows
from trainer.rewards.scorers import last_boxed

GSM8K_INSTRUCTION = 'Solve the problem step by step. End with a line of the form "#### <answer>", the final number only.'
MATH_INSTRUCTION = "Solve the problem step by step, and write the final answer inside \\boxed{}."


def gsm8k_row(raw: dict, index: int, split: str, instruction: str = GSM8K_INSTRUCTION) -> dict:
    q, a = raw.get("question"), raw.get("answer")
    if not isinstance(q, str) or not q.strip():
        raise _Fault("missing or empty 'question'", "GSM8K rows need 'question' and 'answer' strings")
    if not isinstance(a, str) or "####" not in a:
        raise _Fault("'answer' has no '#### <number>' ending", "GSM8K answers end with '#### <final answer>'")
    gt = a.rsplit("####", 1)[1].strip().replace(",", "")
    if not gt:
        raise _Fault("nothing after '####' in 'answer'", "GSM8K answers end with '#### <final answer>'")
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{q.strip()} {instruction}".strip()}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"split": split, "index": index, "question": q, "answer": a},
    }


def math_row(raw: dict, index: int, split: str, instruction: str = MATH_INSTRUCTION, data_source: str | None = None) -> dict:
    p = raw.get("problem")
    if not isinstance(p, str) or not p.strip():
        raise _Fault("missing or empty 'problem'", "MATH rows need 'problem' and 'answer' or 'solution'")
    gt = raw.get("answer")
    if gt is None or (isinstance(gt, str) and not gt.strip()):
        sol = raw.get("solution")
        if not isinstance(sol, str):
            raise _Fault("neither 'answer' nor 'solution' is present", "MATH rows need 'answer' or a 'solution' with \\boxed{}")
        gt = last_boxed(sol)
        if not gt:
            raise _Fault("'solution' has no \\boxed{...} answer", "give an 'answer' field or box the answer in 'solution'")
    extra = {"split": split, "index": index}
    for k in ("level", "type", "subject", "unique_id"):
        if k in raw:
            extra[k] = raw[k]
    return {
        "data_source": data_source or "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [{"role": "user", "content": f"{p.strip()} {instruction}".strip()}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(gt).strip()},
        "extra_info": extra,
    }


CONVERTERS = {"gsm8k": gsm8k_row, "math": math_row}


def convert(kind: str, src: str, dst: str, split: str = "train", on_bad_row: str = "error", **kw) -> dict:
    """Convert ``src`` to ``dst``; returns ``{"rows": written, "bad_rows": skipped}``."""
    if kind not in CONVERTERS:
        raise ValueError(f"unknown converter {kind!r}; choose from {sorted(CONVERTERS)}")
    if not dst.endswith((".parquet", ".jsonl")):
        raise ValueError(f"output {dst!r} must end in .parquet or .jsonl")
    fn = CONVERTERS[kind]
    out, bad = [], 0
    for where, raw in iter_raw_rows(src):
        try:
            if isinstance(raw, _Fault):
                raise raw
            if not isinstance(raw, dict):
                raise _Fault(f"the row is a {type(raw).__name__}, not an object")
            out.append(fn(raw, len(out), split, **kw))
        except _Fault as f:
            if on_bad_row == "error":
                raise BadRowError(f"{src}: {where}: {f.fault}. Fix: {f.fix}. Or pass --on-bad-row skip.") from None
            bad += 1
            print(f"skipping {src}: {where}: {f.fault}", file=sys.stderr)
    if not out:
        raise BadRowError(f"{src}: no row could be converted ({bad} bad)")
    if dst.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(out), dst)
    else:
        with open(dst, "w", encoding="utf-8") as f:
            for r in out:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return {"rows": len(out), "bad_rows": bad}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.data.convert", description="Convert local GSM8K / MATH files to verl rows.")
    ap.add_argument("kind", choices=sorted(CONVERTERS))
    ap.add_argument("src", help="input .jsonl / .json / .parquet")
    ap.add_argument("dst", help="output .parquet / .jsonl")
    ap.add_argument("--split", default="train", help="stored in extra_info.split")
    ap.add_argument("--instruction", default=None, help="text appended to each question")
    ap.add_argument("--data-source", default=None, help="math only: override the data_source name")
    ap.add_argument("--on-bad-row", choices=("error", "skip"), default="error")
    a = ap.parse_args(argv)
    kw = {}
    if a.instruction is not None:
        kw["instruction"] = a.instruction
    if a.data_source and a.kind == "math":
        kw["data_source"] = a.data_source
    try:
        stats = convert(a.kind, a.src, a.dst, a.split, a.on_bad_row, **kw)
    except (BadRowError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {stats['rows']} rows to {a.dst}" + (f" (skipped {stats['bad_rows']} bad rows)" if stats["bad_rows"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
