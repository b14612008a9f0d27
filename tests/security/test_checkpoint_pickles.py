"""A checkpoint never runs code on resume. Each hostile file (torch.distributed.checkpoint's ``.metadata``,
which torch reads with plain ``pickle.load``; megatron's ``common.pt``; the driver's ``driver_state.pt``;
an optimizer item inside a ``*.distcp`` shard, which torch reads with ``weights_only=False``; a DeepSpeed
optimizer file) is a pickle whose ``__reduce__`` would create a marker file. With the manifest left
stale, deleted, or rebuilt over the hostile file, the resume walk (verify, then the loaders) never
creates the marker: the newest checkpoint is refused with one line naming the file and the walk takes
the step before. A checkpoint without a manifest is refused unless ``trainer.resume_allow_unverified``,
and even then its pickles are checked.

The actor directory is written by torch.distributed.checkpoint itself (the format megatron's
dist_checkpointing saves through) plus a ``common.pt``; the loaders that would run a payload are the
third-party ones the workers call (torch DCP's reader, ``torch.load(weights_only=False)``)."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint import (MANIFEST, CheckpointError, CheckpointManager, capture_rng, load_driver_state, verify,
                                write_manifest)


class _Payload:
    """Unpickled, it creates ``target`` (a stand-in for any command)."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def _actor_state(payload=None):
    """A small sharded state as megatron saves it: tensors plus plain optimizer records (byte items)."""
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(4, 3, generator=g), "b": torch.zeros(3)},
            "optimizer": {"param_groups": payload if payload is not None else [{"lr": 0.01, "step": 2}]}}


def _write_actor(ckpt_dir, payload=None):
    actor = os.path.join(ckpt_dir, "actor")
    os.makedirs(actor, exist_ok=True)
    dcp.save(_actor_state(payload), checkpoint_id=actor, no_dist=True)
    torch.save({"extra": {"step": 2}, "scheduler": {"last_epoch": 2}}, os.path.join(actor, "common.pt"))
    ds = os.path.join(actor, "deepspeed")
    os.makedirs(ds, exist_ok=True)
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "loss_scale": 1.0}},
               os.path.join(ds, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))


def _read_like_the_workers(ckpt_dir):
    """What a resume reads after verify: the driver state, the sharded actor (torch DCP's reader: its
    ``.metadata`` by pickle.load, byte items by torch.load(weights_only=False)), megatron's common.pt and
    DeepSpeed's files (torch.load(weights_only=False), as those libraries call it)."""
    load_driver_state(ckpt_dir)
    actor = os.path.join(ckpt_dir, "actor")
    state = _actor_state()
    dcp.load(state, checkpoint_id=actor, no_dist=True)
    for dirpath, _, files in os.walk(actor):
        for f in files:
            if f.endswith(".pt"):
                torch.load(os.path.join(dirpath, f), weights_only=False)
    return state


def _resume_walk(root, allow_unverified=False):
    """trainer.main's auto resume: the newest checkpoint that verifies and loads, with the refusals."""
    refused = []
    for cand in CheckpointManager(root).candidates():
        try:
            verify(cand, allow_unverified)
            _read_like_the_workers(cand)
            return cand, refused
        except CheckpointError as e:
            refused.append(str(e))
    return None, refused


def _two_steps(root):
    m = CheckpointManager(str(root))
    for step in (1, 2):
        m.save(step, {"rng": capture_rng(), "history": [{"step": step}]}, write_workers=_write_actor)
    return m


