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
from doc_pipeline import Document, load as load_record, main, provenance, record  # noqa: E402

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


def validation_section() -> list[str]:
    have = [r for r in RATES if data_file(r).is_file()]
    if not have:
        return ["No measurements committed yet: run `sudo python scripts/make_scale_doc.py`."]
    runs = {r: load(r) for r in have}
    shown = DETAILED if DETAILED in have else have[0]
    detailed = runs[shown]
    patterns = list(detailed["measured"])
    ok, table = costmodel.validate(detailed, TOLERANCE)
    predicted = {r: costmodel.predict_measured(m) for r, m in runs.items()}
    errs = {r: costmodel.prediction_errors(m, predicted[r]) for r, m in runs.items()}
    lines = [
        f"At {DETAILED} Mbit/s (`{command(DETAILED)}`, {load_record(data_file(shown))['provenance']['date']}):",
        "",
        table,
        "",
        f"Calibrated: intra {detailed['intra_bw'] / 1e6:,.0f} MB/s, inter {detailed['inter_bw'] / 1e6:,.1f} MB/s "
        f"(the link's {DETAILED / 8:g} MB/s); latencies intra {detailed['intra_lat'] * 1e3:.2f} ms, inter "
        f"{detailed['inter_lat'] * 1e3:.2f} ms.",
        "",
        "| RATE | " + " | ".join(patterns) + f" | within {TOLERANCE:.0%} |",
        "|---" * (len(patterns) + 2) + "|",
    ]
    for r in have:
        within = all(abs(e) <= TOLERANCE for e in errs[r].values())
        lines.append(f"| {r} Mbit/s | " + " | ".join(f"{errs[r][s]:+.0%}" for s in patterns)
                     + f" | {'yes' if within else 'NO'} |")
    flat = [-errs[r][s] for r in have for s in ("ddp", "zero3") if s in errs[r]]
    slower = all(x > 0 for x in flat)
    # The same runs priced as if the two levels moved data at once (a GPU cluster's rule):
    # what pricing a world ring's hops within the hosts in series changes.
    errs_at_once = {r: costmodel.prediction_errors(m, costmodel.predict_measured(m, levels_in_series=False))
                    for r, m in runs.items()}
    at_once = [-errs_at_once[r][s] for r in have for s in ("ddp", "zero3") if s in errs_at_once[r]]
    measured = detailed["measured"]
    ranking_holds = [r for r, m in runs.items() if sorted(m["measured"], key=m["measured"].get)
                     == sorted(m["measured"], key=predicted[r].get)]
    lines += [
        "",
        "What the errors say:",
        f"- **Flat world rings (ddp, zero3) come out {100 * min(flat):.0f}-{100 * max(flat):.0f}% "
        + ("slower than predicted.**" if slower else "off the prediction (measured over predicted).**")
        + " Each of their steps crosses both levels. Priced as if the levels moved data at once (the slowest "
        f"link's time a step, the GPU clusters' rule) they would be {100 * min(at_once):.0f}-{100 * max(at_once):.0f}% "
        "slower than predicted; adding each step's hop within the host (the levels in series: the same CPU cores "
        "copy both) accounts for "
        + ("part of that. The rest is what the model leaves out: the gaps between a step's end on one link and "
           "the next step's start." if slower and sum(flat) < sum(at_once) else
           "that." if sum(abs(x) for x in flat) < sum(abs(x) for x in at_once) else
           "none of that: the levels in series do not describe these runs."),
        "- **The calibration does not borrow from what it predicts.** The links are fitted from the "
        "point-to-point probe, not from ring all_reduces: fitted from those, the fit absorbed what the probe "
        "exposes. With the ring's direct schedule (chunks under 1 MiB for reduce_scatter, 4 MiB for "
        "all_gather, each sent straight to its rank in one step) a host's link carries (G-1)/G of its ranks' "
        "chunks instead of one per step, which the veth counters of `scripts/multinode_local.sh` see too; "
        "so the measurements here use the ring schedule throughout, the one the model describes.",
        f"- **The ranking (fastest to slowest) is the predicted one at {len(ranking_holds)} of {len(have)} "
        f"rates** ({', '.join(f'{r} Mbit/s' for r in ranking_holds) or 'none'}). At {DETAILED} Mbit/s hsdp3 takes "
        f"{measured['hsdp3'] / measured['ddp']:.2f} of ddp's time and {measured['hsdp3'] / measured['zero3']:.2f} "
        "of zero3's.",
    ]
    if not ok:
        lines.append(f"- **Not every pattern is within {TOLERANCE:.0%} at {DETAILED} Mbit/s.**")
    return lines


