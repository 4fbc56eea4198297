"""The primitives tour runs end to end, every step verified, at 2 and 3 ranks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run(cmd, timeout=180):
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_every_step_of_the_tour_verifies_on_the_ranks(ranks):
    """The tour's steps, each checked against what the primitive must give, on 2 ranks (its
    console, and its launch by the recipe and torchrun: the slow test below)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from tutorial.tour import tour_main

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = OmegaConf.to_container(compose(config_name="tour", overrides=["backend=gloo"]), resolve=True)
    assert ranks(2).run(tour_main, cfg, timeout_s=120) == [[], []]  # no step failed its check


@pytest.mark.slow(stand_in="test_every_step_of_the_tour_verifies_on_the_ranks")
@pytest.mark.parametrize("how,nproc", [("python", 2), ("torchrun", 3)])
def test_tour_verifies_every_step(how, nproc):
    if how == "python":
        cmd = [sys.executable, "recipes/tour.py", f"nproc={nproc}"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--standalone", "recipes/tour.py"]
    proc = run(cmd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "14 steps, all verified." in out
    assert out.count(f"verified on all {nproc} ranks") == 14
    assert "FAILED" not in out
    for title in ("send / recv", "isend / irecv", "broadcast", "scatter", "reduce (sum)", "gather",
                  "all_reduce", "all_gather", "reduce_scatter", "ring all_reduce from send/recv, phase 1",
                  "phase 2: all_gather", "asynchronous", "before wait()", "deadlock"):
        assert title in out


@pytest.mark.slow(stand_in="test_every_step_of_the_tour_verifies_on_the_ranks")  # the same tour, 2 ranks
def test_one_rank_runs_the_collectives_and_says_what_it_skipped():
    proc = run([sys.executable, "recipes/tour.py", "nproc=1"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "need 2 ranks and are skipped" in proc.stdout
    assert "9 steps, all verified." in proc.stdout


def test_tour_refuses_zero_ranks_with_a_clear_message():
    from tutorial.tour import main

    saved = sys.argv[:]
    try:
        with pytest.raises(SystemExit, match="need at least 1 rank"):
            main(["nproc=0"])
    finally:
        sys.argv = saved
