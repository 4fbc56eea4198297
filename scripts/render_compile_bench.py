"""Render docs/compile.md from the committed results of recipes/bench_compile.py.

    python scripts/render_compile_bench.py                # the CPU runs below, then the document
    python scripts/render_compile_bench.py --render-only  # rewrite docs/compile.md from the committed data
    python scripts/render_compile_bench.py --check        # exit 1 if docs/compile.md is not this rendering

Reads docs/benchmarks/data/compile_*.json, each written by recipes/bench_compile.py in the
documents' data schema (scripts/lib/doc_pipeline.py): here for the CPU runs, by
scripts/gpu_check.sh on a GPU machine for the others. Every judgement is computed from the
data: a variant "keeps pace" when the upper end of its ratio's 95% interval is <= 1.05, is
"slower" when the lower end is above 1.05; otherwise the interval straddles that line.
"""

from __future__ import annotations

import functools
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from minidist_tools.benchmarking import variant_spec  # noqa: E402
sys.path.insert(0, str(ROOT / "scripts" / "lib"))
from doc_pipeline import Document, fill, load, main, run_recipe  # noqa: E402

DATA = ROOT / "docs" / "benchmarks" / "data"
DOC = ROOT / "docs" / "compile.md"
OUT = ROOT / "outputs" / "bench_compile"
TARGET = 1.05  # within 5% of native DDP compiled: what "keeps pace" means here
CPU_RUNS = {"cpu_2ranks_inner": ["placement=inner", "steps=60"], "cpu_2ranks_outer": ["placement=outer", "steps=60"]}


def run(name: str, overrides: list[str]) -> None:
    """The recipe writes its data file itself (it runs where this script does not, too)."""
    run_recipe("bench_compile.py", overrides, OUT / name)
    shutil.copy(OUT / name / "results.json", DATA / f"compile_{name}.json")


def is_reference(variant: str) -> bool:
    """Native DDP compiled, what every variant's step is divided by (recipes/bench_compile.py)."""
    return variant_spec(variant).kind == "native" and not variant.endswith("_eager")


def verdict(lo: float, hi: float) -> str:
    if hi <= TARGET:
        return "keeps pace"
    if lo > TARGET:
        return f"slower (at least {(lo - 1) * 100:.0f}% behind)"
    return "undecided at this noise"


def section(name: str, r: dict) -> str:
    rows = []
    for variant, row in r["variants"].items():
        lo, hi = row["ratio_ci95"]
        judged = "reference" if is_reference(variant) else \
            ("(not compiled: what compiling buys)" if variant.endswith("_eager") else verdict(lo, hi))
        rows.append(f"| {variant} | {row['median_step_s'] * 1e3:.2f} ms | {row['paired_ratio']:.3f} | "
                    f"{lo:.3f}-{hi:.3f} | {judged} |")
    ours = {v: row for v, row in r["variants"].items() if variant_spec(v).kind == "minidist"}
    kept = [v for v, row in ours.items() if row["ratio_ci95"][1] <= TARGET]
    g = r["gpt"]
    return fill("compile_run.md", device=r["device"], world=r["world_size"], plural=r["world_size"] > 1,
                backend=r["backend"], outer=r["placement"] == "outer", inner=r["placement"] != "outer",
                psi_m=f"{r['parameters'] / 1e6:.2f}", layers=g["n_layer"], width=g["n_embd"], batch=g["batch"],
                block=g["block_size"], steps=r["variants"]["native_ddp"]["steps"], warmup=r["warmup"], torch=r["torch"],
                commit=r["commit"][:10], command=r["command"], name=name, rows="\n".join(rows), kept=len(kept),
                ours=len(ours), target=TARGET, keepers=", ".join(kept) or "none")


def render() -> str:
    # each run's provenance beside its results: the sections print both
    results = {path.name: {**(d := load(path))["results"], **d["provenance"]} for path in sorted(DATA.glob("compile_*.json"))}
    return fill("compile.md", runs="".join(section(name, r) + "\n" for name, r in results.items()),
                placements="\n".join(placement_rows(list(results.values()))))


def placement_rows(results: list[dict]) -> list[str]:
    """Per machine and variant: which placement stays closer to native DDP compiled the same way
    (decided only where the two ratios' 95% intervals do not overlap)."""
    lines = []
    by_machine: dict[tuple, dict[str, dict]] = {}
    for r in results:
        by_machine.setdefault((r["device"], r["world_size"]), {})[r["placement"]] = r
    for (device, world), runs in sorted(by_machine.items()):
        if set(runs) != {"inner", "outer"}:
            continue
        for variant in runs["inner"]["variants"]:
            if variant_spec(variant).kind != "minidist" or variant not in runs["outer"]["variants"]:
                continue
            (ilo, ihi), (olo, ohi) = (runs[p]["variants"][variant]["ratio_ci95"] for p in ("inner", "outer"))
            closer = "before wrapping" if ihi < olo else "the wrapper" if ohi < ilo else "either (intervals overlap)"
            lines.append(f"| {device}, {world} rank{'s' if world > 1 else ''} | {variant} | {ilo:.3f}-{ihi:.3f} | "
                         f"{olo:.3f}-{ohi:.3f} | {closer} |")
    return lines


DOCUMENT = Document(Path(__file__), DOC, render, {name: functools.partial(run, name, o) for name, o in CPU_RUNS.items()})

if __name__ == "__main__":
    sys.exit(main(DOCUMENT))