# --------------------------------------------------------------------------- the document

MODEL_PARAGRAPH = """## The model in one paragraph

- **Topology.** H hosts of G ranks, numbered host by host. A rank has `intra_bw` within its host;
  a host has `inter_bw` to the network.
- **Collectives.** Rings, priced with the alpha-beta model: (n-1) steps of M/n for a
  reduce_scatter or an all_gather, twice that for an all_reduce. The all_reduce can also be a
  double binary tree: 2 log2 n latencies, with the ring's bandwidth term.
- **Which link a step pays for.**
  - A flat ring over the world sends one message out of each host per step: the host's link.
    On the emulated hosts below, the step's hop within the host adds its own transfer time
    (`Cluster.levels_in_series`: both levels are copies by the same CPU cores); on the GPU
    clusters of the tables, NVLink and the NICs move data at once.
  - The replicate groups of a mesh cross hosts at every step. The G of them share a host's
    link, so each gets `inter_bw / G`.
  - A step split into k buckets or units pays k latencies.
- **Per step, by strategy** (each strategy's collectives come from its spec,
  `minidist/train/strategies/`).
  - ddp: all_reduce over the world.
  - zero1/2: reduce_scatter and all_gather over the world.
  - zero3: reduce_scatter and 2 all_gathers over the world, per unit.
  - hsdp2/hsdp3: the same inside the shard group, plus an all_reduce of 1/S across the replicas.
  - ddp_hierarchical (the hierarchical all_reduce): reduce_scatter in the host, all_reduce of 1/G across, all_gather in
    the host.
- **Memory.** The ZeRO paper's, for mixed precision with Adam (16 bytes per parameter unsharded).
  A strategy fits when its model state is at most half of an 80 GB device.
- **Shard groups that grow.** When hsdp's state does not fit at one host (S = G), the model
  doubles S until it fits. The shard group's rings then cross hosts too."""


