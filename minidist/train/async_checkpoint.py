"""Checkpoints that do not stop training (trainer.checkpoint_async=true).

    checkpoints = AsyncCheckpoints(run_dir, strategy)   # starts this rank's writer process
    checkpoints.save(step, meta)   # the state copied once into shared memory; the writer takes it from there
    agreed = comm.max_over_ranks(checkpoints.progress())   # after a step, while one is in flight: the
    checkpoints.advance(agreed)                            # trainer's agreement, beside the stop signals'
    checkpoints.wait()             # a stop, the end of the run: the checkpoint in flight, committed
    checkpoints.close()

The phases, the process and the guarantees kept: docs/internals.md, "train/async_checkpoint.py".
"""

from __future__ import annotations

import ctypes
import io
import json
import math
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from minidist import comm
from minidist.dist import get_logger
from minidist.train.checkpoint import (CheckpointWriteFailed, _write_error, begin_save, checkpoint_folders,
                                       collect_files, fail_save, finish_folder, prune, sync_to_disk)
from minidist.train.checkpoint_layouts import write_files


class Staging:
    """The checkpoint's tensors, copied once into shared memory (an anonymous memfd: nothing to
    leave behind in /dev/shm) that the writer maps too. Reused by every checkpoint that fits;
    one that needs more gets a fresh buffer, pre-faulted (MAP_POPULATE): no page fault per page.
    Staging GPU tensors pins it (cudaHostRegister, as DCP pins its shared memory): their copies
    go by DMA, all in flight at once, and end at one synchronisation."""

    def __init__(self):
        self.fd, self.size, self.buffer, self.pinned = -1, 0, None, False

    def stage(self, files: dict) -> tuple[list, bytes, bool]:
        """Copy every tensor of `files` into the buffer. Returns (each tensor's [dtype, shape,
        offset], `files` torch.saved with every tensor a placeholder, whether the buffer is new)."""
        leaves, spec = tree_flatten(files)
        tensors, end = [t for t in leaves if torch.is_tensor(t)], 0
        where = []
        for t in tensors:
            where.append([str(t.dtype).removeprefix("torch."), list(t.shape), end])
            end += -(-t.numel() * t.element_size() // 64) * 64  # each on a cache line of its own
        fresh = end > self.size
        if fresh:
            self.close()
            self.fd = os.memfd_create("minidist-checkpoint-staging", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, end)
            self.size, self.buffer = end, mmap.mmap(self.fd, end, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        gpus = {t.device for t in tensors if t.is_cuda}
        if gpus and not self.pinned:
            self._pin()
        for t, at in zip(tensors, where):
            staged_view(self.buffer, *at).copy_(t.detach(), non_blocking=self.pinned)
        for device in gpus:
            torch.cuda.synchronize(device)  # every copy landed before the writer reads it
        skeleton = io.BytesIO()
        torch.save(tree_unflatten([torch.empty(0) if torch.is_tensor(t) else t for t in leaves], spec), skeleton)
        return where, skeleton.getvalue(), fresh

    def _pin(self) -> None:
        code = int(torch.cuda.cudart().cudaHostRegister(self._address(), self.size, 1))  # 1: portable
        if code != 0:  # (the runtime keeps the error for the next kernel launch to raise: stop here)
            raise RuntimeError(f"cannot pin the checkpoint staging buffer ({self.size} bytes): CUDA error {code}; "
                               "trainer.checkpoint_async=false writes without it")
        self.pinned = True

    def _address(self) -> int:
        return torch.frombuffer(self.buffer, dtype=torch.uint8, count=1).data_ptr()

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._address())
            self.pinned = False
        if self.buffer is not None:
            self.buffer.close()
            os.close(self.fd)
            self.fd, self.size, self.buffer = -1, 0, None


def staged_view(buffer, dtype: str, shape: list, offset: int) -> torch.Tensor:
    """The tensor at `offset` of a staging buffer: no copy, a storage of its own (torch.save writes it alone)."""
    n, dtype = math.prod(shape), getattr(torch, dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=n, offset=offset).view(shape) if n else torch.empty(shape, dtype=dtype)


def unstaged(buffer, tensors: list, skeleton: bytes) -> dict:
    """What Staging.stage staged, rebuilt over the buffer (the writer's view of it: no copy)."""
    leaves, spec = tree_flatten(torch.load(io.BytesIO(skeleton), weights_only=True))
    staged = iter(tensors)
    return tree_unflatten([staged_view(buffer, *next(staged)) if torch.is_tensor(x) else x for x in leaves], spec)


def message(header: dict, payload: bytes = b"") -> bytes:
    return json.dumps(header).encode() + b"\n" + payload  # (JSON escapes every newline it holds)


def parsed(data: bytes) -> tuple[dict, bytes]:
    head, _, payload = data.partition(b"\n")
    return json.loads(head), payload


def described(e: BaseException) -> dict:
    """The writer's exception, as its rank rebuilds it: an OSError as the OS said it (the line a
    failed save prints), anything else as its text (a bug: with the writer's traceback)."""
    return {"os": [e.errno, e.strerror, e.filename] if isinstance(e, OSError) and e.errno is not None else None,
            "text": str(e) if _write_error(e) else
            f"the checkpoint writer failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"}


def rebuilt(e: dict) -> BaseException:
    return OSError(*e["os"]) if e["os"] else RuntimeError(e["text"])


def start_writer(rank: int) -> tuple[subprocess.Popen, Connection]:
    """Rank `rank`'s writer process and its end of the socket. Start it early: importing torch
    takes it seconds of CPU, best spent beside the run's own start-up (it runs at idle priority
    once its imports are done)."""
    import minidist  # the writer imports the same minidist, wherever this one came from

    ours, theirs = socket.socketpair()
    path = [str(Path(minidist.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "minidist.train.async_checkpoint", str(theirs.fileno()), str(os.getpid()), str(rank)],
        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path)), "OMP_NUM_THREADS": "1"},
        process_group=0)  # not a Ctrl-C's (the ranks stop it in order), yet this session's (its CPU share)
    theirs.close()
    return proc, Connection(ours.detach())


