"""Checkpoints that do not stop training (issue 28, part 3): trainer.checkpoint_async=true writes
each checkpoint in the background. The checkpoints are the synchronous path's, file for file; a
run with them resumes exactly; a kill -9 during a background write leaves the previous complete
checkpoint, which trainer.resume=auto picks; summary.json says how long training was blocked."""

import json
import os
import socket
import subprocess
import threading
import time
import types
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

import pytest
import torch

from minidist.train import async_checkpoint
from minidist.train.async_checkpoint import AsyncCheckpoints, Staging, message, parsed, unstaged
from minidist.train.checkpoint import list_checkpoints
from minidist.train.checkpoint_safety import describe_files, file_digest
from minidist.train.checkpoint_safety import save_tensors
from train_cases import PYTHON, RECIPE, ROOT, assert_same, load_everything, tiny, tiny_overrides, train_on_rank

ASYNC = ("trainer.checkpoint_async=true", "trainer.ckpt_every=5", "trainer.keep_last=10")
SHORT = ("trainer.max_steps=6", "trainer.ckpt_every=2", "trainer.keep_last=10")  # two checkpoints mid-run, and the last


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("zero3", marks=pytest.mark.slow(
    stand_in="test_background_checkpoints_equal_the_synchronous_ones_and_resume_exactly[ddp]"))])
def test_background_checkpoints_equal_the_synchronous_ones_and_resume_exactly(ranks, tmp_path, strategy):
    pool = ranks(2)
    sync = pool.run(train_on_rank, tiny(*SHORT, strategy=strategy), str(tmp_path / "sync"), timeout_s=240)
    background = pool.run(train_on_rank, tiny("trainer.checkpoint_async=true", *SHORT, strategy=strategy), str(tmp_path / "async"),
                          timeout_s=240)
    names = [c.name for c in list_checkpoints(tmp_path / "sync")]
    assert names == [c.name for c in list_checkpoints(tmp_path / "async")] == \
        ["step_00000002", "step_00000004", "step_00000006"]
    for name in names:  # every file, bitwise (meta.pt's config differs in checkpoint_async alone)
        a, b = (load_everything(tmp_path / d / "checkpoints" / name) for d in ("sync", "async"))
        assert_same(a, b, f"{strategy} {name}")
    assert sync[0]["train/loss"] == background[0]["train/loss"]
    summary = json.loads((tmp_path / "async" / "summary.json").read_text())
    assert summary["checkpoint/write_s"] > 0 and summary["checkpoint/blocked_s"] >= 0
    # resumed from a background checkpoint: what an uninterrupted run gives
    resumed = pool.run(train_on_rank, tiny("trainer.checkpoint_async=true", *SHORT, strategy=strategy), str(tmp_path / "resumed"),
                       str(tmp_path / "async" / "checkpoints" / "step_00000004"), timeout_s=240)
    assert resumed[0]["train/loss"] == sync[0]["train/loss"]
    assert_same(resumed[0]["full_state"], sync[0]["full_state"], strategy)


