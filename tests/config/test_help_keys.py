"""``python -m trainer.main --help-keys``: every key with its default and the description written next
to its field in trainer/config/schema.py; ``| head`` ends without a BrokenPipe traceback."""

import subprocess
import sys
from pathlib import Path

from trainer.config import all_keys

ROOT = Path(__file__).resolve().parents[2]


def test_every_key_has_its_default_and_description():
    out = subprocess.run([sys.executable, "-m", "trainer.main", "--help-keys"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    shown = {ln.split(" = ")[0]: i for i, ln in enumerate(lines) if " = " in ln and not ln.startswith(" ")}
    assert set(shown) == set(all_keys())
    i = shown["trainer.log_val_generations"]
    assert lines[i] == "trainer.log_val_generations = 0" and lines[i + 1].strip().startswith("log N validation samples")
    i = shown["trainer.save_freq"]
    assert lines[i] == "trainer.save_freq = -1" and lines[i + 1].strip() == "checkpoint every N steps (-1 = never)"
    assert "trainer.resume_mode = 'auto'" in lines and "trainer.resume_from_path = null" in lines
    assert "trainer.val_before_train = true" in lines
    # verl's interpolation is shown as written
    assert "actor_rollout_ref.actor.checkpoint.load_contents = '${.save_contents}'" in lines
    # a section header carries its own comment
    assert "[trainer]  loop, logging, checkpoints" in lines
    described = sum(1 for k, j in shown.items() if j + 1 < len(lines) and lines[j + 1].startswith("      "))
    assert described >= 0.9 * len(shown)


def test_help_keys_into_head_has_no_broken_pipe_traceback():
    p = subprocess.run(f"{sys.executable} -m trainer.main --help-keys | head -3", shell=True, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert len(p.stdout.splitlines()) == 3
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


def test_help_keys_into_a_closed_pipe_exits_quietly():
    # deterministic version of `| head`: the reader is gone before the first write
    p = subprocess.Popen([sys.executable, "-m", "trainer.main", "--help-keys"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
