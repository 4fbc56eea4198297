"""docs/benchmarks.md is exactly what `scripts/make_benchmarks.py --render-only` renders from the
committed data (docs/benchmarks/data/compare_*.json): no figure typed in by hand, none stale."""

import importlib.util
import json

from train_cases import ROOT

SCRIPT = ROOT / "scripts" / "make_benchmarks.py"


def load_script():
    spec = importlib.util.spec_from_file_location("make_benchmarks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_document_is_the_rendering_of_the_committed_data(tmp_path):
    make_benchmarks = load_script()
    rendered = make_benchmarks.render(img=tmp_path)
    assert rendered == (ROOT / "docs" / "benchmarks.md").read_text(), \
        "docs/benchmarks.md differs from its data: run python scripts/make_benchmarks.py --render-only"


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