@pytest.mark.slow(stand_in="test_train_recipe.py::test_a_kill_while_saving_leaves_no_checkpoint_that_looks_complete")
def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint(tmp_path):
    """Rank 1 SIGKILLs itself once its writer process has written its files of step 10, before
    the commit: step 10 stays a .tmp folder, no writer is left running (each dies with its rank);
    the next start removes the folder and resumes from step 5."""
    import psutil

    writers = lambda: {p.pid for p in psutil.process_iter(["cmdline"])  # noqa: E731
                       if "minidist.train.async_checkpoint" in (p.info["cmdline"] or [])}
    before = writers()
    run_dir = tmp_path / "run"
    args = [PYTHON, str(RECIPE), "launcher.nproc=2",
            *tiny_overrides(*ASYNC, "debug.kill_rank=1", "debug.kill_at_step=10", "debug.kill_during=save",
                            f"hydra.run.dir={run_dir}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode != 0, out.stderr[-2000:]
    assert [c.name for c in list_checkpoints(run_dir)] == ["step_00000005"], out.stderr[-2000:]
    assert writers() <= before
    again = subprocess.run([PYTHON, str(RECIPE), "launcher.nproc=2", *tiny_overrides(*ASYNC, f"hydra.run.dir={run_dir}")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    log = (run_dir / "logs" / "rank_0.log").read_text()
    assert "removed .step_00000010.tmp" in log and f"resumed from {run_dir / 'checkpoints' / 'step_00000005'}" in log
    assert [c.name for c in list_checkpoints(run_dir)][-1] == "step_00000020"


@pytest.mark.slow(stand_in="test_background_checkpoints_equal_the_synchronous_ones_and_resume_exactly[ddp]")
def test_a_writer_that_dies_stops_every_rank_in_one_line_naming_it(tmp_path):
    """Rank 1's writer process killed: the next checkpoint fails on every rank alike, rank 0's
    line names the writer, and nothing half-written is left looking like a checkpoint."""
    import psutil

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([PYTHON, str(RECIPE), "launcher.nproc=2", *tiny_overrides(
        *ASYNC, "debug.step_delay_s=0.05", f"hydra.run.dir={run_dir}")], cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writer = None
    for _ in range(600):  # the writers start with the ranks
        try:
            writer = next((p for p in psutil.Process(proc.pid).children(recursive=True)
                           if "minidist.train.async_checkpoint" in p.cmdline() and p.cmdline()[-1] == "1"), None)
        except psutil.NoSuchProcess:  # a child that came and went
            continue
        if writer is not None:
            break
        time.sleep(0.1)
    assert writer is not None, "rank 1's writer never started"
    writer.kill()
    _, err = proc.communicate(timeout=240)
    said = err.strip().splitlines()
    assert proc.returncode == 1 and len(said) == 1, err[-3000:]
    assert f"rank 1's checkpoint writer (pid {writer.pid}) exited (-9)" in said[0] and "step 5: " in said[0], said[0]
    assert list_checkpoints(run_dir) == [] and not list((run_dir / "checkpoints").glob(".step_*"))


def test_the_state_is_staged_once_into_a_reused_buffer_and_the_writer_reads_it_back():
    live = {"model.pt": {"w": torch.randn(4, 3), "b": torch.randn(3, dtype=torch.float64), "none": torch.empty(0, 2)},
            "meta.pt": {"step": 5, "rng": (3, (1, 2), None), "shape": torch.Size([4, 3])}}
    staging = Staging()
    tensors, skeleton, fresh = staging.stage(live)
    assert fresh and os.fstat(staging.fd).st_size == staging.size  # a new buffer, for the writer to map
    before = {k: v.clone() for k, v in live["model.pt"].items()}
    live["model.pt"]["w"].add_(1.0)  # training goes on: the staged copy does not move
    back = unstaged(staging.buffer, tensors, skeleton)
    assert all(torch.equal(back["model.pt"][k], before[k]) and back["model.pt"][k].dtype == before[k].dtype
               for k in before)
    assert back["meta.pt"] == live["meta.pt"] and isinstance(back["meta.pt"]["rng"], tuple)
    address = back["model.pt"]["w"].data_ptr()
    tensors, skeleton, fresh = staging.stage({**live, "meta.pt": {"step": 10}})
    assert not fresh  # the same sizes: the same buffer, copied into again
    again = unstaged(staging.buffer, tensors, skeleton)
    assert again["model.pt"]["w"].data_ptr() == address and torch.equal(again["model.pt"]["w"], live["model.pt"]["w"])
    grown = {"model.pt": {"w": torch.randn(50, 3)}}
    tensors, skeleton, fresh = staging.stage(grown)  # more than fits: a fresh buffer, never a wrong copy
    assert fresh and torch.equal(unstaged(staging.buffer, tensors, skeleton)["model.pt"]["w"], grown["model.pt"]["w"])
    staging.close()


class SlowWriter:
    """A stand-in writer process (a thread on the other end of the socket): every write takes
    WRITE_S, every other request none."""

    WRITE_S = 0.4
    pid = 0

    def __init__(self):
        ours, theirs = socket.socketpair()
        self.conn, self._theirs = Connection(ours.detach()), Connection(theirs.detach())
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                header, _ = parsed(self._theirs.recv_bytes())
            except (EOFError, OSError):
                return
            if header["op"] == "buffer":
                os.close(recv_handle(self._theirs))
                continue
            time.sleep(self.WRITE_S if header["op"] == "write" else 0)
            reply = {"write": "written", "commit": "committed"}.get(header["op"], "removed")
            self._theirs.send_bytes(message({"op": reply, "seconds": 0.0}))

    def poll(self):
        return None

    def kill(self):
        self._theirs.close()

    def wait(self, timeout=None):
        return 0


def test_a_save_that_waits_for_the_checkpoint_in_flight_counts_that_wait_once(tmp_path, monkeypatch):
    """checkpoint/blocked_s: a save's wait for the previous checkpoint is training blocked, once
    (it was counted twice: by the wait, then by the save around it)."""
    monkeypatch.setattr(async_checkpoint, "begin_save", lambda run_dir, step, strategy: tmp_path / f"{step}.tmp")
    monkeypatch.setattr(async_checkpoint, "collect_files", lambda strategy, step, meta: {"x.pt": torch.ones(8)})
    monkeypatch.setattr(async_checkpoint.comm, "max_over_ranks", lambda value, group=None: value)  # one rank
    writer = SlowWriter()
    strategy = types.SimpleNamespace(ctx=types.SimpleNamespace(rank=0, world_size=1))
    checkpoints = AsyncCheckpoints(tmp_path, strategy, writer=(writer, writer.conn))
    start = time.perf_counter()
    checkpoints.save(1, {})
    checkpoints.save(2, {})  # the first still being written: waits for it
    took = time.perf_counter() - start
    assert took >= SlowWriter.WRITE_S and checkpoints.blocked_s <= took
    assert checkpoints.wait(training=False)[0] == 2
    checkpoints.close()


def test_the_manifest_entry_hashed_while_writing_is_the_files(tmp_path):
    entry = save_tensors({"w": torch.randn(1000), "n": 3}, tmp_path / "x.pt")
    assert entry == {"bytes": (tmp_path / "x.pt").stat().st_size, "sha256": file_digest(tmp_path / "x.pt")}
    (tmp_path / "other.pt").write_bytes(b"written by a library itself")
    wrong_size = {"other.pt": {"bytes": 1, "sha256": "0" * 64}}  # an entry that does not fit is not trusted
    described = describe_files(tmp_path, {"x.pt": entry, **wrong_size})
    assert described == {"x.pt": entry, "other.pt": {"bytes": 27, "sha256": file_digest(tmp_path / "other.pt")}}


def test_background_pruning_keeps_the_newest_and_leaves_nothing_behind(ranks, tmp_path):
    ranks(2).run(train_on_rank, tiny("trainer.checkpoint_async=true", "trainer.ckpt_every=5", "trainer.keep_last=2"),
                 str(tmp_path), timeout_s=240)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_00000015", "step_00000020"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000015", "step_00000020"]
