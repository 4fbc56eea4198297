"""A rank that stops participating becomes an error on every other rank, not a hang.

Every collective gives up after launcher.timeout_s (init_distributed passes it to the
process group); a dead peer fails its collectives at once (the connection closes).
`collective_failure` turns what the backend raises into one message naming the step and
the collective this rank was waiting for — from minidist.comm's tracer for our strategies,
generically for native ones — and the launcher then stops every rank and exits non-zero.

The test stalls a rank with debug.stall_rank / debug.stall_at_step (minidist/train/faults.py).
"""

from __future__ import annotations

# What the backends' messages contain when a peer is gone or late (gloo, nccl, c10d). Not a bare
# "gloo" or "nccl": every backend error names its backend (a size mismatch, an invalid argument),
# and relabelling those as a stalled peer would hide the real cause.
_SIGNS = ("timed out", "timeout", "connection reset", "connection closed", "connection refused", "broken pipe",
          "peer", "socket closed")


class CollectiveFailure(RuntimeError):
    """A collective did not complete on this rank because another rank stopped participating."""


def collective_failure(error: BaseException, records, step: int, strategy: str,
                       timeout_s: float) -> CollectiveFailure | None:
    """A CollectiveFailure describing `error` (raised while running `step`), or None when the
    error is not a communication failure (then it should propagate as it is)."""
    text = str(error).strip()
    if not any(sign in text.lower() for sign in _SIGNS):
        return None
    pending = [r for r in records if r.pending()]
    if pending:
        r = pending[0]
        what = f"{r.op} of {r.bytes:,} bytes ({r.algorithm})"
    elif records:
        what = f"the collective after {records[-1].op}"
    else:
        what = f"a collective of strategy {strategy}"
    first_line = text.splitlines()[0][:300] if text else type(error).__name__
    return CollectiveFailure(
        f"step {step}: {what} did not complete on this rank: {first_line}. Another rank stopped "
        f"participating (it died, is stuck, or issued a different collective); collectives give up after "
        f"launcher.timeout_s={timeout_s:g} s")

