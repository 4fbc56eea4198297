"""One training step as a timeline: what each rank computes and communicates, and when, from
torch.profiler and our ring's own spans; and that timeline drawn as a PNG.

    trace = record_step(lambda: replica.step(batches), world_size)   # on every rank
    trace["hidden_fraction"], trace["bytes"]                          # this rank's figures
    write_chrome_trace({rank: trace, ...}, "timeline.json")           # open in Perfetto

Sources and what "hidden" means: docs/internals.md, "profiling.py".
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from minidist import comm
from minidist.comm import ring


PHASES = ("minidist.forward", "minidist.backward", "minidist.optimizer")
ANCHOR = "minidist.anchor"
COMM_PREFIXES = ("gloo:", "nccl:", "ring:")

# The collective calls as the dispatcher records them -> our op names (minidist.comm's).
C10D_OPS = {
    "c10d::allreduce_": "all_reduce", "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::_allgather_base_": "all_gather", "c10d::allgather_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter", "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::broadcast_": "broadcast", "c10d::reduce_": "reduce", "c10d::send": "send",
}
ELEMENT_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
                 "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}


def _numel(dims) -> int:
    """Elements of a Tensor's dims ([a, b]) or a TensorList's ([[a, b], [c]])."""
    if not dims:
        return 1 if dims == [] else 0
    if isinstance(dims[0], list):
        return sum(_numel(d) for d in dims)
    n = 1
    for d in dims:
        n *= d
    return n


def call_payload(name: str, args: dict) -> tuple[str, int] | None:
    """(op, payload bytes S as minidist.comm.ring_bytes_sent defines it) of a c10d call event."""
    op = C10D_OPS.get(name)
    dims, types = args.get("Input Dims"), args.get("Input type")
    if op is None or not dims:
        return None
    # A TensorList's dtype is not recorded: fp32 assumed (the comparison trains in fp32 or
    # keeps fp32 master gradients); a plain Tensor's is.
    size = ELEMENT_BYTES.get(types[0], 4) if types else 4
    if op in ("all_gather", "reduce_scatter") and len(dims) >= 2 and not isinstance(dims[0][0] if dims[0] else 0, list):
        # (output, input): S is the whole buffer, the gathered output or the scattered input
        total = _numel(dims[0]) if op == "all_gather" else _numel(dims[1])
    else:
        total = _numel(dims[0])
    return op, total * size


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> float:
    return sum(b - a for a, b in merge(intervals))


def intersect(xs, ys) -> list[tuple[float, float]]:
    xs, ys, out, i, j = merge(xs), merge(ys), [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(xs, ys) -> list[tuple[float, float]]:
    """xs minus ys (both unions)."""
    out = []
    for a, b in merge(xs):
        cur = a
        for c, d in merge(ys):
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b))
    return out


def _trace_events(prof) -> list[dict]:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    finally:
        os.unlink(path)


@contextlib.contextmanager
def native_stderr_silenced():
    """File descriptor 2 to /dev/null while inside: for native libraries' chatter only."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def settle(model) -> None:
    """Wait for communication a step left in flight (ZeRO-1/2's parameter gathers after the
    optimizer step). Must happen before the profiler stops: a gloo work issued while it records
    and finished after it is gone calls back into a freed profiler (a segmentation fault)."""
    wait = getattr(model, "wait_for_parameters", None)
    if wait is not None:
        wait()


def record_step(run, world_size: int, model=None, traced: bool = False, op_group_sizes: dict | None = None) -> dict:
    """Run `run()` (one optimizer step) under the profiler and return this rank's timeline.
    `model`: the wrapped model, whose communication still in flight is waited for (see settle).
    `traced`: all of the step's communication goes through minidist.comm (our strategies): its
    bytes are then counted from the CommTracer, which knows each call's group (the profiler
    does not, and a mesh's subgroups are smaller than the world). Otherwise `op_group_sizes`
    says an op's group size where it is not the world's (native HSDP's)."""
    main = threading.get_ident()
    ring_spans: list[tuple[str, float, float, bool]] = []

    def on_ring(label, start, end):
        ring_spans.append((label, start, end, threading.get_ident() == main))

    ring.span_listeners.append(on_ring)
    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    # On a GPU the host only enqueues: what overlapped is what ran at the same time on the device,
    # so the GPU's kernels are recorded too (analyse() then reads them).
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else []),
                   record_shapes=True)
    try:
        with comm.CommTracer() as tracer:
            with native_stderr_silenced():  # kineto prints start/stop lines and a GPU probe error on CPU
                prof.start()
            try:
                with record_function(ANCHOR):
                    anchor = time.perf_counter()
                run()
            finally:
                settle(model)
                if on_gpu:
                    torch.cuda.synchronize()  # the step's kernels end inside the recording
                with native_stderr_silenced():
                    prof.stop()
    finally:
        ring.span_listeners.remove(on_ring)
    events = _trace_events(prof)
    anchor_us = next(e["ts"] for e in events if e["name"] == ANCHOR)
    # Traced: every call from the tracer. Otherwise the profiler's c10d events, plus our ring's
    # calls, which run on send/recv the profiler does not count as collectives.
    records = tracer.records if traced else [r for r in tracer.records if r.algorithm == "ring"]
    return analyse(events, anchor_us, [(n, a - anchor, b - anchor, inline) for n, a, b, inline in ring_spans],
                   records, world_size, count_profiled=not traced, op_group_sizes=op_group_sizes)


