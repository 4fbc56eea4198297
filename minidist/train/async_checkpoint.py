"""Checkpoints that do not stop training (trainer.checkpoint_async=true).

    checkpoints = AsyncCheckpoints(run_dir, strategy)
    checkpoints.save(step, meta)      # collect, copy aside, write in the background
    checkpoints.poll()                # after every step, on every rank: commit once all have written
    checkpoints.wait()                # a stop, the end of the run: the write in flight, committed

The three phases and the guarantees kept: docs/internals.md, "train/async_checkpoint.py".
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from minidist import comm
from minidist.train.checkpoint import (_write_error, begin_save, checkpoint_folders, collect_files, commit_save, prune,
                                       sync_to_disk)
from minidist.train.checkpoint_layouts import write_files


def copied_aside(files: dict, pinned: bool, reuse: dict | None = None) -> dict:
    """Every tensor of `files` copied to CPU memory of its own (pinned: for a GPU's copies).
    `reuse`: the previous checkpoint's copies, written and no longer needed; where they have
    the same structure, shapes and dtypes (every checkpoint of a run but the first), the
    tensors are copied into them: no allocation, no fresh pages to fault in."""
    leaves, spec = tree_flatten(files)
    old, old_spec = tree_flatten(reuse) if reuse is not None else ([], None)
    same = old_spec == spec and all(
        not torch.is_tensor(a) or (torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype)
        for a, b in zip(leaves, old))

    def copy(t, into):
        if not torch.is_tensor(t):
            return t
        if same:
            return into.copy_(t.detach())
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) if pinned else torch.empty_like(t, device="cpu")
        return out.copy_(t.detach())
    return tree_unflatten([copy(t, into) for t, into in zip(leaves, old if same else leaves)], spec)


class AsyncCheckpoints:
    """One checkpoint write at a time in a background thread; how: docs/internals.md, "train/async_checkpoint.py"."""

    def __init__(self, run_dir: Path, strategy):
        self.run_dir, self.strategy = Path(run_dir), strategy
        self.blocked_s = 0.0   # training time spent in save / poll / wait (the end of the run's wait: none)
        self.write_s = 0.0     # the background writer's time
        self._step: int | None = None   # the step whose write is in flight
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._written: dict[str, dict] = {}   # the files written, their manifest entries
        self._copies: dict | None = None        # the last write's copies: the next one's memory
        self._pruning: threading.Thread | None = None   # rank 0: deleting the checkpoints beyond keep_last

    def save(self, step: int, meta: dict, before_commit: Callable[[], None] | None = None) -> Path:
        """Start the checkpoint of `step` (after finishing the one in flight). A collective.
        Returns the folder it will be once committed."""
        start = time.perf_counter()
        self.wait()
        tmp = begin_save(self.run_dir, step, self.strategy)
        files = copied_aside(collect_files(self.strategy, step, meta), self.strategy.ctx.device.type == "cuda",
                             reuse=self._copies)
        self._copies = files
        self._step, self._error, self._written = step, None, {}
        self._thread = threading.Thread(target=self._write, args=(tmp, files, before_commit),
                                        name=f"minidist-checkpoint-{step}", daemon=True)
        self._thread.start()
        self.blocked_s += time.perf_counter() - start
        return checkpoint_folders(self.run_dir, step)[0]

    def _write(self, tmp: Path, files: dict, before_commit) -> None:
        start = time.perf_counter()
        try:
            self._written = write_files(tmp, files)
            sync_to_disk(tmp)
            if before_commit is not None:
                before_commit()  # fault injection (debug.kill_during=save): a kill mid background write
        except BaseException as e:  # noqa: BLE001 - agreed on and raised by the commit, in the training thread
            self._error = e
        finally:
            self.write_s += time.perf_counter() - start

    def poll(self) -> tuple[int, Path] | None:
        """After a step, on every rank: commit the write in flight if every rank's is done ((its
        step, its folder) returned), else nothing. One 8-byte all_reduce while a write is in flight."""
        if self._step is None:
            return None
        start = time.perf_counter()
        busy = 1.0 if self._thread.is_alive() else 0.0
        try:
            if comm.max_over_ranks(busy) > 0:
                return None
            return self._commit()
        finally:
            self.blocked_s += time.perf_counter() - start

    def wait(self, training: bool = True) -> tuple[int, Path] | None:
        """Finish and commit the write in flight ((its step, its folder); None if there is none).
        A collective. `training=False` (the end of the run): the wait blocks no training."""
        start, done = time.perf_counter(), None
        try:
            if self._step is not None:
                self._thread.join()
                done = self._commit()
            if self._pruning is not None:  # rank 0: no checkpoint beyond keep_last left behind
                self._pruning.join()
                self._pruning = None
            return done
        finally:
            if training:
                self.blocked_s += time.perf_counter() - start

    def _commit(self) -> tuple[int, Path]:
        step, error = self._step, self._error
        self._step = self._thread = self._error = None
        if error is not None and not _write_error(error):
            raise error
        return step, commit_save(self.run_dir, step, self.strategy, error, self._written)

    def prune(self, keep_last: int) -> None:
        """Rank 0: the checkpoints beyond the newest `keep_last`, deleted while training goes on."""
        if self.strategy.ctx.rank != 0 or (self._pruning is not None and self._pruning.is_alive()):
            return
        doomed = prune(self.run_dir, keep_last, later=True)
        if doomed:
            self._pruning = threading.Thread(target=lambda: [shutil.rmtree(d, ignore_errors=True) for d in doomed],
                                             name="minidist-checkpoint-prune", daemon=True)
            self._pruning.start()
