"""Regenerate docs/benchmarks/components.md from real runs of the component recipes.

    python scripts/make_components.py                 # every run below (~20 min on 2 cores), then the document
    python scripts/make_components.py --only ring     # rerun some runs (by name prefix), then render
    python scripts/make_components.py --render-only   # rewrite the document from the committed data, run nothing

One recipe per part: the collectives (recipes/bench_collectives.py), DataParallel against
native DDP (bench_ddp.py), the send/recv ring against gloo's collectives (bench_ring.py), the
ZeRO stages (bench_zero.py), resident memory (bench_memory.py) and the main job (`make train`).
Each run's full output stays in outputs/benchmarks/components/NAME/; what the document is
rendered from is committed as docs/benchmarks/data/component_NAME.json with the commit, torch
version, command and date that produced it. Every judgement is computed from those numbers:
a ratio carries the 95% bootstrap interval of its median over the paired steps or rounds, and a
target counts as met only when the whole interval is on the right side of it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minidist_tools.benchmarking import variant_spec  # noqa: E402
sys.path.insert(0, str(ROOT / "scripts" / "lib"))
from doc_pipeline import Document, load as load_record, main, provenance, record, run_recipe  # noqa: E402
from minidist.comm import RING_WINS_FROM  # noqa: E402
from minidist_tools.report import markdown_table, speed_verdict  # noqa: E402
sys.path.insert(0, str(ROOT / "recipes"))
from bench_memory import formula_bytes, target_bytes  # noqa: E402

OUT = ROOT / "outputs" / "benchmarks" / "components"
DOC = ROOT / "docs" / "benchmarks" / "components.md"
DATA = ROOT / "docs" / "benchmarks" / "data"

ZERO_VARIANTS = "[ddp,zero1,zero2,zero3,native_zero1,native_fsdp,zero1_backend,zero2_backend,zero3_backend]"
RUNS = {  # name: (recipe, overrides, the file the recipe leaves in its run directory)
    "collectives_2": ("bench_collectives.py", ["nproc=2"], "results.json"),
    "collectives_4": ("bench_collectives.py", ["nproc=4"], "results.json"),
    "ddp": ("bench_ddp.py", ["steps=50"], "results.json"),
    "ring_2": ("bench_ring.py", ["nproc=2", "rounds=25"], "results.json"),
    "ring_4": ("bench_ring.py", ["nproc=4", "rounds=25"], "results.json"),
    "zero": ("bench_zero.py", ["steps=20", f"variants={ZERO_VARIANTS}"], "results.json"),
    "memory": ("bench_memory.py", [], "results.json"),
    "train": ("train.py", [], "summary.json"),  # what `make train` runs
}
RING_TARGET = 1.5           # ring reduce_scatter busbw over gloo's, 1-64 MiB (the goal the ring was built for)
RING_TARGET_FROM = 1 << 20
TRAIN_TARGET_LOSS = 2.5     # make train's validation loss, nats (a uniform guess over bytes: ln 256 = 5.55)
MIB = 2**20


def command(name: str) -> str:
    recipe, overrides, _ = RUNS[name]
    return "make train" if recipe == "train.py" else " ".join(["python", f"recipes/{recipe}", *overrides])


def run(name: str) -> None:
    recipe, overrides, result_file = RUNS[name]
    results, wall = run_recipe(recipe, overrides, OUT / name, result_file)
    # the results' key order kept: it is the tables' row order
    record(data_file(name), results, provenance(command(name), importlib.metadata.version("torch")), wall_s=wall)


def data_file(name: str) -> Path:
    return DATA / f"component_{name}.json"


def load(name: str) -> dict | None:
    return load_record(data_file(name)) if data_file(name).is_file() else None


# --------------------------------------------------------------------------- judgements

def size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // 1024} KiB"


def ci(pair) -> str:
    return f" [{pair[0]:.3f}, {pair[1]:.3f}]" if pair else ""


def at_most(ratio: float, interval, target: float = 1.0) -> str:
    """A ratio's target `ratio <= target`, judged on its 95% interval."""
    return speed_verdict({"time_ratio": ratio, "time_ratio_ci": interval}, target).split(" (")[0]


