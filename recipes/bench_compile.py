"""torch.compile under our wrappers vs native DDP compiled: paired, interleaved training steps.

    python recipes/bench_compile.py                          # 2 ranks (gloo, CPU), the wrapper compiled
    python recipes/bench_compile.py placement=inner          # the module compiled before wrapping
    torchrun --nproc_per_node 1 recipes/bench_compile.py backend=nccl   # one GPU
    python scripts/render_compile_bench.py                   # docs/compile.md from docs/benchmarks/data/

Every variant owns a copy of the same GPT and an AdamW; each is compiled the same way
(torch.compile's default backend, inductor) and warmed up (compilation happens there).
Each measured step runs every variant once, in a rotating order, on the same batch; a
step's time is the slowest rank's (CUDA: after a synchronize). Reported per variant: the
median step time, and the median of its step-by-step ratios to native DDP compiled with a
bootstrap 95% interval (the pairs ran back to back, so drift between steps cancels).
The JSON is a document data file (scripts/lib/doc_pipeline.py): the results, with the commit,
command, torch version and date that produced them.
"""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import sys
import time

import torch
from omegaconf import DictConfig, OmegaConf

import minidist
from minidist import comm
from minidist_tools.benchmarking import bootstrap_median_ci, require_known, rotated, slowest, variant_spec, write_json
from minidist.train.app import run_recipe
from minidist.train.models import GPT, count_parameters
from minidist.train.app import hydra_app

VARIANTS = ["native_ddp", "ddp", "zero1", "zero2", "zero3", "native_ddp_eager"]
REFERENCE = "native_ddp"


def build(cfg, device):
    torch.manual_seed(0)
    return GPT(vocab_size=cfg.gpt.vocab_size, block_size=cfg.gpt.block_size, n_layer=cfg.gpt.n_layer,
               n_head=cfg.gpt.n_head, n_embd=cfg.gpt.n_embd).to(device)


def make_variant(name: str, cfg, device):
    """(the callable model, its optimizer, how it clips): the loop as a user writes it."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    net = build(cfg, device)
    compiled = not name.endswith("_eager")
    if compiled and cfg.placement == "inner":
        net = torch.compile(net, backend=cfg.compiler)
    factory = functools.partial(torch.optim.AdamW, lr=1e-4)
    strategy = variant_spec(name)
    if strategy.kind == "native":  # the variants take native DDP only
        model, opt = DDP(net), factory(net.parameters())
        clip = functools.partial(torch.nn.utils.clip_grad_norm_, list(net.parameters()), 1.0)
    elif strategy.zero_stage == 0:
        model, opt = minidist.DataParallel(net), factory(net.parameters())
        clip = functools.partial(torch.nn.utils.clip_grad_norm_, list(net.parameters()), 1.0)
    else:
        stage = strategy.zero_stage
        model = minidist.ShardedDataParallel(net, factory, stage=stage,
                                             **({"min_unit_params": int(cfg.min_unit_params)} if stage == 3 else {}))
        opt, clip = model.optimizer, functools.partial(model.clip_grad_norm_, 1.0)
    forward = torch.compile(model, backend=cfg.compiler) if compiled and cfg.placement == "outer" else model
    return forward, opt, clip


def bench(cfg, ctx) -> dict:
    variants = {name: make_variant(name, cfg, ctx.device) for name in cfg.variants}
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for step in range(int(cfg.warmup) + int(cfg.steps)):
        g = torch.Generator().manual_seed(step * 1000 + ctx.rank)
        x = torch.randint(0, cfg.gpt.vocab_size, (cfg.gpt.batch, cfg.gpt.block_size), generator=g).to(ctx.device)
        y = torch.roll(x, -1, 1)
        for name in rotated(names, step):
            forward, opt, clip = variants[name]
            comm.barrier()
            start = time.perf_counter()
            GPT.loss(forward(x), y).backward()
            clip()
            opt.step()
            opt.zero_grad()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()  # the host timer would stop before the GPU's work ends
            elapsed = time.perf_counter() - start
            if step >= int(cfg.warmup):
                times[name].append(slowest(elapsed))
    rows = {}
    for name in names:
        row = {"median_step_s": statistics.median(times[name]), "steps": len(times[name])}
        if REFERENCE in times:
            ratios = [a / b for a, b in zip(times[name], times[REFERENCE])]
            lo, hi = bootstrap_median_ci(ratios)
            row.update(paired_ratio=statistics.median(ratios), ratio_ci95=[lo, hi])
        rows[name] = row
    return rows


def provenance(cfg) -> dict:
    commit = os.environ.get("MINIDIST_COMMIT", "")  # where the tree travelled without its .git
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and cfg.backend == "nccl" else "CPU"
    # The documents' provenance record (scripts/lib/doc_pipeline.py), written here because this
    # runs on machines the document scripts do not (a GPU one, by scripts/gpu_check.sh).
    return {"commit": commit, "command": "python recipes/bench_compile.py " + " ".join(sys.argv[1:]),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0],
            "device": device}


def bench_main(cfg_dict: dict) -> None:
    cfg = OmegaConf.create(cfg_dict)
    if cfg.backend != "nccl":
        torch.set_num_threads(1)
    ctx = minidist.init_distributed(backend=cfg.backend, timeout_s=cfg.timeout_s)
    minidist.print0(f"compile benchmark: {ctx.world_size} ranks, {ctx.backend}, torch.compile of the "
                    f"{'wrapper' if cfg.placement == 'outer' else 'module before wrapping'}, {cfg.warmup} warm-up + "
                    f"{cfg.steps} measured steps, interleaved: {list(cfg.variants)}")
    rows = bench(cfg, ctx)
    if ctx.rank == 0:
        print(f"  {'variant':<18}{'median step':>13}{'/ native_ddp compiled':>24}{'95% interval':>18}")
        for name, row in rows.items():
            ci = row.get("ratio_ci95")
            print(f"  {name:<18}{row['median_step_s'] * 1e3:>10.2f} ms{row.get('paired_ratio', float('nan')):>24.3f}"
                  f"{f'{ci[0]:.3f}-{ci[1]:.3f}' if ci else '-':>18}")
        write_json(cfg.out, {"provenance": provenance(cfg), "results": {
            "world_size": ctx.world_size, "backend": ctx.backend, "placement": cfg.placement, "compiler": cfg.compiler,
            "parameters": count_parameters(build(cfg, "cpu")), "gpt": OmegaConf.to_container(cfg.gpt),
            "warmup": cfg.warmup, "variants": rows}})
    minidist.shutdown()


@hydra_app("bench_compile")
def main(cfg: DictConfig) -> None:
    require_known("variants", cfg.variants, VARIANTS)
    require_known("placement", [cfg.placement], ["outer", "inner"])
    run_recipe(bench_main, cfg, path_keys=("out",))


if __name__ == "__main__":
    main()
