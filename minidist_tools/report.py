"""From a comparison's raw results to its report: rows, verdicts, and the files and plots in the
run directory. docs/compare.md says what each file holds, how a strategy's reference and a named
variant's are chosen and checked, and the bytes per step the theory column comes from (each
strategy's spec declares its collectives: minidist/train/strategies/registry.py).

    rows = build_rows(results, cfg.compare)        # one row per strategy, with its reference
    write_outputs(results, rows, run_dir)          # report.md, results.csv/json, losses.csv, TensorBoard
    failed = regressions(rows)                     # minidist strategies off their reference
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import matplotlib
import torch

from minidist.train.strategies import names, spec
from minidist_tools.benchmarking import bootstrap_median_ci
from minidist_tools.theory import wire_bytes


WIRE_OPTIONS = ("grad_wire", "param_wire", "outer_wire")


def base_of(name: str, variants) -> str:
    """The registered strategy `name` runs: itself, or a variant's `of`."""
    return str(variants[name]["of"]) if name in variants else name


def variant_options(name: str, variants) -> dict:
    """A variant's own options (its `of` removed); {} for a plain strategy."""
    return {k: v for k, v in dict(variants.get(name, {})).items() if k != "of"}


def compressed(options) -> bool:
    """Does a run with these strategy options round what it sends (a wire format set)?"""
    return any(options.get(k) is not None for k in WIRE_OPTIONS)


def theoretical_bytes(strategy: str, psi: int, n: int, element_bytes: int = 4, shard: int | None = None,
                      sync_every: int = 1, options=None, micro_batches: int = 1) -> dict[str, float]:
    """Ring-model bytes sent per rank per optimizer step, per op ({} for one rank, or n == 1).
    Hybrid strategies need `shard`, the size S of their shard groups ({} without it); DiLoCo's
    outer collectives are averaged over their round of `sync_every` steps. `options`: the
    strategy's config, where an option changes what it sends (DiLoCo's strategy.inner) or what
    it sends it as (grad_wire, param_wire, outer_wire), or how often (accumulate); `micro_batches`
    per optimizer step (trainer.grad_accum)."""
    return wire_bytes(spec(strategy).for_options(options), psi, n, shard=shard, element_bytes=element_bytes,
                      sync_every=sync_every, options=options, micro_batches=micro_batches)


OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def kind(name: str, variants=None) -> str:
    return spec(base_of(name, variants or {})).kind


# A minidist strategy whose own reference is not in a comparison is checked against this one
# when it is there: every strategy trains the same model on the same data, so all should agree.
STAND_IN_REFERENCE = "native_ddp"


def reference_for(name: str, present: list[str], overrides: dict | None = None) -> str | None:
    """What `name` is checked against in a comparison of `present`: compare.references[name] when
    given, else its spec's reference; when that one is absent, the stand-in for a minidist
    strategy; None when neither is present."""
    known = name in names()
    preferred = (overrides or {}).get(name) or (spec(name).reference if known else None)
    if preferred in present and preferred != name:
        return preferred
    if known and spec(name).kind == "minidist" and STAND_IN_REFERENCE in present and name != STAND_IN_REFERENCE:
        return STAND_IN_REFERENCE
    return None


def reference_of(name: str, names: list[str], references: dict, variants) -> str | None:
    """What `name` is checked against: compare.references[name]; a variant's `of` when that runs
    too; else what its strategy's spec names (reference_for)."""
    if name in references:
        return reference_for(name, names, references)
    if name in variants and base_of(name, variants) in names:
        return base_of(name, variants)
    return reference_for(base_of(name, variants), names, references)


def max_state_difference(a: dict, b: dict) -> float:
    """Largest |a - b| over the two state_dicts; inf when a key is in one only or a shape differs
    (a missing or extra tensor is a difference, not something to skip)."""
    if a.keys() != b.keys():
        return float("inf")
    worst = 0.0
    for key in a:
        x, y = a[key], b[key]
        if x.shape != y.shape:
            return float("inf")
        if x.numel():
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else \
        {"median": float("nan"), "min": float("nan"), "max": float("nan")}


