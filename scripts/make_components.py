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
from doc_pipeline import Document, fill, load as load_record, main, provenance, record, run_recipe  # noqa: E402
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


# --------------------------------------------------------------------------- the figures (scripts/templates/components*.md say the rest)

COLLECTIVE_SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)


def collectives_values(runs: dict[int, dict]) -> dict:
    if not runs:
        return {"collectives": False}
    parts = []
    for n, d in runs.items():
        meta, rows = d["results"]["meta"], d["results"]["results"]
        memcpy = meta["memcpy_GBps"]
        cell = {(r["op"], r["mode"], r["bytes"]): r for r in rows}
        ops = list(dict.fromkeys(r["op"] for r in rows))
        body = [[op, mode, *(f"{cell[(op, mode, s)]['busbw_GBps']:.2f}" if (op, mode, s) in cell else "-"
                             for s in COLLECTIVE_SIZES)]
                for op in ops for mode in ("sync", "async") if any(k[:2] == (op, mode) for k in cell)]
        best = max(rows, key=lambda r: r["busbw_GBps"])
        rs, ar = (cell.get((op, "sync", 16 << 20)) for op in ("reduce_scatter", "all_reduce"))
        gains = [cell[(r["op"], "async", r["bytes"])]["busbw_GBps"] / r["busbw_GBps"] for r in rows
                 if r["mode"] == "sync" and r["bytes"] >= 64 << 10 and r["busbw_GBps"] > 0
                 and (r["op"], "async", r["bytes"]) in cell]
        parts.append(fill(
            "components_collectives.md", n=n, crowded=n > 2, memcpy=f"{memcpy:.2f}", provenance=provenance_line(d),
            table=markdown_table(["op", "mode", *(size(s) for s in COLLECTIVE_SIZES)], body), best_op=best["op"],
            best_mode=best["mode"], best_size=size(best["bytes"]), best_busbw=f"{best['busbw_GBps']:.2f}",
            best_share=f"{100 * best['busbw_GBps'] / memcpy:.0f}", stack_bound=best["busbw_GBps"] < 0.8 * memcpy,
            at16=bool(rs and ar), **({"rs_over_ar": f"{rs['time_us'] / ar['time_us']:.2f}", "rs_busbw": f"{rs['busbw_GBps']:.2f}",
                                      "ar_busbw": f"{ar['busbw_GBps']:.2f}"} if rs and ar else {}),
            gains=f"{statistics.median(gains):.2f}" if gains else "",
            **({"gains_range": f"{min(gains):.2f}-{max(gains):.2f}"} if gains else {})))
    meta = next(iter(runs.values()))["results"]["meta"]
    return dict(collectives="\n".join(parts), coll_warmup=meta["warmup"], coll_iters=meta["iters"],
                coll_repeats=meta["repeats"])


def ddp_values(d: dict | None) -> dict:
    if d is None:
        return {"ddp": False}
    headers = ["model", "variant", "median step (IQR)", "paired / native [95%]", "exposed comm (end of backward)",
               "same all_reduces alone", "buckets"]
    body, models = [], []
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
        ours, median = v["ours"]["paired_ratio"], lambda name: v[name]["paired_ratio"]["median"]  # noqa: E731
        view, overlap = "ours_bucket_view" in v and "native_bucket_view" in v, "ours_no_overlap" in v
        models.append(fill(
            "components_ddp_model.md", model=res["model"], ratio=f"{ours['median']:.3f}{ci(ours['ci'])}",
            verdict=at_most(ours["median"], ours["ci"]), bucket_view=view, overlap=overlap,
            **({"ours_view": f"{median('ours_bucket_view'):.3f}", "native_view": f"{median('native_bucket_view'):.3f}",
                "view_ratio": f"{median('ours_bucket_view') / median('native_bucket_view'):.3f}"} if view else {}),
            **({"with_ms": f"{v['ours']['exposed_comm_s'] * 1e3:.1f}",
                "without_ms": f"{v['ours_no_overlap']['exposed_comm_s'] * 1e3:.1f}",
                "overlap_ratio": f"{median('ours') / median('ours_no_overlap'):.3f}"} if overlap else {})))
    r = d["results"]
    return dict(ddp=True, ddp_provenance=provenance_line(d), ddp_world=r["world_size"], ddp_warmup=r["warmup"],
                ddp_steps=r["steps"], ddp_table=markdown_table(headers, body), ddp_models="".join(models))


def ring_values(runs: dict[int, dict]) -> dict:
    if not runs:
        return {"ring": False}
    parts, target_items, faster = [], [], {}
    for n, d in runs.items():
        rows = d["results"]["rows"]
        body = [[r["op"], size(r["bytes"]), f"{r['ms']['backend']:.2f}", f"{r['ms']['ring']:.2f}",
                 f"{r['busbw_GBps']['backend']:.2f}", f"{r['busbw_GBps']['ring']:.2f}",
                 f"{r['speedup']['ring']['median']:.2f}{ci(r['speedup']['ring']['ci'])}"] for r in rows]
        parts.append(f"### {n} ranks{' (' + str(n) + ' processes on 2 cores)' if n > 2 else ''}\n\n{provenance_line(d)}\n\n"
                     + markdown_table(["op", "size", "backend ms", "ring ms", "busbw backend GB/s", "busbw ring GB/s",
                                       "speed-up [95%]"], body) + "\n\n")
        for r in rows:
            if r["op"] == "reduce_scatter" and r["bytes"] >= RING_TARGET_FROM:
                target_items.append((at_least(r["speedup"]["ring"]["ci"], RING_TARGET),
                                     f"{n} ranks {size(r['bytes'])} {r['speedup']['ring']['median']:.2f}x"))
            faster[(r["op"], n, r["bytes"])] = "ring" if r["speedup"]["ring"]["ci"][0] > 1 else \
                "backend" if r["speedup"]["ring"]["ci"][1] < 1 else None
    wins_from = RING_WINS_FROM["gloo"]
    against = []
    for (op, n, nbytes), winner in faster.items():
        auto = "ring" if op in wins_from and nbytes >= wins_from[op] else "backend"
        if winner is not None and winner != auto:
            against.append(f"{op} {n} ranks {size(nbytes)} ({winner} faster, auto takes the {auto})")
    return dict(ring="".join(parts), ring_target=RING_TARGET, ring_from=size(RING_TARGET_FROM),
                ring_verdicts=grouped(target_items), ring_against="; ".join(against), ring_agrees=not against,
                ring_4=4 in runs,
                ring_policy=", ".join(f"{op} from {size(b) if b else 'every size'}" for op, b in wins_from.items()))


