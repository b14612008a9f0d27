"""The direct reshard plan (megatron_bridge/reshard.py) against the gather path's own merge.

Every rank writes its blocks from its own shard into zeroed HF tensors; the result must equal the
checkpoint bit for bit, every element must be written exactly once, and no block may be empty."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bridge_tiny import CASES, make_case
from megatron_bridge.convert import HFCheckpoint, hf_to_megatron_shards, tp_shard
from megatron_bridge.hf_config import read_hf_config
from megatron_bridge.reshard import Block, _compress, blocks_for, spread


def _write_all(shards: dict, hf, tp: int, dp: int = 1) -> tuple[dict, dict]:
    """Apply every rank's blocks (with ``dp`` data-parallel replicas of each, sharing its blocks as
    ``local_blocks`` does); returns (HF tensors, per-element write counts)."""
    out, count = {}, {}
    for (stage, r), params in shards.items():
        locals_ = {name: local.contiguous() for name, local in params.items()}  # live parameters are contiguous
        mine = [dataclasses.replace(b, param=name) for name, local in locals_.items()
                for b in blocks_for(name, hf, tuple(local.shape), tp, r)]
        for d in range(dp):
            for b in spread(mine, dp, d):
                local = locals_[b.param]
                assert b.shape[0] > 0 and b.shape[1] > 0
                if b.hf_name not in out:
                    out[b.hf_name] = torch.zeros(b.hf_shape, dtype=local.dtype)
                    count[b.hf_name] = torch.zeros(b.hf_shape, dtype=torch.int32)
                b.dst(out[b.hf_name]).copy_(b.src(local))
                b.dst(count[b.hf_name]).add_(1)
    return out, count


@pytest.mark.parametrize("dp", [2, 3])
def test_data_parallel_replicas_share_the_writes(tmp_path, dp, monkeypatch):
    """Replicas split a shard's blocks (big ones by rows): still exactly once, and the work is shared."""
    import megatron_bridge.reshard as rs

    monkeypatch.setattr(rs, "SPLIT_BYTES", 1024)  # the tiny model's blocks are small: cut the bigger ones
    make_case("qwen2_bias_gqa2_tied", str(tmp_path))
    hf = read_hf_config(str(tmp_path))
    ck = HFCheckpoint(str(tmp_path))
    shards = hf_to_megatron_shards(ck.get, hf, tp=2, pp=1)
    out, count = _write_all(shards, hf, 2, dp)
    for k in ck.keys():
        assert torch.equal(out[k], ck.get(k)), k
        assert bool((count[k] == 1).all()), k
    local = {n: t.contiguous() for n, t in shards[(0, 0)].items()}
    mine = [dataclasses.replace(b, param=n) for n, t in local.items() for b in blocks_for(n, hf, tuple(t.shape), 2, 0)]
    sizes = [sum(b.shape[0] * b.shape[1] for b in spread(mine, dp, d)) for d in range(dp)]
    assert sum(sizes) == sum(b.shape[0] * b.shape[1] for b in mine)
    assert max(sizes) <= 1.25 * sum(sizes) / dp, sizes  # balanced, not one replica writing it all


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_blocks_rebuild_the_checkpoint_exactly_once(tmp_path, case, tp):
    make_case(case, str(tmp_path))
    hf = read_hf_config(str(tmp_path))
    ck = HFCheckpoint(str(tmp_path))
    pp_layers = None if hf.num_layers % 2 == 0 else [1, 2]
    shards = hf_to_megatron_shards(ck.get, hf, tp=tp, pp=2, pp_layers=pp_layers)
    out, count = _write_all(shards, hf, tp)
    # the tied head is the embedding: HF stores it once, and so does the plan
    assert sorted(out) == sorted(ck.keys())
    for k in ck.keys():
        assert torch.equal(out[k], ck.get(k)), k
        assert bool((count[k] == 1).all()), f"{k}: elements written {int(count[k].min())}..{int(count[k].max())} times"


def test_value_head_is_written_by_the_first_rank_only(tmp_path):
    make_case("qwen2_bias_gqa2_tied", str(tmp_path))
    hf = read_hf_config(str(tmp_path))
    head = torch.randn(1, hf.hidden_size)
    for r in range(2):
        local = tp_shard("output_layer.weight", head, 2, r, value_head=True)
        blocks = blocks_for("output_layer.weight", hf, tuple(local.shape), 2, r, value_head=True)
        if r:
            assert blocks == []
        else:
            (b,) = blocks
            assert b.hf_name == "score.weight" and torch.equal(b.src(local), head)


def test_fused_qkv_gives_one_block_per_group_and_part(tmp_path):
    # megatron's fused QKV interleaves [q heads of group g, k_g, v_g]. With 4 query groups over 2
    # ranks, rank 1 holds groups 2 and 3: their q rows are adjacent in HF but (qpg + 2) * hd rows
    # apart in the shard, so each (group, part) is its own block of row stride H
    make_case("llama_gqa2_untied_llama3rope", str(tmp_path))
    hf = dataclasses.replace(read_hf_config(str(tmp_path)), num_kv_heads=4, num_heads=8)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    ng, hd, H, qpg = 4, hf.head_dim, hf.hidden_size, 2
    blocks = blocks_for(name, hf, ((ng // 2) * (qpg + 2) * hd, H), 2, 1)
    group = (qpg + 2) * hd * H  # elements per group in the shard
    want = []
    for part, (row0, rows, first) in {"q_proj": (0, qpg * hd, 0), "k_proj": (0, hd, qpg * hd),
                                      "v_proj": (0, hd, (qpg + 1) * hd)}.items():
        for g in (2, 3):
            want.append((part, (g * rows, (g + 1) * rows), (g - 2) * group + first * H))
    got = [(b.hf_name.rsplit(".", 2)[1], b.rows, b.offset) for b in blocks]
    assert got == want
    assert all(b.cols == (0, H) and b.row_stride == H for b in blocks)


def test_a_scattered_owner_is_refused():
    ids = torch.tensor([[0, 9], [9, 1]])  # the rank's elements on a diagonal: no rectangle
    with pytest.raises(NotImplementedError, match="non-rectangular"):
        _compress(ids, 0, 2)


def test_block_key_names_tensor_and_bounds():
    b = Block("model.norm.weight", (8,), (0, 8), (0, 1), "", 0, 1)
    assert b.key == "model.norm.weight[0:8,0:1]"
