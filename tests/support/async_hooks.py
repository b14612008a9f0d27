"""Hooks for tests/test_async_fully.py, loaded by name in a driver subprocess with tests/ on its PYTHONPATH
(``trainer.hooks.after_update=[async_hooks:...]``):
fault injection (a slow trainer) and a record of the prompts each update trained on."""

import json
import os
import time


def slow_trainer(batch, metrics):
    """after_update: sleep ``COXSWAIN_TEST_SLOW_TRAINER_S`` seconds (a slow trainer)."""
    time.sleep(float(os.environ.get("COXSWAIN_TEST_SLOW_TRAINER_S") or 0.0))


def record_trained(batch, metrics):
    """after_update: append the dataset indices of the step's prompts (one per group, in batch order)
    as one JSON line to ``COXSWAIN_TEST_TRAINED_LOG``."""
    idx, gids, seen = batch.get_meta("prompt_index"), batch.group_ids.tolist(), set()
    prompts = []
    for i, g in zip(idx, gids):
        if g not in seen:
            seen.add(g)
            prompts.append(int(i))
    with open(os.environ["COXSWAIN_TEST_TRAINED_LOG"], "a") as f:
        f.write(json.dumps(prompts) + "\n")
        f.flush()
        os.fsync(f.fileno())


def double_push(s):
    """trainer.pipeline: the default step, then a second weight push (fault injection: the versions run
    ahead of what the quota plans for, so queued samples fall behind the staleness bound)."""
    from trainer.pipeline import default_pipeline

    default_pipeline(s)
    s.sync_weights()
