"""The checkpoint benchmark runs end to end and reports the three ways (figures are in docs, not asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow(stand_in="test_async_checkpoint.py::test_background_checkpoints_equal_the_synchronous_ones_and_resume_exactly")
def test_tiny_checkpoint_benchmark(tmp_path):
    cmd = [sys.executable, "recipes/bench_checkpoint.py", "model_name=gpt_nano", "steps=6", "ckpt_every=3", "rounds=2",
           "strategies=[zero2]", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "results.json").read_text())["results"]
    assert set(r) == {"zero2"}
    for strategy in r.values():
        assert set(strategy["runs"]) == {"none", "sync", "async"} and all(len(v) == 2 for v in strategy["runs"].values())
        assert all(run["write_s"] > 0 for v in strategy["runs"].values() for run in v)
        assert all(run["writing_step_s"] > 0 for run in strategy["runs"]["async"])
        for ratio in strategy["ratios"].values():
            assert ratio["ci"][0] <= ratio["median"] <= ratio["ci"][1]
