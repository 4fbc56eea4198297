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
                                     table_rows, targets_lines, transports_line)
sys.path.insert(0, str(ROOT / "scripts" / "lib"))
import diloco_doc  # noqa: E402
from doc_pipeline import (Document, fill, fill_quotes, load as load_record, made_by, main, mib,  # noqa: E402
                          provenance, record, results_of, run_recipe)

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


# --------------------------------------------------------------------------- the figures (scripts/templates/benchmarks.md says the rest)

def ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def run_values(prefix: str, r: dict) -> dict:
    """What a comparison run was: its model, size, ranks, batch and steps, as `prefix`_NAME."""
    values = dict(model=r["model"], psi_m=f"{r['psi'] / 1e6:.2f}", world=r["world_size"], batch=r["global_batch"],
                  warmup=r["warmup"], steps=r["steps"], table=markdown_table(*table_rows(r["rows"])),
                  bytes=bytes_table(r["rows"]))
    return {f"{prefix}_{k}": v for k, v in values.items()}


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


def total_bytes(row: dict, op: str, theory: bool = False) -> float:
    return (row["theory_bytes_per_step"] if theory else row["bytes_per_step"]).get(op) or 0.0


def main_values(r: dict) -> dict:
    rows = r["rows"]
    ours = [n for n in rows if rows[n]["kind"] == "minidist" and rows[n]["final_param_diff"] is not None]
    worst, tolerance = max(rows[n]["final_param_diff"] for n in ours), rows[ours[0]]["tolerance"]
    values = dict(
        main_command=command(runs()["main"]), main_data=r["data"], main_targets="\n".join(targets_lines(rows)),
        main_equal="every" if worst <= tolerance else "NOT every", main_tolerance=f"{tolerance:g}",
        main_worst=f"{worst:.1e}", main_diffs=", ".join(f"{n} {rows[n]['final_param_diff']:.1e}" for n in ours),
        main_verdicts=verdicts(rows), main_memory=memory_table(rows),
        main_transports=transports_line(rows, r["environment"]["backend"]),
        main_hidden=", ".join(f"{n} {100 * rows[n]['hidden_fraction']:.0f}%" for n in rows
                              if rows[n]["hidden_fraction"] is not None),
        timelines="".join(f"![timeline {n}](img/timeline_{n}.png)\n\n" for n in TIMELINES
                          if f"timeline_{n}.png" in r.get("timeline_files", [])),
        ds_zero2_bytes="", ds_zero3_bytes="", **run_values("main", r))
    # DeepSpeed's bytes against ours, as measured (the ops each uses, and how many bytes)
    if "ds_zero2" in rows and "zero2" in rows and total_bytes(rows["zero2"], "reduce_scatter"):
        ds, ours_rs = rows["ds_zero2"], total_bytes(rows["zero2"], "reduce_scatter")
        ds_all = total_bytes(ds, "all_reduce") + total_bytes(ds, "reduce_scatter")
        values["ds_zero2_bytes"] = (f"{ds_all / ours_rs:.2f}x (ds_zero2: all_reduce {total_bytes(ds, 'all_reduce') / 2**20:.2f} "
                                    f"MiB, reduce_scatter {total_bytes(ds, 'reduce_scatter') / 2**20:.2f} MiB; zero2: "
                                    f"reduce_scatter {ours_rs / 2**20:.2f} MiB)")
    if "ds_zero3" in rows and total_bytes(rows["ds_zero3"], "all_gather", theory=True):
        measured, theory = (total_bytes(rows["ds_zero3"], "all_gather", t) for t in (False, True))
        values["ds_zero3_bytes"] = (f"{measured / theory:.2f}x the ZeRO-3 theory ({measured / 2**20:.2f} vs "
                                    f"{theory / 2**20:.2f} MiB per step)")
    return values


def scaling_values(results: dict[int, dict], img: Path) -> dict:
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
    throughput = lambda n, name: results[n]["global_batch"] / results[n]["rows"][name]["step_s"]["median"]  # noqa: E731
    state = lambda n, name: results[n]["rows"][name]["model_state_bytes"]["total"]  # noqa: E731
    return dict(
        scale_commands="\n".join(f"- `{command(runs()[f'scale_{n}'])}`" for n in results),
        scale_table=markdown_table(headers, body), crowded=cores + 1, most=last, fewest=first,
        scale_throughput=", ".join(f"{n} {throughput(last, n) / throughput(cores, n):.2f}x" for n in names
                                   if cores in results),
        scale_state=", ".join(f"{n} {state(last, n) / state(first, n):.2f}x" for n in names),
        sharded_share=f"{1 / last:.2f}")


