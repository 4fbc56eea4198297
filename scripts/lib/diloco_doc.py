"""docs/benchmarks.md's DiLoCo section, from its two committed data files (scripts/make_benchmarks.py
calls `section`; the README quotes `quotes`):

    docs/benchmarks/data/diloco_quality.json   scripts/measure_diloco.py: loss and bytes at H = 4 ... 32
    docs/benchmarks/data/diloco_shaped.json    scripts/diloco_local.sh: loss against training time on shaped links

Every sentence that judges a figure is computed here from the figures.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from doc_pipeline import load as load_record

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "benchmarks" / "data"
QUALITY = DATA / "diloco_quality.json"
SHAPED = DATA / "diloco_shaped.json"
LOSS_BOUND = 0.03     # the issue's: diloco at H = 8 within 3% of ddp's validation loss at the same tokens
BYTES_BOUND = 1 / 8   # ... with at most 1/8 of ddp's bytes per step
TIME_GOAL = 0.5       # on the slowest link, ddp's final loss in under half of ddp's time


def mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def table(headers: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers), *("| " + " | ".join(r) + " |" for r in body)]


def quality_figures(r: dict) -> dict:
    """H = 8's validation loss over ddp's (relative difference) and bytes per step over ddp's."""
    ddp = r["runs"][0]  # scripts/measure_diloco.py runs the reference first
    h8 = next(x for x in r["runs"] if x["variant"] == "diloco H=8")
    return {"loss": (h8["val_loss"] - ddp["val_loss"]) / ddp["val_loss"], "bytes": h8["bytes_per_step"] / ddp["bytes_per_step"]}


def quality_lines() -> list[str]:
    if not QUALITY.is_file():
        return []
    d = load_record(QUALITY)
    r, p = d["results"], d["provenance"]
    ddp = r["runs"][0]  # the reference, run first
    body = [[x["variant"], mib(x["bytes_per_step"]), mib(r["theory_bytes_per_step"][x["variant"]]),
             f"{x['bytes_per_step'] / ddp['bytes_per_step']:.3f}x", f"{x['val_loss']:.4f}",
             "-" if x is ddp else f"{(x['val_loss'] - ddp['val_loss']) / ddp['val_loss']:+.2%}",
             mib(x["model_state_bytes"])] for x in r["runs"]]
    f = quality_figures(r)
    met = f["loss"] <= LOSS_BOUND and f["bytes"] <= BYTES_BOUND
    partial = sorted({x["sync_every"] for x in r["runs"] if r["steps"] % x["sync_every"]})
    return [
        f"`{p['command']}` (commit {p['commit'][:12]}, {p['date']}): `make train`'s job ({r['model']} on stdlib_text, "
        f"AdamW, 2 ranks, each rank a DiLoCo worker) for {r['steps']} steps, the same tokens for every variant; "
        "bytes are each rank's per step over the whole run (the CommTracer's), theory the spec's averaged over "
        "the round; model state includes DiLoCo's outer weights and momentum (live storages).",
        "",
        *table(["variant", "bytes per step", "theory", "vs ddp", "validation loss", "vs ddp", "model state"], body),
        "",
        *([f"At H = {', '.join(map(str, partial))} the run's {r['steps']} steps end in a partial round, which the "
           "last step syncs too: one outer all_reduce more than the theory's whole rounds.", ""] if partial else []),
        f"H = 8 ends {f['loss']:+.2%} from ddp's validation loss with {f['bytes']:.3f}x its bytes per step: the "
        f"bound (within {LOSS_BOUND:.0%}, at most 1/8 of the bytes) is {'met' if met else 'NOT met'}. "
        "The outer optimizer is the configs' default (strategy.outer_lr, strategy.outer_momentum).",
        "",
    ]


