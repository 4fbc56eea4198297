"""Checkpoints that do not stop training (trainer.checkpoint_async=true).

    checkpoints = AsyncCheckpoints(run_dir, strategy, keep_last)
    checkpoints.save(step, meta)      # at a checkpoint step: collect, copy aside, write in the background
    checkpoints.poll()                # after every step, on every rank: commit once every rank has written
    checkpoints.wait()                # a stop, the end of the run: the write in flight, finished and committed

A save runs the three phases of checkpoint.save_checkpoint. The first stays in the training
thread, as it communicates: the `.tmp` folder is made, the layout collects this rank's state
(full_state_dict, sharded_state_dict: collectives) and every tensor is copied to CPU memory
(pinned when the model is on a GPU), so training may change the live ones at once. The second,
writing and fsyncing this rank's files, is a background thread's: no communication in it. The
third, the commit (every rank agrees the files are written; rank 0 writes the manifest and
renames the folder), communicates again, so it runs in the training thread, at the first
`poll()` after every rank's writer has finished: each poll is one small all_reduce while a write
is in flight, and nothing otherwise.

At most one write is in flight: the next save, the end of the run and a stop wait for it. A
write that fails surfaces at the poll that commits it, as the same CheckpointWriteFailed line
the synchronous path gives. The guarantee of the synchronous path stays: until the rename, the
checkpoint is a `.tmp` folder no resume looks at, so a kill -9 during a background write leaves
the previous complete checkpoint, which trainer.resume=auto picks.

DeepSpeed's engine writes its own files and communicates while it does: its checkpoints stay
synchronous (said once in the log).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils._pytree import tree_map_only

from minidist import comm
from minidist.train.checkpoint import (_write_error, begin_save, checkpoint_folders, collect_files, commit_save,
                                       sync_to_disk)
from minidist.train.checkpoint_layouts import write_files


def copied_aside(files: dict, pinned: bool) -> dict:
    """Every tensor of `files` copied to CPU memory of its own (pinned: for a GPU's copies)."""
    def copy(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) if pinned else torch.empty_like(t, device="cpu")
        return out.copy_(t.detach())
    return tree_map_only(torch.Tensor, copy, files)


class AsyncCheckpoints:
    """One checkpoint write at a time in a background thread; see the module docstring."""

    def __init__(self, run_dir: Path, strategy, keep_last: int):
        self.run_dir, self.strategy, self.keep_last = Path(run_dir), strategy, keep_last
        self.blocked_s = 0.0   # training time spent in save / poll / wait (the end of the run's wait: none)
        self.write_s = 0.0     # the background writer's time
        self._step: int | None = None   # the step whose write is in flight
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, meta: dict, before_commit: Callable[[], None] | None = None) -> Path:
        """Start the checkpoint of `step` (after finishing the one in flight). A collective.
        Returns the folder it will be once committed."""
        start = time.perf_counter()
        self.wait()
        tmp = begin_save(self.run_dir, step, self.strategy)
        files = copied_aside(collect_files(self.strategy, step, meta), self.strategy.ctx.device.type == "cuda")
        self._step, self._error = step, None
        self._thread = threading.Thread(target=self._write, args=(tmp, files, before_commit),
                                        name=f"minidist-checkpoint-{step}", daemon=True)
        self._thread.start()
        self.blocked_s += time.perf_counter() - start
        return checkpoint_folders(self.run_dir, step)[0]

    def _write(self, tmp: Path, files: dict, before_commit) -> None:
        start = time.perf_counter()
        try:
            write_files(tmp, files)
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
        if self._step is None:
            return None
        start = time.perf_counter()
        try:
            self._thread.join()
            return self._commit()
        finally:
            if training:
                self.blocked_s += time.perf_counter() - start

    def _commit(self) -> tuple[int, Path]:
        step, error = self._step, self._error
        self._step = self._thread = self._error = None
        if error is not None and not _write_error(error):
            raise error
        return step, commit_save(self.run_dir, step, self.strategy, error, self.keep_last)
