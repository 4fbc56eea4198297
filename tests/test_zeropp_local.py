"""scripts/zeropp_local.sh: zero3, native_fsdp and zero3 with ZeRO++ (int8 weights and gradients,
hpZ) trained on 2 emulated hosts x 2 ranks with shaped links. Slow and root-only: one round of
a few steps, checked for what it writes, not for its speed (that is a benchmark: the committed
rounds in docs/benchmarks/data/zeropp_shaped.json, rendered in docs/benchmarks.md)."""

import json
import os
import subprocess

import pytest

from test_multinode import namespaces_available
from train_cases import PYTHON, ROOT


@pytest.mark.slow(stand_in="test_zero_wires.py::test_hpz_keeps_the_backward_gathers_within_a_host_and_trains_identically[int8]")
@pytest.mark.timeout(600)
def test_zeropp_on_shaped_links_leaves_each_host_less(tmp_path):
    reason = namespaces_available()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "OUT": str(tmp_path), "PREFIX": "zpt", "PYTHON": PYTHON, "ROUNDS": "1", "STEPS": "10",
           "RATE": "500mbit", "TIMEOUT_S": "240"}
    # Bytes per step depend on the model, not on the batch: micro-batches of 4 keep the time to the launches.
    out = subprocess.run(["bash", str(ROOT / "scripts" / "zeropp_local.sh"), "trainer.micro_batch_size=4"], env=env,
                         capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    variants = json.loads((tmp_path / "zeropp.json").read_text())["results"]["variants"]
    assert set(variants) == {"zero3", "native_fsdp", "zero3_zeropp"}
    # the network devices' count: ZeRO++ sends a fraction of zero3's bytes out of each host
    assert variants["zero3_zeropp"]["host_tx_bytes_per_step"] < 0.5 * variants["zero3"]["host_tx_bytes_per_step"]
