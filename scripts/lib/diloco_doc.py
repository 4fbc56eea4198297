"""The figures of docs/benchmarks.md's DiLoCo section, from its two committed data files
(scripts/make_benchmarks.py fills scripts/templates/benchmarks.md with `values`; the README quotes `quotes`):

    docs/benchmarks/data/diloco_quality.json   scripts/measure_diloco.py: loss and bytes at H = 4 ... 32
    docs/benchmarks/data/diloco_shaped.json    scripts/diloco_local.sh: loss against training time on shaped links

Every sentence that judges a figure is computed here from the figures.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from doc_pipeline import load as load_record, made_by, mib, results_of
from minidist_tools.report import markdown_table

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "benchmarks" / "data"
QUALITY = DATA / "diloco_quality.json"
SHAPED = DATA / "diloco_shaped.json"
LOSS_BOUND = 0.03     # the issue's: diloco at H = 8 within 3% of ddp's validation loss at the same tokens
BYTES_BOUND = 1 / 8   # ... with at most 1/8 of ddp's bytes per step
TIME_GOAL = 0.5       # on the slowest link, ddp's final loss in under half of ddp's time


def quality_figures(r: dict) -> dict:
    """H = 8's validation loss over ddp's (relative difference) and bytes per step over ddp's."""
    ddp = r["runs"][0]  # scripts/measure_diloco.py runs the reference first
    h8 = next(x for x in r["runs"] if x["variant"] == "diloco H=8")
    return {"loss": (h8["val_loss"] - ddp["val_loss"]) / ddp["val_loss"], "bytes": h8["bytes_per_step"] / ddp["bytes_per_step"]}


def quality_values() -> dict:
    if not QUALITY.is_file():
        return {"quality": False}
    r, p = results_of(QUALITY)
    ddp = r["runs"][0]  # the reference, run first
    body = [[x["variant"], mib(x["bytes_per_step"]), mib(r["theory_bytes_per_step"][x["variant"]]),
             f"{x['bytes_per_step'] / ddp['bytes_per_step']:.3f}x", f"{x['val_loss']:.4f}",
             "-" if x is ddp else f"{(x['val_loss'] - ddp['val_loss']) / ddp['val_loss']:+.2%}",
             mib(x["model_state_bytes"])] for x in r["runs"]]
    f = quality_figures(r)
    partial = sorted({x["sync_every"] for x in r["runs"] if r["steps"] % x["sync_every"]})
    return dict(
        quality=True, **made_by(p, "q_"), q_model=r["model"],
        q_steps=r["steps"], q_partial=", ".join(map(str, partial)), q_loss=f"{f['loss']:+.2%}", q_bytes=f"{f['bytes']:.3f}",
        q_table=markdown_table(["variant", "bytes per step", "theory", "vs ddp", "validation loss", "vs ddp",
                                "model state"], body),
        q_loss_bound=f"{LOSS_BOUND:.0%}", q_met="met" if f["loss"] <= LOSS_BOUND and f["bytes"] <= BYTES_BOUND else "NOT met")


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
        delay = "" if r["delay"] == "none" else f" + {r['delay']}"
        ax.set(title=f"{r['hosts']} hosts x {r['per_host']} ranks, {rate}{delay}", xlabel="training time (s)",
               ylabel="validation loss")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"gpt_nano, {r['steps']} steps each: validation loss against training time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def shaped_values(img: Path) -> dict:
    if not SHAPED.is_file():
        return {"shaped": False}
    r, p = results_of(SHAPED)
    shaped_plot(r, img / "diloco_shaped.png")
    figures = shaped_figures(r)
    tables = []
    for rate in sorted(r["rates"], key=rate_mbit):
        body = [[v, f"{x['tokens_per_s']:,.0f}", mib(x["host_tx_bytes_per_step"]) if x["host_tx_bytes_per_step"] else "-",
                 f"{x['curve'][-1]['train_s']:.0f} s", f"{x['final_val_loss']:.4f}",
                 "-" if v not in figures[rate] else ("not reached" if figures[rate][v] is None
                                                     else f"{figures[rate][v]:.2f}x")]
                for v, x in r["rates"][rate].items()]
        tables.append(f"At {rate}:\n\n" + markdown_table(["variant", "tokens/s", "out of each host per step",
                                                           "training time", "final validation loss",
                                                           "time to ddp's final loss / ddp's"], body))
    slowest = min(r["rates"], key=rate_mbit)
    best = min((t for t in figures[slowest].values() if t is not None), default=None)
    return dict(
        shaped=True, **made_by(p, "s_"), s_hosts=r["hosts"],
        s_per_host=r["per_host"], s_delay="" if r["delay"] == "none" else r["delay"], s_no_delay=r["delay"] == "none",
        s_steps=r["steps"], s_rates="\n\n".join(tables) + "\n", s_slowest=slowest,
        s_best="" if best is None else f"{best:.2f}", s_none=best is None, s_goal=f"{TIME_GOAL:.1f}",
        s_met="met" if best is not None and best < TIME_GOAL else "NOT met", **crossover_values(r))


def crossover_values(r: dict) -> dict:
    """The cost model's link speed below which diloco beats ddp to ddp's loss, on the links
    docs/scale.md calibrated at 200 Mbit/s, with the compute per step read off the measured runs."""
    import costmodel

    calibrated = ROOT / "docs" / "scale" / "data" / "validate_200mbit.json"
    if not calibrated.is_file() or not QUALITY.is_file():
        return {"crossover": False}
    c = costmodel.Cluster.calibrated(load_record(calibrated)["results"])
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
    return dict(crossover=bool(lines), c_compute_ms=f"{compute * 1e3:.0f}", c_reference=r["reference"],
                c_fastest=fastest, c_lines="\n".join(lines))


def values(img: Path) -> dict:
    """Everything the section shows (`diloco`: whether there is anything to show)."""
    out = {**quality_values(), **shaped_values(img)}
    return {"diloco": out["quality"] or out["shaped"], **out}


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
