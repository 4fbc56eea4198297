"""Flat buffers and bucket plans: the memory layout gradient communication works on.

One collective per tensor is slow (a fixed cost per call); one collective for
the whole model cannot start until the last gradient exists. Buckets sit in
between: gradients are packed, in the order backward produces them, into flat
buffers of bounded size, and each buffer is reduced as soon as it is full.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minidist import comm

MiB = 1 << 20


# --------------------------------------------------------------------------- flat buffers


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D copy of `tensors` (all of one dtype and device)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` back into `tensors`, in order."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def group_by_dtype_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Split into lists of one dtype and device each (a flat buffer holds one of each), order kept."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def broadcast_coalesced(tensors: list[torch.Tensor], src: int = 0, group=None,
                        chunk_bytes: int = 256 * MiB) -> None:
    """Broadcast `tensors` from `src` in a few flat messages instead of one call per tensor."""
    for same_kind in group_by_dtype_device(tensors):
        for chunk in split_by_size(same_kind, chunk_bytes):
            flat = flatten(chunk)
            comm.broadcast(flat, src=src, group=group)
            unflatten_into(flat, chunk)


class FlatBuffers:
    """Module buffers (e.g. BatchNorm statistics) re-pointed into one flat tensor per dtype/device.

    Broadcasting them before every forward is then one message per dtype and no copies:
    layers update their buffers in place, i.e. straight inside the flat tensor. A buffer
    replaced by assignment is noticed and everything is laid out again.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._layout()

    def _layout(self) -> None:
        self.buffers = [b for b in self.module.buffers()]
        self.flats = []
        with torch.no_grad():
            for group in group_by_dtype_device(self.buffers):
                flat = flatten(group)
                offset = 0
                for b in group:
                    b.data = flat[offset:offset + b.numel()].view_as(b)
                    offset += b.numel()
                self.flats.append(flat)
        self._ptrs = [b.data_ptr() for b in self.buffers]

    def broadcast(self, src: int, group=None) -> None:
        current = list(self.module.buffers())
        if len(current) != len(self.buffers) or any(
                b is not old or b.data_ptr() != ptr for b, old, ptr in zip(current, self.buffers, self._ptrs)):
            self._layout()
        for flat in self.flats:
            comm.broadcast(flat, src=src, group=group)


class BufferPool:
    """Scratch flat buffers, taken and given back, reused across buckets and steps.

    Strategies that need full-size scratch space every step (ZeRO-2/3 gradients before
    their reduce_scatter) then neither keep one buffer per bucket forever nor pay an
    allocation (and page faults) each time. Every buffer is allocated with at least
    `capacity` elements and serves any request up to its size (as a view of its start),
    so the pool holds only as many buffers as were ever in use at once.
    """

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self._free: list[torch.Tensor] = []
        self._in_use: dict[int, torch.Tensor] = {}  # storage address -> whole buffer

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised 1-D buffer of `numel` elements: the caller writes what it relies on."""
        for k, buf in enumerate(self._free):
            if buf.dtype == dtype and buf.device == device and buf.numel() >= numel:
                self._free.pop(k)
                break
        else:
            buf = torch.empty(max(numel, self.capacity), dtype=dtype, device=device)
        self._in_use[buf.untyped_storage().data_ptr()] = buf
        return buf[:numel]

    def put(self, t: torch.Tensor) -> None:
        self._free.append(self._in_use.pop(t.untyped_storage().data_ptr()))

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer the pool holds, in use or free (for memory reports)."""
        return list(self._in_use.values()) + self._free


def split_by_size(tensors: list[torch.Tensor], cap_bytes: int, first_cap_bytes: int | None = None,
                  closing: str = "at_most"):
    """Consecutive runs of `tensors`, each up to cap_bytes (the first up to first_cap_bytes).

    closing="at_most": a run never holds more than its cap (a tensor larger than the cap gets
    a run of its own). closing="reach": native DDP's rule, a run closes as soon as it reaches
    its cap, so it may exceed it by its last tensor (fewer, fuller runs).
    """
    if closing not in ("at_most", "reach"):
        raise ValueError(f"closing={closing!r}: choose 'at_most' or 'reach'")
    runs, current, size = [], [], 0
    cap = cap_bytes if first_cap_bytes is None else first_cap_bytes
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if closing == "at_most" and current and size + nbytes > cap:
            runs.append(current)
            current, size, cap = [], 0, cap_bytes
        current.append(t)
        size += nbytes
        if closing == "reach" and size >= cap:
            runs.append(current)
            current, size, cap = [], 0, cap_bytes
    if current:
        runs.append(current)
    return runs


# --------------------------------------------------------------------------- bucket plans


def plan_buckets(params: list[torch.Tensor], order: list[int], cap_bytes: int,
                 first_cap_bytes: int, last_cap_bytes: int | None = None,
                 closing: str = "at_most") -> list[list[int]]:
    """Group parameter indices, taken in `order`, into buckets of one dtype/device.

    Every bucket holds at most cap_bytes (a larger tensor gets a bucket of its own).
    Two ends are kept small, at most first_cap_bytes:
    - the first bucket, so the first all_reduce starts early in backward;
    - the last bucket, because nothing is left to overlap it with: it holds the
      gradients that arrive last, and backward waits for all of it to be reduced
      (at most last_cap_bytes when given).
    closing="reach" is native DDP's layout instead: buckets close when they reach their cap
    (see split_by_size), and there is no separate small last bucket.
    """
    small = min(first_cap_bytes, cap_bytes)
    small_last = small if last_cap_bytes is None else min(last_cap_bytes, cap_bytes)
    by_kind: dict[tuple, list[int]] = {}
    for i in order:
        by_kind.setdefault((params[i].dtype, params[i].device), []).append(i)
    kinds = list(by_kind.values())
    buckets: list[list[int]] = []
    for n, indices in enumerate(kinds):
        tail: list[int] = []
        if n == len(kinds) - 1 and len(indices) > 1 and closing == "at_most":
            # Fill the last bucket backwards from the last-ready gradient, up to the small cap.
            rest = split_by_size([params[i] for i in reversed(indices)], small_last)[0]
            if len(rest) < len(indices):
                tail = indices[len(indices) - len(rest):]
                indices = indices[:len(indices) - len(rest)]
        sized = [params[i] for i in indices]
        position = {id(p): i for p, i in zip(sized, indices)}
        runs = split_by_size(sized, cap_bytes, small if not buckets else cap_bytes, closing)
        buckets.extend([position[id(p)] for p in run] for run in runs)
        if tail:
            buckets.append(tail)
    return buckets


@dataclass
class Bucket:
    """A flat buffer holding several parameters' gradients, and the bookkeeping of one backward.

    `buffer` is what the comm hook reduces; `views[k]` is parameter `param_ids[k]`'s slice of it.
    """

    index: int
    param_ids: list[int]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    process_group: object = None
    world_size: int = 1
    pending: int = 0                     # parameters not yet ready in this backward
    handle: object = field(default=None, repr=False)

    @classmethod
    def allocate(cls, index: int, param_ids: list[int], params: list[torch.Tensor],
                 process_group, world_size: int) -> "Bucket":
        first = params[param_ids[0]]
        total = sum(params[i].numel() for i in param_ids)
        buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
        views, offset = [], 0
        for i in param_ids:
            p = params[i]
            views.append(buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return cls(index, list(param_ids), buffer, views, process_group, world_size, pending=len(param_ids))

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
