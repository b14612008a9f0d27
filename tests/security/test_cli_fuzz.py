"""Fuzz the command line and the data loaders: random keys and values, malformed overrides, damaged
and hostile data files. Every run must end in one paragraph on stderr (no raw traceback), with a
non-zero exit code for everything that is not a valid configuration.

Bounded: a fixed seed and a fixed number of cases, all in this process (``trainer.main.cli``), and
every data case fails while the datasets load, before any worker starts.
"""

import io
import json
import os
import random
from contextlib import redirect_stderr, redirect_stdout

import pytest

from tests.support.tiny import TINY_YAML
from trainer.config import all_keys
from trainer.main import cli


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli(argv)
    return code, err.getvalue()


NASTY_VALUES = [
    "", "-1", "0", "-3", "1e309", "nan", "-inf", "999999999999999999999999", "0.5", "true", "null", "[]", "{}",
    "[1,[2,[3]]]", "{a: 1}", "${oc.env:COXSWAIN_FUZZ_UNSET}", "${nope.nope}", "???", "'", '"', "\\", "é🚀", "a" * 300,
    "/dev/null", "../../../../etc", "[", "{", "]]", "1:2", "x=y", "None", "-0", "+5", "0x10", "1_000",
]
BAD_OVERRIDES = ["=1", "key", "a..b=1", "+", "~", "~nope.nope", "+trainer.seed=1", "trainer=1", "trainer.seed.x=1",
                 "actor_rollout_ref=[]", "--config", "--config=/nonexistent.yaml", "trainer.seed", ".=.", "data.=1"]


def test_config_fuzz_never_prints_a_traceback(tmp_path):
    rng = random.Random(1234)
    keys = sorted(all_keys())
    base = ["--config", TINY_YAML, f"trainer.default_local_dir={tmp_path}/run", "--print-config"]
    outcomes = {0: 0, 2: 0}
    cases = [[o] for o in BAD_OVERRIDES]
    for _ in range(100):
        picks = [f"{rng.choice(keys)}={rng.choice(NASTY_VALUES)}" for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.2:
            picks.append(f"{rng.choice(keys)}.{rng.choice(['x', 'enable', '0'])}={rng.choice(NASTY_VALUES)}")
        if rng.random() < 0.1:
            picks.append(f"nope_{rng.randint(0, 99)}.{rng.choice(keys)}=1")
        cases.append(picks)
    for argv in cases:
        code, err = run_cli(base + argv)
        assert "Traceback (most recent call last)" not in err, (argv, err[-2000:])
        assert code in (0, 2), (argv, code, err[-500:])
        if code == 2:
            assert err.startswith("config error:") and len(err.strip()) > len("config error:"), (argv, err)
        outcomes[code] += 1
    assert outcomes[2] > 50  # most random values are refused ...
    assert outcomes[0] > 0  # ... and some are valid (the fuzz is not a wall of one error)


def _write(path, content: bytes):
    with open(path, "wb") as f:
        f.write(content)
    return str(path)


GOOD_ROW = {"prompt": [{"role": "user", "content": "1+1="}], "data_source": "coxswain/arith",
            "reward_model": {"ground_truth": "2"}, "extra_info": {"index": 0}}


def _data_cases(d, rng):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good_pq = os.path.join(d, "good.parquet")
    pq.write_table(pa.Table.from_pylist([GOOD_ROW] * 4), good_pq)
    raw = open(good_pq, "rb").read()
    cases = {
        "random bytes parquet": _write(f"{d}/rand.parquet", bytes(rng.randrange(256) for _ in range(4000))),
        "truncated parquet": _write(f"{d}/trunc.parquet", raw[: len(raw) // 2]),
        "empty parquet": _write(f"{d}/empty.parquet", b""),
        "parquet, no prompt column": None,
        "parquet, prompt is an int": None,
        "jsonl, not UTF-8": _write(f"{d}/latin.jsonl", json.dumps(GOOD_ROW).encode() + b"\n\xff\xfe\xfa garbage\n"),
        "jsonl, not JSON": _write(f"{d}/notjson.jsonl", b"{this is not json\n"),
        "jsonl, a list per line": _write(f"{d}/list.jsonl", b"[1, 2, 3]\n"),
        "jsonl, deep nesting": _write(f"{d}/deep.jsonl", b"[" * 100000 + b"]" * 100000 + b"\n"),
        "json, deep nesting": _write(f"{d}/deep.json", b"[" * 100000 + b"]" * 100000),
        "json, an object": _write(f"{d}/obj.json", b'{"a": 1}'),
        "json, truncated": _write(f"{d}/trunc.json", json.dumps([GOOD_ROW] * 3).encode()[:-20]),
        "json, not UTF-8": _write(f"{d}/latin.json", b'[{"prompt": "\xff"}]'),
        "unknown extension": _write(f"{d}/data.csv", b"prompt,answer\n1+1,2\n"),
        "a directory": d,
        "missing file": f"{d}/nope.parquet",
        "content is a number": _write(f"{d}/num.jsonl", json.dumps({**GOOD_ROW, "prompt": [{"role": "user", "content": 5}]}).encode()),
        "role is a list": _write(f"{d}/role.jsonl", json.dumps({**GOOD_ROW, "prompt": [{"role": ["user"], "content": "x"}]}).encode()),
        "data_source is a dict": _write(f"{d}/ds.jsonl", json.dumps({**GOOD_ROW, "data_source": {"a": 1}}).encode()),
        "extra_info is a string": _write(f"{d}/extra.jsonl", json.dumps({**GOOD_ROW, "extra_info": "x"}).encode()),
        "ground truth missing": _write(f"{d}/gt.jsonl", json.dumps({**GOOD_ROW, "reward_model": {}}).encode()),
        "empty jsonl": _write(f"{d}/empty.jsonl", b"\n\n"),
    }
    pq.write_table(pa.Table.from_pylist([{"question": "1+1", "data_source": "x"}]), f"{d}/noprompt.parquet")
    cases["parquet, no prompt column"] = f"{d}/noprompt.parquet"
    pq.write_table(pa.Table.from_pylist([{**GOOD_ROW, "prompt": 7}]), f"{d}/intprompt.parquet")
    cases["parquet, prompt is an int"] = f"{d}/intprompt.parquet"
    for i in range(6):  # random JSON rows built from the row's own vocabulary
        vocab = [None, 0, -1, 1.5, "", "user", "x" * 50, [], {}, [{"role": "user"}], {"ground_truth": None}]
        row = {k: rng.choice(vocab) for k in rng.sample(list(GOOD_ROW) + ["prompt", "junk"], rng.randint(0, 5))}
        cases[f"random row {i}"] = _write(f"{d}/rand{i}.jsonl", json.dumps(row).encode())
    return cases


@pytest.mark.slow
def test_data_fuzz_never_prints_a_traceback(tmp_path):
    rng = random.Random(99)
    d = tmp_path / "data"
    d.mkdir()
    cases = _data_cases(str(d), rng)
    for name, path in cases.items():
        for key in ("data.train_files", "data.val_files"):
            code, err = run_cli(["--config", TINY_YAML, f"trainer.default_local_dir={tmp_path}/run", f"{key}={path}"])
            assert "Traceback (most recent call last)" not in err, (name, key, err[-3000:])
            assert code in (1, 2), (name, key, code, err[-1000:])
            line = err.strip().splitlines()[-1]
            assert line.startswith(("error", "config error")) and "error.log" in line or line.startswith("config error"), (name, line)
            assert os.path.basename(str(path)) in err or "dataset" in err, (name, err[-500:])
