"""ZeRO's flat shards, in one place: the padded flat groups with their fp32 master shards and their
one parameter gather, and the `minidist.sharded.v1` checkpoint format that reads and writes them.

    flat (padded to a multiple of n):  [ p0 | p1 | p2 ......... | pad ]
    rank r owns                         [ r*s : (r+1)*s ),  s = padded / n

The layout by optimizer group, and the format's fields: docs/internals.md, "parallel/flat_shard.py".
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from minidist import comm


FORMAT = "minidist.sharded.v1"


def check_format(states: list[dict]) -> None:
    for s in states:
        if s.get("format") != FORMAT:
            raise ValueError(f"not a minidist sharded checkpoint (format {s.get('format')!r}, expected {FORMAT!r})")


def merged_pieces(states: list[dict], part: str = "params", key: str | None = None,
                  names=None) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Every saved shard's pieces of each parameter, together: of the parameters (part="params")
    or of one optimizer state (part="optim", key="exp_avg"). `names`: those wanted (default: all
    the checkpoint shapes)."""
    names = list(states[0]["shapes"]) if names is None else list(names)
    source = (lambda s: s[part]) if key is None else (lambda s: s[part].get(key, {}))
    return {n: [p for s in states for p in source(s).get(n, [])] for n in names}


def assemble(name: str, shape, pieces: list[tuple[int, torch.Tensor]], where: str = "the checkpoint") -> torch.Tensor:
    """The whole tensor of parameter `name` from its pieces; a gap names what is missing."""
    flat = torch.empty(int(torch.Size(shape).numel()), dtype=pieces[0][1].dtype if pieces else torch.float32)
    covered = 0
    for start, values in pieces:
        flat[start:start + values.numel()] = values.reshape(-1)
        covered += values.numel()
    if covered != flat.numel():
        raise ValueError(f"{where}: the shards hold {covered} of the {flat.numel()} values of {name!r}; "
                         "is a shard file missing?")
    return flat.view(tuple(shape))


def full_parameters(states: list[dict], where: str = "the checkpoint") -> dict[str, torch.Tensor]:
    """name -> the whole parameter, from every shard of a checkpoint."""
    pieces = merged_pieces(states)
    return {name: assemble(name, shape, pieces[name], where) for name, shape in states[0]["shapes"].items()}


@dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    offset: int  # into the flat buffer
    numel: int


