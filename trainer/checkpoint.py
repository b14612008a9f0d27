"""Atomic checkpoints and exact resume for the driver, in verl's layout.

Under ``trainer.default_local_dir`` (verl's meaning: the checkpoint root)::

    global_step_12/            a complete checkpoint (only ever appears by rename)
        actor/                 sharded model + optimizer + LR scheduler (megatron dist_checkpointing)
        actor/huggingface/     HF safetensors + config + tokenizer (save_contents has 'hf_model')
        critic/                the critic's, when there is one
        driver_state.pt        step, dataloader position, RNG states, KL controller, DAPO carry-over
                               (verl's data.pt, plus what exact resume needs)
        MANIFEST.json          size and sha256 of every other file, written before the marker
        COMPLETE               marker written last inside the temp dir, before the rename
    latest_checkpointed_iteration.txt   verl's tracker file: the newest complete step, e.g. ``12``
    .tmp-global_step_13-<pid>/ a save in progress (removed on the next start)

A save writes everything into a temporary sibling directory, fsyncs it, renames it into place and only
then rewrites ``latest_checkpointed_iteration.txt`` (temp file + ``os.replace``). A crash at any point
leaves either the old checkpoint or the new one, never half of one. ``find_latest`` trusts the tracker
file only after checking the ``COMPLETE`` marker and otherwise scans for the newest complete directory.

Nothing in a checkpoint is read before it is verified: :func:`verify` checks every file against the
manifest (present, same size, same sha256; no file missing or added) before the driver state or the
workers' shards are opened. A resume in ``auto`` mode walks back from the newest complete step to the
newest one that verifies, with one warning per rejected step; an explicit ``resume_from_path`` that does
not verify stops the run with one line naming the bad file. An unreadable tracker file counts as
absent (the scan decides), and the tracker can only name a ``global_step_N`` directory of the root.

A manifest is an unkeyed list of hashes: whoever can write the files can rewrite it too. So no pickle of
a checkpoint is trusted either: :func:`check_pickles` walks every pickle a resume would unpickle
(torch.distributed.checkpoint's ``.metadata``, which torch reads with plain ``pickle.load``; every item of
its ``*.distcp`` files, some of which megatron reads with ``weights_only=False``; ``common.pt``,
``driver_state.pt``, DeepSpeed's model and optimizer files: every ``*.pt`` / ``*.pth`` / ``*.pkl``) with
an unpickler that calls nothing: each global a pickle names must be on :data:`SAFE_GLOBALS` (torch's own
``weights_only`` list, the checkpoint metadata dataclasses, numpy's RNG key array, DeepSpeed's loss
scaler and ZeRO records) and is replaced by an inert stand-in while the walk goes on. A pickle naming
anything else (``os.system``, ``builtins.eval``, ...) fails the checkpoint before any loader opens it. A
checkpoint without a manifest is refused unless ``trainer.resume_allow_unverified=true`` (its pickles
are checked all the same). The manifest records its writer's format (``format``: :data:`FORMAT_VERSION`).

``trainer.max_actor_ckpt_to_keep`` (verl: keep the newest N; None or <= 0 keeps all) prunes whole
``global_step_*`` directories: a Coxswain checkpoint is one unit (actor, critic and driver state).

``actor_rollout_ref.actor.checkpoint.save_contents`` / ``load_contents`` (verl's names):
``model``, ``optimizer`` and ``extra`` (LR scheduler + RNG states) are always saved (one sharded
megatron checkpoint holds them; exact resume needs all three), ``hf_model`` adds
``actor/huggingface``. ``load_contents`` chooses what a resume restores: without ``optimizer`` the
optimizer starts fresh, without ``extra`` the LR scheduler and the workers' RNG states start fresh;
``model`` is required (:func:`contents_errors` refuses the rest with the reason).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import shutil
import zipfile
from typing import Any, Callable, Optional

from trainer.fsutil import replace_dir

# numpy and torch are imported where used: trainer.config checks save/load_contents at load time

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
MARKER = "COMPLETE"
DRIVER_STATE = "driver_state.pt"
MANIFEST = "MANIFEST.json"
MANIFEST_VERSION = 2  # 1: files only; 2: files + the writer's format
FORMAT_VERSION = 1  # the layout above; a reader refuses a checkpoint written in a newer one
TRACKER = "latest_checkpointed_iteration.txt"  # verl's name
HF_DIR = os.path.join("actor", "huggingface")
CONTENTS = ("model", "optimizer", "extra", "hf_model")
ALWAYS_SAVED = ("model", "optimizer", "extra")


def contents_errors(save_contents, load_contents) -> list[str]:
    """Why ``actor_rollout_ref.actor.checkpoint.{save,load}_contents`` cannot be honoured (empty: fine)."""
    key = "actor_rollout_ref.actor.checkpoint"
    errs = []
    save, load = list(save_contents or []), list(load_contents or [])
    for name, vals in (("save_contents", save), ("load_contents", load)):
        bad = [v for v in vals if v not in CONTENTS]
        if bad:
            errs.append(f"{key}.{name} has {bad}; the values are {list(CONTENTS)}.")
    missing = [v for v in ALWAYS_SAVED if v not in save]
    if missing:
        errs.append(f"{key}.save_contents={save} leaves out {missing}: a Coxswain checkpoint is one sharded megatron "
                    f"checkpoint holding model, optimizer and LR scheduler, so it cannot leave parts out. Use "
                    f"{list(ALWAYS_SAVED)} (add 'hf_model' for actor/huggingface), and choose what a resume restores "
                    f"with {key}.load_contents.")
    if load and "model" not in load:
        errs.append(f"{key}.load_contents={load} has no 'model': resuming step N without step N's weights is not a "
                    f"resume. Keep 'model' (drop 'optimizer' / 'extra' to start those fresh), or start a new run "
                    f"from other weights with actor_rollout_ref.model.path and trainer.resume_mode=disable.")
    return errs


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it and what to do."""


