"""The collective benchmark writes its table, CSV, JSON, TensorBoard events and PNG (figures not asserted)."""

import pytest
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow(stand_in="test_unknown_op_is_refused_with_the_choices")  # a real sweep; make test keeps the argument checks
def test_small_sweep_writes_every_output(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "recipes/bench_collectives.py", "nproc=2", "max_bytes=4096", "iters=2",
           "warmup=1", "repeats=2", f"hydra.run.dir={out}"]  # the run directory holds every output
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "memcpy bandwidth" in proc.stdout and "busbw GB/s" in proc.stdout

    rows = list(csv.DictReader(open(out / "results.csv")))
    ops = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "sendrecv"}
    # 6 ops x sizes {1 KiB, 4 KiB} x {sync, async}
    assert {(r["op"], r["mode"], int(r["bytes"])) for r in rows} == {
        (op, mode, size) for op in ops for mode in ("sync", "async") for size in (1024, 4096)}
    factor = {"all_reduce": 2 * 1 / 2, "all_gather": 1 / 2, "reduce_scatter": 1 / 2,
              "broadcast": 1, "reduce": 1, "sendrecv": 1}
    for r in rows:
        t = float(r["time_us"]) * 1e-6
        assert t > 0
        assert abs(float(r["algbw_GBps"]) - int(r["bytes"]) / t / 1e9) <= 1e-3 + 1e-2 * float(r["algbw_GBps"])
        assert abs(float(r["busbw_GBps"]) - float(r["algbw_GBps"]) * factor[r["op"]]) <= 2e-4

    meta = json.loads((out / "results.json").read_text())["meta"]
    assert meta["world_size"] == 2 and meta["memcpy_GBps"] > 0
    assert (out / "busbw.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_unknown_op_is_refused_with_the_choices(tmp_path, capsys):
    from test_train_recipe import one_line_error, recipe_main

    status, lines = one_line_error(recipe_main("bench_collectives"), ["nproc=2", "ops=[all_to_nowhere]",
                                                                      f"hydra.run.dir={tmp_path}"], capsys)
    assert "unknown ops ['all_to_nowhere']" in str(status) + "\n".join(lines)  # SystemExit(the line)