def zero_values(d: dict | None) -> dict:
    if d is None:
        return {"zero": False}
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
    off = [k for k, f in paper.items() if abs(rows[k]["state_per_psi"] - f) > 0.01]
    return dict(
        zero=True, zero_provenance=provenance_line(d), zero_world=n, zero_psi=f"{psi:,}", zero_warmup=res["warmup"],
        zero_steps=res["steps"], zero_table=markdown_table(headers, body), zero_targets="; ".join(targets),
        zero_per_psi=", ".join(f"{k} {rows[k]['state_per_psi']:.2f} (formula {f:g})" for k, f in paper.items()),
        zero_exact=not off, zero_off=", ".join(off),
        zero_peaks=", ".join(f"{k} {rows[k]['peak_bytes'] / MIB:.1f} MiB with `auto` against "
                             f"{rows[k + '_backend']['peak_bytes'] / MIB:.1f} with gloo's"
                             for k in ("zero1", "zero2", "zero3") if k in rows and k + "_backend" in rows))


def memory_values(d: dict | None) -> dict:
    if d is None:
        return {"memory": False}
    res = d["results"]
    rows = res["results"]
    body = [[r["strategy"], r["collectives"] if "collectives" in variant_spec(r["strategy"]).options else "-",
             f"{r['rss_bytes'] / MIB:.1f} MiB", f"{r['formula_bytes'] / MIB:.1f} MiB",
             f"{r['inflight_bytes'] / MIB:.1f} MiB", f"{r['rss_bytes'] / r['formula_bytes']:.2f}",
             f"{target_bytes(r) / MIB:.1f} MiB", "yes" if r["all_ranks_within_target"] else "no"] for r in rows.values()]
    ours = {k: r for k, r in rows.items()  # our ZeRO stages with our collectives (not the _backend variants)
            if variant_spec(k).kind == "minidist" and variant_spec(k).zero_stage and r["collectives"] != "backend"}
    over = [k for k, r in rows.items() if not r["all_ranks_within_target"]]
    return dict(
        memory=True, mem_provenance=provenance_line(d), mem_world=res["world_size"], mem_psi_m=f"{res['psi'] / 1e6:.1f}",
        mem_table=markdown_table(["strategy", "collectives", "RSS above baseline", "ZeRO formula", "buffers in flight",
                                  "RSS / formula", "bound: 1.15 × formula + 8 MiB + in flight", "within, every rank"], body),
        mem_verdict="met for every stage, on every rank" if all(r["all_ranks_within_target"] for r in ours.values())
        else "NOT met: " + ", ".join(k for k, r in ours.items() if not r["all_ranks_within_target"]),
        mem_ours=", ".join(f"{k} {r['rss_bytes'] / MIB:.1f} MiB, bound {target_bytes(r) / MIB:.1f}" for k, r in ours.items()),
        mem_over=", ".join(over) if over else "none", mem_backend_over=any(k.endswith("_backend") for k in over))


def train_values(d: dict | None) -> dict:
    if d is None:
        return {"train": False}
    s, run = d["results"], d["results"]["config"]
    return dict(
        train=True, train_provenance=provenance_line(d), train_strategy=run["strategy"], train_model=run["model"],
        train_psi_m=f"{s['parameters'] / 1e6:.2f}", train_data=run["data"], train_world=run["world_size"],
        train_steps=s["step"], train_lr=f"{run['lr']:g}", train_wall=f"{d['wall_s']:.0f}", train_loss=f"{s['val/loss']:.3f}",
        train_target=TRAIN_TARGET_LOSS, train_met="met" if s["val/loss"] <= TRAIN_TARGET_LOSS else "NOT met",
        train_tokens=f"{s['throughput/tokens_per_s']:,.0f}", train_tokens_rank=f"{s['throughput/tokens_per_s_per_rank']:,.0f}",
        train_step_ms=f"{s['time/step_s'] * 1e3:.1f}", train_exposed_ms=f"{s.get('time/exposed_comm_s', 0) * 1e3:.1f}",
        train_data_ms=f"{s['time/data_s'] * 1e3:.1f}", train_sent=f"{s['comm/bytes_per_step'] / MIB:.1f}",
        train_state=f"{s['memory/model_state_bytes'] / MIB:.1f}")


def render() -> str:
    """The document, from the committed data alone."""
    return fill("components.md", commands="\n".join(command(name) for name in RUNS),
                **collectives_values({n: d for n in (2, 4) if (d := load(f"collectives_{n}"))}),
                **ddp_values(load("ddp")), **ring_values({n: d for n in (2, 4) if (d := load(f"ring_{n}"))}),
                **zero_values(load("zero")), **memory_values(load("memory")), **train_values(load("train")))


DOCUMENT = Document(Path(__file__), DOC, render, {name: functools.partial(run, name) for name in RUNS})

if __name__ == "__main__":
    sys.exit(main(DOCUMENT))