def capture_rng() -> dict[str, Any]:
    """Every RNG the driver (or a worker) draws from."""
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            except OSError:
                pass


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointManager:
    def __init__(self, root: str, max_to_keep: Optional[int] = None):
        self.root = root
        self.max_to_keep = max_to_keep if max_to_keep and max_to_keep > 0 else None  # verl: None / <= 0 keep all
        os.makedirs(root, exist_ok=True)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"global_step_{step}")

    def clean_stale(self) -> list[str]:
        """Remove temp dirs left by a save that was killed; returns what was removed."""
        removed = []
        for name in os.listdir(self.root):
            if name.startswith(".tmp-global_step_"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                removed.append(name)
        return removed

    def save(self, step: int, driver_state: dict[str, Any],
             write_workers: Optional[Callable[[str], None]] = None) -> str:
        """Write a checkpoint atomically. ``write_workers(tmp_dir)`` saves the worker states (actor,
        critic, ...) into the temporary directory before the driver state and the marker."""
        import torch

        final = self.step_dir(step)
        tmp = os.path.join(self.root, f".tmp-global_step_{step}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            if write_workers is not None:
                write_workers(tmp)
            torch.save({"step": step, **driver_state}, os.path.join(tmp, DRIVER_STATE))
            write_manifest(tmp)
            with open(os.path.join(tmp, MARKER), "w") as f:
                f.write(str(step))
            _fsync_tree(tmp)
            replace_dir(tmp, final)  # re-saving the same step (after a resume) replaces it whole
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _atomic_write_text(os.path.join(self.root, TRACKER), str(step))  # only after the rename: never half a checkpoint
        self._prune()
        return final

    def _complete_steps(self) -> list[int]:
        steps = []
        for name in os.listdir(self.root):
            m = _STEP_DIR.match(name)
            if m and os.path.isfile(os.path.join(self.root, name, MARKER)):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def _prune(self) -> None:
        if not self.max_to_keep:
            return
        for s in self._complete_steps()[: -self.max_to_keep]:
            shutil.rmtree(self.step_dir(s), ignore_errors=True)

    def find_latest(self) -> Optional[str]:
        pointer = os.path.join(self.root, TRACKER)
        try:
            with open(pointer, "rb") as f:
                text = f.read(64).decode("ascii").strip()
        except (OSError, UnicodeDecodeError):
            text = ""  # missing or garbage: the scan below decides
        if text.isdigit():
            path = self.step_dir(int(text))  # only ever global_step_N under the root
            if os.path.isfile(os.path.join(path, MARKER)):
                return path
        steps = self._complete_steps()
        return self.step_dir(steps[-1]) if steps else None

    def candidates(self) -> list[str]:
        """Complete checkpoints, newest first (the tracker's choice first)."""
        latest = self.find_latest()
        rest = [self.step_dir(s) for s in reversed(self._complete_steps())]
        return ([latest] if latest else []) + [d for d in rest if d != latest]


def _numpy_array_globals() -> list:
    """What unpickling a numpy array (``np.random.get_state()``'s key) needs: its reconstructor,
    ``ndarray`` and ``dtype`` with the dtype's class, and the byte codec; no callable that runs code."""
    import codecs

    import numpy as np

    from numpy._core.multiarray import _reconstruct

    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)), codecs.encode]


