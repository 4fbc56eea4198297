"""The memory benchmark runs end to end (figures are recorded in docs, not asserted here)."""

import pytest
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow(stand_in="test_zero.py::test_memory_matches_the_zero_paper")  # a real benchmark run
def test_tiny_memory_benchmark(tmp_path):
    cmd = [sys.executable, "recipes/bench_memory.py", "nproc=2", "strategies=[zero2,zero2_backend]",
           "sizes=[64,128,64]", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert set(rows) == {"zero2", "zero2_backend"}
    assert rows["zero2"]["collectives"] == "auto" and rows["zero2_backend"]["collectives"] == "backend"
    assert all(r["formula_bytes"] > 0 and r["psi"] == 64 * 128 + 128 + 128 * 64 + 64 for r in rows.values())