def bucket_values(results: dict[float, dict], img: Path) -> dict:
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
    step = lambda b, n: results[b]["rows"][n]["step_s"]["median"]  # noqa: E731
    return dict(
        bucket_command=command(runs()["bucket_1"]), buckets=list(BUCKETS), wide_psi_m=f"{first['psi'] / 1e6:.1f}",
        wide_grad_mib=f"{first['psi'] * 4 / 2**20:.0f}", bucket_table=markdown_table(headers, body),
        bucket_best=", ".join(f"{n} {best[n]:g} MiB" for n in names),
        bucket_ratios=", ".join(f"{b:g} MiB {r['rows']['ddp']['time_ratio']:.3f}{interval(r['rows']['ddp'])} "
                                f"({speed_verdict(r['rows']['ddp']).split(' (')[0]})" for b, r in results.items()
                                if r["rows"].get("ddp", {}).get("time_ratio") is not None),
        bucket_default=", ".join(f"{n} {step(25, n) / step(best[n], n):.3f}x" for n in names if 25 in results))


def bound_values(results: dict[tuple[str, str], dict]) -> dict:
    headers = ["model", "ddp overlap", "ddp ms", "native_ddp ms", "ddp / native", "ddp hidden", "native hidden"]
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    body = [[model, overlap, ms(r["rows"]["ddp"]["step_s"]["median"]), ms(r["rows"]["native_ddp"]["step_s"]["median"]),
             f"{r['rows']['ddp']['time_ratio']:.3f}", pct(r["rows"]["ddp"]["hidden_fraction"]),
             pct(r["rows"]["native_ddp"]["hidden_fraction"])] for (model, overlap), r in results.items()]
    ratio = lambda model, overlap: results[(model, overlap)]["rows"]["ddp"]["time_ratio"]  # noqa: E731
    gain = {m: ratio(m, "true") / ratio(m, "false") for m in ("gpt_nano", "mlp_wide")
            if (m, "true") in results and (m, "false") in results}
    share = {model: r["rows"]["native_ddp"]["comm_s"] / r["rows"]["native_ddp"]["step_s"]["median"]
             for (model, overlap), r in results.items() if overlap == "false"}
    return dict(bound_commands="\n".join(f"- `{command(runs()[f'bound_{m}_{o}'])}`" for m, o in results),
                bound_table=markdown_table(headers, body), bound_gain=", ".join(f"{m} {g:.3f}" for m, g in gain.items()),
                bound_share=", ".join(f"{m} {100 * x:.0f}%" for m, x in share.items()))


def hybrid_values() -> dict:
    if not have("hybrid"):
        return {"hybrid": False}
    r = load("hybrid")
    rows = r["rows"]
    return dict(hybrid=True, hybrid_command=command(runs()["hybrid"]), hybrid_targets="\n".join(targets_lines(rows)),
                hybrid_sent=", ".join(f"{n} {sum(rows[n]['bytes_per_step'].values()) / 2**20:.2f} MiB" for n in rows),
                **run_values("hybrid", r))


def span(values: list[float], fmt) -> str:
    """"a-b" from the least to the most of `values`, or "a" where they round alike."""
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low}-{high}"


def accumulate_values() -> dict:
    """strategy.accumulate local against sharded at 4 micro-batches: peak memory, bytes, step time."""
    if not have("accumulate"):
        return {"accumulate": False}
    r = load("accumulate")
    rows, n, psi = r["rows"], r["world_size"], r["psi"]
    pairs = [(rows[b], rows[b + "_sharded"]) for b in ACCUMULATED]
    lines = []
    for a, b in pairs:
        rs = b["bytes_per_step"]["reduce_scatter"] / a["bytes_per_step"]["reduce_scatter"] if \
            "reduce_scatter" in a["bytes_per_step"] else None  # fully_shard's bytes are not traced
        lines.append(f"- {a['strategy']}: peak {mib(a['peak_bytes'])} local, {mib(b['peak_bytes'])} sharded "
                     f"({mib(a['peak_bytes'] - b['peak_bytes'])} less)" + (f"; {rs:.2f}x the reduce_scatter bytes" if rs else "")
                     + f"; step time {b['time_ratio']:.3f}{interval(b)} of local's.")
    zero2 = rows["zero2"]["model_state_bytes"]["total"]
    return dict(
        accumulate=True, acc_command=command(runs()["accumulate"]), acc_pairs="\n".join(lines),
        acc_saved_theory=mib(4 * psi * (n - 1) / n),  # the full gradient less its shard
        acc_saved=span([a["peak_bytes"] - b["peak_bytes"] for a, b in pairs], mib),
        acc_slower=span([b["time_ratio"] for _, b in pairs], "{:.2f}".format), acc_zero2_state=mib(zero2),
        acc_zero2_paper=f"{zero2 / model_state_bytes(variant_spec('zero2'), psi, n):.3f}", acc_memory=memory_table(rows),
        **run_values("acc", r))


CHECKPOINT = DATA / "checkpoint_async.json"
CHECKPOINT_COMMAND = ["rounds=5", "steps=40", "ckpt_every=10", "micro_batch_size=1"]
# issue 56: async blocks training at most 0.15x as long as sync; the whole run at most 3% slower
# than with no checkpoint but the last; the steps beside a write at most 1.05x the steps of that run
CHECKPOINT_GOALS = {"blocked_async_over_sync": 0.15, "run_async_over_none": 1.03, "writing_step_over_none": 1.05}


