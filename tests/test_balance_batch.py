"""verl's ``trainer.balance_batch``: the data-parallel shards are token-balanced (true, verl's default) or
contiguous chunks of the batch in the sampler's order (false); ``global_seqlen/*`` are verl's
``log_seqlen_unbalance`` of the split (checked against verl 0.9.1's own function)."""

import pytest
import torch

from tests.support.batches import random_batch
from tests.support.tiny import tiny_config
from trainer.step_data import Partition
from verl.utils.seqlen_balancing import log_seqlen_unbalance


@pytest.mark.parametrize("n,dp", [(16, 2), (32, 4), (12, 3), (10, 4)])
def test_contiguous_and_balanced_shards(n, dp):
    b = random_batch(n, 6, 6, seed=n + dp)
    tokens = b.num_tokens.tolist()
    flat = Partition(b, dp, balanced=False)
    assert [r for ix in flat.index_lists for r in ix] == list(range(n))  # the sampler's order, in chunks
    assert [len(ix) for ix in flat.index_lists] == [n // dp + (d < n % dp) for d in range(dp)]
    if n % dp:  # equal token-balanced shards need dp | n (so does verl's); the contiguous chunks do not
        with pytest.raises(ValueError, match="multiple of k"):
            Partition(b, dp, balanced=True)
        bal = flat
    else:
        bal = Partition(b, dp, balanced=True)
    assert sorted(r for ix in bal.index_lists for r in ix) == list(range(n))
    assert {len(ix) for ix in bal.index_lists} <= {n // dp, -(-n // dp)}  # equal sizes
    spread = lambda p: max(sum(tokens[i] for i in ix) for ix in p.index_lists) - min(
        sum(tokens[i] for i in ix) for ix in p.index_lists)
    assert spread(bal) <= spread(flat)
    for p in (flat, bal):
        want = log_seqlen_unbalance(seqlen_list=tokens, partitions=p.index_lists, prefix="global_seqlen")
        got = p.seqlen_metrics()
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(float(want[k])), k


def test_the_key_reaches_the_plan_and_the_step():
    from trainer.main import train
    from trainer.plan import Plan

    assert Plan.from_config(tiny_config([]), total_steps=1).balance_batch is True
    cfg = tiny_config(["trainer.balance_batch=false", "trainer.total_training_steps=1", "trainer.test_freq=-1",
                       "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.debug.in_process=true",
                       "trainer.n_gpus_per_node=1", "trainer.logger=[console]", "data.train_batch_size=4",
                       "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "data.max_response_length=4"])
    assert Plan.from_config(cfg, total_steps=1).balance_batch is False
    h = train(cfg)["history"][-1]
    # one rank: its shard is the whole batch, either way
    assert h["global_seqlen/balanced_max"] == h["global_seqlen/max"] == h["global_seqlen/mean"] > 0