def _plant(kind, step_dir, target):
    """Replace one file of ``step_dir`` with a hostile pickle."""
    actor = os.path.join(step_dir, "actor")
    if kind == "metadata":
        import pickle

        with open(os.path.join(actor, ".metadata"), "wb") as f:
            pickle.dump(_Payload(target), f)
        return ".metadata"
    if kind == "common.pt":
        torch.save({"extra": _Payload(target)}, os.path.join(actor, "common.pt"))
        return "common.pt"
    if kind == "driver_state.pt":
        torch.save({"step": 2, "evil": _Payload(target)}, os.path.join(step_dir, "driver_state.pt"))
        return "driver_state.pt"
    if kind == "optimizer item":  # the shard rewritten with the payload as the optimizer's param_groups
        for f in os.listdir(actor):
            if f.endswith(".distcp") or f == ".metadata":
                os.remove(os.path.join(actor, f))
        dcp.save(_actor_state(_Payload(target)), checkpoint_id=actor, no_dist=True)
        return ".distcp"
    if kind == "deepspeed optimizer":
        torch.save({"optimizer_state_dict": {"loss_scaler": _Payload(target)}},
                   os.path.join(actor, "deepspeed", "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
        return "optim_states.pt"
    raise ValueError(kind)


KINDS = ("metadata", "common.pt", "driver_state.pt", "optimizer item", "deepspeed optimizer")


@pytest.mark.parametrize("manifest", ["stale", "deleted", "rebuilt"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_pickle_never_runs_and_the_resume_falls_back(tmp_path, kind, manifest):
    m = _two_steps(tmp_path / "run")
    target = tmp_path / "pwned"
    _read_like_the_workers(m.step_dir(2))  # the intact checkpoint loads with the readers used below
    named = _plant(kind, m.step_dir(2), str(target))
    if manifest == "deleted":
        os.remove(os.path.join(m.step_dir(2), MANIFEST))
    elif manifest == "rebuilt":  # whoever wrote the files can rewrite the hash list too
        write_manifest(m.step_dir(2))
    chosen, refused = _resume_walk(str(tmp_path / "run"))
    assert not target.exists(), "a checkpoint's pickle ran code"
    assert chosen == m.step_dir(2 - 1)
    assert len(refused) == 1 and "\n" not in refused[0] and m.step_dir(2) in refused[0], refused
    if manifest == "deleted":  # refused for the missing manifest, with the key that opts in
        assert "has no MANIFEST.json" in refused[0] and "trainer.resume_allow_unverified=true" in refused[0]
    elif manifest == "rebuilt":  # the hashes match: the pickle walk names the file and the global
        assert named in refused[0] and "io.open, which a checkpoint never holds" in refused[0] and "cannot be loaded safely" in refused[0]
    else:
        assert named in refused[0] or "does not match" in refused[0]


@pytest.mark.parametrize("kind", KINDS)
def test_opting_in_to_an_unverified_checkpoint_still_checks_its_pickles(tmp_path, kind):
    m = _two_steps(tmp_path / "run")
    target = tmp_path / "pwned"
    os.remove(os.path.join(m.step_dir(1), MANIFEST))
    os.remove(os.path.join(m.step_dir(2), MANIFEST))
    _plant(kind, m.step_dir(2), str(target))
    chosen, refused = _resume_walk(str(tmp_path / "run"), allow_unverified=True)
    assert not target.exists()
    # step 2 refused for its pickle; step 1 (no manifest, intact) taken because the user opted in
    assert chosen == m.step_dir(1) and len(refused) == 1 and "io.open, which a checkpoint never holds" in refused[0]
    # without the opt-in neither resumes: both lack a manifest
    chosen, refused = _resume_walk(str(tmp_path / "run"))
    assert chosen is None and len(refused) == 2 and all("has no MANIFEST.json" in r for r in refused)
    assert not target.exists()


def test_the_manifest_records_the_format_and_a_newer_one_is_refused(tmp_path):
    import json

    m = _two_steps(tmp_path / "run")
    mf = os.path.join(m.step_dir(2), MANIFEST)
    doc = json.load(open(mf))
    assert (doc["version"], doc["format"]) == (2, 1)
    verify(m.step_dir(2))
    doc["format"] = 2
    json.dump(doc, open(mf, "w"))
    with pytest.raises(CheckpointError, match="format 2, newer than this version reads"):
        verify(m.step_dir(2))
    # the data the walk admits is the real data: the intact step's actor loads bit for bit
    got = _read_like_the_workers(m.step_dir(1))
    assert torch.equal(got["model"]["w"], _actor_state()["model"]["w"])
    assert got["optimizer"]["param_groups"] == [{"lr": 0.01, "step": 2}]
