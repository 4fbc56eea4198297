"""minidist.DataParallel vs native DDP: paired, interleaved training steps in one invocation.

    python recipes/bench_ddp.py                       # GPT ~20M and resnet18 @32x32, 2 ranks, gloo
    python recipes/bench_ddp.py models=[gpt] steps=30
    torchrun --nproc_per_node 2 recipes/bench_ddp.py

Every variant owns a copy of the same model and optimizer; each step runs every
variant once, in a rotating order (so no variant always goes first or last), on
the same batch. A step's time is the slowest rank's. Reported: median step time
per variant with its interquartile range, ratios to native DDP (of the medians, and
the median of step-by-step ratios, which cancels drift between steps), and for ours
the communication time left exposed at the end of backward against the time the
same all_reduces take alone.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

import minidist
from minidist import comm
from minidist_tools.benchmarking import paired_ratio, require_known, rotated, slowest, write_json
from minidist.train.app import run_recipe
from minidist.train.models import GPT, count_parameters
from minidist.train.app import hydra_app

VARIANTS = {
    # name: (kind, DataParallel / DDP keyword arguments)
    "native": ("native", {}),
    "ours": ("ours", {}),
    "ours_no_overlap": ("ours", {"overlap": False}),
    "ours_bucket_view": ("ours", {"gradient_as_bucket_view": True}),
    "native_bucket_view": ("native", {"gradient_as_bucket_view": True}),
}


def build_model(name: str, cfg):
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(vocab_size=cfg.gpt.vocab_size, block_size=cfg.gpt.block_size, n_layer=cfg.gpt.n_layer,
                   n_head=cfg.gpt.n_head, n_embd=cfg.gpt.n_embd)
    if name == "resnet18":
        import torchvision
        return torchvision.models.resnet18(num_classes=10)
    raise SystemExit(f"unknown model {name!r}: choose gpt or resnet18")


def make_batch(name: str, cfg, step: int, rank: int):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    if name == "gpt":
        x = torch.randint(0, cfg.gpt.vocab_size, (cfg.gpt.batch, cfg.gpt.block_size), generator=g)
        return x, torch.roll(x, -1, 1)
    return torch.randn(cfg.resnet.batch, 3, 32, 32, generator=g), torch.randint(0, 10, (cfg.resnet.batch,), generator=g)


def loss_of(name, out, y):
    return GPT.loss(out, y) if name == "gpt" else F.cross_entropy(out, y)


def wrap(kind: str, kwargs: dict, net, cap_mb: float):
    if kind == "native":
        from torch.nn.parallel import DistributedDataParallel as DDP
        # Native DDP uses a 1 MiB first bucket only when bucket_cap_mb is left at its default;
        # given explicitly, its first bucket is as large as the others. Match ours either way.
        if cap_mb == 25.0:
            return DDP(net, **kwargs)
        return DDP(net, bucket_cap_mb=cap_mb, **kwargs)
    first_mb = 1.0 if cap_mb == 25.0 else cap_mb
    return minidist.DataParallel(net, bucket_cap_mb=cap_mb, first_bucket_mb=first_mb, **kwargs)


def standalone_comm_seconds(model, repeats: int = 5) -> float:
    """How long our buckets' all_reduces take with nothing else running (median of repeats)."""
    samples = []
    scratch = [b.buffer.clone() for b in model._buckets]  # allocated outside the timed region
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        handles = [comm.all_reduce(t, async_op=True) for t in scratch]
        for h in handles:
            h.wait()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_model(name: str, cfg, rank: int) -> dict:
    variants = {}
    for v in cfg.variants:
        kind, kwargs = VARIANTS[v]
        net = build_model(name, cfg)
        model = wrap(kind, dict(kwargs), net, float(cfg.bucket_cap_mb))
        variants[v] = (model, torch.optim.AdamW(net.parameters(), lr=1e-4))
    times = {v: [] for v in variants}
    exposed = {v: [] for v in variants}
    names = list(variants)
    for step in range(int(cfg.warmup) + int(cfg.steps)):
        x, y = make_batch(name, cfg, step, rank)
        for v in rotated(names, step):
            model, opt = variants[v]
            comm.barrier()
            start = time.perf_counter()
            loss_of(name, model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
            if step >= int(cfg.warmup):
                times[v].append(slowest(elapsed))
                if isinstance(model, minidist.DataParallel):
                    exposed[v].append(slowest(model.last_wait_s))
    native_median = statistics.median(times["native"]) if "native" in times else None
    result = {"model": name, "parameters": count_parameters(build_model(name, cfg)), "variants": {}}
    for v in names:
        model = variants[v][0]
        med = statistics.median(times[v])
        q1, _, q3 = statistics.quantiles(times[v], n=4) if len(times[v]) > 1 else (med, med, med)
        row = {"median_step_s": med, "iqr_s": [q1, q3],
               "ratio_to_native": med / native_median if native_median else None,
               # the median of step-by-step ratios and its 95% interval: each pair ran back to back
               "paired_ratio": paired_ratio(times[v], times["native"]) if native_median else None,
               "steps": len(times[v])}
        if exposed[v]:
            row["exposed_comm_s"] = statistics.median(exposed[v])
            row["standalone_comm_s"] = slowest(standalone_comm_seconds(model))
            row["buckets"] = len(model._buckets)
        result["variants"][v] = row
    return result


def print_result(res: dict) -> None:
    print(f"\n{res['model']}: {res['parameters'] / 1e6:.1f}M parameters")
    print(f"  {'variant':<20}{'median step':>12}{'IQR':>16}{'ours/native':>12}{'paired':>8}{'exposed comm':>14}"
          f"{'comm alone':>12}{'buckets':>9}")
    for v, row in res["variants"].items():
        ratio = f"{row['ratio_to_native']:.3f}" if row["ratio_to_native"] else "-"
        exp = f"{row['exposed_comm_s'] * 1e3:.1f} ms" if "exposed_comm_s" in row else "-"
        alone = f"{row['standalone_comm_s'] * 1e3:.1f} ms" if "standalone_comm_s" in row else "-"
        iqr = f"{row['iqr_s'][0] * 1e3:.0f}-{row['iqr_s'][1] * 1e3:.0f} ms"
        paired = f"{row['paired_ratio']['median']:.3f}" if row["paired_ratio"] else "-"
        print(f"  {v:<20}{row['median_step_s'] * 1e3:>9.1f} ms{iqr:>16}{ratio:>12}{paired:>8}{exp:>14}{alone:>12}"
              f"{row.get('buckets', '-'):>9}")


def bench_main(cfg_dict: dict) -> None:
    cfg = OmegaConf.create(cfg_dict)
    torch.set_num_threads(1)
    ctx = minidist.init_distributed(backend=cfg.backend, timeout_s=cfg.timeout_s)
    minidist.print0(f"DDP benchmark: {ctx.world_size} ranks, {ctx.backend}, {cfg.warmup} warm-up + "
                    f"{cfg.steps} measured steps, variants interleaved: {list(cfg.variants)}")
    results = []
    for name in cfg.models:
        res = bench_model(name, cfg, ctx.rank)
        results.append(res)
        if ctx.rank == 0:
            print_result(res)
    if ctx.rank == 0:
        write_json(cfg.out, {"world_size": ctx.world_size, "warmup": int(cfg.warmup), "steps": int(cfg.steps),
                             "results": results})
    minidist.shutdown()


@hydra_app("bench_ddp")
def main(cfg: DictConfig) -> None:
    require_known("variants", cfg.variants, VARIANTS)
    run_recipe(bench_main, cfg, path_keys=("out",))


if __name__ == "__main__":
    main()
