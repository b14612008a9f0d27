"""The console a user reads during a run: one line per step above a tqdm progress bar.

The line (``trainer.logger`` contains ``console``)::

    step 7/40 | score 0.625 | acc 0.62 | val 0.94 | pg_loss -0.0123 | entropy 1.32 | mm_kl 3.1e-06 | len 5.1 | 2.9 s/step | eta 1m36s

``score`` is ``critic/score/mean``, ``acc`` the training batch's ``reward/acc``, ``val`` the held-out
accuracy (``val-core/*/acc/mean@N``, on steps that validate), ``mm_kl`` the absolute value of
``mismatch/mismatch_kl``: the k1 estimate of KL(rollout || trainer) between the sampler's and the
trainer's log-probs of the same tokens. The estimate can come out slightly negative when the two
agree to float precision; its size is what matters (``|mm_kl|`` above ~1e-3 means the engines and
the trainer disagree). A legend line names every column once, at the first step.

ETA: from steady-state steps only. The first step this process logs (and step 0's validation)
includes compilation and engine warm-up, so the time per step is the mean wall time between
consecutive step lines after the first step; until two steps have passed the ETA is the first
step's time, marked ``~``. Validation and checkpoint steps are in that mean in their proportion.

The bar is drawn on a terminal only; with output to a file or pipe there are only the lines.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import math
import os
import shutil
import sys
import time
import tokenize
from typing import Mapping

import numpy as np
from tqdm import tqdm

from trainer.config import schema

LEGEND = ("columns: score = critic/score/mean, acc = reward/acc (training batch), val = held-out accuracy "
          "(val-core/*/acc), pg_loss = actor/pg_loss, entropy = actor/entropy, mm_kl = |mismatch/mismatch_kl| "
          "(k1 KL of rollout vs trainer log-probs, ~0 when they agree), len = response_length/mean, "
          "eta = remaining steps x mean steady-state step time")


def fmt_duration(s: float) -> str:
    s = max(0, int(round(s)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def _g(x: float) -> str:
    return f"{x:.4g}"


def val_core_acc(metrics: dict) -> float | None:
    """The held-out accuracy of a step's metrics: the mean of its ``val-core/*/acc/mean@*`` values
    (one per data source), None when the step did not validate."""
    vals = [v for k, v in metrics.items() if k.startswith("val-core/") and "/acc/mean@" in k]
    return float(np.mean(vals)) if vals else None


class ConsoleLog:
    """Per-step line + progress bar. ``clock`` is injectable for tests."""

    def __init__(self, total_steps: int | None, *, stream=None, clock=time.time, t0: float | None = None,
                 bar: bool | None = None):
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.clock = clock
        self.t0 = clock() if t0 is None else t0
        self.first_step: int | None = None  # the first training step this process logged
        self.first_dur = 0.0  # its wall time (since the previous line, e.g. step 0's validation)
        self.last: tuple[int, float] | None = None  # (step, time) of the previous training step line
        self.prev_time = self.t0  # time of the previous line of any step
        self.steady: list[float] = []  # seconds per step after the first step
        self.legend_shown = False
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self.use_bar = isatty if bar is None else bar
        self.pbar = None

    # -------------------------------------------------------------- ETA
    def eta(self, step: int) -> tuple[float | None, bool]:
        """(seconds left, steady?) after ``step``; None without a total or a timed step."""
        if not self.total or self.first_step is None:
            return None, False
        left = max(self.total - step, 0)
        if self.steady:
            return sum(self.steady) / len(self.steady) * left, True
        return self.first_dur * left, False

    def _observe(self, step: int, now: float) -> None:
        if self.first_step is None:  # compile / warm-up: timed, but kept out of the steady mean
            self.first_step, self.first_dur = step, now - self.prev_time
        elif step > self.last[0]:
            self.steady.append((now - self.last[1]) / (step - self.last[0]))
        self.last = (step, now)

    # -------------------------------------------------------------- line
    def line(self, m: Mapping[str, float], step: int) -> str:
        parts = [f"step {step}" + (f"/{self.total}" if self.total else "")]
        val = val_core_acc(m)
        for label, v in (("score", m.get("critic/score/mean")), ("acc", m.get("reward/acc")), ("val", val),
                         ("pg_loss", m.get("actor/pg_loss")), ("entropy", m.get("actor/entropy")),
                         ("mm_kl", abs(m["mismatch/mismatch_kl"]) if "mismatch/mismatch_kl" in m else None),
                         ("len", m.get("response_length/mean"))):
            if v is not None and math.isfinite(v):
                parts.append(f"{label} {_g(v)}")
        if "timing_s/step" in m:
            parts.append(f"{m['timing_s/step']:.3g} s/step")
        eta, steady = self.eta(step) if step > 0 else (None, False)
        if eta is not None:
            parts.append(f"eta {'' if steady else '~'}{fmt_duration(eta)}")
        parts.append(f"elapsed {fmt_duration(self.clock() - self.t0)}")
        return " | ".join(parts)

    def log(self, m: Mapping[str, float], step: int) -> str:
        now = self.clock()
        if step > 0:
            self._observe(step, now)
        text = self.line(m, step)
        if not self.legend_shown:
            self._write(LEGEND)
            self.legend_shown = True
        self._write(text)
        self._bar(step)
        self.prev_time = now
        return text

    # -------------------------------------------------------------- output
    def _write(self, text: str) -> None:
        if self.pbar is not None:
            self.pbar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def _bar(self, step: int) -> None:
        if not self.use_bar or not self.total:
            return
        if self.pbar is None:
            # tqdm's own rate and ETA would count the compile step; ours is in the postfix
            # a pty whose window size was never set reports 0 x 0: tqdm then hides every bar "below" a 0-row
            # screen, so the bar never shows; such a terminal gets the usual 100 x 24
            size = shutil.get_terminal_size((100, 24))
            cols, rows = size.columns or 100, size.lines or 24
            self.pbar = tqdm(total=self.total, initial=0, file=self.stream, ncols=min(cols, 120), nrows=rows, leave=True,
                             bar_format="{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
                             desc="training ")
        self.pbar.n = min(step, self.total)
        eta, steady = self.eta(step)
        self.pbar.set_postfix_str(f"eta {'' if steady else '~'}{fmt_duration(eta)}" if eta is not None else "",
                                  refresh=False)
        self.pbar.refresh()

    def close(self) -> None:
        if self.pbar is not None:
            self.pbar.close()
            self.pbar = None


# ---------------------------------------------------------------------------------------------- --help-keys
def field_comments(source_path: str | None = None) -> dict[tuple[str, str], str]:
    """``{(dataclass name, field name): inline comment}`` of a module's dataclass fields (the ``# ...``
    on the field's line, or the last one of a multi-line field), read with ast + tokenize."""
    if source_path is None:
        source_path = schema.__file__
    src = open(source_path, encoding="utf-8").read()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef):
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    lines = [comments[i] for i in range(st.lineno, st.end_lineno + 1) if i in comments]
                    if lines:
                        out[(node.name, st.target.id)] = lines[-1]
    return out


