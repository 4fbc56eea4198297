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
GATHERING = {"minidist", "minidist.parallel", "minidist.train", "minidist.train.strategies"}


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
    for package in ("minidist", "minidist_tools"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    ring = tmp_path / "minidist" / "comm" / "ring.py"
    ring.write_text(ring.read_text() + "\n\ndef _upward():\n    from minidist.train import config  # noqa\n")
    done = lint_imports(tmp_path, tmp_path)
    assert done.returncode != 0 and "minidist.comm.ring -> minidist.train.config" in done.stdout, done.stdout[-2000:]


def cycles(packages=("minidist", "minidist_tools")) -> list[list[str]]:
    """Strongly connected groups of modules (Tarjan), the gathering packages left out."""
    graph = grimp.build_graph(*packages, include_external_packages=False)
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
    assert cycles(("cyclepkg",)) == [["cyclepkg.a", "cyclepkg.b"]]


# ------------------------------------------------------------ minidist.comm, the only caller

# torch.distributed's functions that communicate (those the installed torch has are checked).
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
               "all_to_all_single", "barrier", "monitored_barrier", "batch_isend_irecv", "broadcast",
               "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "send_object_list",
               "recv_object_list", "all_reduce_coalesced", "all_gather_coalesced", "_all_gather_base",
               "_reduce_scatter_base"}


def direct_collective_calls(source: str, where: str) -> list[str]:
    """Calls of a torch.distributed collective in `source`: through `torch.distributed.X`, an
    alias of the module (`import torch.distributed as dist`: `dist.X`) or a name imported from it."""
    import ast

    tree = ast.parse(source)
    aliases, names = {"torch.distributed"}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            names |= {a.asname or a.name: a.name for a in node.names if a.name in COLLECTIVES}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and ast.unparse(f.value) in aliases:
            found.append(f"{where}:{node.lineno}: {ast.unparse(f)}")
        elif isinstance(f, ast.Name) and f.id in names:
            found.append(f"{where}:{node.lineno}: {f.id} (torch.distributed.{names[f.id]})")
    return found


def test_minidist_comm_is_the_only_caller_of_torch_distributed_collectives():
    """What the README's layout says of minidist/comm/: every other module goes through it (so the
    CommTracer sees every byte, and every collective gets its timeout)."""
    import torch.distributed as dist

    assert {"all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast", "isend"} <= \
        {c for c in COLLECTIVES if hasattr(dist, c)}
    found = []
    for path in sorted([*(ROOT / "minidist").rglob("*.py"), *(ROOT / "minidist_tools").rglob("*.py")]):
        if (ROOT / "minidist" / "comm") not in path.parents:
            found += direct_collective_calls(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []


def test_the_scan_finds_each_way_of_calling_a_collective():
    source = ("import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
              "from torch.distributed import broadcast as bc\n"
              "def f(t):\n    dist.all_reduce(t)\n    torch.distributed.barrier()\n    d2.isend(t, 1)\n    bc(t, 0)\n"
              "    dist.get_rank(); dist.new_group([0])\n")
    assert [line.split(": ", 1)[1] for line in direct_collective_calls(source, "x.py")] == \
        ["dist.all_reduce", "torch.distributed.barrier", "d2.isend", "bc (torch.distributed.broadcast)"]


# The core reading path (docs/architecture.md, "the core"): what a reader opens to follow a
# gradient from loss.backward() to the optimizer under DataParallel and ZeRO 1-3. Extras (comm
# hooks, wires, Join, DiLoCo) plug in at their seams outside it.
CORE = ["dist.py", "comm/__init__.py", "comm/ring.py", "parallel/buckets.py", "parallel/ddp.py", "parallel/zero.py",
        "parallel/zero3.py", "parallel/flat_shard.py", "parallel/sharded_grad.py", "parallel/shard_optimizer.py",
        "parallel/compat.py"]
CORE_LINES, CORE_FILES, MODULES = 4500, 14, 50  # issue 42's budgets


def test_the_core_and_the_package_stay_within_their_budgets():
    lines = {f: len((ROOT / "minidist" / f).read_text().splitlines()) for f in CORE}
    assert len(CORE) <= CORE_FILES and sum(lines.values()) <= CORE_LINES, (
        f"the core reading path is {sum(lines.values())} lines in {len(CORE)} files (budget {CORE_LINES} in "
        f"{CORE_FILES}): move what a reader of DataParallel and ZeRO does not need behind a seam, or cut it; {lines}")
    modules = sorted((ROOT / "minidist").rglob("*.py"))
    assert len(modules) <= MODULES, f"{len(modules)} modules in minidist/ (budget {MODULES}): join one into another"
