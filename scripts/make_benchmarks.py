"""Regenerate docs/benchmarks.md (and docs/img/) from real runs of recipes/compare.py.

    python scripts/make_benchmarks.py               # every run below (~15 min on 2 cores), then the document
    python scripts/make_benchmarks.py --only main   # rerun some runs (by name prefix), then render
    python scripts/make_benchmarks.py --render-only # rewrite the document from the committed data, run nothing

The runs: the main comparison (every strategy with its reference, and a timeline),
world sizes 1-4, a bucket-size sweep on a communication-bound model, ddp with and
without overlap on a compute-bound and a communication-bound model, and hybrid sharding
on a 2x2 mesh against native HSDP and flat ZeRO-3. Each run's full report stays in
outputs/benchmarks/NAME/; what the document is rendered from is committed, one JSON per run,
in docs/benchmarks/data/compare_NAME.json, with the commit, torch version, command and date
that produced it. Every judgement in the document is computed from those numbers: a step-time
ratio carries the 95% bootstrap interval of its median over the interleaved step pairs, and
a target counts as met only when the interval's upper end is at or under it.
"""

from __future__ import annotations

import functools
import math
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minidist_tools.benchmarking import variant_spec  # noqa: E402
from minidist_tools.report import save_figure  # noqa: E402  (sets matplotlib's Agg backend)
from minidist_tools.theory import model_state_bytes  # noqa: E402
from minidist_tools.report import (bytes_table, interval, markdown_table, memory_table, speed_verdict,  # noqa: E402
                                     table_rows, targets_lines)
sys.path.insert(0, str(ROOT / "scripts" / "lib"))
import diloco_doc  # noqa: E402
from doc_pipeline import Document, fill_quotes, load as load_record, main, provenance, record, run_recipe  # noqa: E402

OUT = ROOT / "outputs" / "benchmarks"
DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
DATA = ROOT / "docs" / "benchmarks" / "data"
# Kept from each run's results.json: what the sections render (not the per-step series and
# per-rank timelines, which stay in outputs/benchmarks/NAME/).
KEPT = ("environment", "rows", "strategies", "model", "psi", "data", "world_size", "global_batch", "warmup", "steps",
        "shard_sizes", "timeline_files")

ALL = "[ddp,native_ddp,zero1,native_zero1,zero2,ds_zero2,zero3,native_fsdp]"
SCALED = "[ddp,native_ddp,zero2,ds_zero2,zero3,native_fsdp]"
WIDE = ["model=mlp_wide", "data=fake_images", "trainer.micro_batch_size=8"]
WORLDS = (1, 2, 3, 4)
BUCKETS = (0.25, 1, 4, 25, 100)
HYBRID = "[hsdp3,native_hsdp,hsdp2,zero3,native_fsdp,ddp]"
TIMELINES = ("ddp", "ddp_no_overlap", "native_ddp", "zero2", "zero3", "native_fsdp")
ACCUMULATED = ("zero2", "zero3", "native_fsdp")  # each beside its variant with strategy.accumulate=sharded


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
    out["accumulate"] = [
        f"compare.strategies=[{','.join(n + v for n in ACCUMULATED for v in ('', '_sharded'))}]", "trainer.grad_accum=4",
        "+compare.variants={" + ",".join(f"{n}_sharded:{{of:{n},accumulate:sharded}}" for n in ACCUMULATED) + "}",
        "compare.warmup=3", "compare.steps=15"]
    out["hybrid"] = ["launcher.nproc=4", f"compare.strategies={HYBRID}", "compare.shard_size=2", "compare.warmup=3",
                     "compare.steps=15"]
    return out


def command(overrides: list[str]) -> str:
    return "python recipes/compare.py " + " ".join(overrides)


def run(name: str, overrides: list[str]) -> None:
    # Exit 1 with a report: a check failed, and the report says so. Without one: the run failed.
    results, _ = run_recipe("compare.py", overrides, OUT / name, ok_exits=(0, 1))
    record(data_file(name), {k: results[k] for k in KEPT if k in results},
           provenance(command(overrides), results["environment"]["torch"]), sort_keys=True)
    copy_figures(name)


def data_file(name: str) -> Path:
    return DATA / f"compare_{name}.json"


def load(name: str) -> dict:
    """The results of run `name` (its provenance: load_record(data_file(name)))."""
    return load_record(data_file(name))["results"]


def have(name: str) -> bool:
    return data_file(name).is_file()


def copy_figures(name: str) -> None:
    """The main run's plots and timelines, drawn by recipes/compare.py, into docs/img/."""
    if name != "main":
        return
    IMG.mkdir(parents=True, exist_ok=True)
    for png in ("loss.png", "step_time.png", "memory.png", "bytes_per_op.png"):
        shutil.copy(OUT / "main" / png, IMG / f"compare_{png}")
    for n in TIMELINES:
        if (OUT / "main" / f"timeline_{n}.png").exists():
            shutil.copy(OUT / "main" / f"timeline_{n}.png", IMG / f"timeline_{n}.png")


# --------------------------------------------------------------------------- sections

def ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def verdicts(rows: dict) -> str:
    """Our strategies grouped by what their step-time intervals say about the target (<= 1.00)."""
    groups: dict[str, list[str]] = {}
    for n, row in rows.items():
        if row["kind"] == "minidist" and row["time_ratio"] is not None:
            groups.setdefault(speed_verdict(row).split(" (")[0], []).append(f"{n} {row['time_ratio']:.3f}{interval(row)}")
    said = {"met": "at or under the reference's step time (the whole interval <= 1.00)",
            "NOT met": "slower than the reference (the whole interval above 1.00)",
            "undecided": "not told apart from the reference by this run (the interval spans 1.00)"}
    return "; ".join(f"{said[k]}: {', '.join(v)}" for k, v in groups.items()) or "no ratios"


def main_section(r: dict) -> list[str]:
    rows = r["rows"]
    headers, body = table_rows(rows)
    timelines = [n for n in TIMELINES if f"timeline_{n}.png" in r.get("timeline_files", [])]
    hidden = {n: t for n, t in ((n, rows[n]["hidden_fraction"]) for n in rows) if t is not None}
    ours = [n for n in rows if rows[n]["kind"] == "minidist" and rows[n]["final_param_diff"] is not None]
    worst = max(rows[n]["final_param_diff"] for n in ours)
    tolerance = rows[ours[0]]["tolerance"]
    nl = "\n"
    return [
        "## Ours vs native PyTorch and DeepSpeed (`recipes/compare.py`)",
        "",
        f"`{command(runs()['main'])}`",
        "",
        f"{r['model']} ({r['psi'] / 1e6:.2f}M parameters) on {r['data']}, {r['world_size']} ranks, global batch "
        f"{r['global_batch']}, AdamW, fp32; {r['warmup']} warm-up + {r['steps']} timed steps per strategy, all "
        "interleaved step by step in one invocation from the same weights on the same batches. `/ ref [95%]`: "
        "the median step time over the reference's, and the 95% bootstrap interval of the median of the "
        "step-by-step ratios.",
        "",
        markdown_table(headers, body),
        "",
        *targets_lines(rows),
        "",
        "Reading:",
        f"- Equal results: {'every' if worst <= tolerance else 'NOT every'} minidist strategy ends within "
        f"{tolerance:g} of its reference (largest final parameter difference {worst:.1e}; " +
        ", ".join(f"{n} {rows[n]['final_param_diff']:.1e}" for n in ours) + ").",
        f"- Step time: {verdicts(rows)}.",
        "- Communication hidden behind compute (profiled step): " +
        ", ".join(f"{n} {100 * h:.0f}%" for n, h in hidden.items()) + ". With one core per rank, a collective "
        "that runs during backward takes its core from the computation (gloo's threads and the training thread "
        "share it); the overlap section below measures what hiding buys here.",
        *deepspeed_bytes_lines(rows),
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


def total_bytes(row: dict, op: str, theory: bool = False) -> float:
    return (row["theory_bytes_per_step"] if theory else row["bytes_per_step"]).get(op) or 0.0


def deepspeed_bytes_lines(rows: dict) -> list[str]:
    """DeepSpeed's bytes against ours, as measured (the ops each uses, and how many bytes)."""
    out = []
    if "ds_zero2" in rows and "zero2" in rows:
        ds, ours = rows["ds_zero2"], rows["zero2"]
        ds_reduce = total_bytes(ds, "all_reduce") + total_bytes(ds, "reduce_scatter")
        ours_reduce = total_bytes(ours, "reduce_scatter")
        if ours_reduce:
            out.append(f"- Gradient reduction bytes per step, ds_zero2 / zero2: {ds_reduce / ours_reduce:.2f}x "
                       f"(ds_zero2: all_reduce {total_bytes(ds, 'all_reduce') / 2**20:.2f} MiB, reduce_scatter "
                       f"{total_bytes(ds, 'reduce_scatter') / 2**20:.2f} MiB; zero2: reduce_scatter "
                       f"{ours_reduce / 2**20:.2f} MiB).")
    if "ds_zero3" in rows:
        ds = rows["ds_zero3"]
        measured, theory = total_bytes(ds, "all_gather"), total_bytes(ds, "all_gather", theory=True)
        if theory:
            out.append(f"- ds_zero3's all_gather bytes are {measured / theory:.2f}x the ZeRO-3 theory "
                       f"({measured / 2**20:.2f} vs {theory / 2**20:.2f} MiB per step).")
    return out


def scaling_section(results: dict[int, dict], img: Path) -> list[str]:
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
        style = "-" if variant_spec(name).kind == "minidist" else "--"  # ours solid, the references dashed
        for ax, ys in zip(axes, (t, thr, mem)):
            ax.plot(xs, ys, style, marker="o", label=name)
    for ax, label in zip(axes, ("step time (ms)", "samples/s (all ranks)", "model state per rank (MiB)")):
        ax.set(xlabel="ranks (processes on 2 cores)", ylabel=label)
        ax.set_xticks(list(WORLDS))
    axes[0].legend(fontsize=8)
    save_figure(fig, img / "scaling.png")
    first, last = min(results), max(results)
    cores = results[last]["environment"]["cores"]
    throughput = lambda n, name: results[n]["global_batch"] / results[n]["rows"][name]["step_s"]["median"]
    state = lambda n, name: results[n]["rows"][name]["model_state_bytes"]["total"]
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
        f"Reading: this machine has {cores} cores, so from {cores + 1} ranks on the processes share them; these "
        "runs show how each strategy's overheads and memory move with the world size, not speed-up.",
        f"- Throughput at {last} ranks over {cores}: " +
        ", ".join(f"{n} {throughput(last, n) / throughput(cores, n):.2f}x" for n in names if cores in results) + ".",
        f"- Model state per rank at {last} ranks over {first}: " +
        ", ".join(f"{n} {state(last, n) / state(first, n):.2f}x" for n in names) +
        f" (1/{last} = {1 / last:.2f} for state that is fully sharded).",
        "",
    ]


