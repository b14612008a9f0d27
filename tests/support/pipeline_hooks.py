"""User pipeline stages for tests/test_pipeline.py, loaded by name as a user's package would be
(``trainer.hooks.<point>=[tests.support.pipeline_hooks:fn]``, ``trainer.pipeline=tests.support.pipeline_hooks:fn``)."""

import torch

SEEN: list[dict] = []  # what the observer saw at each step (the driver runs the hooks in this process)
SCALE = 3.0
# the samples the filter drops: (group position in the step, response index in its group)
DROP = ((0, 1), (2, 5), (5, 0))


def scale_rewards(batch, metrics):
    """after_reward: every reward times SCALE (the per-token scores and the per-sample score alike)."""
    batch.token_level_scores = batch.token_level_scores * SCALE
    batch.scores = batch.scores * SCALE
    metrics["hooks/scaled"] = SCALE


def drop_named(batch, metrics):
    """after_reward: drop the responses DROP names (a filter plugin), return the smaller batch."""
    gids = torch.unique_consecutive(batch.group_ids)
    drop = set()
    for g, j in DROP:
        rows = (batch.group_ids == gids[g]).nonzero().squeeze(-1)
        drop.add(int(rows[j]))
    keep = torch.tensor([i for i in range(batch.num_samples) if i not in drop])
    metrics["hooks/named_drops"] = float(len(drop))
    return batch[keep]


def observe(batch, metrics):
    """after_update: record what the update trained on."""
    SEEN.append({"advantages": batch.advantages.clone(), "scores": batch.scores.clone(),
                 "mask": batch.response_mask.clone(), "group_ids": batch.group_ids.clone(),
                 "n": batch.num_samples, "metrics": dict(metrics),
                 "tags": batch.get_meta("hook_tag") if batch.meta is not None and "hook_tag" in batch.meta.keys() else None})


EVALS: list[dict] = []


def observe_eval(batch, metrics):
    """after_eval: record the validation metrics the hook saw."""
    EVALS.append(dict(metrics))


def tag_samples(batch, metrics):
    """after_rollout: add a per-sample field the later hooks read."""
    batch.set_meta("hook_tag", [f"r{i}" for i in range(batch.num_samples)])


def no_reference(s):
    """A user pipeline: the default step without the reference pass (and so without the KL loss)."""
    s.generate()
    s.forward_passes(ref=False)
    s.advantages()
    s.update_actor(kl_loss=False)
    s.hook("after_update")
    s.sync_weights()
    s.validate()


def bad_drop_late(batch, metrics):
    """before_advantages may not drop samples: the ranks already hold the batch."""
    return batch[torch.arange(batch.num_samples - 2)]