def checkpoint_run() -> None:
    """recipes/bench_checkpoint.py: none vs sync vs async checkpoints, paired rounds."""
    import torch

    results, wall = run_recipe("bench_checkpoint.py", CHECKPOINT_COMMAND, OUT / "checkpoint_async")
    record(CHECKPOINT, results, provenance("python recipes/bench_checkpoint.py " + " ".join(CHECKPOINT_COMMAND),
                                            torch.__version__), wall_s=wall)


def checkpoint_values() -> dict:
    if not CHECKPOINT.is_file():
        return {"checkpoint": False}
    r, p = results_of(CHECKPOINT)
    if "results" not in r:  # (recorded before the none way and the writer process)
        return {"checkpoint": False}
    ratio = lambda x: f"{x['median']:.3f} [{x['ci'][0]:.3f}, {x['ci'][1]:.3f}]"  # noqa: E731
    times, goals = [], []
    for strategy, s in r["results"].items():
        m = s["medians"]
        for way in ("none", "sync", "async"):
            times.append([strategy, way, f"{m[way]['run_s']:.1f} s", f"{m[way]['blocked_s']:.2f} s",
                          f"{m[way]['write_s']:.2f} s", f"{m[way]['step_s'] * 1e3:.0f} ms",
                          f"{m[way]['writing_step_s'] * 1e3:.0f} ms" if "writing_step_s" in m[way] else "-"])
        row = [strategy]
        for key, goal in CHECKPOINT_GOALS.items():
            x = s["ratios"][key]
            row.append(f"{ratio(x)}: " + ("met" if x["median"] <= goal else "NOT met"))
        goals.append(row + [ratio(s["ratios"]["run_sync_over_none"])])
    met = sum(cell.endswith(": met") for row in goals for cell in row)
    n_ckpt = r["steps"] // r["ckpt_every"]  # the async runs' checkpoints, the last one among them
    beside = [s["ratios"]["writing_step_over_none"]["median"] for s in r["results"].values()]
    each = {k: [s["medians"][way]["write_s"] / n for s in r["results"].values()] for k, way, n in
            (("async", "async", n_ckpt), ("none", "none", 1))}
    return dict(
        checkpoint=True, **made_by(p, "ckpt_"), ckpt_model=r["model"], ckpt_world=r["world_size"],
        ckpt_steps=r["steps"], ckpt_every=r["ckpt_every"], ckpt_rounds=r["rounds"], ckpt_cpus=r.get("cpus"),
        ckpt_times=markdown_table(["strategy", "checkpoints", "whole run", "training blocked", "writing",
                                   "median step", "median step beside a write"], times),
        ckpt_goals=markdown_table(["strategy", "blocked: async / sync (<= 0.15)", "run: async / none (<= 1.03)",
                                   "steps beside a write / none's (<= 1.05)", "run: sync / none"], goals),
        ckpt_met=f"{met} of {len(goals) * len(CHECKPOINT_GOALS)}",
        ckpt_beside=f"{min(beside):.2f}-{max(beside):.2f}x the median step of the run without checkpoints (by strategy)",
        ckpt_write_each=span(each["async"], "{:.1f}".format) + " s", ckpt_write_none=span(each["none"], "{:.1f}".format) + " s",
        ckpt_no_core=r.get("cpus") is not None and r["cpus"] <= r["world_size"])


SHM = DATA / "shm.json"
SHM_SIZES = [1 << 20, 4 << 20, 32 << 20]
SHM_BENCH = ["algorithms=[backend,shm,shm_inplace,memcpy]", "ops=[all_reduce,reduce_scatter,all_gather,broadcast]",
             f"sizes=[{','.join(map(str, SHM_SIZES))}]", "rounds=20", "calls=20"]  # calls: as nccl-tests' iterations
SHM_DDP = [*WIDE, "compare.strategies=[ddp,native_ddp]", "compare.steps=200"]
SHM_ZERO = ["compare.strategies=[zero2,ds_zero2,zero3,native_fsdp]", "compare.steps=30"]
SHM_PAIRS = 5  # DataParallel over native DDP: this many runs each way (shm, gloo), interleaved run by run
TRAIN_PAIRS = 3  # make train: this many runs each way, alternating (one run's exposed communication moves 2-3x)
SHM_TARGETS = {"busbw_over_gloo": 3.0, "of_memcpy": 0.5, "ddp_shm": 0.70, "ddp_gloo": 1.00}
# issue 56's "lower than today's" for zero2 and zero3: the main run as it was before shared memory
# (2026-12-04, gloo and the ring), kept as it ran: compare_main_gloo.json
MAIN_BEFORE_SHM = "main_gloo"
# The shm run before optim.fused=auto took the fused optimizer kernels on CPU (foreach's), kept as it ran
SHM_FOREACH = DATA / "shm_foreach.json"


