"""The embedded Ray cluster kept between runs (trainer.workers.group.keep_embedded_ray): used again while it
fits, started anew when a run's fault-injection variables (COXSWAIN_FAULT_*) differ from those its workers
inherited at its start. Before, a kept cluster gave every later run the first run's faults: a test that slowed
its engine to 0.75 s a decode step got the 0.25 s of the test before it, and its check that a push caught
responses in flight failed on a loaded machine."""

import os

import pytest
import ray

from trainer.workers.group import init_ray, keep_embedded_ray


@ray.remote
def _env(name):
    return os.environ.get(name)


@pytest.fixture
def kept():
    keep_embedded_ray(True)
    yield
    keep_embedded_ray(False)
    if ray.is_initialized():
        ray.shutdown()


def test_a_kept_cluster_is_reused_until_the_fault_variables_change(kept, monkeypatch):
    name = "COXSWAIN_FAULT_DECODE_DELAY_S"
    monkeypatch.setenv(name, "0.25")
    assert init_ray(num_cpus=1) is True
    first = ray.get_runtime_context().gcs_address
    assert ray.get(_env.remote(name)) == "0.25"
    assert init_ray(num_cpus=1) is False  # the same faults: the kept cluster
    assert ray.get_runtime_context().gcs_address == first
    monkeypatch.setenv(name, "0.75")
    assert init_ray(num_cpus=1) is True  # other faults: a new cluster, whose workers see them
    assert ray.get_runtime_context().gcs_address != first
    assert ray.get(_env.remote(name)) == "0.75"
