"""Experiment tracking: MLflow (params, per-step metrics, artifacts) and a console progress line.

Default store: a local SQLite MLflow store at ``./mlruns/mlflow.db`` with artifacts under
``./mlruns/artifacts`` — nothing to start. (MLflow 3.x refuses the plain ``file:`` store unless
``MLFLOW_ALLOW_FILE_STORE=true``; SQLite works out of the box.) ``MLFLOW_TRACKING_URI`` selects a server.

Each step's metrics go out in ONE ``log_batch`` call: a single ``log_metric`` costs about 4 ms on the
SQLite store, and a step logs a hundred metrics. Secrets never reach MLflow: config values whose key
looks like a secret (``*key*``, ``*token*``, ``*secret*``, ``*password*``) are masked, and any string
equal to the value of an environment variable whose NAME looks like a secret is masked too.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from typing import Any, Mapping

# A config leaf holding a secret itself (``api_key_env`` only names a variable, so it stays visible).
_SECRET_KEY = re.compile(r"(api_?key|secret|password|passwd|credential|auth_token|access_token|hf_token)$", re.I)
# Environment variables whose values are secrets wherever they appear.
_SECRET_ENV = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL)", re.I)


def _secret_values() -> set[str]:
    return {v for k, v in os.environ.items() if _SECRET_ENV.search(k) and len(v) >= 6}


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
    secrets = _secret_values()
    out = {}
    for k, v in params.items():
        sv = str(v)
        if _SECRET_KEY.search(k.rsplit(".", 1)[-1]):
            sv = "***"
        for s in secrets:
            sv = sv.replace(s, "***")
        out[k] = sv[:500]  # MLflow's param value limit
    return out


def default_tracking_uri(root: str = "mlruns") -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath(root)}/mlflow.db"


class Tracker:
    """MLflow run + console line. ``loggers`` is a subset of {"console", "mlflow"}."""

    def __init__(self, project: str, experiment: str, loggers, config: Mapping | None = None,
                 total_steps: int | None = None, mlruns_root: str = "mlruns", run_id: str | None = None):
        self.loggers = set(loggers)
        self.total_steps = total_steps
        self.t0 = time.time()
        self.client = None
        self.run_id = None
        if "mlflow" in self.loggers:
            import logging

            logging.getLogger("mlflow").setLevel(logging.WARNING)
            logging.getLogger("alembic").setLevel(logging.WARNING)
            from mlflow.tracking import MlflowClient

            uri = default_tracking_uri(mlruns_root)
            if uri.startswith("sqlite:///"):
                os.makedirs(os.path.dirname(uri[len("sqlite:///"):]), exist_ok=True)
            self.client = MlflowClient(tracking_uri=uri)
            exp = self.client.get_experiment_by_name(project)
            if exp is None:
                art = None
                if uri.startswith("sqlite:///"):
                    art = "file://" + os.path.abspath(os.path.join(mlruns_root, "artifacts"))
                exp_id = self.client.create_experiment(project, artifact_location=art)
            else:
                exp_id = exp.experiment_id
            if run_id is not None:  # resume into the same MLflow run
                self.run_id = run_id
            else:
                self.run_id = self.client.create_run(exp_id, run_name=experiment).info.run_id
                if config is not None:
                    self.log_params(flatten(config))

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.client is None:
            return
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in redact(params).items()]
        for i in range(0, len(items), 100):  # MLflow's batch limit for params
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        if self.client is not None:
            from mlflow.entities import Metric

            ts = int(time.time() * 1000)
            # verl's MLflow key rule: "@" (mean@N) becomes "_at_", other invalid characters "_"
            items = [Metric(re.sub(r"[^\w\-./ ]", "_", k.replace("@", "_at_")), v, ts, step) for k, v in clean.items()]
            for i in range(0, len(items), 1000):
                self.client.log_batch(self.run_id, metrics=items[i:i + 1000])
        if "console" in self.loggers:
            self._console(clean, step)

    def _console(self, m: Mapping[str, float], step: int) -> None:
        # the step line and progress bar (trainer.console); created at the first line
        if getattr(self, "_console_log", None) is None:
            from trainer.console import ConsoleLog

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
