"""The shape of the house, measured from the source (``python -m tests.support.house`` prints it).

Reads every ``.py`` file under ``trainer/`` and ``megatron_bridge/`` with :mod:`ast` (nothing is imported)
and reports:

* the internal import graph: files as nodes, an edge for every import of another project file, imports inside
  functions included (``from trainer.config import x`` is an edge to ``trainer/config/__init__.py``; ``from
  trainer.workers import rollouts`` to ``trainer/workers/rollouts.py``); its strongly connected components of
  more than one file are the import circles;
* how many of the internal imports sit inside a function (a header that shows a file's dependencies is the goal:
  only optional or heavy third parties belong inside functions);
* every function of 100 lines or more.

``tests/test_layout.py`` holds the tree to these numbers.
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("trainer", "megatron_bridge")


@dataclass
class House:
    files: list[str] = field(default_factory=list)
    edges: set[tuple[str, str]] = field(default_factory=set)
    imports_top: int = 0
    imports_inside: list[tuple[str, int, str]] = field(default_factory=list)  # (file, line, module)
    long_functions: list[tuple[str, str, int]] = field(default_factory=list)  # (file, name, lines)

    @property
    def inside_fraction(self) -> float:
        total = self.imports_top + len(self.imports_inside)
        return len(self.imports_inside) / total if total else 0.0

    def cycles(self) -> list[list[str]]:
        return [c for c in _sccs(self.files, self.edges) if len(c) > 1]


def _py_files(root: str) -> list[str]:
    out = []
    for pkg in PACKAGES:
        for d, dirs, names in os.walk(os.path.join(root, pkg)):
            dirs[:] = sorted(x for x in dirs if x not in ("__pycache__", "site"))
            out += [os.path.relpath(os.path.join(d, n), root) for n in sorted(names) if n.endswith(".py")]
    return out


def _module_file(root: str, module: str) -> str | None:
    parts = module.split(".")
    for cand in (os.path.join(*parts) + ".py", os.path.join(*parts, "__init__.py")):
        if os.path.exists(os.path.join(root, cand)):
            return cand
    return None


def _targets(root: str, path: str, node: ast.AST) -> list[str]:
    """Project files that one import statement loads (its package's ``__init__`` for ``from pkg import name``
    where ``name`` is not a module of its own)."""
    if isinstance(node, ast.Import):
        mods = [a.name for a in node.names]
        return [f for m in mods if m.split(".")[0] in PACKAGES for f in [_module_file(root, m)] if f]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        pkg = os.path.dirname(path).split(os.sep)
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    if base.split(".")[0] not in PACKAGES:
        return []
    out = []
    for a in node.names:
        sub = _module_file(root, f"{base}.{a.name}")
        f = sub or _module_file(root, base)
        if f:
            out.append(f)
    return out


def _inside_function(parents: list[ast.AST]) -> bool:
    return any(isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)) for p in parents)


def _guarded_by_type_checking(parents: list[ast.AST]) -> bool:
    return any(isinstance(p, ast.If) and "TYPE_CHECKING" in ast.unparse(p.test) for p in parents)


def measure(root: str = ROOT, long_lines: int = 100) -> House:
    h = House(files=_py_files(root))
    for path in h.files:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        stack: list[tuple[ast.AST, list[ast.AST]]] = [(tree, [])]
        while stack:
            node, parents = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n >= long_lines:
                    h.long_functions.append((path, node.name, n))
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = [t for t in _targets(root, path, node) if t != path]
                if targets:
                    if _guarded_by_type_checking(parents):
                        continue  # annotations only: no run-time edge
                    h.edges.update((path, t) for t in targets)
                    if _inside_function(parents):
                        h.imports_inside.append((path, node.lineno, ast.unparse(node)))
                    else:
                        h.imports_top += 1
            for child in ast.iter_child_nodes(node):
                stack.append((child, parents + [node]))
    return h


def _sccs(nodes: list[str], edges: set[tuple[str, str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative."""
    adj: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        adj.setdefault(a, []).append(b)
        adj.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, st, out = set(), [], []
    counter = 0
    for start in adj:
        if start in index:
            continue
        work = [(start, iter(adj[start]))]
        index[start] = low[start] = counter
        counter += 1
        st.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    st.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(adj[nxt])))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = st.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def main(argv: list[str]) -> int:
    h = measure()
    total = h.imports_top + len(h.imports_inside)
    print(f"files {len(h.files)}, internal import edges {len(h.edges)}")
    print(f"internal imports: {total}, inside functions {len(h.imports_inside)} ({100 * h.inside_fraction:.0f}%)")
    cyc = h.cycles()
    print(f"import circles: {len(cyc)}")
    for c in cyc:
        print("  " + " <-> ".join(c))
    print(f"functions of 100 lines or more: {len(h.long_functions)}")
    for path, name, n in sorted(h.long_functions, key=lambda x: -x[2]):
        print(f"  {path}:{name} {n}")
    if "-v" in argv:
        for path, line, text in h.imports_inside:
            print(f"  inside {path}:{line}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
