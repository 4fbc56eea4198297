"""Collective benchmark: time, algbw and busbw per op over a size sweep, sync and async.

    python recipes/bench_collectives.py nproc=2
    python recipes/bench_collectives.py nproc=4 max_bytes=16777216 iters=5
    torchrun --nproc_per_node 8 recipes/bench_collectives.py      # e.g. on a GPU node (nccl)

Bandwidths use nccl-tests' definitions (S = message size in bytes, t = time):
    algbw = S / t
    busbw = algbw * 2(n-1)/n   all_reduce
            algbw * (n-1)/n    all_gather, reduce_scatter (S = the total, gathered size)
            algbw              broadcast, reduce, send/recv
busbw is comparable across ops and world sizes: it is what each link carries.
sync times each blocking call (median over iterations, slowest rank); async issues
`iters` calls back to back and waits once (time per call, median over repeats).
The machine's memcpy bandwidth is printed as a one-machine upper bound.

Writes to out_dir: results.csv, results.json, busbw.png and TensorBoard scalars.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

import minidist
from minidist import comm
from minidist_tools.benchmarking import require_known, slowest
from minidist.train.app import run_recipe
from minidist.train.app import hydra_app

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "sendrecv")


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw: the ring model's bytes a rank sends per byte of S (minidist.comm's)."""
    return comm.ring_bytes_sent("send" if op == "sendrecv" else op, 1, n)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Both:
    """Wait on several handles as one."""

    def __init__(self, *handles):
        self.handles = handles

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