def reach_time(curve: list[dict], target: float, key: str = "train_s") -> float | None:
    """Training seconds (or, key="step", the step) at which a curve first reaches `target`
    (linear between evaluations)."""
    prev = None
    for pt in curve:
        if pt["val_loss"] <= target:
            if prev is None:
                return pt[key]
            share = (prev["val_loss"] - target) / (prev["val_loss"] - pt["val_loss"])
            return prev[key] + share * (pt[key] - prev[key])
        prev = pt
    return None


def delay_words(r: dict) -> str:
    return "" if r["delay"] == "none" else f" + {r['delay']}"


def rate_mbit(rate: str) -> float:
    return float(rate.removesuffix("mbit"))


def shaped_figures(r: dict) -> dict[str, dict[str, float | None]]:
    """Per rate, per DiLoCo variant: the training time it takes to reach ddp's final validation
    loss over ddp's whole training time (None: not reached)."""
    out = {}
    for rate, variants in r["rates"].items():
        ddp = variants[r["reference"]]
        target, total = ddp["curve"][-1]["val_loss"], ddp["curve"][-1]["train_s"]
        out[rate] = {v: (None if (t := reach_time(x["curve"], target)) is None else t / total)
                     for v, x in variants.items() if x.get("sync_every")}
    return out


def shaped_plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted(r["rates"], key=rate_mbit)
    fig, axes = plt.subplots(1, len(rates), figsize=(5.5 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for v, x in r["rates"][rate].items():
            ax.plot([p["train_s"] for p in x["curve"]], [p["val_loss"] for p in x["curve"]], marker="o",
                    markersize=3, label=v)
        ax.set(title=f"{r['hosts']} hosts x {r['per_host']} ranks, {rate}" + delay_words(r), xlabel="training time (s)",
               ylabel="validation loss")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"gpt_nano, {r['steps']} steps each: validation loss against training time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def shaped_lines(img: Path) -> list[str]:
    if not SHAPED.is_file():
        return []
    d = load_record(SHAPED)
    r, p = d["results"], d["provenance"]
    shaped_plot(r, img / "diloco_shaped.png")
    figures = shaped_figures(r)
    lines = [
        f"`{p['command']}` (commit {p['commit'][:12]}, {p['date']}): {r['hosts']} emulated hosts (network namespaces) "
        f"x {r['per_host']} ranks, the links between hosts shaped by tc's tbf to each rate"
        + (f", with {r['delay']} more on every packet (netem)" if r["delay"] != "none" else
           " (no delay added: this kernel has no netem; the latency is the network stack's own)")
        + f"; gpt_nano for {r['steps']} steps each (the same tokens). diloco runs DDP within the host "
        "(strategy.inner=ddp) and its outer all_reduce across hosts every H steps. Training time is the sum of "
        "the logged step times up to each evaluation (start-up and evaluation left out, alike for all).",
        "",
        "![validation loss against training time on shaped links](img/diloco_shaped.png)",
        "",
    ]
    for rate in sorted(r["rates"], key=rate_mbit):
        variants = r["rates"][rate]
        body = [[v, f"{x['tokens_per_s']:,.0f}", mib(x["host_tx_bytes_per_step"]) if x["host_tx_bytes_per_step"] else "-",
                 f"{x['curve'][-1]['train_s']:.0f} s", f"{x['final_val_loss']:.4f}",
                 "-" if v not in figures[rate] else ("not reached" if figures[rate][v] is None
                                                     else f"{figures[rate][v]:.2f}x")]
                for v, x in variants.items()]
        lines += [f"At {rate}:", "",
                  *table(["variant", "tokens/s", "out of each host per step", "training time", "final validation loss",
                          "time to ddp's final loss / ddp's"], body), ""]
    slowest = min(r["rates"], key=rate_mbit)
    best = min((t for t in figures[slowest].values() if t is not None), default=None)
    lines += [f"On the slowest link ({slowest}) the best DiLoCo variant reaches ddp's final validation loss in "
              + ("none of its runs" if best is None else f"{best:.2f}x ddp's training time")
              + f": the goal (under {TIME_GOAL:.1f}x) is {'met' if best is not None and best < TIME_GOAL else 'NOT met'}.", ""]
    return lines + crossover_lines(r)


def crossover_lines(r: dict) -> list[str]:
    """The cost model's link speed below which diloco beats ddp to ddp's loss, on the links
    docs/scale.md calibrated at 200 Mbit/s, with the compute per step read off the measured runs."""
    import costmodel

    calibrated = ROOT / "docs" / "scale" / "data" / "validate_200mbit.json"
    if not calibrated.is_file() or not QUALITY.is_file():
        return []
    m = load_record(calibrated)["results"]
    c = costmodel.Cluster.calibrated(m)
    psi = load_record(QUALITY)["results"]["runs"][0]["parameters"]
    fastest = max(r["rates"], key=rate_mbit)
    runs = r["rates"][fastest]
    # compute per step: the reference's measured step at the fastest rate less the model's communication there
    at = dataclasses.replace(c, inter_bw=rate_mbit(fastest) * 1e6 / 8)
    ref = runs[r["reference"]]
    ref_step = ref["curve"][-1]["train_s"] / r["steps"]
    compute = max(0.0, ref_step - costmodel.step_comm_time(ref["strategy"], psi, r["hosts"], at, comm_bytes=4)["total"])
    def where(bw: float) -> str:
        return "on any link" if math.isinf(bw) else f"below {bw * 8 / 1e6:,.0f} Mbit/s between hosts"
    lines = []
    target = ref["curve"][-1]["val_loss"]
    for v, x in runs.items():
        if not x.get("sync_every"):
            continue
        same = costmodel.diloco_crossover(psi, r["hosts"], c, compute, sync_every=x["sync_every"],
                                          strategy=x["strategy"], comm_bytes=4)
        step = reach_time(x["curve"], target, key="step")  # its tokens to the reference's final loss
        measured = "" if step is None else (
            f"; with the tokens it took here to reach {r['reference']}'s final loss ({step / r['steps']:.2f}x "
            f"{r['reference']}'s), it wins "
            + where(costmodel.diloco_crossover(psi, r["hosts"], c, compute, sync_every=x["sync_every"],
                                               strategy=x["strategy"], token_factor=step / r["steps"], comm_bytes=4)))
        lines.append(f"- {v}: a step takes less time than {r['reference']}'s {where(same)}{measured}.")
    return ["The cost model (`diloco_crossover` of scripts/lib/costmodel.py), on the links docs/scale.md calibrated at "
            f"200 Mbit/s, with {compute * 1e3:.0f} ms of compute a step ({r['reference']}'s measured step at "
            f"{fastest} less its modelled communication), no overlap:", "", *lines, ""] if lines else []


def section(img: Path) -> list[str]:
    lines = quality_lines() + shaped_lines(img)
    if not lines:
        return []
    return ["## Across slow links: DiLoCo", "",
            "`strategy=diloco`: each worker trains alone for strategy.sync_every (H) steps, then the workers average "
            "their pseudo-gradients into an outer Nesterov SGD. Not the same arithmetic as ddp, so it is held to a "
            "loss bound, not to equal parameters (`tests/test_diloco.py`).", "", *lines]


def quotes() -> dict[str, str]:
    out = {}
    if QUALITY.is_file():
        f = quality_figures(load_record(QUALITY)["results"])
        out["diloco"] = (f"at H = 8 it ends {f['loss']:+.2%} from ddp's validation loss on `make train`'s job, "
                         f"sending {f['bytes']:.3f}x ddp's bytes per step")
    if SHAPED.is_file():
        r = load_record(SHAPED)["results"]
        slowest = min(r["rates"], key=rate_mbit)
        reached = {v: t for v, t in shaped_figures(r)[slowest].items() if t is not None}
        if reached:
            v = min(reached, key=reached.get)
            out["diloco_shaped"] = (f"at {slowest} between 2 emulated hosts, {v} reaches ddp's final validation loss "
                                    f"in {reached[v]:.2f}x ddp's training time")
    return out
