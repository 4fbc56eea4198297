"""docs/benchmarks.md is exactly what `scripts/make_benchmarks.py --render-only` renders from the
committed data (docs/benchmarks/data/compare_*.json): no figure typed in by hand, none stale."""

import importlib.util
import json
import re
import sys

import pytest

from train_cases import ROOT

SCRIPT = ROOT / "scripts" / "make_benchmarks.py"


def quoting_texts(tag):
    """The README and documents that quote `tag`'s figures (the pipeline's own search), never none."""
    from doc_pipeline import quoting_texts as found_by_the_pipeline  # scripts/lib, importable (conftest.py)

    found = found_by_the_pipeline(tag)
    assert found, f"nothing quotes the {tag} figures"
    return found


def load_script(path=SCRIPT):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_document_is_the_rendering_of_the_committed_data(tmp_path):
    make_benchmarks = load_script()
    rendered = make_benchmarks.render(img=tmp_path)
    assert rendered == (ROOT / "docs" / "benchmarks.md").read_text(), \
        "docs/benchmarks.md differs from its data: run python scripts/make_benchmarks.py --render-only"


def test_the_readmes_quotes_of_the_benchmarks_are_rendered_from_the_same_data():
    make_benchmarks = load_script()
    for path in quoting_texts("benchmarks"):
        text = path.read_text()
        assert make_benchmarks.with_quotes(text) == text, \
            f"{path.name} quotes figures the data no longer holds: run python scripts/make_benchmarks.py --render-only"
    assert make_benchmarks.at_most(2.4e-6) == "3e-6" and make_benchmarks.at_most(3e-6) == "3e-6"
    assert make_benchmarks.at_most(9.5e-7) == "1e-6"


def test_every_data_file_says_where_it_came_from():
    files = sorted((ROOT / "docs" / "benchmarks" / "data").glob("compare_*.json"))
    assert files, "no committed benchmark data"
    for f in files:
        provenance = json.loads(f.read_text())["provenance"]
        assert provenance["command"].startswith("python recipes/compare.py"), f
        assert len(provenance["commit"]) >= 40 and provenance["torch"] and provenance["date"], f


def test_a_target_is_met_only_when_the_whole_interval_is_under_it():
    from minidist_tools.report import speed_verdict
    row = {"time_ratio": 0.99}
    assert speed_verdict({**row, "time_ratio_ci": [0.97, 1.00]}) == "met"
    assert speed_verdict({**row, "time_ratio_ci": [0.97, 1.004]}).startswith("undecided")  # no rounding first
    assert speed_verdict({**row, "time_ratio": 1.05, "time_ratio_ci": [1.01, 1.08]}) == "NOT met"


COMPONENTS = ROOT / "scripts" / "make_components.py"


def load_components_script():
    return load_script(COMPONENTS)


def test_the_component_document_is_the_rendering_of_its_data():
    make_components = load_components_script()
    assert make_components.render() == (ROOT / "docs" / "benchmarks" / "components.md").read_text(), \
        "docs/benchmarks/components.md differs from its data: run python scripts/make_components.py --render-only"


def test_every_component_run_is_committed_with_where_it_came_from():
    make_components = load_components_script()
    for name in make_components.RUNS:
        f = ROOT / "docs" / "benchmarks" / "data" / f"component_{name}.json"
        assert f.is_file(), f"{f.name} missing: run python scripts/make_components.py --only {name}"
        data = json.loads(f.read_text())
        assert data["provenance"]["command"] == make_components.command(name), f
        assert len(data["provenance"]["commit"]) >= 40 and data["provenance"]["torch"], f


def test_a_speedup_target_needs_the_whole_interval_above_it():
    make_components = load_components_script()
    assert make_components.at_least([1.52, 2.0], 1.5) == "met"
    assert make_components.at_least([1.49, 2.0], 1.5) == "undecided"
    assert make_components.at_least([1.1, 1.45], 1.5) == "NOT met"


SCALE = ROOT / "scripts" / "make_scale_doc.py"
SCALE_DOC = ROOT / "docs" / "scale.md"


def test_the_scale_document_is_the_rendering_of_the_cost_model_and_the_committed_runs():
    make_scale_doc = load_script(SCALE)  # the text; its plots are drawn by the strategy registry's test
    assert make_scale_doc.render(img=None) == SCALE_DOC.read_text(), \
        "docs/scale.md differs from the cost model or its data: run python scripts/make_scale_doc.py --render-only"


def test_every_committed_validation_run_says_where_it_came_from_and_is_within_the_bound():
    make_scale_doc = load_script(SCALE)
    for rate in make_scale_doc.RATES:
        provenance = make_scale_doc.load_record(make_scale_doc.data_file(rate))["provenance"]
        assert provenance["command"] == make_scale_doc.command(rate)
        assert len(provenance["commit"]) >= 40 and provenance["date"]
        errors = make_scale_doc.costmodel.prediction_errors(make_scale_doc.load(rate))
        assert set(errors) == {"ddp", "zero3", "zero3_zeropp", "ddp_hierarchical", "hsdp3"}
        assert all(abs(e) <= make_scale_doc.TOLERANCE for e in errors.values()), (rate, errors)


def test_runs_of_picks_reads_as_ranges():
    runs_of = load_script(SCALE).runs_of
    assert runs_of([(16, "zero3"), (64, "hsdp3"), (256, "hsdp3")]) == "zero3 at 16, hsdp3 from 64 on"
    assert runs_of([(16, None), (64, "zero3"), (256, "zero3"), (1024, "hsdp3")]) == \
        "none fits at 16, zero3 from 64 to 256, hsdp3 at 1,024"


FAULTS = ROOT / "scripts" / "make_fault_tolerance_doc.py"


