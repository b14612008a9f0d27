"""The shared-memory weight sync (trainer/workers/weight_shm.py), in one process: two "ranks" write
their TP shards' blocks into the buffer and a real native engine loads it. The engine must end up with
exactly the checkpoint (its own full checksum against the checkpoint's, cast to its dtype), and a
byte corrupted anywhere between the ranks' copies and the engine's weights must be caught and named.
The Ray paths (hybrid engine, separate engine workers) run in tests/test_step_fast_paths.py."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "megatron_bridge"))

from bridge_tiny import make_case  # noqa: E402
from megatron_bridge.convert import HFCheckpoint, hf_to_megatron_shards  # noqa: E402
from megatron_bridge.hf_config import read_hf_config  # noqa: E402
from megatron_bridge.reshard import Block, blocks_for  # noqa: E402
from trainer.rollout.engine import checksum_named_tensors  # noqa: E402
from trainer.rollout.native import NativeEngine  # noqa: E402
from trainer.workers.weight_shm import SharedSlots, check_bucket, create_buffer, plan_layout, write_blocks  # noqa: E402

TP = 2


class Rank:
    """What a megatron rank holds for a sync: its shards (contiguous, as live parameters are) and blocks."""

    def __init__(self, shards: dict, hf, r: int):
        self.params = {n: t.contiguous() for n, t in shards.items()}
        self.blocks = [Block(b.hf_name, b.hf_shape, b.rows, b.cols, n, b.offset, b.row_stride)
                       for n, t in self.params.items() for b in blocks_for(n, hf, tuple(t.shape), TP, r)]


def _setup(path: str, dtype: str, bucket_bytes: int):
    hf = read_hf_config(path)
    ck = HFCheckpoint(path)
    shards = hf_to_megatron_shards(ck.get, hf, tp=TP, pp=1)
    ranks = [Rank(shards[(0, r)], hf, r) for r in range(TP)]
    tensors, seen = [], set()
    for rk in ranks:
        for b in rk.blocks:
            if b.hf_name not in seen:
                seen.add(b.hf_name)
                tensors.append((b.hf_name, b.hf_shape))
    layout = plan_layout(tensors, dtype, bucket_bytes, [(b.hf_name, b.rows, b.cols) for rk in ranks for b in rk.blocks])
    buf, token = create_buffer(layout.file_bytes)
    try:
        writers = [SharedSlots(buf, token, layout) for _ in ranks]  # each rank's own mapping
        reader = SharedSlots(buf, token, layout)
    finally:
        os.unlink(buf)
    return ck, ranks, layout, writers, reader


def _sync(engine, ranks, layout, writers, reader, corrupt=None) -> list:
    errors = []
    for b in range(layout.num_buckets):
        for rk, w in zip(ranks, writers):
            write_blocks(w, [blk for blk in rk.blocks if layout.entries[blk.hf_name][0] == b], rk.params.__getitem__, True)
        if corrupt is not None:
            corrupt(b)
        engine.update_weights([(n, reader.tensor(n)) for n in layout.bucket(b)])
        errors.append(check_bucket(reader, b, engine.hf_views()))
    return errors


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))
    make_case("qwen2_bias_gqa2_tied", path)
    return path


@pytest.mark.parametrize("dtype,bucket_kib", [("float32", 1 << 20), ("float32", 48), ("bfloat16", 48)])
def test_engine_ends_with_exactly_the_checkpoint(ckpt, dtype, bucket_kib):
    ck, ranks, layout, writers, reader = _setup(ckpt, dtype, bucket_kib << 10)
    assert layout.num_slots == (1 if bucket_kib > 1000 else 2) and (layout.num_buckets > 2) == (bucket_kib < 1000)
    engine = NativeEngine(ckpt, max_batch_size=2, max_seq_len=64, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for v in engine.hf_views().values():
            v.normal_()  # the engine starts from other weights
    assert _sync(engine, ranks, layout, writers, reader) == [None] * layout.num_buckets
    want = checksum_named_tensors(((n, ck.get(n)) for n in ck.keys()), dtype=getattr(torch, dtype))
    assert engine.weights_checksum() == want


def test_a_corrupted_byte_in_the_buffer_is_caught_and_named(ckpt):
    ck, ranks, layout, writers, reader = _setup(ckpt, "float32", 48 << 10)
    engine = NativeEngine(ckpt, max_batch_size=2, max_seq_len=64, dtype=torch.float32)
    name = "model.layers.1.self_attn.o_proj.weight"  # a row-parallel weight: two column blocks
    bucket = layout.entries[name][0]

    def corrupt(b):
        if b == bucket:
            raw = reader.tensor(name).view(torch.uint8)
            raw[3, -1] ^= 0x01  # one bit of one byte, in rank 1's column block
    errors = _sync(engine, ranks, layout, writers, reader, corrupt)
    assert [i for i, e in enumerate(errors) if e] == [bucket]
    assert f"block {name}[0:" in errors[bucket] and "differs from what the actor sent" in errors[bucket]
    assert ",32:64]" in errors[bucket] or ",16:32]" in errors[bucket]  # the second rank's columns


def test_a_bad_copy_into_the_engine_is_caught(ckpt):
    ck, ranks, layout, writers, reader = _setup(ckpt, "float32", 1 << 30)
    engine = NativeEngine(ckpt, max_batch_size=2, max_seq_len=64, dtype=torch.float32)
    real = engine.update_weights

    def lossy(named):  # an engine whose load drops the last row of every q_proj
        named = list(named)
        out = real(named)
        for n, _ in named:
            if n.endswith("q_proj.weight"):
                engine.hf_views()[n][-1].zero_()
        return out
    engine.update_weights = lossy
    (err,) = _sync(engine, ranks, layout, writers, reader)
    assert err is not None and "q_proj.weight[" in err


def test_a_buffer_from_elsewhere_is_refused(ckpt, tmp_path):
    _, _, layout, _, _ = _setup(ckpt, "float32", 1 << 30)
    path, token = create_buffer(layout.file_bytes, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="token mismatch"):
        SharedSlots(path, b"x" * 16, layout)
    with pytest.raises(FileNotFoundError, match="no sync buffer"):
        SharedSlots(str(tmp_path / "absent"), token, layout)
    SharedSlots(path, token, layout)


def test_two_writers_of_one_block_are_refused():
    with pytest.raises(ValueError, match="same block"):
        plan_layout([("w", (4, 4))], "float32", 1 << 20, [("w", (0, 4), (0, 4)), ("w", (0, 4), (0, 4))])
