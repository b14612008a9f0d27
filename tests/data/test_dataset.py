"""RLDataset (verl rows, chat template / fallback, overlong handling, bad rows) and PromptSampler."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from trainer.data.dataset import BadRowError, PromptSampler, RLDataset, render_prompt

CHARS = list("0123456789+-*=abcdefghijklmnopqrstuvwxyz ?.,:")
SPECIAL = ["<pad>", "<unk>", "<|user|>", "<|system|>", "<|assistant|>"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def char_tokenizer(with_template: bool = True) -> PreTrainedTokenizerFast:
    """A character-level tokenizer built locally: every character is one token, and the chat
    markers are single special tokens, so expected token counts can be worked out by hand."""
    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL[2:]})
    if with_template:
        fast.chat_template = TEMPLATE
    return fast


def row(content="12+34=", ds="coxswain/arith", gt="46", extra=None):
    r = {"data_source": ds, "prompt": [{"role": "user", "content": content}], "reward_model": {"ground_truth": gt}}
    if extra is not None:
        r["extra_info"] = extra
    return r


def write_jsonl(path, rows_or_lines):
    with open(path, "w") as f:
        for r in rows_or_lines:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


# ---------------------------------------------------------------------------------------------
# reading, template, fallback
# ---------------------------------------------------------------------------------------------
def test_chat_template_tokens_hand_counted(tmp_path):
    tok = char_tokenizer()
    path = write_parquet(tmp_path / "a.parquet", [row("12+34=", extra={"index": 7}), row("5*6=", gt="30")])
    ds = RLDataset(path, tok, max_prompt_length=64)
    assert len(ds) == 2
    # "<|user|>" + "12+34=" + "<|assistant|>" -> 1 + 6 + 1 = 8 tokens
    assert ds[0]["prompt_text"] == "<|user|>12+34=<|assistant|>"
    assert len(ds[0]["input_ids"]) == 8
    assert tok.convert_ids_to_tokens(ds[0]["input_ids"]) == ["<|user|>", "1", "2", "+", "3", "4", "=", "<|assistant|>"]
    assert ds[0]["ground_truth"] == "46" and ds[0]["data_source"] == "coxswain/arith"
    assert ds[0]["extra_info"] == {"index": 7} and ds[1]["extra_info"] == {}
    assert ds[1]["source"].endswith("a.parquet: row 2")


def test_plain_fallback_without_chat_template(tmp_path):
    tok = char_tokenizer(with_template=False)
    path = write_jsonl(tmp_path / "a.jsonl", [row("12+34=")])
    ds = RLDataset(path, tok, max_prompt_length=64)
    # one user message -> its text verbatim, no markers: 6 characters, 6 tokens
    assert ds[0]["prompt_text"] == "12+34="
    assert len(ds[0]["input_ids"]) == 6
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}]
    assert render_prompt(msgs, tok) == "system: be brief\nuser: 1+1=\nassistant: "


def test_jsonl_parquet_and_json_read_the_same(tmp_path):
    tok = char_tokenizer()
    rows = [row("1+2=", gt="3"), row("3*4=", gt="12", ds="other")]
    a = RLDataset(write_jsonl(tmp_path / "a.jsonl", rows), tok)
    b = RLDataset(write_parquet(tmp_path / "b.parquet", rows), tok)
    (tmp_path / "c.json").write_text(json.dumps(rows))
    c = RLDataset(str(tmp_path / "c.json"), tok)
    for x, y in ((a, b), (a, c)):
        assert [i["input_ids"] for i in x.items] == [i["input_ids"] for i in y.items]
        assert [i["data_source"] for i in x.items] == [i["data_source"] for i in y.items]


def test_several_files_concatenate_in_order(tmp_path):
    tok = char_tokenizer()
    p1 = write_jsonl(tmp_path / "a.jsonl", [row("1+1=", gt="2")])
    p2 = write_jsonl(tmp_path / "b.jsonl", [row("2+2=", gt="4"), row("3+3=", gt="6")])
    ds = RLDataset([p1, p2], tok)
    assert [i["ground_truth"] for i in ds.items] == ["2", "4", "6"]


# ---------------------------------------------------------------------------------------------
# bad rows
# ---------------------------------------------------------------------------------------------
BAD = [
    ({"data_source": "x", "reward_model": {"ground_truth": "1"}}, "missing key 'prompt'"),
    (dict(row(), prompt="12+34="), "is a string"),
    (dict(row(), prompt=[]), "empty prompt"),
    (dict(row(), prompt=[{"role": "user", "content": "   "}]), "blank"),
    (dict(row(), prompt=[{"role": "robot", "content": "hi"}]), "role 'robot'"),
    (dict(row(), prompt=[{"role": "user", "content": 5}]), "content is a int"),
    ({"prompt": row()["prompt"], "reward_model": {"ground_truth": "1"}}, "'data_source'"),
    (dict(row(), reward_model={"style": "rule"}), "ground_truth"),
    (dict(row(), extra_info=[1, 2]), "extra_info is a list"),
]


@pytest.mark.parametrize("bad,fault", BAD)
def test_bad_row_error_names_file_row_fault_and_fix(tmp_path, bad, fault):
    path = write_jsonl(tmp_path / "d.jsonl", [row(), row(), bad])
    with pytest.raises(BadRowError) as e:
        RLDataset(path, char_tokenizer())
    msg = str(e.value)
    assert "d.jsonl: line 3" in msg and fault in msg and "Fix:" in msg and "on_bad_row=skip" in msg


def test_bad_rows_skipped_and_counted(tmp_path, caplog):
    lines = [json.dumps(row()), "{not json", json.dumps(BAD[0][0]), json.dumps(row("7+1=", gt="8")), json.dumps(BAD[2][0])]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    with caplog.at_level(logging.WARNING):
        ds = RLDataset(path, char_tokenizer(), on_bad_row="skip")
    assert len(ds) == 2 and ds.stats["bad_rows"] == 3 and ds.stats["rows"] == 5
    assert ds.bad_rows[0].endswith("line 2: not valid JSON (Expecting property name enclosed in double quotes at column 2)")
    assert "line 3" in ds.bad_rows[1] and "line 5" in ds.bad_rows[2]
    assert "skipped 3 bad row(s)" in caplog.text


def test_bad_parquet_row_is_reported_by_row_number(tmp_path):
    rows = [row(), row(), dict(row(), reward_model={"ground_truth": None})]
    path = write_parquet(tmp_path / "p.parquet", rows)
    with pytest.raises(BadRowError, match=r"p\.parquet: row 3: missing reward_model\.ground_truth"):
        RLDataset(path, char_tokenizer())


def test_all_rows_bad_is_an_error_even_when_skipping(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["[1]", "[2]"])
    with pytest.raises(BadRowError, match="no usable rows"):
        RLDataset(path, char_tokenizer(), on_bad_row="skip")


# ---------------------------------------------------------------------------------------------
# overlong prompts
# ---------------------------------------------------------------------------------------------
def overlong_rows():
    # with the template, "ab" -> 1 + 2 + 1 = 4 tokens; "abcdefgh" -> 1 + 8 + 1 = 10 tokens
    return [row("ab"), row("abcdefgh")]


def test_overlong_filtered_and_counted(tmp_path):
    ds = RLDataset(rows=overlong_rows(), tokenizer=char_tokenizer(), max_prompt_length=6)
    assert len(ds) == 1 and ds.stats["filtered_overlong"] == 1 and ds[0]["prompt_text"] == "<|user|>ab<|assistant|>"


def test_overlong_truncation_left_right_and_error(tmp_path):
    tok = char_tokenizer()
    kw = dict(rows=overlong_rows(), tokenizer=tok, max_prompt_length=6, filter_overlong_prompts=False)
    left = RLDataset(truncation="left", **kw)
    right = RLDataset(truncation="right", **kw)
    # left keeps the last 6 of [<|user|> a b c d e f g h <|assistant|>], right the first 6
    assert tok.convert_ids_to_tokens(left[1]["input_ids"]) == ["d", "e", "f", "g", "h", "<|assistant|>"]
    assert tok.convert_ids_to_tokens(right[1]["input_ids"]) == ["<|user|>", "a", "b", "c", "d", "e"]
    assert left.stats["truncated"] == 1
    with pytest.raises(BadRowError, match=r"row 2: the prompt has 10 tokens, more than data.max_prompt_length=6"):
        RLDataset(truncation="error", **kw)


def test_build_dataset_defaults_to_synthetic():
    from trainer.config import DataConfig
    from trainer.data.dataset import build_dataset

    tok = char_tokenizer(with_template=False)
    train, val = build_dataset(DataConfig(), tok, "train"), build_dataset(DataConfig(), tok, "val")
    assert len(train) == 2048 and len(val) == 256
    assert {i["prompt_text"] for i in train.items}.isdisjoint({i["prompt_text"] for i in val.items})


def test_max_samples_keeps_verls_rows():
    """data.train_max_samples / val_max_samples as verl's RLHFDataset: with data.shuffle a seeded sample
    without replacement (numpy's default_rng(seed).choice), else the first rows; <= 0 keeps all."""
    import numpy as np

    from trainer.config import DataConfig
    from trainer.data.dataset import build_dataset
    from trainer.data.synthetic import make_rows

    tok = char_tokenizer(with_template=False)
    rows = make_rows(2048, "train", ops=("+",), max_digits=2)
    picked = build_dataset(DataConfig(train_max_samples=10, seed=3), tok, "train")
    want = [rows[i]["prompt"][0]["content"] for i in np.random.default_rng(3).choice(2048, size=10, replace=False)]
    assert [it["messages"][0]["content"] for it in picked.items] == want and len(set(want)) == 10
    first = build_dataset(DataConfig(train_max_samples=10, shuffle=False), tok, "train")
    assert [it["messages"][0]["content"] for it in first.items] == [r["prompt"][0]["content"] for r in rows[:10]]
    assert len(build_dataset(DataConfig(val_max_samples=7), tok, "val")) == 7
    assert len(build_dataset(DataConfig(val_max_samples=7), tok, "train")) == 2048  # each split its own key
    assert len(build_dataset(DataConfig(train_max_samples=-1), tok, "train")) == 2048
    assert len(build_dataset(DataConfig(train_max_samples=5000), tok, "train")) == 2048


# ---------------------------------------------------------------------------------------------
# sampler
# ---------------------------------------------------------------------------------------------
def test_sampler_epochs_are_permutations_and_drop_the_tail():
    s = PromptSampler(10, seed=3)
    b = [s.next(4) for _ in range(4)]
    # epoch 0 gives two batches of 4 (8 of 10 items); the remaining 2 are dropped, epoch 1 starts
    assert len(set(b[0] + b[1])) == 8 and s.epoch == 1
    assert len(set(b[2] + b[3])) == 8
    assert b[0] + b[1] != b[2] + b[3]  # a new permutation each epoch
    seq = PromptSampler(5, shuffle=False)
    assert seq.next(2) == [0, 1] and seq.next(2) == [2, 3] and seq.next(2) == [0, 1]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 50),
    seed=st.integers(0, 10**6),
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=30),
    cut=st.integers(0, 30),
)
def test_sampler_resume_is_exact(n, seed, sizes, cut):
    """Save after `cut` draws, restore into a fresh sampler: the following draws are identical."""
    sizes = [min(x, n) for x in sizes]
    cut = min(cut, len(sizes))
    ref = PromptSampler(n, seed=seed)
    expected = [ref.next(x) for x in sizes]
    a = PromptSampler(n, seed=seed)
    for x in sizes[:cut]:
        a.next(x)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    b = PromptSampler(n, seed=0)
    b.load_state_dict(state)
    assert [b.next(x) for x in sizes[cut:]] == expected[cut:]


def test_sampler_refuses_state_of_another_dataset():
    s = PromptSampler(10)
    with pytest.raises(ValueError, match="dataset of 12 prompts but this one has 10"):
        s.load_state_dict({"epoch": 0, "offset": 0, "seed": 1, "num_items": 12})