def bucket_section(results: dict[float, dict], img: Path) -> list[str]:
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
    save_figure(fig, img / "buckets.png")
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
        "ddp / native_ddp at the same cap, with the 95% interval: " + ", ".join(
            f"{b:g} MiB {r['rows']['ddp']['time_ratio']:.3f}{interval(r['rows']['ddp'])} "
            f"({speed_verdict(r['rows']['ddp']).split(' (')[0]})" for b, r in results.items()
            if r["rows"].get("ddp", {}).get("time_ratio") is not None) + ".",
        "",
        "![buckets](img/buckets.png)",
        "",
        "Small buckets mean many collectives, each paying gloo's per-call latency; large ones leave one big "
        "all_reduce after backward with nothing to overlap. The default 25 MiB against the best measured: " +
        ", ".join(f"{n} {results[25]['rows'][n]['step_s']['median'] / results[best[n]]['rows'][n]['step_s']['median']:.3f}x"
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
    share = {model: r["rows"]["native_ddp"]["comm_s"] / r["rows"]["native_ddp"]["step_s"]["median"]
             for (model, overlap), r in results.items() if overlap == "false"}
    return [
        "## Where overlap pays: compute-bound vs communication-bound",
        "",
        *[f"- `{command(runs()[f'bound_{m}_{o}'])}`" for m, o in results],
        "",
        markdown_table(headers, body),
        "",
        "Overlap's effect (ddp/native ratio with overlap over the ratio without; below 1: overlap made ddp "
        "faster): " + ", ".join(f"{m} {g:.3f}" for m, g in gain.items()) + ". Communication's share of native "
        "DDP's step (profiled): " + ", ".join(f"{m} {100 * x:.0f}%" for m, x in share.items()) + ".",
        "",
        "On this machine the bytes are moved by the same cores that compute (gloo's threads and the training "
        "thread share one core per rank): overlap can reorder the work but not add bandwidth. On GPUs the copy "
        "engines and NVLink/NICs move the bytes while the SMs compute, which is where overlap pays.",
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
        "The hybrids' all_reduce is the 1/S shard across the replicas (the only traffic that would cross "
        "hosts); their gathers and reduce_scatters stay in the shard group. Bytes sent per rank and step, all "
        "ops: " + ", ".join(f"{n} {sum(rows[n]['bytes_per_step'].values()) / 2**20:.2f} MiB" for n in rows) +
        ". On one machine every link is loopback, so this measures the implementations, not the network "
        "(docs/scale.md models and measures that).",
        "",
    ]


def span(values: list[float], fmt) -> str:
    """"a-b" from the least to the most of `values`, or "a" where they round alike."""
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low}-{high}"


