"""Weight sync through one node's shared memory: no gather, no funnel, every block moved once.

When the actor's ranks and the rollout engines share a node (and its ``/dev/shm``), a sync runs as:

1. each actor rank copies the blocks of its own shards (``megatron_bridge.reshard``) to their final
   places in a HF-layout buffer in shared memory, casting to the engine dtype on the way, in parallel
   with the other ranks, and takes the XXH3 digest of each block it sent;
2. each engine copies the buffer's HF tensors into its weights (``update_weights``), then digests the
   same blocks of the weights it now holds and compares them with the actor's: a mismatch raises
   :class:`~trainer.rollout.engine.WeightSyncError`, naming the tensor and block.

The model goes through in buckets of ``bucket_bytes``; two buffer slots alternate, so the ranks write
bucket ``b + 1`` while the engines load bucket ``b`` (peak extra memory: two buckets). Cost per byte:
one strided copy on the writing rank (ranks in parallel), one copy into each engine, and each side's
hash (XXH3, ~30 GB/s per core). The object-store path (``trainer/workers/rollouts.py``) gathers every
tensor-parallel parameter over gloo and funnels the whole model through actor rank 0.

The buffer is one file under ``/dev/shm`` created by the driver with ``posix_fallocate`` (a full
tmpfs is an ``ENOSPC`` at set-up, not a ``SIGBUS`` mid-copy), mapped by every process, then unlinked:
the mappings stay, and no file outlives the processes. Its first 16 bytes are a random token that
every process checks after mapping it, so a process on another node (or in another ``/dev/shm``
namespace) reports that it cannot join and the sync keeps the object-store path.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import torch

from trainer.rollout.engine import WeightSyncError, tensor_digest

HEADER = 64  # token (16 bytes), then padding
ALIGN = 64
DIGEST = 16  # XXH3-128


@dataclass(frozen=True)
class Layout:
    """Where every HF tensor and every block's digest of the sync sits: bucket ``b`` lives in slot
    ``b % num_slots``; ``blocks[i]`` = (HF name, rows, cols) owns digest row ``i`` of the table."""

    dtype: str  # the engine dtype every tensor is written in
    slot_bytes: int
    num_slots: int
    entries: dict  # hf_name -> (bucket, byte offset in its slot, shape)
    blocks: tuple = ()  # ((hf_name, rows, cols), ...): every writer's blocks, in the digest table's order

    @property
    def num_buckets(self) -> int:
        return 1 + max(b for b, _, _ in self.entries.values()) if self.entries else 0

    @property
    def table_bytes(self) -> int:
        return -(-len(self.blocks) * DIGEST // ALIGN) * ALIGN

    @property
    def file_bytes(self) -> int:
        return HEADER + self.table_bytes + self.num_slots * self.slot_bytes

    def bucket(self, b: int) -> list[str]:
        return [n for n, (bb, _, _) in self.entries.items() if bb == b]

    def index(self) -> dict[tuple, int]:
        return {(n, tuple(r), tuple(c)): i for i, (n, r, c) in enumerate(self.blocks)}


def plan_layout(tensors: list[tuple[str, tuple[int, ...]]], dtype: str, bucket_bytes: int,
                blocks: list[tuple] = ()) -> Layout:
    """Buckets of at least ``bucket_bytes`` in the given order (the last may be smaller; a tensor larger
    than a bucket is a bucket by itself: the rule of ``megatron_bridge.export.iter_hf_weights``), and
    a digest row per block."""
    esize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    entries, b, off, sizes = {}, 0, 0, []
    for name, shape in tensors:
        if name in entries:
            raise ValueError(f"tensor {name!r} appears twice in the weight-sync layout")
        n = esize
        for s in shape:
            n *= int(s)
        entries[name] = (b, off, tuple(int(s) for s in shape))
        off += -(-n // ALIGN) * ALIGN
        if off >= bucket_bytes:
            sizes.append(off)
            b, off = b + 1, 0
    if off:
        sizes.append(off)
    keys = [(n, tuple(r), tuple(c)) for n, r, c in blocks]
    if len(set(keys)) != len(keys):
        raise ValueError("two ranks plan to write the same block of a weight")
    return Layout(dtype, max(sizes, default=ALIGN), min(2, len(sizes)) or 1, entries, tuple(keys))


def create_buffer(nbytes: int, directory: str = "/dev/shm") -> tuple[str, bytes]:
    """A new shared file of ``nbytes`` with a random token at its head; (path, token). Raises
    ``OSError`` (ENOSPC) when the tmpfs cannot hold it: the caller keeps the object-store path."""
    token = uuid.uuid4().bytes
    path = os.path.join(directory, f"coxswain-wsync-{os.getpid()}-{token.hex()[:12]}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # reserve the pages now: a full tmpfs fails here, not mid-copy
        os.pwrite(fd, token, 0)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path, token


class SharedSlots:
    """One process's mapping of the sync buffer: typed views of its tensors, and the digest table."""

    def __init__(self, path: str, token: bytes, layout: Layout):
        if not os.path.exists(path) or os.path.getsize(path) != layout.file_bytes:
            raise FileNotFoundError(f"{path}: no sync buffer of {layout.file_bytes} bytes here")
        self.buf = torch.from_file(path, shared=True, size=layout.file_bytes, dtype=torch.uint8)
        if bytes(self.buf[:16].tolist()) != token:
            raise FileNotFoundError(f"{path}: another process's file (token mismatch)")
        self.layout = layout
        self.dtype = getattr(torch, layout.dtype)
        self._esize = torch.empty((), dtype=self.dtype).element_size()
        self.index = layout.index()
        self.table = self.buf[HEADER:HEADER + len(layout.blocks) * DIGEST].view(len(layout.blocks), DIGEST)

    def tensor(self, name: str) -> torch.Tensor:
        b, off, shape = self.layout.entries[name]
        start = HEADER + self.layout.table_bytes + (b % self.layout.num_slots) * self.layout.slot_bytes + off
        n = torch.Size(shape).numel() * self._esize
        return self.buf[start:start + n].view(self.dtype).view(shape)

    def put_digest(self, key: tuple, digest: bytes) -> None:
        self.table[self.index[key]].copy_(torch.frombuffer(bytearray(digest), dtype=torch.uint8))

    def get_digest(self, key: tuple) -> bytes:
        return bytes(self.table[self.index[key]].tolist())