def analyse(events: list[dict], anchor_us: float, ring_spans, records, world_size: int,
            count_profiled: bool = True, op_group_sizes: dict | None = None) -> dict:
    """Phases, compute and communication intervals, bytes per op and the hidden fraction.
    Bytes: the CommTracer's `records`, plus (count_profiled) the profiler's c10d events, counted
    at the world size or at `op_group_sizes[op]`."""
    def span(e):
        return (e["ts"] - anchor_us) / 1e6, (e["ts"] + e["dur"] - anchor_us) / 1e6

    main_tid = next(e["tid"] for e in events if e["name"] == PHASES[0])
    phases = [(e["name"].removeprefix("minidist."), *span(e)) for e in events if e["name"] in PHASES]
    comm_spans = [(e["name"], *span(e)) for e in events if e["name"].startswith(COMM_PREFIXES)]
    comm_spans += [(name, a, b) for name, a, b, _ in ring_spans]
    inline_ring = [(a, b) for _, a, b, inline in ring_spans if inline]
    busy = [span(e) for e in events if e["tid"] == main_tid and e["name"].startswith("aten::")
            and "wait" not in e["name"]]
    compute = subtract(merge(busy), inline_ring)  # a ring run inline is communication, not compute
    # autograd's backward nodes: gradients being produced (a collective issued before the last
    # one ends overlaps backward)
    backward_nodes = merge([span(e) for e in events if e["tid"] == main_tid
                            and e["name"].startswith("autograd::engine::evaluate_function")])
    # when the step's thread issued each collective (when it ran is its thread's and the scheduler's)
    issued = [(C10D_OPS[e["name"]], span(e)[0]) for e in events if e["tid"] == main_tid and e["name"] in C10D_OPS]

    per_op: dict = defaultdict(lambda: {"calls": 0, "bytes": 0, "sent_bytes": 0.0})
    for e in events if count_profiled else []:
        found = call_payload(e["name"], e.get("args", {}))
        if found:
            op, nbytes = found
            row = per_op[op]
            row["calls"] += 1
            row["bytes"] += nbytes
            row["sent_bytes"] += comm.ring_bytes_sent(op, nbytes, (op_group_sizes or {}).get(op, world_size))
    for r in records:
        if r.op in ("barrier", "all_gather_object", "recv", "irecv"):
            continue  # nothing sent (or, for objects, not the training's bytes)
        row = per_op[r.op]
        row["calls"] += 1
        row["bytes"] += r.bytes
        row["sent_bytes"] += r.sent_bytes

    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:  # CUDA: the device's own intervals, NCCL's kernels against everything else
        nccl = [e for e in kernels if e["name"].lower().startswith("nccl")]
        comm_spans = [(e["name"], *span(e)) for e in nccl]
        compute = merge([span(e) for e in kernels if e not in nccl])
    comm_intervals = [(a, b) for _, a, b in comm_spans]
    comm_s = length(comm_intervals)
    hidden_s = length(intersect(comm_intervals, compute))
    start = min(a for _, a, _ in phases)
    end = max(b for _, _, b in phases)
    return {
        "step_s": end - start, "start_s": start,
        "phases": phases, "compute": compute, "comm": comm_spans, "backward_nodes": backward_nodes, "issued": issued,
        "compute_s": length(compute), "comm_s": comm_s, "hidden_s": hidden_s,
        "exposed_comm_s": comm_s - hidden_s,
        "hidden_fraction": hidden_s / comm_s if comm_s > 0 else None,
        "clock": "GPU kernels (CUDA profiler)" if kernels else "host threads (CPU profiler)",
        "bytes": dict(per_op),
    }


def write_chrome_trace(traces: dict[int, dict], path, title: str) -> None:
    """One Chrome trace (chrome://tracing, ui.perfetto.dev) of one step: a process per rank,
    with a phase lane, a compute lane (busy intervals) and a communication lane."""
    events = []
    for rank, t in sorted(traces.items()):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"{title} rank {rank}"}})
        for tid, lane in ((0, "phases"), (1, "compute"), (2, "communication")):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}})

        def x(name, a, b, tid, **args):
            events.append({"ph": "X", "name": name, "pid": rank, "tid": tid, "ts": (a - t["start_s"]) * 1e6,
                           "dur": max(0.0, b - a) * 1e6, "args": args})
        for name, a, b in t["phases"]:
            x(name, a, b, 0)
        for a, b in t["compute"]:
            x("compute", a, b, 1)
        for name, a, b in t["comm"]:
            x(name, a, b, 2)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def _pyplot():
    """matplotlib's pyplot without a display, imported when a plot is drawn: the trainer imports this module."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PHASE_COLORS = {"forward": "#4C72B0", "backward": "#55A868", "optimizer": "#C44E52"}


def save_figure(fig, path: Path) -> Path:
    """Lay out, write as PNG, close."""
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    _pyplot().close(fig)
    return path


def timeline_plot(traces: dict, title: str, path: Path) -> Path:
    """traces: rank -> record_step's result. Lanes per rank: phases, compute (busy), communication."""
    ranks = sorted(traces)
    plt = _pyplot()
    from matplotlib.patches import Patch

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
    handles = [Patch(color=c, label=n) for n, c in PHASE_COLORS.items()]
    handles += [Patch(color="#555555", label="compute (aten ops)"),
                Patch(color="#DD8452", label="collective running")]
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, frameon=False)
    return save_figure(fig, path)
