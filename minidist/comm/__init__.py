"""The one module that calls torch.distributed collectives; everything else goes through it, so
CommTracer (minidist.measure) sees and measures all communication.

Each wrapper mirrors torch.distributed's call and takes `async_op` (a `Handle` with `wait()`),
`wire_dtype` (what travels: wire.py) and `algorithm` ("backend", "ring": ring.py, "shm": shm.py, or
"auto": shm where the group's ranks share a host, else the ring where it wins).
Details: docs/internals.md, "comm/__init__.py".
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from minidist.comm import check as _checks
from minidist.comm import ring, shm
from minidist.comm import wire as _wire
from minidist.comm.wire import Wire  # noqa: F401  (public API)
from minidist.comm.check import CollectiveMismatch, check_collectives, control_device  # noqa: F401  (public API)
from minidist.measure import CommRecord, CommTracer, Span, ring_bytes_sent  # noqa: F401  (public API)

ReduceOp = dist.ReduceOp

# torch 2.14 renamed the flat-tensor collectives and deprecated the old names;
# use whichever this torch offers so neither old nor new releases warn.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _record(op: str, nbytes: int, dtype: torch.dtype | None, group, async_op: bool,
            is_root: bool = False, algorithm: str = "backend") -> CommRecord | None:
    if _checks.enabled():  # debug.check_collectives: the ranks compare fingerprints first
        _checks.verify(op, nbytes, dtype, group)
    if not CommTracer._active:
        return None
    n = dist.get_world_size(group)
    rec = CommRecord(op=op, bytes=int(nbytes), dtype=str(dtype).replace("torch.", "") if dtype else "-",
                     group_size=n, async_op=async_op, issued=time.perf_counter(),
                     sent_bytes=ring_bytes_sent(op, int(nbytes), n, is_root), algorithm=algorithm,
                     group_ranks=tuple(dist.get_process_group_ranks(group)) if group is not None
                     else tuple(range(dist.get_world_size())))
    if dist.get_backend(group) == "nccl":
        rec.device_timed = True
        if not async_op:
            rec.device_spans.append(Span("cuda").start())  # a sync call's stall: until _finish stops it
    for tracer in CommTracer._active:
        tracer.records.append(rec)
    return rec


class Handle:
    """An in-flight operation. `wait()` blocks until it (and only it) is complete."""

    def __init__(self, work, record: CommRecord | None):
        self._work = work
        self._record = record
        self._done = False

    def wait(self, timeout: datetime.timedelta | float | None = None) -> None:
        if not self._done:
            start = time.perf_counter()
            span = Span("cuda").start() if self._record is not None and self._record.device_timed else None
            if timeout is not None and not isinstance(timeout, datetime.timedelta):
                timeout = datetime.timedelta(seconds=timeout)
            self._work.wait() if timeout is None else self._work.wait(timeout)
            self._done = True
            if span is not None:  # how long the stream stalled in this wait()
                self._record.device_spans.append(span.stop())
            if self._record is not None:
                now = time.perf_counter()
                self._record.blocked_s += now - start
                if self._record.completed is None:
                    self._record.completed = now

    def wait_on_stream(self) -> None:
        """CUDA: make the *current* stream wait for this operation, without counting it as time
        the computation was blocked (used from a side stream that chains one collective behind
        another: sharded_grad.py). The host does not wait."""
        if not self._done:
            self._work.wait()  # on NCCL: the current stream waits; the call returns at once
            self._done = True
            if self._record is not None and self._record.completed is None:
                self._record.completed = time.perf_counter()

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()


def _finish(work, rec: CommRecord | None, async_op: bool) -> Handle | None:
    if async_op:
        return Handle(work, rec)
    if rec is not None:
        rec.completed = time.perf_counter()
        rec.blocked_s = rec.completed - rec.issued
        if rec.device_spans:
            rec.device_spans[-1].stop()
    return None


ALGORITHMS = ("auto", "backend", "ring", "shm")
# Where our send/recv ring measurably beats the backend (recipes/bench_ring.py;
# docs/benchmarks/components.md compares this table with the committed runs): from how many
# bytes (the whole buffer) it wins. gloo's reduce_scatter at every size measured (64 KiB up);
# gloo's all_gather from 4 MiB (below, at 2 ranks, gloo's is as fast or faster).
# gloo's all_reduce and every nccl collective stay the backend's.
RING_WINS_FROM = {"gloo": {"reduce_scatter": 0, "all_gather": 4 << 20}}


def choose_algorithm(op: str, group, algorithm: str, nbytes: int = 0, device: torch.device | None = None) -> str:
    """Resolve "auto" for `op` on `group`'s backend and an `nbytes` buffer on `device`; check that
    "ring" can run there. The ring is built from gloo's send/recv, which take CPU tensors only: a
    gloo group holding CUDA tensors gets the backend's collective (gloo stages those through the
    host itself). "auto" and "shm" set up the group's shared memory at its first use (a collective:
    shm.channel); where it cannot run, "shm" is the backend's (one line says why)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {list(ALGORITHMS)}")
    backend, on_cpu = dist.get_backend(group), device is None or torch.device(device).type == "cpu"
    if algorithm in ("auto", "shm") and on_cpu and shm.channel(group, algorithm) is not None:
        return "shm"
    if algorithm == "shm":
        return "backend"
    if algorithm == "auto":
        wins_from = RING_WINS_FROM.get(backend, {}).get(op)
        return "ring" if wins_from is not None and nbytes >= wins_from and on_cpu else "backend"
    if algorithm == "ring" and (backend != "gloo" or not on_cpu):
        raise ValueError(f"the send/recv ring runs on gloo process groups and CPU tensors (gloo's send/recv), not on "
                         f"{backend} with {device or 'cpu'} tensors: use algorithm='backend' or 'auto'")
    return algorithm


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------- point to point


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    rec = _record("send", _nbytes(tensor), tensor.dtype, group, False)
    dist.send(tensor, dst=dst, group=group, tag=tag)
    _finish(None, rec, False)


