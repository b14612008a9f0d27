"""Driver checkpoints: atomic under SIGKILL, exact RNG resume, clear errors for bad checkpoints."""

import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from trainer.checkpoint import CheckpointError, CheckpointManager, capture_rng, load_driver_state, restore_rng


def test_save_find_load_and_prune(tmp_path):
    m = CheckpointManager(str(tmp_path), max_to_keep=2)
    for s in (1, 2, 3):
        m.save(s, {"dataloader": {"offset": s * 16}},
               write_workers=lambda d, s=s: open(os.path.join(d, "actor.bin"), "w").write(str(s)))
    assert m.find_latest().endswith("global_step_3")
    # verl's layout: global_step_N dirs and the tracker file holding the newest step
    assert sorted(os.listdir(tmp_path)) == ["global_step_2", "global_step_3", "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"
    st = load_driver_state(m.find_latest())
    assert st["step"] == 3 and st["dataloader"]["offset"] == 48
    assert open(os.path.join(m.find_latest(), "actor.bin")).read() == "3"


def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal
        from trainer.checkpoint import CheckpointManager
        m = CheckpointManager({str(tmp_path)!r})
        m.save(1, {{"x": 1}})
        def die(d):
            open(os.path.join(d, "half.bin"), "w").write("partial")
            os.kill(os.getpid(), signal.SIGKILL)
        m.save(2, {{"x": 2}}, write_workers=die)
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)))
    assert p.returncode == -9
    m = CheckpointManager(str(tmp_path))
    assert m.find_latest().endswith("global_step_1")  # the killed save is invisible
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert load_driver_state(m.find_latest())["x"] == 1
    assert len(m.clean_stale()) == 1 and not any(n.startswith(".tmp") for n in os.listdir(tmp_path))