@dataclass
class Flight:
    """The checkpoint in flight: writing (every rank's writer), then committing (rank 0's)."""

    step: int
    before_commit: Callable[[], None] | None
    phase: str = "writing"
    done: bool = False                   # this rank's part of the phase
    error: dict | None = None            # what it failed with, as `described` gives it


class AsyncCheckpoints:
    """One checkpoint in flight at a time, written and committed by this rank's writer process;
    how: docs/internals.md, "train/async_checkpoint.py"."""

    def __init__(self, run_dir: Path, strategy, writer: tuple | None = None):
        """`writer`: what start_writer gave, started early; else one is started now."""
        self.run_dir, self.strategy, self.rank = Path(run_dir), strategy, strategy.ctx.rank
        self.blocked_s = 0.0   # training's time in save, progress, advance, wait (the end of the run's wait: none)
        self.write_s = 0.0     # the writer's time, writing and committing
        self._flight: Flight | None = None
        self._removals = 0     # rank 0: pruned checkpoints the writer is still deleting
        self._staging = Staging()
        self._proc, self._conn = writer or start_writer(self.rank)

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    def save(self, step: int, meta: dict, before_commit: Callable[[], None] | None = None) -> Path:
        """Start the checkpoint of `step` (after finishing the one in flight). A collective: the
        folder agreed on, then this rank's state copied once; the writer does the rest.
        `before_commit()` runs on each rank once its writer has written its files (fault
        injection: debug.kill_during=save). Returns the folder it will be once committed."""
        self.wait()  # the checkpoint in flight, finished: training blocked, counted there
        start = time.perf_counter()
        tmp = begin_save(self.run_dir, step, self.strategy)
        tensors, skeleton, fresh = self._staging.stage(collect_files(self.strategy, step, meta))
        self._flight = Flight(step, before_commit)
        if not fresh or self._send({"op": "buffer", "size": self._staging.size}):
            self._send({"op": "write", "dir": str(tmp), "tensors": tensors}, skeleton)
        self.blocked_s += time.perf_counter() - start
        return checkpoint_folders(self.run_dir, step)[0]

    def progress(self) -> float:
        """This rank's part of the checkpoint in flight, the writer's replies taken (no waiting):
        0 done, 1 busy, 2 failed. The caller's agreement takes every rank's largest, for advance()."""
        start = time.perf_counter()
        self._settle(block=False)
        self.blocked_s += time.perf_counter() - start
        return self._part()

    def advance(self, agreed: float) -> tuple[int, Path] | None:
        """After a step, on every rank, with the largest of every rank's progress() (the trainer
        agrees on it beside the stop signals: no collective of its own): the checkpoint in flight
        moved on where every rank's part of it is done; (its step, its folder) once committed."""
        start = time.perf_counter()
        try:
            return self._agree(agreed)
        finally:
            self.blocked_s += time.perf_counter() - start

    def wait(self, training: bool = True) -> tuple[int, Path] | None:
        """Finish and commit the checkpoint in flight ((its step, its folder); None if there is
        none). A collective. `training=False` (the end of the run): the wait blocks no training."""
        start, done = time.perf_counter(), None
        try:
            while self._flight is not None:
                self._settle(block=True)
                done = self._agree(comm.max_over_ranks(self._part()))  # every rank's part done: never "busy"
            while self._removals:  # rank 0: no checkpoint beyond keep_last left behind
                self._settle(block=True)
            return done
        finally:
            if training:
                self.blocked_s += time.perf_counter() - start

    def prune(self, keep_last: int) -> None:
        """Rank 0: the checkpoints beyond the newest `keep_last`, renamed out of sight now and
        deleted by the writer while training goes on."""
        if self.rank == 0 and (doomed := prune(self.run_dir, keep_last, later=True)):
            self._removals += self._send({"op": "remove", "paths": [str(d) for d in doomed]})

    def close(self) -> None:
        """The writer stopped (a write in flight is abandoned: its `.tmp` folder goes at the next start)."""
        self._conn.close()
        self._proc.kill()
        self._proc.wait()
        self._staging.close()

    def _send(self, header: dict, payload: bytes = b"") -> bool:
        try:
            self._conn.send_bytes(message(header, payload))
            if header["op"] == "buffer":
                send_handle(self._conn, self._staging.fd, self._proc.pid)
            return True
        except OSError:
            self._gone()
            return False

    def _gone(self) -> None:
        """The writer exited (killed, out of memory): the checkpoint in flight fails with that (with
        none in flight, the next one: its request cannot be sent)."""
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # (its end of the socket closed, yet running)
            self._proc.kill()
            code = self._proc.wait()
        self._removals = 0
        if self._flight is not None:
            self._flight.done, self._flight.error = True, {"os": None, "text": (
                f"step {self._flight.step}: the checkpoint was not written: rank {self.rank}'s checkpoint writer "
                f"(pid {self._proc.pid}) exited ({code})")}

    def _settle(self, block: bool) -> None:
        """Take the writer's replies; with `block`, until this rank's part of the flight (or of
        the removals) is done."""
        f = self._flight
        while (busy := (not f.done) if f is not None else self._removals > 0) or self._conn.poll(0):
            if not self._conn.poll(1.0 if block and busy else 0):
                if block and busy and self._proc.poll() is None:
                    continue
                if not (block and busy):
                    return
            try:
                reply, _ = parsed(self._conn.recv_bytes())
            except (EOFError, OSError):
                return self._gone()
            self.write_s += reply["seconds"]
            if reply["op"] == "removed":
                self._removals -= 1
                continue
            f.done, f.error = True, reply.get("error")
            if reply.get("note"):
                get_logger().info(reply["note"])
            if reply["op"] == "written" and f.error is None and f.before_commit is not None:
                f.before_commit()

    def _part(self) -> float:
        f = self._flight
        return 2.0 if f.error is not None else 0.0 if f.done else 1.0

    def _agree(self, agreed: float) -> tuple[int, Path] | None:
        """The flight moved on as every rank's progress, agreed (the largest), says."""
        f = self._flight
        if agreed == 1.0:
            return None
        final, tmp = checkpoint_folders(self.run_dir, f.step)
        if agreed == 2.0:
            self._settle(block=True)  # this rank's writer done with the folder before it goes
            self._flight = None
            first = rebuilt(next(e for e in comm.all_gather_object(f.error) if e))  # every rank says the same
            try:
                fail_save(self.run_dir, f.step, self.strategy, first if _write_error(first) else None)
            except CheckpointWriteFailed:
                if not _write_error(first):  # not the disk: a writer that died, a bug (its traceback, logged)
                    raise CheckpointWriteFailed(str(first)) from None
                raise
        if f.phase == "writing":  # every rank's files are written: rank 0's writer commits
            f.phase, f.done = "committing", self.rank != 0
            if self.rank == 0:
                self._send({"op": "commit", "dir": str(tmp), "final": str(final), "ranks": self.strategy.ctx.world_size})
            return None
        self._flight = None
        return f.step, final


