"""Tracking: a real local MLflow (SQLite) store receives params, batched metrics and artifacts; secrets never do."""

import pytest
from mlflow.tracking import MlflowClient

from trainer.config import ConfigError
from trainer.tracking import Tracker, artifact_location, default_tracking_uri, redact


def test_mlflow_run_gets_params_metrics_artifacts_and_no_secrets(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DASHSCOPE_API_KEY", "sk-very-secret-123")
    cfg = {"algorithm": {"gamma": 0.99}, "judge": {"api_key": "plain-secret", "api_key_env": "DASHSCOPE_API_KEY",
                                                    "base_url": "http://h/?k=sk-very-secret-123"}}
    root = tmp_path / "mlruns"
    t = Tracker("proj", "exp", ["mlflow", "console"], config=cfg, total_steps=4, mlruns_root=str(root))
    t.log_metrics({"reward/mean": 0.25, "actor/pg_loss": -0.1, "bad": float("nan")}, step=1)
    t.log_metrics({"reward/mean": 0.5}, step=2)
    art = tmp_path / "report.txt"
    art.write_text("hello")
    t.log_artifact(str(art))
    t.finish()

    c = MlflowClient(tracking_uri=default_tracking_uri(str(root)))
    run = c.get_run(t.run_id)
    p = run.data.params
    assert p["algorithm.gamma"] == "0.99"
    assert p["judge.api_key"] == "***" and p["judge.api_key_env"] == "DASHSCOPE_API_KEY"
    assert "sk-very-secret-123" not in p["judge.base_url"]
    hist = c.get_metric_history(t.run_id, "reward/mean")
    assert [(m.step, m.value) for m in hist] == [(1, 0.25), (2, 0.5)]
    assert "bad" not in run.data.metrics  # NaN is dropped, not logged
    assert [a.path for a in c.list_artifacts(t.run_id)] == ["report.txt"]
    assert run.info.status == "FINISHED"
    out = capsys.readouterr().out
    assert "step 1/4" in out and "pg_loss -0.1" in out and "eta" in out  # the console line (trainer.console)


def test_redact_masks_env_secret_values_anywhere(monkeypatch):
    monkeypatch.setenv("MY_TOKEN", "abcdef123")
    assert redact({"x.url": "http://a/abcdef123/b", "x.n": 3}) == {"x.url": "http://a/***/b", "x.n": "3"}


def test_resume_logs_each_step_once_and_survives_a_missing_run(tmp_path, monkeypatch, capsys):
    """A resumed run continues its MLflow run without logging again the steps it already holds (trained a
    second time after a crash); resumed with another store, where that run is missing, it logs to a new run
    linked to the old one instead of failing."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "mlruns"
    t = Tracker("proj", "exp", ["mlflow"], total_steps=4, mlruns_root=str(root))
    for s in (1, 2, 3):  # step 3 logged, then the driver dies before checkpointing it
        t.log_metrics({"timing_s/step": 1.0, "reward/mean": s / 10}, step=s)
    again = Tracker("proj", "exp", ["mlflow"], total_steps=4, mlruns_root=str(root), run_id=t.run_id)
    assert again.run_id == t.run_id
    for s in (3, 4):  # resumed from the step-2 checkpoint: step 3 again, then 4
        again.log_metrics({"timing_s/step": 1.0, "reward/mean": s / 10}, step=s)
    c = MlflowClient(tracking_uri=default_tracking_uri(str(root)))
    assert [m.step for m in c.get_metric_history(t.run_id, "reward/mean")] == [1, 2, 3, 4]
    other = Tracker("proj", "exp", ["mlflow"], total_steps=4, mlruns_root=str(tmp_path / "elsewhere"), run_id=t.run_id)
    assert other.run_id != t.run_id
    other.log_metrics({"timing_s/step": 1.0}, step=3)
    c2 = MlflowClient(tracking_uri=default_tracking_uri(str(tmp_path / "elsewhere")))
    assert c2.get_run(other.run_id).data.tags["coxswain.resumed_from_run_id"] == t.run_id
    assert "is not in" in capsys.readouterr().out


def test_artifacts_follow_the_tracking_uri_not_the_working_directory(tmp_path, monkeypatch):
    """MLFLOW_TRACKING_URI names a SQLite store in one folder and the run starts from another: the
    artifacts land next to the store's database, nothing under the working directory; with
    MLFLOW_ARTIFACT_URI they land there; an experiment that exists keeps its own location."""
    store, cwd = tmp_path / "store", tmp_path / "checkout"
    store.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("MLFLOW_ARTIFACT_URI", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}/mlflow.db")
    art = tmp_path / "report.txt"
    art.write_text("hello")
    t = Tracker("proj", "exp", ["mlflow"])
    t.log_artifact(str(art), "report")
    t.finish()
    assert (store / "artifacts").is_dir()
    assert [p.name for p in (store / "artifacts").rglob("report.txt")] == ["report.txt"]
    assert list(cwd.iterdir()) == []  # no ./mlruns in the directory the run started from
    c = MlflowClient(tracking_uri=f"sqlite:///{store}/mlflow.db")
    assert c.get_experiment_by_name("proj").artifact_location == f"file://{store}/artifacts"
    # a second experiment with MLFLOW_ARTIFACT_URI: its artifacts go there
    monkeypatch.setenv("MLFLOW_ARTIFACT_URI", f"file://{tmp_path}/bucket")
    t2 = Tracker("proj2", "exp", ["mlflow"])
    t2.log_artifact(str(art))
    t2.finish()
    assert [p.parent.parent.parent.name for p in (tmp_path / "bucket").rglob("report.txt")] == ["bucket"]
    # the existing experiment "proj" keeps the location it was created with
    t3 = Tracker("proj", "exp", ["mlflow"])
    t3.log_artifact(str(art))
    t3.finish()
    assert len(list((store / "artifacts").rglob("report.txt"))) == 2
    assert list(cwd.iterdir()) == []


def test_a_database_store_without_artifact_location_is_refused(monkeypatch):
    monkeypatch.delenv("MLFLOW_ARTIFACT_URI", raising=False)
    with pytest.raises(ConfigError) as e:
        artifact_location("postgresql://user:pw@db:5432/mlflow")
    assert str(e.value) == (
        "MLFLOW_TRACKING_URI=postgresql://user:***@db:5432/mlflow is a database store, which has no artifact location "
        "of its own (MLflow would write the artifacts under ./mlruns of the working directory): set "
        "MLFLOW_ARTIFACT_URI to where they should go (a path, s3://..., ...).")
    monkeypatch.setenv("MLFLOW_ARTIFACT_URI", "s3://bucket/x")
    assert artifact_location("postgresql://db/mlflow") == "s3://bucket/x"
    assert artifact_location("http://mlflow-server:5000") == "s3://bucket/x"
    monkeypatch.delenv("MLFLOW_ARTIFACT_URI")
    assert artifact_location("http://mlflow-server:5000") is None  # the server's own artifact root
