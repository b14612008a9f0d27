"""The CLI's failure report: one paragraph (what, where, what to do), the traceback in the run
directory's ``error.log``, and a resume hint that states only what is on disk."""

import os

from tests.support.tiny import tiny_config
from trainer.checkpoint import CheckpointManager
from trainer.main import report_failure
from trainer.workers.group import WorkerDiedError


def _raise(e):
    try:
        raise e
    except BaseException as caught:  # noqa: BLE001 - to give it a traceback
        return caught


def report(e, run_dir, capsys):
    cfg = tiny_config([f"trainer.default_local_dir={run_dir}"])
    code = report_failure(e, cfg)
    err = capsys.readouterr().err
    return code, err


def test_a_worker_death_mid_step_names_the_step_and_the_checkpoint_that_exists(tmp_path, capsys):
    run_dir = tmp_path / "run"
    e = _raise(WorkerDiedError("a worker of group 'actor' died (ActorDiedError)."))
    e.coxswain_where = "step 3 of 5"
    code, err = report(e, run_dir, capsys)
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("error during step 3 of 5: a worker of group 'actor' died")
    assert f"No verified checkpoint is saved under {run_dir}: a rerun starts from step 0" in err  # none was saved
    log = (run_dir / "error.log").read_text()
    assert "Traceback (most recent call last)" in log and "WorkerDiedError" in log

    m = CheckpointManager(str(run_dir))
    m.save(2, {"dataloader": {"offset": 2}}, write_workers=lambda d: open(os.path.join(d, "actor.bin"), "w").write("x"))
    code, err = report(e, run_dir, capsys)
    assert f"The newest checkpoint that verifies is {m.step_dir(2)}: rerun the same command with trainer.resume_mode=auto" in err
    # damage it: the hint must not promise it any more
    with open(os.path.join(m.step_dir(2), "actor.bin"), "w") as f:
        f.write("y")
    code, err = report(e, run_dir, capsys)
    assert "No verified checkpoint" in err and m.step_dir(2) not in err
    assert (run_dir / "error.log").read_text().count("=== ") == 3  # appended, one record per failure


def test_unexpected_errors_and_interrupts_are_one_paragraph_too(tmp_path, capsys):
    e = _raise(KeyError("rollout_log_probs"))
    e.coxswain_where = "step 1 of 2"
    code, err = report(e, tmp_path / "run", capsys)
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("unexpected error during step 1 of 2: KeyError: 'rollout_log_probs'. This is probably a bug")
    code, err = report(_raise(KeyboardInterrupt()), tmp_path / "run", capsys)
    assert code == 130 and err.startswith("interrupted.") and "error.log" in err


def test_nan_loss_through_the_cli_has_no_stale_promise():
    """The NaN message itself no longer claims a checkpoint exists (the CLI decides from the disk)."""
    from trainer.step import check_update

    try:
        check_update({"actor/loss": float("nan")}, 4)
    except FloatingPointError as e:
        assert "step 4" in str(e) and "intact" not in str(e) and "resume" not in str(e)
    else:
        raise AssertionError("a NaN loss must stop the run")
