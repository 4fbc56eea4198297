"""One run per run directory (issue 26, item 7): a second run started in a directory a live run
holds stops at once, in one line naming the live one, having written nothing; a lock left by a
run that died is no obstacle."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from minidist.train.run_files import RunDirectoryInUse, run_directory_lock
from train_cases import tiny_overrides

# Another run's launcher, as the lock sees it: a process holding the flock, its pid recorded
# (plain fcntl, so that it starts in a blink: run_directory_lock takes the same lock).
HOLD = ("import fcntl, json, os, socket, sys, time\n"
        "os.makedirs(sys.argv[1], exist_ok=True)\n"
        "fd = os.open(os.path.join(sys.argv[1], 'run.lock'), os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "os.write(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname(), 'started': time.time()}).encode())\n"
        "print('held', flush=True); time.sleep(120)\n")


@pytest.fixture
def held(tmp_path):
    """A live process holding tmp_path/run's lock."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield tmp_path / "run", proc
    proc.kill()
    proc.wait()


def test_a_held_directory_is_refused_naming_the_holder(held):
    run_dir, proc = held
    with pytest.raises(RunDirectoryInUse, match=rf"is in use by another run \(pid {proc.pid} on {socket.gethostname()}"):
        with run_directory_lock(run_dir):
            pass


def test_a_second_training_run_stops_at_once_in_one_line(held, capsys):
    """Through the recipe's entry (launch), which takes the lock before any rank starts."""
    from minidist.train.app import launch
    from train_cases import compose_cfg

    run_dir, proc = held
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    started = time.monotonic()
    status = launch(compose_cfg(tiny_overrides("trainer.max_steps=2")), run_dir)
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and f"pid {proc.pid}" in lines[0], lines
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before  # nothing written
    assert time.monotonic() - started < 60


def test_the_lock_of_a_run_that_died_is_taken_over(held):
    run_dir, proc = held
    proc.kill()
    proc.wait()
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == proc.pid  # what it left
    with run_directory_lock(run_dir):
        assert json.loads((run_dir / "run.lock").read_text())["pid"] == os.getpid()