def at_least(interval, target: float) -> str:
    """A speed-up's target `speed-up >= target`, judged on its 95% interval."""
    if interval[0] >= target:
        return "met"
    return "NOT met" if interval[1] < target else "undecided"


def grouped(items: list[tuple[str, str]]) -> str:
    """'met: a, b; NOT met: c' from (verdict, what) pairs, in the verdicts' first-seen order."""
    groups: dict[str, list[str]] = {}
    for verdict, what in items:
        groups.setdefault(verdict, []).append(what)
    return "; ".join(f"{v}: {', '.join(w)}" for v, w in groups.items())


def provenance_line(d: dict) -> str:
    p = d["provenance"]
    return f"Command: `{p['command']}` (commit {p['commit'][:12]}, torch {p['torch']}, {p['date']}; {d['wall_s']:.0f} s)."


# --------------------------------------------------------------------------- sections

COLLECTIVE_SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)


def collectives_section(runs: dict[int, dict]) -> list[str]:
    meta = next(iter(runs.values()))["results"]["meta"]
    out = ["## Collectives (`recipes/bench_collectives.py`)", "",
           f"{meta['warmup']} warm-up calls, then the median of {meta['iters']} timed calls (sync) or of "
           f"{meta['repeats']} bursts of {meta['iters']} back-to-back async calls. busbw in GB/s, nccl-tests' definitions (all_reduce algbw·2(n-1)/n; "
           "all_gather and reduce_scatter algbw·(n-1)/n with S the total size; broadcast, reduce, send/recv "
           "algbw). Each run also writes results.csv, TensorBoard scalars and busbw.png to its run directory.", ""]
    for n, d in runs.items():
        meta, rows = d["results"]["meta"], d["results"]["results"]
        memcpy = meta["memcpy_GBps"]
        cell = {(r["op"], r["mode"], r["bytes"]): r for r in rows}
        ops = list(dict.fromkeys(r["op"] for r in rows))
        body = [[op, mode, *(f"{cell[(op, mode, s)]['busbw_GBps']:.2f}" if (op, mode, s) in cell else "-"
                             for s in COLLECTIVE_SIZES)]
                for op in ops for mode in ("sync", "async") if any(k[:2] == (op, mode) for k in cell)]
        best = max(rows, key=lambda r: r["busbw_GBps"])
        at16 = {op: cell.get((op, "sync", 16 << 20)) for op in ("reduce_scatter", "all_reduce")}
        gains = [cell[(r["op"], "async", r["bytes"])]["busbw_GBps"] / r["busbw_GBps"] for r in rows
                 if r["mode"] == "sync" and r["bytes"] >= 64 << 10 and r["busbw_GBps"] > 0
                 and (r["op"], "async", r["bytes"]) in cell]
        out += [f"### {n} ranks{' (' + str(n) + ' processes on 2 cores)' if n > 2 else ''} — memcpy bandwidth "
                f"{memcpy:.2f} GB/s (the one-machine upper bound)", "", provenance_line(d), "",
                markdown_table(["op", "mode", *(size(s) for s in COLLECTIVE_SIZES)], body), "",
                f"- Highest busbw measured: {best['op']} {best['mode']} at {size(best['bytes'])}, "
                f"{best['busbw_GBps']:.2f} GB/s ({100 * best['busbw_GBps'] / memcpy:.0f}% of memcpy)" +
                (": the loopback TCP stack, not memory, is the bound." if best["busbw_GBps"] < 0.8 * memcpy else ".")]
        if all(at16.values()):
            ratio = at16["reduce_scatter"]["time_us"] / at16["all_reduce"]["time_us"]
            out.append(f"- At 16 MiB, gloo's reduce_scatter takes {ratio:.2f}x the time of an all_reduce of the "
                       f"same buffer (busbw {at16['reduce_scatter']['busbw_GBps']:.2f} against "
                       f"{at16['all_reduce']['busbw_GBps']:.2f} GB/s), though it moves half the bytes: the reason "
                       "for the send/recv ring below.")
        if gains:
            out.append(f"- Async bursts over blocking calls (busbw, from 64 KiB): median {statistics.median(gains):.2f}x "
                       f"(range {min(gains):.2f}-{max(gains):.2f}).")
        out.append("")
    return out


