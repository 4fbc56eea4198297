"""Muon under ZeRO, measured: optimizer state per rank, bytes per step, and step time against DDP.

    .venv/bin/python scripts/measure_muon.py                # -> docs/benchmarks/data/muon.json

A GPT (minidist.train.models, 4 layers of 256) on 2 local ranks, Muon over the blocks' weight
matrices and AdamW over the rest, the recipe Muon's users write. Per variant (DataParallel, ZeRO 1-3
with [Muon, AdamW], and ZeRO 1-3 with AdamW alone, for the bytes a whole-matrix layout adds): the
optimizer state each rank holds (live tensors) beside the formula, 4 bytes a Muon element and 8
an AdamW element over N; the bytes each rank sends per step (the CommTracer's). Then step times,
DataParallel with Muon and ZeRO-1 with Muon interleaved step by step (each rank orthogonalises
only the matrices it owns under ZeRO): the median of the paired ratios and its 95% bootstrap
interval. scripts/make_benchmarks.py renders the result into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "lib"))

LAYERS, WIDTH, VOCAB, BLOCK, BATCH = 4, 256, 512, 64, 8
NAMES = ("DataParallel", "ZeRO-1", "ZeRO-2", "ZeRO-3")  # by stage (0: none)


def optimizers(net, muon: bool):
    import torch
    hidden = [p for n, p in net.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    rest = [p for n, p in net.named_parameters() if not (n.startswith("blocks.") and p.dim() == 2)]
    adamw = torch.optim.AdamW(rest if muon else list(net.parameters()), lr=1e-3)
    return [torch.optim.Muon(hidden, lr=0.02), adamw] if muon else [adamw], sum(p.numel() for p in hidden)


def build(stage: int, muon: bool):
    """Stage 0: DataParallel; 1-3: ShardedDataParallel at that stage."""
    import torch

    import minidist
    from minidist.train.models import GPT
    torch.manual_seed(0)
    net = GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=LAYERS, n_head=4, n_embd=WIDTH)
    opts, hidden = optimizers(net, muon)
    if stage == 0:
        return minidist.DataParallel(net), opts, hidden
    model = minidist.ShardedDataParallel(net, opts if len(opts) > 1 else opts[0], stage=stage)
    return model, model.optimizers, hidden


def step(model, opts, seed: int) -> None:
    import torch

    from minidist.train.models import GPT
    rank = torch.distributed.get_rank()
    x = torch.randint(0, VOCAB, (BATCH, BLOCK), generator=torch.Generator().manual_seed(1000 * seed + rank))
    GPT.loss(model(x), x).backward()
    for o in opts:
        o.step()
        o.zero_grad()


def rank_main(steps: int) -> dict | None:
    import torch

    import minidist
    from minidist import comm
    from minidist.measure import optimizer_tensors
    ctx = minidist.init_distributed(backend="gloo")
    torch.set_num_threads(1)
    out = {"variants": {}, "world_size": ctx.world_size}
    for stage in range(4):
        for muon in (True, False):
            model, opts, hidden = build(stage, muon)
            step(model, opts, 0)  # the optimizer state exists from the first step on
            with comm.CommTracer() as tracer:
                step(model, opts, 1)
            state = sum(t.numel() * t.element_size() for o in opts for t in optimizer_tensors(o) if t.dim())
            psi = sum(p.numel() for p in (model.module.parameters()))
            out["psi"], out["hidden"] = psi, hidden
            out["variants"][f"{NAMES[stage]} {'Muon + AdamW' if muon else 'AdamW'}"] = {
                "state_bytes": comm.all_gather_object(state), "sent_bytes": tracer.total_sent_bytes}
    pair = {k: build(k, True) for k in (0, 1)}
    times = {k: [] for k in pair}
    for s in range(2 + steps):
        for k in ((0, 1) if s % 2 else (1, 0)):  # the order alternates
            comm.barrier()
            t0 = time.perf_counter()
            step(pair[k][0], pair[k][1], s)
            seconds = comm.max_over_ranks(time.perf_counter() - t0)
            if s >= 2:
                times[k].append(seconds)
    out["step_s"] = {NAMES[k]: v for k, v in times.items()}
    minidist.shutdown()
    return out if ctx.rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    import torch
    from doc_pipeline import provenance, record

    from minidist_tools.benchmarking import paired_ratio
    from minidist.train.app import run_local
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=str(ROOT / "docs/benchmarks/data/muon.json"))
    a = p.parse_args(argv)
    start = time.time()
    result = run_local(rank_main, nproc=2, args=(a.steps,))[0]
    result["zero1_over_ddp"] = paired_ratio(result["step_s"][NAMES[1]], result["step_s"][NAMES[0]])
    command = "python scripts/measure_muon.py" + (f" --steps {a.steps}" if a.steps != 30 else "")
    record(Path(a.out), result, provenance(command, torch.__version__), time.time() - start)
    print(f"wrote {a.out}: zero1/ddp step time {result['zero1_over_ddp']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