def shm_run() -> None:
    """Shared memory against gloo on one host: the collectives (bench_ring.py at 2 and 4 ranks,
    beside a memcpy of the same bytes), DataParallel over native DDP on the communication-bound
    MLP (SHM_PAIRS runs of each, alternating), make train's exposed communication, and zero2 /
    zero3 against their references."""
    import torch

    out: dict = {"collectives": {}, "ddp": {"shm": [], "backend": []}, "train": {}}
    for n in (2, 4):
        out["collectives"][n], _ = run_recipe("bench_ring.py", [f"nproc={n}", *SHM_BENCH], OUT / f"shm_bench_{n}")
    for k in range(SHM_PAIRS):
        for way in (("shm", "backend") if k % 2 == 0 else ("backend", "shm")):
            r, _ = run_recipe("compare.py", [*SHM_DDP, f"+compare.overrides.ddp.collectives={way}"],
                              OUT / f"shm_ddp_{way}_{k}", label=f"ddp {way} {k + 1}/{SHM_PAIRS}")
            row = r["rows"]["ddp"]
            out["ddp"][way].append({"ratio": row["time_ratio"], "ci": row["time_ratio_ci"], "step_s": row["step_s"]["median"]})
    for k in range(TRAIN_PAIRS):
        for way in (("backend", "auto") if k % 2 == 0 else ("auto", "backend")):
            summary, _ = run_recipe("train.py", [f"strategy.collectives={way}"], OUT / f"shm_train_{way}_{k}", "summary.json")
            out["train"].setdefault(way, []).append({key: summary[key] for key in ("time/step_s", "time/exposed_comm_s")})
    r, _ = run_recipe("compare.py", SHM_ZERO, OUT / "shm_zero")
    out["zero"] = {k: {"ratio": v["time_ratio"], "ci": v["time_ratio_ci"]} for k, v in r["rows"].items()
                   if v["time_ratio"] is not None}
    record(SHM, out, provenance("python scripts/make_benchmarks.py --only shm", torch.__version__))


def shm_foreach_values(ddp: dict) -> dict:
    """The DataParallel runs with foreach's optimizer kernels (SHM_FOREACH) beside these: how much
    shorter each way's median step is now, and whether by the same time (the optimizer's step,
    the same work on both sides) or not."""
    if not SHM_FOREACH.is_file():
        return {"shm_foreach": False}
    old = load_record(SHM_FOREACH)
    then = old["results"]["ddp"]
    median = lambda runs, key: statistics.median(x[key] for x in runs)  # noqa: E731
    step = {w: median(then[w], "step_s") * 1e3 for w in ("shm", "backend")}
    less = {w: step[w] - median(ddp[w], "step_s") * 1e3 for w in ("shm", "backend")}
    alike = abs(less["shm"] - less["backend"]) <= 0.15 * max(less.values())
    return dict(shm_foreach=True, shm_foreach_when=f"{old['provenance']['date']}, {old['provenance']['commit'][:7]}",
                shm_foreach_shm=f"{median(then['shm'], 'ratio'):.3f}",
                shm_foreach_gloo=f"{median(then['backend'], 'ratio'):.3f}",
                shm_foreach_step_shm=f"{step['shm']:.1f}", shm_foreach_step_gloo=f"{step['backend']:.1f}",
                shm_foreach_less_shm=f"{less['shm']:.1f}", shm_foreach_less_gloo=f"{less['backend']:.1f}",
                shm_foreach_why="about the same time, work both sides do alike; the ratio with shared memory moved "
                "because the optimizer's share of the step shrank, not because the all_reduce got faster" if alike else
                "different times, so more than the optimizer's step changed")


