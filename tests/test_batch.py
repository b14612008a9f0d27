"""Tests for trainer/batch.py: the schema, split/cat/index, numpy transport and balanced partitioning.

Partitioning is checked against a brute-force optimum (every assignment of items to parts) on small
inputs, with the published worst-case ratios as per-instance bounds:
  * LPT, free:                         max <= (4/3 - 1/(3k)) OPT   (Graham 1969)
  * Karmarkar-Karp (LDM), free:        max <= (4/3 - 1/(3k)) OPT   (Michiels, Korst, Aarts, van Leeuwen 2007;
                                                                    7/6 for k=2, Fischetti & Martello 1987)
  * Karmarkar-Karp, equal sizes:       max <= (2 - 1/k) OPT        (Michiels et al. 2003, k parts given)
and, on seeded random instances, KK's mean ratio to OPT is compared with a random partition's.
"""

from __future__ import annotations

import inspect
import itertools
import pickle
import random
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import trainer.batch as tb
from trainer.batch import (
    FIELD_SPECS,
    RolloutBatch,
    greedy_lpt,
    inverse_permutation,
    karmarkar_karp,
    make_meta,
    partition_imbalance,
    restore_order,
)

# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------

FLOAT_BT = [n for n, (d, k) in FIELD_SPECS.items() if d == ("B", "T") and k == tb.FLOAT]