def flat_layout(numels: list[int], world_size: int, whole: bool = False,
                load: tuple[int, ...] | None = None) -> tuple[list[int], int, tuple[int, ...] | None]:
    """(each parameter's offset in the flat buffer, its padded length, the owners' load after it).

    Cut: back to back, in order, padded at the end; a rank's slice may cut a parameter anywhere.
    Whole: each parameter lies within one rank's slice, for optimizers that update a matrix as a
    whole (Muon): the largest first to the rank that owns the fewest elements of this group (the
    least padding), between equals the fewest over the groups before it too (`load`), so every
    rank owns ~1/N of the model within its largest parameter; each rank's in their given order, its
    slice padded to the fullest rank's here."""
    if not whole:
        offsets = list(itertools.accumulate(numels, initial=0))
        return offsets[:-1], -(-offsets[-1] // world_size) * world_size, load
    total, here, owner = list(load or [0] * world_size), [0] * world_size, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        owner[i] = min(range(world_size), key=lambda r: (here[r], total[r], r))
        total[owner[i]] += numels[i]
        here[owner[i]] += numels[i]
    size = max(1, max(here))
    offsets, at = [0] * len(numels), [r * size for r in range(world_size)]
    for i, r in enumerate(owner):
        offsets[i], at[r] = at[r], at[r] + numels[i]
    return offsets, size * world_size, tuple(total)


def order_by_group(ids: list[int], group_of: list[int]) -> list[int]:
    """`ids` with the parameters of each optimizer group together, in group order (stable):
    the layout FlatShard needs to cut its master shard into one piece per group."""
    return sorted(ids, key=lambda i: group_of[i])


class FlatShard:
    """One flat group. `full` holds the compute-dtype values of every parameter in the group
    (when materialised); `master` is this rank's fp32 slice; `pieces` are the nn.Parameters the
    optimizer steps, one per optimizer group, viewing consecutive parts of `master`.

    `groups[i]`: the optimizer group of params[i], non-decreasing (see order_by_group);
    None: every parameter in group 0 of `n_groups`."""

    def __init__(self, index: int, names: list[str], params: list[nn.Parameter], *, rank: int,
                 world_size: int, group, compute_dtype: torch.dtype | None, keep_full: bool,
                 algorithm: str = "backend", groups: list[int] | None = None, n_groups: int = 1, wire=None,
                 values: torch.Tensor | None = None, master: torch.Tensor | None = None,
                 whole_groups: frozenset = frozenset(),
                 load: tuple[int, ...] | None = None):
        self.index, self.rank, self.world_size, self.group = index, rank, world_size, group
        self.algorithm = algorithm  # of its all_gathers: see minidist.comm.choose_algorithm
        self.wire = wire  # what the parameters travel as in gather_full (None: the compute dtype; comm.wire)
        self.params = params
        first = params[0]
        self.device = first.device
        self.master_dtype = first.dtype
        self.compute_dtype = compute_dtype or first.dtype
        self.groups = list(groups) if groups is not None else [0] * len(params)  # of each slot
        # Whole layout where a group's optimizer updates each parameter as a whole (whole_groups):
        # then every parameter here lies within one rank's slice (flat_layout); `load`: what each
        # rank owns in the groups before this one, `load_after` with this one.
        self.whole = any(g in whole_groups for g in self.groups)
        offsets, self.padded, self.load_after = flat_layout([p.numel() for p in params], world_size, self.whole, load)
        self.slots = [ParamSlot(name, tuple(p.shape), at, p.numel()) for name, p, at in zip(names, params, offsets)]
        self.numel = sum(p.numel() for p in params)
        # What no parameter covers, zeroed in every reduce buffer (cut layout: the tail alone).
        ends = [0] + [s.offset + s.numel for s in sorted(self.slots, key=lambda s: s.offset)]
        starts = [s.offset for s in sorted(self.slots, key=lambda s: s.offset)] + [self.padded]
        self.gaps = [(a, b) for a, b in zip(ends, starts) if a < b]
        self.shard_size = self.padded // world_size
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size

        with torch.no_grad():
            if master is not None:  # a meta-built model (meta_init.py): `values` is untouched, the shard holds values
                self.master = master
                self.full = values if values.dtype == self.compute_dtype else \
                    torch.empty(self.padded, dtype=self.compute_dtype, device=self.device)
            else:
                values = torch.zeros(self.padded, dtype=self.master_dtype, device=self.device)
                for slot, p in zip(self.slots, params):
                    values[slot.offset:slot.offset + slot.numel].copy_(p.reshape(-1))
                self.full = values.to(self.compute_dtype) if self.compute_dtype != self.master_dtype else values
                # Stages 1-2 in full precision: the master shard *is* the owned slice of the
                # parameters (no copy). Otherwise it is a separate fp32 tensor: also under a wire
                # format, whose rounded values the gather writes into every slice of `full`.
                if keep_full and self.compute_dtype == self.master_dtype and wire is None:
                    self.master = self.full[self.lo:self.hi]
                else:
                    self.master = values[self.lo:self.hi].clone()
            self._cut_into_pieces(n_groups, whole_groups)
            for slot, p in zip(self.slots, params):
                p.data = self.full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        self.keep_full = keep_full
        if not keep_full:
            self.free_full()

    def _cut_into_pieces(self, n_groups: int, whole_groups: frozenset) -> None:
        """The pieces the optimizer steps: per group one flat view of the master shard (maybe empty;
        cut layout: together they tile it; whole layout: the padding in none), or for a group in
        `whole_groups` one per parameter this rank owns, shaped as it. piece_bounds[j], piece_group[j]:
        piece j's (start, end) in the master shard, its group; slot_piece[k]: the piece holding this
        rank's part of parameter k (None: none)."""
        if any(b < a for a, b in zip(self.groups, self.groups[1:])):
            raise ValueError("FlatShard: parameters must be ordered by optimizer group (order_by_group)")
        clamp = lambda x: min(max(x - self.lo, 0), self.shard_size)  # noqa: E731
        mine = [k for k in range(len(self.slots)) if self.owned_range(k, self.rank)[1]]
        mine_of = [[k for k in mine if self.groups[k] == g] for g in range(n_groups)]
        if self.whole:  # each group's parameters here (ordered by group), no padding: it would get state
            starts = [min([self.slots[k].offset for k in ks], default=self.lo) for ks in mine_of]
            ends = [max([self.slots[k].offset + self.slots[k].numel for k in ks], default=self.lo) for ks in mine_of]
        else:
            starts = [min([s.offset for s, gi in zip(self.slots, self.groups) if gi >= g], default=self.numel)
                      for g in range(n_groups)]
            ends = starts[1:] + [self.padded]
        bounds, shapes, self.piece_group, self.slot_piece = [], [], [], [None] * len(self.slots)
        for g, (a, b) in enumerate(zip(starts, ends)):
            for k in (mine_of[g] if g in whole_groups else [None]):
                if k is not None:
                    a, b = self.slots[k].offset, self.slots[k].offset + self.slots[k].numel
                bounds.append((clamp(a), clamp(b)))
                shapes.append(self.slots[k].shape if k is not None else (clamp(b) - clamp(a),))
                self.piece_group.append(g)
        for k in mine:  # (a parameter lies in its group's one piece, or is a whole piece)
            at = max(self.slots[k].offset, self.lo) - self.lo
            self.slot_piece[k] = next(j for j, (a, b) in enumerate(bounds)
                                      if a <= at < b and self.piece_group[j] == self.groups[k])
        self.piece_bounds = bounds
        self.pieces = [nn.Parameter(self.master[a:b].view(shape), requires_grad=True)
                       for (a, b), shape in zip(bounds, shapes)]

    def zero_padding(self, flat: torch.Tensor) -> None:
        """Zero what no parameter covers in a flat buffer of this layout (its gaps and tail)."""
        for a, b in self.gaps:
            flat[a:b].zero_()

    # ----------------------------------------------------------------- gradients (of the pieces)

    def grads(self) -> list[torch.Tensor]:
        """The pieces' gradients that exist (what clipping and the optimizer see)."""
        return [p.grad for p in self.pieces if p.grad is not None]

    def add_grad(self, flat: torch.Tensor) -> None:
        """Accumulate a shard-sized gradient into the pieces (which view it when they had none)."""
        for p, (a, b) in zip(self.pieces, self.piece_bounds):
            if p.grad is None:
                p.grad = flat[a:b].view(p.shape)
            else:
                p.grad.add_(flat[a:b].view(p.shape))

    def owned_grad(self, k: int) -> torch.Tensor | None:
        """This rank's part of slot k's gradient (a 1-D view into its piece's), or None where
        this rank owns none of the parameter or the piece has no gradient."""
        j = self.slot_piece[k]
        a, b = self.owned_range(k, self.rank)
        if j is None or self.pieces[j].grad is None:
            return None
        start = self.slots[k].offset + a - self.lo - self.piece_bounds[j][0]
        return self.pieces[j].grad.view(-1)[start:start + b - a]

    def take_grad(self) -> torch.Tensor | None:
        """The pieces' gradient as one shard-sized copy (None if they have none); clears them."""
        if all(p.grad is None for p in self.pieces):
            return None
        out = torch.zeros_like(self.master)
        for p, (a, b) in zip(self.pieces, self.piece_bounds):
            if p.grad is not None:
                out[a:b].copy_(p.grad.reshape(-1))
            p.grad = None
        return out

    # ----------------------------------------------------------------- full parameters

    @property
    def is_materialised(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def free_full(self) -> None:
        """Release the full buffer's memory; the parameters' views stay, pointing at nothing."""
        self.full.untyped_storage().resize_(0)

    def materialise(self) -> None:
        """Give the full buffer its memory back (its values are whatever the next gather writes)."""
        if not self.is_materialised:
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())

    def gather_full(self, async_op: bool = False):
        """all_gather every rank's master shard (cast to the compute dtype) into `full`: the one
        parameter gather of every stage. With a wire format, the master shard is encoded straight
        from fp32 and every slice of `full`, this rank's too, holds what the wire delivered."""
        self.materialise()
        with torch.no_grad():
            if self.wire is not None:
                return comm.all_gather_into(self.full, self.master.detach(), group=self.group, async_op=async_op,
                                            wire_dtype=self.wire)
            own = self.full[self.lo:self.hi]
            if own.data_ptr() != self.master.data_ptr():
                own.copy_(self.master)  # cast fp32 master -> compute dtype
            return comm.all_gather_into(self.full, own, group=self.group, async_op=async_op,
                                        algorithm=self.algorithm)

    # ----------------------------------------------------------------- who owns what

    def owned_range(self, k: int, rank: int) -> tuple[int, int]:
        """[start, end) of slot k's parameter (flattened) that `rank` owns; start == end: none."""
        slot = self.slots[k]
        lo, hi = rank * self.shard_size, (rank + 1) * self.shard_size
        a, b = max(slot.offset, lo) - slot.offset, min(slot.offset + slot.numel, hi) - slot.offset
        return (a, b) if a < b else (0, 0)

    def owned_master(self, k: int) -> torch.Tensor:
        """This rank's part of slot k's parameter in the master shard: a 1-D fp32 view (writable)."""
        a, b = self.owned_range(k, self.rank)
        at = self.slots[k].offset - self.lo  # where the parameter starts, relative to this rank's slice
        return self.master[at + a:at + b] if a < b else self.master[:0]

    # ----------------------------------------------------------------- checkpoint pieces

    def owned_pieces(self, flat_values: torch.Tensor, copy: bool = True) -> dict[str, tuple[int, torch.Tensor]]:
        """For each parameter overlapping this rank's slice: (start within the parameter, values).

        `flat_values` is shard-sized (the master, or an optimizer state of the same shape). The
        values are copies on the CPU; `copy=False`: views of it where it is on the CPU (for a
        checkpoint, which copies them once where it writes or stages them).
        """
        pieces = {}
        for k, slot in enumerate(self.slots):
            a, b = self.owned_range(k, self.rank)
            if a < b:
                at = slot.offset - self.lo  # where the parameter starts, relative to this rank's slice
                piece = flat_values[at + a:at + b].detach()
                pieces[slot.name] = (a, piece.clone().cpu() if copy else piece.cpu())
        return pieces

    def fill_from_pieces(self, target: torch.Tensor, pieces: dict[str, list[tuple[int, torch.Tensor]]],
                         only: set[str] | None = None) -> None:
        """Write this rank's slice of `target` (shard-sized) from per-parameter pieces of any layout
        (of the parameters named in `only`, when given: one optimizer's, where there are several)."""
        with torch.no_grad():
            target.zero_()
            for k, slot in enumerate(self.slots):
                want_lo, want_hi = self.owned_range(k, self.rank)  # range within the parameter
                if want_lo >= want_hi or (only is not None and slot.name not in only):
                    continue
                if slot.name not in pieces:
                    raise KeyError(f"checkpoint has no values for parameter {slot.name!r}")
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
        return self.gather_flat(self.master)

    def gather_flat(self, shard_values: torch.Tensor) -> torch.Tensor:
        """Every rank's shard-sized `shard_values` (the master, an optimizer state), gathered
        into the padded flat layout. A collective over the shard group."""
        out = torch.empty(self.padded, dtype=shard_values.dtype, device=self.device)
        comm.all_gather_into(out, shard_values.detach(), group=self.group, algorithm=self.algorithm)
        return out
