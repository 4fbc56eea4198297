"""The DDP benchmark runs end to end and reports every variant (figures are not asserted: see docs)."""

import pytest
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow(stand_in="test_unknown_variant_is_refused")  # a real benchmark run; make test keeps the argument checks
def test_tiny_benchmark_reports_every_variant(tmp_path):
    out = tmp_path / "results.json"  # written into the run directory
    cmd = [sys.executable, "recipes/bench_ddp.py", "warmup=1", "steps=2", "gpt.n_layer=1", "gpt.n_embd=32",
           "gpt.n_head=2", "gpt.vocab_size=128", "gpt.block_size=16", "resnet.batch=2", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["model"] for r in results] == ["gpt", "resnet18"]
    for r in results:
        v = r["variants"]
        assert set(v) == {"native", "ours", "ours_no_overlap", "ours_bucket_view", "native_bucket_view"}
        assert v["native"]["ratio_to_native"] == 1.0
        assert all(row["steps"] == 2 and row["median_step_s"] > 0 for row in v.values())
        assert all("exposed_comm_s" in v[k] for k in ("ours", "ours_no_overlap", "ours_bucket_view"))
    assert "ours/native" in proc.stdout


def test_unknown_variant_is_refused(tmp_path, capsys):
    from test_train_recipe import one_line_error, recipe_main

    status, lines = one_line_error(recipe_main("bench_ddp"), ["variants=[turbo]", f"hydra.run.dir={tmp_path}"], capsys)
    assert "unknown variants ['turbo']" in str(status) + "\n".join(lines)  # SystemExit(the line)