def render(img: Path | None = IMG) -> str:
    """The document, from the cost model and the committed measurements; its plots go into `img`
    (None: the text alone, as the test that compares it with the committed document needs)."""
    if img is not None:
        img.mkdir(parents=True, exist_ok=True)
        costmodel.plot(str(img / "scale.png"), "ring")
        costmodel.plot(str(img / "scale_tree.png"), "tree")
    lines = [
        "# Many machines: what hybrid sharding buys, on paper and measured",
        "",
        "Generated by `python scripts/make_scale_doc.py` (`--render-only` rewrites it from the cost model and the "
        "committed measurements, `docs/scale/data/`); do not edit by hand.",
        "",
        "The cost model is `scripts/lib/costmodel.py`. Its docstring gives every formula. It models communication "
        "only: compute, and how much of the communication compute hides, are left out. The tables below come "
        "from `python scripts/lib/costmodel.py table` (`--algorithm tree` for the second set) and the plots from "
        "`--plot`. For one model on one cluster, `python scripts/lib/costmodel.py recommend` prints each strategy's "
        "communication per step and state per rank, then the pick:",
        "",
        "```",
        example(),
        "```",
        "",
        MODEL_PARAGRAPH,
        "",
        "## Where each strategy wins (ring all_reduce)",
        "",
        "Milliseconds of communication per optimizer step, in bf16. ✗: the model state does not fit. "
        "(S=…): the shard group size hsdp needs. **pick**: the least communication among those that fit.",
        "",
        "![cost model, ring](img/scale.png)",
        "",
        costmodel.table_markdown("ring"),
        "## With tree all_reduce (NCCL's choice at scale)",
        "",
        "Trees cut the all_reduce's latency from 2(n-1) to 2 log2 n steps, which helps ddp and the all_reduce "
        "halves of the hybrids. Reduce_scatter and all_gather stay rings, so ZeRO over the whole world still "
        "pays N-1 latencies per unit.",
        "",
        "![cost model, tree](img/scale_tree.png)",
        "",
        costmodel.table_markdown("tree"),
        "## DiLoCo: synchronising every H steps",
        "",
        "`strategy=diloco` is another algorithm (workers train apart, an outer optimizer averages their "
        "progress every H steps), so the tables above leave it out: it does not compute the same step. Priced "
        "as a worker's ranks train together every step — `strategy.inner=ddp` within a host where its state "
        "fits, else a ZeRO stage within the host, else `zero3` over the fewest hosts that fit, leaving two "
        "workers at least (`diloco_worker` of scripts/lib/costmodel.py; the cell names it where it is not ddp in a "
        "host) — and the outer all_reduce of each rank's 1/S across the workers (then, below stage 3, an "
        "all_gather in the worker) once per round, in ms of communication per step, ring all_reduce, bf16; "
        "✗: nothing fits half of the device:",
        "",
        costmodel.diloco_table_markdown("ring"),
        "What it is worth in time to a loss depends on the compute per step and on how many more tokens "
        "DiLoCo needs to reach a loss: `diloco_crossover` of scripts/lib/costmodel.py takes both and gives the link speed "
        "between hosts below which it wins. `docs/benchmarks.md` (\"Across slow links\") measures both on "
        "emulated hosts and says where that is for them.",
        "",
        "## What the trainer should pick",
        "",
        "The picks of the tables above, by size (ranks):",
        "",
        *picks_lines(),
        "",
        "Why flat ZeRO-3 falls behind as N grows: its reduce_scatter and all_gather rings span the world and pay "
        "N-1 latencies per unit, where hybrid sharding pays S-1 inside the group and R-1 across. A tree "
        "all_reduce pays 2 log2 N latencies instead of 2(N-1), which is what brings ddp back where the model "
        "fits a device; ddp still holds 16 bytes per parameter on every rank.",
        "",
        "Run `python scripts/lib/costmodel.py recommend --params P --hosts H --per-host G --cluster ib|ethernet "
        "[--algorithm tree]` for other sizes.",
        "",
        "## The model against measurements: emulated hosts with shaped links",
        "",
        "`sudo scripts/validate_sim.sh` (the slow test `tests/test_validate_sim.py`, in `make test-all`) builds "
        "2 emulated hosts of 2 ranks each. The hosts are network namespaces on a bridge (`scripts/lib/netns.sh`, "
        "shared with `scripts/multinode_local.sh`).",
        "",
        "- **Shaping.** Each host's `eth0` is shaped to RATE with tc's `tbf` qdisc. Between hosts there is RATE; "
        "within a host, loopback.",
        "  - This kernel has no `netem`, so no delay is added. The latency is the network stack's own, and the "
        "calibration measures it.",
        "  - `tcp_slow_start_after_idle=0` keeps TCP windows open between ring steps.",
        "- **Measuring.** `scripts/bench_mesh.py` runs every collective as minidist's send/recv ring, with the "
        "ring schedule throughout (the one the model describes), with fp32 values.",
        "  - It first calibrates both levels with a separate probe, point-to-point send/recv of 1 and 4 MiB in "
        "the ring's pieces, not with the collectives it then predicts:",
        "    - intra: each rank with the next rank of its host, all at once;",
        "    - inter: one stream out of each host, and all of a host's ranks at once to their counterparts on the "
        "next host, fitted together by least squares on relative error.",
        "  - It measures the int8 wire's coding on the ranks' own cores (encode and decode of the payload, every "
        "rank at once, no communication): the model's codec_s.",
        "  - It then times five step patterns on 1 M values (4 MiB) in 2 messages: ddp, zero3, zero3_zeropp "
        "(zero3 with ZeRO++: int8 gathers and an int8 all-to-all for the gradients, the backward's gather within "
        "the host), ddp_hierarchical and hsdp3.",
        f"  - It times the probes, the coding and the patterns together in {REPS} rounds, each round running "
        "every one of them once in turn. A busy stretch of the machine then falls on the calibration and on the "
        "patterns alike. Each figure is the median of its runs, the slowest rank's time.",
        "  - glibc keeps the memory the ranks free (`MALLOC_TRIM_THRESHOLD_`, `MALLOC_MMAP_THRESHOLD_`). Without "
        "that, each coding of the payload mapped fresh pages: their faults were two thirds of its time here, "
        "and cost 4-10x as much on a busy CI machine.",
        f"- **Predicting.** `python scripts/lib/costmodel.py validate measured.json` predicts each pattern from the "
        f"calibrated links and fails beyond {TOLERANCE:.0%}.",
        "",
        *validation_section(),
    ]
    return "\n".join(lines).rstrip() + "\n"


DOCUMENT = Document(Path(__file__), DOC, render, {str(r): (lambda r=r: measure(r)) for r in RATES})

if __name__ == "__main__":
    sys.exit(main(DOCUMENT))
