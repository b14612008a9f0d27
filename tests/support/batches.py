"""Shared test data: a random RolloutBatch with ragged prompts and responses (tests/ is on sys.path)."""

import torch


def random_batch(n=16, P=6, T=6, seed=0):
    """``n`` rows: left-padded prompts of 3..P tokens, responses of 1..T tokens, groups of 4, random advantages."""
    from trainer.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(3, P + 1, (n,), generator=g)
    rlen = torch.randint(1, T + 1, (n,), generator=g)
    pm = torch.arange(P)[None] >= (P - plen)[:, None]
    rm = torch.arange(T)[None] < rlen[:, None]
    prompts = torch.randint(2, 16, (n, P), generator=g) * pm
    resp = torch.randint(2, 16, (n, T), generator=g) * rm
    b = RolloutBatch.from_tokens(prompts, resp, pm, rm, group_ids=torch.arange(n) // 4)
    b.advantages = torch.randn(n, T, generator=g) * rm
    return b