def accumulate_section(r: dict) -> list[str]:
    """strategy.accumulate local against sharded at 4 micro-batches: peak memory, bytes, step time."""
    rows, n, psi = r["rows"], r["world_size"], r["psi"]
    headers, body = table_rows(rows)
    saved_in_theory = 4 * psi * (n - 1) / n  # the full gradient less its shard
    pairs = [(rows[b], rows[b + "_sharded"]) for b in ACCUMULATED]
    lines = []
    for a, b in pairs:
        rs = b["bytes_per_step"]["reduce_scatter"] / a["bytes_per_step"]["reduce_scatter"] if \
            "reduce_scatter" in a["bytes_per_step"] else None  # fully_shard's bytes are not traced
        lines.append(f"- {a['strategy']}: peak {mib(a['peak_bytes'])} local, {mib(b['peak_bytes'])} sharded "
                     f"({mib(a['peak_bytes'] - b['peak_bytes'])} less)" +
                     (f"; {rs:.2f}x the reduce_scatter bytes" if rs else "") +
                     f"; step time {b['time_ratio']:.3f}{interval(b)} of local's.")
    zero2 = rows["zero2"]["model_state_bytes"]["total"] / model_state_bytes(variant_spec("zero2"), psi, n)
    return [
        "## Accumulation: full gradients or the shard",
        "",
        f"`{command(runs()['accumulate'])}`",
        "",
        f"{r['model']} ({r['psi'] / 1e6:.2f}M parameters), {n} ranks, 4 micro-batches per step (global batch "
        f"{r['global_batch']}); {r['warmup']} warm-up + {r['steps']} timed steps, interleaved. `local` (the "
        "default) accumulates the full gradient under no_sync and reduces it once a step; `sharded` "
        "reduce_scatters every micro-batch into the gradient shard (FSDP2's default loop, DeepSpeed's stage 2).",
        "",
        markdown_table(headers, body),
        "",
        *lines,
        f"- The full gradient less its shard, 4Ψ(N-1)/N: {mib(saved_in_theory)}: what sharded should save at the "
        "peak, where the full gradient and the activations are alive together.",
        f"- The trade-off, from these rows: sharded saves {span([a['peak_bytes'] - b['peak_bytes'] for a, b in pairs], mib)}"
        f" per rank at the peak for {span([b['time_ratio'] for _, b in pairs], '{:.2f}'.format)}x the step time and "
        "4x the gradient's bytes: worth it where memory, not the network, is short.",
        f"- zero2's model state (gradients complete, before the step): "
        f"{mib(rows['zero2']['model_state_bytes']['total'])}, {zero2:.3f}x the ZeRO paper's 4Ψ + 12Ψ/N (its reduce "
        "buffers are freed after each backward).",
        "",
        "### Communication per step",
        "",
        bytes_table(rows),
        "",
        memory_table(rows),
        "",
    ]


CHECKPOINT = DATA / "checkpoint_async.json"
CHECKPOINT_COMMAND = ["rounds=4", "steps=40", "ckpt_every=10", "micro_batch_size=1"]
CHECKPOINT_TARGET = 0.2  # async blocks training under a fifth of the synchronous time


def checkpoint_run() -> None:
    """recipes/bench_checkpoint.py: sync vs async checkpoints, paired rounds."""
    import torch

    results, wall = run_recipe("bench_checkpoint.py", CHECKPOINT_COMMAND, OUT / "checkpoint_async")
    record(CHECKPOINT, results, provenance("python recipes/bench_checkpoint.py " + " ".join(CHECKPOINT_COMMAND),
                                            torch.__version__), wall_s=wall)


def checkpoint_section() -> list[str]:
    if not CHECKPOINT.is_file():
        return []
    d = load_record(CHECKPOINT)
    r, p = d["results"], d["provenance"]
    m, ratio = r["medians"], r["blocked_ratio"]
    lo, hi = ratio["ci"]
    met = "met" if hi < CHECKPOINT_TARGET else "NOT met" if lo >= CHECKPOINT_TARGET else "undecided at this noise"
    body = [[way, f"{m[way]['blocked_s']:.2f} s", f"{m[way]['write_s']:.2f} s", f"{m[way]['step_s'] * 1e3:.0f} ms"]
            for way in ("sync", "async")]
    return [
        "## Checkpoints that do not stop training",
        "",
        f"`{p['command']}` ({p['date']}, commit {p['commit'][:12]}): {r['model']} with `strategy={r['strategy']}` on "
        f"{r['world_size']} ranks, {r['steps']} steps, a checkpoint every {r['ckpt_every']}; {r['rounds']} rounds, "
        "each running both ways in alternating order. Medians over the rounds of each run's summary.json:",
        "",
        markdown_table(["checkpoints", "training blocked (all saves)", "writing the files", "median step"], body),
        "",
        f"Async blocks training {ratio['median']:.3f}x as long as synchronous saves (median of the rounds' ratios, "
        f"95% interval {lo:.3f}-{hi:.3f}); the goal, under {CHECKPOINT_TARGET:g}x: {met}. What async still "
        "blocks: gathering the state (the collectives), copying it into CPU memory (the previous checkpoint's, "
        "reused) and the commit (the writers' hashes gathered, the manifest, the rename); the files are written, "
        "hashed and fsynced, and the oldest checkpoint deleted, in the background "
        "(`minidist/train/async_checkpoint.py`). " + step_cost(m, r["steps"], r["world_size"], r.get("cpus")),
        "",
    ]


def step_cost(m: dict, steps: int, ranks: int, cpus: int | None) -> str:
    """What the background writer costs the steps it runs beside, and the net of the two."""
    slower = m["async"]["step_s"] / m["sync"]["step_s"]
    total = {way: steps * m[way]["step_s"] + m[way]["blocked_s"] for way in ("sync", "async")}
    verdict = "saves time overall" if total["async"] < total["sync"] else "does not save time overall here"
    return (f"The writer shares the machine with training: the median step is {slower:.2f}x the synchronous run's, "
            f"so with steps and blocked time together ({total['sync']:.1f} s sync, {total['async']:.1f} s async) "
            f"async {verdict}." + (f" Here {ranks} ranks train on the machine's {cpus} cores, so the writer has no "
                                   "core of its own; where it has one (a GPU's host), only the blocked time is left."
                                   if cpus is not None and cpus <= ranks else ""))


MUON = DATA / "muon.json"


