"""Weight sync through one node's shared memory: the engines' weights live in it, and every actor rank
writes the shards it owns straight into them. No gather, no funnel, no staging buffer: each byte of
the model is written once, by its owner, and checked while it is still in that core's cache.

When the actor's ranks and the rollout engines share a node (and its ``/dev/shm``):

* set-up, once per actor: the driver creates one file the size of an engine's weights (its flat
  storage layout, ``NativeEngine.storage_layout``). Every engine of the node moves its weights into
  it (``share_weights``): one copy of the weights per node, mapped by every engine (engines only read
  their weights, and a sync writes them only while none generates: the loop settles or pauses the
  engines first). Every actor rank maps it too and finds its blocks (``megatron_bridge.reshard``) in
  the engines' HF-named views. :func:`plan_layout` checks that the ranks' blocks partition every
  tensor exactly (no element written twice, none left out), so no later write can touch a checked
  block. The first sync after set-up is also checked end to end by the caller: every engine's full
  checksum, over its own views, against the actor's (``rollout.verify``): that proves the writers'
  views of the file and the engines' views agree;
* a sync: each rank copies its blocks into the engines' weights, casting to the engine dtype, in
  pieces of an eighth of L1 (a few KiB; a small C kernel, ``_copycheck.c``), and right after each
  piece's copy compares the bytes that now sit in the engines' memory with the bytes it sent
  (``memcmp``; the cast chunk for a cast), both still in L1.
  A mismatch raises :class:`~trainer.rollout.engine.WeightSyncError` naming the tensor, the block and
  the row. Each engine re-derives what it computes from its weights (packed copies) at its next pass,
  which starts only after the driver has every rank's result: no barrier between the ranks.

Why a comparison, not digests: the engines hold the very pages the writer just wrote, so what the
engine holds can be read back where it is cheapest, in the writer's cache, and compared exactly (no
collision probability). A digest on each side means a second pass over the model from memory on the
engine side, which here costs more than the copy itself. Cost per byte: one strided copy by its owner
(the ranks in parallel) and an in-cache ``memcmp``: measured, the checked copy costs what torch's
unchecked copy does (0.93-0.97x, contiguous blocks and column blocks alike). Memory: nothing extra;
the engines of a node share one copy of the weights instead of one each.

The file is created with ``posix_fallocate`` (a full tmpfs is an ``ENOSPC`` at set-up, not a
``SIGBUS`` mid-copy), mapped by every process, then unlinked: the mappings stay, and no file outlives
the processes. Its first 16 bytes are a random token that every process checks after mapping it, so
a process on another node (or in another ``/dev/shm`` namespace) reports that it cannot join and the
sync takes the rollout's next transport (the object store).

The halves: :class:`Sender` on every actor rank (its blocks, the mapping, the checked writes; in the
hybrid engine also the hand-over to the engine in its own process, rung on a doorbell,
trainer/sync/doorbell.py), :class:`Receiver` beside every engine (its layout, the move of its weights
into the file, the re-derivation after a sync), and :class:`SharedMemory`, the driver's link.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import time
import uuid
from dataclasses import dataclass

import torch

from megatron_bridge import cpu_shims
from trainer.rollout.engine import WeightSyncError
from trainer.sync.base import Half, Link, params_resident, plan_of, reshard_plan, sync_metrics
from trainer.sync.doorbell import Doorbell, DoorbellError, serve

HEADER = 64  # token (16 bytes), then padding: the weights start on a cache line

_libc = ctypes.CDLL(None)
_memcmp = _libc.memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcpy = _libc.memcpy
_memcpy.restype = ctypes.c_void_p
_memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def _cache_size(text: str) -> int:
    """A sysfs cache size (``"1024K"``, ``"2M"``, ``"65536"``) in bytes; ValueError otherwise."""
    v = text.strip().upper()
    if v[-1:] in ("K", "M"):
        return int(v[:-1]) << (10 if v[-1] == "K" else 20)
    return int(v)


def _l2_bytes(default: int = 512 << 10, path: str = "/sys/devices/system/cpu/cpu0/cache/index2/size") -> int:
    """This core's L2 cache size (Linux sysfs), or ``default`` where it cannot be read."""
    try:
        with open(path) as f:
            return _cache_size(f.read())
    except (OSError, ValueError):
        return default


