"""Run as a script by tests/test_lazy_dynamo.py, in a fresh process: import tensordict either through
trainer.batch (``lazy``: trainer/lazy_dynamo.py) or plainly (``plain``), then import torch._dynamo and print, as
JSON, whether dynamo was loaded before that, and which of tensordict's functions dynamo's allow-list holds and
which carry the assume-constant mark."""

import json
import pkgutil
import sys

if sys.argv[1] == "lazy":
    import trainer.batch  # noqa: F401
else:
    import tensordict  # noqa: F401
before = "torch._dynamo" in sys.modules

import tensordict  # noqa: E402
import torch._dynamo  # noqa: E402,F401
from torch._dynamo import trace_rules  # noqa: E402

ids = trace_rules._allowed_callable_ids
allowed = set(getattr(ids, "function_ids", None) or ids)
names, consts = [], []
for mi in pkgutil.walk_packages(tensordict.__path__, "tensordict."):
    m = sys.modules.get(mi.name)
    for k, v in vars(m).items() if m else ():
        if callable(v) and id(v) in allowed:
            names.append(f"{mi.name}.{k}")
        if getattr(v, "_dynamo_marked_constant", False):
            consts.append(f"{mi.name}.{k}")
# a function tensordict marks after dynamo is loaded goes straight to the allow-list
late = None
if sys.argv[1] == "lazy":
    import tensordict.utils as tu

    def late_fn():
        return None

    tu.allow_in_graph(late_fn)
    late = id(late_fn) in set(getattr(ids, "function_ids", None) or ids)
print(json.dumps({"dynamo_before": before, "allowed": sorted(names), "const": sorted(consts), "late": late}))