def muon_section() -> list[str]:
    """scripts/measure_muon.py: Muon + AdamW under ZeRO: state per rank, bytes, ZeRO-1's step time."""
    if not MUON.is_file():
        return []
    d = load_record(MUON)
    r, p = d["results"], d["provenance"]
    n, hidden, psi = r["world_size"], r["hidden"], r["psi"]
    body = []
    for name, v in r["variants"].items():
        stage, optimizers = name.split(" ", 1)
        sharded = stage != "DataParallel"
        theory = (4 * hidden + 8 * (psi - hidden) if "Muon" in optimizers else 8 * psi) / (n if sharded else 1)
        plain = r["variants"][f"{stage} AdamW"]["sent_bytes"]
        body.append([name, " / ".join(f"{b / 2**20:.2f}" for b in v["state_bytes"]), f"{theory / 2**20:.2f}",
                     f"{max(v['state_bytes']) / theory:.3f}", f"{v['sent_bytes'] / 2**20:.2f}",
                     f"{v['sent_bytes'] / plain:.3f}"])
    ratio = r["zero1_over_ddp"]
    goal = "met" if ratio["ci"][1] < 1.0 else "NOT met" if ratio["ci"][0] >= 1.0 else "not decided by this run"
    worst = max((v["sent_bytes"] / r["variants"][k.replace("Muon + AdamW", "AdamW")]["sent_bytes"], k)
                for k, v in r["variants"].items() if "Muon" in k)
    return [
        "## Muon under ZeRO: whole matrices, one owner each",
        "",
        f"`{p['command']}` ({p['date']}, commit {p['commit'][:12]}): a GPT of {psi / 1e6:.2f}M parameters on {n} "
        f"ranks, Muon over the blocks' {hidden / 1e6:.2f}M matrix elements, AdamW over the rest; the same model "
        "with AdamW alone beside it. Optimizer state per rank from live tensors, against the formula (4 bytes a "
        "Muon element, 8 an AdamW element, over N where sharded); bytes each rank sends per step (the "
        "CommTracer's), over those of the same stage with AdamW alone.",
        "",
        markdown_table(["variant", "optimizer state MiB per rank", "formula MiB", "/ formula", "bytes sent MiB",
                        "/ AdamW alone"], body),
        "",
        f"- Step time of ZeRO-1 with Muon over DataParallel with Muon (each rank orthogonalises only the matrices "
        f"it owns), {len(r['step_s']['ZeRO-1'])} interleaved steps: {ratio['median']:.3f} [{ratio['ci'][0]:.3f}, "
        f"{ratio['ci'][1]:.3f}] (goal < 1.00: {goal}).",
        f"- The whole-matrix layout pads each rank's slice of a flat group to the fullest rank's: the most it adds "
        f"is {worst[0] - 1:.1%} of the bytes ({worst[1]}: stage 3 gathers each block's four matrices, which two "
        "ranks cannot split evenly); large buckets (stages 1-2) split evenly.",
        "",
    ]


WIRES = DATA / "wires_zero3.json"
ZEROPP = DATA / "zeropp_shaped.json"
WIRE_BYTES_GOAL = 0.35   # int8 weights + gradients: at most this share of plain zero3's bytes per step
LOSS_BOUND, LOSS_GOAL = 0.02, 0.01  # validation loss within 2% of plain zero3 (goal: 1%)


def mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def wires_figures(r: dict) -> tuple[float, dict[int, float], int]:
    """int8 weights + gradients' bytes per step over plain zero3's; per run length, the largest
    relative difference of a variant's validation loss from plain's; the length judged (200)."""
    runs = r["runs"]
    steps = sorted({x["steps"] for x in runs})
    plain = {s: next(x for x in runs if x["steps"] == s and x["variant"] == "plain") for s in steps}
    both = next(x for x in runs if x["steps"] == steps[0] and x["variant"] == "int8 both")
    worst = {s: max(abs(x["val_loss"] - plain[s]["val_loss"]) / plain[s]["val_loss"] for x in runs if x["steps"] == s)
             for s in steps}
    return both["bytes_per_step"] / plain[steps[0]]["bytes_per_step"], worst, min(steps, key=lambda s: abs(s - 200))