def _l1d_bytes(default: int = 32 << 10, path: str = "/sys/devices/system/cpu/cpu0/cache/index0/size") -> int:
    """This core's L1 data cache size (sysfs ``index0`` is the L1 data cache on Linux), or ``default``."""
    return _l2_bytes(default, path)


def _load_kernel():
    """The C checked copy (``trainer/sync/_copycheck.c``, built by ``pip install``) through ctypes, or
    None where it was not built (no C compiler at install time): the sync then checks in Python."""
    try:
        spec = importlib.util.find_spec("trainer.sync._copycheck")
        lib = ctypes.CDLL(spec.origin) if spec is not None and spec.origin else None
    except (ImportError, OSError):
        return None
    if lib is None:
        return None
    f = lib.coxswain_copy_check
    f.restype = ctypes.c_longlong
    f.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_longlong,
                  ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p)
    return f


KERNEL = _load_kernel()
_COPY_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


# The C kernel's piece: source and destination pieces fit an eighth of L1 each, so the comparison reads
# both from L1 (measured on a 32 KiB L1: 4 KiB 0.93-0.96x an unchecked copy, 16 KiB 0.96-1.15x, 64 KiB 1.2x)
KERNEL_PIECE = min(max(_l1d_bytes() // 8, 2 << 10), 16 << 10)
# Without the kernel, a checked copy goes in pieces this size, one ctypes call each: the piece just
# copied is compared while both sides are still in L2, so source + destination piece take half of it
# (measured on a 512 KiB L2: 128 KiB pieces add 21% to a plain copy, 512 KiB ones 60%, a second pass
# 90%; on a 1 MiB L2, 37.5 MB: 128 KiB +33%, 256 KiB +28%)
PIECE = min(max(_l2_bytes() // 4, 64 << 10), 1 << 20)
# a column block (strided rows in the engines' tensor) is cast, or without the kernel copied and gathered
# back, by torch, whose per-call overhead outweighs L2 misses: bigger pieces there (1 MiB: 0.82 ms against
# 1.19 at 128 KiB for 8.6 MB)
STRIDED_PIECE = 1 << 20


@dataclass(frozen=True)
class Layout:
    """The shared file: a header, then the engines' weights, a flat storage of ``numel`` elements of
    ``dtype``, where HF tensor ``name`` is the view ``entries[name]`` = (element offset, shape, stride)."""

    dtype: str
    numel: int
    entries: dict

    @property
    def esize(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def file_bytes(self) -> int:
        return HEADER + self.numel * self.esize

    @property
    def model_bytes(self) -> int:
        """Bytes of the HF tensors a sync writes (what a sync moves)."""
        n = 0
        for _, shape, _ in self.entries.values():
            k = 1
            for s in shape:
                k *= int(s)
            n += k
        return n * self.esize


def _frame(shape) -> tuple[int, int]:
    """The [rows, cols] frame blocks are cut in (``megatron_bridge.reshard.as_2d``)."""
    if not shape:
        return 1, 1
    n = 1
    for s in shape[1:]:
        n *= int(s)
    return int(shape[0]), n


def plan_layout(engine_layout: tuple[str, int, dict], plans: list[list[tuple]]) -> Layout:
    """The sync's layout from an engine's ``storage_layout()`` and every actor rank's plan ((HF name, HF
    shape, rows, cols) per block). Raises ``ValueError`` where they do not fit: a tensor the engine
    lacks or holds in another shape, or blocks that do not partition a tensor exactly (two writers of
    one element, or an element nobody writes: the engine would keep a stale value unchecked)."""
    dtype, numel, entries = engine_layout
    by_tensor: dict[str, list] = {}
    for plan in plans:
        for name, shape, rows, cols in plan:
            if name not in entries:
                raise ValueError(f"the actor's weights have a tensor the rollout engine lacks: {name!r}")
            if tuple(entries[name][1]) != tuple(shape):
                raise ValueError(f"{name}: the actor's HF shape {tuple(shape)} != the engine's {tuple(entries[name][1])}")
            by_tensor.setdefault(name, []).append((tuple(rows), tuple(cols)))
    for name, rects in by_tensor.items():
        R, C = _frame(entries[name][1])
        area = 0
        for i, ((r0, r1), (c0, c1)) in enumerate(rects):
            if not (0 <= r0 < r1 <= R and 0 <= c0 < c1 <= C):
                raise ValueError(f"{name}: block [{r0}:{r1},{c0}:{c1}] lies outside its [{R}, {C}] frame")
            area += (r1 - r0) * (c1 - c0)
            for (q0, q1), (d0, d1) in rects[:i]:
                if r0 < q1 and q0 < r1 and c0 < d1 and d0 < c1:
                    raise ValueError(f"two ranks plan to write the same block of a weight: {name} "
                                     f"[{r0}:{r1},{c0}:{c1}] and [{q0}:{q1},{d0}:{d1}] overlap")
        if area != R * C:
            raise ValueError(f"{name}: the ranks' blocks cover {area} of its {R * C} elements; every element "
                             f"must be written by exactly one rank")
    missing = sorted(set(entries) - set(by_tensor)) if plans else []
    if missing:
        raise ValueError(f"the rollout engine has weights no actor rank writes, e.g. {missing[:3]}")
    return Layout(dtype, int(numel), {n: (int(o), tuple(s), tuple(st)) for n, (o, s, st) in entries.items()})


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


class SharedWeights:
    """One process's mapping of the sync file: the flat weight storage and HF-named views of it."""

    def __init__(self, path: str, token: bytes, layout: Layout):
        if not os.path.exists(path) or os.path.getsize(path) != layout.file_bytes:
            raise FileNotFoundError(f"{path}: no weight-sync file of {layout.file_bytes} bytes here")
        self.buf = torch.from_file(path, shared=True, size=layout.file_bytes, dtype=torch.uint8)
        if bytes(self.buf[:16].tolist()) != token:
            raise FileNotFoundError(f"{path}: another process's file (token mismatch)")
        self.layout = layout
        self.dtype = getattr(torch, layout.dtype)
        self.storage = self.buf[HEADER:].view(self.dtype)  # flat: what the engines move their weights into

    def tensor(self, name: str) -> torch.Tensor:
        off, shape, stride = self.layout.entries[name]
        return self.storage.as_strided(shape, stride, self.storage.storage_offset() + off)


@dataclass
class Write:
    """One block of a rank's sync, prepared once per set-up."""

    blk: object  # megatron_bridge.reshard.Block
    dst: torch.Tensor  # the block's place in the engines' weights, [rows, cols]
    k: int  # rows per chunk


def prepare_writes(shared: SharedWeights, blocks: list) -> list[Write]:
    out = []
    for blk in blocks:
        dst = blk.dst(shared.tensor(blk.hf_name))
        piece = PIECE if dst.is_contiguous() else STRIDED_PIECE
        out.append(Write(blk, dst, max(1, piece // max(1, dst.shape[1] * dst.element_size()))))
    return out


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)  # one name for the copy, so a test can make it lossy


def _differs(dst: torch.Tensor, sent: torch.Tensor, scratch: torch.Tensor) -> int:
    """-1 if ``dst`` holds exactly the bytes of contiguous ``sent`` (same dtype and shape), else the
    first differing row. A strided ``dst`` (a column block) is gathered into ``scratch`` first; both
    are in cache right after the copy."""
    n = sent.numel() * sent.element_size()
    if dst.is_contiguous():
        a = dst
    elif n > scratch.numel():  # one row longer than a chunk (rare): no cache to save
        a = dst.contiguous()
    else:
        a = scratch[:n].view(dst.dtype).view(dst.shape)
        a.copy_(dst)
    if n == 0 or _memcmp(a.data_ptr(), sent.data_ptr(), n) == 0:
        return -1
    return int((a.view(torch.uint8) != sent.view(torch.uint8)).view(a.shape[0], -1).any(1).nonzero()[0])


def _mismatch(blk, row: int) -> WeightSyncError:
    return WeightSyncError(f"weight sync failed: block {blk.key} of the engines' weights differs from what the actor "
                           f"sent, first at row {blk.rows[0] + row} of {blk.hf_name}, right after the copy; the "
                           f"engines would sample from corrupted weights")


def _rows_contiguous(t: torch.Tensor) -> bool:
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] == 1)


def _kernel_copy(dst: torch.Tensor, src: torch.Tensor) -> int:
    """The C checked copy of ``src`` into ``dst`` (2-D, same shape and dtype, each row contiguous): -1,
    or a byte index in the first piece that differs. A whole contiguous block is one run of pieces."""
    es = dst.element_size()
    rows, width = dst.shape[0], dst.shape[1] * es
    if dst.is_contiguous() and src.is_contiguous():
        rows, width, ds, ss = 1, rows * width, 0, 0
    else:
        ds, ss = dst.stride(0) * es, src.stride(0) * es
    f = _memcpy  # libc's memcpy, reached by its address; a test's lossy copy, through a C callback
    fn = ctypes.cast(f, ctypes.c_void_p) if isinstance(f, ctypes._CFuncPtr) else _COPY_FN(f)
    return KERNEL(dst.data_ptr(), ds, src.data_ptr(), ss, rows, width, KERNEL_PIECE, fn)


def write_blocks(shared: SharedWeights, writes: list[Write], get_param, verify: bool) -> int:
    """Write prepared blocks (:func:`prepare_writes`) from their local parameters into the engines'
    weights, casting to the engine dtype, in row chunks; with ``verify``, after each piece's copy
    compare what the engines' memory now holds with what was sent, and raise ``WeightSyncError`` on the
    first difference. Returns the bytes written.

    The checked copy is the C kernel (``_copycheck.c``: L1-sized pieces, one call per block or cast
    chunk); a cast goes through a chunk-sized temporary first. Without the kernel: ``memcpy`` and
    ``memcmp`` per L2-sized piece from Python, and for a column block or a cast a torch copy, then a
    gather of what landed and a ``memcmp``."""
    nbytes = 0
    scratch = torch.empty(STRIDED_PIECE + 64, dtype=torch.uint8) if verify else None
    with torch.no_grad():
        for w in writes:
            src, dst = w.blk.src(get_param(w.blk.param)), w.dst
            if not verify:
                _copy(dst, src)
            elif KERNEL is not None:
                if src.dtype == dst.dtype and _rows_contiguous(src) and _rows_contiguous(dst):
                    if _kernel_copy(dst, src) >= 0:
                        raise _mismatch(w.blk, _differs(dst, src.contiguous(), scratch))
                else:
                    for r in range(0, dst.shape[0], w.k):
                        s, d = src[r:r + w.k].to(dst.dtype).contiguous(), dst[r:r + w.k]  # what is sent
                        if _kernel_copy(d, s) >= 0:
                            raise _mismatch(w.blk, r + _differs(d, s, scratch))
            elif dst.is_contiguous() and src.is_contiguous() and src.dtype == dst.dtype:
                # the common block (a rank's rows of a column-parallel weight): by address, no tensor per piece
                pd, ps, n = dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()
                for o in range(0, n, PIECE):
                    c = min(PIECE, n - o)
                    _memcpy(pd + o, ps + o, c)
                    if _memcmp(pd + o, ps + o, c):
                        raise _mismatch(w.blk, _differs(dst, src, scratch))
            else:
                for r in range(0, dst.shape[0], w.k):
                    s, d = src[r:r + w.k], dst[r:r + w.k]
                    if s.dtype != dst.dtype or not s.is_contiguous():
                        s = s.to(dst.dtype).contiguous()  # a chunk-sized temporary, in cache: what is sent
                    _copy(d, s)
                    row = _differs(d, s, scratch)
                    if row >= 0:
                        raise _mismatch(w.blk, r + row)
            nbytes += dst.numel() * dst.element_size()
    return nbytes


# ---- the halves and the driver's link ---------------------------------------------------------------------
class Sender(Half):
    """An actor rank's half: its blocks (planned once), its mapping of the file, its checked writes."""

    resident_ops = frozenset({"write"})  # sync_engine_shm loads them itself: the doorbell calls it directly

    shared: SharedWeights | None = None
    _doorbell = None

    def plan(self) -> list[tuple] | None:
        """Plan this rank's part of a sync: (HF name, HF shape, rows, cols) of each block it writes, or None
        when the strategy cannot (the sync keeps the object-store path)."""
        planned = reshard_plan(self.owner)
        if planned is None:
            return None
        self.blocks, self.params = planned
        if any(p.device.type != "cpu" for p in self.params.values()):
            return None  # the file is host memory, written by memcpy: a GPU actor syncs by another transport
        return plan_of(self.blocks)

    def attach(self, path: str, token: bytes, layout: Layout) -> bool:
        """Map the sync file; False when it is not visible from here (another node or namespace)."""
        try:
            self.shared = SharedWeights(path, token, layout)
        except FileNotFoundError:
            return False
        self.writes = prepare_writes(self.shared, self.blocks)
        return True

    def write(self, verify: bool) -> int:
        """Write this rank's blocks into the engines' shared weights (cast to the engine dtype), with
        ``verify`` each chunk compared in cache with what was sent (``WeightSyncError`` on a
        difference); returns the bytes written."""
        return write_blocks(self.shared, self.writes, self.params.__getitem__, verify)

    def sync_engine_shm(self, verify: bool) -> dict:
        """The hybrid engine's sync (the engine in this rank's process): write this rank's blocks (every
        actor rank hosts one engine of the node), each piece compared in cache with what was sent when
        ``verify``. No barrier: the engine re-derives what it computes from its weights at its next pass,
        which starts after the driver has every rank's result. A mismatch is returned, so the driver names
        the rank. Returns ``{"bytes", "buckets", "error"}``."""
        error = None
        # plain copies: megatron's CPU device shim would only add dispatch
        with params_resident(self.owner), cpu_shims.suspended():
            try:
                write_blocks(self.shared, self.writes, self.params.__getitem__, verify)
            except WeightSyncError as e:
                error = str(e)
            nbytes = self.owner.engine_worker.sync_recv("shared_memory", "take")
        return {"bytes": nbytes, "buckets": 1, "error": error}

    def doorbell_open(self) -> tuple[str, bytes]:
        """Serve :meth:`sync_engine_shm` on a doorbell (trainer/sync/doorbell.py): the driver rings it
        without a Ray round trip. Returns (address, token); a second call replaces the first doorbell."""
        self._doorbell = serve(self, ("sync_engine_shm",), self._doorbell)
        return self._doorbell.address, self._doorbell.token


class Receiver(Half):
    """An engine's half: the engine's weights moved into the file, re-derived after each sync."""

    shared: SharedWeights | None = None

    def layout(self) -> tuple | None:
        """This engine's weights as one flat storage (``NativeEngine.storage_layout``): what the file is laid
        out by; None when the engine cannot take one."""
        engine = self.owner.engine
        layout = getattr(engine, "storage_layout", None)
        if layout is None or getattr(engine, "device", torch.device("cpu")).type != "cpu":
            return None  # the file is host memory: an engine on a GPU keeps its weights there
        return layout()

    def attach(self, path: str, token: bytes, layout: Layout) -> bool:
        """Map the file and move this engine's weights into it (every engine of the node then holds the
        same pages); False when the file is not visible from here (another node or ``/dev/shm``
        namespace) or the engine cannot hold its weights there."""
        engine = self.owner.engine
        if not hasattr(engine, "share_weights"):
            return False
        if engine.storage_layout()[1:] != (layout.numel, layout.entries):
            raise ValueError("this engine lays its weights out differently from the weight-sync file")
        try:
            self.shared = SharedWeights(path, token, layout)
        except FileNotFoundError:
            return False
        engine.share_weights(self.shared.storage)
        return True

    def take(self) -> int:
        """The actor ranks wrote the weights in place: the engine re-derives what it computes from them at
        its next pass (``weights_changed``). Returns the sync's bytes."""
        self.owner.engine.weights_changed()
        return self.shared.layout.model_bytes

    def load(self, *written: int) -> int:
        """:meth:`take` once every actor rank has written (``written``: the ranks' results, which Ray
        resolves first: a rank's failed check fails this call too)."""
        return self.take()


class SharedMemory(Link):
    """The driver's side: the file's set-up (once per actor), then each sync, on engine workers (a Ray
    call per side) or on the hybrid engine's ranks (rung on a doorbell where the driver reaches them)."""

    name = label = "shared_memory"
    sender, receiver = Sender, Receiver
    placements, weight_syncs, protocol = ("workers", "hybrid"), ("auto",), "shared_memory"

    def __init__(self, rollout):
        super().__init__(rollout)
        self.setup: tuple | None = None  # (actor group, Layout or None, reason)
        self._bell: tuple | None = None  # (the set-up it serves, Doorbell or None)

    def ready(self, actor) -> bool:
        if self.setup is None or self.setup[0] is not actor.group:
            self.setup = (actor.group, *self._set_up(actor))
        self.reason = self.setup[2]
        return self.setup[1] is not None

    def reset(self) -> None:
        self.setup = None

    def buffer_bytes(self) -> int:
        """The file's size (the engines' weights, one copy for the node instead of one per engine), 0
        when not set up."""
        layout = self.setup[1] if self.setup is not None else None
        return layout.file_bytes if layout is not None else 0

    def _set_up(self, actor) -> tuple:
        """Every engine's weights move into one shared file that every actor rank maps. Returns
        ``(layout, reason)``; the layout is None where it cannot run, and the reason then says why."""
        r = self.rollout
        plans = actor.group.call("sync_send", [("shared_memory", "plan")] * actor.size)
        if any(p is None for p in plans):
            return None, "the actor's strategy has no direct reshard plan, or its weights are not in host memory"
        layouts = r.recv_call("shared_memory", "layout")
        if any(x is None for x in layouts):
            return None, "the rollout engine cannot hold its weights in shared memory"
        if any(x != layouts[0] for x in layouts):
            return None, "the rollout engines lay their weights out differently"
        layout = plan_layout(layouts[0], plans)
        try:
            path, token = create_buffer(layout.file_bytes)
        except OSError as e:
            return None, f"no room for the {layout.file_bytes >> 20} MiB weight-sync file in /dev/shm: {e}"
        try:
            # the actor ranks first: an engine that joins moves its weights into the file, so join only
            # where the writers can reach it
            ok = actor.group.call("sync_send", [("shared_memory", "attach", path, token, layout)] * actor.size)
            if all(ok):
                ok = r.recv_call("shared_memory", "attach", path, token, layout)
        finally:
            os.unlink(path)  # every process that joined keeps its mapping; nothing outlives them
        if not all(ok):
            return None, "the actor and the engines do not share a node's /dev/shm"
        return layout, ""

    def sync(self, actor, verify: bool) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.rollout.in_actor:
            res = self._ring(actor, verify)
            errors = [(i, x["error"]) for i, x in enumerate(res) if x["error"]]
            if errors:  # every rank compared what it wrote with what it sent
                raise WeightSyncError(f"rank {errors[0][0]}: {errors[0][1]}")
            m = self._metrics(actor, t0, res[0]["bytes"], verify)
            m["sync/doorbell"] = float(self._bell[1] is not None)
            return m
        # every actor rank writes its blocks (checking each chunk in cache); then (Ray resolves the ranks'
        # results first) every engine re-derives its packed weights
        writes = actor.group.async_call("sync_send", [("shared_memory", "write", verify)] * actor.size)
        nbytes = self.rollout.recv_call("shared_memory", "load", *writes)[0]
        return self._metrics(actor, t0, nbytes, verify)

    def _metrics(self, actor, t0: float, nbytes: int, verify: bool) -> dict[str, float]:
        m = sync_metrics(t0, nbytes, 1, verify)
        m["sync/shared_memory"] = 1.0
        if verify:
            self.check_once(actor, self.setup)
        return m

    def _ring(self, actor, verify: bool) -> list[dict]:
        """The hybrid engine's sync on every rank: on the doorbell where the driver reaches the ranks, else
        a Ray call. A failure on the doorbell closes it (later syncs of this set-up go through Ray)."""
        bell = self._doorbell(actor)
        if bell is None:
            return actor.group.call("sync_send", [("shared_memory", "sync_engine_shm", verify)] * actor.size)
        try:
            return bell.call("sync_engine_shm", [(verify,)] * actor.size)
        except DoorbellError:
            self._bell = (self.setup, None)
            actor.group.call("ping")  # a lost worker or node raises here, named by the group
            raise

    def _doorbell(self, actor):
        """The doorbell to the actor ranks, opened with each set-up; None in-process or where the driver
        cannot reach them (another node): Ray calls then."""
        if self._bell is None or self._bell[0] is not self.setup:
            self.close()
            bell = None
            if not actor.group.in_process:
                bell = Doorbell.connect(actor.group.call("sync_send", [("shared_memory", "doorbell_open")]
                                                         * actor.size))
            self._bell = (self.setup, bell)
        return self._bell[1]

    def close(self) -> None:
        if self._bell is not None and self._bell[1] is not None:
            self._bell[1].close()
        self._bell = None
