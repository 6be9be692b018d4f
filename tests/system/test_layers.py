"""Every dependency between pccl's modules runs one way: no import circle (issue 39), so
each layer can be read and tested from the bottom up. Imports are read from the source
(every ``import`` statement, also those inside functions or ``TYPE_CHECKING``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pccl
from pccl.config import markdown_table

ROOT = Path(pccl.__file__).resolve().parent


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Module -> the pccl modules it imports (a package's ``__init__`` is the package)."""
    files = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for a in node.names:  # "from pccl import config": the module config
                    out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base)
        graph[name] = {m for m in out if m in files and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_pccl_imports_one_that_imports_it_back() -> None:
    graph = imports()
    assert "pccl.config" in graph["pccl.communicator"]  # (the reader reads)
    # A package's __init__ re-exports what is below it; a module importing its own
    # package would make every module a circle through it, so those arrows are left out.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    assert circles(graph) == []


def test_the_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_python_m_pccl_env_prints_the_table() -> None:
    run = subprocess.run([sys.executable, "-m", "pccl", "env"], capture_output=True,
                         text=True, timeout=60, check=True)
    assert (run.stdout, run.stderr) == (markdown_table(), "")