DDP_VARIANTS = ("native", "ours", "ours_no_overlap", "ours_bucket_view", "native_bucket_view")


def ddp_section(d: dict) -> list[str]:
    out = ["## DataParallel vs native DDP (`recipes/bench_ddp.py`)", "", provenance_line(d), "",
           f"{d['results']['world_size']} ranks, gloo, {d['results']['warmup']} warm-up + {d['results']['steps']} "
           "measured steps, AdamW; a GPT-style transformer (10 layers, d=384, vocab "
           "8192, 2x128 tokens per rank) and torchvision's resnet18 on 32x32 inputs (16 images per rank); "
           "bucket_cap_mb=25 with a 1 MiB first bucket for both. Every variant runs every step in rotating "
           "order; `paired / native [95%]` is the median of the step-by-step ratios and its bootstrap interval.",
           ""]
    headers = ["model", "variant", "median step (IQR)", "paired / native [95%]", "exposed comm (end of backward)",
               "same all_reduces alone", "buckets"]
    body, lines = [], []
    for res in d["results"]["results"]:
        v = res["variants"]
        label = f"{res['model']} ({res['parameters'] / 1e6:.1f}M)"
        for name, row in v.items():
            pr = row["paired_ratio"]
            body.append([label, name, f"{row['median_step_s'] * 1e3:.1f} ms ({row['iqr_s'][0] * 1e3:.0f}-"
                         f"{row['iqr_s'][1] * 1e3:.0f})", f"{pr['median']:.3f}{ci(pr['ci'])}" if pr else "-",
                         f"{row['exposed_comm_s'] * 1e3:.1f} ms" if "exposed_comm_s" in row else "-",
                         f"{row['standalone_comm_s'] * 1e3:.1f} ms" if "standalone_comm_s" in row else "-",
                         str(row.get("buckets", "-"))])
        ours = v["ours"]["paired_ratio"]
        lines.append(f"- {res['model']}: ours / native {ours['median']:.3f}{ci(ours['ci'])}, target <= 1.00 "
                     f"{at_most(ours['median'], ours['ci'])}.")
        if "ours_bucket_view" in v and "native_bucket_view" in v:
            a, b = v["ours_bucket_view"]["paired_ratio"]["median"], v["native_bucket_view"]["paired_ratio"]["median"]
            lines.append(f"  With `gradient_as_bucket_view=True` on both sides: ours {a:.3f}, native {b:.3f} of "
                         f"native's default step, i.e. ours/native {a / b:.3f} (a ratio of medians, no interval).")
        if "ours_no_overlap" in v:
            on, off = v["ours"], v["ours_no_overlap"]
            lines.append(f"  Overlap: exposed communication {on['exposed_comm_s'] * 1e3:.1f} ms with it, "
                         f"{off['exposed_comm_s'] * 1e3:.1f} ms without; the step with overlap is "
                         f"{on['paired_ratio']['median'] / off['paired_ratio']['median']:.3f}x the step without "
                         "(ratio of the two paired medians).")
    return out + [markdown_table(headers, body), "", *lines, "",
                  "With one core per rank, gloo's communication threads take the core backward needs, so hiding "
                  "communication buys little here. (\"same all_reduces alone\" is a separate, noisier measurement "
                  "of the buckets' all_reduces with nothing else running.)", ""]