def wires_section() -> list[str]:
    """scripts/measure_wires.py: zero3 with and without int8 wires, bytes by collective and the loss."""
    if not WIRES.is_file():
        return []
    d = load_record(WIRES)
    r, p = d["results"], d["provenance"]
    runs = r["runs"]
    steps = sorted({x["steps"] for x in runs})
    plain = {s: next(x for x in runs if x["steps"] == s and x["variant"] == "plain") for s in steps}
    theory_total = {k: sum(v.values()) for k, v in r["theory"].items()}
    body = []
    for x in runs:
        if x["steps"] != steps[0]:
            continue
        ref = plain[x["steps"]]
        losses = []
        for s in steps:
            y = next(z for z in runs if z["steps"] == s and z["variant"] == x["variant"])
            delta = (y["val_loss"] - plain[s]["val_loss"]) / plain[s]["val_loss"]
            losses.append(f"{y['val_loss']:.4f}" + ("" if y is plain[s] else f" ({delta:+.2%})"))
        body.append([x["variant"], mib(x["bytes_per_step"]), f"{x['bytes_per_step'] / ref['bytes_per_step']:.3f}x",
                     mib(x["by_op"].get("reduce_scatter", 0)), mib(x["by_op"].get("all_gather", 0)), *losses])
    ratio, worst, judged = wires_figures(r)
    loss_verdict = ("met, the goal too" if worst[judged] <= LOSS_GOAL else "met, not the goal"
                    if worst[judged] <= LOSS_BOUND else "NOT met")
    per = r["theory"]["int8"]
    lines = [
        "## Fewer bytes at no loss: int8 wires and ZeRO++ (zero3)",
        "",
        f"`{p['command']}` ({p['date']}, commit {p['commit'][:12]}): `make train`'s model and data "
        f"({r['model']}, {runs[0]['parameters'] / 1e6:.2f}M parameters) on {runs[0]['world_size']} ranks with "
        f"`strategy={r['strategy']}`, for {' and '.join(map(str, steps))} steps (the default length is 400), with "
        "`strategy.param_wire=int8` (ZeRO++'s qwZ: the weights' gathers carry block-scaled int8), "
        "`strategy.grad_wire=int8` (qgZ: each rank's gradient rounded to int8 once, the chunks summed in full "
        f"precision by their owner) or both; {r['quant_block']} elements per fp32 scale. Bytes are what each "
        "rank sent per step as the tracer counted them (the wire's, scales included; the few small control "
        "collectives too); validation loss after the run, its difference from plain zero3's in brackets:",
        "",
        markdown_table(["variant", "bytes per step", "vs plain", "reduce_scatter", "all_gather",
                        *(f"val loss, {s} steps" for s in steps)], body),
        "",
        f"Theory (ring model, the spec's collectives): plain zero3 sends {mib(theory_total['plain'])} per rank and "
        f"step (reduce_scatter {mib(r['theory']['plain']['reduce_scatter'])}, the two all_gathers "
        f"{mib(r['theory']['plain']['all_gather'])}); at int8 with its scales, 1 + 4/{r['quant_block']} bytes an "
        f"element instead of 4, {mib(sum(per.values()))}. Measured, int8 weights and gradients together send "
        f"{ratio:.3f}x plain zero3's bytes (goal at most {WIRE_BYTES_GOAL}x: "
        f"{'met' if ratio <= WIRE_BYTES_GOAL else 'NOT met'}). After {judged} steps every variant's validation "
        f"loss is within {worst[judged]:.2%} of plain zero3's (bound {LOSS_BOUND:.0%}, goal {LOSS_GOAL:.0%}: "
        f"{loss_verdict}); after {steps[-1]}, within {worst[steps[-1]]:.2%}. The master shards and the optimizer "
        "never see a rounded value (`tests/test_zero_wires.py` checks each: the gradient the master gets is the "
        "exact sum of the wire-rounded ones, the module's weights are the wire's rendering of the masters).",
        "",
        *zeropp_lines(),
        *ddp_before_after_lines(),
    ]
    return lines


BEFORE_AFTER = DATA / "ddp_before_after.json"


def ddp_before_after_lines() -> list[str]:
    """scripts/measure_ddp_before_after.py: ddp / native_ddp before a change and after it."""
    if not BEFORE_AFTER.is_file():
        return []
    d = load_record(BEFORE_AFTER)
    r, p = d["results"], d["provenance"]
    body, verdicts = [], []
    for model, row in r["models"].items():
        b, a = row["before"], row["after"]
        body.append([model, f"{b['ratio']:.3f} [{b['ci'][0]:.3f}, {b['ci'][1]:.3f}]",
                     f"{a['ratio']:.3f} [{a['ci'][0]:.3f}, {a['ci'][1]:.3f}]"])
        overlap = a["ci"][0] <= b["ci"][1] and b["ci"][0] <= a["ci"][1]
        under = "at or under 1.00" if a["ratio"] <= 1.0 else "above 1.00"
        verdicts.append(f"{model}: after {a['ratio']:.3f} ({under}; the target counts as met only when the whole "
                        f"interval is: {'met' if a['ci'][1] <= 1.0 else 'not decided by this run' if a['ci'][0] <= 1.0 else 'NOT met'}), "
                        + ("its interval overlaps before's: no cost measurable" if overlap
                           else "its interval does not overlap before's: a measurable change"))
    return [
        f"Does {r.get('change', '`grad_wire=null` (the default)')} cost DataParallel anything? `{p['command']}` "
        f"({p['date']}, after = commit "
        f"{p['commit'][:12]}, before = {r['before'][:12]}): ddp / native_ddp, each run interleaving the two step by "
        "step (median of the paired ratios, 95% bootstrap interval), on the default gpt_nano and the "
        "communication-bound mlp_wide:",
        "",
        markdown_table(["model", "before", "after"], body),
        "",
        "; ".join(verdicts) + ".",
        "",
    ]


