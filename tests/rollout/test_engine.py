"""The engine interface's pure parts: sampling-param validation, outputs, the weight checksum."""

import random

import pytest
import torch

from trainer.rollout.engine import GenerationOutput, SamplingParams, checksum_named_tensors, iter_buckets, tensor_digest


def named(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [("a.weight", torch.randn(3, 4, generator=g)), ("b.bias", torch.randn(5, generator=g)),
            ("c.weight", torch.randn(2, 2, 2, generator=g)), ("scalar", torch.tensor(1.5))]


def test_checksum_golden_construction():
    # The documented construction, spelled out with the xxhash library: per-tensor XXH3-128 over name,
    # dtype, shape, bytes; then XXH3-128 of the digests in sorted-name order.
    import xxhash

    items = named()
    per = {}
    for name, t in items:
        h = xxhash.xxh3_128()
        h.update(name.encode())
        h.update(b"\0" + str(t.dtype).encode() + b"\0" + repr(tuple(t.shape)).encode() + b"\0")
        h.update(t.contiguous().numpy().tobytes())
        per[name] = h.digest()
    expected = xxhash.xxh3_128(b"".join(per[n] for n in sorted(per))).hexdigest()
    assert checksum_named_tensors(items) == expected


def test_checksum_order_and_bucket_independent_but_exact():
    items = named()
    ref = checksum_named_tensors(items)
    shuffled = items[:]
    random.Random(1).shuffle(shuffled)
    assert checksum_named_tensors(shuffled) == ref
    assert checksum_named_tensors(p for bucket in iter_buckets(shuffled, 40) for p in bucket) == ref
    # One ulp in one element, a renamed tensor, a reshaped tensor or another dtype all change it.
    bumped = [(n, t.clone()) for n, t in items]
    bumped[0][1][1, 2] = torch.nextafter(bumped[0][1][1, 2], torch.tensor(1e9))
    assert checksum_named_tensors(bumped) != ref
    assert checksum_named_tensors([("z.weight" if n == "a.weight" else n, t) for n, t in items]) != ref
    assert checksum_named_tensors([(n, t.reshape(-1)) for n, t in items]) != ref
    assert checksum_named_tensors([(n, t.double()) for n, t in items]) != ref
    # Non-contiguous views hash like their contiguous copies.
    assert checksum_named_tensors([(n, t.t().contiguous().t()) if t.dim() == 2 else (n, t) for n, t in items]) == ref
    with pytest.raises(ValueError, match="twice"):
        checksum_named_tensors(items + items[:1])


def test_checksum_dtype_cast_and_ignore():
    items = named()
    bf = [(n, t.to(torch.bfloat16)) for n, t in items]
    assert checksum_named_tensors(items, dtype=torch.bfloat16) == checksum_named_tensors(bf)
    assert checksum_named_tensors(items, ignore={"scalar"}) == checksum_named_tensors(items[:3])
    assert tensor_digest("x", torch.zeros(0)) != tensor_digest("x", torch.zeros(0, 1))


def test_iter_buckets_sizes_and_order():
    items = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([3, 3, 10, 1, 1, 1])]  # fp32: 4 bytes each
    buckets = list(iter_buckets(items, bucket_bytes=24))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]


