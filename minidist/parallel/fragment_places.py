"""Where a DiLoCo fragment's values live on the ranks of one worker, and how its outer state moves.

The outer loop (diloco.py) works on each rank's *slice* of a fragment: it keeps the slice's outer
weights and momentum, all_reduces the slice's pseudo-gradient across the workers, and writes the
result back. A place says what that slice is:

    Replicated     every rank of the worker holds the whole parameters (one rank, or DDP within
                   the worker): rank s of S takes slice s of the flat fragment (padded to a
                   multiple of S); written back, the slices are gathered within the worker
    ShardedWithin  ZeRO within the worker: rank s already holds its pieces of the parameters in
                   its fp32 master shards; its slice is those pieces, written in place

Both give the whole fragment from every rank's slice (`whole`, a collective within the worker)
and a rank's slice from a whole one (`slice`), so the outer state saved by one place, at one S,
loads in the other, at any S.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist import comm


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


class Replicated:
    """Where a fragment's values live when every rank of the worker holds its whole parameters
    (one rank, or DDP within the worker): rank s of S owns slice s of the flat fragment, padded to
    a multiple of S, for the outer step; the updated slices are gathered within the worker."""

    def __init__(self, params: list[torch.Tensor], group):
        self.params, self.group = params, group
        S, s = (group_size(group), group_rank(group)) if group is not None else (1, 0)
        self.shard = S
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // S) * S
        self.lo, self.hi = s * self.padded // S, (s + 1) * self.padded // S

    def local(self) -> torch.Tensor:
        """This rank's slice of the fragment's current weights, flat, fp32 (a new tensor)."""
        flat = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        return torch.nn.functional.pad(flat, (0, self.padded - flat.numel()))[self.lo:self.hi].clone()

    @torch.no_grad()
    def write(self, piece: torch.Tensor, mixing: float) -> None:
        """Every rank of the worker: the whole fragment's new outer weights (from each rank's
        slice `piece`) into its parameters, keeping `mixing` of their own values."""
        full = self._padded(piece.detach())
        offset = 0
        for p in self.params:
            new = full[offset:offset + p.numel()].view_as(p).to(p.dtype)
            p.copy_(new if mixing == 0 else torch.lerp(new, p, mixing))
            offset += p.numel()

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        """The whole fragment, unpadded and a copy, from every rank's slice: the form that loads
        at any S and any placement (a collective within the worker)."""
        return self._padded(piece.detach())[:self.numel].clone()

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole fragment (`whole`'s form), a new fp32 tensor."""
        full = torch.nn.functional.pad(full.float(), (0, self.padded - full.numel()))
        return full[self.lo:self.hi].clone()

    def _padded(self, piece: torch.Tensor) -> torch.Tensor:
        if self.shard == 1:
            return piece
        full = torch.empty(self.padded, dtype=piece.dtype, device=piece.device)
        comm.all_gather_into(full, piece.contiguous(), group=self.group)
        return full


class ShardedWithin:
    """Where a fragment's values live under ZeRO within the worker: each rank holds its pieces of
    the fragment's parameters in its fp32 master shards (`model`, a ShardedDataParallel); its
    slice is those pieces in parameter order, written in place. Slices differ in length from rank
    to rank, but the same place in every worker owns the same pieces, so the all_reduce across
    the workers lines up."""

    def __init__(self, params: list[torch.Tensor], model):
        self.model, self.group = model, model.process_group
        self.views = [model.master_view(p) for p in params]
        self.numel = sum(p.numel() for p in params)
        # Where each rank's slice lies in the whole fragment: (offset, length) per piece, in order.
        self.layout: list[list[tuple[int, int]]] = [[] for _ in range(model.world_size)]
        offset = 0
        for p in params:
            for r, (a, b) in enumerate(model.master_owners(p)):
                if b > a:
                    self.layout[r].append((offset + a, b - a))
            offset += p.numel()
        self.longest = max(sum(n for _, n in pieces) for pieces in self.layout)
        self.mine = self.layout[model.rank]

    def local(self) -> torch.Tensor:
        return torch.cat([v.detach().float() for v in self.views])

    @torch.no_grad()
    def write(self, piece: torch.Tensor, mixing: float) -> None:
        """Into this rank's master pieces only; the caller makes the wrapper gather them."""
        self.model.wait_for_parameters()  # no gather still reading the masters
        offset = 0
        for v in self.views:
            new = piece[offset:offset + v.numel()].to(v.dtype)
            v.copy_(new if mixing == 0 else torch.lerp(new, v, mixing))
            offset += v.numel()

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(piece.detach(), (0, self.longest - piece.numel()))
        gathered = torch.empty(self.longest * len(self.layout), dtype=piece.dtype, device=piece.device)
        comm.all_gather_into(gathered, padded.contiguous(), group=self.group)
        full = torch.empty(self.numel, dtype=piece.dtype, device=piece.device)
        for r, pieces in enumerate(self.layout):
            at = r * self.longest
            for offset, n in pieces:
                full[offset:offset + n] = gathered[at:at + n]
                at += n
        return full

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        full = full.float()
        return torch.cat([full[offset:offset + n] for offset, n in self.mine]) if self.mine \
            else full.new_zeros(0)