def build_rows(results: dict, compare_cfg) -> dict[str, dict]:
    names = results["strategies"]
    references = dict(compare_cfg.references)
    variants = compare_cfg.get("variants") or {}
    options = compare_cfg.get("options") or {}
    tolerance = float(compare_cfg.tolerance)
    loss_tolerance = float(compare_cfg.get("loss_tolerance", 0.02))
    n, psi = results["world_size"], results["psi"]
    rows = {}
    for name in names:
        per = results["per_step"][name]
        ranks = results["timelines"][name]
        memory = results["memory"][name]
        opts = options.get(name, {})
        s = spec(base_of(name, variants)).for_options(opts)  # as its options configure it (DiLoCo's inner)
        shard = results.get("shard_sizes", {}).get(name)
        measured = {}
        for op in OPS:  # the busiest rank's bytes in the profiled step (ZeRO shards may be uneven)
            sent = [t["bytes"].get(op, {}).get("sent_bytes", 0.0) for t in ranks.values()]
            if any(sent):
                measured[op] = max(sent)
        timed = per.get("sent_bytes") if any(c.per_round for c in s.collectives) else None
        if timed:  # once every H steps: rank 0's mean over the timed steps
            measured = {op: sum(step.get(op, 0.0) for step in timed) / len(timed) for op in OPS
                        if any(step.get(op) for step in timed)}
        hidden = [t["hidden_fraction"] for t in ranks.values() if t["hidden_fraction"] is not None]
        state = max(memory, key=lambda m: m["model_state"].get("total", 0))["model_state"]
        lossy = compressed(opts) or s.checked_by == "loss"  # rounded wires, or another algorithm (DiLoCo)
        theory = theoretical_bytes(base_of(name, variants), psi, n, shard=shard,
                                   sync_every=int(opts.get("sync_every") or 1), options=opts,
                                   micro_batches=int(results.get("grad_accum", 1)))
        rows[name] = {
            "strategy": name, "kind": kind(name, variants), "reference": reference_of(name, names, references, variants),
            "checked_by": "loss" if lossy else "parameters",
            "variant_of": base_of(name, variants) if name in variants else None,
            "final_loss": per["loss"][-1],
            "step_s": _spread(per["step_s"]),
            "blocked_s": statistics.median(per["blocked_s"]) if per["blocked_s"] else None,
            # how its collectives ran, as the tracer saw them (none: a reference, on its backend's own)
            "transports": per.get("transports") or None,
            "comm_s": max(t["comm_s"] for t in ranks.values()),
            "exposed_comm_s": max(t["exposed_comm_s"] for t in ranks.values()),
            "hidden_fraction": statistics.mean(hidden) if hidden else None,
            "model_state_bytes": state,
            # DiLoCo's outer weights and momentum: 4 bytes each per parameter, over the worker's S ranks
            "outer_state_theory": 4 * s.outer_copies * psi / (shard or 1) if s.outer_copies else None,
            "peak_bytes": max(m["peak_bytes"] for m in memory),
            "bytes_per_step": measured,
            "bytes_averaged_over_steps": len(timed) if timed else None,
            "theory_bytes_per_step": theory,  # each collective at its wire's bytes (the spec's)
        }
    for name, row in rows.items():
        ref = row["reference"]
        if ref is None:
            row.update(max_loss_diff=None, final_param_diff=None, final_loss_diff=None, time_ratio=None,
                       time_ratio_ci=None, tolerance=tolerance, ok=None)
            continue
        losses, ref_losses = results["per_step"][name]["loss"], results["per_step"][ref]["loss"]
        diff = max_state_difference(results["finals"][name], results["finals"][ref])
        # The steps ran interleaved: each step's ratio pairs two runs seconds apart, so drift
        # cancels. The ratio is the median of those pairs; its bootstrap interval says what it is,
        # noise included.
        pairs = [a / b for a, b in zip(results["per_step"][name]["step_s"], results["per_step"][ref]["step_s"])]
        loss_diff = abs(losses[-1] - ref_losses[-1]) / abs(ref_losses[-1])
        # a compressed wire: the parameters are not expected equal, the final loss is checked
        ok = loss_diff <= loss_tolerance if row["checked_by"] == "loss" else diff <= tolerance
        row.update(
            max_loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)),
            final_param_diff=diff, final_loss_diff=loss_diff, tolerance=tolerance, loss_tolerance=loss_tolerance,
            time_ratio=statistics.median(pairs) if pairs else
            row["step_s"]["median"] / rows[ref]["step_s"]["median"],
            time_ratio_ci=list(bootstrap_median_ci(pairs)) if len(pairs) > 1 else None,
            # only our strategies are held to it: the others are the references
            ok=ok if row["kind"] == "minidist" else None,
        )
    return rows


