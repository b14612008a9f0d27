"""A password inside a URL never leaves the process in clear: ``--print-config`` prints
``reward_model.sandbox_fusion.url=http://user:PASS@host/...`` as ``http://user:***@host/...``, the
``config.yaml`` it writes to the run directory holds the same masked value, and the trackers' params
(MLflow) mask it too. A URL without credentials is printed as it is."""

import subprocess
import sys
from pathlib import Path

import yaml

from trainer.config.secrets import mask_url_credentials
from trainer.tracking import redact

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = str(ROOT / "recipes" / "cpu" / "tiny_grpo.yaml")
PASSWORD = "Pw-7f3kq9x"  # no secret-named env var holds it: only the URL rule can mask it


def test_print_config_and_config_yaml_mask_url_credentials(tmp_path):
    url = f"http://sandbox-user:{PASSWORD}@sandbox.internal:8080/run_code"
    argv = ["--print-config", "--config", TINY_YAML, f"trainer.default_local_dir={tmp_path}",
            f"reward_model.sandbox_fusion.url={url}",
            "trainer.project_name=https://mirror.example.org/plain"]  # no credentials: left alone
    p = subprocess.run([sys.executable, "-m", "trainer.main", *argv], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    written = (tmp_path / "config.yaml").read_text()
    for text in (p.stdout, p.stderr, written):
        assert PASSWORD not in text
    masked = "http://sandbox-user:***@sandbox.internal:8080/run_code"
    assert f"url: {masked}" in p.stdout
    cfg = yaml.safe_load(written)
    assert cfg["reward_model"]["sandbox_fusion"]["url"] == masked
    assert cfg["trainer"]["project_name"] == "https://mirror.example.org/plain"


def test_the_url_rule_and_tracker_params():
    assert mask_url_credentials(f"postgresql://ann:{PASSWORD}@db:5432/x and https://ghp_tok3n@github.com/o/r") == \
        "postgresql://ann:***@db:5432/x and https://***@github.com/o/r"
    for plain in ("http://host:8080/run_code", "user:pw@host", "http://host/a@b", "git@github.com:o/r.git"):
        assert mask_url_credentials(plain) == plain
    params = redact({"reward_model.sandbox_fusion.url": f"http://u:{PASSWORD}@h/run_code", "trainer.seed": 1})
    assert params == {"reward_model.sandbox_fusion.url": "http://u:***@h/run_code", "trainer.seed": "1"}
