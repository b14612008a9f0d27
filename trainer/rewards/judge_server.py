"""Local judges in a subprocess on 127.0.0.1: an LLM judge, ``python -m trainer.serve``
(:mod:`trainer.serving.openai`) on an HF checkpoint, for ADCA's ``evaluation_type=local``; and the rule judge
of an environment, ``python -m trainer.rewards.rule_judge``, for ``evaluation_type=rule``.

:class:`JudgeServer` starts either on a free port (``--port 0``), waits for its ready line
(:data:`trainer.net.OPENAI_READY_PREFIX`) and exposes ``base_url`` (``http://127.0.0.1:PORT/v1``)
for :class:`trainer.rewards.judge.JudgeClient`. The server runs without a key (``COXSWAIN_API_KEY`` is
removed from its environment) and bound to loopback only. :func:`trainer.credit.make_judge` starts one
before the first step; ``close()`` (or the ``with`` block) terminates it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from trainer.orphans import supervised
from trainer.net import OPENAI_READY_PREFIX, ready_url

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class JudgeServer:
    """A judge server command in a subprocess on 127.0.0.1 that prints the OpenAI server's ready line
    (``python -m trainer.serve`` or ``python -m trainer.rewards.rule_judge``); ``base_url`` once it listens.

    Started before the first step; ``close()`` (or the ``with`` block) terminates it. Its output goes
    to ``log_path`` so a failed start can be explained."""

    def __init__(self, cmd: list[str], *, what: str, log_path: str, start_timeout: float = 180.0):
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        self.log_path = log_path
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("COXSWAIN_API_KEY", None)  # a local judge: no key, bound to 127.0.0.1 only
        self._log = open(log_path, "w")
        # supervised: a SIGKILLed driver takes the judge with it (trainer.orphans)
        self.proc = subprocess.Popen(supervised(cmd), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.base_url = None
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self._log.write(line)
            self.base_url = ready_url(line, OPENAI_READY_PREFIX)
            if self.base_url is not None:
                break
        self._log.flush()
        if self.base_url is None:
            self.close()
            raise RuntimeError(f"the {what} did not start within {start_timeout:.0f}s; its output is in {log_path}")
        # Keep draining its output into the log so the pipe never fills.
        threading.Thread(target=self._drain, daemon=True, name="coxswain-judge-log").start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            try:
                self._log.write(line)
                self._log.flush()
            except ValueError:  # closed
                return

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            self._log.close()
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LocalJudgeServer(JudgeServer):
    """``python -m trainer.serve`` on an HF checkpoint (``evaluation_type=local``), served as ``local-judge``."""

    def __init__(self, model_dir: str, *, log_path: str, max_seq_len: int = 4096, threads: int = 1,
                 start_timeout: float = 180.0):
        cmd = [sys.executable, "-m", "trainer.serve", "--model", model_dir, "--port", "0", "--host", "127.0.0.1",
               "--threads", str(threads), "--max-seq-len", str(max_seq_len), "--served-model-name", "local-judge"]
        super().__init__(cmd, what=f"local judge server (trainer.serve --model {model_dir})", log_path=log_path,
                         start_timeout=start_timeout)


class RuleJudgeServer(JudgeServer):
    """``python -m trainer.rewards.rule_judge`` for an environment (``evaluation_type=rule``), served as
    ``rule-judge``."""

    def __init__(self, environment: str, *, log_path: str, start_timeout: float = 60.0):
        cmd = [sys.executable, "-m", "trainer.rewards.rule_judge", "--environment", environment, "--port", "0",
               "--host", "127.0.0.1"]
        super().__init__(cmd, what=f"rule judge server (trainer.rewards.rule_judge --environment {environment})",
                         log_path=log_path, start_timeout=start_timeout)