def shm_values() -> dict:
    if not SHM.is_file():
        return {"shm": False}
    r, p = results_of(SHM)
    t = SHM_TARGETS
    tables, checks, inplace, inplace_checks = [], [], [], []
    calls = next(iter(r["collectives"].values()))["rows"][0].get("calls", 1)  # (recorded since calls= existed)
    for n, d in r["collectives"].items():
        body = []
        for row in d["rows"]:
            ms, bw, sp = row["ms"], row["busbw_GBps"], row["speedup"]["shm"]
            body.append([row["op"], f"{row['bytes'] >> 20} MiB", f"{ms['backend']:.2f}", f"{ms['shm']:.2f}",
                         f"{ms['memcpy']:.2f}", f"{bw['backend']:.2f}", f"{bw['shm']:.2f}", f"{bw['memcpy']:.2f}",
                         f"{sp['median']:.2f} [{sp['ci'][0]:.2f}, {sp['ci'][1]:.2f}]", f"{bw['shm'] / bw['memcpy']:.0%}"])
            if row["op"] == "all_reduce":
                checks.append((n, row["bytes"] >> 20, sp, bw["shm"] / bw["memcpy"]))
            if "shm_inplace" in ms:  # (all_reduce's alone; recorded since 2026-12-06)
                sp = row["speedup"]["shm_inplace"]
                inplace.append([f"{n}", f"{row['bytes'] >> 20} MiB", f"{ms['backend']:.2f}", f"{ms['shm']:.2f}",
                                f"{ms['shm_inplace']:.2f}", f"{bw['shm_inplace']:.2f}", f"{bw['memcpy']:.2f}",
                                f"{sp['median']:.2f} [{sp['ci'][0]:.2f}, {sp['ci'][1]:.2f}]",
                                f"{bw['shm_inplace'] / bw['memcpy']:.0%}"])
                inplace_checks.append((n, row["bytes"] >> 20, sp, bw["shm_inplace"] / bw["memcpy"]))
        tables.append(f"{n} ranks:\n\n" + markdown_table(
            ["op", "size", "gloo ms", "shm ms", "memcpy ms", "busbw gloo GB/s", "busbw shm GB/s", "memcpy GB/s",
             "gloo / shm [95%]", "shm busbw / memcpy"], body))
    def judged(items, ok):
        good = [label for label, v in items if ok(v)]
        bad = [label for label, v in items if not ok(v)]
        return ("met at " + ", ".join(good) if good else "") + ("; " if good and bad else "") + \
            ("NOT met at " + ", ".join(bad) if bad else "")
    def goals(checks):  # (at least busbw_over_gloo x gloo's, at least of_memcpy of memcpy's)
        return (judged([(f"{n} ranks {mib} MiB ({sp['median']:.1f}x)", sp) for n, mib, sp, _ in checks],
                       lambda sp: sp["ci"][0] >= t["busbw_over_gloo"]),
                judged([(f"{n} ranks {mib} MiB ({f:.0%})", f) for n, mib, _, f in checks], lambda f: f >= t["of_memcpy"]))
    (over_gloo, of_memcpy), (inplace_over_gloo, inplace_of_memcpy) = goals(checks), goals(inplace_checks)
    ddp = {}
    for way, runs in r["ddp"].items():
        ratios = [x["ratio"] for x in runs]
        med = statistics.median(ratios)
        ddp[way] = dict(runs=len(runs), median=f"{med:.3f}", span=f"{min(ratios):.3f}-{max(ratios):.3f}",
                        step=f"{statistics.median(x['step_s'] for x in runs) * 1e3:.1f}",
                        each=", ".join(f"{x['ratio']:.3f} [{x['ci'][0]:.3f}, {x['ci'][1]:.3f}]" for x in runs),
                        met="met" if med <= t["ddp_" + ("shm" if way == "shm" else "gloo")] else "NOT met")
    tr = r["train"]  # each way: TRAIN_PAIRS runs
    exposed = {w: statistics.median(x["time/exposed_comm_s"] for x in runs) for w, runs in tr.items()}
    step = {w: statistics.median(x["time/step_s"] for x in runs) for w, runs in tr.items()}
    # "lower than today's": the main run's ratios when ours still went through gloo and the ring (kept)
    before = load_record(data_file(MAIN_BEFORE_SHM))
    zero_then, then = before["results"]["rows"], f"{before['provenance']['date']}, {before['provenance']['commit'][:7]}"
    zero = [f"{k} {v['ratio']:.3f} [{v['ci'][0]:.3f}, {v['ci'][1]:.3f}] (with gloo and the ring, the main run of {then}: "
            f"{zero_then[k]['time_ratio']:.3f}; {'lower' if v['ratio'] < zero_then[k]['time_ratio'] else 'NOT lower'})"
            for k, v in r["zero"].items()]  # ours: the references have no ratio
    return dict(
        shm=True, **made_by(p, "shm_"), **shm_foreach_values(r["ddp"]), shm_tables="\n\n".join(tables),
        shm_over_gloo=over_gloo, shm_of_memcpy=of_memcpy,
        shm_inplace=bool(inplace), shm_inplace_over_gloo=inplace_over_gloo, shm_inplace_of_memcpy=inplace_of_memcpy,
        shm_inplace_table=markdown_table(["ranks", "size", "gloo ms", "shm ms", "in place ms", "busbw in place GB/s",
                                          "memcpy GB/s", "gloo / in place [95%]", "in place busbw / memcpy"], inplace),
        shm_calls="one call (its latency: how far apart the ranks leave the barrier counts too)" if calls == 1 else
        f"{calls} calls back to back (as nccl-tests times its iterations), the time per call",
        shm_target_gloo=f"{t['busbw_over_gloo']:g}", shm_target_memcpy=f"{t['of_memcpy']:.0%}",
        shm_ddp_command="python recipes/compare.py " + " ".join(SHM_DDP), shm_pairs=SHM_PAIRS,
        **{f"shm_ddp_{way}_{k}": v for way, d in ddp.items() for k, v in d.items()},
        shm_target_ddp=f"{t['ddp_shm']:.2f}", shm_target_gloo_ddp=f"{t['ddp_gloo']:.2f}",
        shm_train_gloo=f"{exposed['backend'] * 1e3:.1f}", shm_train_shm=f"{exposed['auto'] * 1e3:.1f}",
        shm_train_ratio=f"{exposed['auto'] / exposed['backend']:.2f}",
        shm_train_met="met" if exposed["auto"] <= exposed["backend"] / 2 else "NOT met",
        shm_train_step_gloo=f"{step['backend'] * 1e3:.1f}", shm_train_step_shm=f"{step['auto'] * 1e3:.1f}",
        shm_train_runs=len(tr["auto"]),
        shm_train_each="; ".join(f"{a['time/exposed_comm_s'] * 1e3:.1f} / {b['time/exposed_comm_s'] * 1e3:.1f}"
                                 for a, b in zip(tr["auto"], tr["backend"])),
        shm_zero="; ".join(zero))


