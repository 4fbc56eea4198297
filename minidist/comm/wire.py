"""Low-precision wires with full-precision accumulation: what travels (bf16, fp16, block-scaled
int8) is not what is summed (fp64, rounded once), so the error does not grow with the ranks.

    comm.reduce_scatter_tensor(out, flat, wire_dtype=torch.bfloat16)   # fp32 in and out
    comm.all_gather_into(full, mine, wire_dtype="int8")                # block-int8 on the wire

The formats and the exchange: docs/internals.md, "comm/wire.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.comm import ring

QUANT_BLOCK = 256
FORMATS = ("bf16", "fp16", "int8")
_CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16}
_BY_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "int8"}


@dataclass(frozen=True)
class Wire:
    """A wire format: `name` one of FORMATS; `block`: the int8 format's block size."""

    name: str
    block: int = QUANT_BLOCK

    def __post_init__(self):
        if self.name not in FORMATS:
            raise ValueError(f"unknown wire format {self.name!r}: choose one of {list(FORMATS)} (or None: the "
                             "tensor's own dtype travels)")
        if self.block < 1:
            raise ValueError(f"the int8 wire's block must be >= 1, got {self.block}")

    @property
    def label(self) -> str:
        """How the tracer names what travelled."""
        return f"int8/{self.block}" if self.name == "int8" else {"bf16": "bfloat16", "fp16": "float16"}[self.name]

    def chunk_bytes(self, m: int) -> int:
        """Bytes one chunk of m elements takes on the wire (the int8 format's scales included)."""
        if self.name == "int8":
            return m + 4 * -(-m // self.block)
        return 2 * m

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """k chunks of m values (a [k, m] tensor) -> their wire bytes, [k, chunk_bytes(m)] uint8."""
        if self.name != "int8":
            return x.to(_CASTS[self.name]).contiguous().view(torch.uint8)
        k, m = x.shape
        blocks = -(-m // self.block)
        padded = F.pad(x.float(), (0, blocks * self.block - m)).view(k, blocks, self.block)
        scale = padded.abs().amax(dim=2) / 127.0  # nan / inf where the block holds one: kept
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.nan_to_num(padded / divisor.unsqueeze(2)).round_().clamp_(-127, 127).to(torch.int8)
        return torch.cat([q.view(k, -1)[:, :m].view(torch.uint8), scale.view(torch.uint8)], dim=1)

    def decode(self, packed: torch.Tensor, m: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[k, chunk_bytes(m)] wire bytes -> the k chunks' values, [k, m] in `dtype`."""
        if self.name != "int8":
            return packed.contiguous().view(_CASTS[self.name]).to(dtype)
        k = packed.shape[0]
        blocks = -(-m // self.block)
        q = F.pad(packed[:, :m].view(torch.int8).float(), (0, blocks * self.block - m))
        scale = packed[:, m:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # a copy: aligned for the 4-byte view
        return (q.view(k, blocks, self.block) * scale.unsqueeze(2)).view(k, -1)[:, :m].to(dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What x becomes after one trip over this wire (fp32): the reference the tests sum."""
        flat = x.reshape(1, -1)
        return self.decode(self.encode(flat), flat.shape[1]).reshape(x.shape)


def as_wire(wire_dtype, block: int | None = None) -> Wire | None:
    """None, a Wire, a format name ("bf16", "fp16", "int8") or a dtype (bfloat16, float16, int8);
    with `block` (a wrapper's quant_block), the int8 wire's block size is that."""
    if wire_dtype is None:
        return None
    if isinstance(wire_dtype, Wire):
        wire = wire_dtype
    elif isinstance(wire_dtype, torch.dtype):
        if wire_dtype not in _BY_DTYPE:
            raise ValueError(f"no wire format for {wire_dtype}: choose one of {list(_BY_DTYPE)}")
        wire = Wire(_BY_DTYPE[wire_dtype])
    else:
        wire = Wire(str(wire_dtype))
    return wire if block is None else Wire(wire.name, block=int(block))


def runs_on_ring(group, device: torch.device) -> bool:
    """Our send/recv carries the bytes (gloo, CPU tensors); else the backend's collectives."""
    return dist.get_backend(group) == "gloo" and device.type == "cpu"


class _Finishing:
    """A backend work whose wait() also runs what follows it (decoding, summing), once."""

    def __init__(self, work, finish):
        self._work, self._finish, self._done = work, finish, False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._work.wait() if timeout is None else self._work.wait(timeout)
            self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()


def _me(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _exchange(recv: torch.Tensor, send: torch.Tensor, group) -> None:
    """All-to-all of [n, b] uint8 rows by send/recv: row q of `send` to rank q, rank q's into row q."""
    r, n = _me(group)
    recv[r].copy_(send[r])
    others = [q for q in range(n) if q != r]
    ring.exchange_all({q: send[q] for q in others}, {q: recv[q] for q in others}, group)


def _sum_chunks(wire: Wire, recv: torch.Tensor, m: int) -> torch.Tensor:
    """The n received chunks decoded and summed. The sum is taken in fp64, whose 53 bits hold a
    sum of a few fp32 values exactly (short of a span of exponents beyond 2^29), so no partial sum
    is rounded: the one rounding is the caller's, to its output dtype."""
    return wire.decode(recv, m).sum(dim=0, dtype=torch.float64)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, wire: Wire, group, async_op: bool):
    """Rank r gets the fp32 sum of every rank's wire-rounded chunk r (cast to output's dtype)."""
    r, n = _me(group)
    m = output.numel()
    send = wire.encode(input.reshape(n, m))  # rounded here, at issue: `input` may be reused at once
    recv = torch.empty_like(send)

    def finish():
        output.view(-1).copy_(_sum_chunks(wire, recv, m))

    return _start(lambda: _exchange(recv, send, group), finish, group, send, async_op,
                  lambda: dist.all_to_all_single(recv, send, group=group, async_op=True), "wire:reduce_scatter")


def all_gather(output: torch.Tensor, input: torch.Tensor, wire: Wire, group, async_op: bool):
    """Every rank's `input`, rounded to the wire, into the flat `output` (own chunk included)."""
    r, n = _me(group)
    m = input.numel()
    send = wire.encode(input.reshape(1, m))
    recv = torch.empty((n, send.shape[1]), dtype=torch.uint8, device=send.device)

    def finish():
        output.view(n, m).copy_(wire.decode(recv, m, output.dtype))

    def exchange():
        ring.all_gather_bytes(recv.view(-1), send.view(-1), group)

    return _start(exchange, finish, group, send, async_op,
                  lambda: dist.all_gather_into_tensor(recv.view(-1), send.view(-1), group=group, async_op=True),
                  "wire:all_gather")


def all_reduce(tensor: torch.Tensor, wire: Wire, group, async_op: bool):
    """The wire reduce_scatter, then the summed chunks rounded once more and all_gathered: every
    rank ends with the same values."""
    r, n = _me(group)
    numel = tensor.numel()
    m = -(-numel // n)
    flat = F.pad(tensor.reshape(-1).float(), (0, n * m - numel))
    send = wire.encode(flat.view(n, m))
    recv = torch.empty_like(send)
    gathered = torch.empty_like(send)

    def mine() -> torch.Tensor:
        return wire.encode(_sum_chunks(wire, recv, m).float().view(1, m)).view(-1)  # as reduce_scatter gives it

    def finish():
        tensor.copy_(wire.decode(gathered, m).reshape(-1)[:numel].view_as(tensor))

    def exchange():
        _exchange(recv, send, group)
        ring.all_gather_bytes(gathered.view(-1), mine(), group)

    def backend():  # the gather can start only once this rank's sum exists: chained at wait()
        first = dist.all_to_all_single(recv, send, group=group, async_op=True)
        return _Finishing(first, lambda: dist.all_gather_into_tensor(gathered.view(-1), mine(), group=group))

    return _start(exchange, finish, group, send, async_op, backend, "wire:all_reduce")


def _start(exchange, finish, group, send: torch.Tensor, async_op: bool, backend, label: str):
    if runs_on_ring(group, send.device):
        def job():
            exchange()
            finish()
        return ring.run(job, async_op, label)
    work = _Finishing(backend(), finish)
    if not async_op:
        work.wait()
        return None
    return work
