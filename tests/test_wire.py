"""Low-precision wires with full-precision accumulation (minidist.comm.wire), on gloo.

The bound each wire collective must meet: its result is the exact sum of the wire-rounded
inputs, rounded once (to fp32) — whatever the number of ranks. Beside it, a bf16 ring (every
partial sum rounded to bf16 at every hop, as a reduce_dtype=bf16 reduce_scatter does) whose
error grows with the ranks. The bytes the tracer records are checked against the bytes the
exchange actually handed to send/recv.
"""

import math

import pytest
import torch
import torch.distributed as dist

from minidist import comm
from minidist.comm import ring
from minidist.comm.wire import Wire, as_wire

WIRES = [Wire("bf16"), Wire("fp16"), Wire("int8"), Wire("int8", block=7)]


def rank_input(rank: int, numel: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + rank)
    if kind == "random":
        return torch.randn(numel, generator=g)
    if kind == "positive":  # partial sums only grow: a low-precision ring rounds every one of them
        return torch.rand(numel, generator=g) + 1.0
    # adversarial: magnitudes 2^-12 .. 2^12 side by side (within fp16's range), ranks cancelling each other
    x = torch.randn(numel, generator=g) * torch.pow(2.0, torch.randint(-12, 13, (numel,), generator=g).float())
    return x if rank % 2 == 0 else -x * (1 + 2.0 ** -9)


def exact_reference(wire: Wire, everyone: list[torch.Tensor]) -> torch.Tensor:
    """Each input rounded to the wire once, summed exactly (fp64), rounded once to fp32."""
    return torch.stack([wire.round_trip(x).double() for x in everyone]).sum(0).float()


def within_half_ulp(got: torch.Tensor, want64: torch.Tensor) -> bool:
    """|got - exact| <= half an fp32 ulp of the exact value (what one rounding allows)."""
    ulp = torch.pow(2.0, torch.floor(torch.log2(want64.abs().clamp_min(2.0 ** -126))) - 23).double()
    return bool(((got.double() - want64).abs() <= ulp / 2 * (1 + 1e-9)).all())


def check_wire_collectives(kinds, m: int):
    r, n = dist.get_rank(), dist.get_world_size()
    failures = []
    for wire in WIRES:
        for kind in kinds:
            everyone = [rank_input(q, n * m, kind) for q in range(n)]
            chunks = [x[r * m:(r + 1) * m] for x in everyone]
            exact = torch.stack([wire.round_trip(c).double() for c in chunks]).sum(0)
            for async_op in (False, True):
                out = torch.empty(m)
                h = comm.reduce_scatter_tensor(out, everyone[r].clone(), wire_dtype=wire, async_op=async_op)
                if h is not None:
                    h.wait()
                if not within_half_ulp(out, exact):
                    failures.append(("reduce_scatter", wire.label, kind, async_op))
            # all_gather: every chunk (this rank's too) is what the wire delivers, on every rank
            gathered = torch.empty(n * m)
            comm.all_gather_into(gathered, everyone[r][:m].clone(), wire_dtype=wire)
            want = torch.cat([wire.round_trip(x[:m]) for x in everyone])
            if not torch.equal(gathered, want):
                failures.append(("all_gather", wire.label, kind))
            # all_reduce on a size the world does not divide: the same values on every rank
            t = everyone[r][:n * m - 1].clone()
            comm.all_reduce(t, wire_dtype=wire)
            k = m  # ceil((n*m - 1) / n)
            # chunk c summed exactly, then rounded to the wire once more (chunk by chunk: int8's blocks)
            summed = torch.cat([wire.round_trip(exact_reference(wire, [x[:n * m - 1][c * k:(c + 1) * k]
                                                                       for x in everyone])) for c in range(n)])
            if not torch.equal(t, summed[:n * m - 1]):
                failures.append(("all_reduce", wire.label, kind))
            same = comm.all_gather_object(t.sum().item())
            if len(set(same)) != 1:
                failures.append(("all_reduce differs across ranks", wire.label, kind))
    return failures


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_wire_collectives_round_each_input_once_and_sum_exactly(world_size, ranks):
    results = ranks(world_size).run(check_wire_collectives, ["random", "adversarial"], 600)
    assert results == [[]] * world_size


