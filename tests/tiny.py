"""The tiny CPU job's config for tests: ``recipes/cpu/tiny_grpo.yaml`` (the settings the shipped recipe
uses on top of verl's defaults) plus a test's own overrides."""

import os

from trainer.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(ROOT, "recipes", "cpu", "tiny_grpo.yaml")


def tiny_config(overrides=(), **kw):
    return load_config(["--config", TINY_YAML, *overrides], **kw)
