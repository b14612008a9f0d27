"""Experiment tracking as verl's ``trainer.logger``: console, mlflow, wandb, tensorboard.

Every tracker gets the same metric names (verl's), steps and values from one ``log_metrics`` call.

MLflow. Default store: a local SQLite MLflow store at ``./mlruns/mlflow.db`` with artifacts under
``./mlruns/artifacts`` — nothing to start; open it with
``mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db``. (MLflow 3.x refuses the plain ``file:``
store unless ``MLFLOW_ALLOW_FILE_STORE=true``; SQLite works out of the box.) ``MLFLOW_TRACKING_URI``
selects another store or a server; the artifacts follow it (:func:`artifact_location`: next to a
SQLite file, the server's artifact root, or ``MLFLOW_ARTIFACT_URI`` when set), never the working
directory. Metric keys follow verl's MLflow rule ("@" -> "_at_"). A run is tagged with its
source (``mlflow.source.name``, ``mlflow.source.type``) and git commit (``mlflow.source.git.commit``,
``coxswain.git.dirty``); artifacts go in folders (``config/``, ``report/``, ``hf_export/``,
``val_generations/``). Each step's metrics go out in ONE ``log_batch`` call: a single ``log_metric``
costs about 4 ms on the SQLite store, and a step logs a hundred metrics.

wandb. Offline unless ``WANDB_API_KEY`` is set or ``WANDB_MODE`` says otherwise: the run is written
under ``<dir>/wandb/offline-run-*`` (``wandb sync`` uploads it later), with no network access and no
login prompt. ``<dir>`` is ``WANDB_DIR`` or the run directory.

tensorboard. Event files under ``TENSORBOARD_DIR`` (verl's variable) or ``<run dir>/tensorboard``:
``tensorboard --logdir <that dir>``.

``trainer.log_val_generations=N``: N validation samples (verl's choice: sorted by input, shuffled with
seed 42, the first N) with their step, as a wandb Table (``val/generations``), an MLflow JSON artifact
(``val_generations/val_step{N}.json``) and tensorboard text (``val/generations``).

Secrets never reach a tracker's config: config values whose key looks like a secret (``*key*``,
``*token*``, ``*secret*``, ``*password*``) are masked, and any string equal to the value of an
environment variable whose NAME looks like a secret is masked too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from typing import Any, Mapping

import numpy as np

from trainer.config.schema import ConfigError
from trainer.config.secrets import SECRET_KEY, mask_url_credentials, secret_values
from trainer.console import ConsoleLog

def flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def redact(params: Mapping[str, Any]) -> dict[str, str]:
    """Flattened params with secrets masked (by key name, and by value equal to a secret env var)."""
    secrets = secret_values()
    out = {}
    for k, v in params.items():
        sv = str(v)
        if SECRET_KEY.search(k.rsplit(".", 1)[-1]):
            sv = "***"
        for s in secrets:
            sv = sv.replace(s, "***")
        out[k] = mask_url_credentials(sv)[:500]  # MLflow's param value limit
    return out


def default_tracking_uri(root: str = "mlruns") -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath(root)}/mlflow.db"


_DB_SCHEMES = ("postgresql", "mysql", "mssql", "oracle")  # SQLAlchemy stores other than SQLite


def artifact_location(uri: str) -> str | None:
    """Where a new experiment's artifacts go: ``MLFLOW_ARTIFACT_URI`` (Coxswain's variable: MLflow's
    client has none) when set; for a SQLite store, ``artifacts/`` next to the database file (so the
    default store keeps ``./mlruns/artifacts`` and a store elsewhere keeps its artifacts with it);
    otherwise None, the store's own choice (a tracking server's artifact root, a file store's folder).
    A database store other than SQLite has no place of its own: MLflow would use ``./mlruns`` of
    whatever directory the run starts from, so it is refused without ``MLFLOW_ARTIFACT_URI``."""
    if os.environ.get("MLFLOW_ARTIFACT_URI"):
        return os.environ["MLFLOW_ARTIFACT_URI"]
    if uri.startswith("sqlite:///"):
        db = os.path.abspath(uri[len("sqlite:///"):])
        return "file://" + os.path.join(os.path.dirname(db), "artifacts")
    if uri.split(":", 1)[0].split("+", 1)[0] in _DB_SCHEMES:
        raise ConfigError(f"MLFLOW_TRACKING_URI={mask_url_credentials(uri)} is a database store, which has no artifact "
                         f"location of its own (MLflow would write the artifacts under ./mlruns of the working "
                         f"directory): set MLFLOW_ARTIFACT_URI to where they should go (a path, s3://..., ...).")
    return None


def git_info(path: str | None = None) -> dict[str, str]:
    """The commit (and whether the tree has uncommitted changes) of the repository holding ``path``."""
    path = path or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        if not commit:
            return {}
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=path,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return {"commit": commit, "dirty": str(bool(dirty)).lower()}
    except (OSError, subprocess.SubprocessError):
        return {}


def pick_val_generations(samples, n: int) -> list[tuple[str, str, float]]:
    """verl's choice of the ``n`` logged samples: sorted by input, shuffled with seed 42, the first n."""
    samples = sorted(samples, key=lambda x: x[0])
    order = np.random.RandomState(42).permutation(len(samples))
    return [samples[i] for i in order[:n]]