def recv(tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> None:
    rec = _record("recv", _nbytes(tensor), tensor.dtype, group, False)
    dist.recv(tensor, src=src, group=group, tag=tag)
    _finish(None, rec, False)


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> Handle:
    rec = _record("isend", _nbytes(tensor), tensor.dtype, group, True)
    return Handle(dist.isend(tensor, dst=dst, group=group, tag=tag), rec)


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> Handle:
    rec = _record("irecv", _nbytes(tensor), tensor.dtype, group, True)
    return Handle(dist.irecv(tensor, src=src, group=group, tag=tag), rec)


# --------------------------------------------------------------------------- one to all / all to one


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False,
              algorithm: str = "backend") -> Handle | None:
    """Global rank `src`'s `tensor` to every rank of `group`. algorithm: "backend", "shm" or "auto"."""
    algorithm = "backend" if algorithm == "ring" else choose_algorithm("broadcast", group, algorithm, 0, tensor.device)
    rec = _record("broadcast", _nbytes(tensor), tensor.dtype, group, async_op, algorithm=algorithm)
    if algorithm == "shm":
        src_in_group = src if group is None else dist.get_group_rank(group, src)
        return _finish(shm.run("broadcast", group, async_op, tensor, arg=src_in_group), rec, async_op)
    return _finish(dist.broadcast(tensor, src=src, group=group, async_op=async_op), rec, async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group=None, async_op: bool = False) -> Handle | None:
    n = dist.get_world_size(group)
    is_root = dist.get_rank() == src
    rec = _record("scatter", _nbytes(tensor) * n, tensor.dtype, group, async_op, is_root)
    work = dist.scatter(tensor, scatter_list if is_root else None, src=src, group=group, async_op=async_op)
    return _finish(work, rec, async_op)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False) -> Handle | None:
    rec = _record("reduce", _nbytes(tensor), tensor.dtype, group, async_op, dist.get_rank() == dst)
    return _finish(dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op), rec, async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group=None, async_op: bool = False) -> Handle | None:
    n = dist.get_world_size(group)
    is_root = dist.get_rank() == dst
    rec = _record("gather", _nbytes(tensor) * n, tensor.dtype, group, async_op, is_root)
    work = dist.gather(tensor, gather_list if is_root else None, dst=dst, group=group, async_op=async_op)
    return _finish(work, rec, async_op)