def regressions(rows: dict) -> list[str]:
    """Our strategies whose final parameters differ from their reference beyond the tolerance."""
    return [name for name, r in rows.items() if r["ok"] is False]


# --------------------------------------------------------------------------- formatting

def _ms(s):
    return "-" if s is None else f"{s * 1e3:.1f}"


def _mib(b):
    if b is None:
        return "-"
    return "<0.01" if 0 < b < 0.005 * 2**20 else f"{b / 2**20:.2f}"


def _sci(x):
    return "-" if x is None else ("0" if x == 0 else f"{x:.1e}")


def _pct(x):
    return "-" if x is None else f"{100 * x:.0f}%"


def _ratio(x):
    return "-" if x is None else f"{x:.3f}"


def _verdict(r):
    if r["ok"] is None:
        return "-"
    by_loss = r.get("checked_by") == "loss"
    return ("ok" if r["ok"] else "DIFFERS") + (f" (loss {r['final_loss_diff']:.2%})" if by_loss else "")


TABLE = [  # (header, cell)
    ("strategy", lambda r: r["strategy"]),
    ("reference", lambda r: r["reference"] or "-"),
    ("max loss diff", lambda r: _sci(r["max_loss_diff"])),
    ("final param diff", lambda r: _sci(r["final_param_diff"])),
    ("check", _verdict),
    ("step ms (min-max)", lambda r: f"{_ms(r['step_s']['median'])} ({_ms(r['step_s']['min'])}-{_ms(r['step_s']['max'])})"),
    ("/ ref [95%]", lambda r: _ratio(r["time_ratio"]) + interval(r)),
    ("exposed comm ms", lambda r: _ms(r["exposed_comm_s"])),
    ("hidden", lambda r: _pct(r["hidden_fraction"])),
    ("state MiB", lambda r: _mib(r["model_state_bytes"].get("total"))),
    ("peak MiB", lambda r: _mib(r["peak_bytes"])),
]


def table_rows(rows: dict) -> tuple[list[str], list[list[str]]]:
    return [h for h, _ in TABLE], [[cell(r) for _, cell in TABLE] for r in rows.values()]


def console_table(rows: dict) -> str:
    headers, body = table_rows(rows)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(b) for b in body)])


def markdown_table(headers: list[str], body: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
                      *("| " + " | ".join(b) + " |" for b in body)])


def bytes_table(rows: dict) -> str:
    headers = ["strategy", *(f"{op} MiB (theory)" for op in OPS)]
    body = []
    for r in rows.values():
        cells = [r["strategy"]]
        for op in OPS:
            m, t = r["bytes_per_step"].get(op), r["theory_bytes_per_step"].get(op)
            cells.append("-" if m is None and t is None else f"{_mib(m or 0)} ({_mib(t) if t else '-'})")
        body.append(cells)
    return markdown_table(headers, body)


# The parts of a rank's model state that memory_report()s measure, in the order tables and plots show
# them (ZeRO's fp32 master shards and the module's non-parameter state included: without them a
# ZeRO row's parts do not add up to its total). DiLoCo's outer_state has its own column, beside its formula.
MEMORY_PARTS = ("parameters", "master_params", "gradients", "optimizer_state", "comm_buffers", "replicated")


def memory_parts(rows: dict) -> list[str]:
    """The parts some row holds (a column of zeros for every strategy says nothing)."""
    return [c for c in MEMORY_PARTS if any(r["model_state_bytes"].get(c) for r in rows.values())]