def test_sampling_params_validation():
    sp = SamplingParams(stop_token_ids=[3, 4], top_k=0)
    assert sp.stop_token_ids == (3, 4) and sp.top_k_or_zero == 0 and not sp.greedy
    assert SamplingParams(temperature=0).greedy
    for bad in (dict(n=0), dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(max_new_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_generation_output_validation():
    GenerationOutput([1, 2], [-0.1, -0.2], "stop")
    with pytest.raises(ValueError):
        GenerationOutput([1, 2], [-0.1], "stop")
    with pytest.raises(ValueError):
        GenerationOutput([1], [-0.1], "eos")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,c0", [((8, 4096), 2048), ((40, 9000), 4500), ((5, 7), 3), ((1, 8192), 0)])
def test_a_column_block_digests_like_its_contiguous_copy(dtype, shape, c0):
    # a weight sync's column block (a strided view) is hashed in place, row by row when rows are long:
    # the digest must equal that of the block's contiguous copy, and differ when one byte differs
    a = torch.randn(*shape).to(dtype)
    block = a[:, c0:]
    assert tensor_digest("w[0:1]", block) == tensor_digest("w[0:1]", block.contiguous())
    b = a.clone()
    b.view(torch.uint8)[-1, -1] ^= 1
    assert tensor_digest("w[0:1]", b[:, c0:]) != tensor_digest("w[0:1]", block)


def test_routes_travel_in_sglangs_wire_form():
    """R3 routes between processes: base64 of int32 [tokens, layers, top_k] (SGLang PR #12162's
    meta_info["routed_experts"]); decoded to the batch's int16, the row count checked, never reshaped silently."""
    import base64

    import numpy as np

    from trainer.rollout.engine import decode_routes, encode_routes

    t = torch.randint(0, 300, (7, 3, 2))
    text = encode_routes(t)
    # SGLang's own encoding of the same array (tokenizer_manager: b64encode(tensor.numpy().tobytes()))
    assert text == base64.b64encode(t.to(torch.int32).numpy().tobytes()).decode()
    back = decode_routes(text, 3, 2, rows=7)
    assert back.dtype == torch.int16 and torch.equal(back.long(), t)
    assert np.array_equal(decode_routes(text, 3, 2).numpy(), t.numpy())  # no expected count: every row
    with pytest.raises(ValueError, match="7 rows of 3 layers x top-2 int32, but 6 input tokens"):
        decode_routes(text, 3, 2, rows=6)
    with pytest.raises(ValueError, match="rows of 4 layers"):
        decode_routes(text, 4, 2)  # 42 ints are not whole rows of 8
    with pytest.raises(ValueError, match="not base64"):
        decode_routes("@@@", 3, 2)
    assert decode_routes("", 3, 2, rows=0).shape == (0, 3, 2)


def test_segment_routes_keep_each_token_as_it_was_first_fed():
    """R3 over segments. Partial rollout: a response aborted after 2 of its tokens (prompt of 3) resumes as a
    request whose prompt is those 5 tokens; the first 3 + 2 - 1 = 4 input rows keep the earlier segment's experts,
    the prefix's last token (fed first in the resumed request) and every later one take the resumed segment's.
    Multi-turn: turn 2's prompt is turn 1's context + its 3 sampled tokens + 2 tool tokens (10 fed tokens)."""
    from trainer.rollout.engine import extend_routes

    before = torch.full((4, 2, 2), 1, dtype=torch.int16)  # prompt 3 + 2 sampled - 1
    after = torch.full((5 + 3 - 1, 2, 2), 2, dtype=torch.int16)  # prompt' 5 + 3 sampled - 1
    got = extend_routes(before, after)
    assert got.shape == (3 + 5 - 1, 2, 2)  # the whole response: prompt 3 + 5 sampled - 1
    assert (got[:4] == 1).all() and (got[4:] == 2).all()
    assert extend_routes(None, after) is after
    # a resumed request aborted again while queued (no slot: nothing fed, no routes) keeps the earlier routes;
    # the next resume then extends them instead of re-routing the whole prefix under newer weights
    assert extend_routes(before, None) is before
    again = extend_routes(extend_routes(before, None), after)
    assert (again[:4] == 1).all() and (again[4:] == 2).all()
    assert extend_routes(None, None) is None  # routes not asked for
    turn1 = torch.full((5 + 3 - 1, 2, 2), 1, dtype=torch.int16)  # context 5, 3 sampled
    turn2 = torch.full((10 + 4 - 1, 2, 2), 2, dtype=torch.int16)  # context 5 + 3 + 2 tool tokens, 4 sampled
    got = extend_routes(turn1, turn2)
    assert got.shape[0] == 13 and (got[:7] == 1).all() and (got[7:] == 2).all()  # row 7: turn 1's last token
