"""minidist's layers hold: runtime -> profiling -> parallel -> train -> tools, nothing imports
upward (the import-linter contract in pyproject.toml), and no module imports itself back through
others (no cycles, imports inside functions included). A future upward import fails here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

from train_cases import ROOT

# Packages whose __init__ only gathers the public names of their modules: importing the
# package from one of its own modules is not a design cycle (Python runs __init__ first anyway).
GATHERING = {"minidist", "minidist.parallel", "minidist.train", "minidist.train.strategies", "minidist.compare",
             "minidist.profiling", "minidist.walkthrough"}


def lint_imports(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.exit(lint_imports_command())"], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(pythonpath), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_no_module_imports_a_layer_above_its_own():
    done = lint_imports(ROOT, ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout


def test_the_contract_catches_an_upward_import(tmp_path):
    """The same contract on a copy of the package with one upward import added: broken."""
    shutil.copytree(ROOT / "minidist", tmp_path / "minidist", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    ring = tmp_path / "minidist" / "comm" / "ring.py"
    ring.write_text(ring.read_text() + "\n\ndef _upward():\n    from minidist.train import errors  # noqa\n")
    done = lint_imports(tmp_path, tmp_path)
    assert done.returncode != 0 and "minidist.comm.ring -> minidist.train.errors" in done.stdout, done.stdout[-2000:]


def cycles(package: str = "minidist") -> list[list[str]]:
    """Strongly connected groups of modules (Tarjan), the gathering packages left out."""
    graph = grimp.build_graph(package, include_external_packages=False)
    modules = [m for m in graph.modules if m not in GATHERING]
    edges = {m: [i for i in graph.find_modules_directly_imported_by(m) if i not in GATHERING] for m in modules}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in modules:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles() == []


def test_the_cycle_check_finds_a_cycle_made_by_an_import_inside_a_function(tmp_path, monkeypatch):
    pkg = tmp_path / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclepkg import b\n")
    (pkg / "b.py").write_text("def late():\n    from cyclepkg import a\n")
    (pkg / "c.py").write_text("from cyclepkg import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cycles("cyclepkg") == [["cyclepkg.a", "cyclepkg.b"]]