def _sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(root: str) -> list[str]:
    out = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            if rel not in (MANIFEST, MARKER):
                out.append(rel)
    return sorted(out)


def write_manifest(ckpt_dir: str) -> None:
    """``MANIFEST.json``: the writer's format and the size and sha256 of every file of the checkpoint (but
    itself and the marker)."""
    doc = {"version": MANIFEST_VERSION, "format": FORMAT_VERSION,
           "files": {rel: {"size": os.path.getsize(os.path.join(ckpt_dir, rel)),
                           "sha256": _sha256(os.path.join(ckpt_dir, rel))} for rel in _files(ckpt_dir)}}
    with open(os.path.join(ckpt_dir, MANIFEST), "w") as f:
        json.dump(doc, f, indent=1)


def _read_manifest(mf: str) -> dict:
    try:
        with open(mf) as f:
            doc = json.load(f)
        listed = doc["files"]
        assert isinstance(listed, dict)
    except Exception as e:
        raise CheckpointError(f"{mf} is unreadable ({type(e).__name__}); the checkpoint cannot be verified") from e
    fmt = doc.get("format", 1)
    if not isinstance(fmt, int) or fmt > FORMAT_VERSION:
        raise CheckpointError(f"{mf} says the checkpoint is in format {fmt!r}, newer than this version reads "
                              f"({FORMAT_VERSION}); resume it with the version that wrote it")
    return listed


def verify(ckpt_dir: str, allow_unverified: bool = False) -> None:
    """Check a checkpoint before anything in it is opened: every file its manifest lists present with its
    size and sha256, no unlisted file, and every pickle in it naming only :data:`SAFE_GLOBALS`
    (:func:`check_pickles`). Without a manifest it is refused unless ``allow_unverified``
    (``trainer.resume_allow_unverified``). Raises :class:`CheckpointError` naming the first bad file."""
    if not os.path.isfile(os.path.join(ckpt_dir, MARKER)):
        raise CheckpointError(f"checkpoint '{ckpt_dir}' is incomplete (no {MARKER} marker)")
    mf = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isfile(mf):
        if not allow_unverified:
            raise CheckpointError(f"checkpoint '{ckpt_dir}' has no {MANIFEST}, so its files cannot be verified "
                                  f"(written before manifests, or the manifest was removed); if you trust whoever "
                                  f"wrote it, set trainer.resume_allow_unverified=true")
    else:
        listed = _read_manifest(mf)
        present = set(_files(ckpt_dir))
        for rel, want in sorted(listed.items()):
            path = os.path.join(ckpt_dir, rel)
            if os.path.isabs(rel) or ".." in rel.split(os.sep) or rel not in present:
                raise CheckpointError(f"{path} is missing")
            if not isinstance(want, dict) or os.path.getsize(path) != want.get("size") or _sha256(path) != want.get("sha256"):
                raise CheckpointError(f"{path} does not match the checkpoint's manifest (corrupt or modified)")
        extra = sorted(present - set(listed))
        if extra:
            raise CheckpointError(f"{os.path.join(ckpt_dir, extra[0])} is not in the checkpoint's manifest (added later)")
    check_pickles(ckpt_dir)


