"""Regenerate docs/scale.md: the cost model's tables and plots, and the model against measurements.

    sudo python scripts/make_scale_doc.py                 # measure at every rate below (~5 min, root), then render
    sudo python scripts/make_scale_doc.py --only 200      # re-measure one rate, then render
    python scripts/make_scale_doc.py --render-only        # rewrite the document from the committed data

The tables, plots, example and picks are computed from scripts/lib/costmodel.py itself (nothing to
measure). The validation section is rendered from scripts/validate_sim.sh's measurements on
emulated hosts, one run per link rate, committed as docs/scale/data/validate_RATE.json with the
commit, command and date that produced them. Every figure and every judgement of one in the
document is computed from those, so it cannot go stale.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "scripts" / "lib"))
import costmodel  # noqa: E402
from doc_pipeline import Document, fill, load as load_record, main, provenance, record  # noqa: E402

DOC = ROOT / "docs" / "scale.md"
IMG = ROOT / "docs" / "img"
DATA = ROOT / "docs" / "scale" / "data"
RATES = (100, 200, 500)     # Mbit/s between the emulated hosts
DETAILED = 200              # the rate whose measurements the document shows in full (validate_sim.sh's default)
REPS = 5
TOLERANCE = 0.25            # what `costmodel validate` and tests/test_validate_sim.py allow
EXAMPLE = ["recommend", "--params", "1e9", "--hosts", "4", "--cluster", "ethernet"]


# --------------------------------------------------------------------------- measuring

def command(rate: int) -> str:
    return f"sudo RATE={rate}mbit REPS={REPS} scripts/validate_sim.sh"


def measure(rate: int) -> None:
    """One run of scripts/validate_sim.sh at `rate`; its measurements, with where they came from, into DATA."""
    import torch

    out = Path(tempfile.mkdtemp(prefix="minidist-scale-"))
    env = {**os.environ, "RATE": f"{rate}mbit", "REPS": str(REPS), "OUT": str(out), "PREFIX": "msd"}
    print(f"[{rate} Mbit/s] {command(rate)}", flush=True)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "validate_sim.sh")], cwd=ROOT, env=env)
    if not (out / "measured.json").is_file():
        raise SystemExit(f"validate_sim.sh at {rate} Mbit/s measured nothing (exit {done.returncode}); logs in {out}")
    record(data_file(rate), json.loads((out / "measured.json").read_text()), provenance(command(rate), torch.__version__))
    shutil.rmtree(out, ignore_errors=True)


def data_file(rate: int) -> Path:
    return DATA / f"validate_{rate}mbit.json"


def load(rate: int) -> dict:
    """What validate_sim.sh measured at `rate` (the cost model's `validate` input)."""
    return load_record(data_file(rate))["results"]


# --------------------------------------------------------------------------- the figures

def example() -> str:
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        costmodel.main(EXAMPLE)
    return f"$ python scripts/lib/costmodel.py {' '.join(EXAMPLE)}\n{text.getvalue().rstrip()}"


def runs_of(picks: list[tuple[int, str]]) -> str:
    """[(16, 'zero3'), (64, 'hsdp3'), (256, 'hsdp3')] -> 'zero3 at 16, hsdp3 from 64 on'."""
    parts, k = [], 0
    while k < len(picks):
        j = k
        while j + 1 < len(picks) and picks[j + 1][1] == picks[k][1]:
            j += 1
        first, last, pick = picks[k][0], picks[j][0], picks[k][1] or "none fits"
        where = (f"at {first:,}" if first == last else f"from {first:,} on" if j == len(picks) - 1
                 else f"from {first:,} to {last:,}")
        parts.append(f"{pick} {where}")
        k = j + 1
    return ", ".join(parts)


def picks_lines() -> list[str]:
    """For each cluster, model and all_reduce algorithm: which strategy the model picks at each size,
    and the shard group hsdp3 needs at the largest."""
    out = []
    for algorithm in ("ring", "tree"):
        for cname, c in costmodel.CLUSTERS.items():
            for mname, (params, units) in costmodel.MODELS.items():
                picks = [(n, costmodel.recommend(params, units, n // c.per_host, c, algorithm)[0])
                         for n in costmodel.RANKS]
                rows = costmodel.recommend(params, units, costmodel.RANKS[-1] // c.per_host, c, algorithm)[1]
                shard = rows["hsdp3"]["shard"]
                group = "one host" if shard == c.per_host else f"{shard} ranks (`strategy.shard_size={shard}`)"
                out.append(f"- {mname} on `{cname}`, {algorithm} all_reduce: {runs_of(picks)}. hsdp3's shard group: "
                           f"{group}.")
    return out


def validation_values() -> dict:
    """The validation section's figures, from the committed measurements (`measured`: there are some)."""
    have = [r for r in RATES if data_file(r).is_file()]
    if not have:
        return {"measured": False, "unmeasured": True}
    runs = {r: load(r) for r in have}
    shown = DETAILED if DETAILED in have else have[0]
    detailed = runs[shown]
    patterns = list(detailed["measured"])
    ok, table = costmodel.validate(detailed, TOLERANCE)
    predicted = {r: costmodel.predict_measured(m) for r, m in runs.items()}
    errs = {r: costmodel.prediction_errors(m, predicted[r]) for r, m in runs.items()}
    errors_table = "\n".join([
        "| RATE | " + " | ".join(patterns) + f" | within {TOLERANCE:.0%} |", "|---" * (len(patterns) + 2) + "|",
        *(f"| {r} Mbit/s | " + " | ".join(f"{errs[r][s]:+.0%}" for s in patterns) +
          f" | {'yes' if all(abs(e) <= TOLERANCE for e in errs[r].values()) else 'NO'} |" for r in have)])
    flat = [-errs[r][s] for r in have for s in ("ddp", "zero3") if s in errs[r]]
    slower = all(x > 0 for x in flat)
    # The same runs priced as if the two levels moved data at once (a GPU cluster's rule):
    # what pricing a world ring's hops within the hosts in series changes.
    errs_at_once = {r: costmodel.prediction_errors(m, costmodel.predict_measured(m, levels_in_series=False))
                    for r, m in runs.items()}
    at_once = [-errs_at_once[r][s] for r in have for s in ("ddp", "zero3") if s in errs_at_once[r]]
    measured = detailed["measured"]
    ranked = [r for r, m in runs.items() if sorted(m["measured"], key=m["measured"].get)
              == sorted(m["measured"], key=predicted[r].get)]
    return dict(
        measured=True, unmeasured=False, rate=DETAILED, command=command(DETAILED),
        date=load_record(data_file(shown))["provenance"]["date"], validate_table=table,
        intra_bw=f"{detailed['intra_bw'] / 1e6:,.0f}", inter_bw=f"{detailed['inter_bw'] / 1e6:,.1f}",
        link_mb=f"{DETAILED / 8:g}", intra_lat=f"{detailed['intra_lat'] * 1e3:.2f}",
        inter_lat=f"{detailed['inter_lat'] * 1e3:.2f}", errors_table=errors_table,
        flat=f"{100 * min(flat):.0f}-{100 * max(flat):.0f}%", slower=slower, not_slower=not slower,
        at_once=f"{100 * min(at_once):.0f}-{100 * max(at_once):.0f}%",
        accounts_for=("part of that. The rest is what the model leaves out: the gaps between a step's end on one "
                      "link and the next step's start." if slower and sum(flat) < sum(at_once) else
                      "that." if sum(abs(x) for x in flat) < sum(abs(x) for x in at_once) else
                      "none of that: the levels in series do not describe these runs."),
        ranked=len(ranked), rates=len(have), ranked_at=", ".join(f"{r} Mbit/s" for r in ranked) or "none",
        hsdp3_vs_ddp=f"{measured['hsdp3'] / measured['ddp']:.2f}",
        hsdp3_vs_zero3=f"{measured['hsdp3'] / measured['zero3']:.2f}", not_all_within=not ok)


# --------------------------------------------------------------------------- the document

def render(img: Path | None = IMG) -> str:
    """The document, from the cost model and the committed measurements; its plots go into `img`
    (None: the text alone, as the test that compares it with the committed document needs)."""
    if img is not None:
        img.mkdir(parents=True, exist_ok=True)
        costmodel.plot(str(img / "scale.png"), "ring")
        costmodel.plot(str(img / "scale_tree.png"), "tree")
    return fill("scale.md", example=example(), ring_table=costmodel.table_markdown("ring"),
                tree_table=costmodel.table_markdown("tree"), diloco_table=costmodel.diloco_table_markdown("ring"),
                picks="\n".join(picks_lines()), reps=REPS, tolerance=f"{TOLERANCE:.0%}", **validation_values())


DOCUMENT = Document(Path(__file__), DOC, render, {str(r): (lambda r=r: measure(r)) for r in RATES})

if __name__ == "__main__":
    sys.exit(main(DOCUMENT))
