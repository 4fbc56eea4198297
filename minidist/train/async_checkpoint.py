"""Checkpoints that do not stop training (trainer.checkpoint_async=true).

    checkpoints = AsyncCheckpoints(run_dir, strategy)   # starts this rank's writer process
    checkpoints.save(step, meta)   # the state copied once into shared memory; the writer takes it from there
    checkpoints.poll()             # after every step: one 8-byte agreement while a checkpoint is in flight
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
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from minidist import comm
from minidist.dist import get_logger
from minidist.train.checkpoint import (_write_error, begin_save, checkpoint_folders, collect_files, fail_save,
                                       finish_folder, prune, sync_to_disk)
from minidist.train.checkpoint_layouts import write_files

ALIGN = 64  # each staged tensor starts on a cache line


class Staging:
    """The checkpoint's tensors, copied once into shared memory (an anonymous memfd: nothing to
    leave behind in /dev/shm) that the writer process maps too. Reused by every checkpoint that
    fits in it; one that needs more gets a fresh buffer, pre-faulted (MAP_POPULATE) so that the
    copy does not pay a page fault per page."""

    def __init__(self):
        self.fd, self.size, self.buffer = -1, 0, None

    def stage(self, files: dict) -> tuple[list, bytes, int | None]:
        """Copy every tensor of `files` into the buffer. Returns (each tensor's [dtype, shape,
        offset], `files` with every tensor a placeholder, torch.saved, and the fd of a new buffer
        for the writer to map, or None)."""
        leaves, spec = tree_flatten(files)
        tensors, offset = [], 0
        for t in leaves:
            if torch.is_tensor(t):
                tensors.append([str(t.dtype).removeprefix("torch."), list(t.shape), offset])
                offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        fresh = self._grow(offset) if offset > self.size else None
        for t, (dtype, shape, at) in zip((t for t in leaves if torch.is_tensor(t)), tensors):
            if t.numel():
                staged_view(self.buffer, dtype, shape, at).copy_(t.detach())
        skeleton = io.BytesIO()
        torch.save(tree_unflatten([torch.empty(0) if torch.is_tensor(t) else t for t in leaves], spec), skeleton)
        return tensors, skeleton.getvalue(), fresh

    def _grow(self, size: int) -> int:
        self.close()
        self.fd = os.memfd_create("minidist-checkpoint-staging", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.size, self.buffer = size, mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        return self.fd

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
            os.close(self.fd)
            self.fd, self.size, self.buffer = -1, 0, None


def staged_view(buffer, dtype: str, shape: list, offset: int) -> torch.Tensor:
    """The tensor at `offset` of a staging buffer (no copy; its own storage, so torch.save writes it alone)."""
    dtype_ = getattr(torch, dtype)
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype_)
    return torch.frombuffer(buffer, dtype=dtype_, count=math.prod(shape), offset=offset).view(shape)


# -- the wire between a rank and its writer: a JSON header and bytes, an fd passed alongside

def send(sock: socket.socket, header: dict, payload: bytes = b"", fd: int | None = None) -> None:
    head = json.dumps(header).encode()
    prefix = struct.pack("<QQ", len(head), len(payload))
    if fd is None:
        sock.sendall(prefix)
    else:
        socket.send_fds(sock, [prefix], [fd])
    sock.sendall(head + payload)


def receive(sock: socket.socket) -> tuple[dict, bytes, list[int]] | None:
    """The next message (header, payload, fds passed), or None at the end of the stream."""
    prefix, fds, _, _ = socket.recv_fds(sock, 16, 1)
    if not prefix:
        return None
    n_head, n_payload = struct.unpack("<QQ", prefix + exactly(sock, 16 - len(prefix)))
    return json.loads(exactly(sock, n_head)), exactly(sock, n_payload), fds


def exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed mid-message")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def failure(e: BaseException) -> dict:
    """An exception, as the writer reports it."""
    return {"type": type(e).__name__, "text": str(e), "errno": getattr(e, "errno", None),
            "strerror": getattr(e, "strerror", None), "filename": getattr(e, "filename", None),
            "write": _write_error(e), "traceback": traceback.format_exc()}


def rebuilt(error: dict) -> BaseException:
    """The writer's exception, in the training process: a write error as the OS said it (the
    line a failed save prints), anything else with the writer's traceback."""
    if error["write"] and error["errno"] is not None:
        return OSError(error["errno"], error["strerror"], error["filename"])
    if error["write"]:
        return RuntimeError(error["text"])
    return RuntimeError(f"the checkpoint writer failed: {error['traceback']}")