# ---------------------------------------------------------------------------------------------------
# pickles: walked with nothing called before any loader opens them

PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle")
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of the *.distcp items (a plain pickle)
_DCP = "torch.distributed.checkpoint."
# beyond torch's weights_only list: what checkpoints of megatron (via torch.distributed.checkpoint),
# DeepSpeed and the driver hold. Each is a data record or an enum; none runs code given any arguments.
EXTRA_SAFE_GLOBALS = frozenset({
    *(_DCP + "metadata." + n for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                       "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                                       "_MEM_FORMAT_ENCODING")),
    _DCP + "filesystem._StorageInfo",
    *(_DCP + "planner." + n for n in ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType", "LoadPlan",
                                      "ReadItem", "LoadItemType")),
    "torch.serialization._get_layout", "pathlib.PosixPath", "pathlib.PurePosixPath",
    # numpy's RNG key array (np.random.get_state()), pickled by value
    "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy._core.multiarray.scalar",
    "numpy.core.multiarray.scalar", "numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType", "codecs.encode",
    # DeepSpeed's optimizer files
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", "deepspeed.utils.tensor_fragment.fragment_address",
})


def safe_globals() -> frozenset:
    """The globals a checkpoint's pickle may name (``module.name``): torch's ``weights_only`` list, the
    globals registered with ``torch.serialization.add_safe_globals`` and :data:`EXTRA_SAFE_GLOBALS`."""
    import torch
    from torch import _weights_only_unpickler

    added = {f"{g.__module__}.{g.__qualname__}" for g in torch.serialization.get_safe_globals() if hasattr(g, "__qualname__")}
    return frozenset(_weights_only_unpickler._get_allowed_globals()) | added | EXTRA_SAFE_GLOBALS