def ring_section(runs: dict[int, dict]) -> list[str]:
    out = ["## Ring collectives from send/recv vs gloo's (`recipes/bench_ring.py`)", "",
           "fp32, 64 KiB to 64 MiB (the total gathered / scattered buffer). Each round times the backend's call "
           "and the ring's (`minidist.comm.ring`) once each on the same buffers, in alternating order, after a "
           "barrier; a call's time is the slowest rank's. Times are medians; the speed-up is the median of the "
           "per-round ratios backend / ring (> 1: the ring is faster) with its 95% bootstrap interval.", ""]
    target_items, faster = [], {}
    for n, d in runs.items():
        rows = d["results"]["rows"]
        body = [[r["op"], size(r["bytes"]), f"{r['backend_ms']:.2f}", f"{r['ring_ms']:.2f}",
                 f"{r['busbw_backend_GBps']:.2f}", f"{r['busbw_ring_GBps']:.2f}",
                 f"{r['speedup']:.2f}{ci(r['speedup_ci'])}"] for r in rows]
        out += [f"### {n} ranks{' (' + str(n) + ' processes on 2 cores)' if n > 2 else ''}", "", provenance_line(d),
                "", markdown_table(["op", "size", "backend ms", "ring ms", "busbw backend GB/s", "busbw ring GB/s",
                                    "speed-up [95%]"], body), ""]
        for r in rows:
            if r["op"] == "reduce_scatter" and r["bytes"] >= RING_TARGET_FROM:
                target_items.append((at_least(r["speedup_ci"], RING_TARGET),
                                     f"{n} ranks {size(r['bytes'])} {r['speedup']:.2f}x"))
            winner = "ring" if r["speedup_ci"][0] > 1 else "backend" if r["speedup_ci"][1] < 1 else None
            faster[(r["op"], n, r["bytes"])] = winner
    out.append(f"- Target: the ring's reduce_scatter at least {RING_TARGET}x gloo's from {size(RING_TARGET_FROM)} "
               f"to 64 MiB (the interval's lower end at or above it): {grouped(target_items)}.")
    wins_from = RING_WINS_FROM["gloo"]
    against = []
    for (op, n, nbytes), winner in faster.items():
        auto = "ring" if op in wins_from and nbytes >= wins_from[op] else "backend"
        if winner is not None and winner != auto:
            against.append(f"{op} {n} ranks {size(nbytes)} ({winner} faster, auto takes the {auto})")
    policy = ", ".join(f"{op} from {size(b) if b else 'every size'}" for op, b in wins_from.items())
    out += [f"- `algorithm=\"auto\"` on gloo takes the ring for {policy}, the backend otherwise "
            "(`minidist.comm.RING_WINS_FROM`). Where these runs tell the two apart (the interval excludes 1), "
            + (f"they disagree with it at: {'; '.join(against)}." if against else "they agree with it everywhere."),
            *(["- At 4 ranks on 2 cores every call waits for 4 processes to be scheduled; the intervals there are "
               "wider."] if 4 in runs else []), ""]
    return out


