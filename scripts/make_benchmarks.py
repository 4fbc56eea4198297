"""Regenerate docs/benchmarks.md (and docs/img/) from real runs of recipes/compare.py.

    python scripts/make_benchmarks.py              # every run below (~15 min on 2 cores), then the document
    python scripts/make_benchmarks.py --render     # re-render from the runs already in outputs/benchmarks/
    python scripts/make_benchmarks.py --only main  # rerun some runs (by name prefix), then render

The runs: the main comparison (every strategy with its reference, and a timeline),
world sizes 1-4, a bucket-size sweep on a communication-bound model, ddp with and
without overlap on a compute-bound and a communication-bound model, and hybrid sharding
on a 2x2 mesh against native HSDP and flat ZeRO-3. Each run's full
report stays in outputs/benchmarks/NAME/. The component benchmarks measured issue by
issue (docs/benchmarks/components.md) are appended as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minidist.compare.plots import save_figure  # noqa: E402  (sets matplotlib's Agg backend)
from minidist.compare.report import bytes_table, markdown_table, memory_table, table_rows, targets_lines  # noqa: E402

OUT = ROOT / "outputs" / "benchmarks"
DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
COMPONENTS = ROOT / "docs" / "benchmarks" / "components.md"

ALL = "[ddp,native_ddp,zero1,native_zero1,zero2,ds_zero2,zero3,native_fsdp]"
SCALED = "[ddp,native_ddp,zero2,ds_zero2,zero3,native_fsdp]"
WIDE = ["model=mlp_wide", "data=fake_images", "trainer.micro_batch_size=8"]
WORLDS = (1, 2, 3, 4)
BUCKETS = (0.25, 1, 4, 25, 100)
HYBRID = "[hsdp3,native_hsdp,hsdp2,zero3,native_fsdp,ddp]"


def runs() -> dict[str, list[str]]:
    out = {"main": [f"compare.strategies={ALL}", "compare.timeline=true", "compare.steps=30"]}
    for n in WORLDS:
        out[f"scale_{n}"] = [f"launcher.nproc={n}", f"compare.strategies={SCALED}", "compare.warmup=3",
                             "compare.steps=15"]
    for b in BUCKETS:
        out[f"bucket_{b}"] = [*WIDE, "compare.strategies=[ddp,native_ddp,zero2]", f"compare.bucket_cap_mb={b}",
                              "compare.warmup=3", "compare.steps=15"]
    # Buckets small enough that there are several per step on both sides (else nothing can overlap).
    for model, extra in (("gpt_nano", ["compare.bucket_cap_mb=1"]), ("mlp_wide", [*WIDE, "compare.bucket_cap_mb=4"])):
        for overlap in ("true", "false"):
            out[f"bound_{model}_{overlap}"] = [*extra, "compare.strategies=[ddp,native_ddp]",
                                               f"+compare.overrides.ddp.overlap={overlap}", "compare.steps=30"]
    out["hybrid"] = ["launcher.nproc=4", f"compare.strategies={HYBRID}", "compare.shard_size=2", "compare.warmup=3",
                     "compare.steps=15"]
    return out


def command(overrides: list[str]) -> str:
    return "python recipes/compare.py " + " ".join(overrides)


def run(name: str, overrides: list[str]) -> None:
    target = OUT / name
    if target.exists():
        shutil.rmtree(target)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.time()
    print(f"[{name}] {command(overrides)}", flush=True)
    done = subprocess.run([sys.executable, str(ROOT / "recipes" / "compare.py"), *overrides,
                           f"hydra.run.dir={target}"], cwd=ROOT, env=env, capture_output=True, text=True)
    # Exit 1 with a report: a check failed, and the report says so. Without one: the run failed.
    if done.returncode not in (0, 1) or not (target / "results.json").is_file():
        raise SystemExit(f"[{name}] failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    print(f"[{name}] {time.time() - start:.0f} s", flush=True)


def load(name: str) -> dict:
    return json.loads((OUT / name / "results.json").read_text())


# --------------------------------------------------------------------------- sections

def ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def main_section(r: dict) -> list[str]:
    rows = r["rows"]
    headers, body = table_rows(rows)
    for png in ("loss.png", "step_time.png", "memory.png", "bytes_per_op.png"):
        shutil.copy(OUT / "main" / png, IMG / f"compare_{png}")
    timelines = [n for n in ("ddp", "ddp_no_overlap", "native_ddp", "zero2", "zero3", "native_fsdp")
                 if (OUT / "main" / f"timeline_{n}.png").exists()]
    for n in timelines:
        shutil.copy(OUT / "main" / f"timeline_{n}.png", IMG / f"timeline_{n}.png")
    hidden = {n: t for n, t in ((n, rows[n]["hidden_fraction"]) for n in rows) if t is not None}
    wins = [f"{n} ({rows[n]['time_ratio']:.3f})" for n in rows if rows[n]["kind"] == "minidist"
            and rows[n]["time_ratio"] is not None and round(rows[n]["time_ratio"], 2) <= 1.0]
    losses = [f"{n} ({rows[n]['time_ratio']:.3f})" for n in rows if rows[n]["kind"] == "minidist"
              and rows[n]["time_ratio"] is not None and round(rows[n]["time_ratio"], 2) > 1.0]
    nl = "\n"
    return [
        "## Ours vs native PyTorch and DeepSpeed (`recipes/compare.py`)",
        "",
        f"`{command(runs()['main'])}`",
        "",
        f"{r['model']} ({r['psi'] / 1e6:.2f}M parameters) on {r['data']}, {r['world_size']} ranks, global batch "
        f"{r['global_batch']}, AdamW, fp32; {r['warmup']} warm-up + {r['steps']} timed steps per strategy, all "
        "interleaved step by step in one invocation from the same weights on the same batches.",
        "",
        markdown_table(headers, body),
        "",
        *targets_lines(rows),
        "",
        "Reading:",
        f"- Equal results: every minidist strategy ends within {rows['ddp']['tolerance']:g} of its reference "
        f"(final parameter differences: " + ", ".join(f"{n} {rows[n]['final_param_diff']:.1e}" for n in rows
                                                       if rows[n]["kind"] == "minidist") + ").",
        f"- At or under the reference's step time: {', '.join(wins) or 'none'}; over it: {', '.join(losses) or 'none'}. "
        "Differences of 1-3% are within this machine's run-to-run noise (see the min-max spread).",
        "- Overlap: " + ", ".join(f"{n} {100 * h:.0f}%" for n, h in hidden.items()) + " of communication hidden "
        "behind compute. With one core per rank, a collective that runs during backward takes its core from "
        "the computation (gloo's threads and the training thread share it), so hiding communication does not "
        "shorten the step here as it does on GPUs, where communication has its own engine.",
        "- DeepSpeed's ZeRO-1/2 reduce gradients with all_reduce on CPU (twice the reduce_scatter bytes), and "
        "its ZeRO-3 keeps small parameters whole and reuses gathered ones between forward and backward (fewer "
        "all_gather bytes than the theory): the bytes table shows both.",
        "",
        "### Communication per step",
        "",
        bytes_table(rows),
        "",
        "### Model state per rank",
        "",
        memory_table(rows),
        "",
        "![loss](img/compare_loss.png) ![step time](img/compare_step_time.png)",
        "",
        "![memory](img/compare_memory.png) ![bytes per op](img/compare_bytes_per_op.png)",
        "",
        "### One step on a timeline",
        "",
        "Per rank: the phase (forward, backward, optimizer), compute (aten ops on the training thread) and "
        "each collective from start to end. `compare.timeline=true` writes these PNGs and Chrome traces "
        "(timeline_*.json, for ui.perfetto.dev); `trainer.timeline_step=N` does the same for one step of a "
        "training run.",
        "",
        *[f"![timeline {n}](img/timeline_{n}.png)" + nl for n in timelines],
    ]


def scaling_section(results: dict[int, dict]) -> list[str]:
    import matplotlib.pyplot as plt

    names = results[WORLDS[0]]["strategies"]
    headers = ["strategy", *(f"{n} rank{'s' if n > 1 else ''}: ms / samples/s / state MiB" for n in results)]
    body = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for name in names:
        cells, xs, t, thr, mem = [name], [], [], [], []
        for n, r in results.items():
            row = r["rows"][name]
            step = row["step_s"]["median"]
            state = row["model_state_bytes"]["total"] / 2**20
            cells.append(f"{ms(step)} / {r['global_batch'] / step:.0f} / {state:.2f}")
            xs.append(n), t.append(step * 1e3), thr.append(r["global_batch"] / step), mem.append(state)
        body.append(cells)
        style = "-" if name in ("ddp", "zero2", "zero3") else "--"
        for ax, ys in zip(axes, (t, thr, mem)):
            ax.plot(xs, ys, style, marker="o", label=name)
    for ax, label in zip(axes, ("step time (ms)", "samples/s (all ranks)", "model state per rank (MiB)")):
        ax.set(xlabel="ranks (processes on 2 cores)", ylabel=label)
        ax.set_xticks(list(WORLDS))
    axes[0].legend(fontsize=8)
    save_figure(fig, IMG / "scaling.png")
    return [
        "## Scaling: 1 to 4 ranks",
        "",
        *[f"- `{command(runs()[f'scale_{n}'])}`" for n in results],
        "",
        "gpt_nano, micro-batch 16 per rank (the global batch grows with the ranks).",
        "",
        markdown_table(headers, body),
        "",
        "![scaling](img/scaling.png)",
        "",
        "Reading: beyond 2 ranks the processes outnumber the 2 cores, so step time grows with the ranks and "
        "throughput stays flat: these runs show how each strategy's overheads and memory move with the world "
        "size, not speed-up. Model state per rank falls as 1/N for the sharded parts (ZeRO-2: gradients and "
        "optimizer state; ZeRO-3: everything), as the formulas say; replicated DDP stays constant.",
        "",
    ]


def bucket_section(results: dict[float, dict]) -> list[str]:
    import matplotlib.pyplot as plt

    first = next(iter(results.values()))
    names = first["strategies"]
    headers = ["bucket MiB", *(f"{n} ms (exposed comm)" for n in names)]
    body = [[f"{b:g}", *(f"{ms(r['rows'][n]['step_s']['median'])} ({ms(r['rows'][n]['exposed_comm_s'])})"
                         for n in names)] for b, r in results.items()]
    best = {n: min(results, key=lambda b: results[b]["rows"][n]["step_s"]["median"]) for n in names}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for n in names:
        bs = list(results)
        axes[0].plot(bs, [results[b]["rows"][n]["step_s"]["median"] * 1e3 for b in bs], marker="o", label=n)
        axes[1].plot(bs, [results[b]["rows"][n]["exposed_comm_s"] * 1e3 for b in bs], marker="o", label=n)
    for ax, label in zip(axes, ("step time (ms)", "exposed communication (ms, profiled step)")):
        ax.set(xscale="log", xlabel="bucket_cap_mb", ylabel=label)
    axes[0].legend()
    save_figure(fig, IMG / "buckets.png")
    return [
        "## Bucket size (communication-bound model)",
        "",
        f"`{command(runs()['bucket_1'])}` with compare.bucket_cap_mb in {list(BUCKETS)} (native DDP gets the same "
        "cap; for zero2 it is the flat group size).",
        "",
        f"mlp_wide: {first['psi'] / 1e6:.1f}M parameters, micro-batch 8 of 32x32 images: "
        f"{first['psi'] * 4 / 2**20:.0f} MiB of gradients per step for little compute.",
        "",
        markdown_table(headers, body),
        "",
        "Best setting measured: " + ", ".join(f"{n} {best[n]:g} MiB" for n in names) + ".",
        "",
        "ddp / native_ddp at the same cap: " + ", ".join(
            f"{b:g} MiB {r['rows']['ddp']['time_ratio']:.3f}" for b, r in results.items()
            if r["rows"].get("ddp", {}).get("time_ratio") is not None) +
        ". On this communication-bound model our ddp stays a few percent behind native DDP although "
        "the buckets and the bytes are the same (bucket_closing=reach; 10 parameters, so per-parameter Python "
        "work is small). Not pinned down yet: the difference is in backward (torch.profiler puts ~1 ms more "
        "per step under our gradient hooks, whose Python runs on the backward thread while gloo's threads "
        "move the buckets). On the compute-bound GPT above it is within the run-to-run noise.",
        "",
        "![buckets](img/buckets.png)",
        "",
        "Reading: small buckets mean many collectives, each paying gloo's per-call latency; large ones leave "
        "one big all_reduce after backward with nothing to overlap. The default 25 MiB against the best "
        "measured: " + ", ".join(
            f"{n} {results[25]['rows'][n]['step_s']['median'] / results[best[n]]['rows'][n]['step_s']['median']:.3f}x"
            for n in names if 25 in results) + ".",
        "",
    ]


def bound_section(results: dict[tuple[str, str], dict]) -> list[str]:
    headers = ["model", "ddp overlap", "ddp ms", "native_ddp ms", "ddp / native", "ddp hidden", "native hidden"]
    body = []
    for (model, overlap), r in results.items():
        rows = r["rows"]
        pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"
        body.append([model, overlap, ms(rows["ddp"]["step_s"]["median"]), ms(rows["native_ddp"]["step_s"]["median"]),
                     f"{rows['ddp']['time_ratio']:.3f}", pct(rows["ddp"]["hidden_fraction"]),
                     pct(rows["native_ddp"]["hidden_fraction"])])
    gain = {}
    for model in ("gpt_nano", "mlp_wide"):
        on, off = results.get((model, "true")), results.get((model, "false"))
        if on and off:
            gain[model] = on["rows"]["ddp"]["time_ratio"] / off["rows"]["ddp"]["time_ratio"]
    return [
        "## Where overlap pays: compute-bound vs communication-bound",
        "",
        *[f"- `{command(runs()[f'bound_{m}_{o}'])}`" for m, o in results],
        "",
        markdown_table(headers, body),
        "",
        "Overlap's effect (ddp/native ratio with overlap over the ratio without): " +
        ", ".join(f"{m} {g:.3f}" for m, g in gain.items()) + " (below 1: overlap made ddp faster).",
        "",
        "Reading: on the GPT, communication is a few percent of the step, so there is little to hide. On the "
        "wide MLP, communication is most of the step, but on this machine the bytes are moved by the same "
        "cores that compute (gloo's threads and the training thread share one core per rank): overlap can "
        "reorder the work but not add bandwidth, so hiding communication buys little or nothing here. On GPUs "
        "the copy engines and NVLink/NICs move the bytes while the SMs compute, which is where overlap pays.",
        "",
    ]


def hybrid_section(r: dict) -> list[str]:
    rows = r["rows"]
    headers, body = table_rows(rows)
    return [
        "## Hybrid sharding on a 2x2 mesh (4 ranks on one machine)",
        "",
        f"`{command(runs()['hybrid'])}`",
        "",
        f"{r['model']} ({r['psi'] / 1e6:.2f}M parameters), {r['world_size']} ranks as 2 replicas x shard groups "
        f"of 2, global batch {r['global_batch']}; {r['warmup']} warm-up + {r['steps']} timed steps, interleaved.",
        "",
        markdown_table(headers, body),
        "",
        *targets_lines(rows),
        "",
        "### Communication per step",
        "",
        bytes_table(rows),
        "",
        "Reading: the hybrids' all_reduce is the 1/S shard across the replicas (the only traffic that would "
        "cross hosts) and their gathers and reduce_scatters stay in the shard group of 2, so they move fewer "
        "bytes per rank than zero3 over all 4; on one machine every link is loopback, so this measures the "
        "implementations, not the network (docs/scale.md models and measures that).",
        "",
    ]


def components() -> list[str]:
    """The component benchmarks, one heading level down."""
    text = COMPONENTS.read_text().splitlines()
    return ["#" + line if line.startswith("#") else line for line in text]


def render() -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    main = load("main")
    env = main["environment"]
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python scripts/make_benchmarks.py` from the runs it makes (each run's full report, CSV, "
        "JSON, TensorBoard and plots stay in outputs/benchmarks/NAME/). Do not edit by hand.",
        "",
        f"Machine: {env['cores']} CPU cores, no GPU; torch {env['torch']}, DeepSpeed {env['deepspeed']}, "
        f"Python {env['python']}; backend {env['backend']} over loopback, OMP_NUM_THREADS=1 per rank. "
        "Times are medians of the slowest rank's step; ratios compare strategies interleaved in one invocation.",
        "",
        *main_section(main),
        "",
        *scaling_section({n: load(f"scale_{n}") for n in WORLDS if (OUT / f"scale_{n}" / "results.json").exists()}),
        *bucket_section({b: load(f"bucket_{b}") for b in BUCKETS if (OUT / f"bucket_{b}" / "results.json").exists()}),
        *bound_section({(m, o): load(f"bound_{m}_{o}") for m in ("gpt_nano", "mlp_wide") for o in ("true", "false")
                        if (OUT / f"bound_{m}_{o}" / "results.json").exists()}),
        *(hybrid_section(load("hybrid")) if (OUT / "hybrid" / "results.json").exists() else []),
        *components(),
    ]
    DOC.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {DOC} and {IMG}/")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", action="store_true", help="only render from existing runs")
    parser.add_argument("--only", nargs="*", help="rerun only the runs whose names start with these")
    args = parser.parse_args(argv)
    if not args.render:
        for name, overrides in runs().items():
            if args.only is None or any(name.startswith(p) for p in args.only):
                run(name, overrides)
    render()


if __name__ == "__main__":
    main()