MUON = DATA / "muon.json"


def muon_values() -> dict:
    """scripts/measure_muon.py: Muon + AdamW under ZeRO: state per rank, bytes, ZeRO-1's step time."""
    if not MUON.is_file():
        return {"muon": False}
    r, p = results_of(MUON)
    n, hidden, psi = r["world_size"], r["hidden"], r["psi"]
    body = []
    for name, v in r["variants"].items():
        stage, optimizers = name.split(" ", 1)
        theory = (4 * hidden + 8 * (psi - hidden) if "Muon" in optimizers else 8 * psi) / (n if stage != "DataParallel" else 1)
        plain = r["variants"][f"{stage} AdamW"]["sent_bytes"]
        body.append([name, " / ".join(f"{b / 2**20:.2f}" for b in v["state_bytes"]), f"{theory / 2**20:.2f}",
                     f"{max(v['state_bytes']) / theory:.3f}", f"{v['sent_bytes'] / 2**20:.2f}",
                     f"{v['sent_bytes'] / plain:.3f}"])
    ratio = r["zero1_over_ddp"]
    worst = max((v["sent_bytes"] / r["variants"][k.replace("Muon + AdamW", "AdamW")]["sent_bytes"], k)
                for k, v in r["variants"].items() if "Muon" in k)
    return dict(
        muon=True, **made_by(p, "muon_"), muon_world=n,
        muon_psi_m=f"{psi / 1e6:.2f}", muon_hidden_m=f"{hidden / 1e6:.2f}", muon_steps=len(r["step_s"]["ZeRO-1"]),
        muon_table=markdown_table(["variant", "optimizer state MiB per rank", "formula MiB", "/ formula",
                                   "bytes sent MiB", "/ AdamW alone"], body),
        muon_ratio=f"{ratio['median']:.3f} [{ratio['ci'][0]:.3f}, {ratio['ci'][1]:.3f}]",
        muon_goal="met" if ratio["ci"][1] < 1.0 else "NOT met" if ratio["ci"][0] >= 1.0 else "not decided by this run",
        muon_pad=f"{worst[0] - 1:.1%}", muon_pad_where=worst[1])


META_WRAP = DATA / "meta_wrap.json"


def meta_wrap_values() -> dict:
    """scripts/measure_meta_wrap.py: the resident set of wrapping a meta-built model, ours vs FSDP2's."""
    if not META_WRAP.is_file():
        return {"meta": False}
    r, p = results_of(META_WRAP)
    cases, body, worse = r["cases"], [], []
    med = lambda key, f: statistics.median(c[f] for c in cases[key]) / 2**20  # noqa: E731
    for world in r["worlds"]:
        for allocator in ("glibc", "minidist"):
            ours, fsdp2 = f"ours {world} {allocator}", f"fsdp2 {world} {allocator}"
            body.append([str(world), allocator, *(f"{med(k, f):.1f}" for f in ("peak", "kept") for k in (ours, fsdp2)),
                         f"{med(ours, 'state'):.1f}"])
            for f in ("peak", "kept"):  # paired by round: ours - FSDP2's
                diffs = [(a[f] - b[f]) / 2**20 for a, b in zip(cases[ours], cases[fsdp2])]
                worse += [(statistics.median(diffs), max(diffs), f"{f} at {world} ranks ({allocator})")]
    last = f"ours {r['worlds'][-1]} minidist"
    return dict(
        meta=True, **made_by(p, "meta_"), meta_blocks=r["blocks"], meta_width=r["width"], meta_rounds=r["rounds"],
        meta_model=f"{r['blocks'] * 2 * (r['width'] + 1) * r['width'] * 4 / 2**20:.0f}",
        meta_table=markdown_table(["ranks", "allocator", "peak: ours", "peak: FSDP2", "kept: ours", "kept: FSDP2",
                                   "model state a rank"], body),
        meta_verdict="met" if all(m <= 0 for m, _, _ in worse) else "NOT met: " + "; ".join(
            f"{where} {m:+.1f} MiB" for m, _, where in worse if m > 0),
        meta_most=f"{max(x for _, x, _ in worse):+.1f}", meta_world=r["worlds"][-1],
        meta_state=f"{med(last, 'state'):.1f}", meta_anon=f"{med(last, 'kept') - med(last, 'state'):.1f}",
        meta_file=f"{med(last, 'kept_file'):.1f}", meta_file_fsdp2=f"{med(last.replace('ours', 'fsdp2'), 'kept_file'):.1f}")


