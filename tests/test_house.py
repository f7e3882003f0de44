"""The house rules that code review would otherwise have to keep: no import
cycle inside the package (an import made inside a function counts too), no
module of the package's runtime importing the test harness
(``clawcomm.testing``), and no source file over 500 lines in clawcomm/ or
csrc/."""

from __future__ import annotations

import ast
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "clawcomm")
MAX_LINES = 500


def _modules() -> dict[str, str]:
    """Module name -> path, for every .py file and extension stub in clawcomm/."""
    mods = {}
    for folder, _, files in os.walk(PKG):
        for f in files:
            if f.endswith((".py", ".pyi")):
                rel = os.path.relpath(os.path.join(folder, f), ROOT).rsplit(".", 1)[0]
                name = rel.replace(os.sep, ".").removesuffix(".__init__")
                mods.setdefault(name, os.path.join(folder, f))
    return mods


def import_graph() -> dict[str, set[str]]:
    """Which clawcomm modules each clawcomm module imports, at any depth of
    its code. ``from pkg import name`` is an edge to ``pkg.name`` when that is
    a module (an extension such as ``_C`` included), else to ``pkg``; a
    module's own ancestors are implied by Python and are not edges."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        if path.endswith(".pyi"):
            graph[name] = set()
            continue
        is_pkg = path.endswith("__init__.py")
        targets = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if is_pkg else name.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    targets.add(full if full in mods else base)
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {t for t in targets if t in mods and t != name and t not in ancestors}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "clawcomm.train.trainer" in graph and "clawcomm._C" in graph["clawcomm._backend"]
    found = cycles(graph)
    detail = [{m: sorted(graph[m] & set(c)) for m in c} for c in found]
    assert not found, f"import cycles: {detail}"


def test_nothing_in_the_runtime_imports_the_test_harness():
    graph = import_graph()
    harness = {m for m in graph if m == "clawcomm.testing" or m.startswith("clawcomm.testing.")}
    assert "clawcomm.testing.chaos" in harness and "clawcomm.launch.ranks" in graph
    leaks = {
        m: sorted(graph[m] & harness) for m in graph if m not in harness and graph[m] & harness
    }
    assert not leaks, f"runtime modules importing the test harness: {leaks}"


def test_no_source_file_over_500_lines():
    files = subprocess.run(
        ["git", "ls-files", "clawcomm/*.py", "csrc/*.h", "csrc/*.cc", "csrc/*.cu", "csrc/*.cuh"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert len(files) > 50
    long = {}
    for f in files:
        with open(os.path.join(ROOT, f)) as fh:
            n = sum(1 for _ in fh)
        if n > MAX_LINES:
            long[f] = n
    assert not long, f"files over {MAX_LINES} lines (split them along their seam): {long}"