def shown_value(v) -> str:
    """A config value as it is written on a command line: ``null``, ``true``, ``[console,mlflow]``."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(shown_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{k}: {shown_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def changed_from_defaults(raw: Mapping, defaults: Mapping, shown: Mapping) -> dict:
    """``{key: shown value}`` of the flat config ``raw`` (values as set, interpolations unresolved) whose value
    differs from the flat ``defaults``, in the config's order; ``shown`` holds the values to print (resolved, with
    secrets masked)."""
    return {k: shown.get(k, v) for k, v in raw.items() if k not in defaults or defaults[k] != v}


def config_summary_lines(changed: Mapping, path: str) -> list[str]:
    """What the console opens with instead of the whole resolved config: the keys that differ from the defaults
    (one ``key=value`` line each) and the file that holds every key."""
    head = f"config: {len(changed)} key(s) differ from the defaults; every key is in {path}"
    return [head] + [f"  {k}={shown_value(v)}" for k, v in changed.items()]


def help_keys_lines(root=None) -> list[str]:
    """Every config key with its default and description, grouped by section."""
    if root is None:
        root = schema.CoxswainConfig
    notes = field_comments()
    lines: list[str] = []

    def walk(cls, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            # a subclass (RefMegatronConfig, RefFSDPConfig) describes only what it changes: the rest is its base's
            desc = next((notes[(c.__name__, f.name)] for c in cls.__mro__ if (c.__name__, f.name) in notes), "")
            if dataclasses.is_dataclass(default):
                lines.append("")
                lines.append(f"[{key}]" + (f"  {desc}" if desc else ""))
                walk(type(default), key + ".")
            else:
                shown = "null" if default is None else repr(default) if isinstance(default, str) else str(default)
                if isinstance(default, bool):
                    shown = str(default).lower()
                lines.append(f"{key} = {shown}")
                if desc:
                    lines.append(f"      {desc}")

    walk(root, "")
    return lines[1:] if lines and lines[0] == "" else lines


def print_lines(lines) -> int:
    """Print ``lines``; a closed pipe (``| head``) ends quietly instead of with a BrokenPipe traceback."""
    try:
        for line in lines:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # Python's documented recipe: no error at interpreter exit
        os.dup2(devnull, sys.stdout.fileno())
    return 0
