"""Start a job's ranks: in this process under torchrun / SLURM, else local ranks started now.

    results = run_ranks(main_fn, nproc=4, args=(cfg_dict,))   # rank -> result; RanksFailed names failures

With plain `python`, run_ranks starts `nproc` local ranks through torch's elastic launcher
(run_local); under torchrun or srun this process is already one rank and calls main_fn itself.
The trainer and the comparison both launch through it.
"""

from __future__ import annotations

import os
import uuid
from typing import Callable

from minidist.dist import free_port


def under_launcher() -> bool:
    """True when torchrun or SLURM already started this process as one rank of a job."""
    return "RANK" in os.environ or ("SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ)


def run_local(fn: Callable, nproc: int, args: tuple = ()) -> dict:
    """Run fn(*args) on `nproc` local ranks (torchrun's machinery, in-process); return rank -> result.

    A rank that fails makes this raise torch's ChildFailedError with that rank's traceback.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8],
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
        monitor_interval=0.1, start_method="spawn",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A failed rank has said what happened in one line and logged its traceback (the trainer's
    # run_rank does): the elastic agent's copy of that traceback would only bury the line.
    import logging
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    return elastic_launch(config, entrypoint=fn)(*args)


class RanksFailed(RuntimeError):
    """Local ranks that failed (each has logged its own traceback)."""

    def __init__(self, ranks):
        self.ranks = sorted(ranks)
        super().__init__(f"rank(s) {self.ranks} failed")


def run_ranks(fn: Callable, nproc: int, args: tuple = ()) -> dict:
    """fn(*args) on every rank of the job; rank -> result. Under a launcher (torchrun, SLURM) this
    process is one rank: {its rank: its result}, its exceptions its own. Otherwise `nproc` local
    ranks start now, and any that fails raises RanksFailed."""
    if under_launcher():
        from minidist.dist import launch_rank

        return {launch_rank(): fn(*args)}
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        return run_local(fn, nproc=nproc, args=args)
    except ChildFailedError as e:
        raise RanksFailed(e.failures) from None


def run_recipe(fn: Callable, cfg, path_keys: tuple[str, ...] = ()) -> None:
    """A recipe's entry: call fn(cfg_dict) on this rank under torchrun / SLURM, else start
    `cfg.nproc` local ranks that each call it.

    `cfg` (a Hydra DictConfig or a dict) travels to the ranks as a plain dict; the
    `path_keys` given are made absolute first, so every rank writes to the same place.
    """
    from omegaconf import OmegaConf

    cfg_dict = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else dict(cfg)
    for key in path_keys:
        if cfg_dict.get(key):
            cfg_dict[key] = os.path.abspath(cfg_dict[key])
    run_ranks(fn, nproc=int(cfg_dict["nproc"]), args=(cfg_dict,))
