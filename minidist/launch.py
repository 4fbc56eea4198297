"""Start a job's ranks: in this process under torchrun / SLURM, else local ranks started now.

    results = run_ranks(main_fn, nproc=4, args=(cfg_dict,))   # rank -> result; RanksFailed names failures

With plain `python`, run_ranks starts `nproc` local ranks through torch's elastic launcher
(run_local); under torchrun or srun this process is already one rank and calls main_fn itself.
The trainer and the comparison both launch through it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
import uuid
from typing import Callable

from minidist.dist import free_port


def under_launcher() -> bool:
    """True when torchrun or SLURM already started this process as one rank of a job."""
    return "RANK" in os.environ or ("SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ)


# The signals the launcher passes on to its ranks (then waits for them to stop): torch's own
# list, and SIGUSR1, SLURM's warning before preemption (`--signal=USR1@N`), which would
# otherwise kill this process and leave the ranks without a launcher.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def run_local(fn: Callable, nproc: int, args: tuple = (), stop_grace_s: float = 30.0) -> dict:
    """Run fn(*args) on `nproc` local ranks (torchrun's machinery, in-process); return rank -> result.

    A rank that fails makes this raise torch's ChildFailedError with that rank's traceback. A
    signal (FORWARDED_SIGNALS) is passed on to the ranks, which get `stop_grace_s` (and 5 s more)
    to stop before they are killed; then torch's SignalException is raised.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8],
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
        monitor_interval=0.1, start_method="spawn", signals_to_handle=FORWARDED_SIGNALS,
        shutdown_timeout=int(math.ceil(stop_grace_s)) + 5,
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A failed rank has said what happened in one line and logged its traceback (the trainer's
    # run_rank does): the elastic agent's copy of that traceback would only bury the line.
    import logging
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # A stop signal: the ranks' own line says what happened ("Received 15 death signal" would not).
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    return elastic_launch(config, entrypoint=fn)(*args)


class RanksFailed(RuntimeError):
    """Local ranks that failed (each has logged its own traceback)."""

    def __init__(self, failures: dict):
        self.ranks = sorted(failures)
        self.exitcodes = {r: getattr(f, "exitcode", None) for r, f in failures.items()}
        super().__init__(f"rank(s) {self.ranks} failed")

    def stopped_by(self) -> int | None:
        """The stop signal, when every failed rank ended with a stop's status (128 + SIGINT,
        SIGTERM or SIGUSR1: stop_signal.py's), else None."""
        signums = {code - 128 if code is not None else None for code in self.exitcodes.values()}
        stops = {int(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
        return signums.pop() if len(signums) == 1 and signums <= stops else None


class Stopped(RuntimeError):
    """The launcher was signalled (Ctrl-C, SIGTERM, SIGUSR1) and its ranks have stopped."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def run_ranks(fn: Callable, nproc: int, args: tuple = (), stop_grace_s: float = 30.0) -> dict:
    """fn(*args) on every rank of the job; rank -> result. Under a launcher (torchrun, SLURM) this
    process is one rank: {its rank: its result}, its exceptions its own. Otherwise `nproc` local
    ranks start now: any that fails raises RanksFailed, and a signal to this process, passed on
    to them, raises Stopped once they have stopped."""
    if under_launcher():
        from minidist.dist import launch_rank

        return {launch_rank(): fn(*args)}
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        return run_local(fn, nproc=nproc, args=args, stop_grace_s=stop_grace_s)
    except ChildFailedError as e:
        raise RanksFailed(e.failures) from None
    except SignalException as e:
        end_leftover_ranks(e.sigval)
        raise Stopped(e.sigval) from None


def end_leftover_ranks(signum: int, wait_s: float = 5.0) -> None:
    """A second signal cut short torch's wait for the ranks to stop: pass it on too (a second
    Ctrl-C stops them at once), give them `wait_s` to say so, then kill what is left."""
    import multiprocessing

    alive = multiprocessing.active_children()
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signum)
    deadline = time.monotonic() + wait_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()


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
