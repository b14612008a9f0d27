"""Dump a step's batch and replay it: the files behind ``trainer.debug.rollout_only`` / ``train_only``.

``trainer.debug.dump_batch_path=DIR`` writes, after rollout + reward + dynamic sampling of step ``s``,
``DIR/step_{s:06d}.safetensors`` (every tensor field of the :class:`~trainer.batch.RolloutBatch`, in
its own dtype) and ``DIR/step_{s:06d}.meta.json`` (the per-sample metadata: data source, ground truth,
multi-turn messages, ...). Both are written atomically (temp file + rename), the JSON last, so a file
pair whose JSON exists is complete.

``trainer.debug.train_only=true`` trains on those dumps instead of generating: step ``s`` replays
``step_{s:06d}`` when it exists, else the dumps in order, cycling (a handful of dumped steps drive a
long profiling run). ``trainer.debug.rollout_only=true`` generates and scores without training.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from trainer.batch import FIELD_SPECS, RolloutBatch, make_meta


def _atomic(path: str, write) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def dump_batch(batch: RolloutBatch, directory: str, step: int) -> str:
    os.makedirs(directory, exist_ok=True)
    stem = os.path.join(directory, f"step_{step:06d}")
    tensors = {n: getattr(batch, n).contiguous() for n in FIELD_SPECS if getattr(batch, n) is not None}
    _atomic(stem + ".safetensors", lambda p: save_file(tensors, p))
    meta = {}
    if batch.meta is not None:
        for key in batch.meta.keys():
            meta[key] = batch.get_meta(key)
    doc = {"step": step, "batch_size": batch.num_samples, "meta": meta}

    def _write_json(p):
        with open(p, "w") as f:
            json.dump(doc, f, default=_jsonable)

    _atomic(stem + ".meta.json", _write_json)
    return stem


def _jsonable(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"batch metadata of type {type(o).__name__} cannot be dumped as JSON")


def dumped_steps(directory: str) -> list[str]:
    """The complete dumps in ``directory`` (stems), in step order."""
    return sorted(p[: -len(".meta.json")] for p in glob.glob(os.path.join(directory, "step_*.meta.json")))


def load_batch(stem: str) -> RolloutBatch:
    try:
        tensors = load_file(stem + ".safetensors")
        with open(stem + ".meta.json") as f:
            doc = json.load(f)
    except (OSError, ValueError, SafetensorError) as e:
        raise ValueError(f"cannot read the dumped batch {stem}.safetensors / .meta.json ({e}); dump it again "
                         f"with trainer.debug.dump_batch_path") from e
    unknown = sorted(set(tensors) - set(FIELD_SPECS))
    if unknown:
        raise ValueError(f"{stem}.safetensors has fields this version does not know: {unknown}")
    b = int(doc["batch_size"])
    meta = make_meta(doc["meta"], b) if doc["meta"] else None
    return RolloutBatch(**tensors, meta=meta, batch_size=[b])


def replay_batch(directory: str, step: int) -> RolloutBatch:
    """The batch to train on at ``step`` in train-only mode (see the module docstring)."""
    stems = dumped_steps(directory)
    if not stems:
        raise FileNotFoundError(f"trainer.debug.train_only=true but trainer.debug.dump_batch_path={directory} holds no "
                                f"dumped batch (step_*.meta.json); first run with trainer.debug.dump_batch_path={directory} "
                                f"(e.g. with trainer.debug.rollout_only=true)")
    own = os.path.join(directory, f"step_{step:06d}")
    return load_batch(own if own in stems else stems[(step - 1) % len(stems)])