def memory_table(rows: dict) -> str:
    cats = memory_parts(rows)
    outer = any(r.get("outer_state_theory") for r in rows.values())  # DiLoCo's, beside its formula
    headers = ["strategy", *(f"{c} MiB" for c in cats), *(["outer_state MiB (theory)"] if outer else []),
               "total MiB", "peak MiB"]
    body = [[r["strategy"], *(_mib(r["model_state_bytes"].get(c, 0)) for c in cats),
             *([f"{_mib(r['model_state_bytes'].get('outer_state', 0))} ({_mib(r['outer_state_theory'])})"
                if r.get("outer_state_theory") else "-"] if outer else []),
             _mib(r["model_state_bytes"].get("total")), _mib(r["peak_bytes"])] for r in rows.values()]
    return markdown_table(headers, body)


def speed_verdict(r: dict, target: float = 1.0) -> str:
    """The step-time target (ratio to the reference <= target), judged on the 95% interval of the
    median paired ratio: met when its upper end is <= target, missed when its lower end is above,
    else not decided by this run (the noise spans the target)."""
    ci = r.get("time_ratio_ci")
    if ci is None:
        return "met" if r["time_ratio"] <= target else "NOT met"
    if ci[1] <= target:
        return "met"
    return "NOT met" if ci[0] > target else "undecided (the interval spans the target)"


def interval(r: dict) -> str:
    ci = r.get("time_ratio_ci")
    return f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""


def targets_lines(rows: dict) -> list[str]:
    """Each minidist strategy's step time against its reference's (target: ratio <= 1.00), with
    the 95% bootstrap interval of the median step-by-step ratio."""
    out = []
    for r in rows.values():
        if r["kind"] == "minidist" and r["time_ratio"] is not None:
            verdict = ("a variant of it: no target" if r.get("variant_of") == r["reference"]
                       else f"target <= 1.00: {speed_verdict(r)}")
            out.append(f"- {r['strategy']} / {r['reference']}: {r['time_ratio']:.3f}{interval(r)} ({verdict})")
    return out


def transports_line(rows: dict, backend: str) -> str:
    """How our strategies' collectives ran, as each one's tracer saw them (comm.choose_algorithm's
    choice: shared memory between ranks of one host, our send/recv ring, or the backend's own), and
    the references' (their backend's own; the tracer does not see them); "" for a run recorded before
    transports were."""
    said = {"shm": "shared memory", "ring": "our send/recv ring", "backend": f"{backend}'s own"}
    by_how: dict[str, list[str]] = {}
    for n, r in rows.items():
        if r.get("transports"):
            by_how.setdefault(" and ".join(said.get(t, t) for t in r["transports"]), []).append(n)
    if not by_how:
        return ""
    ours = (f"every one of ours through {next(iter(by_how))}" if len(by_how) == 1 else
            "; ".join(f"through {how}: {', '.join(names)}" for how, names in by_how.items()))
    references = any(r["kind"] != "minidist" for r in rows.values())
    return ours + (f"; the references through {backend}'s own" if references else "")


