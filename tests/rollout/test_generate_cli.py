"""``python -m trainer.rollout.generate`` on a small jsonl: ids and text prompts, greedy and n > 1."""

import json
import os
import subprocess
import sys

import pytest

from trainer.rollout.engine import SamplingParams
from trainer.rollout.generate import main
from trainer.rollout.native import NativeEngine

from .conftest import make_hf_model, make_tokenizer, save_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = "the cat sat on a mat dog ran far away and then stopped".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_model")
    hf = make_hf_model("qwen3")
    hf.config.eos_token_id = 1  # the tokenizer's <eos>; becomes the default stop token
    save_model(hf, path)
    make_tokenizer(path, WORDS)
    return str(path)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_cli_subprocess_greedy(model_dir, tmp_path):
    # Greedy through the real `python -m` entry point; each line equals the engine's own output.
    rows = [{"prompt_ids": [5, 6, 7], "id": "a"}, {"prompt": "the cat sat on", "id": "b"}]
    write_jsonl(tmp_path / "in.jsonl", rows)
    cmd = [sys.executable, "-m", "trainer.rollout.generate", "--model", model_dir, "--input", str(tmp_path / "in.jsonl"),
           "--out", str(tmp_path / "out.jsonl"), "--temperature", "0", "--max-new-tokens", "6", "--threads", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [o["id"] for o in out] == ["a", "b"]
    text_ids = [3 + WORDS.index(w) for w in "the cat sat on".split()]  # word-level ids, no specials
    engine = NativeEngine(model_dir, max_batch_size=4, max_seq_len=16)
    ref = engine.generate([[5, 6, 7], text_ids], SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[1]))
    for o, (r,) in zip(out, ref):
        assert o["response_ids"] == r.token_ids and o["finish_reason"] == r.finish_reason
        assert o["logprobs"] == pytest.approx(r.logprobs, abs=1e-6)
        assert len(o["logprobs"]) == len(o["response_ids"]) and isinstance(o["response"], str)
    assert out[0]["prompt_ids"] == [5, 6, 7] and out[1]["prompt"] == "the cat sat on"


def test_cli_sampling_n_and_stop_override(model_dir, tmp_path):
    rows = [{"prompt_ids": [4, 9]}, {"prompt_ids": [10, 11, 12, 3]}]
    write_jsonl(tmp_path / "in.jsonl", rows)
    args = ["--model", model_dir, "--input", str(tmp_path / "in.jsonl"), "--temperature", "0.9", "--top-p", "0.9",
            "--top-k", "20", "--max-new-tokens", "5", "--n", "3", "--seed", "4", "--stop-token-ids", ""]
    assert main(args + ["--out", str(tmp_path / "o1.jsonl")]) == 0
    assert main(args + ["--out", str(tmp_path / "o2.jsonl")]) == 0
    o1, o2 = read_jsonl(tmp_path / "o1.jsonl"), read_jsonl(tmp_path / "o2.jsonl")
    assert o1 == o2  # same seed, same file
    assert [o["sample_index"] for o in o1] == [0, 1, 2, 0, 1, 2]
    assert all(o["finish_reason"] == "length" and len(o["response_ids"]) == 5 for o in o1)  # no stop ids
    engine = NativeEngine(model_dir, max_batch_size=64, max_seq_len=9)
    ref = engine.generate([r["prompt_ids"] for r in rows], SamplingParams(n=3, temperature=0.9, top_p=0.9, top_k=20, max_new_tokens=5, seed=4))
    assert [o["response_ids"] for o in o1] == [s.token_ids for g in ref for s in g]
    assert "response" not in o1[0]  # no tokenizer needed for id-only input
