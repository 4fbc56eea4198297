"""Process-group runtime: one call that works under torchrun, SLURM or a plain `python`, and the 2-D
mesh of hybrid sharding (replicate across hosts x shard within a host).

    ctx = minidist.init_distributed()                  # reads the launcher's environment
    mesh = minidist.init_mesh(replicate=2, shard=4)    # 8 ranks: 2 hosts of 4
    print0(f"world size {ctx.world_size}"); minidist.shutdown()

How ranks sit on the mesh: docs/internals.md, "dist.py".
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import shutil
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.distributed as dist


DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as the launcher described it."""

    launcher: str  # "torchrun", "slurm" or "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class DistContext:
    """The immutable result of `init_distributed`: who am I and where do I compute."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str
    launcher: str


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: "gpu[03-05,9],cpu1" -> "gpu03"."""
    first = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not first:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = first.group(1), first.group(3)
    if ranges is None:
        return prefix
    first_range = ranges.split(",")[0]
    return prefix + first_range.split("-")[0]  # keeps zero padding: "03-05" -> "03"


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    """env[key] as an integer (`default` where it is unset and one is given)."""
    if default is not None and key not in env:
        return default
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer; "
                         "fix the launcher's environment") from None


def ranks_per_host(env: Mapping[str, str] | None = None) -> int | None:
    """How many ranks each host runs, where the launcher says so; None where nothing says (one
    process) or the hosts run different numbers. The one reading of the host layout: LaunchInfo,
    init_mesh's default shard groups and the cross-host byte accounting all take it from here.

    torchrun (and minidist's launcher) set LOCAL_WORLD_SIZE. srun sets SLURM_TASKS_PER_NODE
    ("4(x2)" or "4,4"; "3,1" differs between hosts), and SLURM_NTASKS_PER_NODE only when
    --ntasks-per-node was given."""
    env = os.environ if env is None else env
    if "LOCAL_WORLD_SIZE" in env:
        return _int(env, "LOCAL_WORLD_SIZE")
    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        return int(env["SLURM_NTASKS_PER_NODE"])
    counts = set()
    for entry in filter(None, env.get("SLURM_TASKS_PER_NODE", "").split(",")):
        match = re.fullmatch(r"(\d+)(\(x\d+\))?", entry)
        if match is None:
            return None
        counts.add(int(match.group(1)))
    return counts.pop() if len(counts) == 1 else None


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read torchrun's variables, else SLURM's, else describe a single process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return LaunchInfo("torchrun", rank=_int(env, "RANK"), world_size=world,
                          local_rank=_int(env, "LOCAL_RANK", _int(env, "RANK")),
                          local_world_size=ranks_per_host(env) or world, node_rank=_int(env, "GROUP_RANK", 0),
                          master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_int(env, "MASTER_PORT", 29500))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = _int(env, "SLURM_NTASKS")
        local_world = ranks_per_host(env) or max(1, world // max(1, _int(env, "SLURM_NNODES", 1)))  # unequal hosts: a guess
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        return LaunchInfo("slurm", rank=_int(env, "SLURM_PROCID"), world_size=world,
                          local_rank=_int(env, "SLURM_LOCALID", 0), local_world_size=local_world,
                          node_rank=_int(env, "SLURM_NODEID", 0),
                          master_addr=env.get("MASTER_ADDR", first_slurm_host(nodelist)),
                          # Every task of the job derives the same port; different jobs on a node rarely collide.
                          master_port=_int(env, "MASTER_PORT", 15000 + _int(env, "SLURM_JOB_ID", 0) % 20000))
    return LaunchInfo("single", 0, 1, 0, 1, 0, "127.0.0.1", 0)


def launch_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's global rank as its launcher set it (torchrun's RANK, SLURM's SLURM_PROCID, 0
    for a lone process), known before any process group exists: the one rule for "am I rank 0"
    before init_distributed (after it: ctx.rank, is_main())."""
    return detect_launch(env).rank


def process_alive(pid) -> bool:
    """Is process `pid` (an int or its digits) running on this host? A zombie (exited, not yet
    reaped by its parent) is not: a rank killed a moment ago is dead to its peers at once."""
    try:
        return Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError, ValueError, TypeError):
        return False


def remove_left_by_dead(folder: Path, prefix: str) -> None:
    """What a process of this user left in `folder` as `<prefix><its pid>-...` and could not remove
    itself (kill -9): removed once that process is gone, never while it lives (another run's)."""
    for path in Path(folder).glob(f"{prefix}*"):
        pid = path.name[len(prefix):].split("-")[0]
        try:
            if pid.isdigit() and path.lstat().st_uid == os.getuid() and not process_alive(pid):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        except OSError:
            pass


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# glibc serves a freed block's size from its heap from then on (up to 32 MiB) and keeps freed heap
# memory resident, so a rank that once freed a 32 MiB tensor keeps its pages. Ranks minidist starts
# take blocks of this size and more straight from the system and give them back on free. A fixed
# threshold also switches off glibc's rule that keeps twice as much free at the heap's top: without
# it every smaller temporary (an optimizer's) was given back and faulted in again, each step
# (1.5x the step of a communication-bound MLP). Tensors of 2 MiB and more get transparent huge
# pages where the kernel gives them only on request (THP "madvise", Debian's and Ubuntu's default):
# torch's allocator asks for them, and a 12 MiB block taken from the system faults a few times, not
# 3,072 (that MLP's step ~0.9x). Not glibc's own (glibc.malloc.hugetlb=1): it puts the whole heap
# on huge pages, and each start of a rank cost ~0.7 s more. A user who set any of these has the
# allocator as they chose (docs/trainer.md, "Memory").
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": 8 << 20, "MALLOC_TRIM_THRESHOLD_": 16 << 20, "THP_MEM_ALLOC_ENABLE": 1}


@contextlib.contextmanager
def ranks_allocator():
    """MALLOC_ENV in this process's environment while it starts ranks (glibc and torch's allocator
    read it as a process starts: the ranks, which inherit it, not this one); as it was after. A
    user who set any of the variables has the allocator as they chose."""
    ours = [] if any(k in os.environ for k in MALLOC_ENV) else list(MALLOC_ENV)
    os.environ.update({k: str(MALLOC_ENV[k]) for k in ours})
    try:
        yield
    finally:
        for k in ours:
            os.environ.pop(k, None)


def gpu_bound_per_task(env: Mapping[str, str] | None = None) -> bool:
    """Did SLURM give this task GPUs of its own (--gpus-per-task, --gpu-bind)? Then each task
    sees only its own (device_count() is 1 with one GPU a task), whatever the node holds."""
    env = os.environ if env is None else env
    return "SLURM_LOCALID" in env and any(k in env for k in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"))


def choose_backend(backend: str, local_world_size: int, env: Mapping[str, str] | None = None) -> str:
    """"auto": nccl when every local rank can own a CUDA device (as many visible as local ranks,
    or GPUs bound per task by SLURM), else gloo."""
    if backend != "auto":
        return backend
    if torch.cuda.is_available() and (torch.cuda.device_count() >= local_world_size or
                                      (torch.cuda.device_count() >= 1 and gpu_bound_per_task(env))):
        return "nccl"
    return "gloo"


def cuda_device_for(local_rank: int, local_world_size: int, env: Mapping[str, str] | None = None) -> torch.device:
    """The GPU this rank drives under nccl: local_rank % visible devices (all GPUs visible: one
    each; SLURM binding one a task: its own, device 0). Two ranks on one GPU is an error NCCL
    reports late and obscurely ("Duplicate GPU detected"), so it is refused here, with the fix."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise RuntimeError("backend nccl needs a CUDA device, and this process sees none (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): use backend gloo, or a GPU machine")
    if count < local_world_size and not gpu_bound_per_task(env):
        raise RuntimeError(f"backend nccl with {local_world_size} ranks on this machine but {count} visible GPU(s): "
                           "NCCL needs one GPU per rank; start at most that many ranks per machine (torchrun "
                           "--nproc_per_node, launcher.nproc), or bind one GPU per task (srun --gpus-per-task=1)")
    return torch.device("cuda", local_rank % count)


def _restart_safe_store(timeout: datetime.timedelta):
    """Under torchrun, a store whose keys are this restart attempt's own, or None elsewhere.

    torchrun's workers share the agent's store, which outlives a restart (same host and
    port), while the process group writes its members' addresses under the same keys each
    attempt: after `--max-restarts` brought the group back, a rank could read a dead peer's
    address from the previous attempt and fail to connect ("Connection refused"), now and
    then (pytorch/pytorch#167288 reports the same with nccl). A prefix per attempt keeps them apart.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return None
    agent = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                          timeout=timeout)
    run = env.get("TORCHELASTIC_RUN_ID", "run")
    return dist.PrefixStore(f"minidist/{run}/attempt_{env['TORCHELASTIC_RESTART_COUNT']}", agent)


class RendezvousError(RuntimeError):
    """The process group could not be formed: the message says why and what to change."""


def rendezvous_failure(error: BaseException, rank: int, world_size: int, timeout_s: float) -> str:
    """One message for a failed init_process_group: where, what went wrong, and the fix."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    text = str(error)
    low = text.lower()
    where = f"rank {rank} of {world_size}: the rendezvous at MASTER_ADDR={addr} MASTER_PORT={port}"
    if "address already in use" in low or "eaddrinuse" in low or "errno 98" in low or "failed to listen" in low:
        return (f"{where} failed: port {port} is already in use on this machine (another job, or a previous "
                "run still exiting): choose a free port (MASTER_PORT=..., torchrun --master-port / "
                "--rdzv-endpoint HOST:PORT)")
    if "timed out" in low or "timeout" in low or "refused" in low or "no route" in low or "unreachable" in low:
        return (f"{where} was not reached within {timeout_s:g} s ({text.splitlines()[0][:200]}): check that "
                "MASTER_ADDR is the address of rank 0's machine and reachable from here, that rank 0 was started, "
                f"and that all {world_size} ranks were launched with the same MASTER_ADDR / MASTER_PORT")
    return f"{where} failed: {text.splitlines()[0][:300] if text else type(error).__name__}"


@contextlib.contextmanager
def _bounded(timeout_s: float, why: Callable[[], str]):
    """Leave the process, saying why in one line on stderr, if the body is still running after
    `timeout_s`. torch's store client does not bound its handshake: a rendezvous port held by a
    listener that accepts and never answers blocks the rank inside init_process_group, in C, where
    no timeout of torch's fires. (A stop signal meanwhile: the trainer's StopSignals ends the wait.)"""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(timeout_s):
            os.write(2, f"error: {why()}\n".encode())
            os._exit(1)

    watcher = threading.Thread(target=watch, name="minidist-rendezvous-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


_CONTEXT: DistContext | None = None


def init_distributed(backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Create the default process group from the launcher's environment and return the context.

    Calling it again returns the same context. `timeout_s` bounds every collective:
    a dead or missing peer raises instead of hanging forever.
    """
    global _CONTEXT
    if _CONTEXT is not None:
        return _CONTEXT
    info = detect_launch()
    backend = choose_backend(backend, info.local_world_size)
    if backend == "nccl":
        device = cuda_device_for(info.local_rank, info.local_world_size)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # nccl: the communicator is made now, for this device (device_id), so that a bad GPU or
    # network fails at start, not in the first backward.
    eager = {"device_id": device} if backend == "nccl" else {}
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if info.launcher == "single":
            # A one-member group needs no rendezvous: an in-memory store is enough.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **eager)
        else:
            os.environ.setdefault("MASTER_ADDR", info.master_addr)
            os.environ.setdefault("MASTER_PORT", str(info.master_port))
            try:
                with _bounded(timeout_s, lambda: rendezvous_failure(TimeoutError(f"no answer, timed out after "
                                                                                 f"{timeout_s:g} s"),
                                                                    info.rank, info.world_size, timeout_s)):
                    store = _restart_safe_store(timeout)
                    dist.init_process_group(backend, **({"store": store} if store else {"init_method": "env://"}),
                                            rank=info.rank, world_size=info.world_size, timeout=timeout, **eager)
            except Exception as e:  # noqa: BLE001 - re-raised with the cause and the fix named
                raise RendezvousError(rendezvous_failure(e, info.rank, info.world_size, timeout_s)) from e
    _CONTEXT = DistContext(
        rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
        local_world_size=info.local_world_size, node_rank=info.node_rank,
        device=device, backend=backend, launcher=info.launcher,
    )
    return _CONTEXT


_BEFORE_SHUTDOWN: list = []


def before_shutdown(fn) -> None:
    """Run fn() in shutdown() before the process groups go (e.g. to finish communication in flight:
    gloo aborts the process when a group is destroyed under a running transfer)."""
    if fn not in _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.append(fn)


def shutdown() -> None:
    """Finish what is in flight, destroy the default process group (if any), forget the context."""
    global _CONTEXT
    if dist.is_initialized():
        for fn in _BEFORE_SHUTDOWN:
            fn()
        dist.destroy_process_group()
    _CONTEXT = None


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """True on global rank 0 (and in a process that never initialised distributed)."""
    return get_rank() == 0


def print0(*args, **kwargs) -> None:
    """`print` on rank 0 only."""
    if is_main():
        print(*args, **kwargs, flush=True)


class _RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return is_main()


def get_logger(name: str = "minidist") -> logging.Logger:
    """A logger whose console output comes from rank 0 only (other ranks stay silent)."""
    logger = logging.getLogger(name)
    if not any(getattr(h, "_minidist", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler._minidist = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter("[%(asctime)s %(name)s] %(message)s", "%H:%M:%S"))
        handler.addFilter(_RankZeroFilter())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


@dataclass
class Mesh:
    """The two dimensions' process groups, and where this rank sits in them."""

    replicate: int            # R: number of replicas (shard groups)
    shard: int                # S: ranks one copy of the model is sharded over
    rank: int                 # this rank in the world
    shard_group: object       # this rank's shard group (S contiguous ranks)
    replicate_group: object   # this rank's replicate group (R ranks, stride S)
    shard_ranks: list         # every shard group, as lists of world ranks
    replicate_ranks: list     # every replicate group, as lists of world ranks

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard

    @property
    def shard_rank(self) -> int:
        """This rank's index within its shard group (which slice of each shard it owns)."""
        return self.rank % self.shard

    @property
    def replica(self) -> int:
        """Which replica (shard group) this rank belongs to."""
        return self.rank // self.shard

    def __str__(self) -> str:
        def fmt(groups):
            return " ".join(f"[{g[0]}-{g[-1]}]" if len(g) > 2 and g == list(range(g[0], g[-1] + 1))
                            else "[" + ",".join(map(str, g)) + "]" for g in groups)
        return (f"Mesh(replicate={self.replicate} x shard={self.shard}): shard groups (within a host) "
                f"{fmt(self.shard_ranks)}; replicate groups (across hosts) {fmt(self.replicate_ranks)}; "
                f"rank {self.rank} = replica {self.replica}, shard {self.shard_rank}")


def mesh_shape(world_size: int, replicate: int | None, shard: int | None, per_host: int | None) -> tuple[int, int]:
    """(R, S) from what was given; errors name the cause and the fix. Pure: tested without ranks."""
    for name, value in (("replicate", replicate), ("shard", shard)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"init_mesh: {name}={value!r} must be a positive integer")
    if shard is None and replicate is None:
        shard = per_host or world_size  # one shard group per host
    if shard is None:
        if world_size % replicate:
            raise ValueError(f"init_mesh: the world of {world_size} ranks does not split into replicate={replicate} "
                             f"groups: choose a replicate that divides {world_size}")
        shard = world_size // replicate
    if replicate is None:
        if world_size % shard:
            raise ValueError(f"init_mesh: the world of {world_size} ranks does not split into shard groups of "
                             f"{shard}: choose a shard size that divides {world_size}")
        replicate = world_size // shard
    if replicate * shard != world_size:
        raise ValueError(f"init_mesh: replicate={replicate} x shard={shard} = {replicate * shard} ranks, but the "
                         f"world has {world_size}: make replicate x shard equal the world size")
    if per_host is not None and shard % per_host and per_host % shard:
        raise ValueError(f"init_mesh: shard groups of {shard} ranks would span hosts of {per_host} ranks unevenly "
                         f"(some groups would straddle two hosts): choose a shard size that divides {per_host} "
                         f"or is a multiple of it")
    return replicate, shard


# The meshes made in this process: (R, S, timeout) -> (the world group they were made in, the mesh).
_MADE: dict[tuple, tuple[object, Mesh]] = {}


def init_mesh(replicate: int | None = None, shard: int | None = None, *, timeout_s: float | None = None,
              env: Mapping[str, str] | None = None) -> Mesh:
    """Build the 2-D process groups over the whole world; a collective: every rank calls it alike.

    Args:
        replicate: R, the number of replicas; shard: S, the ranks one replica is sharded over.
            Give either, both (R x S must be the world size) or neither (S = ranks per host).
        timeout_s: the groups' collective timeout (default: the world's).
        env: where to read the host layout (LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE);
            default os.environ. Where it is known, shard groups must not straddle hosts.

    The same shape again in the same process group gives the mesh made the first time: a group
    holds its communicators (and gloo's threads) until the process ends, and a process that trains
    several times (a sweep under torchrun) would pile them up.
    """
    if not dist.is_initialized():
        raise RuntimeError("init_mesh needs a process group: call minidist.init_distributed() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    R, S = mesh_shape(world, replicate, shard, ranks_per_host(env))
    default = dist.distributed_c10d._get_default_group()
    made = _MADE.get((R, S, timeout_s))
    if made is not None and made[0] is default:
        return made[1]
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    shard_ranks = [list(range(h * S, (h + 1) * S)) for h in range(R)]
    replicate_ranks = [list(range(s, world, S)) for s in range(S)]
    # Every rank creates every group, in the same order (torch.distributed's rule for new_group).
    shard_groups = [dist.new_group(ranks, **kwargs) for ranks in shard_ranks]
    replicate_groups = [dist.new_group(ranks, **kwargs) for ranks in replicate_ranks]
    mesh = Mesh(replicate=R, shard=S, rank=rank, shard_group=shard_groups[rank // S],
                replicate_group=replicate_groups[rank % S], shard_ranks=shard_ranks, replicate_ranks=replicate_ranks)
    _MADE[R, S, timeout_s] = default, mesh
    return mesh
