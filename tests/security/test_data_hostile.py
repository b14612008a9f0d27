"""Hostile data files: an unknown data_source is refused at load (not scored by some default), huge
prompts are dropped before tokenization, FIFOs and devices are named for what they are (and never
opened), and a non-UTF-8 byte is reported at its own line."""

import json
import os
import time
import tracemalloc

import pytest

from tests.data.test_dataset import char_tokenizer, row
from tests.support.tiny import tiny_config
from trainer.config.preflight import check_data_sources
from trainer.config.schema import ConfigError
from trainer.data.dataset import BadRowError, RLDataset, chars_per_token_bound
from trainer.rewards import scorers


def test_an_unknown_data_source_is_refused_with_the_known_scorers_and_the_fix(tmp_path):
    ds = RLDataset(rows=[row(ds="my/addition"), row(ds="openai/gsm8k")], tokenizer=char_tokenizer())
    with pytest.raises(ConfigError) as info:
        check_data_sources(tiny_config(), ds, None)
    msg = str(info.value)
    assert len(msg.splitlines()) == 1
    assert "data_source 'my/addition' has no scorer (known: " in msg and "openai/gsm8k" in msg and "countdown" in msg
    assert "register your own scorer with custom_reward_function.path=FILE.py" in msg
    # a custom reward function scores every source, as in verl
    check_data_sources(tiny_config(["custom_reward_function.path=docs/examples/my_reward.py"]), ds)
    # verl's default_compute_score raises NotImplementedError for a source it does not know
    with pytest.raises(NotImplementedError, match="'my/addition' has no scorer"):
        scorers.compute_score("my/addition", "29", "29")


def test_huge_prompts_are_dropped_before_tokenization(tmp_path):
    path = tmp_path / "huge.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps(row("12+34=")) + "\n")
        big = json.dumps(row("1" * 2_000_000))
        for _ in range(32):
            f.write(big + "\n")
    tok = char_tokenizer()
    limit = 1024 * chars_per_token_bound(tok)
    assert limit == 1024 * 64 * 4  # the vocabulary's longest entry is under the constant

    class Guard(type(tok)):  # the tokenizer refuses anything over the bound: it must never see such a prompt
        def __call__(self, texts, *a, **k):
            assert max(len(t) for t in texts) <= limit, "a prompt that cannot fit was tokenized"
            return super().__call__(texts, *a, **k)

    tok.__class__ = Guard
    tracemalloc.start()
    t = time.time()
    try:
        ds = RLDataset(str(path), tok, max_prompt_length=1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.time() - t < 10 and peak < 1 << 30
    assert len(ds) == 1 and ds.stats["filtered_overlong"] == 32


def test_fifos_and_devices_are_named_and_never_opened(tmp_path):
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)  # opening it would block until a writer came
    with pytest.raises(BadRowError, match=r"is a named pipe \(FIFO\), not a data file"):
        RLDataset(str(fifo), char_tokenizer())
    with pytest.raises(BadRowError, match="'/dev/zero' is a character device, not a data file"):
        RLDataset("/dev/zero", char_tokenizer())


def test_the_non_utf8_error_names_the_line_of_the_byte(tmp_path):
    path = tmp_path / "latin.jsonl"
    good = json.dumps(row()).encode() + b"\n"
    path.write_bytes(good * 499 + b'{"data_source": "caf\xe9"}\n' + good * 500)  # the bad byte on line 500
    with pytest.raises(BadRowError) as info:
        RLDataset(str(path), char_tokenizer())
    assert str(info.value) == (f"{path}: not UTF-8 text at line 500, byte 21 of the line (invalid continuation byte); "
                               f"re-encode the file as UTF-8")