def zero_section(d: dict) -> list[str]:
    res = d["results"]
    rows, psi, n = res["results"], res["psi"], res["world_size"]
    headers = ["variant", "median step", "/ ours ddp [95%]", "/ native counterpart [95%]", "model state per rank",
               "measured / Ψ", "peak per rank"]
    body = [[name, f"{r['median_step_s'] * 1e3:.1f} ms",
             f"{r['ratio_to_ddp']:.3f}{ci(r.get('ratio_to_ddp_ci'))}" if "ratio_to_ddp" in r else "-",
             f"{r['ratio_to_native']:.3f}{ci(r.get('ratio_to_native_ci'))}" if "ratio_to_native" in r else "-",
             f"{r['state_bytes'] / MIB:.1f} MiB", f"{r['state_per_psi']:.2f}", f"{r['peak_bytes'] / MIB:.1f} MiB"]
            for name, r in rows.items()]
    targets = []
    if "zero2" in rows and "ratio_to_ddp" in rows["zero2"]:
        z = rows["zero2"]
        targets.append(f"ZeRO-2 step <= DataParallel's: {z['ratio_to_ddp']:.3f}{ci(z['ratio_to_ddp_ci'])} "
                       f"{at_most(z['ratio_to_ddp'], z['ratio_to_ddp_ci'])}")
    for name in ("zero1", "zero3"):
        if "ratio_to_native" in rows.get(name, {}):
            r = rows[name]
            targets.append(f"{name} <= its native counterpart: {r['ratio_to_native']:.3f}{ci(r['ratio_to_native_ci'])} "
                           f"{at_most(r['ratio_to_native'], r['ratio_to_native_ci'])}")
    paper = {k: formula_bytes(k, psi, n) / psi for k in ("ddp", "zero1", "zero2", "zero3") if k in rows}
    exact = [f"{k} {rows[k]['state_per_psi']:.2f} (formula {f:g})" for k, f in paper.items()]
    off = [k for k, f in paper.items() if abs(rows[k]["state_per_psi"] - f) > 0.01]
    lines = [f"- Targets: {'; '.join(targets)}.",
             f"- Model state per parameter against the ZeRO paper at N={n}: {', '.join(exact)}: " +
             ("every stage matches." if not off else f"{', '.join(off)} do not match.")]
    peaks = [f"{k} {rows[k]['peak_bytes'] / MIB:.1f} MiB with the ring against {rows[k + '_backend']['peak_bytes'] / MIB:.1f} "
             f"with gloo's" for k in ("zero1", "zero2", "zero3") if k in rows and k + "_backend" in rows]
    if peaks:
        lines.append(f"- Peak memory, our ring vs gloo's collectives: {', '.join(peaks)}.")
    return ["## ZeRO stages vs native and vs DataParallel (`recipes/bench_zero.py`)", "", provenance_line(d), "",
            f"{n} ranks, gloo, a GPT of {psi:,} parameters (Ψ), AdamW, {res['warmup']} warm-up + {res['steps']} measured "
            "steps, every variant every step in rotating order. zero1-3 use `collectives=\"auto\"` (our send/recv "
            "ring on gloo); `zeroK_backend` is the same stage with gloo's reduce_scatter / all_gather. native_zero1 "
            "is native DDP + ZeroRedundancyOptimizer; native_fsdp is `fully_shard` on each block, then the root. "
            "Ratios are medians of the step-by-step ratios with their 95% interval. Memory is measured per variant, "
            "built alone, after a step (gradients still held): model state from live storages, peak from live "
            "tensor bytes sampled through the step; the largest rank's.", "",
            markdown_table(headers, body), "", *lines, ""]


def memory_section(d: dict) -> list[str]:
    res = d["results"]
    rows = res["results"]
    body = [[r["strategy"], r["collectives"] if "collectives" in variant_spec(r["strategy"]).options else "-",
             f"{r['rss_bytes'] / MIB:.1f} MiB", f"{r['formula_bytes'] / MIB:.1f} MiB",
             f"{r['inflight_bytes'] / MIB:.1f} MiB", f"{r['rss_bytes'] / r['formula_bytes']:.2f}",
             f"{target_bytes(r) / MIB:.1f} MiB", "yes" if r["all_ranks_within_target"] else "no"] for r in rows.values()]
    ours = {k: r for k, r in rows.items()  # our ZeRO stages with our collectives (not the _backend variants)
            if variant_spec(k).kind == "minidist" and variant_spec(k).zero_stage and r["collectives"] != "backend"}
    over = [k for k, r in rows.items() if not r["all_ranks_within_target"]]
    verdict = "met for every stage, on every rank" if all(r["all_ranks_within_target"] for r in ours.values()) \
        else "NOT met: " + ", ".join(k for k, r in ours.items() if not r["all_ranks_within_target"])
    return ["## Resident memory per strategy (`recipes/bench_memory.py`)", "", provenance_line(d), "",
            f"{res['world_size']} ranks, an MLP of {res['psi'] / 1e6:.1f}M parameters, AdamW, 1 MiB buckets, 3 steps, "
            "gradients still held. Each strategy runs in freshly started ranks with `MALLOC_MMAP_THRESHOLD_=65536`, "
            "so freed tensors return their pages and RSS follows live tensors (`tests/test_rss.py` checks this). "
            "RSS is its anonymous part (RssAnon), above a baseline taken after the same strategy trained a tiny "
            "model once. \"In flight\": the gradient buckets or stage-3 staging buffers a strategy keeps. Rank 0's "
            "figures; \"within\" checks every rank.", "",
            markdown_table(["strategy", "collectives", "RSS above baseline", "ZeRO formula", "buffers in flight",
                            "RSS / formula", "bound: 1.15 × formula + 8 MiB + in flight", "within, every rank"], body),
            "",
            "- Target: every ZeRO stage with our collectives within its bound: " + verdict + " (" +
            ", ".join(f"{k} {r['rss_bytes'] / MIB:.1f} MiB, bound {target_bytes(r) / MIB:.1f}" for k, r in ours.items()) + ").",
            f"- Over the bound: {', '.join(over) if over else 'none'}." +
            (" gloo's reduce_scatter holds on to memory that no live tensor accounts for." if
             any(k.endswith("_backend") for k in over) else ""), ""]


