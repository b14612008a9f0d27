import os
import sys
import types

import pytest
import torch

# ``tests`` is this directory. A package installed into site-packages may ship its own top-level ``tests``
# package (verl's wheel does, and requirements-peers.txt installs verl), and a regular package found
# anywhere on sys.path beats this namespace directory; pin the name to this directory instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
if getattr(sys.modules.get("tests"), "__path__", [None])[0] != _HERE:
    _pkg = types.ModuleType("tests")
    _pkg.__path__ = [_HERE]
    sys.modules["tests"] = _pkg


def pytest_collection_modifyitems(config, items):
    # GPU tests are visible in the report as skipped with a reason, never silently dropped.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on a lent device: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
