"""Regenerate docs/walkthrough.md (and its timelines in docs/img/) from a run of recipes/walkthrough.py.

    python scripts/make_walkthrough_doc.py                # run the walkthrough (~20 s), then the document
    python scripts/make_walkthrough_doc.py --render-only  # rewrite the document from the committed data

The run's results are committed as docs/walkthrough/data/walkthrough.json with the commit, torch
version, command and date that produced it; every figure and judgement in the document is
computed from that file.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "scripts" / "lib"))
from doc_pipeline import Document, fill, made_by, main, provenance, record, results_of, run_recipe  # noqa: E402
from minidist_tools.report import markdown_table  # noqa: E402

OUT = ROOT / "outputs" / "walkthrough_doc"
DOC = ROOT / "docs" / "walkthrough.md"
DATA = ROOT / "docs" / "walkthrough" / "data" / "walkthrough.json"
IMG = ROOT / "docs" / "img"
COMMAND = "python recipes/walkthrough.py"
FILES = {"1 naive": "step1_naive.py", "2 buckets": "step2_buckets.py", "3 overlap": "step3_overlap.py",
         "4 zero1": "step4_zero1.py"}


def image(name: str) -> str:
    return f"walkthrough_{name.replace(' ', '_')}.png"


def run() -> None:
    results, wall = run_recipe("walkthrough.py", [], OUT, label="walkthrough")
    record(DATA, results, provenance(COMMAND, results["torch"]), wall_s=wall)
    IMG.mkdir(parents=True, exist_ok=True)
    for name in results["rows"]:
        shutil.copy(OUT / f"timeline_{name.replace(' ', '_')}.png", IMG / image(name))


def moved(before: float, after: float) -> str:
    """'drops from A to B' / 'rises from A to B', as the figures say."""
    return f"{'drops' if after < before else 'rises'} from {ms(before)} to {ms(after)}"


def ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def render() -> str:
    r, p = results_of(DATA)
    rows = r["rows"]
    headers = ["step", "file", "max difference from native DDP", "collectives per step", "median step",
               "exposed communication", "hidden behind compute (profiled step)"]
    body = [[name, f"`tutorial/walkthrough/{FILES[name]}`" if name in FILES else "`torch.nn.parallel.DistributedDataParallel`",
             "bitwise equal" if x["max_diff"] == 0 else f"{x['max_diff']:.1e}",
             "-" if x.get("collectives_per_step") is None else str(x["collectives_per_step"]), ms(x["step_s"]),
             ms(x["exposed_comm_s"]), "-" if x["hidden_fraction"] is None else f"{100 * x['hidden_fraction']:.0f}%"]
            for name, x in rows.items()]
    worst = max(x["max_diff"] for n, x in rows.items() if n in FILES)
    equal = ("every step ends bitwise equal to native DDP" if worst == 0 else
             f"every step ends within {worst:.1e} of native DDP" if worst <= r["tolerance"] else
             f"NOT every step matches native DDP (largest difference {worst:.1e}, tolerance {r['tolerance']:g})")
    naive, buckets, overlap, zero1 = (rows[n] for n in FILES)
    ratio = lambda a: f"{a['step_s'] / rows['native DDP']['step_s']:.2f}"  # noqa: E731
    hidden = lambda a: f"{100 * (a['hidden_fraction'] or 0):.0f}"  # noqa: E731
    return fill("walkthrough.md", **made_by(p, "", "torch"),
                world_size=r["world_size"], parameters_m=f"{r['parameters'] / 1e6:.2f}", warmup=r["warmup"],
                steps=r["steps"], bucket_cap_mb=f"{r['bucket_cap_mb']:g}", table=markdown_table(headers, body),
                equal=equal, exact=worst == 0 and r["world_size"] == 2,
                naive_calls=naive["collectives_per_step"], naive_exposed=ms(naive["exposed_comm_s"]),
                naive_ratio=ratio(naive), buckets_calls=buckets["collectives_per_step"],
                naive_to_buckets=moved(naive["exposed_comm_s"], buckets["exposed_comm_s"]),
                buckets_to_overlap=moved(buckets["exposed_comm_s"], overlap["exposed_comm_s"]),
                overlap_hidden=hidden(overlap), buckets_hidden=hidden(buckets), overlap_ratio=ratio(overlap),
                zero1_calls=zero1["collectives_per_step"], zero1_exposed=ms(zero1["exposed_comm_s"]))


DOCUMENT = Document(Path(__file__), DOC, render, {"walkthrough": run})

if __name__ == "__main__":
    sys.exit(main(DOCUMENT))
