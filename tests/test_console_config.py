"""The console opens with what differs from the defaults, not the whole config: a run prints one line per key
that differs (resolved, secrets masked) and the path of ``config.yaml``, which holds every key;
``--print-config`` still prints every key. No training runs here (``train`` is replaced)."""

import os

import yaml

from tests.support.house import ROOT
from trainer import main
from trainer.config import load_config
from trainer.console import changed_from_defaults, config_summary_lines, shown_value

TINY = os.path.join(ROOT, "recipes", "cpu", "tiny_grpo.yaml")


def test_changed_keys_are_those_set_and_shown_as_on_a_command_line():
    raw = {"a": 1, "b": "${a}", "c": [1, 2], "d": None, "e": {"x": True}}
    defaults = {"a": 0, "b": "${a}", "c": [1, 2], "d": 3}
    shown = {"a": 1, "b": 1, "c": [1, 2], "d": None, "e": {"x": True}}
    changed = changed_from_defaults(raw, defaults, shown)
    assert changed == {"a": 1, "d": None, "e": {"x": True}}  # b follows a: not set, not shown
    lines = config_summary_lines(changed, "run/config.yaml")
    assert lines == ["config: 3 key(s) differ from the defaults; every key is in run/config.yaml",
                     "  a=1", "  d=null", "  e={x: true}"]
    assert shown_value(["console", "mlflow"]) == "[console,mlflow]" and shown_value(False) == "false"


def test_the_tiny_recipes_summary_names_what_it_sets(monkeypatch):
    monkeypatch.setenv("MY_JUDGE_URL", "https://user:sk-very-secret-value@judge.example")
    cfg = load_config(["--config", TINY, "attribution_driven_credit_assignment.base_url=${oc.env:MY_JUDGE_URL}"])
    changed = main.config_changes(cfg)
    assert changed["algorithm.adv_estimator"] == "grpo" and changed["trainer.device"] == "cpu"
    assert changed["actor_rollout_ref.model.path"] == "recipes/cpu/tiny_model"
    assert "algorithm.gamma" not in changed and "actor_rollout_ref.rollout.prompt_length" not in changed
    assert "attribution_driven_credit_assignment.base_url" in changed  # set, and shown without its value
    assert "sk-very-secret-value" not in "\n".join(config_summary_lines(changed, "x"))
    assert len(changed) < 60  # a short summary, where the whole config is 360 keys


def test_a_run_opens_with_the_summary_and_writes_every_key(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(main, "train", lambda cfg: None)
    assert main.cli(["--config", TINY, f"trainer.default_local_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("config: ") and f"every key is in {tmp_path}/config.yaml" in out.splitlines()[0]
    assert "  algorithm.adv_estimator=grpo" in out.splitlines()
    assert "trigger_parameter_sync_step" not in out  # the whole config is not printed ...
    saved = yaml.safe_load(open(tmp_path / "config.yaml"))  # ... it is in the run directory
    assert saved["async_training"]["trigger_parameter_sync_step"] == 4 and saved["algorithm"]["adv_estimator"] == "grpo"


def test_print_config_still_prints_every_key(tmp_path, capsys):
    assert main.cli(["--print-config", "--config", TINY, f"trainer.default_local_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "trigger_parameter_sync_step: 4" in out and f"resolved config written to {tmp_path}/config.yaml" in out