def errors_against_the_exact_sum(m: int):
    """Mean relative error of the bf16 wire (fp64 sum) and of a bf16 ring, against the exact sum
    of the same bf16-rounded inputs."""
    r, n = dist.get_rank(), dist.get_world_size()
    wire = Wire("bf16")
    everyone = [rank_input(q, n * m, "positive") for q in range(n)]
    exact = torch.stack([wire.round_trip(x[r * m:(r + 1) * m]).double() for x in everyone]).sum(0)
    ours = torch.empty(m)
    comm.reduce_scatter_tensor(ours, everyone[r].clone(), wire_dtype=torch.bfloat16)
    ring_out = torch.empty(m, dtype=torch.bfloat16)
    comm.reduce_scatter_tensor(ring_out, everyone[r].to(torch.bfloat16), algorithm="ring")
    rel = lambda got: ((got.double() - exact).abs() / exact.abs()).mean().item()  # noqa: E731
    return rel(ours), rel(ring_out)


def test_the_wire_error_does_not_grow_with_the_ranks_where_a_bf16_ring_does(ranks):
    errors = {n: ranks(n).run(errors_against_the_exact_sum, 20_000)[0] for n in (2, 3, 4)}
    ours = {n: e[0] for n, e in errors.items()}
    bf16_ring = {n: e[1] for n, e in errors.items()}
    assert all(e <= 2.0 ** -25 for e in ours.values()), ours  # one fp32 rounding, at every world size
    assert bf16_ring[2] < bf16_ring[3] < bf16_ring[4], bf16_ring  # one more bf16 rounding per hop
    assert bf16_ring[2] > 100 * ours[2], (bf16_ring, ours)


def bytes_handed_to_send(m: int, wire_name: str):
    """The tracer's bytes for each wire collective beside what isend was actually given."""
    n = dist.get_world_size()
    wire = as_wire(wire_name)
    counted = []
    real_isend = dist.isend

    def counting_isend(tensor, *args, **kwargs):
        counted.append(tensor.numel() * tensor.element_size())
        return real_isend(tensor, *args, **kwargs)

    rows = []
    dist.isend = counting_isend
    try:
        for op in ("reduce_scatter", "all_gather", "all_reduce"):
            counted.clear()
            with comm.CommTracer() as tracer:
                x = torch.randn(n * m)
                if op == "reduce_scatter":
                    comm.reduce_scatter_tensor(torch.empty(m), x, wire_dtype=wire)
                elif op == "all_gather":
                    comm.all_gather_into(x, torch.randn(m), wire_dtype=wire)
                else:
                    comm.all_reduce(x, wire_dtype=wire)
            ring.drain()
            (rec,) = tracer.records
            rows.append((op, rec.dtype, rec.sent_bytes, float(sum(counted)), rec.bytes))
    finally:
        dist.isend = real_isend
    return rows


@pytest.mark.parametrize("wire_name", ["bf16", "int8"])
def test_the_tracer_records_the_bytes_the_wire_carried(wire_name, ranks):
    m = 1000
    for rows in ranks(3).run(bytes_handed_to_send, m, wire_name):
        for op, dtype, traced, sent, payload in rows:
            assert traced == sent, (op, traced, sent)
            assert dtype == as_wire(wire_name).label
            fp32_payload = 3 * m * 4
            assert payload < fp32_payload * (0.52 if wire_name == "bf16" else 0.27), (op, payload)


def test_int8_blocks_scale_by_their_absmax_and_keep_non_finite_values():
    wire = Wire("int8", block=4)
    x = torch.tensor([[1.0, -2.0, 0.5, 0.25, 0.0, 0.0, 0.0, 0.0, 3.0, math.inf, 1.0]])
    packed = wire.encode(x)
    assert packed.shape == (1, wire.chunk_bytes(11)) == (1, 11 + 3 * 4)
    back = wire.decode(packed, 11)
    assert torch.allclose(back[0, :4], x[0, :4], atol=2.0 / 254)  # within half a step of absmax / 127
    assert torch.equal(back[0, 4:8], torch.zeros(4))               # an all-zero block stays zero
    assert not torch.isfinite(back[0, 8:]).any()                   # an overflow stays visible
    assert torch.equal(Wire("bf16").round_trip(x[:, :4]), x[:, :4].to(torch.bfloat16).float())


def test_bad_wire_formats_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match="bf16"):
        as_wire("fp8")
    with pytest.raises(ValueError, match="no wire format"):
        as_wire(torch.float64)
    with pytest.raises(ValueError, match="block"):
        Wire("int8", block=0)


def max_with_a_wire():
    with pytest.raises(ValueError, match="wire_dtype sums only"):
        comm.all_reduce(torch.ones(3), op=comm.ReduceOp.MAX, wire_dtype="bf16")
    return True


def test_a_wire_sums_only(ranks):
    assert ranks(2).run(max_with_a_wire) == [True, True]
