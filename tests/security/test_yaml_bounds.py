"""Hostile ``--config`` files: an alias bomb fails fast, a self-referencing anchor is one line (no
RecursionError), a file's content is never echoed back, and an unreadable file is reported alone."""

import os
import time

import pytest

from trainer.config.load import load_config
from trainer.config.schema import ConfigError


def _problems(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    text = str(info.value)
    assert "Traceback" not in text and "RecursionError" not in text
    return [line for line in text.splitlines()[1:]]


def _billion_laughs(path) -> None:
    lines = ["a: &a [" + ",".join(['"lol"'] * 10) + "]"]
    for i in range(1, 10):
        cur, prev = chr(ord("a") + i), chr(ord("a") + i - 1)
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 10) + "]")
    lines.append("data: {max_prompt_length: *j}")
    path.write_text("\n".join(lines) + "\n")


def test_an_alias_bomb_fails_fast_with_one_line(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    _billion_laughs(bomb)
    t = time.time()
    problems = _problems(["--config", str(bomb)])
    assert time.time() - t < 5
    assert problems == [f"  1. --config: file '{bomb}': expands to more than 200000 values once its aliases are "
                        f"expanded (an alias bomb?); write the values out or use fewer aliases"]


def test_a_self_referencing_anchor_is_one_line(tmp_path):
    f = tmp_path / "self.yaml"
    f.write_text("data: &x\n  foo: *x\n")
    assert _problems(["--config", str(f)]) == [
        f"  1. --config: file '{f}': an anchor is used inside itself (a self-referencing alias); remove that alias"]


def test_deep_nesting_is_refused_without_recursion(tmp_path):
    f = tmp_path / "deep.yaml"
    f.write_text("data: " + "[" * 5000 + "]" * 5000 + "\n")
    (line,) = _problems(["--config", str(f)])
    assert "nested more than 64 levels deep; flatten it" in line


def test_an_oversized_file_is_refused_before_it_is_parsed(tmp_path):
    f = tmp_path / "big.yaml"
    f.write_text("data:\n  x: '" + "a" * (5 << 20) + "'\n")
    (line,) = _problems(["--config", str(f)])
    assert "more than a config's limit of 4194304" in line and "aaaa" not in line


def test_a_non_config_file_is_not_echoed(tmp_path):
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
                      "hunter2-secret-line\n")
    (line,) = _problems(["--config", str(secret)])
    assert "is not a config mapping of known keys" in line
    rest = line.split("' is not a config", 1)[1]  # after the file's name
    assert "root" not in rest and "daemon" not in rest and "hunter2" not in rest and len(line) < 400

    keys = tmp_path / "keys.yaml"  # a mapping, but of no config section: a few keys named, cut short
    keys.write_text("".join(f"user{i}_{'x' * 100}: secret{i}\n" for i in range(50)))
    (line,) = _problems(["--config", str(keys)])
    assert "is not a config mapping of known keys: none of its 50 top-level keys" in line
    assert line.count("user") == 3 and "secret" not in line and "x" * 40 not in line


def test_yaml_syntax_errors_name_the_place_not_the_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("data:\n  x: [1, 2\n  password: hunter2\n")
    (line,) = _problems(["--config", str(f)])
    assert "is not valid YAML at line 3" in line and "hunter2" not in line


def test_unreadable_config_files_are_reported_alone(tmp_path):
    missing = tmp_path / "missing.yaml"
    assert _problems(["--config", str(missing)]) == [f"  1. --config: file '{missing}' does not exist"]
    assert _problems(["--config", str(tmp_path)]) == [f"  1. --config: '{tmp_path}' is a directory; give a YAML file"]
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x01garbage")
    assert _problems(["--config", str(binary)]) == [f"  1. --config: file '{binary}' is not UTF-8 text, so not a YAML config"]
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    assert _problems(["--config", str(fifo)]) == [f"  1. --config: '{fifo}' is not a regular file; give a YAML file"]


def test_hydra_config_name_gets_the_same_bounds(tmp_path):
    _billion_laughs(tmp_path / "mine.yaml")
    t = time.time()
    (line,) = _problems(["--config-path", str(tmp_path), "--config-name", "mine"])
    assert time.time() - t < 5 and "an alias bomb" in line
