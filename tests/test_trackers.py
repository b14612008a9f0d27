"""The four trackers of ``trainer.logger`` written for real and read back with their own readers: an
MLflow SQLite store (MlflowClient), tensorboard event files (tensorboard's EventAccumulator) and a wandb
offline run (its ``.wandb`` record log, parsed with wandb's own protobuf). Same names, steps, values."""

import glob
import json
import os
import struct
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def read_wandb_history(run_dir) -> dict[int, dict]:
    """``{step: {key: value}}`` from a wandb offline run's ``run-*.wandb`` file (a LevelDB-style log:
    7-byte header, 32 KiB blocks of [crc32 u32, length u16, type u8] chunks holding ``Record`` protos)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, buf, out = 7, 32768, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0:
            continue
        buf += chunk
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                row = out.setdefault(rec.history.step.num, {})
                for it in rec.history.item:
                    row[it.key or "/".join(it.nested_key)] = json.loads(it.value_json)
    return out


def read_tensorboard(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


@pytest.fixture
def offline(monkeypatch, tmp_path):
    for k in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "TENSORBOARD_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # no network: any contact attempt would fail
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")


def test_tracker_writes_every_backend_and_val_generations(tmp_path, offline):
    from mlflow.tracking import MlflowClient

    from trainer.tracking import Tracker, pick_val_generations

    t = Tracker("proj", "exp", ["mlflow", "wandb", "tensorboard"], config={"trainer": {"api_key": "s3cr3t!", "n": 3}},
                log_dir=str(tmp_path))
    t.log_metrics({"val-core/gsm8k/acc/mean@1": 0.25, "actor/pg_loss": -0.5}, 0)
    t.log_metrics({"actor/pg_loss": 0.125, "nan/skip": float("nan")}, 1)
    samples = [(f"q{i}", f"a{i}", float(i % 2)) for i in range(5)]
    picked = t.log_val_generations(samples, 1, 2)
    run_id = t.run_id
    t.finish()
    # verl's pick: sorted by input, RandomState(42) permutation, first N
    import numpy as np

    assert picked == [samples[i] for i in np.random.RandomState(42).permutation(5)[:2]] == pick_val_generations(samples, 2)

    # wandb's offline writer is its own process: under load its last records can reach the file just after
    # finish() returns (seen once in a CI run); wait for them, then check every value
    deadline = time.monotonic() + 20
    while not {0, 1} <= set(w := read_wandb_history(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert w[0]["val-core/gsm8k/acc/mean@1"] == 0.25 and w[0]["actor/pg_loss"] == -0.5
    assert w[1]["actor/pg_loss"] == 0.125 and "nan/skip" not in w[1]
    assert w[1]["val/generations/_type"] == "table-file" and w[1]["val/generations/nrows"] == 1
    table = json.load(open(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "files" / w[1]["val/generations/path"]))[0]))
    assert table["columns"] == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
    assert table["data"] == [[1, *picked[0], *picked[1]]]

    ea = read_tensorboard(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in ea.Scalars("actor/pg_loss")] == [(0, -0.5), (1, 0.125)]
    text = ea.Tensors("val/generations/text_summary")[0]
    assert text.step == 1 and picked[0][0] in text.tensor_proto.string_val[0].decode()

    c = MlflowClient()
    r = c.get_run(run_id)
    assert r.data.params["trainer.api_key"] == "***" and r.data.params["trainer.n"] == "3"
    assert len(r.data.tags["mlflow.source.git.commit"]) == 40 and r.data.tags["mlflow.source.type"] == "LOCAL"
    assert [(m.step, m.value) for m in c.get_metric_history(run_id, "val-core/gsm8k/acc/mean_at_1")] == [(0, 0.25)]
    path = c.download_artifacts(run_id, "val_generations/val_step1.json", str(tmp_path / "dl"))
    assert json.load(open(path)) == [{"input": i, "output": o, "score": s} for i, o, s in picked]


@pytest.mark.slow
def test_two_step_run_writes_all_four_trackers_alike(tmp_path, offline, capsys):
    """The real loop with trainer.logger=['console','mlflow','tensorboard','wandb']: every tracker holds
    the same metric names, steps and values (tensorboard stores float32)."""
    from mlflow.tracking import MlflowClient

    from tests.support.tiny import tiny_config
    from trainer.main import train

    run_dir = tmp_path / "run"
    cfg = tiny_config(["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "data.max_response_length=6",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.total_training_steps=2",
                       "trainer.test_freq=2", "trainer.logger=[console,mlflow,tensorboard,wandb]",
                       "trainer.log_val_generations=3", f"trainer.default_local_dir={run_dir}"])
    try:
        hist = train(cfg)["history"]
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    assert [h["step"] for h in hist] == [0, 1, 2]
    console = capsys.readouterr().out
    assert "step 1/2" in console and "step 2/2" in console

    wandb_rows = read_wandb_history(run_dir)
    ea = read_tensorboard(run_dir / "tensorboard")
    c = MlflowClient()
    (run,) = c.search_runs([c.get_experiment_by_name(cfg.trainer.project_name).experiment_id])
    assert run.data.tags["mlflow.source.git.commit"]
    checked = 0
    for h in hist:
        step = h["step"]
        for k, v in h.items():
            if k == "step":
                continue
            assert wandb_rows[step][k] == pytest.approx(v, rel=1e-12, abs=1e-12), (k, step)
            tb = {e.step: e.value for e in ea.Scalars(k)}
            assert tb[step] == pytest.approx(v, rel=1e-6, abs=1e-6), (k, step)
            ml = {m.step: m.value for m in c.get_metric_history(run.info.run_id, k.replace("@", "_at_"))}
            assert ml[step] == pytest.approx(v, rel=1e-12, abs=1e-12), (k, step)
            checked += 1
    assert checked > 100 and set(ea.Tags()["scalars"]) == {k for h in hist for k in h if k != "step"}
    # validation samples at steps 0 and 2, in each tracker
    val_files = {os.path.basename(f.path) for f in c.list_artifacts(run.info.run_id, "val_generations")}
    assert val_files == {"val_step0.json", "val_step2.json"}
    assert [t.step for t in ea.Tensors("val/generations/text_summary")] == [0, 2]
    assert wandb_rows[2]["val/generations/nrows"] == 2 and wandb_rows[2]["val/generations/ncols"] == 1 + 3 * 3
    # artifacts in folders
    assert {a.path for a in c.list_artifacts(run.info.run_id)} >= {"config", "report", "hf_export", "val_generations"}
