"""trainer/lazy_dynamo.py: tensordict imported without torch._dynamo, and dynamo, once loaded, sees every mark
tensordict made exactly as a plain import leaves them (each side in a fresh interpreter)."""

import json
import os
import subprocess
import sys

from tests.support.house import ROOT

PROBE = os.path.join(ROOT, "tests", "support", "lazy_dynamo_probe.py")


def probe(mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, PROBE, mode], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_tensordict_without_dynamo_then_the_same_marks_as_a_plain_import():
    lazy, plain = probe("lazy"), probe("plain")
    assert lazy["dynamo_before"] is False  # trainer.batch's import of tensordict left dynamo unloaded
    assert plain["dynamo_before"] is True  # the cost it avoids (if tensordict stops paying it, this module can go)
    assert lazy["allowed"] == plain["allowed"] and len(plain["allowed"]) >= 3, (lazy, plain)
    assert lazy["const"] == plain["const"] and plain["const"]
    assert lazy["late"] is True