class _Inert:
    """What an allowed global becomes while a pickle is walked: accepts every call the unpickler makes
    (construction, state, items) and does nothing, so no code of the checkpoint's choosing runs."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass

    def add(self, value):
        pass


class _Walker(pickle.Unpickler):
    """Reads a pickle calling nothing: an allowed global is an :class:`_Inert` class, any other refused."""

    def __init__(self, f, allowed: frozenset):
        super().__init__(f)
        self.allowed = allowed

    def find_class(self, module, name):
        if f"{module}.{name}" not in self.allowed:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint never holds")
        return type(name, (_Inert,), {})

    def persistent_load(self, pid):
        return _Inert()  # a torch storage: its bytes are raw data, never unpickled


class _MetadataReader(_Walker):
    """torch.distributed.checkpoint's ``.metadata`` with the real classes, admitting only allowed globals
    (all of them data records: building them runs nothing)."""

    def find_class(self, module, name):
        super().find_class(module, name)  # refuses what is not allowed
        return pickle.Unpickler.find_class(self, module, name)


class _Slice(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a seekable file (one ``*.distcp`` item)."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buf):
        n = max(0, min(len(buf), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buf)[:n])
        self.pos += got
        return got


def _walk(f, allowed: frozenset) -> None:
    """Every pickle of ``f`` (a torch zip: its ``*.pkl`` members; otherwise the pickles in a row to the
    end), walked by :class:`_Walker`. Anything the walk cannot read is refused as well: a real loader
    reading further than the walk could meet a global the walk never saw."""
    head = f.read(4)
    f.seek(0)
    if head == b"PK\x03\x04":  # torch.save's zip format (what torch.load checks for)
        with zipfile.ZipFile(f) as z:
            for member in z.namelist():
                if member.endswith(".pkl"):
                    with z.open(member) as m:
                        _walk_stream(io.BytesIO(m.read()), allowed)
        return
    _walk_stream(f, allowed)


def _walk_stream(f, allowed: frozenset) -> None:
    end = f.seek(0, io.SEEK_END)
    f.seek(0)
    while f.tell() < end:
        _Walker(f, allowed).load()


def _dcp_items(directory: str, allowed: frozenset) -> dict[str, list[tuple[int, int]]]:
    """``*.distcp`` file -> its items' (offset, length), from the directory's ``.metadata``."""
    with open(os.path.join(directory, DCP_METADATA), "rb") as f:
        md = _MetadataReader(f, allowed).load()
    items: dict[str, list[tuple[int, int]]] = {}
    for info in getattr(md, "storage_data", None).values():
        rel = info.relative_path
        if os.path.isabs(rel) or os.sep in rel or getattr(info, "transform_descriptors", None):
            raise pickle.UnpicklingError(f"its item path {rel!r} is not a file of the directory")
        items.setdefault(rel, []).append((int(info.offset), int(info.length)))
    return items


def check_pickles(ckpt_dir: str) -> None:
    """Raise :class:`CheckpointError` naming the first file of ``ckpt_dir`` (walked recursively) whose
    pickles name a global outside :func:`safe_globals` or cannot be read; see the module docstring."""
    allowed = safe_globals()
    for rel in _files(ckpt_dir):
        directory, name = os.path.split(os.path.join(ckpt_dir, rel))
        path = os.path.join(directory, name)
        try:
            if name == DCP_METADATA:
                with open(path, "rb") as f:
                    _walk_stream(f, allowed)
                items = _dcp_items(directory, allowed)
                for shard, spans in sorted(items.items()):
                    path = os.path.join(directory, shard)
                    with open(path, "rb") as f:
                        for start, length in spans:
                            _walk(_Slice(f, start, length), allowed)
            elif name.endswith(PICKLE_SUFFIXES):
                with open(path, "rb") as f:
                    _walk(f, allowed)
        except Exception as e:  # noqa: BLE001 - anything a walk meets is the file's fault
            raise CheckpointError(f"{path} holds a pickle that cannot be loaded safely ({str(e)[:200] or type(e).__name__}): "
                                  f"the checkpoint was modified or not written by Coxswain; resume from another "
                                  f"one") from e


def load_driver_state(path: str) -> dict[str, Any]:
    """Load and check a checkpoint's driver state; a bad checkpoint is a clear error."""
    import torch

    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint '{path}' does not exist; check trainer.resume_from_path.")
    if not os.path.isfile(os.path.join(path, MARKER)):
        raise CheckpointError(
            f"checkpoint '{path}' is incomplete (no {MARKER} marker: its save was interrupted). "
            f"Delete it, or set trainer.resume_from_path to an earlier global_step_* directory.")
    f = os.path.join(path, DRIVER_STATE)
    try:
        # data only: a checkpoint someone hands over must not run code when it is read. Beyond torch's
        # tensors and plain containers, the one type the driver state holds is numpy's RNG key array.
        with torch.serialization.safe_globals(_numpy_array_globals()):
            state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or foreign file
        raise CheckpointError(f"checkpoint '{path}': cannot read {DRIVER_STATE} ({type(e).__name__}: {e}). "
                              f"The file is corrupt; resume from an earlier checkpoint.") from e
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"checkpoint '{path}': {DRIVER_STATE} is not a Coxswain driver state (no 'step').")
    return state


def save_workers(cluster, ckpt_dir: str, save_contents, model_path: str) -> None:
    """The workers' part of a checkpoint: ``actor/``, ``critic/`` and, with 'hf_model' in
    ``save_contents``, ``actor/huggingface`` (HF safetensors + config + tokenizer of ``model_path``)."""
    cluster.save(ckpt_dir)
    if "hf_model" in (save_contents or []):
        cluster.actor.export(os.path.join(ckpt_dir, HF_DIR), model_path)


def load_workers(cluster, ckpt_dir: str, load_contents) -> None:
    """Restore the trained groups from ``ckpt_dir/<role>``, only what ``load_contents`` names."""
    contents = tuple(c for c in (load_contents or ALWAYS_SAVED) if c in ALWAYS_SAVED)
    for name, group in cluster.trained().items():
        group.group.call("load", [(os.path.join(ckpt_dir, name),)] * group.size, contents=contents)