def report_markdown(results: dict, rows: dict, environment: dict, command: str) -> str:
    headers, body = table_rows(rows)
    transports = transports_line(rows, results["backend"])
    lines = [
        f"# Comparison: {', '.join(results['strategies'])}",
        "",
        f"`{command}`",
        "",
        f"{results['model']} ({results['psi'] / 1e6:.2f}M parameters) on {results['data']}, "
        f"{results['world_size']} rank(s), {results['backend']}, global batch {results['global_batch']}; "
        f"{results['warmup']} warm-up + {results['steps']} timed steps, strategies interleaved step by step "
        f"(rotating order) on the same batches from the same initial weights.",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in environment.items()),
        "",
        *([f"Collectives: {transports}.", ""] if transports else []),
        markdown_table(headers, body),
        "",
        "- *final param diff*: the largest |difference| of any parameter or buffer after the last step, "
        f"against the reference; *check*: ours within the tolerance {float(rows and next(iter(rows.values()))['tolerance']):g}; a run "
        "with a compressed wire (grad_wire / param_wire), or of another algorithm (DiLoCo's strategies), marked "
        "*(loss x%)*, is checked by its final loss instead, relative to its reference's, within "
        "compare.loss_tolerance: its parameters are not expected equal.",
        *(["- DiLoCo's communication per step is the mean over the timed steps (it sends once every "
           "strategy.sync_every steps); its theory is averaged over the round."]
          if any(r.get("bytes_averaged_over_steps") for r in rows.values()) else []),
        "- *step ms*: median (min-max) of the slowest rank's step time; */ ref [95%]*: median of the step-by-step "
        "ratios to the reference (interleaved pairs) and its 95% bootstrap interval.",
        "- *exposed comm*, *hidden*: from one profiled step — communication time (the backend's collectives "
        "from start to end, our ring's runs) not overlapped / overlapped with compute on the training thread.",
        "- *state*: parameters, gradients, optimizer state (and our communication buffers) on the busiest "
        "rank, from live storages just before the optimizer step; *peak*: state before the step plus the largest "
        "rise of live tensor bytes sampled during it. Native DDP's buckets live in C++ and are not seen.",
        "",
        "## Step time against the reference",
        "",
        *(targets_lines(rows) or ["- (no minidist strategy with a reference in this run)"]),
        "",
        "## Communication per optimizer step (bytes this rank sends, ring model; theory in brackets)",
        "",
        bytes_table(rows),
        "",
        "## Model state per rank",
        "",
        memory_table(rows),
        "",
        "Plots: loss.png, step_time.png, memory.png, bytes_per_op.png" +
        (", timeline_*.png (Chrome traces: timeline_*.json)" if results.get("timeline_files") else "") + ".",
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- files

def _flat(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                out[f"{k}.{kk}"] = vv
        elif isinstance(v, list) and len(v) == 2:  # an interval
            out[f"{k}.low"], out[f"{k}.high"] = v
        else:
            out[k] = v
    return out


def write_csv(rows: dict, path: Path) -> None:
    flat = [_flat(r) for r in rows.values()]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(flat)


def write_losses_csv(results: dict, path: Path) -> None:
    names = results["strategies"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *names])
        for k in range(len(results["per_step"][names[0]]["loss"])):
            w.writerow([k + 1, *(repr(results["per_step"][n]["loss"][k]) for n in names)])


def write_tensorboard(results: dict, directory: Path) -> None:
    """Each strategy its own run under one log directory: TensorBoard overlays their curves."""
    from torch.utils.tensorboard import SummaryWriter

    for name in results["strategies"]:
        per = results["per_step"][name]
        with SummaryWriter(str(directory / name)) as w:
            for k, loss in enumerate(per["loss"]):
                w.add_scalar("train/loss", loss, k + 1)
                w.add_scalar("grad_norm", per["grad_norm"][k], k + 1)
            for k, s in enumerate(per["step_s"]):
                w.add_scalar("time/step_s", s, results["warmup"] + k + 1)


def json_ready(results: dict, rows: dict, environment: dict) -> dict:
    """Everything but the final state_dicts (tensors), as plain JSON."""
    return {"environment": environment, "rows": rows,
            **{k: v for k, v in results.items() if k != "finals"}}


def write_outputs(results: dict, rows: dict, run_dir: Path, environment: dict, command: str) -> dict[str, Path]:
    run_dir = Path(run_dir)
    files = {"report": run_dir / "report.md", "csv": run_dir / "results.csv", "json": run_dir / "results.json",
             "losses": run_dir / "losses.csv", "tensorboard": run_dir / "tensorboard"}
    files["report"].write_text(report_markdown(results, rows, environment, command))
    write_csv(rows, files["csv"])
    write_losses_csv(results, files["losses"])
    files["json"].write_text(json.dumps(json_ready(results, rows, environment), indent=1, default=str))
    write_tensorboard(results, files["tensorboard"])
    return files


def environment_info(backend: str) -> dict:
    import os
    import platform

    from minidist_tools.deepspeed import deepspeed_version

    return {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "deepspeed": deepspeed_version() or "not installed", "backend": backend}


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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
