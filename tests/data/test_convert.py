"""Converters for local GSM8K / MATH files (nothing downloaded)."""

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from trainer.data.convert import convert, main
from trainer.data.dataset import BadRowError, RLDataset
from trainer.rewards.scorers import compute_score

GSM = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,000 eggs twice.", "answer": "1000*2=2000\n#### 2,000"},
]
MATH = [
    {"problem": "What is $1/2 + 1/4$?", "solution": "We get $\\boxed{\\frac{3}{4}}$.", "level": "Level 1", "type": "Algebra"},
    {"problem": "Compute $2^3$.", "answer": "8", "subject": "Algebra"},
]


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_gsm8k_cli_writes_verl_rows_that_load_and_score(tmp_path):
    src, dst = jsonl(tmp_path / "gsm.jsonl", GSM), str(tmp_path / "gsm.parquet")
    r = subprocess.run([sys.executable, "-m", "trainer.data.convert", "gsm8k", src, dst], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "wrote 2 rows" in r.stdout
    rows = pq.read_table(dst).to_pylist()
    # "#### 2,000" -> ground truth "2000" (thousands separator removed)
    assert [x["reward_model"]["ground_truth"] for x in rows] == ["7", "2000"]
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[0]["extra_info"]["index"] == 0
    assert rows[0]["prompt"][0]["content"].startswith("Tom has 3 apples") and "####" in rows[0]["prompt"][0]["content"]
    ds = RLDataset(dst, tokenizer=None)
    assert len(ds) == 2
    assert compute_score("openai/gsm8k", "so 4 more... #### 2,000", ds[1]["ground_truth"])["score"] == 1.0


def test_math_converter_boxed_or_answer_field(tmp_path):
    dst = str(tmp_path / "m.jsonl")
    assert convert("math", jsonl(tmp_path / "m_in.jsonl", MATH), dst, split="test") == {"rows": 2, "bad_rows": 0}
    rows = [json.loads(x) for x in open(dst)]
    assert rows[0]["reward_model"]["ground_truth"] == "\\frac{3}{4}"  # the solution's last \boxed{}
    assert rows[1]["reward_model"]["ground_truth"] == "8"  # the answer field
    assert rows[0]["extra_info"] == {"split": "test", "index": 0, "level": "Level 1", "type": "Algebra"}
    assert compute_score(rows[0]["data_source"], "so it is \\boxed{0.75}", rows[0]["reward_model"]["ground_truth"])["score"] == 1.0


def test_bad_input_rows_reported_or_skipped(tmp_path):
    bad = GSM + [{"question": "no marker", "answer": "42"}, {"answer": "#### 1"}]
    src = jsonl(tmp_path / "g.jsonl", bad)
    with pytest.raises(BadRowError, match=r"g\.jsonl: line 3: 'answer' has no '#### <number>' ending"):
        convert("gsm8k", src, str(tmp_path / "o.parquet"))
    stats = convert("gsm8k", src, str(tmp_path / "o.parquet"), on_bad_row="skip")
    assert stats == {"rows": 2, "bad_rows": 2}
    # the CLI turns the error into a message and exit code 2, not a traceback
    assert main(["gsm8k", src, str(tmp_path / "o2.parquet")]) == 2


def test_math_solution_without_box_is_bad(tmp_path):
    src = jsonl(tmp_path / "m.jsonl", [{"problem": "x?", "solution": "it is 3"}])
    with pytest.raises(BadRowError, match=r"line 1: 'solution' has no \\boxed"):
        convert("math", src, str(tmp_path / "o.parquet"))
