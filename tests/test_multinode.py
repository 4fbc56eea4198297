"""scripts/multinode_local.sh: 2 emulated hosts (network namespaces, own IPs, a bridge) x 2 ranks,
torchrun's c10d rendezvous across them; every rank ends equal to a 4-rank single-host run (ddp,
zero2: bitwise); hybrid sharding (hsdp2, hsdp3) and hierarchical all_reduce, their shard groups
found from the host layout, end within 1e-6 of ddp."""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from train_cases import PYTHON, ROOT

SCRIPT = ROOT / "scripts" / "multinode_local.sh"


def namespaces_available() -> str | None:
    """None when network namespaces can be created here, else why not."""
    if os.geteuid() != 0:
        return "not root: creating network namespaces needs root"
    name = f"mdprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name])
    return None


@pytest.mark.slow(stand_in="test_hsdp.py::test_hybrid_strategies_equal_ddp")  # root-only emulated hosts; make test: the same meshes on one host
@pytest.mark.timeout(600)  # the script bounds each of its 2 sweeps by TIMEOUT_S
def test_two_emulated_hosts_train_like_one(tmp_path):
    reason = namespaces_available()
    if reason:
        pytest.skip(reason)
    prefix = "mdt"  # names of our own; a run killed half-way is cleaned up by the next one
    env = {**os.environ, "OUT": str(tmp_path), "PREFIX": prefix, "PYTHON": PYTHON, "TIMEOUT_S": "240",
           "STRATEGIES": "ddp zero2 zero3 hsdp2 hsdp3 ddp_hierarchical", "TWINS": "ddp zero2"}
    out = subprocess.run(["bash", str(SCRIPT), "trainer.max_steps=8", "trainer.micro_batch_size=4",
                          "trainer.eval_batches=1", "trainer.ckpt_every=0", "trainer.log_every=4",
                          "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
                          "data.max_bytes=200000"], env=env, capture_output=True, text=True, timeout=560)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for strategy in ("ddp", "zero2"):
        assert f"{strategy}: 4 ranks on emulated hosts" in out.stdout
    assert out.stdout.count("every rank identical and equal to the single-host run") == 2, out.stdout
    # hsdp2, hsdp3, ddp_hierarchical: one shard group per host, found by the mesh from the host layout
    assert (tmp_path / "multi.host1.log").read_text().count("Mesh(replicate=2 x shard=2)") == 3
    # Every strategy against ddp on one host, within the tolerance the script derived from ddp
    # summed in another order (TOLERANCE=auto)
    assert "multinode_local: tolerance 4 x " in out.stdout, out.stdout[-3000:]
    for name in ("zero2", "zero3", "hsdp2", "hsdp3", "ddp_hierarchical"):
        assert f"{name} on emulated hosts vs ddp on one host: largest relative difference" in out.stdout
        assert "(within " in out.stdout.split(f"{name} on emulated hosts vs ddp")[1].splitlines()[0], out.stdout
    # Bytes between the hosts, as the kernel's veth counters saw them, within the bound the script
    # derives (the ring model's payload, plus headers and ACKs per packet, plus 16 KiB per step).
    for name in ("ddp", "zero2", "zero3", "hsdp2", "hsdp3", "ddp_hierarchical"):
        line = next((l for l in out.stdout.splitlines() if l.startswith(f"{name}: cross-host bytes per step")), "")
        assert "measured" in line and "theory" in line and line.endswith(": within)"), (name, out.stdout[-3000:])
    # Inside a host shared memory, across hosts the network: the hybrid strategies' shard groups (one
    # per host) reduce through shared memory; the flat ones' groups span both hosts: none of theirs.
    for name in ("ddp", "zero2", "zero3", "hsdp2", "hsdp3", "ddp_hierarchical"):
        share = float(out.stdout.split(f"{name}: of the bytes sent, through shared memory (a host's own groups): ")[1]
                      .split("%")[0])
        assert (share > 0) == name.startswith(("hsdp", "ddp_hier")), (name, share)
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{prefix}h1" not in listing and f"{prefix}h2" not in listing  # cleaned up


@pytest.mark.parametrize("script", ["multinode_local.sh", "validate_sim.sh"])
def test_without_root_it_says_so(script):
    # As user nobody when we are root. The script goes in on stdin: nobody may not be allowed
    # to read the checkout (a clone in a private temporary folder).
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    made = lambda: set(Path("/tmp").glob("minidist-multinode.*")) | set(Path("/tmp").glob("minidist-validate-sim.*"))  # noqa: E731
    before = made()
    out = subprocess.run([*as_nobody, "bash", "-s"], input=(ROOT / "scripts" / script).read_text(), cwd="/",
                         env={**os.environ}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    assert f"{script.removesuffix('.sh')}: cannot create network namespaces here (needs root" in out.stderr
    assert made() == before  # a refusal leaves no output folder behind


def test_without_a_python_it_says_run_make_setup(tmp_path):
    """A clone where `make` has not run and no python3 on PATH has torch: one line, exit 2."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    out = subprocess.run(["/bin/bash", "-c", ". scripts/lib/python.sh; echo chose $PYTHON"], cwd=tmp_path,
                         env={"PATH": "/nonexistent"}, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "run 'make setup' first" in out.stderr and not out.stdout, out
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(sys.executable)
    out = subprocess.run(["/bin/bash", "-c", ". scripts/lib/python.sh; echo chose $PYTHON"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "chose .venv/bin/python", out


ELASTIC = ROOT / "scripts" / "elastic_local.sh"


@pytest.mark.slow(stand_in="test_elastic_check.py::test_the_final_history_takes_each_steps_last_attempt_and_its_ranks")
@pytest.mark.timeout(900)
def test_a_lost_host_is_left_within_seconds_and_a_returning_one_rejoins(tmp_path):
    """2 hosts x 2 ranks, zero2, under torchrun --nnodes 1:2: host 2 loses its link (then its
    processes) after step 25; the survivors' heartbeat notices within launcher.peer_timeout_s,
    torchrun re-forms the group at 2 ranks, which resumes from step 20 with the same global batch;
    host 2 comes back and the group restarts at 4 ranks. The final model and every step's sample
    ids equal a run switched by hand at the same checkpoints (bitwise, here)."""
    reason = namespaces_available()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "OUT": str(tmp_path), "PREFIX": "mde", "PYTHON": PYTHON, "TIMEOUT_S": "300",
           "STEPS": "80"}
    out = subprocess.run(["bash", str(ELASTIC), "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
                          "model.block_size=32", "data.max_bytes=200000", "trainer.micro_batch_size=4"],
                         env=env, capture_output=True, text=True, timeout=880)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "elastic.json").read_text())
    assert result["world_sizes"] == [4, 2, 4] and result["resumed_at_steps"][0] == 20, result
    assert result["final_step"] == 80 and result["final_world_size"] == 4, result
    assert result["samples_identical"] and result["largest_relative_difference"] <= 1e-5, result
    # Bounded: the heartbeat (5 s), the rendezvous' last call (5 s), and starting the ranks; far
    # under the 300 s a collective would have waited (launcher.timeout_s).
    assert result["seconds_loss_to_first_step"] < 120, result
    assert "PeerLost: rank 2 sent no heartbeat" in (tmp_path / "elastic.host1.log").read_text() or \
        "PeerLost: rank 3 sent no heartbeat" in (tmp_path / "elastic.host1.log").read_text()
