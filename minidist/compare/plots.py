"""PNG plots of a comparison (matplotlib, no display needed).

    loss.png          per-step training loss of every strategy, overlaid
    step_time.png     each strategy's step times: median bar, min-max whisker, every step as a dot
    memory.png        model state per category (stacked) and the peak, per rank
    bytes_per_op.png  bytes sent per step per op, measured beside the theory
    timeline_S.png    one step of strategy S: per rank a phase lane, a compute lane, a communication lane
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minidist.compare.report import OPS, memory_parts  # noqa: E402
from minidist.profiling import save_figure, timeline_plot  # noqa: E402


def loss_plot(results: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, name in enumerate(results["strategies"]):
        losses = results["per_step"][name]["loss"]
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1.5,
                linestyle=("-", "--", ":", "-.")[k % 4])
    ax.set(xlabel="step", ylabel="training loss", title="Loss per step (same weights, same batches)")
    ax.legend()
    return save_figure(fig, path)


def step_time_plot(results: dict, rows: dict, path: Path) -> Path:
    names = results["strategies"]
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(names)), 4))
    for k, name in enumerate(names):
        times = [s * 1e3 for s in results["per_step"][name]["step_s"]]
        r = rows[name]["step_s"]
        ax.bar(k, r["median"] * 1e3, color="#8fb3d9", width=0.6)
        ax.errorbar(k, r["median"] * 1e3, yerr=[[(r["median"] - r["min"]) * 1e3], [(r["max"] - r["median"]) * 1e3]],
                    color="black", capsize=4)
        ax.scatter([k] * len(times), times, s=6, color="#1f3b5c", alpha=0.5, zorder=3)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set(ylabel="step time (ms)", title="Step time: median, min-max, every step")
    return save_figure(fig, path)


def memory_plot(rows: dict, path: Path) -> Path:
    names = list(rows)
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(names)), 4))
    bottoms = [0.0] * len(names)
    for cat in [*memory_parts(rows), "outer_state"]:  # DiLoCo's outer state stacks on top
        values = [rows[n]["model_state_bytes"].get(cat, 0) / 2**20 for n in names]
        if any(values):
            ax.bar(range(len(names)), values, bottom=bottoms, label=cat, width=0.6)
            bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.scatter(range(len(names)), [rows[n]["peak_bytes"] / 2**20 for n in names], marker="_", s=400,
               color="black", label="peak", zorder=3)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set(ylabel="MiB per rank", title="Model state per rank (busiest rank) and peak")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def bytes_plot(rows: dict, path: Path) -> Path:
    names = list(rows)
    ops = [op for op in OPS if any(op in rows[n]["bytes_per_step"] or op in rows[n]["theory_bytes_per_step"]
                                   for n in names)]
    fig, axes = plt.subplots(1, max(1, len(ops)), figsize=(4 * max(1, len(ops)), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        measured = [rows[n]["bytes_per_step"].get(op, 0) / 2**20 for n in names]
        theory = [rows[n]["theory_bytes_per_step"].get(op, 0) / 2**20 for n in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], measured, width=0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], theory, width=0.4, label="theory", color="#bbbbbb")
        ax.set_xticks(list(xs), names, rotation=30, fontsize=8)
        ax.set(title=op, ylabel="MiB sent per rank per step")
    axes[0][0].legend()
    return save_figure(fig, path)


def all_plots(results: dict, rows: dict, run_dir: Path, timelines: bool) -> list[Path]:
    run_dir = Path(run_dir)
    paths = [loss_plot(results, run_dir / "loss.png"), step_time_plot(results, rows, run_dir / "step_time.png"),
             memory_plot(rows, run_dir / "memory.png"), bytes_plot(rows, run_dir / "bytes_per_op.png")]
    if timelines:
        for name, traces in results["timelines"].items():
            paths.append(timeline_plot(traces, name, run_dir / f"timeline_{name}.png"))
    return paths
