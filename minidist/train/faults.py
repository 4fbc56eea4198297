"""Fault injection, to prove recovery: a rank SIGKILLs itself mid-training.

    torchrun --max-restarts 2 --nproc_per_node 2 recipes/train.py hydra.run.dir=runs/a \\
        debug.kill_rank=1 debug.kill_at_step=12

Rank `kill_rank` dies by SIGKILL right after optimizer step `kill_at_step` (before that
step's checkpoint, so recovery has work to redo). Each kill happens once per run directory:
a marker file in <run dir>/faults/ is written (and synced) first, so the group torchrun
restarts resumes from the latest complete checkpoint and runs through. Several kills:
lists of the same length, e.g. debug.kill_rank=[1,3,0] debug.kill_at_step=[120,480,777].
"""

from __future__ import annotations

import os
import signal
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