def write_blocks(slots: SharedSlots, blocks: list, get_param, digest: bool) -> int:
    """Copy ``blocks`` (``megatron_bridge.reshard.Block``) from their local parameters into the buffer,
    casting to the engine dtype; with ``digest``, put each block's digest of the bytes sent (the
    source block after the cast) into the table. Returns the number of blocks written."""
    with torch.no_grad():
        for blk in blocks:
            src = blk.src(get_param(blk.param))
            blk.dst(slots.tensor(blk.hf_name)).copy_(src)
            if digest:
                slots.put_digest((blk.hf_name, blk.rows, blk.cols), tensor_digest(blk.key, src, slots.dtype))
    return len(blocks)


def check_bucket(slots: SharedSlots, bucket: int, held: dict) -> str | None:
    """Digest every block of ``bucket`` in the weights the engine holds (``held``: HF name -> view) and
    compare with the writers' digests in the table. Returns the first mismatch as an error message,
    or None."""
    from megatron_bridge.reshard import Block

    names = set(slots.layout.bucket(bucket))
    for hf_name, rows, cols in slots.layout.blocks:
        if hf_name not in names:
            continue
        t = held.get(hf_name)
        if t is None:
            raise WeightSyncError(f"weight sync failed: the engine has no tensor {hf_name!r}")
        blk = Block(hf_name, tuple(t.shape), rows, cols, "", 0, 0)
        got, want = tensor_digest(blk.key, blk.dst(t), slots.dtype), slots.get_digest((hf_name, rows, cols))
        if got != want:
            return (f"weight sync failed: block {blk.key} of the engine's weights differs from what the actor "
                    f"sent (digest {got.hex()[:12]}... vs {want.hex()[:12]}...); the engine would sample from "
                    f"corrupted weights")
    return None
