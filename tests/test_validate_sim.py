"""scripts/validate_sim.sh: the cost model (scripts/lib/costmodel.py) against measurements on 2 emulated hosts
x 2 ranks whose links are shaped with tc (200 Mbit/s between hosts, loopback within): every step
pattern (ddp, zero3, zero3 with ZeRO++, hierarchical all_reduce, hsdp3) predicted within 25%. Slow (about 20 s of
saturated links and both cores): `make test-all`. Without root it says so: test_multinode.py.

The 25% bound is what `python scripts/lib/costmodel.py validate` uses; the runs at 100, 200 and
500 Mbit/s committed in docs/scale/data/ (rendered in docs/scale.md) hold every pattern's error,
and tests/test_benchmarks_doc.py checks that each is within it."""

import os
import subprocess

import pytest

from test_multinode import namespaces_available
from train_cases import PYTHON, ROOT

SCRIPT = ROOT / "scripts" / "validate_sim.sh"


@pytest.mark.slow(stand_in="test_costmodel.py::test_across_hosts_only_one_shard_crosses")  # root-only shaped links
@pytest.mark.timeout(600)  # two takes of at most 280 s
def test_cost_model_within_a_quarter_of_shaped_links(tmp_path):
    reason = namespaces_available()
    if reason:
        pytest.skip(reason)
    # One measurement is a few seconds of saturated links on cores the machine shares: a CI run
    # once measured one flat ring 26% slower than predicted where runs here measure 3-17%. So a
    # measurement out of bounds is taken again once; a model that is off fails both.
    for attempt in (1, 2):
        out_dir = tmp_path / f"try{attempt}"
        out_dir.mkdir()
        # TIMEOUT_S bounds each launch: a fresh clone's run in CI took 75 s to start its 4 ranks
        # (imports from a cold page cache) and was cut off at the 100 s this once allowed.
        env = {**os.environ, "OUT": str(out_dir), "PREFIX": "mst", "PYTHON": PYTHON, "TIMEOUT_S": "240"}
        out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=280)
        if "NOT within" not in out.stdout:  # a pass, or a failure that is not the model's bound: no retake
            break
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "within 25% for every pattern" in out.stdout
    for pattern in ("ddp", "zero3", "zero3_zeropp", "ddp_hierarchical", "hsdp3"):
        assert f"| {pattern} |" in out.stdout
    assert (out_dir / "measured.json").is_file()

