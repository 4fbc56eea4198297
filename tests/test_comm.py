"""Every minidist.comm wrapper, sync and async, at world sizes 1-4, odd sizes, several dtypes;
and the CommTracer's exact byte accounting."""

import pytest
import torch
import torch.distributed as dist

from minidist import comm
from minidist.comm import CommTracer, ring_bytes_sent

DTYPES = [torch.float32, torch.float64, torch.int64, torch.bfloat16]


def rank_data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers (exact in every dtype) that differ per rank and per element."""
    return ((torch.arange(numel) * 3 + rank * 7) % 11).to(dtype)


def _done(handle):
    if handle is not None:
        handle.wait()


def check_collectives(numel: int, dtype_name: str, async_op: bool):
    dtype = getattr(torch, dtype_name)
    rank, n = dist.get_rank(), dist.get_world_size()
    every = [rank_data(r, numel, dtype) for r in range(n)]
    total = torch.stack(every).sum(0)
    mine = every[rank]

    t = mine.clone()
    _done(comm.all_reduce(t, async_op=async_op))
    assert torch.equal(t, total)

    t = mine.clone()
    _done(comm.broadcast(t, src=n - 1, async_op=async_op))
    assert torch.equal(t, every[n - 1])

    t = mine.clone()
    _done(comm.reduce(t, dst=0, async_op=async_op))
    if rank == 0:
        assert torch.equal(t, total)

    outs = [torch.empty_like(mine) for _ in range(n)]
    _done(comm.all_gather(outs, mine, async_op=async_op))
    for r in range(n):
        assert torch.equal(outs[r], every[r])

    flat = torch.empty(n * numel, dtype=dtype)
    _done(comm.all_gather_into(flat, mine, async_op=async_op))
    assert torch.equal(flat, torch.cat(every))

    chunks = [rank_data(rank + 10 * r, numel, dtype) for r in range(n)]  # chunk r goes to rank r
    out = torch.empty(numel, dtype=dtype)
    _done(comm.reduce_scatter(out, chunks, async_op=async_op))
    assert torch.equal(out, sum(rank_data(q + 10 * rank, numel, dtype) for q in range(n)))

    out = torch.empty(numel, dtype=dtype)
    _done(comm.reduce_scatter_tensor(out, torch.cat(chunks), async_op=async_op))
    assert torch.equal(out, sum(rank_data(q + 10 * rank, numel, dtype) for q in range(n)))

    out = torch.empty(numel, dtype=dtype)
    scatter_list = [rank_data(100 + r, numel, dtype) for r in range(n)] if rank == 0 else None
    _done(comm.scatter(out, scatter_list, src=0, async_op=async_op))
    assert torch.equal(out, rank_data(100 + rank, numel, dtype))

    gather_list = [torch.empty_like(mine) for _ in range(n)] if rank == n - 1 else None
    _done(comm.gather(mine, gather_list, dst=n - 1, async_op=async_op))
    if rank == n - 1:
        for r in range(n):
            assert torch.equal(gather_list[r], every[r])

    _done(comm.barrier(async_op=async_op))


def check_point_to_point(numel: int, dtype_name: str):
    dtype = getattr(torch, dtype_name)
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    # Ring shift with blocking calls: even ranks send first, odd ranks receive first (no deadlock).
    got = torch.empty(numel, dtype=dtype)
    if rank % 2 == 0:
        comm.send(rank_data(rank, numel, dtype), dst=right)
        comm.recv(got, src=left)
    else:
        comm.recv(got, src=left)
        comm.send(rank_data(rank, numel, dtype), dst=right)
    assert torch.equal(got, rank_data(left, numel, dtype))
    # The same shift with non-blocking calls: post both, then wait.
    got = torch.empty(numel, dtype=dtype)
    handles = [comm.irecv(got, src=left), comm.isend(rank_data(rank, numel, dtype), dst=right)]
    for h in handles:
        h.wait()
    assert torch.equal(got, rank_data(left, numel, dtype))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_collectives_every_dtype_sync_and_async(ranks, world_size):
    pool = ranks(world_size)
    for dtype in DTYPES:
        for numel in (1, 7, 1000):
            for async_op in (False, True):
                pool.run(check_collectives, numel, str(dtype).replace("torch.", ""), async_op)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_point_to_point(ranks, world_size):
    for dtype in ("float32", "int64"):
        for numel in (1, 13):
            ranks(world_size).run(check_point_to_point, numel, dtype)


def trace_one_of_each():
    n = dist.get_world_size()
    x = torch.zeros(10, dtype=torch.float32)  # 40 bytes
    with CommTracer() as tracer:
        comm.all_reduce(x)
        h = comm.all_reduce(x, async_op=True)
        assert tracer.records[-1].completed is None  # async: not complete until wait()
        h.wait()
        comm.broadcast(x, src=0)
        comm.all_gather_into(torch.zeros(10 * n), x)
        comm.reduce_scatter_tensor(x, torch.zeros(10 * n))
        comm.barrier()
    recs = tracer.records
    return {
        "summary": tracer.summary(),
        "ops": [(r.op, r.bytes, r.dtype, r.group_size, r.async_op) for r in recs],
        "all_complete": all(r.completed is not None and r.completed >= r.issued for r in recs),
        "total": tracer.total_sent_bytes,
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_tracer_counts_every_call_and_its_bytes(ranks, world_size):
    n = world_size
    for result in ranks(n).run(trace_one_of_each):
        assert result["ops"] == [
            ("all_reduce", 40, "float32", n, False),
            ("all_reduce", 40, "float32", n, True),
            ("broadcast", 40, "float32", n, False),
            ("all_gather", 40 * n, "float32", n, False),
            ("reduce_scatter", 40 * n, "float32", n, False),
            ("barrier", 0, "-", n, False),
        ]
        assert result["all_complete"]
        s = result["summary"]
        assert s["all_reduce"]["calls"] == 2 and s["all_reduce"]["bytes"] == 80
        ring = (n - 1) / n
        assert s["all_reduce"]["sent_bytes"] == pytest.approx(2 * 2 * ring * 40)
        assert s["all_gather"]["sent_bytes"] == pytest.approx(ring * 40 * n)
        assert s["reduce_scatter"]["sent_bytes"] == pytest.approx(ring * 40 * n)
        assert s["broadcast"]["sent_bytes"] == (40 if n > 1 else 0)
        assert result["total"] == pytest.approx(4 * ring * 40 + 2 * ring * 40 * n + (40 if n > 1 else 0))


def test_ring_model_formulas():
    assert ring_bytes_sent("all_reduce", 1000, 4) == 1500
    assert ring_bytes_sent("all_gather", 1000, 4) == 750
    assert ring_bytes_sent("reduce_scatter", 1000, 4) == 750
    assert ring_bytes_sent("broadcast", 1000, 4) == 1000
    assert ring_bytes_sent("scatter", 1000, 4, is_root=True) == 750
    assert ring_bytes_sent("scatter", 1000, 4, is_root=False) == 0
    assert ring_bytes_sent("gather", 1000, 4, is_root=False) == 250
    assert ring_bytes_sent("all_reduce", 1000, 1) == 0
    with pytest.raises(ValueError):
        ring_bytes_sent("teleport", 1, 2)


def test_tracers_nest_and_stop_recording_on_exit():
    import minidist
    minidist.init_distributed(backend="gloo")  # a world of one, no rendezvous
    try:
        with CommTracer() as outer:
            comm.all_reduce(torch.ones(3))
            with CommTracer() as inner:
                comm.all_reduce(torch.ones(5))
        comm.all_reduce(torch.ones(7))
        assert [r.bytes for r in outer.records] == [12, 20]
        assert [r.bytes for r in inner.records] == [20]
    finally:
        minidist.shutdown()


def test_no_deprecation_warnings_from_flat_collectives(recwarn):
    import minidist
    minidist.init_distributed(backend="gloo")
    try:
        comm.all_gather_into(torch.zeros(2), torch.ones(2))
        comm.reduce_scatter_tensor(torch.zeros(2), torch.ones(2))
    finally:
        minidist.shutdown()
    assert not [w for w in recwarn if issubclass(w.category, (FutureWarning, DeprecationWarning))
                and "deprecated" in str(w.message)]