WIRES = DATA / "wires_zero3.json"
ZEROPP = DATA / "zeropp_shaped.json"
WIRE_BYTES_GOAL = 0.35   # int8 weights + gradients: at most this share of plain zero3's bytes per step
LOSS_BOUND, LOSS_GOAL = 0.02, 0.01  # validation loss within 2% of plain zero3 (goal: 1%)


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


def wires_values() -> dict:
    """scripts/measure_wires.py: zero3 with and without int8 wires, bytes by collective and the loss."""
    if not WIRES.is_file():
        return {"wires": False}
    r, p = results_of(WIRES)
    runs = r["runs"]
    steps = sorted({x["steps"] for x in runs})
    plain = {s: next(x for x in runs if x["steps"] == s and x["variant"] == "plain") for s in steps}
    body = []
    for x in (x for x in runs if x["steps"] == steps[0]):
        losses = []
        for s in steps:
            y = next(z for z in runs if z["steps"] == s and z["variant"] == x["variant"])
            delta = (y["val_loss"] - plain[s]["val_loss"]) / plain[s]["val_loss"]
            losses.append(f"{y['val_loss']:.4f}" + ("" if y is plain[s] else f" ({delta:+.2%})"))
        body.append([x["variant"], mib(x["bytes_per_step"]), f"{x['bytes_per_step'] / plain[steps[0]]['bytes_per_step']:.3f}x",
                     mib(x["by_op"].get("reduce_scatter", 0)), mib(x["by_op"].get("all_gather", 0)), *losses])
    ratio, worst, judged = wires_figures(r)
    theory = r["theory"]
    return dict(
        wires=True, **made_by(p, "wires_"), wires_model=r["model"], wires_psi_m=f"{runs[0]['parameters'] / 1e6:.2f}",
        wires_world=runs[0]["world_size"],
        wires_strategy=r["strategy"], wires_lengths=" and ".join(map(str, steps)), quant_block=r["quant_block"],
        wires_table=markdown_table(["variant", "bytes per step", "vs plain", "reduce_scatter", "all_gather",
                                    *(f"val loss, {s} steps" for s in steps)], body),
        theory_plain=mib(sum(theory["plain"].values())), theory_rs=mib(theory["plain"]["reduce_scatter"]),
        theory_ag=mib(theory["plain"]["all_gather"]), theory_int8=mib(sum(theory["int8"].values())),
        wires_ratio=f"{ratio:.3f}", wires_goal=WIRE_BYTES_GOAL, wires_met="met" if ratio <= WIRE_BYTES_GOAL else "NOT met",
        judged=judged, judged_worst=f"{worst[judged]:.2%}", loss_bound=f"{LOSS_BOUND:.0%}", loss_goal=f"{LOSS_GOAL:.0%}",
        loss_verdict=("met, the goal too" if worst[judged] <= LOSS_GOAL else "met, not the goal"
                      if worst[judged] <= LOSS_BOUND else "NOT met"),
        longest=steps[-1], longest_worst=f"{worst[steps[-1]]:.2%}", **zeropp_values(), **before_after_values())


BEFORE_AFTER = DATA / "ddp_before_after.json"


def before_after_values() -> dict:
    """scripts/measure_ddp_before_after.py: ddp / native_ddp before a change and after it."""
    if not BEFORE_AFTER.is_file():
        return {"before_after": False}
    r, p = results_of(BEFORE_AFTER)
    body, said = [], []
    for model, row in r["models"].items():
        b, a = row["before"], row["after"]
        body.append([model, f"{b['ratio']:.3f} [{b['ci'][0]:.3f}, {b['ci'][1]:.3f}]",
                     f"{a['ratio']:.3f} [{a['ci'][0]:.3f}, {a['ci'][1]:.3f}]"])
        overlap = a["ci"][0] <= b["ci"][1] and b["ci"][0] <= a["ci"][1]
        under = "at or under 1.00" if a["ratio"] <= 1.0 else "above 1.00"
        said.append(f"{model}: after {a['ratio']:.3f} ({under}; the target counts as met only when the whole "
                    f"interval is: {'met' if a['ci'][1] <= 1.0 else 'not decided by this run' if a['ci'][0] <= 1.0 else 'NOT met'}), "
                    + ("its interval overlaps before's: no cost measurable" if overlap
                       else "its interval does not overlap before's: a measurable change"))
    return dict(before_after=True, ba_change=r.get("change", "`grad_wire=null` (the default)"),
                **made_by(p, "ba_"), ba_before=r["before"][:12],
                ba_table=markdown_table(["model", "before", "after"], body), ba_verdicts="; ".join(said))