# -- this rank's side


@dataclass
class Flight:
    """The checkpoint in flight: writing (every rank's writer), then committing (rank 0's)."""

    step: int
    before_commit: Callable[[], None] | None
    phase: str = "writing"
    done: bool = False                   # this rank's part of the phase
    error: BaseException | None = None   # what it failed with


class AsyncCheckpoints:
    """One checkpoint in flight at a time, written and committed by this rank's writer process;
    how: docs/internals.md, "train/async_checkpoint.py"."""

    def __init__(self, run_dir: Path, strategy):
        self.run_dir, self.strategy, self.rank = Path(run_dir), strategy, strategy.ctx.rank
        self.blocked_s = 0.0   # training time spent in save / poll / wait (the end of the run's wait: none)
        self.write_s = 0.0     # the writer's time, writing and committing
        self._flight: Flight | None = None
        self._removals = 0     # rank 0: pruned checkpoints the writer is still deleting
        self._staging = Staging()
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        import minidist  # the writer imports the same minidist, wherever this one came from
        where = str(Path(minidist.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([where, *filter(None, [os.environ.get("PYTHONPATH")])]),
               "OMP_NUM_THREADS": "1"}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "minidist.train.async_checkpoint", str(child.fileno()), str(os.getpid()),
             str(self.rank)], pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)  # a Ctrl-C to the job reaches the ranks, which stop it in order
        child.close()

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    def save(self, step: int, meta: dict, before_commit: Callable[[], None] | None = None) -> Path:
        """Start the checkpoint of `step` (after finishing the one in flight). A collective: the
        folder agreed on, then this rank's state copied once; the writer does the rest.
        `before_commit()` runs on each rank once its writer has written its files (fault
        injection: debug.kill_during=save). Returns the folder it will be once committed."""
        start = time.perf_counter()
        self.wait()
        tmp = begin_save(self.run_dir, step, self.strategy)
        tensors, skeleton, fd = self._staging.stage(collect_files(self.strategy, step, meta))
        self._flight = Flight(step, before_commit)
        if fd is not None:
            self._send({"op": "buffer", "size": self._staging.size}, fd=fd)
        self._send({"op": "write", "dir": str(tmp), "tensors": tensors}, skeleton)
        self.blocked_s += time.perf_counter() - start
        return checkpoint_folders(self.run_dir, step)[0]

    def poll(self) -> tuple[int, Path] | None:
        """After a step, on every rank: the checkpoint in flight moved on where every rank's part
        of it is done; (its step, its folder) once committed, else None. One 8-byte all_reduce
        while a checkpoint is in flight; nothing otherwise."""
        if self._flight is None:
            return None
        start = time.perf_counter()
        try:
            self._settle(block=False)
            return self._agree()
        finally:
            self.blocked_s += time.perf_counter() - start

    def wait(self, training: bool = True) -> tuple[int, Path] | None:
        """Finish and commit the checkpoint in flight ((its step, its folder); None if there is
        none). A collective. `training=False` (the end of the run): the wait blocks no training."""
        start, done = time.perf_counter(), None
        try:
            while self._flight is not None:
                self._settle(block=True)
                done = self._agree()  # every rank's part done: never "busy"
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
        self._sock.close()
        self._proc.kill()
        self._proc.wait()
        self._staging.close()

    def _send(self, header: dict, payload: bytes = b"", fd: int | None = None) -> bool:
        try:
            send(self._sock, header, payload, fd)
            return True
        except OSError:
            self._gone()
            return False

    def _gone(self) -> None:
        """The writer exited: the checkpoint in flight fails with that (and with no flight, the next one)."""
        said = f"rank {self.rank}'s checkpoint writer (pid {self._proc.pid}) exited ({self._proc.wait(timeout=30)})"
        self._removals = 0
        if self._flight is None:
            raise RuntimeError(said)
        self._flight.done, self._flight.error = True, RuntimeError(f"{said} during the checkpoint of step "
                                                                   f"{self._flight.step}")

    def _settle(self, block: bool) -> None:
        """Take the writer's replies; with `block`, until this rank's part of the flight (or of
        the removals) is done. A writer that died is this flight's failure."""
        f = self._flight
        while True:
            busy = (f is not None and not f.done) or (f is None and self._removals)
            if not select.select([self._sock], [], [], 1.0 if block and busy else 0)[0]:
                if not (block and busy):
                    return
                if self._proc.poll() is None:
                    continue
            try:
                message = receive(self._sock)
            except (EOFError, OSError):
                message = None
            if message is None:  # the writer is gone (killed, out of memory): this flight fails
                self._gone()
                return
            reply = message[0]
            self.write_s += reply.get("seconds", 0.0)
            if reply["op"] == "removed":
                self._removals -= 1
                continue
            f.done, f.error = True, rebuilt(reply["error"]) if reply.get("error") else None
            if reply.get("note"):
                get_logger().info(reply["note"])
            if reply["op"] == "written" and f.error is None and f.before_commit is not None:
                f.before_commit()

    def _agree(self) -> tuple[int, Path] | None:
        """Every rank's state of the flight, agreed (max: 0 done, 1 busy, 2 failed), and acted on."""
        f = self._flight
        agreed = comm.max_over_ranks(2.0 if f.error is not None else 0.0 if f.done else 1.0)
        if agreed == 1.0:
            return None
        if agreed == 2.0:
            self._settle(block=True)  # this rank's writer done with the folder before it goes
            self._flight = None
            mine = f.error if f.error is not None and _write_error(f.error) else None
            try:
                fail_save(self.run_dir, f.step, self.strategy, mine)
            except Exception:
                if f.error is not None and mine is None:  # a bug, not a full disk: its own traceback
                    raise f.error from None
                raise
        final, tmp = checkpoint_folders(self.run_dir, f.step)
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