def test_rng_round_trip_gives_identical_draws():
    random.seed(3); np.random.seed(3); torch.manual_seed(3)
    st = capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(99); np.random.seed(99); torch.manual_seed(99)
    restore_rng(st)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_bad_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_driver_state(str(tmp_path / "nope"))
    half = tmp_path / "global_step_5"
    half.mkdir()
    with pytest.raises(CheckpointError, match="incomplete.*resume_from_path"):
        load_driver_state(str(half))
    (half / "COMPLETE").write_text("5")
    (half / "driver_state.pt").write_bytes(b"\x80garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_driver_state(str(half))
    # a stale tracker file pointing at an incomplete dir falls back to the newest complete one
    import shutil
    shutil.rmtree(half)
    m = CheckpointManager(str(tmp_path))
    m.save(3, {})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("9")
    assert m.find_latest().endswith("global_step_3")
    (tmp_path / "global_step_9").mkdir()  # half-written: a directory with no marker is never complete
    (tmp_path / "global_step_9" / "actor").mkdir()
    assert m.find_latest().endswith("global_step_3")


def test_save_and_load_contents_refused_with_the_reason():
    from tests.support.tiny import tiny_config
    from trainer.config import ConfigError

    ok = tiny_config(["actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"])
    # verl's default: load_contents follows save_contents ('hf_model' there is a copy, never loaded)
    assert list(ok.actor_rollout_ref.actor.checkpoint.load_contents) == ["model", "optimizer", "extra", "hf_model"]
    tiny_config(["actor_rollout_ref.actor.checkpoint.load_contents=[model]"])  # fresh optimizer and scheduler: fine
    with pytest.raises(ConfigError) as e:
        tiny_config(["actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]",
                     "actor_rollout_ref.actor.checkpoint.load_contents=[optimizer,weights]"])
    msg = str(e.value)
    assert "save_contents=['model', 'hf_model'] leaves out ['optimizer', 'extra']" in msg
    assert "load_contents has ['weights']" in msg and "has no 'model'" in msg


class _Payload:
    """A pickle that would run code when loaded (writes a file)."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_a_handed_over_driver_state_cannot_run_code(tmp_path):
    """A checkpoint is data: a driver_state.pt whose pickle calls a function is refused as unreadable,
    and the call never happens; a real driver state (numpy RNG key included) still loads."""
    m = CheckpointManager(str(tmp_path / "run"))
    good = m.save(3, {"rng": capture_rng(), "history": [{"step": 1, "x": 0.5}]})
    state = load_driver_state(good)
    assert state["step"] == 3 and isinstance(state["rng"]["numpy"][1], np.ndarray)
    target = tmp_path / "pwned"
    torch.save({"step": 4, "evil": _Payload(str(target))}, os.path.join(good, "driver_state.pt"))
    with pytest.raises(CheckpointError, match="cannot read driver_state.pt"):
        load_driver_state(good)
    assert not target.exists()


def test_manifest_catches_damage_and_resume_takes_the_newest_verified_step(tmp_path):
    """Every file of a checkpoint is listed with its size and sha256; truncating, deleting, flipping one
    byte of, or adding a file, or a garbage manifest, is caught before anything is read; a resume tries the
    checkpoints newest first (the loop's walk back to the intact one: tests/security/test_resume_verify.py)."""
    from trainer.checkpoint import MANIFEST, verify

    m = CheckpointManager(str(tmp_path))

    def workers(d):
        os.makedirs(os.path.join(d, "actor"))
        with open(os.path.join(d, "actor", "shard.bin"), "wb") as f:
            f.write(bytes(range(256)) * 64)

    damage = {
        "truncated": lambda d: open(os.path.join(d, "actor", "shard.bin"), "r+b").truncate(100),
        "deleted": lambda d: os.remove(os.path.join(d, "actor", "shard.bin")),
        "flipped": lambda d: _flip(os.path.join(d, "actor", "shard.bin"), 5000),
        "added": lambda d: open(os.path.join(d, "actor", "extra.py"), "w").write("import os"),
        "garbage manifest": lambda d: open(os.path.join(d, MANIFEST), "w").write("{not json"),
        "driver state": lambda d: _flip(os.path.join(d, "driver_state.pt"), 40),
    }
    want = {"truncated": "shard.bin does not match", "deleted": "shard.bin is missing", "flipped": "shard.bin does not match",
            "added": "extra.py is not in the checkpoint's manifest", "garbage manifest": "unreadable",
            "driver state": "driver_state.pt does not match"}
    for kind, hurt in damage.items():
        root = tmp_path / kind.replace(" ", "_")
        m = CheckpointManager(str(root))
        for s in (1, 2):
            m.save(s, {"x": s}, write_workers=workers)
        verify(m.step_dir(2))  # intact: passes
        hurt(m.step_dir(2))
        with pytest.raises(CheckpointError, match=want[kind]):
            verify(m.step_dir(2))
        # the order a resume tries them in (trainer.main.train): the damaged newest, then the intact one
        assert m.candidates() == [m.step_dir(2), m.step_dir(1)], kind
        verify(m.step_dir(1))
    # an unreadable tracker file counts as absent: the scan finds the newest complete step
    (root / "latest_checkpointed_iteration.txt").write_bytes(os.urandom(32) + b"\xff\xfe")
    assert m.find_latest() == m.step_dir(2)
    (root / "latest_checkpointed_iteration.txt").write_text("../../etc")
    assert m.find_latest() == m.step_dir(2)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 1]))


def test_staged_dir_swaps_in_whole_or_leaves_the_old_directory(tmp_path):
    """trainer.fsutil.staged_dir (the HF and peft exports'): a block that ends normally replaces the directory whole;
    one that raises leaves the old contents and no temporary directory beside them."""
    import pytest

    from trainer.fsutil import staged_dir

    final = tmp_path / "export"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with staged_dir(str(final)) as tmp:
            (tmp_path / tmp / "new.txt").write_text("half")
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"] and sorted(p.name for p in final.iterdir()) == ["old.txt"]
    with staged_dir(str(final)) as tmp:
        (tmp_path / tmp / "new.txt").write_text("whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"] and sorted(p.name for p in final.iterdir()) == ["new.txt"]