def zeropp_ratios(v: dict) -> dict[str, list[float]]:
    """zero3_zeropp's step time over zero3's and native_fsdp's, round by round."""
    return {k: [a / b for a, b in zip(v["zero3_zeropp"]["step_s"], v[k]["step_s"])] for k in ("zero3", "native_fsdp")}


def zeropp_values() -> dict:
    """scripts/zeropp_local.sh: step times on emulated hosts with shaped links."""
    if not ZEROPP.is_file():
        return {"zeropp": False}
    r, p = results_of(ZEROPP)
    v = r["variants"]
    med = {k: statistics.median(x["step_s"]) for k, x in v.items()}
    body = [[k, f"{med[k] * 1e3:.0f} ms", ", ".join(f"{s * 1e3:.0f}" for s in x["step_s"]),
             mib(x["bytes_per_step"]) if x["bytes_per_step"] else "(not traced)",
             mib(x["host_tx_bytes_per_step"])] for k, x in v.items()]
    vs = zeropp_ratios(v)
    return dict(
        zeropp=True, **made_by(p, "zpp_"), zpp_hosts=r["hosts"],
        zpp_per_host=r["per_host"], zpp_rate=r["rate"], zpp_rounds=len(v["zero3"]["step_s"]),
        zpp_table=markdown_table(["variant", "median step", "each round (ms)", "sent per rank (traced)",
                                  "out of each host per step"], body),
        zpp_vs_zero3=f"{statistics.median(vs['zero3']):.3f}", zpp_vs_zero3_range=f"{min(vs['zero3']):.3f}-{max(vs['zero3']):.3f}",
        zpp_vs_fsdp=f"{statistics.median(vs['native_fsdp']):.3f}",
        zpp_vs_fsdp_range=f"{min(vs['native_fsdp']):.3f}-{max(vs['native_fsdp']):.3f}",
        zpp_faster=("faster than both in every round" if all(max(x) < 1 for x in vs.values())
                    else "NOT faster than both in every round"), **zeropp_prediction(r, med))


def zeropp_prediction(r: dict, med: dict[str, float]) -> dict:
    """The cost model's communication per step for zero3 and zero3_zeropp on the links docs/scale.md
    calibrated at the same rate, against the step times' difference (the compute is the same)."""
    from omegaconf import OmegaConf

    import costmodel

    calibrated = ROOT / "docs" / "scale" / "data" / f"validate_{r['rate']}.json"
    if not calibrated.is_file() or not WIRES.is_file():
        return {"zpp_predicted": False}
    c = costmodel.Cluster.calibrated(load_record(calibrated)["results"])
    psi = load_record(WIRES)["results"]["runs"][0]["parameters"]  # gpt_nano's, as trained here
    units = int(OmegaConf.load(ROOT / "configs" / "model" / "gpt_nano.yaml").n_layer) + 1  # blocks + the root
    strategy, wires = costmodel.VARIANTS["zero3_zeropp"]
    plain = costmodel.step_comm_time(strategy, psi, r["hosts"], c, comm_bytes=4, units=units)["total"]
    zeropp = costmodel.step_comm_time(strategy, psi, r["hosts"], c, comm_bytes=4, units=units, **wires)["total"]
    predicted, measured = plain - zeropp, med["zero3"] - med["zero3_zeropp"]
    error, bound = (predicted - measured) / measured, costmodel_tolerance()
    return dict(zpp_predicted=True, zpp_plain_ms=f"{plain * 1e3:.0f}", zpp_zeropp_ms=f"{zeropp * 1e3:.0f}",
                zpp_saved_ms=f"{predicted * 1e3:.0f}", zpp_measured_ms=f"{measured * 1e3:.0f}", zpp_error=f"{error:+.0%}",
                zpp_within="within" if abs(error) <= bound else "NOT within", zpp_bound=f"{bound:.0%}")


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
    return fill(
        "benchmarks.md", dates=", ".join(sorted({load_record(f)["provenance"]["date"] for f in DATA.glob("compare_*.json")})),
        cores=env["cores"], torch=env["torch"], deepspeed=env["deepspeed"], python=env["python"], backend=env["backend"],
        **main_values(main), **scaling_values({n: load(f"scale_{n}") for n in WORLDS if have(f"scale_{n}")}, img),
        **bucket_values({b: load(f"bucket_{b}") for b in BUCKETS if have(f"bucket_{b}")}, img),
        **bound_values({(m, o): load(f"bound_{m}_{o}") for m in ("gpt_nano", "mlp_wide") for o in ("true", "false")
                        if have(f"bound_{m}_{o}")}),
        **hybrid_values(), **accumulate_values(), **checkpoint_values(), **shm_values(), **wires_values(), **muon_values(),
        **meta_wrap_values(),
        **diloco_doc.values(img))


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
                     "checkpoint": checkpoint_run, "shm": shm_run},
                    readme_quotes=with_quotes,
                    quote_tag="benchmarks")

if __name__ == "__main__":
    sys.exit(main(DOCUMENT))
