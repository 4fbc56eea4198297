"""FlatShard: a group of parameters laid out in one flat buffer, of which this rank owns a slice.

    flat (padded to a multiple of n):  [ p0 | p1 | p2 ......... | pad ]
    rank r owns                         [ r*s : (r+1)*s ),  s = padded / n

The padding makes every shard the same size, so a real reduce_scatter / all_gather
applies. The owned slice of the fp32 values ("master" shard) is what the
optimizer steps on: any element-wise optimizer (SGD, Adam, AdamW) works on a
flat slice exactly as on the separate tensors.

Both ZeRO-1/2 buckets and ZeRO-3 units are FlatShards; what differs is whether
the full flat buffer lives all the time (stages 1-2) or only around the unit's
forward and backward (stage 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minidist import comm


@dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    offset: int  # into the flat buffer
    numel: int


class FlatShard:
    """One flat group. `full` holds the compute-dtype values of every parameter in the group
    (when materialised); `master` is this rank's fp32 slice, wrapped as an nn.Parameter."""

    def __init__(self, index: int, names: list[str], params: list[nn.Parameter], *, rank: int,
                 world_size: int, group, compute_dtype: torch.dtype | None, keep_full: bool,
                 algorithm: str = "backend"):
        self.index, self.rank, self.world_size, self.group = index, rank, world_size, group
        self.algorithm = algorithm  # of its all_gathers: see minidist.comm.choose_algorithm
        self.params = params
        first = params[0]
        self.device = first.device
        self.master_dtype = first.dtype
        self.compute_dtype = compute_dtype or first.dtype
        self.slots: list[ParamSlot] = []
        offset = 0
        for name, p in zip(names, params):
            self.slots.append(ParamSlot(name, tuple(p.shape), offset, p.numel()))
            offset += p.numel()
        self.numel = offset
        self.padded = -(-offset // world_size) * world_size
        self.shard_size = self.padded // world_size
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size

        with torch.no_grad():
            values = torch.zeros(self.padded, dtype=self.master_dtype, device=self.device)
            for slot, p in zip(self.slots, params):
                values[slot.offset:slot.offset + slot.numel].copy_(p.reshape(-1))
            self.full = values.to(self.compute_dtype) if self.compute_dtype != self.master_dtype else values
            # Stages 1-2 in full precision: the master shard *is* the owned slice of the
            # parameters (no copy). Otherwise it is a separate fp32 tensor.
            if keep_full and self.compute_dtype == self.master_dtype:
                master = self.full[self.lo:self.hi]
            else:
                master = values[self.lo:self.hi].clone()
            self.master = nn.Parameter(master, requires_grad=True)
            for slot, p in zip(self.slots, params):
                p.data = self.full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        self.keep_full = keep_full
        if not keep_full:
            self.free_full()

    # ----------------------------------------------------------------- full parameters

    @property
    def is_materialised(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def free_full(self) -> None:
        """Release the full buffer's memory; the parameters' views stay, pointing at nothing."""
        self.full.untyped_storage().resize_(0)

    def gather_full(self, async_op: bool = False):
        """all_gather every rank's master shard (cast to the compute dtype) into `full`."""
        if not self.is_materialised:
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        with torch.no_grad():
            own = self.full[self.lo:self.hi]
            if own.data_ptr() != self.master.data_ptr():
                own.copy_(self.master)  # cast fp32 master -> compute dtype
            return comm.all_gather_into(self.full, own, group=self.group, async_op=async_op,
                                        algorithm=self.algorithm)

    # ----------------------------------------------------------------- checkpoint pieces

    def owned_pieces(self, flat_values: torch.Tensor) -> dict[str, tuple[int, torch.Tensor]]:
        """For each parameter overlapping this rank's slice: (start within the parameter, values).

        `flat_values` is shard-sized (the master, or an optimizer state of the same shape).
        """
        pieces = {}
        for slot in self.slots:
            a, b = max(slot.offset, self.lo), min(slot.offset + slot.numel, self.hi)
            if a < b:
                pieces[slot.name] = (a - slot.offset, flat_values[a - self.lo:b - self.lo].detach().clone().cpu())
        return pieces

    def fill_from_pieces(self, target: torch.Tensor, pieces: dict[str, list[tuple[int, torch.Tensor]]]) -> None:
        """Write this rank's slice of `target` (shard-sized) from per-parameter pieces of any layout."""
        with torch.no_grad():
            target.zero_()
            for slot in self.slots:
                a, b = max(slot.offset, self.lo), min(slot.offset + slot.numel, self.hi)
                if a >= b:
                    continue
                if slot.name not in pieces:
                    raise KeyError(f"checkpoint has no values for parameter {slot.name!r}")
                want_lo, want_hi = a - slot.offset, b - slot.offset  # range within the parameter
                covered = 0
                for start, values in pieces[slot.name]:
                    lo, hi = max(want_lo, start), min(want_hi, start + values.numel())
                    if lo < hi:
                        dst = target[slot.offset + lo - self.lo:slot.offset + hi - self.lo]
                        dst.copy_(values[lo - start:hi - start].to(dst.dtype))
                        covered += hi - lo
                if covered != want_hi - want_lo:
                    raise ValueError(f"checkpoint covers {covered} of the {want_hi - want_lo} values of "
                                     f"{slot.name!r} this rank needs: are all ranks' shards loaded?")

    def full_fp32(self) -> torch.Tensor:
        """Every rank's master shard, gathered (fp32, padded)."""
        out = torch.empty(self.padded, dtype=self.master_dtype, device=self.device)
        comm.all_gather_into(out, self.master.detach(), group=self.group, algorithm=self.algorithm)
        return out
