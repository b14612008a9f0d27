"""megatron_bridge/lazy_compile.py: megatron-core imported without dynamo or inductor, its torch.compile
decorations compiled on first call (the real torch.compile, with megatron's arguments), and torch.compile itself
untouched outside megatron's module bodies."""

import json
import os
import subprocess
import sys

import torch

from megatron_bridge.lazy_compile import deferred
from tests.support.house import ROOT

IMPORTS = """
import json, sys, torch
real = torch.compile
import megatron_bridge.model, megatron_bridge.train, megatron_bridge.logprobs, megatron_bridge.export
from megatron.core import jit
from megatron.core.fusions import fused_bias_gelu
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor.compile_fx" in sys.modules,
                  "compile_restored": torch.compile is real,
                  "jit_fuser_deferred": getattr(jit.jit_fuser, "__deferred_torch_compile__", False),
                  "bias_gelu_deferred": hasattr(fused_bias_gelu.bias_gelu, "__wrapped_compile_kwargs__")}))
"""


def test_the_bridge_imports_megatron_without_dynamo_or_inductor():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", IMPORTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"dynamo": False, "inductor": False, "compile_restored": True, "jit_fuser_deferred": True,
                   "bias_gelu_deferred": True}, got


def test_deferred_compile_compiles_once_on_first_call_with_its_arguments():
    calls = []

    def real(model, **kw):
        calls.append((model, kw))
        return lambda *a, **k: ("compiled", model(*a, **k))

    def f(x, y=1):
        """doc"""
        return x + y

    g = deferred(real)(f)
    h = deferred(real)(dynamic=True, fullgraph=True)(f)  # the decorator-factory form
    assert calls == [] and g.__name__ == "f" and g.__doc__ == "doc"  # nothing compiled at decoration
    assert g(1, y=2) == ("compiled", 3) and g(2) == ("compiled", 3)
    assert calls == [(f, {})]  # compiled once, on the first call
    assert h(5) == ("compiled", 6) and calls[-1] == (f, {"dynamic": True, "fullgraph": True})
    m = torch.nn.Linear(2, 2)
    assert deferred(real)(m, mode="max-autotune") is not m and calls[-1] == (m, {"mode": "max-autotune"})  # a module: at once


MARKS = """
import json, sys
from megatron_bridge import model  # first, as in a worker: the bridge installs the import hook
from megatron.core.models.common.embeddings import rope_utils
from megatron_bridge.attention import TorchSDPAttention

def marks():
    return [bool(getattr(rope_utils._apply_rotary_pos_emb_thd, "_torchdynamo_disable", False)),
            bool(getattr(TorchSDPAttention.__dict__["_thd"], "_torchdynamo_disable", False))]

model._install_thd_rope()
before, dynamo_before = marks(), "torch._dynamo" in sys.modules
model._eager_inside_compiled_chunks()  # what compile_model does first
after = marks()
model._eager_inside_compiled_chunks()  # idempotent: not wrapped twice
again = rope_utils._apply_rotary_pos_emb_thd.__wrapped__ is model._thd_rope
print(json.dumps({"before": before, "dynamo_before": dynamo_before, "after": after, "again": again}))
"""


def test_a_compiled_chunk_runs_the_data_dependent_pieces_eagerly():
    """The THD RoPE and the attention's length buckets are marked ``torch.compiler.disable`` when a chunk is
    compiled (not at import, which would load dynamo in every megatron process)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", MARKS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"before": [False, False], "dynamo_before": False, "after": [True, True], "again": True}, got
