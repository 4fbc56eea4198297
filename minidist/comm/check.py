"""debug.check_collectives: before each collective, the ranks compare what they are about to do.

    comm.check_collectives(True)    # every minidist.comm collective from here on is checked

Each rank sends a fingerprint — its sequence number of collectives on that group, the op,
the dtype and the payload bytes — to every other (one small all_gather), before the real
collective is issued. If they differ, every rank raises CollectiveMismatch naming what each
rank issued, instead of the job hanging in mismatched collectives or silently reducing the
wrong tensors. Costs one extra collective per collective: a debugging mode. Point-to-point
calls (send/recv) are not checked; a rank that issues nothing at all is caught by the
collective timeout instead (launcher.timeout_s).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

POINT_TO_POINT = ("send", "recv", "isend", "irecv")
_OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "barrier",
        "all_gather_object"]
_DTYPES = [None, torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int8, torch.uint8, torch.bool]
_state = {"enabled": False, "sequence": {}}


class CollectiveMismatch(RuntimeError):
    """The ranks were about to issue different collectives (op, dtype or size), or in another order."""


def check_collectives(enabled: bool = True) -> None:
    """Turn the cross-rank fingerprint check of every minidist.comm collective on or off.
    Turning it on starts counting collectives afresh (every rank must turn it on together)."""
    if enabled and not _state["enabled"]:
        _state["sequence"].clear()
    _state["enabled"] = bool(enabled)


def enabled() -> bool:
    return _state["enabled"]


def _describe(row: list[int]) -> str:
    seq, op, dtype, nbytes = row
    name = _OPS[op] if 0 <= op < len(_OPS) else f"op#{op}"
    kind = str(_DTYPES[dtype]).replace("torch.", "") if 0 < dtype < len(_DTYPES) else "-"
    return f"collective #{seq} {name} of {nbytes:,} bytes ({kind})"


def control_device(group=None) -> torch.device:
    """Where a small control tensor for a collective on `group` must live: nccl takes CUDA tensors only."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def verify(op: str, nbytes: int, dtype, group) -> None:
    """All ranks of `group` agree on this collective, or every one raises CollectiveMismatch."""
    if op in POINT_TO_POINT:
        return
    key = group if group is not None else dist.group.WORLD
    seq = _state["sequence"].get(key, 0) + 1
    _state["sequence"][key] = seq
    code = _OPS.index(op) if op in _OPS else len(_OPS)
    dtype_code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
    rows = exchange([seq, code, dtype_code, int(nbytes)], group)
    if any(r != rows[0] for r in rows):
        ranks = [dist.get_global_rank(group, k) if group is not None else k for k in range(len(rows))]
        issued = "; ".join(f"rank {r} issued {_describe(row)}" for r, row in zip(ranks, rows))
        raise CollectiveMismatch(f"the ranks disagree on the next collective: {issued}. Every rank must issue "
                                 "the same collectives in the same order (look for rank-dependent control flow)")


def exchange(values: list[int], group=None) -> list[list[int]]:
    """Every rank's `values` (a few integers), in group rank order: one small all_gather, untraced
    (control messages, as the fingerprints above and stage 3's forward agreement)."""
    mine = torch.tensor(values, dtype=torch.int64, device=control_device(group))
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return [r.tolist() for r in rows]
