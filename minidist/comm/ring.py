"""Ring collectives built from isend/irecv: reduce_scatter, all_gather and all_reduce, each rank
sending the bandwidth-optimal (n-1)/n of the buffer per phase, summed in a fixed, reproducible
order, on one worker thread per process in issue order. The algorithm and the order of the sum:
docs/internals.md, "comm/ring.py".
"""

from __future__ import annotations

import atexit
import datetime
import queue
import threading
import time

import torch
import torch.distributed as dist

from minidist.dist import before_shutdown

RING_TAG = 0x6D64  # "md": ring traffic only
PIECE_BYTES = 1 << 20
# Below these sizes per chunk, one step beats n-1: every rank sends each chunk straight to
# the rank that needs it (the same bytes as the ring; measured in docs/benchmarks.md).
# reduce_scatter then holds n-1 received chunks at once, so its limit is lower; all_gather
# receives straight into the output.
DIRECT_BELOW_BYTES = {"reduce_scatter": 1 << 20, "all_gather": 4 << 20}


class RingWork:
    """The handle of a ring collective running on the worker thread (what Handle wraps)."""

    def __init__(self):
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout is not None else None
        if not self._done.wait(seconds):
            raise TimeoutError(f"ring collective not finished after {seconds} s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


class _Worker:
    """One daemon thread that runs queued ring collectives in order."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self.pending = 0  # queued or running; changed under _order_lock
        threading.Thread(target=self._loop, name="minidist-ring", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, work = self._jobs.get()
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                error = e
            else:
                error = None
            with _order_lock:
                self.pending -= 1
            work._finish(error)
            del fn, work, error  # the call's tensors (a reduce buffer) are not kept till the next call

    def submit(self, fn) -> RingWork:
        work = RingWork()
        self.pending += 1
        self._jobs.put((fn, work))
        return work


_workers: dict[object, _Worker] = {}  # one per queue: the ring's calls share one, each shm group has its own
span_listeners: list = []  # callables(label, start_s, end_s), told of every ring call that ran
# Held while a call is issued (and while a synchronous one runs on its caller's thread):
# the order calls are issued in is the order they run in.
_order_lock = threading.Lock()


def run(fn, async_op: bool, label: str = "ring", queue: object = "ring") -> RingWork | None:
    """Run fn in issue order among the calls of its `queue`: on that queue's worker thread, or,
    for a synchronous call with nothing queued, right here (no thread hop). A synchronous call
    never overtakes an asynchronous one still in flight: their messages share the tag and would
    cross. Calls of different queues do not wait for each other (a group's shm collectives need
    not be issued in the same order as another group's on every rank, as with gloo).

    `label` names the run for whoever watches: every callable in `span_listeners` gets
    (label, start, end) in time.perf_counter() seconds once it ran (torch.profiler does not
    see work on this module's Python thread; the comparison's timeline listens here)."""
    plain = fn

    def fn():
        start = time.perf_counter()
        plain()
        for listener in list(span_listeners):
            listener(label, start, time.perf_counter())

    with _order_lock:
        worker = _workers.get(queue)
        if worker is None:
            worker = _workers[queue] = _Worker()
            before_shutdown(drain)
            # A script that ends without minidist.shutdown() (or ends with torch's own
            # destroy_process_group) may leave a transfer in flight, e.g. stages 1-2's gathers after
            # the last step: the interpreter's exit under it aborts the process in gloo.
            atexit.register(drain)
        if not async_op and worker.pending == 0:
            fn()
            return None
        work = worker.submit(fn)
    if async_op:
        return work
    work.wait()
    return None


def drain() -> None:
    """Return once every call issued so far has finished (minidist.shutdown() calls it)."""
    for queue in list(_workers):
        run(lambda: None, async_op=False, queue=queue)  # queued behind them all, or inline when nothing is queued


def _global(group, k: int) -> int:
    return k if group is None else dist.get_global_rank(group, k)


def _ring(group) -> tuple[int, int, int, int]:
    """(my position in the ring, ring size, global rank of the next, of the previous)."""
    n = dist.get_world_size(group)
    r = dist.get_rank(group)
    return r, n, _global(group, (r + 1) % n), _global(group, (r - 1) % n)


def sends_direct(op: str, chunk_bytes: int, n: int) -> bool:
    """Does the ring's `op` ("reduce_scatter" or "all_gather") on n ranks with chunks of
    `chunk_bytes` send each chunk straight to its rank (else: every chunk to the next rank)?"""
    return n > 2 and chunk_bytes < DIRECT_BELOW_BYTES[op]  # at n = 2 both schedules are the same one step


def exchange_all(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], group) -> None:
    """Every listed transfer at once: recvs[q] from rank q, sends[q] to rank q (group ranks)."""
    works = [dist.irecv(t, _global(group, q), group=group, tag=RING_TAG) for q, t in recvs.items()]
    works += [dist.isend(t, _global(group, q), group=group, tag=RING_TAG) for q, t in sends.items()]
    for work in works:
        work.wait()


def piece_bounds(numel: int, element_size: int, piece_bytes: int) -> list[tuple[int, int]]:
    step = max(1, piece_bytes // element_size)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)]


def _exchange(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, group, pieces, on_piece=None) -> None:
    """Send `send` to the next rank while receiving `recv` from the previous, piece by piece;
    on_piece(a, b) runs as soon as recv[a:b] has arrived."""
    # Receives first: each message then finds its buffer already posted when it arrives.
    recvs = [dist.irecv(recv[a:b], prv, group=group, tag=RING_TAG) for a, b in pieces]
    sends = [dist.isend(send[a:b], nxt, group=group, tag=RING_TAG) for a, b in pieces]
    for (a, b), work in zip(pieces, recvs):
        work.wait()
        if on_piece is not None:
            on_piece(a, b)
    for work in sends:
        work.wait()


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, piece_bytes: int) -> None:
    r, n, nxt, prv = _ring(group)
    m = output.numel()
    chunks = input.reshape(n, m)
    if n == 1:
        output.copy_(chunks[0].view_as(output))
        return
    if m == 0:
        return
    if sends_direct("reduce_scatter", m * input.element_size(), n):
        others = [q for q in range(n) if q != r]
        got = {q: torch.empty(m, dtype=input.dtype, device=input.device) for q in others}
        exchange_all({q: chunks[q] for q in others}, got, group)
        got[r] = chunks[r]
        total = got[(r + 1) % n].clone()  # the ring's order: from rank r+1 round to rank r
        for k in range(2, n + 1):
            total.add_(got[(r + k) % n])
        output.view(-1).copy_(total)
        return
    pieces = piece_bounds(m, input.element_size(), piece_bytes)
    # Two scratch chunks take turns: one is being sent while the other receives. Step 0
    # sends this rank's own piece straight from the input (which is never written).
    scratch = [torch.empty(m, dtype=input.dtype, device=input.device) for _ in range(min(2, n - 1))]
    sending = chunks[(r - 1) % n]
    for s in range(n - 1):
        incoming, local = scratch[s % 2], chunks[(r - s - 2) % n]
        result = output.reshape(-1) if s == n - 2 else incoming

        def add(a, b, incoming=incoming, local=local, result=result):
            torch.add(incoming[a:b], local[a:b], out=result[a:b])  # the partial sum so far + mine
        _exchange(sending, incoming, nxt, prv, group, pieces, add)
        sending = incoming


def _all_gather(output: torch.Tensor, input: torch.Tensor, group, piece_bytes: int) -> None:
    r, n, nxt, prv = _ring(group)
    m = input.numel()
    chunks = output.reshape(n, m)
    if chunks[r].data_ptr() != input.data_ptr():
        chunks[r].copy_(input.reshape(-1))
    if n == 1 or m == 0:
        return
    if sends_direct("all_gather", m * input.element_size(), n):
        others = [q for q in range(n) if q != r]
        exchange_all({q: chunks[r] for q in others}, {q: chunks[q] for q in others}, group)
        return
    pieces = piece_bounds(m, input.element_size(), piece_bytes)
    for s in range(n - 1):
        _exchange(chunks[(r - s) % n], chunks[(r - s - 1) % n], nxt, prv, group, pieces)


def _all_reduce(tensor: torch.Tensor, group, piece_bytes: int) -> None:
    r, n, _, _ = _ring(group)
    numel = tensor.numel()
    if n == 1 or numel == 0:
        return
    m = -(-numel // n)
    in_place = tensor.is_contiguous() and numel == n * m
    if in_place:  # already n equal chunks: reduce into this rank's chunk, gather around it
        padded = tensor.view(-1)
    else:
        padded = torch.zeros(n * m, dtype=tensor.dtype, device=tensor.device)
        padded[:numel].copy_(tensor.reshape(-1))
    mine = padded[r * m:(r + 1) * m]
    _reduce_scatter(mine, padded, group, piece_bytes)
    _all_gather(padded, mine, group, piece_bytes)
    if not in_place:
        tensor.copy_(padded[:numel].view_as(tensor))


def _check(op: str, flat: torch.Tensor, part: torch.Tensor, group) -> None:
    """The flat buffer must hold world-size parts; ring transfers need contiguous tensors."""
    if not (flat.is_contiguous() and part.is_contiguous()):
        raise ValueError(f"ring {op} works on contiguous tensors: pass .contiguous() ones")
    if flat.numel() != dist.get_world_size(group) * part.numel():
        raise ValueError(f"ring {op}: the flat tensor has {flat.numel()} elements, expected world size x "
                         f"{part.numel()}")


def reduce_scatter_tensor(output, input, group=None, async_op=False, piece_bytes=None):
    """Rank r receives the sum over ranks of chunk r of the flat `input` (n * output.numel())."""
    _check("reduce_scatter", input, output, group)
    return run(lambda: _reduce_scatter(output, input, group, piece_bytes or PIECE_BYTES), async_op,
                "ring:reduce_scatter")


def all_gather_into(output, input, group=None, async_op=False, piece_bytes=None):
    """Every rank's `input` into the flat `output` (n * input.numel()), in rank order."""
    _check("all_gather", output, input, group)
    return run(lambda: _all_gather(output, input, group, piece_bytes or PIECE_BYTES), async_op, "ring:all_gather")


def all_gather_bytes(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """all_gather on the calling thread (for a job already running in issue order: wire.py)."""
    _all_gather(output, input, group, PIECE_BYTES)


def all_reduce(tensor, group=None, async_op=False, piece_bytes=None):
    """Sum `tensor` over ranks in place (ring reduce_scatter, then ring all_gather)."""
    return run(lambda: _all_reduce(tensor, group, piece_bytes or PIECE_BYTES), async_op, "ring:all_reduce")