class Tracker:
    """``loggers``: a subset of {"console", "mlflow", "wandb", "tensorboard"}. ``log_dir``: the run
    directory (wandb offline files, tensorboard event files)."""

    def __init__(self, project: str, experiment: str, loggers, config: Mapping | None = None,
                 total_steps: int | None = None, mlruns_root: str = "mlruns", run_id: str | None = None,
                 log_dir: str = "."):
        self.loggers = set(loggers)
        self.total_steps = total_steps
        self.t0 = time.time()
        self.client = None
        self.run_id = None
        self.logged_through: int | None = None  # MLflow already holds every step up to this one
        self.resumed = False  # logging into an MLflow run that already exists (its params are written once)
        self.wandb = self.tb = None
        self._val_rows: list = []
        flat = redact(flatten(config)) if config is not None else {}
        if "wandb" in self.loggers:
            self.wandb = _start_wandb(project, experiment, flat, log_dir)
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter  # optional: the trackers extra (tensorboard)

            self.tb_dir = os.environ.get("TENSORBOARD_DIR") or os.path.join(log_dir, "tensorboard")
            os.makedirs(self.tb_dir, exist_ok=True)
            self.tb = SummaryWriter(log_dir=self.tb_dir)
        if "mlflow" in self.loggers:
            logging.getLogger("mlflow").setLevel(logging.WARNING)
            logging.getLogger("alembic").setLevel(logging.WARNING)
            from mlflow.tracking import MlflowClient  # heavy (seconds to import): only with trainer.logger mlflow

            uri = default_tracking_uri(mlruns_root)
            if uri.startswith("sqlite:///"):
                os.makedirs(os.path.dirname(uri[len("sqlite:///"):]), exist_ok=True)
            self.client = MlflowClient(tracking_uri=uri)
            exp = self.client.get_experiment_by_name(project)
            if exp is None:  # an existing experiment keeps its own artifact location
                exp_id = self.client.create_experiment(project, artifact_location=artifact_location(uri))
            else:
                exp_id = exp.experiment_id
            if run_id is not None and self._run_exists(run_id):  # resume into the same MLflow run
                self.run_id, self.resumed = run_id, True
                # the steps it already has (logged before a crash, then trained again after the resume, with the
                # same values under exact resume) are not logged a second time
                self.logged_through = self._last_logged_step(run_id)
            else:
                tags = {"mlflow.source.name": os.path.basename(sys.argv[0]) or "python", "mlflow.source.type": "LOCAL"}
                if run_id is not None:  # resumed with another (or a fresh) MLflow store: a new run, linked to the old
                    tags["coxswain.resumed_from_run_id"] = run_id
                    print(f"note: MLflow run {run_id} (from the checkpoint) is not in {uri}; logging to a new run "
                          f"tagged coxswain.resumed_from_run_id={run_id}", flush=True)
                git = git_info()
                if git:
                    tags.update({"mlflow.source.git.commit": git["commit"], "coxswain.git.dirty": git["dirty"]})
                self.run_id = self.client.create_run(exp_id, run_name=experiment, tags=tags).info.run_id
                if config is not None:
                    self.log_params(flatten(config))

    def _run_exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException  # heavy: mlflow is imported only when it logs

        try:
            self.client.get_run(run_id)
            return True
        except MlflowException:
            return False

    def _last_logged_step(self, run_id: str) -> int | None:
        """The last step of the run's step-time metric (logged once per step, with the step's other metrics)."""
        hist = self.client.get_metric_history(run_id, "timing_s/step")
        return max((m.step for m in hist), default=None)

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.client is None:
            return
        from mlflow.entities import Param  # heavy: mlflow is imported only when it logs

        have = self.client.get_run(self.run_id).data.params if self.resumed else {}
        # MLflow refuses to change a param: a resumed run keeps the values its first start logged
        items = [Param(k, v) for k, v in redact(params).items() if k not in have]
        for i in range(0, len(items), 100):  # MLflow's batch limit for params
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        if self.client is not None and (self.logged_through is None or step > self.logged_through):
            from mlflow.entities import Metric  # heavy: mlflow is imported only when it logs

            ts = int(time.time() * 1000)
            # verl's MLflow key rule: "@" (mean@N) becomes "_at_", other invalid characters "_"
            items = [Metric(re.sub(r"[^\w\-./ ]", "_", k.replace("@", "_at_")), v, ts, step) for k, v in clean.items()]
            for i in range(0, len(items), 1000):
                self.client.log_batch(self.run_id, metrics=items[i:i + 1000])
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if self.tb is not None:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if "console" in self.loggers:
            self._console(clean, step)

    def log_val_generations(self, samples, step: int, n: int) -> list:
        """Log ``n`` of the validation ``samples`` ((input, output, score)) of ``step``; returns them."""
        picked = pick_val_generations(samples, n)
        if not picked:
            return picked
        if self.wandb is not None:  # one table, a row per validation (verl's columns)
            import wandb  # optional: the trackers extra

            cols = ["step"] + [f"{c}_{i + 1}" for i in range(len(picked)) for c in ("input", "output", "score")]
            self._val_rows.append([step] + [v for smp in picked for v in smp])
            width = len(cols)
            self.wandb.log({"val/generations": wandb.Table(columns=cols, data=[r[:width] + [None] * (width - len(r))
                                                                               for r in self._val_rows])}, step=step)
        if self.client is not None:
            rows = [{"input": i, "output": o, "score": sc} for i, o, sc in picked]
            self.client.log_text(self.run_id, json.dumps(rows, indent=1), f"val_generations/val_step{step}.json")
        if self.tb is not None:
            text = f"**Generation Results - Step {step}**\n\n" + "\n\n".join(
                f"**Sample {i + 1}**\n\n*Input:* {inp}\n\n*Output:* {out}\n\n*Score:* {sc}\n\n---"
                for i, (inp, out, sc) in enumerate(picked))
            self.tb.add_text("val/generations", text, step)
            self.tb.flush()
        return picked

    def _console(self, m: Mapping[str, float], step: int) -> None:
        # the step line and progress bar (trainer.console); created at the first line
        if getattr(self, "_console_log", None) is None:
            self._console_log = ConsoleLog(self.total_steps, t0=self.t0)
        self._console_log.log(m, step)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        if self.client is not None and os.path.exists(path):
            if os.path.isdir(path):
                self.client.log_artifacts(self.run_id, path, artifact_path)
            else:
                self.client.log_artifact(self.run_id, path, artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        if getattr(self, "_console_log", None) is not None:
            self._console_log.close()
        if self.client is not None:
            self.client.set_terminated(self.run_id, status)
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish(exit_code=0 if status == "FINISHED" else 1)
            self.wandb = None


def _start_wandb(project: str, experiment: str, config: Mapping[str, str], log_dir: str):
    """A wandb run; offline (no network, no prompt) unless WANDB_API_KEY or WANDB_MODE says otherwise."""
    try:
        import wandb  # optional: the trackers extra
    except ImportError as e:
        raise ImportError("trainer.logger has 'wandb' but wandb is not installed: pip install 'coxswain[trackers]', "
                          "or drop 'wandb' from trainer.logger") from e
    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    wdir = os.environ.get("WANDB_DIR") or log_dir
    os.makedirs(wdir, exist_ok=True)
    settings = wandb.Settings(init_timeout=120, console="off", silent=True, x_disable_stats=True)
    return wandb.init(project=project, name=experiment, config=dict(config), dir=wdir, mode=mode,
                      settings=settings, reinit="create_new")