def zeropp_ratios(v: dict) -> dict[str, list[float]]:
    """zero3_zeropp's step time over zero3's and native_fsdp's, round by round."""
    return {k: [a / b for a, b in zip(v["zero3_zeropp"]["step_s"], v[k]["step_s"])] for k in ("zero3", "native_fsdp")}


def zeropp_lines() -> list[str]:
    """scripts/zeropp_local.sh: step times on emulated hosts with shaped links."""
    if not ZEROPP.is_file():
        return []
    d = load_record(ZEROPP)
    r, p = d["results"], d["provenance"]
    v = r["variants"]
    med = {k: statistics.median(x["step_s"]) for k, x in v.items()}
    body = [[k, f"{med[k] * 1e3:.0f} ms", ", ".join(f"{s * 1e3:.0f}" for s in x["step_s"]),
             mib(x["bytes_per_step"]) if x["bytes_per_step"] else "(not traced)",
             mib(x["host_tx_bytes_per_step"])] for k, x in v.items()]
    rounds = len(v["zero3"]["step_s"])
    vs = zeropp_ratios(v)
    faster = all(max(x) < 1 for x in vs.values())
    return [
        f"On emulated hosts (`{p['command']}`, {p['date']}, commit {p['commit'][:12]}): {r['hosts']} network "
        f"namespaces x {r['per_host']} ranks, each host's link shaped to {r['rate']} with tc; gpt_nano, "
        f"{rounds} rounds each running every variant once in rotated order. zero3_zeropp is zero3 with int8 "
        "weights, int8 gradients and `strategy.secondary_shard=host` (hpZ: the backward's gathers stay in the "
        "host). Step time is each run's last logged window (slowest rank); bytes out of each host are its "
        "network device's count:",
        "",
        markdown_table(["variant", "median step", "each round (ms)", "sent per rank (traced)",
                        "out of each host per step"], body),
        "",
        f"zero3_zeropp's step against zero3's: {statistics.median(vs['zero3']):.3f}x (rounds "
        f"{min(vs['zero3']):.3f}-{max(vs['zero3']):.3f}); against native_fsdp's: "
        f"{statistics.median(vs['native_fsdp']):.3f}x ({min(vs['native_fsdp']):.3f}-{max(vs['native_fsdp']):.3f}): "
        f"{'faster than both in every round' if faster else 'NOT faster than both in every round'}. "
        + zeropp_prediction(r, med) + " The cost model's prediction of the bare patterns (`zero3_zeropp` beside "
        "`zero3`, no compute) against their measured time is in docs/scale.md's validation.",
        "",
    ]


def zeropp_prediction(r: dict, med: dict[str, float]) -> str:
    """The cost model's communication per step for zero3 and zero3_zeropp on the links docs/scale.md
    calibrated at the same rate, against the step times' difference (the compute is the same)."""
    from omegaconf import OmegaConf

    import costmodel

    calibrated = ROOT / "docs" / "scale" / "data" / f"validate_{r['rate']}.json"
    if not calibrated.is_file() or not WIRES.is_file():
        return ""
    m = load_record(calibrated)["results"]
    c = costmodel.Cluster.calibrated(m)
    psi = load_record(WIRES)["results"]["runs"][0]["parameters"]  # gpt_nano's, as trained here
    units = int(OmegaConf.load(ROOT / "configs" / "model" / "gpt_nano.yaml").n_layer) + 1  # blocks + the root
    strategy, wires = costmodel.VARIANTS["zero3_zeropp"]
    plain = costmodel.step_comm_time(strategy, psi, r["hosts"], c, comm_bytes=4, units=units)["total"]
    zeropp = costmodel.step_comm_time(strategy, psi, r["hosts"], c, comm_bytes=4, units=units, **wires)["total"]
    predicted, measured = plain - zeropp, med["zero3"] - med["zero3_zeropp"]
    error = (predicted - measured) / measured
    bound = costmodel_tolerance()
    return (f"The cost model, on the links docs/scale.md calibrated at {r['rate']}, prices zero3's communication "
            f"at {plain * 1e3:.0f} ms a step and zero3_zeropp's at {zeropp * 1e3:.0f} ms: {predicted * 1e3:.0f} ms "
            f"saved, against {measured * 1e3:.0f} ms between the measured steps ({error:+.0%}; "
            f"{'within' if abs(error) <= bound else 'NOT within'} its {bound:.0%}).")


