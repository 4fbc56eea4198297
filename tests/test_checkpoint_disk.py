"""A checkpoint that cannot be written (a full disk) stops the run in one line, and the previous
checkpoint stays usable.

The run directory is a small tmpfs (root can mount one), 1.2 MiB: room for the run's files and
the two checkpoints kept (trainer.keep_last=2, 0.45 MiB each), not for a third beside them.
"""

import os
import shutil
import subprocess

import pytest

from minidist.train.checkpoint import list_checkpoints
from train_cases import PYTHON, RECIPE, ROOT, tiny_overrides

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    where = tmp_path / "disk"
    where.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def train(run_dir, *overrides):
    return subprocess.run([PYTHON, str(RECIPE), "launcher.nproc=2",
                           *tiny_overrides("trainer.max_steps=6", "trainer.ckpt_every=2", "trainer.keep_last=2",
                                           *overrides, f"hydra.run.dir={run_dir}", strategy="zero2")],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)


@pytest.mark.slow(stand_in="test_checkpoint_safety.py::test_a_short_write_on_a_nearly_full_disk_is_reported_as_one")  # a real small disk, root only
@pytest.mark.parametrize("way", ["sync", "async"])
def test_a_full_disk_stops_the_run_in_one_line_and_keeps_the_previous_checkpoint(small_disk, way):
    """Synchronous saves, and background ones (the writer process's OSError, the same line)."""
    run_dir = small_disk / "run"
    way = [f"trainer.checkpoint_async={way == 'async'}"]
    out = train(run_dir, *way)
    assert out.returncode == 1, out.stderr[-3000:]
    said = out.stderr.strip().splitlines()
    assert len(said) == 1, out.stderr[-3000:]  # the cause alone: no second "training failed" line after it
    line = said[0]
    for part in ("error: rank 0 stopped after step ", "the checkpoint could not be written to "
                 f"{run_dir / 'checkpoints'}", "[Errno 28] No space left on device", "it needs about ",
                 "MiB are free there", "the previous checkpoint ", "is intact", "trainer.resume=auto"):
        assert part in line, (part, line)
    kept = list_checkpoints(run_dir)
    assert [c.name for c in kept] == ["step_00000002", "step_00000004"] and f"{kept[-1]} is intact" in line
    assert not list((run_dir / "checkpoints").glob(".step_*.tmp"))  # the partial one is gone, its space back
    assert "Traceback" in (run_dir / "logs" / "rank_0.log").read_text()  # the detail, in the log

    # With space again, trainer.resume=auto continues from the checkpoint that was kept.
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    again = train(run_dir, "trainer.resume=auto", *way)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {kept[-1]}" in again.stdout
    assert [c.name for c in list_checkpoints(run_dir)] == ["step_00000004", "step_00000006"]
