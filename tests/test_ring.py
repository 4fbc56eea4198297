"""minidist.comm's ring collectives (built from isend/irecv) against the backend's, on gloo.

all_gather must equal the backend's exactly. Sums must equal, bitwise, the order the
ring states (chunk c summed from rank c+1 round the ring to rank c), and the backend's
result to rounding.
"""

import pytest
import torch
import torch.distributed as dist

from minidist import comm
from minidist.comm import ring, shm
from ring_order import ring_order_sum

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PIECE = 4096  # bytes: small pieces, so even these sizes are cut into several


def rank_input(rank: int, numel: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g).to(dtype)


def check_collectives(sizes, dtypes):
    r, n = dist.get_rank(), dist.get_world_size()
    failures = []
    for dtype in dtypes:
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        for m in sizes:
            everyone = [rank_input(q, n * m, dtype) for q in range(n)]
            mine = everyone[r]
            # reduce_scatter
            out = torch.empty(m, dtype=dtype)
            comm.reduce_scatter_tensor(out, mine.clone(), algorithm="ring")
            want = ring_order_sum([x[r * m:(r + 1) * m] for x in everyone], r, n)
            backend = torch.empty(m, dtype=dtype)
            comm.reduce_scatter_tensor(backend, mine.clone(), algorithm="backend")
            if not torch.equal(out, want):
                failures.append(("reduce_scatter order", dtype, m))
            if m and not torch.allclose(out.double(), backend.double(), rtol=tol, atol=tol * n):
                failures.append(("reduce_scatter vs backend", dtype, m))
            # all_gather: exact
            gathered, reference = torch.empty(n * m, dtype=dtype), torch.empty(n * m, dtype=dtype)
            piece = mine[:m].clone()
            comm.all_gather_into(gathered, piece, algorithm="ring")
            comm.all_gather_into(reference, piece, algorithm="backend")
            if not torch.equal(gathered, reference):
                failures.append(("all_gather", dtype, m))
            # all_reduce on a size the world does not divide (padded to n chunks of ceil(numel / n)),
            # and on one it does (reduced in place, no padding)
            for numel in (n * m + 1 if m else 1, n * m):
                t = rank_input(r + 7, numel, dtype)
                alls = [rank_input(q + 7, numel, dtype) for q in range(n)]
                comm.all_reduce(t, algorithm="ring")
                k = -(-numel // n)
                want = torch.cat([ring_order_sum([x[c * k:(c + 1) * k] for x in alls], c, n) for c in range(n)])
                if not torch.equal(t, want[:numel]):
                    failures.append(("all_reduce order", dtype, numel))
    return failures


@pytest.mark.parametrize("schedule", ["ring", "direct"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_collectives_equal_the_backend(world_size, schedule, ranks):
    sizes = [0, 1, 5, 1000, 3001]
    results = ranks(world_size).run(check_with_schedule, schedule, sizes, DTYPES, timeout_s=180)
    assert results == [[]] * world_size


def check_with_schedule(schedule, sizes, dtypes):
    """Force the n-1-step ring (with several pieces per chunk, so pipelining is exercised) or the
    one-step direct exchange, whatever the sizes would pick."""
    saved = ring.PIECE_BYTES, dict(ring.DIRECT_BELOW_BYTES)
    ring.PIECE_BYTES = PIECE
    for op in ring.DIRECT_BELOW_BYTES:
        ring.DIRECT_BELOW_BYTES[op] = 0 if schedule == "ring" else 1 << 40
    try:
        return check_collectives(sizes, dtypes)
    finally:
        ring.PIECE_BYTES = saved[0]
        ring.DIRECT_BELOW_BYTES.update(saved[1])


def overlapping_async_calls():
    """Several ring calls in flight at once, with backend collectives issued between them."""
    r, n = dist.get_rank(), dist.get_world_size()
    ins = [rank_input(r + 10 * k, n * 333, torch.float32) for k in range(4)]
    outs = [torch.empty(333) for _ in ins]
    handles = [comm.reduce_scatter_tensor(o, i, algorithm="ring", async_op=True) for o, i in zip(outs, ins)]
    side = torch.full((4,), float(r))
    comm.all_reduce(side)  # the backend, while the ring works on the worker thread
    gathered = torch.empty(n * 333)
    handles.append(comm.all_gather_into(gathered, outs[0], algorithm="ring", async_op=True))
    for h in handles:
        h.wait()
    expect = [ring_order_sum([rank_input(q + 10 * k, n * 333, torch.float32)[r * 333:(r + 1) * 333]
                              for q in range(n)], r, n) for k in range(4)]
    ok_side = torch.equal(side, torch.full((4,), float(sum(range(n)))))
    everyone = [torch.empty(333) for _ in range(n)]
    dist.all_gather(everyone, outs[0])
    return all(torch.equal(o, e) for o, e in zip(outs, expect)) and ok_side and torch.equal(gathered, torch.cat(everyone))


@pytest.mark.parametrize("world_size", [2, 4])
def test_async_ring_calls_overlap(world_size, ranks):
    assert all(ranks(world_size).run(overlapping_async_calls, timeout_s=120))


def group_on_separate_hosts():
    """A new group of every rank, set up as if each rank were on a host of its own (no shared memory)."""
    saved, shm._host = shm._host, lambda: f"host {dist.get_rank()}"
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        assert comm.choose_algorithm("all_reduce", group, "auto") == "backend"
    finally:
        shm._host = saved
    return group


def traced_once():
    n, group = dist.get_world_size(), group_on_separate_hosts()
    big = 1 << 20  # elements: a 4 MiB fp32 all_gather, where the ring starts to win
    with comm.CommTracer() as tracer:
        out = torch.empty(100)
        comm.reduce_scatter_tensor(out, torch.ones(n * 100), group=group, algorithm="auto")
        comm.all_gather_into(torch.empty(n * 100), out, group=group, algorithm="auto", async_op=True).wait()
        comm.all_gather_into(torch.empty(big), torch.ones(big // n), group=group, algorithm="auto", async_op=True).wait()
        comm.all_reduce(torch.ones(10), group=group, algorithm="auto")
        comm.all_reduce(torch.ones(10), algorithm="auto")  # the world: every rank on this host
    return [(rec.op, rec.algorithm, rec.bytes, rec.sent_bytes) for rec in tracer.records]


def test_ring_is_traced_as_one_collective_and_auto_picks_it_where_it_wins(ranks):
    """Across hosts, auto takes the ring where it measurably wins; on one host, shared memory."""
    records = ranks(4).run(traced_once)[0]
    assert records == [("reduce_scatter", "ring", 1600, 1200.0), ("all_gather", "backend", 1600, 1200.0),
                       ("all_gather", "ring", 4 << 20, 3 << 20), ("all_reduce", "backend", 40, 60.0),
                       ("all_reduce", "shm", 40, 60.0)]


def ring_refuses_max():
    try:
        comm.reduce_scatter_tensor(torch.empty(1), torch.ones(2), op=comm.ReduceOp.MAX, algorithm="ring")
    except ValueError as e:
        return str(e)
    return ""


def test_ring_sums_only(ranks):
    assert "algorithm='backend'" in ranks(2).run(ring_refuses_max)[0]


def subgroup_ring():
    r = dist.get_rank()
    group = dist.new_group([1, 3])
    if r not in (1, 3):
        return None
    out = torch.empty(3)
    comm.reduce_scatter_tensor(out, torch.arange(6.0) * (r + 1), group=group, algorithm="ring")
    return out.tolist()


def test_ring_over_a_subgroup(ranks):
    # ranks 1 and 3 (weights 2 and 4): 6 x arange(6), split in two
    assert ranks(4).run(subgroup_ring) == [None, [0.0, 6.0, 12.0], None, [18.0, 24.0, 30.0]]


def sync_call_behind_async_ones():
    """A synchronous ring call made while asynchronous ones of other sizes are in flight."""
    r, n = dist.get_rank(), dist.get_world_size()
    outs = [torch.empty(n * (100 + k)) for k in range(3)]
    handles = [comm.all_gather_into(o, torch.full((100 + k,), float(r)), algorithm="ring", async_op=True)
               for k, o in enumerate(outs)]
    now = torch.empty(n * 37)
    comm.all_gather_into(now, torch.full((37,), float(r)), algorithm="ring")  # runs after them, in order
    for h in handles:
        h.wait()
    expect = lambda m: torch.arange(n, dtype=torch.float32).repeat_interleave(m)  # noqa: E731
    return torch.equal(now, expect(37)) and all(torch.equal(o, expect(100 + k)) for k, o in enumerate(outs))


def test_a_sync_call_waits_its_turn(ranks):
    assert all(ranks(3).run(sync_call_behind_async_ones, timeout_s=60))


# Fresh ranks as a script runs them: large async ring gathers in flight, then the script ends as
# argv[1] says: minidist.shutdown() (drains the ring first), torch's destroy_process_group(), or
# no call at all. Either of the last two left a transfer running as the interpreter exited, which
# aborted the process in gloo ("terminate called without an active exception"): an exit hook drains.
ENDS_IN_FLIGHT = """
import sys, torch, minidist, torch.distributed as dist
from minidist import comm
ctx = minidist.init_distributed(backend="gloo", timeout_s=60)
handles = [comm.all_gather_into(torch.empty(ctx.world_size * (4 << 20)), torch.ones(4 << 20), algorithm="ring",
                                async_op=True) for _ in range(3)]
if sys.argv[1] == "shutdown":
    minidist.shutdown()
    assert all(h.is_completed() for h in handles)
elif sys.argv[1] == "destroy":
    dist.destroy_process_group()
"""


@pytest.mark.slow(stand_in="test_ring_collectives_equal_the_backend")  # fresh ranks, ended as scripts end
@pytest.mark.parametrize("end", ["shutdown", "destroy", "exit"])
def test_a_script_may_end_with_ring_calls_in_flight(end):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", ENDS_IN_FLIGHT, end], stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
             for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "terminate called" not in err, (end, p.returncode, err[-2000:])


def auto_on_cuda_tensors():
    """choose_algorithm with CUDA tensors on a gloo group (no GPU needed: it only reads the device)."""
    big, group = 64 << 20, group_on_separate_hosts()
    chosen = [comm.choose_algorithm(op, group, "auto", big, torch.device(d))
              for op in ("reduce_scatter", "all_gather") for d in ("cpu", "cuda")]
    try:
        comm.choose_algorithm("reduce_scatter", group, "ring", big, torch.device("cuda"))
    except ValueError as e:
        return chosen, str(e)
    return chosen, ""


def test_gloo_groups_holding_cuda_tensors_never_get_the_ring(ranks):
    """gloo's send/recv take CPU tensors only: auto falls back to the backend for CUDA tensors, and
    an explicit ring says why it cannot run."""
    chosen, refused = ranks(2).run(auto_on_cuda_tensors)[0]
    assert chosen == ["ring", "backend", "ring", "backend"]
    assert "CPU tensors" in refused and "algorithm='backend'" in refused