def costmodel_tolerance() -> float:
    """The bound docs/scale.md holds the cost model to (make_scale_doc.TOLERANCE)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_scale_doc import TOLERANCE

    return TOLERANCE


def render(img: Path = IMG) -> str:
    """The document, from the committed data alone; the plots it draws go into `img`."""
    img.mkdir(parents=True, exist_ok=True)
    main = load("main")
    env = main["environment"]
    sources = sorted(DATA.glob("compare_*.json"))
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python scripts/make_benchmarks.py` (`--render-only` rewrites it from the committed data "
        "without running anything); do not edit by hand. Data: `docs/benchmarks/data/compare_*.json`, each with "
        "the commit, torch version, command and date that produced it "
        f"({', '.join(sorted({load_record(f)['provenance']['date'] for f in sources}))}).",
        "",
        f"Machine: {env['cores']} CPU cores, no GPU; torch {env['torch']}, DeepSpeed {env['deepspeed']}, "
        f"Python {env['python']}; backend {env['backend']} over loopback, OMP_NUM_THREADS=1 per rank. "
        "Times are medians of the slowest rank's step; ratios compare strategies interleaved in one invocation.",
        "",
        *main_section(main),
        "",
        *scaling_section({n: load(f"scale_{n}") for n in WORLDS if have(f"scale_{n}")}, img),
        *bucket_section({b: load(f"bucket_{b}") for b in BUCKETS if have(f"bucket_{b}")}, img),
        *bound_section({(m, o): load(f"bound_{m}_{o}") for m in ("gpt_nano", "mlp_wide") for o in ("true", "false")
                        if have(f"bound_{m}_{o}")}),
        *(hybrid_section(load("hybrid")) if have("hybrid") else []),
        *(accumulate_section(load("accumulate")) if have("accumulate") else []),
        *checkpoint_section(),
        *wires_section(),
        *muon_section(),
        *diloco_doc.section(img),
        "## Component benchmarks",
        "",
        "Each part on its own (collectives, DataParallel, the ring, ZeRO stages, resident memory, the main "
        "job), one recipe each: `docs/benchmarks/components.md`, rendered the same way by "
        "`scripts/make_components.py` from `docs/benchmarks/data/component_*.json`.",
    ]
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------- the README's quotes

def at_most(x: float) -> str:
    """x rounded *up* to one significant digit (2.4e-06 -> 3e-6): a bound the data respects."""
    exp = math.floor(math.log10(x)) if x > 0 else 0
    m = math.ceil(x / 10 ** exp - 1e-9) if x > 0 else 0
    return f"{m}e{exp}" if m < 10 else f"1e{exp + 1}"


def readme_quotes() -> dict[str, str]:
    """The README's sentences that quote this document's figures, rendered from the same data
    (between <!-- benchmarks:NAME --> and <!-- /benchmarks:NAME --> in README.md)."""
    main = load("main")
    rows = main["rows"]
    ours = [r for r in rows.values() if r["kind"] == "minidist" and r["time_ratio"] is not None]
    quotes = {"main": f"all {len(rows)} at {main['world_size']} ranks: " + ", ".join(
        f"{r['strategy']}/{r['reference']} {r['time_ratio']:.3f}" for r in ours) + " of the reference's step time, "
        f"every final parameter within {at_most(max(r['final_param_diff'] for r in ours))} of its reference"}
    glance = ["| ours | reference | final parameters apart | step time / reference [95%] | model state MiB (reference's) |",
              "| --- | --- | --- | --- | --- |"]
    for r in ours:
        ref = rows[r["reference"]]
        lo, hi = r["time_ratio_ci"]
        glance.append(f"| {r['strategy']} | {r['reference']} | {r['final_param_diff']:.1e} | {r['time_ratio']:.3f} "
                      f"[{lo:.3f}, {hi:.3f}] | {r['model_state_bytes']['total'] / 2**20:.2f} ({ref['model_state_bytes']['total'] / 2**20:.2f}) |")
    quotes["glance"] = "\n" + "\n".join(glance) + "\n"
    if have("hybrid"):
        r = load("hybrid")["rows"]["hsdp3"]
        quotes["hybrid"] = (f"hsdp3 takes {r['time_ratio']:.2f}x its step time (4 ranks as 2x2; "
                            f"`docs/benchmarks.md`, \"Hybrid sharding\") and ends within "
                            f"{at_most(r['final_param_diff'])} of it")
    if WIRES.is_file():
        ratio, worst, judged = wires_figures(load_record(WIRES)["results"])
        quotes["wires"] = (f"int8 weights and gradients together send {ratio:.3f}x plain zero3's bytes per step, and "
                           f"after {judged} steps of `make train`'s model every variant's validation loss is within "
                           f"{worst[judged]:.2%} of plain zero3's")
    if ZEROPP.is_file():
        v = load_record(ZEROPP)["results"]
        vs = zeropp_ratios(v["variants"])
        quotes["zeropp"] = (f"at {v['rate']} between {v['hosts']} hosts, zero3 with all three takes "
                            f"{statistics.median(vs['zero3']):.2f}x zero3's step and "
                            f"{statistics.median(vs['native_fsdp']):.2f}x native_fsdp's (medians of the rounds' "
                            "ratios)")
    quotes.update(diloco_doc.quotes())
    return quotes


def with_quotes(text: str) -> str:
    """`text` (the README) with each quote region holding its current rendering."""
    return fill_quotes(text, "benchmarks", readme_quotes())


DOCUMENT = Document(Path(__file__), DOC, render,
                    {**{name: functools.partial(run, name, overrides) for name, overrides in runs().items()},
                     "checkpoint": checkpoint_run},
                    readme_quotes=with_quotes,
                    quote_tag="benchmarks")

if __name__ == "__main__":
    sys.exit(main(DOCUMENT))
