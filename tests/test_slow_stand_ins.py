"""Each test marked slow names what in `make test` stands for it, or says why nothing can (the
README's promise): `pytest.mark.slow(stand_in="test_name")` (in the same file), `stand_in=
"test_file.py::test_name"`, a parameter as `test_name[id]`, or `stand_in=None, why="..."`.
The named test must exist and not be slow as a whole."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def is_slow_mark(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "slow" and ast.unparse(node.value) == "pytest.mark"


def slow_tests(tree: ast.Module) -> tuple[bool, set[str]]:
    """(the whole module is slow, the test functions slow as a whole)."""
    module = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                 and any(is_slow_mark(m) for m in ast.walk(n.value)) for n in tree.body)
    functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                 and any(is_slow_mark(d.func if isinstance(d, ast.Call) else d) for d in n.decorator_list)}
    return module, functions


def problems(files: dict[str, str]) -> list[str]:
    """What is wrong with the slow marks of these test files (name -> source)."""
    trees = {name: ast.parse(src) for name, src in files.items()}
    out = []
    for name, tree in trees.items():
        calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            if is_slow_mark(node) and id(node) not in calls:
                out.append(f"{name}:{node.lineno}: pytest.mark.slow without stand_in=")
            if not (isinstance(node, ast.Call) and is_slow_mark(node.func)):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            where = f"{name}:{node.lineno}"
            if "stand_in" not in kw or node.args:
                out.append(f"{where}: pytest.mark.slow(stand_in=...) names its fast stand-in (or None, why=...)")
                continue
            stand_in = kw["stand_in"]
            if isinstance(stand_in, ast.Constant) and stand_in.value is None:
                if not (isinstance(kw.get("why"), ast.Constant) and str(kw["why"].value).strip()):
                    out.append(f"{where}: stand_in=None needs why=\"...\"")
                continue
            if not (isinstance(stand_in, ast.Constant) and isinstance(stand_in.value, str)):
                out.append(f"{where}: stand_in must be a literal test name")
                continue
            file, _, test = stand_in.value.rpartition("::")
            file = file or name
            test = test.split("[")[0]
            if file not in trees:
                out.append(f"{where}: stand-in {stand_in.value!r}: no file {file}")
                continue
            defined = {n.name for n in ast.walk(trees[file]) if isinstance(n, ast.FunctionDef)}
            whole_module, whole_tests = slow_tests(trees[file])
            if test not in defined or not test.startswith("test"):
                out.append(f"{where}: stand-in {stand_in.value!r} is not a test in {file}")
            elif whole_module or test in whole_tests:
                out.append(f"{where}: stand-in {stand_in.value!r} is itself slow")
    return out


def test_every_slow_test_names_its_fast_stand_in():
    files = {p.name: p.read_text() for p in sorted(TESTS.glob("*.py"))}
    assert problems(files) == []


def test_the_check_finds_a_missing_or_wrong_stand_in():
    src = ("import pytest\n@pytest.mark.slow\ndef test_a(): pass\n"
           "@pytest.mark.slow(stand_in='test_c')\ndef test_b(): pass\n"
           "@pytest.mark.slow(stand_in='test_a')\ndef test_d(): pass\n"
           "@pytest.mark.slow(stand_in=None)\ndef test_e(): pass\n"
           "@pytest.mark.slow(stand_in='other.py::test_f[x]')\ndef test_g(): pass\n"
           "@pytest.mark.parametrize('x', [pytest.param(1, marks=pytest.mark.slow(stand_in='test_h[2]')), 2])\n"
           "def test_h(x): pass\n")
    other = "import pytest\npytestmark = pytest.mark.slow(stand_in=None, why='a wheel build')\ndef test_f(): pass\n"
    found = problems({"test_x.py": src, "other.py": other})
    assert [f.split(": ", 1)[1] for f in found] == [
        "pytest.mark.slow without stand_in=",
        "stand-in 'test_c' is not a test in test_x.py",
        "stand-in 'test_a' is itself slow",
        'stand_in=None needs why="..."',
        "stand-in 'other.py::test_f[x]' is itself slow",
    ]
