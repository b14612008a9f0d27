import os

import pytest
import torch


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
