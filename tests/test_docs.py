"""The docs cannot drift from the code: the site builds in strict mode, every config key the docs and the README
write exists (with the default they state), every repository path they name exists, every ``pkg.module:name`` of
the project they name imports, the generated pages are current, the table of departures from verl's defaults is
complete, and every command they mark runnable runs.

Marking a fenced block runnable: an HTML comment on the line before it (invisible on the site).

* ``<!-- runnable -->``: each command line of the block runs as written, from the repository root, and must exit 0;
* ``<!-- runnable: --print-config -->``: a training job; it is resolved instead of run (``--print-config`` with a
  run directory under a temporary directory), which refuses exactly what a run refuses except the hardware;
* ``<!-- runnable: --help -->``: a long job that is not a training run; ``--help`` is appended.

A default the docs state is written "`key` (default `value`)" (or "`key=value` (the default)") and is checked
against the schema; the table of departures from verl's defaults (docs/configuration.md) is checked both ways.

Training commands (``python -m trainer.main ...`` and the tiny recipe's wrapper) are resolved in one helper process
that imports the trainer once; the others run in a shell. All of it takes well under a minute (no training runs).
"""

import glob
import importlib
import importlib.util
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from omegaconf import OmegaConf

from tests.support.house import ROOT
from trainer import verl_keys
from trainer.config import schema
from trainer.console import shown_value
from trainer.verl_compat import same_value

DOCS = os.path.join(ROOT, "docs")
README = os.path.join(ROOT, "README.md")
PAGES = sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))
TEXTS = {os.path.relpath(p, ROOT): open(p, encoding="utf-8").read() for p in [README, *PAGES]}
SECTIONS = tuple(f.name for f in schema.dataclasses.fields(schema.CoxswainConfig))
DEFAULTS = schema.flatten_keys(OmegaConf.structured(schema.CoxswainConfig))
VERL_ONLY = set(verl_keys.MEGATRON) | set(getattr(verl_keys, "FSDP_ONLY", ()))
TOP_LEVEL = {n for n in os.listdir(ROOT) if not n.startswith(".") or n == ".ci"}
CODE_ROOTS = ("trainer", "megatron_bridge", "docs", "tests", "benchmarks", "recipes", "launch")

# the README's two set-up commands: CI (.ci/run) runs the second, so it must stay byte-identical
SETUP_COMMAND = "pip install -e . && bash recipes/cpu/run_tiny_grpo.sh"
TEST_COMMAND = 'pip install -e ".[dev]" && pip install --no-deps -r requirements-peers.txt && python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder'
TINY_WRAPPER = ("bash", "recipes/cpu/run_tiny_grpo.sh")
TINY_LINE = 'python -m trainer.main --config recipes/cpu/tiny_grpo.yaml "$@"'

_FENCE = re.compile(r"^(?P<marker><!--\s*runnable(?::\s*(?P<suffix>[^>]*?))?\s*-->\n)?```(?P<lang>[^\n]*)\n(?P<body>.*?)^```",
                    re.M | re.S)
_SPAN = re.compile(r"`([^`\n]+)`")
_KEYLIKE = re.compile(r"^(?:\*|\.\.\.|" + "|".join(SECTIONS) + r")(?:\.(?:[A-Za-z_]\w*|\*|\{[\w,]+\}))+$")


# ---------------------------------------------------------------------------------------------- reading the docs
def _strip_fences(text: str) -> str:
    return _FENCE.sub("", text)


def _fences(text: str):
    """``(marker suffix or None when not runnable, language, body)`` of every fenced block."""
    for m in _FENCE.finditer(text):
        yield (m.group("suffix") or "" if m.group("marker") else None), m.group("lang").strip(), m.group("body")


def _tokens(text: str):
    """Words of inline code spans (outside fenced blocks) and of shell / yaml-free fenced blocks."""
    for span in _SPAN.findall(_strip_fences(text)):
        yield from span.split()
    for _, lang, body in _fences(text):
        if lang.split()[:1] in (["bash"], ["sh"], ["console"]):
            yield from body.replace("\\\n", " ").split()


def _key_part(token: str) -> str | None:
    """The config key a token writes (``a.b=c``, ``+a.b=c``, ``a.b``), or None when it is no key."""
    token = token.strip("\"'(),;:").lstrip("+~")
    if "=" in token:
        token = token.split("=", 1)[0]
        has_value = True
    else:
        has_value = False
    if not _KEYLIKE.match(token):
        return None
    first, _, rest = token.partition(".")
    if first == "trainer" and not has_value and not schema.is_schema_key(token):
        # trainer.X.Y without a value may be code (trainer.pipeline.default_pipeline, trainer.rollout.sglang_cpu)
        mod = rest.split(".", 1)[0]
        if os.path.exists(os.path.join(ROOT, "trainer", mod + ".py")) or os.path.isdir(os.path.join(ROOT, "trainer", mod)):
            return None
    return token


