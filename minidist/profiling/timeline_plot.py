"""One profiled step drawn as a PNG: per rank a phase lane (forward, backward, optimizer), a
compute lane and a communication lane (matplotlib, no display needed). Used by the trainer's
`trainer.timeline_step`, the comparison's `compare.timeline=true` and the walkthrough."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.patches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

PHASE_COLORS = {"forward": "#4C72B0", "backward": "#55A868", "optimizer": "#C44E52"}


def save_figure(fig, path: Path) -> Path:
    """Lay out, write as PNG, close."""
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path


def timeline_plot(traces: dict, title: str, path: Path) -> Path:
    """traces: rank -> record_step's result. Lanes per rank: phases, compute (busy), communication."""
    ranks = sorted(traces)
    fig, ax = plt.subplots(figsize=(10, 0.9 + 1.1 * len(ranks)))
    yticks, ylabels = [], []
    for i, rank in enumerate(ranks):
        t = traces[rank]
        base = (len(ranks) - 1 - i) * 3
        zero = t["start_s"]
        for name, a, b in t["phases"]:
            ax.broken_barh([((a - zero) * 1e3, (b - a) * 1e3)], (base + 2, 0.8), color=PHASE_COLORS.get(name, "gray"))
        ax.broken_barh([((a - zero) * 1e3, (b - a) * 1e3) for a, b in t["compute"]], (base + 1, 0.8), color="#555555")
        ax.broken_barh([((a - zero) * 1e3, (b - a) * 1e3) for _, a, b in t["comm"]], (base, 0.8), color="#DD8452")
        yticks += [base + 0.4, base + 1.4, base + 2.4]
        ylabels += [f"rank {rank} comm", f"rank {rank} compute", f"rank {rank} phase"]
    hidden = [t["hidden_fraction"] for t in traces.values() if t["hidden_fraction"] is not None]
    share = f", {100 * sum(hidden) / len(hidden):.0f}% of communication hidden" if hidden else ""
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set(xlabel="ms from the start of the step", title=f"{title}: one step{share}")
    handles = [matplotlib.patches.Patch(color=c, label=n) for n, c in PHASE_COLORS.items()]
    handles += [matplotlib.patches.Patch(color="#555555", label="compute (aten ops)"),
                matplotlib.patches.Patch(color="#DD8452", label="collective running")]
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, frameon=False)
    return save_figure(fig, path)
