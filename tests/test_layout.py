"""The Layout table of the architecture page (docs/architecture.md) and the packages' own module lists are checked against the tree, and the shape of the
house is held: no import circles, few imports inside functions, no function of 100 lines or more
(``python tests/support/house.py`` prints the figures)."""

import os
import re
import subprocess

from tests.support.house import ROOT, measure

LAYOUT_PAGE = os.path.join(ROOT, "docs", "architecture.md")


def _layout_paths() -> set[str]:
    """The paths in the first column of the Layout table of docs/architecture.md (backticked, one or more per cell)."""
    text = open(LAYOUT_PAGE, encoding="utf-8").read()
    section = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    paths = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            paths.update(p.strip() for p in re.findall(r"`([^`]+)`", first))
    return paths


def _entries(package: str) -> list[str]:
    """A package's public modules and subpackages as Layout-table paths (``trainer/x.py``, ``trainer/x/``)."""
    out = []
    base = os.path.join(ROOT, package)
    for name in sorted(os.listdir(base)):
        full = os.path.join(base, name)
        if name.startswith(("_", ".")):
            continue
        if name.endswith(".py"):
            out.append(f"{package}/{name}")
        elif os.path.isdir(full) and os.path.exists(os.path.join(full, "__init__.py")):
            out.append(f"{package}/{name}/")
    return out


def test_layout_table_names_every_top_level_module_of_trainer():
    listed = _layout_paths()
    missing = [e for e in _entries("trainer") if e not in listed]
    assert not missing, f"the Layout table of docs/architecture.md does not name: {missing}"


def test_layout_table_names_only_paths_that_exist():
    gone = [p for p in _layout_paths() if not os.path.exists(os.path.join(ROOT, p.rstrip("/")))]
    assert not gone, f"the Layout table of docs/architecture.md names paths that do not exist: {gone}"


def test_every_package_docstring_names_its_modules():
    """Each package of trainer/ lists its public modules in its ``__init__`` docstring, so that opening the
    package tells what is in it."""
    unnamed = {}
    for d, dirs, files in os.walk(os.path.join(ROOT, "trainer")):
        dirs[:] = [x for x in dirs if not x.startswith(("_", ".")) and x != "site"]
        init = os.path.join(d, "__init__.py")
        if d == os.path.join(ROOT, "trainer") or not os.path.exists(init):
            continue
        doc = open(init, encoding="utf-8").read()
        pkg = os.path.relpath(d, ROOT)
        names = [e.split("/")[-1] or e.split("/")[-2] for e in _entries(pkg)]
        names = [n[:-3] if n.endswith(".py") else n for n in names]
        missing = [n for n in names if not re.search(rf"\b{re.escape(n)}\b", doc)]
        if missing:
            unnamed[pkg] = missing
    assert not unnamed, f"package docstrings that do not name their modules: {unnamed}"


def test_the_house_has_no_import_circle():
    cycles = measure().cycles()
    assert not cycles, f"import circles (python tests/support/house.py): {cycles}"


def test_imports_inside_functions_stay_rare():
    h = measure()
    assert h.inside_fraction <= 0.20, (
        f"{len(h.imports_inside)} of {h.imports_top + len(h.imports_inside)} internal imports sit inside functions "
        f"({100 * h.inside_fraction:.0f}% > 20%): move them to the top of the file (python tests/support/house.py -v lists them)")


def test_no_function_of_100_lines_or_more():
    h = measure()
    assert not h.long_functions, f"functions of 100+ lines: {h.long_functions}"


def test_config_checks_stay_short():
    """#37: no check function of trainer/config over 60 lines (one concern each, readable beside its schema)."""
    long = [(f, n, ln) for f, n, ln in measure(long_lines=61).long_functions if f.startswith("trainer/config/")]
    assert not long, f"config check functions over 60 lines: {long}"


def test_no_source_file_is_ignored_by_git():
    """A source file that .gitignore matches exists here but never reaches a clean clone (a ``site/`` rule once
    hid an SGLang CPU hook that sitecustomize imports: every real-SGLang test failed in CI only)."""
    sources = [os.path.relpath(os.path.join(d, f), ROOT)
               for top in ("trainer", "megatron_bridge", "recipes", "launch", "benchmarks", "tests")
               for d, dirs, files in os.walk(os.path.join(ROOT, top))
               if "__pycache__" not in d
               for f in files if f.endswith((".py", ".sh", ".yaml", ".json", ".txt", ".sbatch"))]
    assert len(sources) > 100
    out = subprocess.run(["git", "check-ignore", "--no-index", *sources], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == [], f"source files that git ignores (fix .gitignore): {out.stdout.split()}"