def _expand(key: str) -> list[str]:
    """Brace lists expanded: ``a.{b,c}`` -> ``a.b``, ``a.c``."""
    parts = re.split(r"\{([\w,]+)\}", key)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


_ALL_KEYS = set(schema.LEAVES) | set(VERL_ONLY)


def _known(key: str) -> bool:
    if key.startswith(("*.", "...")):  # any role: some key ends with the rest
        tail = "." + key.split(".", 1)[1] if key.startswith("*.") else key[3:]
        tail = tail if tail.startswith(".") else "." + tail
        if tail.endswith(".*"):
            tail = tail[:-2]
            return any(tail + "." in k for k in _ALL_KEYS)
        return any(k.endswith(tail) for k in _ALL_KEYS) or any(
            (k + ".").find(tail + ".") >= 0 for k in schema._OPEN) or any(
            tail[1:].startswith(p.rsplit(".", 1)[-1] + ".") for p in schema._OPEN)
    if key.endswith(".*"):
        key = key[:-2]
    return schema.is_schema_key(key) or key in VERL_ONLY or any(k.startswith(key + ".") for k in VERL_ONLY)


# ---------------------------------------------------------------------------------------------- the tests
def test_readme_keeps_the_two_setup_commands_and_its_length():
    readme = TEXTS["README.md"]
    blocks = [body.strip() for _, _, body in _fences(readme)]
    assert SETUP_COMMAND in blocks, "the README's install-and-run command changed"
    assert TEST_COMMAND in blocks, "the README's test command (CI runs it, .ci/run) must stay byte-identical"
    words = len(readme.split())
    assert words <= 1200, f"README.md has {words} words; at most 1,200 (the rest belongs in docs/)"


def test_config_keys_in_the_docs_exist():
    unknown = {}
    for name, text in TEXTS.items():
        for tok in _tokens(text):
            key = _key_part(tok)
            if key is None:
                continue
            for k in _expand(key):
                if not _known(k):
                    unknown.setdefault(name, set()).add(k)
    assert not unknown, f"config keys the docs name that the schema does not have: {unknown}"


_DEFAULT_STATED = [
    re.compile(r"`(?P<key>[\w.]+)` \(default:? `(?P<value>[^`]*)`\)"),
    re.compile(r"`(?P<key>[\w.]+)=(?P<value>[^`]*)` \((?:the )?default\b"),
]


def test_defaults_stated_in_the_docs_are_the_schemas():
    stated, wrong = 0, []
    for name, text in TEXTS.items():
        for rx in _DEFAULT_STATED:
            for m in rx.finditer(text):
                key, value = m.group("key"), m.group("value").strip("'\"")
                if key not in DEFAULTS:
                    continue
                stated += 1
                if value.lower() != shown_value(DEFAULTS[key]).lower():
                    wrong.append(f"{name}: {key} default {value!r}, the schema's {shown_value(DEFAULTS[key])!r}")
    assert stated >= 15, "the default-matching patterns found (almost) nothing: did the docs' phrasing change?"
    assert not wrong, wrong


def _departures_table() -> dict[str, tuple[str, str]]:
    text = TEXTS["docs/configuration.md"]
    section = text.split("\n## Deliberate departures from verl's defaults", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1].strip("`"), cells[2].strip("`"))
    return rows


def test_departures_table_is_complete_and_right():
    table = _departures_table()
    differ = {k for k in DEFAULTS if k in verl_keys.MEGATRON and not same_value(DEFAULTS[k], verl_keys.MEGATRON[k])}
    assert set(table) == differ, (f"departures missing from the table: {sorted(differ - set(table))}; "
                                  f"rows that are no departure: {sorted(set(table) - differ)}")
    for key, (verl, ours) in table.items():
        assert verl == shown_value(verl_keys.MEGATRON[key]), f"{key}: verl's default is {verl_keys.MEGATRON[key]!r}"
        assert ours == shown_value(DEFAULTS[key]), f"{key}: Coxswain's default is {DEFAULTS[key]!r}"


def _path_candidates(text: str):
    for tok in _tokens(text):
        for part in tok.split("=", 1)[-1:] + ([tok.split("=", 1)[0]] if "=" in tok else []):
            part = part.strip("\"'(),;:").split(":", 1)[0].rstrip(".,")
            if "/" not in part and not re.search(r"\.(py|sh|yaml|yml|txt|md|json|jsonl|toml|ini|c|sbatch)$", part):
                continue
            if any(ch in part for ch in "*<>{}$") or part.startswith(("/", "http", "~")):
                continue
            if part.split("/", 1)[0] in TOP_LEVEL:
                yield part


def test_repository_paths_in_the_docs_exist():
    missing = {}
    for name, text in TEXTS.items():
        for p in _path_candidates(text):
            if not os.path.exists(os.path.join(ROOT, p.rstrip("/"))):
                missing.setdefault(name, set()).add(p)
    assert not missing, f"paths the docs name that do not exist: {missing}"


_SPEC = re.compile(r"^(?P<mod>(?:" + "|".join(CODE_ROOTS) + r")(?:\.\w+)+):(?P<attr>[A-Za-z_]\w*)$")


