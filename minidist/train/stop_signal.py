"""Stop signals (Ctrl-C, preemption): every rank finishes its step, the ranks agree, the step is
checkpointed, and the run ends in one line.

    with StopSignals(grace_s=25) as stop:        # a rank's main thread, around its whole run
        stop.where = lambda: f"after step {step}"   # what a forced stop's line says
        signum = comm.max_over_ranks(stop.requested)   # after each step, on every rank: a collective

The signals, the forced ways out and the watcher thread: docs/internals.md, "train/stop_signal.py".
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
REPEAT_GATHER_S = 0.1  # signals this close to a second stop signal are the same press (see _received)


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by `signum`: the shell's convention for it."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    """SIGTERM for 15; a number no signal has: "signal N"."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """While inside (a main thread; elsewhere it does nothing), SIGINT/SIGTERM/SIGUSR1 request a
    stop instead of killing the process. How: docs/internals.md, "train/stop_signal.py"."""

    def __init__(self, grace_s: float = 25.0, repeat_window_s: float = 1.0,
                 where: Callable[[], str] | None = None, latest: Callable[[], object] | None = None):
        self.grace_s, self.repeat_window_s = float(grace_s), float(repeat_window_s)
        self.where = where or (lambda: "before training started")   # for a forced stop's line
        self.latest = latest or (lambda: None)                       # the latest checkpoint, ditto
        self.on_stuck: Callable[[str], None] | None = None           # told the line when the grace ran out
        self.requested = 0            # the first stop signal received (0: none)
        self._first_at: float | None = None
        self._active = False

    # ------------------------------------------------------------------ install

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # set_wakeup_fd requires it
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        # A Python handler must exist so that the default action (terminate) does not happen; the
        # watcher thread, woken by the byte the C handler writes, does the work.
        self._previous = {s: signal.signal(s, _ignore) for s in STOP_SIGNALS}
        self._active = True
        self._watcher = threading.Thread(target=self._watch, name="minidist-stop-signals", daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        if not self._active:
            return
        self._active = False
        signal.set_wakeup_fd(self._previous_fd)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        os.write(self._write, b"\0")  # wakes the watcher, which sees it is no longer needed
        self._watcher.join(timeout=5)
        os.close(self._read), os.close(self._write)

    # ------------------------------------------------------------------ the watcher

    def _watch(self) -> None:
        while self._active:
            timeout = None if self._first_at is None else max(0.0, self._first_at + self.grace_s - time.monotonic())
            ready, _, _ = select.select([self._read], [], [], timeout)
            if not self._active:
                return
            if not ready:  # the grace is over and the rank is still not done
                self._force(self.requested, f"by {signal_name(self.requested)}",
                            f": still unfinished launcher.stop_grace_s={self.grace_s:g} s later (a step, or its "
                            "checkpoint, that did not end: a stuck peer?)", stuck=True)
            arrived = [s for s in os.read(self._read, 64) if s in STOP_SIGNALS]
            if arrived:
                self._received(arrived)

    def _received(self, arrived: list[int]) -> None:
        """`arrived`: the stop signals one read of the wakeup pipe found, in the order written."""
        now = time.monotonic()
        if self._first_at is None:
            # The rest of this batch is the same press (the launcher's copy of the terminal's).
            self.requested, self._first_at = arrived[0], now
        elif now - self._first_at >= self.repeat_window_s:
            # A second Ctrl-C reaches a rank twice: from the terminal, and as the SIGTERM torch's
            # agent sends when the Ctrl-C cut its wait short. The two may be taken by two of the
            # rank's threads at once and written in either order, in one batch or two. Whichever
            # comes first, the line names the kind of the first stop if it is among those
            # arriving within REPEAT_GATHER_S.
            seen = set(arrived)
            deadline = now + REPEAT_GATHER_S
            while (left := deadline - time.monotonic()) > 0 and select.select([self._read], [], [], left)[0]:
                seen |= set(os.read(self._read, 64)) & set(STOP_SIGNALS)
            named = self.requested if self.requested in seen else arrived[0]
            self._force(named, f"at once by a second {signal_name(named)}")

    def _force(self, signum: int, how: str, why: str = "", stuck: bool = False) -> None:
        """The one line, then exit with no more work: nothing here waits for the main thread."""
        try:
            line = (f"error: stopped {how} {self.where()}{why}; the latest checkpoint is {self.latest() or 'none'}; "
                    "resume with the same command")
            if stuck and self.on_stuck is not None:
                self.on_stuck(line)
        except Exception as e:  # noqa: BLE001 - the exit must happen whatever the description does
            line = f"error: stopped {how}{why} ({e.__class__.__name__} describing where)"
        try:  # os.write: no lock the main thread could be holding (print's would be)
            os.write(2, (line + "\n").encode())
        finally:
            os._exit(exit_status(signum))


def _ignore(signum, frame) -> None:
    """The Python-level handler: nothing (the watcher thread acts on the wakeup byte)."""
