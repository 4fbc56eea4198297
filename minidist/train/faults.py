"""Fault injection, to prove recovery: a rank dies, stalls, or produces nan gradients.

    torchrun --max-restarts 2 --nproc_per_node 2 recipes/train.py hydra.run.dir=runs/a \\
        debug.kill_rank=1 debug.kill_at_step=12

Rank `kill_rank` dies by SIGKILL right after optimizer step `kill_at_step` (before that
step's checkpoint, so recovery has work to redo); with debug.kill_during=save, during that
step's checkpoint instead, once its own files are written and before the folder is renamed
(the save must then leave nothing that looks like a checkpoint). Each kill happens once per run directory:
a marker file in <run dir>/faults/ is written (and synced) first, so the group torchrun
restarts resumes from the latest complete checkpoint and runs through. Several kills:
lists of the same length, e.g. debug.kill_rank=[1,3,0] debug.kill_at_step=[120,480,777].

debug.stall_rank / debug.stall_at_step: that rank stops participating before that step (it
sleeps, as a rank stuck in a data loader or a deadlock would); the others must fail after
launcher.timeout_s (minidist/train/collective_failure.py names what they waited for).
debug.nan_rank / debug.nan_at_step: that rank's loss becomes nan at that step.
debug.step_delay_s: every rank sleeps this long before each step (a slow model, without one: so
that a host can be lost, or come back, while the run is still going).

The trainer parses the plan once (FaultPlan) and asks it at each step.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def planned_kills(debug_cfg) -> list[tuple[int, int]]:
    """[(rank, step), ...] from debug.kill_rank / debug.kill_at_step (ints or equal-length lists)."""
    if debug_cfg is None or debug_cfg.get("kill_at_step") is None:
        return []
    steps, ranks = debug_cfg.kill_at_step, debug_cfg.get("kill_rank", 0)
    steps = [int(s) for s in steps] if not isinstance(steps, int) else [steps]
    ranks = [int(r) for r in ranks] if not isinstance(ranks, int) else [ranks] * len(steps)
    if len(ranks) != len(steps):
        raise ValueError(f"debug.kill_rank has {len(ranks)} entries and debug.kill_at_step {len(steps)}: "
                         "give one rank, or one per step")
    return list(zip(ranks, steps))


def marker(run_dir: Path, rank: int, step: int) -> Path:
    return Path(run_dir) / "faults" / f"killed_rank{rank}_step{step}"


def maybe_kill(kills: list[tuple[int, int]], run_dir: Path, rank: int, step: int) -> None:
    """Die now if this (rank, step) is planned and has not happened in this run directory yet."""
    if (rank, step) not in kills:
        return
    path = marker(run_dir, rank, step)
    if path.exists():
        return  # it happened before the restart: run through
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(f"rank {rank} killed itself after step {step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def _rank_and_step(debug_cfg, prefix: str) -> tuple[int, int] | None:
    """(debug.PREFIX_rank, debug.PREFIX_at_step), or None when no step is given."""
    if debug_cfg is None or debug_cfg.get(f"{prefix}_at_step") is None:
        return None
    return int(debug_cfg.get(f"{prefix}_rank", 0)), int(debug_cfg[f"{prefix}_at_step"])


class FaultPlan:
    """The faults the debug config asks for, parsed once."""

    def __init__(self, debug_cfg):
        self.kills = planned_kills(debug_cfg)
        self.kill_during = str(debug_cfg.get("kill_during", "step")) if debug_cfg is not None else "step"
        self.stall = _rank_and_step(debug_cfg, "stall")
        self.nan = _rank_and_step(debug_cfg, "nan")
        self.step_delay_s = float(debug_cfg.get("step_delay_s", 0) or 0) if debug_cfg is not None else 0.0

    def maybe_kill(self, run_dir: Path, rank: int, step: int, during: str = "step") -> None:
        """Die now if planned for this rank and step, `during` the step or its checkpoint's save."""
        if during == self.kill_during:
            maybe_kill(self.kills, run_dir, rank, step)

    def maybe_stall(self, rank: int, step: int) -> None:
        """Stop participating, for good, if this rank is to stall before this step (and sleep
        debug.step_delay_s before every step)."""
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        if self.stall == (rank, step):
            while True:  # until the launcher stops the job
                time.sleep(3600)

    def nan_loss(self, rank: int, step: int) -> bool:
        """Is this rank's loss to be nan at this step?"""
        return self.nan == (rank, step)
