"""Data parallelism step by step (tutorial/walkthrough/), each step checked against native DDP.

    python recipes/walkthrough.py                 # 2 local ranks
    python recipes/walkthrough.py steps=20 bucket_cap_mb=0.5
    torchrun --nproc_per_node 2 recipes/walkthrough.py

Every step trains the same GPT from the same weights on the same batches as native DDP. One line
per step: the largest difference of its final parameters from native DDP's, its median step time
(the slowest rank's) and its exposed communication (time the training thread waited for it).
The last step of each runs under the profiler: timeline_<step>.png and .json (Chrome trace,
ui.perfetto.dev) in the run directory show the all_reduces moving into backward in step 3.
Writes results.json there too. Exit status 1 if a step's parameters drift from native DDP's by
more than `tolerance`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.profiler import record_function

import minidist
from minidist import comm
from minidist_tools.benchmarking import slowest
from minidist.train.app import run_recipe
from minidist.train.app import hydra_app
from minidist.train.models import GPT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tutorial/ lives in the checkout, not the package
from tutorial.walkthrough import STEPS, Zero1DataParallel  # noqa: E402


def build(name: str, net: torch.nn.Module, cfg):
    """(model, finish: after backward, step: the optimizer step) for a walkthrough step or native DDP."""
    adamw = lambda params: torch.optim.AdamW(params, lr=float(cfg.lr))  # noqa: E731
    if name == "native DDP":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(net, bucket_cap_mb=float(cfg.bucket_cap_mb))
        opt = adamw(net.parameters())
        return model, lambda: None, lambda: (opt.step(), opt.zero_grad(set_to_none=True))
    cls = STEPS[name]
    if cls is Zero1DataParallel:
        model = cls(net, adamw)
        return model, model.finish_gradients, model.step
    model = cls(net) if name == "1 naive" else cls(net, bucket_cap_mb=float(cfg.bucket_cap_mb))
    opt = adamw(net.parameters())
    return model, model.finish_gradients, lambda: (opt.step(), opt.zero_grad(set_to_none=True))


def batch(cfg, step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own slice of the batch
    x = torch.randint(0, int(cfg.gpt.vocab_size), (int(cfg.batch), int(cfg.gpt.block_size)), generator=g)
    return x, torch.roll(x, -1, 1)


def train(name: str, cfg, rank: int, world_size: int, out_dir: Path) -> dict:
    """Train `name` for warmup + steps (timed) + 1 (profiled) steps; its final parameters and figures."""
    from minidist.profiling import timeline_plot
    from minidist.profiling import record_step, write_chrome_trace

    torch.manual_seed(int(cfg.seed) + rank)  # different weights on every rank: the broadcast must fix that
    net = GPT(vocab_size=int(cfg.gpt.vocab_size), block_size=int(cfg.gpt.block_size), n_layer=int(cfg.gpt.n_layer),
              n_head=int(cfg.gpt.n_head), n_embd=int(cfg.gpt.n_embd))
    model, finish, optimizer_step = build(name, net, cfg)

    def one_step(k: int) -> None:
        x, y = batch(cfg, k, rank)
        with record_function("minidist.forward"):
            loss = GPT.loss(model(x), y)
        with record_function("minidist.backward"):
            loss.backward()
        with record_function("minidist.optimizer"):
            finish()
            optimizer_step()

    times, exposed, calls = [], [], 0
    total = int(cfg.warmup) + int(cfg.steps)
    for k in range(total):
        comm.barrier()
        with comm.CommTracer() as tracer:
            start = time.perf_counter()
            one_step(k)
            elapsed = time.perf_counter() - start
        if k >= int(cfg.warmup):
            times.append(slowest(elapsed))
            exposed.append(slowest(tracer.blocked_s))
            calls = len(tracer.records)  # collectives per step
    comm.barrier()
    trace = record_step(lambda: one_step(total), world_size, model, traced=name != "native DDP")
    traces = dict(enumerate(comm.all_gather_object(trace)))
    stem = out_dir / f"timeline_{name.replace(' ', '_')}"
    if rank == 0:
        write_chrome_trace(traces, stem.with_suffix(".json"), name)
        timeline_plot(traces, f"walkthrough: {name}", stem.with_suffix(".png"))
    hidden = [t["hidden_fraction"] for t in traces.values() if t["hidden_fraction"] is not None]
    return {"params": {n: p.detach().clone() for n, p in net.named_parameters()},
            "step_s": statistics.median(times),
            "exposed_comm_s": statistics.median(exposed) if name != "native DDP" else None,
            "collectives_per_step": calls if name != "native DDP" else None,
            "hidden_fraction": sum(hidden) / len(hidden) if hidden else None}


def walkthrough_main(cfg_dict: dict) -> None:
    cfg = OmegaConf.create(cfg_dict)
    torch.set_num_threads(1)
    ctx = minidist.init_distributed(backend="gloo", timeout_s=float(cfg.timeout_s))
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    minidist.print0(f"walkthrough: {ctx.world_size} ranks, gloo; {cfg.warmup} warm-up + {cfg.steps} timed steps "
                    f"+ 1 profiled, AdamW, each against native DDP on the same weights and batches\n")
    reference = train("native DDP", cfg, ctx.rank, ctx.world_size, out_dir)
    rows = {"native DDP": {"max_diff": 0.0, **{k: v for k, v in reference.items() if k != "params"}}}
    for name in STEPS:
        r = train(name, cfg, ctx.rank, ctx.world_size, out_dir)
        diff = max((r["params"][n] - p).abs().max().item() for n, p in reference["params"].items())
        rows[name] = {"max_diff": comm.max_over_ranks(diff), **{k: v for k, v in r.items() if k != "params"}}
    if ctx.rank == 0:
        print(f"{'step':<12}{'max |diff| vs native DDP':>26}{'step ms':>10}{'exposed comm ms':>17}{'hidden':>8}")
        for name, r in rows.items():
            exposed = f"{r['exposed_comm_s'] * 1e3:.1f}" if r["exposed_comm_s"] is not None else "-"
            hidden = f"{100 * r['hidden_fraction']:.0f}%" if r["hidden_fraction"] is not None else "-"
            print(f"{name:<12}{r['max_diff']:>26.2e}{r['step_s'] * 1e3:>10.1f}{exposed:>17}{hidden:>8}")
        results = {"world_size": ctx.world_size, "tolerance": float(cfg.tolerance), "steps": int(cfg.steps),
                   "warmup": int(cfg.warmup), "bucket_cap_mb": float(cfg.bucket_cap_mb),
                   "parameters": sum(p.numel() for p in reference["params"].values()), "rows": rows,
                   "torch": torch.__version__}
        (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        print(f"\nwrote {out_dir}/results.json and timeline_*.png / .json", flush=True)
    comm.barrier()
    minidist.shutdown()


def drifted(out_dir: Path) -> list[str]:
    results = json.loads((out_dir / "results.json").read_text())
    return [n for n, r in results["rows"].items() if r["max_diff"] > results["tolerance"]]


@hydra_app("walkthrough")
def main(cfg: DictConfig) -> None:
    run_recipe(walkthrough_main, cfg, path_keys=("out_dir",))
    bad = drifted(Path(cfg.out_dir).absolute())
    if bad:
        print(f"error: {', '.join(bad)} drifted from native DDP by more than tolerance={cfg.tolerance:g}",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