# -- the writer process


def written_path(tmp: Path, rank: int) -> Path:
    """Where rank `rank`'s writer leaves its files' manifest entries for the commit."""
    return Path(tmp) / f".written.rank{rank:05d}.json"


def serve(op: str, header: dict, payload: bytes, buffer, rank: int) -> dict:
    """One request: this rank's files written from the staging buffer, hashed and fsynced, their
    entries left for the commit; the commit (rank 0: the manifest from every rank's entries, the
    rename); or pruned checkpoints deleted."""
    tmp = Path(header.get("dir", "."))
    if op == "write":
        entries = write_files(tmp, unstaged(buffer, header["tensors"], payload))
        sync_to_disk(tmp)
        written_path(tmp, rank).write_text(json.dumps(entries))
        return {"op": "written"}
    if op == "commit":
        entries = {}
        for r in range(header["ranks"]):
            entries.update(json.loads(written_path(tmp, r).read_text()))
            written_path(tmp, r).unlink()
        return {"op": "committed", "note": finish_folder(tmp, Path(header["final"]), entries)}
    for path in header["paths"]:
        shutil.rmtree(path, ignore_errors=True)
    return {"op": "removed"}


def writer_main(fd: int, parent: int, rank: int) -> None:
    """The writer: one request at a time from its rank, on the CPU time training leaves idle."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a rank killed takes its writer with it
    if os.getppid() != parent:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a stop is the rank's to handle
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # training first: it takes the CPU left idle
    conn, buffer = Connection(fd), None
    while True:
        try:
            header, payload = parsed(conn.recv_bytes())
        except EOFError:  # the rank closed its end
            return
        op, start = header["op"], time.perf_counter()
        if op == "buffer":
            buffer = mmap.mmap(handle := recv_handle(conn), header["size"], flags=mmap.MAP_SHARED)
            os.close(handle)
            continue
        try:
            reply = serve(op, header, payload, buffer, rank)
        except Exception as e:  # noqa: BLE001 - reported to the rank, which stops every rank alike
            reply = {"op": "written" if op == "write" else "committed", "error": described(e)}
        conn.send_bytes(message({**reply, "seconds": time.perf_counter() - start}))


if __name__ == "__main__":
    writer_main(*map(int, sys.argv[1:4]))
