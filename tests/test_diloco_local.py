"""scripts/diloco_local.sh: ddp, hsdp3 and diloco (DDP within the host, the outer all_reduce across
hosts every H steps) on 2 emulated hosts x 2 ranks with shaped links. Slow and root-only: a few
steps at one rate, checked for what it writes and for the bytes that leave each host, not for its
speed (that is a benchmark: docs/benchmarks/data/diloco_shaped.json, rendered in docs/benchmarks.md)."""

import json
import os
import subprocess

import pytest

from test_multinode import namespaces_available
from train_cases import PYTHON, ROOT


@pytest.mark.slow(stand_in="test_diloco.py::test_one_step_rounds_with_plain_outer_sgd_are_ddp")
@pytest.mark.timeout(900)
def test_diloco_on_shaped_links_leaves_each_host_a_fraction_of_ddps_bytes(tmp_path):
    reason = namespaces_available()
    if reason:
        pytest.skip(reason)
    # Bytes per step depend on the model, not on the batch: micro-batches of 4 and 2 evaluation
    # batches keep the check's time to its launches.
    env = {**os.environ, "OUT": str(tmp_path), "PREFIX": "dlt", "PYTHON": PYTHON, "RATES": "500mbit",
           "STEPS": "16", "EVAL_EVERY": "8", "EVAL_BATCHES": "2", "SYNC_EVERY": "8"}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "diloco_local.sh"), "trainer.micro_batch_size=4"], env=env,
                         capture_output=True, text=True, timeout=880)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "diloco_shaped.json").read_text())["results"]
    runs = result["rates"]["500mbit"]
    assert list(runs) == ["ddp", "hsdp3", "diloco_h8"] and result["reference"] == "ddp"
    for r in runs.values():
        assert [p["step"] for p in r["curve"]] == [8, 16] and r["curve"][0]["train_s"] < r["curve"][1]["train_s"]
    # the network devices' count: a round of 8 steps sends the model once, ddp every step
    assert runs["diloco_h8"]["host_tx_bytes_per_step"] < 0.3 * runs["ddp"]["host_tx_bytes_per_step"]
