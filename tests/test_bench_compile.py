"""The compile benchmark runs end to end (figures are not asserted: docs/compile.md), and
docs/compile.md is exactly the rendering of its committed results."""

import pytest
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow(stand_in="test_benchmarks_doc.py::test_the_committed_document_is_the_rendering_of_the_committed_data")  # compiles every variant
def test_tiny_benchmark_reports_every_variant_with_an_interval(tmp_path):
    cmd = [sys.executable, "recipes/bench_compile.py", "compiler=aot_eager", "warmup=1", "steps=3",
           "gpt.n_layer=1", "gpt.n_embd=32", "gpt.n_head=2", "gpt.block_size=16", "gpt.batch=2",
           f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    r, p = data["results"], data["provenance"]
    assert set(r["variants"]) == {"native_ddp", "ddp", "zero1", "zero2", "zero3", "native_ddp_eager"}
    assert p["command"].startswith("python recipes/bench_compile.py") and p["torch"] and p["date"] and p["commit"]
    for row in r["variants"].values():
        lo, hi = row["ratio_ci95"]
        assert row["steps"] == 3 and row["median_step_s"] > 0 and lo <= row["paired_ratio"] <= hi
    assert r["variants"]["native_ddp"]["paired_ratio"] == 1.0


@pytest.mark.slow(stand_in="test_benchmarks_doc.py::test_the_committed_document_is_the_rendering_of_the_committed_data")
def test_committed_document_is_the_rendering_of_the_committed_data():
    proc = subprocess.run([sys.executable, "scripts/render_compile_bench.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list((ROOT / "docs" / "benchmarks" / "data").glob("compile_*.json")), "no committed results"
