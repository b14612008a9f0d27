"""Small helpers shared by the ``bench_*.py`` files: the machine line, a plain text table, the JSON
dump and best-of timing. Same output style everywhere: a ``machine:`` line, a table, optional
``--json PATH``, and the headline ratio as the last line.

Importing it also sets up a benchmark process (a script's own folder is on ``sys.path`` already):
the repository root (``ROOT``) goes on ``sys.path`` and into ``PYTHONPATH``, so Ray workers and
spawned ranks import ``trainer`` / ``megatron_bridge`` from it wherever the script is run from, and
children inherit ``PYTHONWARNINGS=ignore`` (their import-time "no Apex / Transformer Engine" warnings
are noise in a benchmark's output)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
os.environ.setdefault("PYTHONWARNINGS", "ignore")

import torch  # noqa: E402


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def machine(extra: str = "") -> str:
    """CPU model, core count, torch version and threads, and the 1-minute load average (the machine
    may be shared with other jobs, which only ever slows a run down)."""
    s = (f"{cpu_model()}, {os.cpu_count()} cores visible, torch {torch.__version__} "
         f"({torch.get_num_threads()} threads), python {platform.python_version()}, load avg {load_average():.1f}")
    return s + (f", {extra}" if extra else "")


def table(headers: Sequence[str], rows: Sequence[Sequence], floatfmt: str = "{:.3f}") -> str:
    """Right-aligned columns except the first; floats through ``floatfmt``."""
    cells = [[h for h in headers]] + [[floatfmt.format(c) if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for j, r in enumerate(cells):
        out.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def write_json(path: str | None, result: dict) -> None:
    if path:
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, default=str)


def timed(fn: Callable) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def summary(times: Sequence[float]) -> dict:
    """Best (the estimate of the code's own cost on a shared machine: noise is one-sided) and median."""
    return {"best": min(times), "median": statistics.median(times), "n": len(times), "all": list(times)}