def test_project_specs_in_the_docs_import():
    """``docs.examples.plugins:no_reference``, ``trainer.rollout.native:NativeEngine``, ``trainer.main:cli``, ..."""
    bad = []
    seen = set()
    for name, text in TEXTS.items():
        for tok in _tokens(text):
            for part in re.split(r"[=\[\],]", tok.strip("\"'()")):
                m = _SPEC.match(part.strip())
                if not m or part in seen:
                    continue
                seen.add(part)
                try:
                    obj = importlib.import_module(m.group("mod"))
                except ImportError as e:
                    bad.append(f"{name}: {part}: {e}")
                    continue
                if not hasattr(obj, m.group("attr")):
                    bad.append(f"{name}: {part}: no attribute {m.group('attr')}")
    assert seen, "no pkg.module:name spec found in the docs"
    assert not bad, bad


def test_python_modules_the_docs_run_exist():
    """Every ``python -m X`` the docs write names a module of the project or an installed one."""
    bad = []
    for name, text in TEXTS.items():
        for m in re.finditer(r"python3? -m ([\w.]+)", text):
            mod = m.group(1)
            if mod.split(".")[0] in ("trainer", "megatron_bridge") and importlib.util.find_spec(mod) is None:
                bad.append(f"{name}: python -m {mod}")
    assert not bad, bad


def test_generated_pages_are_current():
    spec = importlib.util.spec_from_file_location("gen_pages", os.path.join(DOCS, "gen_pages.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    stale = [os.path.relpath(path, ROOT) for path, make in gen.PAGES.items()
             if not os.path.exists(path) or open(path, encoding="utf-8").read() != make()]
    assert not stale, f"{stale} differ from what the code generates: run python docs/gen_pages.py"


def _mkdocs() -> str | None:
    exe = shutil.which("mkdocs")
    if exe is None and importlib.util.find_spec("mkdocs") is None:
        return None
    return exe


def test_site_builds_in_strict_mode(tmp_path):
    if _mkdocs() is None:
        msg = 'mkdocs is not installed: pip install -e ".[dev]" (mkdocs-material)'
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- runnable commands
def _commands():
    """``(page, command line, suffix)`` for every line of every block marked runnable."""
    out = []
    for name, text in TEXTS.items():
        for suffix, _, body in _fences(text):
            if suffix is None:
                continue
            for line in body.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    out.append((name, line, suffix.strip()))
    return out


_RUNNER = r"""
import contextlib, io, json, sys
from trainer.main import cli
results = []
for argv in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    results.append({"rc": rc, "tail": (out.getvalue()[-1500:] + err.getvalue()[-1500:])})
print("RESULTS" + json.dumps(results))
"""


def _as_trainer_argv(argv: list[str]) -> list[str] | None:
    """The trainer's own arguments of a training command, or None when it is something else."""
    if argv[:3] in (["python", "-m", "trainer.main"], ["python3", "-m", "trainer.main"]):
        return argv[3:]
    if tuple(argv[:2]) == TINY_WRAPPER:
        wrapper = open(os.path.join(ROOT, TINY_WRAPPER[1]), encoding="utf-8").read()
        if TINY_LINE in wrapper:  # the wrapper only passes its arguments on
            return ["--config", "recipes/cpu/tiny_grpo.yaml", *argv[2:]]
    return None


def test_runnable_commands_run(tmp_path):
    commands = _commands()
    assert len(commands) >= 5, "fewer runnable commands than expected: did the marker convention change?"
    trainer_runs, shell_runs = [], []
    for i, (page, line, suffix) in enumerate(commands):
        if suffix == "--print-config":
            suffix = f"--print-config trainer.default_local_dir={tmp_path}/run{i}"
        full = f"{line} {suffix}".strip()
        argv = None if re.search(r"[|&;<>`]", line) else _as_trainer_argv(
            [os.path.expandvars(a) for a in shlex.split(full)])
        if argv is not None:
            trainer_runs.append((page, full, argv))
        else:
            shell_runs.append((page, full))

    def run_trainer():
        if not trainer_runs:
            return []
        r = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps([a for _, _, a in trainer_runs]),
                           cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert "RESULTS" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
        results = json.loads(r.stdout.rsplit("RESULTS", 1)[1])
        return [(page, cmd, res["rc"], res["tail"]) for (page, cmd, _), res in zip(trainer_runs, results)]

    def run_shell(item):
        page, cmd = item
        r = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
        return page, cmd, r.returncode, r.stdout[-1500:] + r.stderr[-1500:]

    with ThreadPoolExecutor(max_workers=3) as pool:
        trainer_future = pool.submit(run_trainer)
        results = list(pool.map(run_shell, shell_runs)) + trainer_future.result()
    failed = [f"{page}: `{cmd}` exited {rc}:\n{tail}" for page, cmd, rc, tail in results if rc != 0]
    assert not failed, "\n\n".join(failed)