def make_op(op: str, nbytes: int, n: int, rank: int, device: torch.device):
    """Return (launch(async_op) -> handle|None, effective S in bytes) for one op at about `nbytes`."""
    elem = 4
    numel = max(n, nbytes // elem // n * n)  # divisible by n so shards are even
    big = torch.ones(numel, device=device)
    small = torch.ones(numel // n, device=device)
    if op == "all_reduce":
        return (lambda a: comm.all_reduce(big, async_op=a)), numel * elem
    if op == "all_gather":
        return (lambda a: comm.all_gather_into(big, small, async_op=a)), numel * elem
    if op == "reduce_scatter":
        return (lambda a: comm.reduce_scatter_tensor(small, big, async_op=a)), numel * elem
    if op == "broadcast":
        return (lambda a: comm.broadcast(big, src=0, async_op=a)), numel * elem
    if op == "reduce":
        return (lambda a: comm.reduce(big, dst=0, async_op=a)), numel * elem
    if op == "sendrecv":
        # Between ranks 0 and 1. sync: a blocking ping-pong (a round trip = two transfers);
        # async: both post isend + irecv at once and wait on both (an exchange = two transfers).
        # Either way one call moves the message twice; bench_main halves its time.
        peer = 1 - rank
        other = torch.empty_like(big)

        def pingpong(async_op: bool):
            if rank > 1:
                return None
            if async_op:
                return _Both(comm.irecv(other, src=peer), comm.isend(big, dst=peer))
            if rank == 0:
                comm.send(big, dst=1)
                comm.recv(big, src=1)
            else:
                comm.recv(big, src=0)
                comm.send(big, dst=0)
            return None
        return pingpong, numel * elem
    raise ValueError(f"unknown op {op!r}; choose from {sorted(OPS)}")


def time_op(launch, mode: str, cfg, device) -> float:
    """Seconds per call: the median over iterations (sync) or repeats (async), slowest rank."""
    for _ in range(int(cfg.warmup)):
        h = launch(mode == "async")
        if h is not None:
            h.wait()
    _sync(device)
    samples = []
    if mode == "sync":
        for _ in range(int(cfg.iters)):
            comm.barrier()
            start = time.perf_counter()
            launch(False)
            _sync(device)
            samples.append(time.perf_counter() - start)
    else:
        for _ in range(int(cfg.repeats)):
            comm.barrier()
            start = time.perf_counter()
            handles = [launch(True) for _ in range(int(cfg.iters))]
            for h in handles:
                if h is not None:
                    h.wait()
            _sync(device)
            samples.append((time.perf_counter() - start) / int(cfg.iters))
    return slowest(statistics.median(samples))  # the op is as slow as its slowest rank


def memcpy_bandwidth(device: torch.device, nbytes: int = 64 << 20, iters: int = 10) -> float:
    """Bytes per second of a device-local tensor copy: what no collective on this machine can beat."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        samples.append(time.perf_counter() - start)
    return nbytes / statistics.median(samples)


def sizes(cfg) -> list[int]:
    out, s = [], int(cfg.min_bytes)
    while s <= int(cfg.max_bytes):
        out.append(s)
        s *= int(cfg.factor)
    return out


def write_outputs(rows: list[dict], out_dir: Path, memcpy: float, n: int, backend: str, cfg) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    meta = {"world_size": n, "backend": backend, "memcpy_GBps": memcpy / 1e9, "torch": torch.__version__,
            "warmup": int(cfg.warmup), "iters": int(cfg.iters), "repeats": int(cfg.repeats)}
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))

    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(out_dir / "tensorboard")) as tb:
        for r in rows:
            step = int(r["bytes"]).bit_length() - 1  # log2(size)
            tb.add_scalar(f"busbw_GBps/{r['op']}_{r['mode']}", r["busbw_GBps"], step)
            tb.add_scalar(f"time_us/{r['op']}_{r['mode']}", r["time_us"], step)
        tb.add_scalar("memcpy_GBps", memcpy / 1e9, 0)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, op in enumerate(dict.fromkeys(r["op"] for r in rows)):
        for mode, style in (("sync", "-"), ("async", "--")):
            pts = [(r["bytes"], r["busbw_GBps"]) for r in rows if r["op"] == op and r["mode"] == mode]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", markersize=3, color=f"C{i}", label=f"{op} {mode}")
    ax.axhline(memcpy / 1e9, color="k", linestyle=":", label="memcpy (upper bound)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"minidist collectives: {n} ranks, {backend}")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "busbw.png", dpi=110)
    plt.close(fig)


def bench_main(cfg_dict: dict) -> None:
    cfg = OmegaConf.create(cfg_dict)
    torch.set_num_threads(1)
    ctx = minidist.init_distributed(backend=cfg.backend, timeout_s=cfg.timeout_s)
    n, rank = ctx.world_size, ctx.rank
    memcpy = memcpy_bandwidth(ctx.device)
    minidist.print0(f"collectives benchmark: {n} ranks, backend {ctx.backend}, device {ctx.device}; "
                    f"memcpy bandwidth {memcpy / 1e9:.2f} GB/s (one-machine upper bound)")
    minidist.print0(f"{'op':<15}{'mode':<7}{'bytes':>11}{'time us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}")
    rows = []
    for op in cfg.ops:
        if op == "sendrecv" and n < 2:
            continue
        for nbytes in sizes(cfg):
            launch, s = make_op(op, nbytes, n, rank, ctx.device)
            for mode in cfg.modes:
                t = time_op(launch, mode, cfg, ctx.device)
                if op == "sendrecv":
                    t /= 2  # one call moved the message twice (see make_op)
                algbw = s / t / 1e9
                row = dict(op=op, mode=mode, bytes=s, world_size=n, time_us=round(t * 1e6, 2),
                           algbw_GBps=round(algbw, 4), busbw_GBps=round(algbw * bus_factor(op, n), 4))
                rows.append(row)
                minidist.print0(f"{op:<15}{mode:<7}{s:>11}{row['time_us']:>12.1f}"
                                f"{row['algbw_GBps']:>12.3f}{row['busbw_GBps']:>12.3f}")
    if rank == 0:
        out_dir = Path(cfg.out_dir)
        write_outputs(rows, out_dir, memcpy, n, ctx.backend, cfg)
        print(f"wrote {out_dir}/results.csv, results.json, busbw.png, tensorboard/", flush=True)
    comm.barrier()
    minidist.shutdown()


@hydra_app("bench_collectives")
def main(cfg: DictConfig) -> None:
    require_known("ops", cfg.ops, OPS)
    run_recipe(bench_main, cfg, path_keys=("out_dir",))


if __name__ == "__main__":
    main()