def train_section(d: dict) -> list[str]:
    s = d["results"]
    loss = s["val/loss"]
    verdict = "met" if loss <= TRAIN_TARGET_LOSS else "NOT met"
    run = s["config"]
    return ["## The trainer's main job (`make train`)", "", provenance_line(d), "",
            f"minidist `{run['strategy']}`, {run['model']} ({s['parameters'] / 1e6:.2f}M parameters) on {run['data']}, "
            f"{run['world_size']} ranks, {s['step']} steps, AdamW (peak lr {run['lr']:g}). Measured: {d['wall_s']:.0f} s "
            f"wall, final validation loss {loss:.3f} nats (target <= {TRAIN_TARGET_LOSS}: {verdict}), "
            f"{s['throughput/tokens_per_s']:,.0f} tokens/s ({s['throughput/tokens_per_s_per_rank']:,.0f} per rank), "
            f"a step of {s['time/step_s'] * 1e3:.1f} ms of which {s.get('time/exposed_comm_s', 0) * 1e3:.1f} ms "
            f"exposed communication and {s['time/data_s'] * 1e3:.1f} ms data, "
            f"{s['comm/bytes_per_step'] / MIB:.1f} MiB sent per step and rank, model state "
            f"{s['memory/model_state_bytes'] / MIB:.1f} MiB per rank.", ""]


def render() -> str:
    """The document, from the committed data alone."""
    sections = []
    collectives = {n: d for n in (2, 4) if (d := load(f"collectives_{n}"))}
    rings = {n: d for n in (2, 4) if (d := load(f"ring_{n}"))}
    if collectives:
        sections += collectives_section(collectives)
    if d := load("ddp"):
        sections += ddp_section(d)
    if rings:
        sections += ring_section(rings)
    if d := load("zero"):
        sections += zero_section(d)
    if d := load("memory"):
        sections += memory_section(d)
    if d := load("train"):
        sections += train_section(d)
    lines = [
        "# Component benchmarks (one recipe per part: collectives, DataParallel, ring, ZeRO, memory, the trainer)",
        "",
        "Generated by `python scripts/make_components.py` (`--render-only` rewrites it from the committed data "
        "without running anything); do not edit by hand. Data: `docs/benchmarks/data/component_*.json`.",
        "",
        "Machine: 2 CPU cores, no GPU; gloo over loopback, `OMP_NUM_THREADS=1` per rank. With two ranks on two "
        "cores, computation and gloo's communication threads compete for the same cores, so overlap buys little "
        "here; the ratios, not the absolute times, are the point. Every comparison runs its variants interleaved "
        "in one invocation (paired steps, rotating order) and reports medians of the slowest rank's step.",
        "",
        *sections,
        "## Reproducing",
        "",
        "```bash",
        "python scripts/make_components.py    # every command below, then this document",
        *[command(name) for name in RUNS],
        "```",
    ]
    return "\n".join(lines).rstrip() + "\n"


DOCUMENT = Document(Path(__file__), DOC, render, {name: functools.partial(run, name) for name in RUNS})

if __name__ == "__main__":
    sys.exit(main(DOCUMENT))
