"""The collectives benchmark runs end to end and reports every op, size and algorithm (figures are in
docs, not asserted)."""

import pytest
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow(stand_in="test_ring.py::test_ring_collectives_equal_the_backend")  # a real benchmark run
def test_tiny_ring_benchmark(tmp_path):
    cmd = [sys.executable, "recipes/bench_ring.py", "nproc=2", "sizes=[4096,16384]", "rounds=2", "warmup=1", "calls=2",
           "algorithms=[backend,ring,shm,shm_inplace,memcpy]", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {(r["op"], r["bytes"]) for r in rows} == {
        (op, size) for op in ("reduce_scatter", "all_gather", "all_reduce") for size in (4096, 16384)}
    assert all(r["speedup"][a]["median"] > 0 and r["busbw_GBps"][a] > 0 for r in rows for a in ("ring", "shm", "memcpy"))
    assert all(r["calls"] == 2 for r in rows)
    assert [r["op"] for r in rows if "shm_inplace" in r["ms"]] == ["all_reduce"] * 2  # (all_reduce's alone)
    assert all(r["speedup"]["shm_inplace"]["median"] > 0 for r in rows if r["op"] == "all_reduce")


def test_fewer_than_one_call_per_round_is_refused_naming_the_way(monkeypatch):
    from test_train_recipe import recipe_main

    monkeypatch.setattr(sys, "argv", ["bench_ring.py"])
    with pytest.raises(SystemExit, match=r"^bench_ring: calls=0: time at least 1 call per round \(calls=1: each alone\)$"):
        recipe_main("bench_ring")(["calls=0"])
