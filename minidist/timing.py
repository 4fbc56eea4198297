"""Device-true timing behind one interface: CUDA events on CUDA, the host clock elsewhere.

On a GPU the host only enqueues work: `time.perf_counter()` around a step measures how fast
Python issued it, and around an NCCL `wait()` (which makes the current stream wait and returns
at once) it reads ~0. A `Span` measures on the clock where the work happens — CUDA events on
the current stream for a CUDA device, `perf_counter` otherwise — and is read only when asked
(`seconds()`), so timing a step costs no host synchronisation until the figure is logged.

    span = Span(device).start()
    ...                          # the step
    span.stop()
    ...                          # later, at a log step
    span.seconds()               # waits for the end event on CUDA; plain arithmetic on CPU
"""

from __future__ import annotations

import time

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