def make_batch(b=6, p=5, t=7, seed=0, full=True, meta=True) -> RolloutBatch:
    """A batch with ragged left-padded prompts and right-padded responses, every field filled."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(1, p + 1, (b,), generator=g)  # [B] real prompt tokens
    rlen = torch.randint(0, t + 1, (b,), generator=g)  # [B] real response tokens (0 allowed)
    cols_p = torch.arange(p)
    cols_t = torch.arange(t)
    prompt_mask = cols_p[None, :] >= (p - plen)[:, None]  # [B, P] left padding
    resp_attn = cols_t[None, :] < rlen[:, None]  # [B, T] right padding
    prompts = torch.randint(1, 100, (b, p), generator=g) * prompt_mask
    responses = torch.randint(1, 100, (b, t), generator=g) * resp_attn
    fields = {}
    if full:
        for n in FLOAT_BT:
            fields[n] = torch.randn(b, t, generator=g)
        fields["step_ids"] = torch.where(resp_attn, torch.randint(0, 3, (b, t), generator=g), -1)
        real = torch.cat([prompt_mask, resp_attn], 1)  # [B, P+T]
        fields["routed_experts"] = torch.where(real[..., None, None], torch.randint(0, 8, (b, p + t, 2, 2), generator=g),
                                               -1).to(torch.int16)
        fields["group_ids"] = torch.arange(b) // 2
        fields["acc"] = torch.randint(0, 2, (b,), generator=g).float()
        fields["scores"] = torch.randn(b, generator=g)
    m = None
    if meta:
        m = {
            "data_source": [f"src{i % 3}" for i in range(b)],
            "ground_truth": [[i, [i + 1]] if i % 2 else {"answer": str(i)} for i in range(b)],
        }
    return RolloutBatch.from_tokens(prompts, responses, prompt_mask, resp_attn, meta=m, **fields)


def assert_batch_equal(a: RolloutBatch, b: RolloutBatch):
    assert a.batch_size == b.batch_size
    assert a.present_fields() == b.present_fields()
    for n in FIELD_SPECS:
        x, y = getattr(a, n), getattr(b, n)
        if x is None:
            assert y is None, n
            continue
        assert x.dtype == y.dtype, n
        assert torch.equal(x, y), n
    if a.meta is not None:
        assert sorted(a.meta.keys()) == sorted(b.meta.keys())
        for k in a.meta.keys():
            va, vb = a.meta.get(k), b.meta.get(k)
            if isinstance(va, torch.Tensor):
                assert torch.equal(va, vb), k
            else:
                la, lb = a.get_meta(k), b.get_meta(k)
                assert la == lb, k
                assert [type(v) for v in la] == [type(v) for v in lb], k


def brute_force_opt(seqlens, k, equal_size):
    """Minimum over every assignment of items to k parts of the largest part sum (item 0 is put in
    part 0: the parts are interchangeable)."""
    n = len(seqlens)
    if n == 0:
        return 0
    rest = list(itertools.product(range(k), repeat=n - 1))  # k^(n-1) tuples (one empty tuple if n == 1)
    assign = np.array(rest, dtype=np.int64).reshape(len(rest), n - 1)
    assign = np.concatenate([np.zeros((assign.shape[0], 1), dtype=np.int64), assign], axis=1)  # [A, n]
    onehot = assign[:, :, None] == np.arange(k)[None, None, :]  # [A, n, k]
    if equal_size:
        ok = (onehot.sum(1) == n // k).all(1)
        onehot = onehot[ok]
    sums = np.einsum("ank,n->ak", onehot.astype(np.int64), np.asarray(seqlens, dtype=np.int64))
    return int(sums.max(1).min())


def max_load(seqlens, parts):
    return max(sum(seqlens[i] for i in p) for p in parts)


def assert_valid_partition(parts, n, k, equal_size):
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(n))
    if equal_size:
        assert all(len(p) == n // k for p in parts)


# --------------------------------------------------------------------------------------------------
# schema
# --------------------------------------------------------------------------------------------------


def test_field_comments_match_the_schema():
    # Every field's comment in the class body states the shape FIELD_SPECS checks.
    src = inspect.getsource(RolloutBatch)
    for name, (dims, _) in FIELD_SPECS.items():
        line = next(l for l in src.splitlines() if re.match(rf"\s+{name}:", l))
        want = "[" + ", ".join("P+T" if d == "L" else d for d in dims) + "]"
        assert f"# {want}" in line, (name, line)


def test_from_tokens_golden():
    # Two samples, P=3, T=4.
    # sample 0: prompt [pad, 11, 12], response [21, 22, 23, pad]  -> 2 + 3 = 5 real tokens
    # sample 1: prompt [13, 14, 15],  response [24, pad, pad, pad] -> 3 + 1 = 4 real tokens
    prompts = torch.tensor([[0, 11, 12], [13, 14, 15]])
    responses = torch.tensor([[21, 22, 23, 0], [24, 0, 0, 0]])
    pm = torch.tensor([[0, 1, 1], [1, 1, 1]])
    rm = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    b = RolloutBatch.from_tokens(prompts, responses, pm, rm)
    assert b.input_ids.tolist() == [[0, 11, 12, 21, 22, 23, 0], [13, 14, 15, 24, 0, 0, 0]]
    # position = (cumsum of the mask) - 1, clamped at 0:
    # sample 0 mask 0 1 1 1 1 1 0 -> cumsum 0 1 2 3 4 5 5 -> -1 0 1 2 3 4 4 -> 0 0 1 2 3 4 4
    # sample 1 mask 1 1 1 1 0 0 0 -> cumsum 1 2 3 4 4 4 4 -> 0 1 2 3 3 3 3
    assert b.position_ids.tolist() == [[0, 0, 1, 2, 3, 4, 4], [0, 1, 2, 3, 3, 3, 3]]
    assert b.attention_mask.dtype == torch.bool
    assert b.prompt_length.tolist() == [2, 3]
    assert b.response_length.tolist() == [3, 1]
    assert b.num_tokens.tolist() == [5, 4]
    assert b.num_loss_tokens.tolist() == [3, 1]
    assert (b.prompt_width, b.response_width, b.num_samples) == (3, 4, 2)


def test_multi_turn_tool_tokens_count_for_length_not_for_loss():
    # Response of 6 tokens: 2 sampled, 2 tool-output tokens, 1 sampled, 1 pad.
    # response_length counts every real token (5); the loss mask counts sampled ones (3).
    prompts = torch.tensor([[5, 6]])
    responses = torch.tensor([[1, 2, 90, 91, 3, 0]])
    real = torch.tensor([[1, 1, 1, 1, 1, 0]])
    loss = torch.tensor([[1, 1, 0, 0, 1, 0]])
    b = RolloutBatch.from_tokens(prompts, responses, torch.ones(1, 2), real, response_mask=loss)
    assert b.response_length.tolist() == [5]
    assert b.num_loss_tokens.tolist() == [3]
    assert b.num_tokens.tolist() == [7]  # 2 prompt + 5 response


@pytest.mark.parametrize("name", list(FIELD_SPECS))
def test_wrong_shape_names_the_field(name):
    b = make_batch(full=False, meta=False)
    B, P, T = 6, 5, 7
    dims, kind = FIELD_SPECS[name]
    size = {"B": B, "P": P, "T": T, "L": P + T, "R": 2, "K": 3}
    shape = [size[d] for d in dims]
    dtype = {tb.INT64: torch.int64, tb.MASK: torch.bool, tb.FLOAT: torch.float32, tb.INDEX: torch.int16}[kind]
    # 1) one dim too many
    with pytest.raises(ValueError, match=rf"RolloutBatch\.{name} must have shape"):
        setattr(b, name, torch.zeros(*shape, 2, dtype=dtype))
    # 2) a wrong non-batch size (fields with a second dim)
    if len(shape) > 1:
        bad = shape.copy()
        bad[1] += 1
        with pytest.raises(ValueError, match=rf"RolloutBatch\.{name} must have shape .*dim 1 is {bad[1]}"):
            setattr(b, name, torch.zeros(*bad, dtype=dtype))
    # 3) wrong dtype class
    wrong = torch.float32 if kind != tb.FLOAT else torch.int64
    with pytest.raises(ValueError, match=rf"RolloutBatch\.{name} must be"):
        setattr(b, name, torch.zeros(*shape, dtype=wrong))
    # 4) wrong batch size: tensordict's own check, which also names the field
    with pytest.raises(RuntimeError, match=name):
        setattr(b, name, torch.zeros(B + 1, *shape[1:], dtype=dtype))
    # and the right value is accepted
    setattr(b, name, torch.zeros(*shape, dtype=dtype))
    assert getattr(b, name).shape == torch.Size(shape)


def test_constructor_checks_cross_field_sizes():
    B, P, T = 3, 4, 5
    ok = dict(
        prompts=torch.zeros(B, P, dtype=torch.long),
        responses=torch.zeros(B, T, dtype=torch.long),
        attention_mask=torch.ones(B, P + T, dtype=torch.bool),
        response_mask=torch.ones(B, T, dtype=torch.bool),
    )
    RolloutBatch(**ok, batch_size=[B])
    with pytest.raises(ValueError, match=r"attention_mask .*P\+T=9"):
        RolloutBatch(**{**ok, "attention_mask": torch.ones(B, P + T + 1, dtype=torch.bool)}, batch_size=[B])
    with pytest.raises(ValueError, match=r"old_log_probs .*T=5 \(from 'responses'\)"):
        RolloutBatch(**ok, old_log_probs=torch.zeros(B, T - 1), batch_size=[B])
    with pytest.raises(ValueError, match=r"prompts must be int64"):
        RolloutBatch(**{**ok, "prompts": torch.zeros(B, P, dtype=torch.int32)}, batch_size=[B])
    with pytest.raises(TypeError, match="meta must be a TensorDict"):
        RolloutBatch(**ok, meta=["a", "b", "c"], batch_size=[B])
    # masks may be integer as well as bool
    RolloutBatch(**{**ok, "response_mask": torch.ones(B, T, dtype=torch.int64)}, batch_size=[B])


def test_optional_fields_start_none_and_can_be_cleared():
    b = make_batch(full=False)
    assert b.old_log_probs is None and b.advantages is None and b.values is None
    b.values = torch.zeros(6, 7)
    assert "values" in b.present_fields()
    b.values = None
    assert b.values is None and "values" not in b.present_fields()


# --------------------------------------------------------------------------------------------------
# split / cat / index / to
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 6])
def test_dp_split_cat_round_trip(k):
    b = make_batch()
    parts = b.dp_split(k)
    assert [p.num_samples for p in parts] == [6 // k] * k
    # each chunk is the contiguous slice of every field
    for i, p in enumerate(parts):
        rows = torch.arange(i * 6 // k, (i + 1) * 6 // k)
        assert torch.equal(p.old_log_probs, b.old_log_probs[rows])
        assert p.get_meta("data_source") == [b.get_meta("data_source")[j] for j in rows.tolist()]
    assert_batch_equal(RolloutBatch.cat(parts), b)


def test_dp_split_uneven():
    b = make_batch(b=7)
    with pytest.raises(ValueError, match=r"7 samples does not divide into 3 equal chunks \(7 % 3 = 1\)"):
        b.dp_split(3)
    parts = b.dp_split(3, allow_uneven=True)
    assert [p.num_samples for p in parts] == [3, 2, 2]
    assert_batch_equal(RolloutBatch.cat(parts), b)
    # more ranks than samples: some chunks are empty, still exactly k of them
    parts = b.dp_split(9, allow_uneven=True)
    assert [p.num_samples for p in parts] == [1] * 7 + [0, 0]
    assert_batch_equal(RolloutBatch.cat(parts), b)


def test_index_select_matches_per_field_indexing():
    b = make_batch(b=8)
    idx = torch.tensor([5, 0, 3, 3])  # any order, repeats allowed
    s = b[idx]
    assert s.num_samples == 4
    for n in FIELD_SPECS:
        assert torch.equal(getattr(s, n), getattr(b, n)[idx]), n
    gt = b.get_meta("ground_truth")
    assert s.get_meta("ground_truth") == [gt[i] for i in idx.tolist()]
    # empty selection (a DAPO filter that keeps no group) gives an empty batch with the same fields
    e = b[torch.zeros(0, dtype=torch.long)]
    assert e.num_samples == 0 and e.present_fields() == b.present_fields()
    assert e.get_meta("data_source") == []
    assert_batch_equal(RolloutBatch.cat([e, b]), b)
    # a boolean mask selects too
    keep = torch.tensor([True, False] * 4)
    assert_batch_equal(b[keep], b[torch.arange(0, 8, 2)])


def test_cat_of_mismatched_parts_names_the_fields():
    a = make_batch(full=False)
    b = make_batch(full=False)
    b.old_log_probs = torch.zeros(6, 7)
    with pytest.raises(ValueError, match=r"missing \(part index -> fields\): \{0: \['old_log_probs'\]\}"):
        RolloutBatch.cat([a, b])
    c = make_batch(full=False)
    c.set_meta("uid", list(range(6)))
    with pytest.raises(ValueError, match=r"meta keys differ.*\{0: \['uid'\]\}"):
        RolloutBatch.cat([a, c])


def test_to_device_and_pickle():
    b = make_batch()
    assert_batch_equal(b.to("cpu"), b)
    assert_batch_equal(pickle.loads(pickle.dumps(b)), b)


@pytest.mark.gpu
def test_to_cuda_round_trip():
    b = make_batch()
    g = b.to("cuda")
    assert g.old_log_probs.is_cuda and g.prompts.is_cuda
    assert g.get_meta("ground_truth") == b.get_meta("ground_truth")
    assert_batch_equal(g.to("cpu"), b)
    # numpy transport from a GPU batch copies to host
    assert_batch_equal(RolloutBatch.from_numpy_dict(g.to_numpy_dict()), b)


def test_set_meta_and_get_meta():
    b = make_batch(meta=False)
    with pytest.raises(KeyError, match="no key 'uid'"):
        b.get_meta("uid")
    b.set_meta("uid", [f"u{i}" for i in range(6)])
    b.set_meta("tools", [None, [1, 2], (3,), {"a": [1]}, "x", 2.5])
    assert b.get_meta("uid") == [f"u{i}" for i in range(6)]
    # objects come back as given: lists stay lists, tuples stay tuples, None stays None
    assert b.get_meta("tools") == [None, [1, 2], (3,), {"a": [1]}, "x", 2.5]
    assert type(b.get_meta("tools")[2]) is tuple
    with pytest.raises(ValueError, match="needs 6 values"):
        b.set_meta("bad", [1, 2])


# --------------------------------------------------------------------------------------------------
# numpy transport
# --------------------------------------------------------------------------------------------------


def test_numpy_round_trip_dtypes_and_meta():
    b = make_batch()
    b.old_log_probs = b.old_log_probs.bfloat16()  # numpy has no bf16: travels as int16 bits
    b.ref_log_probs = b.ref_log_probs.double()
    b.response_mask = b.response_mask.to(torch.int32)
    b.meta.set("uid_tensor", torch.arange(6))  # a tensor entry in meta
    d = b.to_numpy_dict()
    # plain numpy / lists only: what Ray moves without torch's pickler
    assert all(isinstance(a, np.ndarray) for a in d["fields"].values())
    assert all(isinstance(v, list) for v in d["meta"].values())
    assert d["torch_dtypes"] == {"old_log_probs": "bfloat16"}
    # zero-copy on the way out: the arrays view the tensors' memory
    assert d["fields"]["prompts"].ctypes.data == b.prompts.data_ptr()
    r = RolloutBatch.from_numpy_dict(pickle.loads(pickle.dumps(d, protocol=5)))
    assert_batch_equal(r, b)
    assert r.old_log_probs.dtype == torch.bfloat16 and r.response_mask.dtype == torch.int32


def test_from_numpy_copies_read_only_arrays_only():
    b = make_batch(meta=False)
    d = b.to_numpy_dict()
    for a in d["fields"].values():
        a.flags.writeable = False  # as Ray's object store hands them over
    r = RolloutBatch.from_numpy_dict(d)
    r.advantages.add_(1.0)  # must be safe to write
    assert torch.equal(r.advantages, b.advantages + 1.0)
    d2 = b.to_numpy_dict()  # writable arrays: shared, no copy
    r2 = RolloutBatch.from_numpy_dict(d2)
    assert r2.advantages.data_ptr() == b.advantages.data_ptr()
    r3 = RolloutBatch.from_numpy_dict(d2, copy=True)
    assert r3.advantages.data_ptr() != b.advantages.data_ptr()
    assert_batch_equal(r3, b)


# --------------------------------------------------------------------------------------------------
# partitioning: golden numbers
# --------------------------------------------------------------------------------------------------


def test_partition_imbalance_golden():
    # sums: {0,3} -> 10+40 = 50, {1} -> 20, {2} -> 30; total 100, mean 100/3 = 33.33..
    # imbalance = 50 / (100/3) = 1.5
    m = partition_imbalance([10, 20, 30, 40], [[0, 3], [1], [2]])
    assert m == {"max_tokens": 50.0, "min_tokens": 20.0, "mean_tokens": pytest.approx(100 / 3), "imbalance_ratio": pytest.approx(1.5)}
    # an empty part counts in the mean: sums 30, 0 -> mean 15, ratio 2
    assert partition_imbalance([10, 20], [[0, 1], []])["imbalance_ratio"] == 2.0
    assert partition_imbalance([0, 0], [[0], [1]])["imbalance_ratio"] == 1.0


def test_kk_golden_three_way():
    # [4, 6, 7, 5, 8] into 3 (free). Differencing by hand (states as sorted k-tuples of sums):
    #   (8,0,0) (7,0,0) (6,0,0) (5,0,0) (4,0,0)
    #   merge the two largest spreads 8,7 -> (8,7,0) spread 8; then with (6,0,0) -> (8,7,6) spread 2
    #   (5,0,0)+(4,0,0) -> (5,4,0) spread 5; with (8,7,6): 5+6, 4+7, 0+8 -> (11,11,8)
    # Optimum is 11 too: 8 alone leaves 22 for two parts.
    s = [4, 6, 7, 5, 8]
    parts = karmarkar_karp(s, 3, equal_size=False)
    assert sorted(sum(s[i] for i in p) for p in parts) == [8, 11, 11]
    assert brute_force_opt(s, 3, False) == 11


def test_kk_golden_equal_size():
    # [1..6] into 2 parts of 3. Sorted runs of k=2: (6,5) (4,3) (2,1), each spread 1.
    #   (6,5)+(4,3): 6+3, 5+4 -> (9,9) spread 0;  (2,1)+(9,9): 2+9, 1+9 -> (11,10)
    # Total 21 is odd, so 11 is optimal.
    s = [1, 2, 3, 4, 5, 6]
    parts = karmarkar_karp(s, 2, equal_size=True)
    assert sorted(sum(s[i] for i in p) for p in parts) == [10, 11]
    assert [len(p) for p in parts] == [3, 3]


def test_kk_and_lpt_are_heuristics_golden_suboptimal_case():
    # [4,5,6,7,8] into 2: the optimum is {4,5,6} | {7,8} = 15 | 15.
    # KK: 8-7=1, 6-5=1, then 4 vs (1 diff) -> (11,8) spread 3, then (11,8)+(6,5) -> (16,14): max 16.
    # LPT: 8->A, 7->B, 6->B(13), 5->A(13), 4->A (tie, lower index) = 17: max 17.
    s = [4, 5, 6, 7, 8]
    assert brute_force_opt(s, 2, False) == 15
    assert max_load(s, karmarkar_karp(s, 2, False)) == 16
    assert max_load(s, greedy_lpt(s, 2, False)) == 17
    # both within their bounds: 16/15 <= 7/6 and 17/15 <= 4/3 - 1/6 = 7/6
    assert 16 / 15 <= 7 / 6 and 17 / 15 <= 7 / 6


def test_partition_errors():
    with pytest.raises(ValueError, match=r"equal_size needs the number of items \(5\) to be a multiple of k \(2\)"):
        karmarkar_karp([1, 2, 3, 4, 5], 2, True)
    with pytest.raises(ValueError, match="multiple of k"):
        greedy_lpt([1, 2, 3], 2, True)
    with pytest.raises(ValueError, match="k must be >= 1"):
        karmarkar_karp([1], 0, False)
    # more parts than items (free): the extra parts are empty
    parts = karmarkar_karp([3, 1], 4, False)
    assert_valid_partition(parts, 2, 4, False)
    assert sorted(len(p) for p in parts) == [0, 0, 1, 1]
    assert karmarkar_karp([], 3, True) == [[], [], []]


# --------------------------------------------------------------------------------------------------
# partitioning: against brute force
# --------------------------------------------------------------------------------------------------

CASES = [(8, 2, True), (8, 2, False), (9, 3, True), (8, 3, False)]


@pytest.mark.parametrize("n,k,equal_size", CASES)
def test_kk_vs_brute_force_and_random(n, k, equal_size):
    rng = random.Random(1234 + n * 10 + k)
    kk_r, lpt_r, rand_r = [], [], []
    kk_bound = (2 - 1 / k) if equal_size else (4 / 3 - 1 / (3 * k))
    for _ in range(40):
        s = [rng.randint(1, 1000) for _ in range(n)]
        opt = brute_force_opt(s, k, equal_size)
        kk = karmarkar_karp(s, k, equal_size)
        lpt = greedy_lpt(s, k, equal_size)
        assert_valid_partition(kk, n, k, equal_size)
        assert_valid_partition(lpt, n, k, equal_size)
        assert opt <= max_load(s, kk) <= kk_bound * opt + 1e-9
        if not equal_size:
            assert max_load(s, lpt) <= (4 / 3 - 1 / (3 * k)) * opt + 1e-9
        # a random partition with the same constraint
        idx = list(range(n))
        rng.shuffle(idx)
        if equal_size:
            rnd = [idx[j * n // k : (j + 1) * n // k] for j in range(k)]
        else:
            a = [rng.randrange(k) for _ in range(n)]
            rnd = [[i for i in range(n) if a[i] == p] for p in range(k)]
        kk_r.append(max_load(s, kk) / opt)
        lpt_r.append(max_load(s, lpt) / opt)
        rand_r.append(max_load(s, rnd) / opt)
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    # On average KK is within a few percent of the optimum and far better than random.
    assert mean(kk_r) <= mean(rand_r)
    assert mean(kk_r) <= 1.03
    assert mean(kk_r) <= mean(lpt_r) + 1e-9


@settings(max_examples=60, deadline=None)
@given(
    s=st.lists(st.integers(1, 100), min_size=1, max_size=7),
    k=st.integers(2, 4),
)
def test_lpt_and_kk_free_within_graham_bound(s, k):
    opt = brute_force_opt(s, k, False)
    bound = 4 / 3 - 1 / (3 * k)
    for fn in (greedy_lpt, karmarkar_karp):
        parts = fn(s, k, False)
        assert_valid_partition(parts, len(s), k, False)
        assert opt <= max_load(s, parts) <= bound * opt + 1e-9, fn.__name__


@settings(max_examples=40, deadline=None)
@given(data=st.data(), k=st.integers(2, 3))
def test_kk_equal_size_within_bound(data, k):
    m = data.draw(st.integers(1, 3))  # items per part
    s = data.draw(st.lists(st.integers(1, 100), min_size=m * k, max_size=m * k))
    opt = brute_force_opt(s, k, True)
    for fn in (karmarkar_karp, greedy_lpt):
        parts = fn(s, k, True)
        assert_valid_partition(parts, len(s), k, True)
        assert max_load(s, parts) >= opt
    assert max_load(s, karmarkar_karp(s, k, True)) <= (2 - 1 / k) * opt + 1e-9


# --------------------------------------------------------------------------------------------------
# balanced_split / restore_order
# --------------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 12), k=st.integers(1, 4), method=st.sampled_from(["kk", "lpt"]), seed=st.integers(0, 10_000))
def test_balanced_split_restore_is_identity(b, k, method, seed):
    batch = make_batch(b=b, seed=seed)
    equal = b % k == 0
    parts, index_lists, metrics = batch.balanced_split(k, method=method, equal_size=equal)
    assert_valid_partition(index_lists, b, k, equal)
    for p, ix in zip(parts, index_lists):
        assert_batch_equal(p, batch[torch.tensor(ix, dtype=torch.long)])
    assert_batch_equal(restore_order(parts, index_lists), batch)
    # a worker's per-sample tensor output comes back in order too
    outs = [p.num_tokens * 10 for p in parts]
    assert torch.equal(restore_order(outs, index_lists), batch.num_tokens * 10)
    sums = [int(p.num_tokens.sum()) for p in parts]
    assert metrics["max_tokens"] == max(sums) and metrics["min_tokens"] == min(sums)


def test_balanced_split_beats_contiguous_on_sorted_lengths():
    # 16 samples with 1..16 tokens, sorted: contiguous 4-way split sums are
    # 1+2+3+4=10, 26, 42, 58 -> mean 136/4 = 34, naive imbalance 58/34.
    b = 16
    plen = torch.arange(1, 17)
    prompts = torch.ones(b, 16, dtype=torch.long)
    pm = torch.arange(16)[None, :] >= (16 - plen)[:, None]
    batch = RolloutBatch.from_tokens(prompts, torch.zeros(b, 1, dtype=torch.long), pm, torch.zeros(b, 1))
    assert batch.num_tokens.tolist() == list(range(1, 17))
    parts, ix, m = batch.balanced_split(4, method="kk")
    assert m["naive_imbalance_ratio"] == pytest.approx(58 / 34)
    assert m["mean_tokens"] == 34.0
    assert m["imbalance_ratio"] < m["naive_imbalance_ratio"]
    assert [len(i) for i in ix] == [4, 4, 4, 4]


def test_balanced_split_method_dispatch():
    batch = make_batch(b=8)
    _, ix_lpt, _ = batch.balanced_split(2, method="trainer.batch:greedy_lpt")
    assert ix_lpt == greedy_lpt(batch.num_tokens.tolist(), 2, True)
    _, ix_fn, _ = batch.balanced_split(2, method=karmarkar_karp, workloads=[1] * 8)
    assert ix_fn == karmarkar_karp([1] * 8, 2, True)
    with pytest.raises(ValueError, match="Did you mean 'kk'"):
        batch.balanced_split(2, method="kkk")


def test_inverse_permutation_checks_cover():
    assert inverse_permutation([[2, 0], [1]]).tolist() == [1, 2, 0]  # cat rows are 2,0,1
    with pytest.raises(ValueError, match="not a permutation"):
        inverse_permutation([[0, 0], [1]])
    with pytest.raises(ValueError, match="part 0 has 1 rows but its index list has 2"):
        restore_order([torch.zeros(1)], [[0, 1]])


def test_make_meta_length_check():
    with pytest.raises(ValueError, match="has 2 values for a batch of 3"):
        make_meta({"a": [1, 2]}, 3)
    assert isinstance(make_meta({"a": [1, 2, 3]}, 3), TensorDict)


def test_trim_padding_drops_only_all_pad_columns():
    # P=4 (columns 0-1 are pads in every row), T=5 (columns 3-4 pads in every row)
    prompts = torch.tensor([[0, 0, 5, 6], [0, 0, 0, 7]])
    responses = torch.tensor([[1, 2, 3, 0, 0], [4, 0, 0, 0, 0]])
    pm = prompts != 0
    rm = responses != 0
    adv = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    b = RolloutBatch.from_tokens(prompts, responses, pm, rm, advantages=adv, group_ids=torch.tensor([3, 4]),
                                 meta={"uid": ["a", "b"]})
    t, lead, tail = b.trim_padding()
    assert (lead, tail) == (2, 2)
    assert t.prompts.tolist() == [[5, 6], [0, 7]] and t.responses.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert torch.equal(t.input_ids, b.input_ids[:, 2:7]) and torch.equal(t.attention_mask, b.attention_mask[:, 2:7])
    assert torch.equal(t.position_ids, b.position_ids[:, 2:7])  # per-token positions are unchanged
    assert torch.equal(t.advantages, adv[:, :3]) and t.group_ids.tolist() == [3, 4]
    assert t.get_meta("uid") == ["a", "b"]
    assert torch.equal(t.num_tokens, b.num_tokens)  # no real token was dropped
    # nothing to trim: the same object back
    same, lead, tail = t.trim_padding()
    assert same is t and (lead, tail) == (0, 0)
    # every response empty: one response column is kept (the batch stays well-formed)
    e = RolloutBatch.from_tokens(prompts, torch.zeros(2, 3, dtype=torch.long), pm, torch.zeros(2, 3, dtype=torch.bool))
    et, _, tail = e.trim_padding()
    assert tail == 2 and et.response_width == 1


def test_micro_batch_groups_fixed_budget_and_minimum():
    from trainer.batch import micro_batch_groups

    toks = [5, 9, 3, 4, 8]
    assert micro_batch_groups(toks, size=2) == [[0, 1], [2, 3], [4]]
    # a token budget of 15: ceil(29 / 15) = 2 groups, every one within it, every row once
    g = micro_batch_groups(toks, size=1, max_tokens=15)
    assert len(g) == 2 and max(sum(toks[i] for i in x) for x in g) <= 15 and sorted(sum(g, [])) == list(range(5))
    # the interleaved pipeline's minimum number of micro-batches (pp), fixed size or budget
    assert micro_batch_groups(toks, size=64, min_groups=2) == [[0, 1, 2], [3, 4]]
    g = micro_batch_groups(toks, size=1, max_tokens=100, min_groups=3)
    assert len(g) == 3 and sorted(sum(g, [])) == list(range(5))
    assert micro_batch_groups([7], size=4, min_groups=2) == [[0]]  # no more groups than rows
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu=8"):
        micro_batch_groups(toks, size=1, max_tokens=8)


def test_routed_experts_follow_trim_widen_and_cat():
    """The [B, P+T, R, K] routing table moves with its tokens: trim_padding drops the same columns as
    input_ids, widen pads them with -1 (not routed), cat lines up batches of different widths."""
    from trainer.rollout.single_turn import routes_grid

    prompts, resp = [[5, 6], [7]], [[1, 2, 3], [4]]
    routes = [torch.arange(n).repeat_interleave(4).view(-1, 2, 2).to(torch.int16) + 10 * i
              for i, n in enumerate((2 + 3 - 1, 1 + 1 - 1))]  # [n_in, R=2, K=2], distinct per token
    grid = routes_grid(routes, [2, 1], P=4, T=5)  # 2 all-pad prompt columns, 1 all-pad response column
    assert grid.shape == (2, 9, 2, 2)
    assert torch.equal(grid[0, 2:6], routes[0]) and bool((grid[0, :2] == -1).all()) and bool((grid[0, 6:] == -1).all())
    assert torch.equal(grid[1, 3:4], routes[1]) and bool((grid[1, 4:] == -1).all())
    p_ids = torch.tensor([[0, 0, 5, 6], [0, 0, 0, 7]])
    r_ids = torch.tensor([[1, 2, 3, 0, 0], [4, 0, 0, 0, 0]])
    b = RolloutBatch.from_tokens(p_ids, r_ids, p_ids > 0, r_ids > 0, routed_experts=grid)
    t, lead, tail = b.trim_padding()
    assert (lead, tail) == (2, 2)
    assert torch.equal(t.routed_experts, grid[:, 2:7])
    w = t.widen(4, 5)
    assert torch.equal(w.routed_experts, grid)  # the trimmed columns come back as -1
    c = RolloutBatch.cat([t, b])
    assert c.routed_experts.shape == (4, 9, 2, 2) and torch.equal(c.routed_experts[:2], grid)
