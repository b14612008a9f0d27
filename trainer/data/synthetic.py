"""The shipped synthetic task: integer arithmetic prompts such as ``"37+58="`` or ``"6*14="``.

The answer is the integer that follows the prompt; ``trainer.rewards.scorers.arith_score`` scores it
(data source ``coxswain/arith``). Rows are in verl's format::

    {"data_source": "coxswain/arith",
     "prompt": [{"role": "user", "content": "37+58="}],
     "ability": "arithmetic",
     "reward_model": {"style": "rule", "ground_truth": "95"},
     "extra_info": {"split": "train", "index": 0, "a": 37, "b": 58, "op": "+"}}

Determinism and splits: a problem's split is a function of the problem text alone (a BLAKE2 hash
of ``"37+58"``; ``held_out_fraction`` of the hash space is held out), so the train and held-out sets
can never share a problem, whatever the seed or sizes. Within a split, problems are drawn from
``random.Random(seed)`` without replacement, so the same arguments give the same rows everywhere.

``python -m trainer.data.synthetic OUT_DIR --train 2048 --test 256`` writes ``train.parquet`` and
``test.parquet``; with ``data.train_files`` unset the trainer builds the same rows in memory.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random

DATA_SOURCE = "coxswain/arith"


def split_of(problem: str, held_out_fraction: float = 0.1) -> str:
    """``"train"`` or ``"test"`` for a problem text such as ``"37+58"`` (stable across runs)."""
    h = int.from_bytes(hashlib.blake2b(problem.encode(), digest_size=8).digest(), "big")
    return "test" if h / 2**64 < held_out_fraction else "train"


def _problem_space(ops, min_digits, max_digits) -> int:
    lo, hi = (10 ** (min_digits - 1) if min_digits > 1 else 0), 10**max_digits - 1
    return len(ops) * (hi - lo + 1) ** 2


def make_rows(
    n: int,
    split: str = "train",
    seed: int = 0,
    ops: tuple[str, ...] = ("+", "*"),
    min_digits: int = 1,
    max_digits: int = 2,
    held_out_fraction: float = 0.1,
) -> list[dict]:
    """``n`` distinct problems of ``split`` ("train" | "test"); operands have min..max digits."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    bad = [o for o in ops if o not in ("+", "-", "*")]
    if bad or not ops:
        raise ValueError(f"ops must be a non-empty subset of '+', '-', '*', got {ops!r}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    frac = held_out_fraction if split == "test" else 1 - held_out_fraction
    available = _problem_space(ops, min_digits, max_digits) * frac
    if n > 0.5 * available:  # drawing without replacement gets slow, and may be impossible
        raise ValueError(
            f"asked for {n} {split} problems but only about {int(available)} exist with ops={ops}, "
            f"digits {min_digits}..{max_digits}: raise max_digits or ask for fewer"
        )
    lo, hi = (10 ** (min_digits - 1) if min_digits > 1 else 0), 10**max_digits - 1
    # Each split draws from its own stream, so the test rows do not change when n_train does.
    rng = random.Random(f"{seed}:{split}")
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < n:
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(ops)
        problem = f"{a}{op}{b}"
        if problem in seen or split_of(problem, held_out_fraction) != split:
            continue
        seen.add(problem)
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": problem + "="}],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": len(rows), "a": a, "b": b, "op": op},
            }
        )
    return rows


def write(out_dir: str, n_train: int = 2048, n_test: int = 256, seed: int = 0, **kw) -> tuple[str, str]:
    """Write ``train.parquet`` and ``test.parquet`` under ``out_dir``; returns both paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("test", n_test)):
        path = os.path.join(out_dir, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(make_rows(n, split, seed, **kw)), path)
        paths.append(path)
    return paths[0], paths[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, default=2048, help="training problems")
    ap.add_argument("--test", type=int, default=256, help="held-out problems")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ops", default="+*", help="operators to use, e.g. '+' or '+*'")
    ap.add_argument("--min-digits", type=int, default=1)
    ap.add_argument("--max-digits", type=int, default=2)
    a = ap.parse_args(argv)
    tr, te = write(a.out_dir, a.train, a.test, a.seed, ops=tuple(a.ops), min_digits=a.min_digits, max_digits=a.max_digits)
    print(f"wrote {tr} ({a.train} rows) and {te} ({a.test} rows)")


if __name__ == "__main__":
    main()
