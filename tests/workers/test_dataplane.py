"""The driver's data plane (``trainer.workers.dataplane``) and the update's mini-batch plan, without
workers: shards are trimmed to their own width and cover the batch exactly once; results gather back
to batch order and width; a result made for one partition is re-sharded for another; every
mini-batch's global counts are the counts of exactly the rows the ranks train on."""

import numpy as np
import pytest
import torch

from tests.support.batches import random_batch
from trainer.algos.losses import batch_norm_counts
from trainer.batch import RolloutBatch
from trainer.plan import UpdateSettings
from trainer.workers.dataplane import Sharded, StepData, Transport, shard_batch
from trainer.workers.roles import plan_mini_batches


def _wide_batch(n=16, seed=0):
    b = random_batch(n, P=6, T=6, seed=seed)
    return b.widen(10, 9)  # four all-pad prompt columns and three all-pad response columns on every row


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_shards_are_trimmed_and_cover_the_batch(dp):
    batch = _wide_batch()
    data = StepData(batch, Transport(in_process=True))
    part = data.partition(dp)
    assert sorted(i for ix in part.index_lists for i in ix) == list(range(16))
    for rows, shard in zip(part.rows, data.shards(dp)):
        sub = batch[rows]
        # the shard's widths are its own longest prompt and response
        assert shard["prompts"].shape[1] == int(sub.prompt_length.max())
        assert shard["responses"].shape[1] == int(sub.response_length.max())
        # and the rank rebuilds exactly the rows' real tokens and positions
        rebuilt = shard_batch(shard)
        for i in range(len(rows)):
            for f in ("input_ids", "position_ids"):
                want = getattr(sub, f)[i][sub.attention_mask[i].bool()]
                got = getattr(rebuilt, f)[i][rebuilt.attention_mask[i].bool()]
                assert torch.equal(want, got), f
            assert torch.equal(sub.response_mask[i, :shard["responses"].shape[1]].bool(), rebuilt.response_mask[i].bool())
    # a second call reuses the same references: one put per shard per step
    assert data.shards(dp) is data.shards(dp)


def test_scatter_gather_round_trip_and_zero_padding():
    batch = _wide_batch()
    data = StepData(batch, Transport(in_process=True))
    part = data.partition(4)
    x = torch.randn(16, 9) * batch.response_mask  # a per-token field, 0 on padding
    back = part.gather(part.scatter(x))
    assert torch.equal(back, x)
    assert all(p.shape[1] == w for p, w in zip(part.scatter(x), part.widths))


def test_a_result_follows_its_partition_or_is_resharded():
    batch = _wide_batch()
    t = Transport(in_process=True)
    data = StepData(batch, t)
    x = torch.randn(16, 9) * batch.response_mask
    res = Sharded(data.partition(2), [{"log_probs": a} for a in data.partition(2).scatter(x)], t)
    assert res.refs_for(data, 2) is res.refs  # same partition: passed on as it is
    four = res.refs_for(data, 4)  # another DP size: through the driver, into the other partition
    assert torch.equal(data.partition(4).gather([r["log_probs"] for r in four]), x)
    torch.testing.assert_close(res.fetch()["log_probs"], x)


@pytest.mark.parametrize("dp,mb,epochs,shuffle", [(1, 8, 1, False), (2, 8, 2, True), (4, 16, 1, True), (2, 16, 1, False)])
def test_mini_batch_plan_counts_are_the_trained_rows(dp, mb, epochs, shuffle):
    batch = _wide_batch()
    data = StepData(batch, Transport(in_process=True))
    part = data.partition(dp)
    s = UpdateSettings(mini_batch_size=mb, epochs=epochs, shuffle=shuffle, micro_batch_size=4)
    local, counts = plan_mini_batches(part, batch.response_mask, s, seed=5, agg_mode="seq-mean-token-mean")
    assert len(counts) == epochs * (16 // mb) and all(len(l) == len(counts) for l in local)
    for e in range(epochs):  # every epoch trains on every row exactly once
        k0, k1 = e * 16 // mb, (e + 1) * 16 // mb
        rows = [part.rows_of([torch.tensor(local[d][k]) for d in range(dp)]) for k in range(k0, k1)]
        assert sorted(r for rr in rows for r in rr) == list(range(16))
        for k, rr in zip(range(k0, k1), rows):
            assert len(rr) == mb
            n_tok, n_seq = batch_norm_counts(batch.response_mask[rr], "token-mean")
            assert counts[k] == (float(n_tok), float(n_seq))
    with pytest.raises(ValueError, match="multiple of the DP size"):
        plan_mini_batches(data.partition(4), batch.response_mask,
                          UpdateSettings(mini_batch_size=6, epochs=1, shuffle=False, micro_batch_size=4), seed=0,
                          agg_mode="token-mean")


def test_transport_counts_what_enters_and_leaves_the_driver():
    t = Transport(in_process=True)
    a = np.zeros((4, 8), dtype=np.float32)
    ref = t.put({"x": a})
    t.get([ref])
    assert t.take_metrics() == {"dataplane/driver_bytes_out": 128.0, "dataplane/driver_bytes_in": 128.0}
    assert t.take_metrics()["dataplane/driver_bytes_out"] == 0.0


def test_widen_and_cat_of_batches_of_different_widths():
    a, b = random_batch(4, P=3, T=2, seed=1), random_batch(4, P=6, T=5, seed=2)
    a.step_ids = torch.zeros(4, 2, dtype=torch.long)
    b.step_ids = torch.ones(4, 5, dtype=torch.long)
    c = RolloutBatch.cat([a, b])
    assert (c.prompt_width, c.response_width) == (6, 5)
    w = a.widen(6, 5)
    assert torch.equal(c[:4].input_ids, w.input_ids) and torch.equal(c[4:].input_ids, b.input_ids)
    # real tokens and their order are unchanged; pads are masked; step_ids pad with -1 (no turn)
    for i in range(4):
        assert torch.equal(w.input_ids[i][w.attention_mask[i].bool()], a.input_ids[i][a.attention_mask[i].bool()])
    assert (w.step_ids[:, 2:] == -1).all() and (w.step_ids[:, :2] == 0).all()
    assert torch.equal(w.trim_padding()[0].input_ids, a.trim_padding()[0].input_ids)
    with pytest.raises(ValueError, match="narrower"):
        b.widen(3, 5)