def unstaged(buffer, tensors: list, skeleton: bytes) -> dict:
    """What Staging.stage staged, rebuilt over the buffer (the writer's view of it: no copy)."""
    leaves, spec = tree_flatten(torch.load(io.BytesIO(skeleton), weights_only=True))
    staged = iter(tensors)
    return tree_unflatten([staged_view(buffer, *next(staged)) if torch.is_tensor(x) else x for x in leaves], spec)


def write(buffer, header: dict, skeleton: bytes, rank: int) -> None:
    """This rank's files, from the staging buffer: written, hashed, fsynced; their entries left for the commit."""
    tmp = Path(header["dir"])
    entries = write_files(tmp, unstaged(buffer, header["tensors"], skeleton))
    sync_to_disk(tmp)
    written_path(tmp, rank).write_text(json.dumps(entries))


def commit(header: dict) -> str | None:
    """Rank 0's writer, once every rank's files are written: the manifest from their entries, the rename."""
    tmp, entries = Path(header["dir"]), {}
    for r in range(header["ranks"]):
        entries.update(json.loads(written_path(tmp, r).read_text()))
        written_path(tmp, r).unlink()
    return finish_folder(tmp, Path(header["final"]), entries)


def writer_main(fd: int, parent: int, rank: int) -> None:
    """The writer: one request at a time from its rank, on the CPU time training leaves idle."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a rank killed takes its writer with it
    if os.getppid() != parent:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a stop is the rank's to handle
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        os.nice(19)
    sock, buffer = socket.socket(fileno=fd), None
    while (message := receive(sock)) is not None:
        header, payload, fds = message
        op, start, reply = header["op"], time.perf_counter(), {}
        if op == "buffer":
            if buffer is not None:
                buffer.close()
            buffer = mmap.mmap(fds[0], header["size"], flags=mmap.MAP_SHARED)
            os.close(fds[0])
            continue
        try:
            if op == "write":
                write(buffer, header, payload, rank)
                reply = {"op": "written"}
            elif op == "commit":
                reply = {"op": "committed", "note": commit(header)}
            elif op == "remove":
                for path in header["paths"]:
                    shutil.rmtree(path, ignore_errors=True)
                reply = {"op": "removed"}
        except Exception as e:  # noqa: BLE001 - reported to the rank, which stops every rank alike
            reply = {"op": "written" if op == "write" else "committed", "error": failure(e)}
        send(sock, {**reply, "seconds": time.perf_counter() - start})


if __name__ == "__main__":
    writer_main(*map(int, sys.argv[1:4]))
