"""Measuring, below everything else: device-true time (Span: CUDA events on CUDA, the host clock
elsewhere, read only when asked), memory from live storages (a shared storage counted once), and
communication (CommTracer: every minidist.comm call leaves a CommRecord).

    span = Span(device).start(); ...; span.stop(); span.seconds()
    report = measure({"parameters": params, "gradients": grads, "comm_buffers": buckets})
    with CommTracer() as tracer: loss.backward()

Why each is measured so: docs/internals.md, "measure.py".
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import torch


def clock_name(device: torch.device) -> str:
    """Which clock the timings of a run on `device` come from (the summary says it)."""
    return "CUDA events (device time on the current stream)" if device.type == "cuda" else "host clock (perf_counter)"


class Span:
    """One interval of time on `device`'s clock. start() and stop() cost no synchronisation."""

    def __init__(self, device: torch.device | str | None = None):
        self.cuda = torch.device(device).type == "cuda" if device is not None else False
        self._start = self._end = None
        self._seconds: float | None = None

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> "Span":
        self._start, self._end, self._seconds = self._mark(), None, None
        return self

    def stop(self) -> "Span":
        self._end = self._mark()
        return self

    def done(self) -> bool:
        """Has the work the span covers finished? (Always, on the host clock; never blocks.)"""
        return self._end is not None and (not self.cuda or self._end.query())

    def seconds(self) -> float:
        """The interval's length (on CUDA this waits for the end event, once)."""
        if self._start is None or self._end is None:
            raise RuntimeError("Span.seconds() needs start() and stop() first")
        if self._seconds is None:
            if self.cuda:
                self._end.synchronize()
                self._seconds = self._start.elapsed_time(self._end) / 1e3
            else:
                self._seconds = self._end - self._start
        return self._seconds


class HostReads:
    """Counts the values the training loop copies from the device to the host (each a
    synchronisation on CUDA), so a test can check that a step between log steps reads none.

        with HostReads() as reads:
            trainer.train_step(batches)
        assert reads.count == 0
    """

    _active: list["HostReads"] = []

    def __init__(self) -> None:
        self.count = 0
        self.what: list[str] = []

    def __enter__(self) -> "HostReads":
        HostReads._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        HostReads._active.remove(self)


def to_host(t: torch.Tensor, what: str) -> list | float:
    """`t` on the host (a float for one element, else a list): the one way the training loop
    reads a device value, counted by any active `HostReads`."""
    for reads in HostReads._active:
        reads.count += 1
        reads.what.append(what)
    return t.item() if t.numel() == 1 else t.tolist()


def _storages(tensors: Iterable[torch.Tensor]):
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            yield (t.device, s.data_ptr()), s.nbytes()


def measure(categories: dict[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Bytes per category plus "total"; each distinct storage is counted once overall."""
    seen: set = set()
    report: dict[str, int] = {}
    for name, tensors in categories.items():
        total = 0
        for key, nbytes in _storages(tensors):
            if key not in seen and nbytes > 0:
                seen.add(key)
                total += nbytes
        report[name] = total
    report["total"] = sum(report.values())
    return report


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor in an optimizer's state (exp_avg, momentum_buffer, step, ...)."""
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


# --------------------------------------------------------------------------- the communication tracer


@dataclass
class CommRecord:
    """One communication call as the tracer saw it."""

    op: str
    bytes: int            # payload S of the call (see `ring_bytes_sent` for which tensor)
    dtype: str
    group_size: int
    async_op: bool
    issued: float         # perf_counter() when the call was made
    completed: float | None = None  # when it returned (sync) or wait() returned (async)
    sent_bytes: float = 0.0         # bytes this rank sends under the ring model
    algorithm: str = "backend"      # "backend" (torch.distributed's collective), "ring" or "shm" (minidist.comm's)
    blocked_s: float = 0.0          # time the caller was blocked on it: a sync call's duration, or time in wait()
    group_ranks: tuple = ()         # the group's members, as world ranks (tells a mesh's groups apart)
    # On NCCL the host is never blocked (wait() only makes the current stream wait): the time the
    # current stream stalled on the collective, as CUDA-event spans around the call / each wait().
    device_timed: bool = False
    device_spans: list = field(default_factory=list)

    @property
    def duration(self) -> float | None:
        return None if self.completed is None else self.completed - self.issued

    def blocked_seconds(self) -> float:
        """Time the computation waited for this call: on the stream's clock where the call was
        device-timed (NCCL), on the host's otherwise. Reading device spans waits for them."""
        return sum(s.seconds() for s in self.device_spans) if self.device_timed else self.blocked_s

    def pending(self) -> bool:
        """Not finished: never waited for, or (device-timed) its wait not yet passed on the stream."""
        return self.completed is None or not all(s.done() for s in self.device_spans)


def ring_bytes_sent(op: str, nbytes: int, n: int, is_root: bool = False) -> float:
    """Bytes one rank sends for `op` on `n` ranks under the ring model.

    nbytes is S: the tensor for all_reduce / broadcast / reduce / send, the *total*
    (gathered output or scattered input) for all_gather, reduce_scatter, gather, scatter.
    """
    if n <= 1 or op in ("barrier", "recv", "irecv", "all_gather_object"):
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes
    if op in ("broadcast", "reduce", "send", "isend"):
        return float(nbytes)
    if op == "scatter":  # the root sends every other rank its chunk
        return (n - 1) / n * nbytes if is_root else 0.0
    if op == "gather":   # every non-root sends its chunk to the root
        return 0.0 if is_root else nbytes / n
    raise ValueError(f"unknown op {op!r}")


class CommTracer:
    """Records every minidist.comm call made while it is active (a context manager).

    Tracers nest: every active tracer records each call.
    """

    _active: list["CommTracer"] = []

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __enter__(self) -> "CommTracer":
        CommTracer._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        CommTracer._active.remove(self)

    def clear(self) -> None:
        self.records.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """Per op: number of calls, payload bytes and ring-model bytes sent by this rank."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "bytes": 0, "sent_bytes": 0.0})
        for r in self.records:
            row = out[r.op]
            row["calls"] += 1
            row["bytes"] += r.bytes
            row["sent_bytes"] += r.sent_bytes
        return dict(out)

    def sent_bytes_by_group(self) -> dict[tuple, float]:
        """Ring-model bytes this rank sent, per group (keyed by the group's world ranks)."""
        out: dict[tuple, float] = defaultdict(float)
        for r in self.records:
            out[r.group_ranks] += r.sent_bytes
        return dict(out)

    def calls(self, op: str) -> list[CommRecord]:
        return [r for r in self.records if r.op == op]

    @property
    def total_sent_bytes(self) -> float:
        return sum(r.sent_bytes for r in self.records)

    @property
    def blocked_s(self) -> float:
        """Time the computation spent waiting for communication: the part not hidden behind it
        (the host thread's on gloo; the current CUDA stream's on NCCL, read from its events)."""
        return sum(r.blocked_seconds() for r in self.records)

    def format_summary(self) -> str:
        lines = [f"{'op':<16}{'calls':>7}{'bytes':>14}{'sent (ring)':>14}"]
        for op, row in sorted(self.summary().items()):
            lines.append(f"{op:<16}{row['calls']:>7}{row['bytes']:>14,}{row['sent_bytes']:>14,.0f}")
        return "\n".join(lines)