def test_the_fault_tolerance_document_is_the_rendering_of_the_committed_soak():
    make_doc = load_script(FAULTS)
    assert make_doc.render() == (ROOT / "docs" / "fault_tolerance.md").read_text(), \
        "docs/fault_tolerance.md differs from its data: run python scripts/make_fault_tolerance_doc.py --render-only"
    data = json.loads(make_doc.DATA.read_text())
    soak = data["results"]
    assert data["provenance"]["command"] == make_doc.COMMAND and len(data["provenance"]["commit"]) >= 40
    assert len(soak["kills"]) == len(soak["redone_steps"]) and soak["with_kills_s"] > soak["straight_s"]
    for path in quoting_texts("fault_tolerance"):
        text = path.read_text()
        assert make_doc.with_quotes(text) == text, \
            f"{path.name} quotes soak figures the data no longer holds: run python scripts/make_fault_tolerance_doc.py --render-only"


# ---------------------------------------------------------------- one pipeline for every document

DOCUMENT_SCRIPTS = ["make_benchmarks.py", "make_components.py", "make_scale_doc.py", "make_fault_tolerance_doc.py",
                    "make_walkthrough_doc.py", "render_compile_bench.py"]


def test_every_document_script_declares_its_document_to_the_one_pipeline():
    """Each scripts/make_*.py says only what is its own (runs, data, prose) and hands a Document to
    scripts/lib/doc_pipeline.py, whose command line they all share; the library has none of it."""
    import ast

    found = sorted(p.name for p in (ROOT / "scripts").glob("*.py")
                   if "render(" in p.read_text() and "docs" in p.read_text())
    assert found == sorted(DOCUMENT_SCRIPTS)
    for name in DOCUMENT_SCRIPTS:
        module = load_script(ROOT / "scripts" / name)
        assert module.DOCUMENT.script == ROOT / "scripts" / name and module.DOCUMENT.path.is_file()
        tree = ast.parse((ROOT / "scripts" / name).read_text())
        assert not any(isinstance(n, ast.Import) and any(a.name == "argparse" for a in n.names) for n in ast.walk(tree))
        assert module.main.__module__ == "doc_pipeline"
    scripts = "".join(p.read_text() for p in [*(ROOT / "scripts").glob("*.py"), *(ROOT / "scripts" / "lib").glob("*.py")])
    for template in (ROOT / "scripts" / "templates").glob("*.md"):  # each document's text, filled by its script
        assert re.search(rf'fill\(\s*"{re.escape(template.name)}"', scripts), f"{template.name}: no script fills it"
    library = "".join(p.read_text() for p in (ROOT / "minidist").rglob("*.py"))
    assert "argparse.ArgumentParser(description=description)" not in library and "def provenance(repo" not in library


def test_every_committed_data_file_is_in_the_one_schema():
    """provenance (commit, command, torch, date) and results, for every file under docs/*/data/."""
    pipeline = load_script(ROOT / "scripts" / "lib" / "doc_pipeline.py")
    files = sorted((ROOT / "docs").glob("*/data/*.json")) + sorted((ROOT / "docs").glob("*/*/data/*.json"))
    assert len(files) >= 30
    for f in files:
        data = pipeline.load(f)
        assert len(data["provenance"]["commit"]) >= 40, f


def test_check_fails_on_a_stale_document_and_names_the_command(tmp_path, capsys):
    pipeline = load_script(ROOT / "scripts" / "lib" / "doc_pipeline.py")
    doc = tmp_path / "doc.md"
    doc.write_text("old\n")
    document = pipeline.Document(ROOT / "scripts" / "make_benchmarks.py", doc, lambda: "new\n")
    assert pipeline.main(document, ["--check"]) == 1
    assert f"{doc} is not the rendering of its data: run python scripts/make_benchmarks.py --render-only" in \
        capsys.readouterr().out
    assert doc.read_text() == "old\n"  # --check writes nothing
    assert pipeline.main(document, ["--render-only"]) == 0 and doc.read_text() == "new\n"
    assert pipeline.main(document, ["--check"]) == 0


def test_a_template_is_filled_whole_and_refuses_a_hole_or_an_unsaid_figure(tmp_path, monkeypatch):
    pipeline = load_script(ROOT / "scripts" / "lib" / "doc_pipeline.py")
    monkeypatch.setattr(pipeline, "TEMPLATES", tmp_path)
    (tmp_path / "t.md").write_text("a {{x}}{{#more}} b {{y}}{{#most}} c{{/most}}{{/more}}.\n\n")
    assert pipeline.fill("t.md", x=1, more=True, y="two", most=False) == "a 1 b two.\n"
    assert pipeline.fill("t.md", x=1, more=False) == "a 1.\n"  # a dropped passage's figures are not asked for
    for values, said in (({"x": 1, "more": True}, "no value for ['most', 'y']"),
                         ({"x": 1, "more": False, "z": 3}, "nothing in it asks for: ['z']")):
        with pytest.raises(SystemExit, match=re.escape(said)):
            pipeline.fill("t.md", **values)


def test_every_planted_defect_still_finds_the_line_it_patches(monkeypatch):
    """docs/testing.md's mutation score holds while each of scripts/mutations.py's defects patches the
    library as it is: its text stands exactly once in its file (a rewritten line otherwise stops the
    script's run midway, found only when someone runs it)."""
    spec = importlib.util.spec_from_file_location("mutations", ROOT / "scripts" / "mutations.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mutations", module)  # (its dataclass looks its module up there)
    spec.loader.exec_module(module)
    found = {m.name: (ROOT / m.file).read_text().count(m.old) for m in module.MUTATIONS}
    stale = {name: times for name, times in found.items() if times != 1}
    assert found and not stale, f"update these mutations to the library (times found): {stale}"
