"""docs/benchmarks.md is exactly what `scripts/make_benchmarks.py --render-only` renders from the
committed data (docs/benchmarks/data/compare_*.json): no figure typed in by hand, none stale."""

import importlib.util
import json

from train_cases import ROOT

SCRIPT = ROOT / "scripts" / "make_benchmarks.py"


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
    readme = (ROOT / "README.md").read_text()
    assert make_benchmarks.with_quotes(readme) == readme, \
        "README.md quotes figures the data no longer holds: run python scripts/make_benchmarks.py --render-only"
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
    from minidist.compare.report import speed_verdict
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


def test_the_scale_document_is_the_rendering_of_the_cost_model_and_the_committed_runs(tmp_path):
    make_scale_doc = load_script(SCALE)
    assert make_scale_doc.render(img=tmp_path) == (ROOT / "docs" / "scale.md").read_text(), \
        "docs/scale.md differs from the cost model or its data: run python scripts/make_scale_doc.py --render-only"


def test_every_committed_validation_run_says_where_it_came_from_and_is_within_the_bound():
    make_scale_doc = load_script(SCALE)
    for rate in make_scale_doc.RATES:
        data = make_scale_doc.load(rate)
        assert data["provenance"]["command"] == make_scale_doc.command(rate)
        assert len(data["provenance"]["commit"]) >= 40 and data["provenance"]["date"]
        errors = make_scale_doc.costmodel.prediction_errors(data)
        assert set(errors) == {"ddp", "zero3", "ddp_hierarchical", "hsdp3"}
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
    soak = json.loads(make_doc.DATA.read_text())
    assert soak["provenance"]["command"] == make_doc.COMMAND and len(soak["provenance"]["commit"]) >= 40
    assert len(soak["kills"]) == len(soak["redone_steps"]) and soak["with_kills_s"] > soak["straight_s"]
    readme = (ROOT / "README.md").read_text()
    assert make_doc.with_quotes(readme) == readme, \
        "README.md quotes soak figures the data no longer holds: run python scripts/make_fault_tolerance_doc.py --render-only"
