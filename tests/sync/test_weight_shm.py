"""The shared-memory weight sync (trainer/sync/shared_memory.py), in one process: two "ranks" write
their TP shards' blocks straight into the weights of real native engines, which share one file. Every
engine must end up with exactly the checkpoint (its own full checksum against the checkpoint's, cast
to its dtype); a copy that lands wrong must be caught at its block and row; plans that do not
partition the engine's tensors are refused. The Ray paths (hybrid engine, separate engine workers)
run in tests/test_step_fast_paths.py, tests/test_controller.py and tests/sync/test_weight_group.py."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "megatron_bridge"))

from bridge_tiny import make_case  # noqa: E402
from megatron_bridge.convert import HFCheckpoint, hf_to_megatron_shards  # noqa: E402
from megatron_bridge.hf_config import read_hf_config  # noqa: E402
from megatron_bridge.reshard import Block, blocks_for  # noqa: E402
from trainer.rollout.engine import SamplingParams, checksum_named_tensors  # noqa: E402
from trainer.rollout.native import NativeEngine  # noqa: E402
from trainer.rollout.engine import WeightSyncError  # noqa: E402
from trainer.sync import shared_memory as weight_shm  # noqa: E402
from trainer.sync.shared_memory import SharedWeights, create_buffer, plan_layout, prepare_writes, write_blocks  # noqa: E402

TP = 2


class Rank:
    """What a megatron rank holds for a sync: its shards (contiguous, as live parameters are) and blocks."""

    def __init__(self, shards: dict, hf, r: int):
        self.params = {n: t.contiguous() for n, t in shards.items()}
        self.blocks = [Block(b.hf_name, b.hf_shape, b.rows, b.cols, n, b.offset, b.row_stride)
                       for n, t in self.params.items() for b in blocks_for(n, hf, tuple(t.shape), TP, r)]

    def plan(self):
        return [(b.hf_name, b.hf_shape, b.rows, b.cols) for b in self.blocks]


def _setup(path: str, dtype: str, engines: int = 2, writer_entries=None):
    """Two TP ranks and ``engines`` native engines (scrambled weights) joined to one sync file."""
    hf = read_hf_config(path)
    ck = HFCheckpoint(path)
    shards = hf_to_megatron_shards(ck.get, hf, tp=TP, pp=1)
    ranks = [Rank(shards[(0, r)], hf, r) for r in range(TP)]
    engs = [NativeEngine(path, max_batch_size=2, max_seq_len=64, dtype=getattr(torch, dtype)) for _ in range(engines)]
    for e in engs:
        with torch.no_grad():
            for v in e.hf_views().values():
                v.normal_()  # the engines start from other weights
    layout = plan_layout(engs[0].storage_layout(), [rk.plan() for rk in ranks])
    buf, token = create_buffer(layout.file_bytes)
    try:
        wl = layout if writer_entries is None else dataclasses.replace(layout, entries=writer_entries(layout.entries))
        writers = [SharedWeights(buf, token, wl) for _ in ranks]  # each rank's own mapping
        readers = [SharedWeights(buf, token, layout) for _ in engs]
    finally:
        os.unlink(buf)
    for e, r in zip(engs, readers):
        e.share_weights(r.storage)
    return ck, ranks, engs, writers, readers


def _sync(ranks, engs, writers) -> None:
    """Every rank writes (each chunk compared with what it sent), then every engine re-derives."""
    for rk, w in zip(ranks, writers):
        write_blocks(w, prepare_writes(w, rk.blocks), rk.params.__getitem__, True)
    for e in engs:
        e.weights_changed()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))
    make_case("qwen2_bias_gqa2_tied", path)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engines_end_with_exactly_the_checkpoint(ckpt, dtype):
    ck, ranks, engs, writers, readers = _setup(ckpt, dtype)
    _sync(ranks, engs, writers)
    want = checksum_named_tensors(((n, ck.get(n)) for n in ck.keys()), dtype=getattr(torch, dtype))
    assert [e.weights_checksum() for e in engs] == [want, want]
    # one copy of the weights for the node: both engines read the same pages
    name = "model.layers.0.mlp.down_proj.weight"
    assert engs[0].hf_views()[name].data_ptr() != engs[1].hf_views()[name].data_ptr()  # own mappings...
    keep = engs[0].hf_views()[name][0, 0].clone()
    with torch.no_grad():
        engs[0].hf_views()[name][0, 0] += 1.0
    assert torch.equal(engs[0].hf_views()[name], engs[1].hf_views()[name])  # ...of one file
    # and they generate what a private-weight engine with the checkpoint generates
    ref = NativeEngine(ckpt, max_batch_size=2, max_seq_len=64, dtype=getattr(torch, dtype))
    with torch.no_grad():
        engs[0].hf_views()[name][0, 0] = keep  # exactly (x + 1 - 1 rounds in bf16)
    engs[1].weights_changed()
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    got, exp = engs[1].generate([[3, 4, 5]], sp)[0][0], ref.generate([[3, 4, 5]], sp)[0][0]
    assert got.token_ids == exp.token_ids and got.logprobs == exp.logprobs


def _kernel_modes():
    """The C checked copy (built by ``pip install``; CI must have it) and the Python fallback."""
    if weight_shm.KERNEL is None and os.environ.get("CI"):
        pytest.fail("trainer/sync/_copycheck.c was not built: `pip install -e .` builds it (needs a C compiler)")
    return ["kernel", "python"] if weight_shm.KERNEL is not None else ["python"]


@pytest.mark.parametrize("mode", _kernel_modes())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_copy_that_lands_wrong_is_caught_at_its_block_and_row(ckpt, dtype, mode, monkeypatch):
    if mode == "python":
        monkeypatch.setattr(weight_shm, "KERNEL", None)
    kernel = weight_shm.KERNEL is not None
    ck, ranks, engs, writers, readers = _setup(ckpt, dtype)
    name = "model.layers.1.self_attn.o_proj.weight"  # a row-parallel weight: a column block per rank
    target = writers[1].tensor(name)  # one bit of row 5 of rank 1's column block lands flipped
    half = target.shape[1] // 2
    bad = target[5, half:].data_ptr()
    real, real_memcpy = weight_shm._copy, weight_shm._memcpy

    def lossy(dst, src):  # the torch copy (the Python path's column blocks and casts)
        real(dst, src)
        if dst.data_ptr() == target[:, half:].data_ptr():
            dst[5:6, :1].view(torch.uint8)[0, 0] ^= 0x01

    def lossy_memcpy(dst, src, n):  # the byte copy (the kernel copies every piece with it)
        real_memcpy(dst, src, n)
        if dst <= bad < dst + n:
            ctypes.c_ubyte.from_address(bad).value ^= 0x01
    monkeypatch.setattr(weight_shm, "_copy", lossy)
    monkeypatch.setattr(weight_shm, "_memcpy", lossy_memcpy)
    with pytest.raises(WeightSyncError, match=rf"block {name}\[0:\d+,{half}:\d+\] .*first at row 5 of"):
        _sync(ranks, engs, writers)
    monkeypatch.setattr(weight_shm, "_copy", real)
    # a byte copy (same dtype, contiguous block: by address) that drops the last byte of gate_proj's rows
    gates = [w.tensor("model.layers.0.mlp.gate_proj.weight") for w in writers]  # each rank's own mapping
    gate = gates[0]

    def lossy_memcpy(dst, src, n):
        real_memcpy(dst, src, n)
        for g in gates:
            end = g.data_ptr() + g.numel() * g.element_size()
            if dst < end <= dst + n:
                ctypes.c_ubyte.from_address(end - 1).value ^= 0x80
    monkeypatch.setattr(weight_shm, "_memcpy", lossy_memcpy)
    if dtype == "float32" or kernel:  # the kernel copies a cast chunk with the byte copy too
        with pytest.raises(WeightSyncError, match=rf"block model.layers.0.mlp.gate_proj.weight\[\d+:{gate.shape[0]},0:"
                                                  rf"{gate.shape[1]}\] .*first at row {gate.shape[0] - 1} of"):
            _sync(ranks, engs, writers)
    else:
        _sync(ranks, engs, writers)  # a cast goes through the tensor copy: the byte copy is not used
    monkeypatch.setattr(weight_shm, "_memcpy", real_memcpy)
    # a copy that writes nothing at all: the engines keep their old weights
    with torch.no_grad():
        for v in engs[0].hf_views().values():
            v.normal_()  # both engines: one copy of the weights
    monkeypatch.setattr(weight_shm, "_copy", lambda dst, src: None)
    monkeypatch.setattr(weight_shm, "_memcpy", lambda dst, src, n: None)
    with pytest.raises(WeightSyncError, match="differs from what the actor sent"):
        _sync(ranks, engs, writers)
    monkeypatch.setattr(weight_shm, "_memcpy", real_memcpy)
    monkeypatch.setattr(weight_shm, "_copy", real)
    _sync(ranks, engs, writers)  # and a good sync repairs the engines
    want = checksum_named_tensors(((n, ck.get(n)) for n in ck.keys()), dtype=getattr(torch, dtype))
    assert [e.weights_checksum() for e in engs] == [want, want]


def test_the_kernel_catches_a_difference_in_any_piece_and_names_it():
    """The C checked copy on its own: every byte of a strided (column-block) copy arrives; a copy that
    drops one byte anywhere is reported at that byte's piece, for pieces and rows of every alignment."""
    if weight_shm.KERNEL is None:
        pytest.skip("the C kernel is not built here (see test_a_copy_that_lands_wrong_...[kernel], which CI requires)")
    import random

    rng = random.Random(0)
    real = weight_shm._memcpy
    for rows, cols, es in ((1, 1, 4), (3, 1000, 4), (17, 777, 2), (64, 4096, 2)):
        full = torch.zeros(rows, cols * 2 * es, dtype=torch.uint8)
        dst = full[:, cols * es:]  # the right half: strided rows
        src = torch.randint(0, 256, (rows, cols * es), dtype=torch.uint8)
        assert weight_shm._kernel_copy(dst, src) == -1 and torch.equal(dst, src) and not full[:, :cols * es].any()
        for _ in range(5):
            r, c = rng.randrange(rows), rng.randrange(cols * es)
            bad = dst[r, c:].data_ptr()

            def lossy(d, s, n, bad=bad):
                real(d, s, n)
                if d <= bad < d + n:
                    ctypes.c_ubyte.from_address(bad).value ^= 0xFF
            weight_shm._memcpy = lossy
            try:
                at = weight_shm._kernel_copy(dst, src)
            finally:
                weight_shm._memcpy = real
            width = cols * es
            piece = weight_shm.KERNEL_PIECE
            assert at == r * width + (c // piece) * piece, (rows, cols, es, r, c, at)


def test_writers_that_disagree_with_the_engines_layout_fail_the_end_to_end_check(ckpt):
    """A writer whose view of one tensor is off by one row (a layout bug) writes, and reads back, the
    wrong place, so its in-cache check passes; the end-to-end check of the first sync after set-up
    (every engine's full checksum over its own views, ``trainer.sync.base.Link.check_once``) catches it."""
    name = "model.layers.0.self_attn.q_proj.weight"

    def shifted(entries):
        out = dict(entries)
        off, shape, stride = out[name]
        out[name] = (off + stride[0], shape, stride)
        return out
    ck, ranks, engs, writers, readers = _setup(ckpt, "float32", writer_entries=shifted)
    _sync(ranks, engs, writers)
    want = checksum_named_tensors(((n, ck.get(n)) for n in ck.keys()), dtype=torch.float32)
    assert engs[0].weights_checksum() != want


def test_a_file_from_elsewhere_is_refused(ckpt, tmp_path):
    engine = NativeEngine(ckpt, max_batch_size=2, max_seq_len=64, dtype=torch.float32)
    layout = plan_layout(engine.storage_layout(), [])
    path, token = create_buffer(layout.file_bytes, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="token mismatch"):
        SharedWeights(path, b"x" * 16, layout)
    with pytest.raises(FileNotFoundError, match="no weight-sync file"):
        SharedWeights(str(tmp_path / "absent"), token, layout)
    SharedWeights(path, token, layout)


def test_plans_that_do_not_partition_the_engines_tensors_are_refused(ckpt):
    engine = NativeEngine(ckpt, max_batch_size=2, max_seq_len=64, dtype=torch.float32)
    el = engine.storage_layout()
    full = [(n, shape, (0, shape[0]), (0, 1 if len(shape) == 1 else shape[1])) for n, (_, shape, _) in el[2].items()]
    plan_layout(el, [full])  # one writer of everything: fine
    name, shape, rows, cols = next(b for b in full if len(b[1]) == 2)
    rest = [b for b in full if b[0] != name]
    half = shape[1] // 2
    left, right = (name, shape, rows, (0, half)), (name, shape, rows, (half, shape[1]))
    plan_layout(el, [rest + [left], [right]])  # two column blocks: fine
    with pytest.raises(ValueError, match="same block"):
        plan_layout(el, [rest + [left], [(name, shape, rows, (half - 1, shape[1]))]])  # one column twice
    with pytest.raises(ValueError, match="every element must be written"):
        plan_layout(el, [rest + [left]])  # the right half left stale
    with pytest.raises(ValueError, match="no actor rank writes"):
        plan_layout(el, [rest])
    with pytest.raises(ValueError, match="lacks"):
        plan_layout(el, [full + [("model.layers.99.mlp.up_proj.weight", shape, rows, cols)]])
    with pytest.raises(ValueError, match="HF shape"):
        plan_layout(el, [rest + [(name, (1, *shape), rows, cols)]])


def test_piece_size_follows_the_l2_cache(tmp_path):
    """A checked copy's piece is a quarter of the core's L2 (source + destination piece: half of it),
    the kernel's an eighth of L1, read from sysfs; sizes in sysfs's spellings parse, and an unreadable
    size falls back."""
    from trainer.sync import shared_memory as ws

    assert [ws._cache_size(t) for t in ("1024K\n", "2M", "65536", " 512k ")] == [1 << 20, 2 << 20, 65536, 512 << 10]
    with pytest.raises(ValueError):
        ws._cache_size("lots")
    f = tmp_path / "size"
    f.write_text("2048K\n")
    assert ws._l2_bytes(path=str(f)) == 2 << 20
    f.write_text("?")
    assert ws._l2_bytes(path=str(f)) == 512 << 10 and ws._l2_bytes(path=str(tmp_path / "none")) == 512 << 10
    assert ws.PIECE == min(max(ws._l2_bytes() // 4, 64 << 10), 1 << 20)
    f.write_text("48K\n")
    assert ws._l1d_bytes(path=str(f)) == 48 << 10 and ws._l1d_bytes(path=str(tmp_path / "none")) == 32 << 10
    assert ws.KERNEL_PIECE == min(max(ws._l1d_bytes() // 8, 2 << 10), 16 << 10)