# --------------------------------------------------------------------------- all to all


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False,
               algorithm: str = "backend", wire_dtype=None) -> Handle | None:
    """Reduce `tensor` over ranks in place. algorithm="ring" (sum only): our send/recv ring; "shm"
    (sum, product, max, min): through shared memory; "auto": choose_algorithm.
    wire_dtype (sum only): what travels (bf16, fp16, int8 with block scales: wire.py), summed in full precision."""
    wire = _wire_for_sum("all_reduce", op, wire_dtype)
    if wire is not None:
        n = dist.get_world_size(group)
        rec = _record("all_reduce", n * wire.chunk_bytes(-(-tensor.numel() // n)), wire.label, group, async_op,
                      algorithm=_wire_transport(group, tensor))
        return _finish(_wire.all_reduce(tensor, wire, group, async_op), rec, async_op)
    algorithm = _ring_for_sum("all_reduce", op, group, algorithm, tensor)
    rec = _record("all_reduce", _nbytes(tensor), tensor.dtype, group, async_op, algorithm=algorithm)
    if algorithm == "ring":
        return _finish(ring.all_reduce(tensor, group=group, async_op=async_op), rec, async_op)
    if algorithm == "shm":
        return _finish(shm.run("all_reduce", group, async_op, tensor, arg=op), rec, async_op)
    return _finish(dist.all_reduce(tensor, op=op, group=group, async_op=async_op), rec, async_op)


def max_over_ranks(*values: float, group=None) -> float | tuple[float, ...]:
    """The largest of every rank's `value` (a collective: every rank of `group` must call it); of
    several values, each one's, in one all_reduce. The small tensor lives where the backend takes
    it (control_device: the rank's GPU under nccl)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=control_device(group))
    all_reduce(t, op=ReduceOp.MAX, group=group)
    return t.item() if len(values) == 1 else tuple(t.tolist())


def _wire_for_sum(op_name: str, op, wire_dtype) -> "_wire.Wire | None":
    wire = _wire.as_wire(wire_dtype)
    if wire is not None and op != ReduceOp.SUM:
        raise ValueError(f"a {op_name} with wire_dtype sums only; for {op} leave wire_dtype=None")
    return wire


def _wire_transport(group, t: torch.Tensor) -> str:
    """How a wire collective's bytes travel: "ring" (our send/recv) or "backend" (wire.py)."""
    return "ring" if _wire.runs_on_ring(group, t.device) else "backend"


def _ring_for_sum(op_name: str, op, group, algorithm: str, tensor: torch.Tensor) -> str:
    algorithm = choose_algorithm(op_name, group, algorithm, _nbytes(tensor), tensor.device)
    if algorithm == "ring" and op != ReduceOp.SUM:
        raise ValueError(f"the ring {op_name} sums; for {op} use algorithm='backend'")
    return "backend" if algorithm == "shm" and op not in shm.REDUCE else algorithm


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None,
               async_op: bool = False) -> Handle | None:
    """Gather `tensor` from every rank into `tensor_list` (one tensor per rank)."""
    rec = _record("all_gather", sum(_nbytes(t) for t in tensor_list), tensor.dtype, group, async_op)
    return _finish(dist.all_gather(tensor_list, tensor, group=group, async_op=async_op), rec, async_op)


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group=None,
                    async_op: bool = False, algorithm: str = "backend", wire_dtype=None) -> Handle | None:
    """Gather every rank's `input` into the flat `output` (world_size * input.numel()).
    algorithm: "backend", "ring" (our send/recv ring), "shm" or "auto" (choose_algorithm).
    wire_dtype: what travels (wire.py); every chunk, this rank's too, is what the wire delivered."""
    wire = _wire.as_wire(wire_dtype)
    if wire is not None:
        rec = _record("all_gather", dist.get_world_size(group) * wire.chunk_bytes(input.numel()), wire.label,
                      group, async_op, algorithm=_wire_transport(group, input))
        return _finish(_wire.all_gather(output, input, wire, group, async_op), rec, async_op)
    algorithm = choose_algorithm("all_gather", group, algorithm, _nbytes(output), output.device)
    rec = _record("all_gather", _nbytes(output), input.dtype, group, async_op, algorithm=algorithm)
    if algorithm == "ring":
        return _finish(ring.all_gather_into(output, input, group=group, async_op=async_op), rec, async_op)
    if algorithm == "shm":
        return _finish(shm.run("all_gather", group, async_op, output, input), rec, async_op)
    return _finish(_all_gather_flat(output, input, group=group, async_op=async_op), rec, async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op=ReduceOp.SUM, group=None,
                   async_op: bool = False) -> Handle | None:
    """Rank r receives the reduction over ranks of input_list[r]."""
    rec = _record("reduce_scatter", sum(_nbytes(t) for t in input_list), output.dtype, group, async_op)
    return _finish(dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op), rec, async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False, algorithm: str = "backend", wire_dtype=None) -> Handle | None:
    """Rank r receives the reduction of slice r of the flat `input` (world_size * output.numel()).
    algorithm: "backend", "ring" (our send/recv ring, sum only), "shm" or "auto" (choose_algorithm).
    wire_dtype (sum only): each input rounded to it once, the chunks summed in full precision (wire.py)."""
    wire = _wire_for_sum("reduce_scatter", op, wire_dtype)
    if wire is not None:
        rec = _record("reduce_scatter", dist.get_world_size(group) * wire.chunk_bytes(output.numel()), wire.label,
                      group, async_op, algorithm=_wire_transport(group, input))
        return _finish(_wire.reduce_scatter(output, input, wire, group, async_op), rec, async_op)
    algorithm = _ring_for_sum("reduce_scatter", op, group, algorithm, input)
    rec = _record("reduce_scatter", _nbytes(input), input.dtype, group, async_op, algorithm=algorithm)
    if algorithm == "ring":
        return _finish(ring.reduce_scatter_tensor(output, input, group=group, async_op=async_op), rec, async_op)
    if algorithm == "shm":
        return _finish(shm.run("reduce_scatter", group, async_op, output, input, arg=op), rec, async_op)
    return _finish(_reduce_scatter_flat(output, input, op=op, group=group, async_op=async_op), rec, async_op)


def barrier(group=None, async_op: bool = False) -> Handle | None:
    rec = _record("barrier", 0, None, group, async_op)
    return _finish(dist.barrier(group=group, async_op=async_op), rec, async_op)


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable `obj`, in rank order (for small metadata and printing, not tensors)."""
    rec = _record("all_gather_object", 0, None, group, False)
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    _finish(None, rec, False)
    return out
