"""The summation order minidist's ring states, written out independently of minidist.comm:
chunk c of a reduce_scatter is summed from rank c+1 round the ring to rank c."""

import torch


def ring_order_sum(chunks_by_rank: list[torch.Tensor], c: int, n: int) -> torch.Tensor:
    """((x[c+1] + x[c+2]) + ...) + x[c], left to right, in the tensors' dtype."""
    total = chunks_by_rank[(c + 1) % n].clone()
    for k in range(2, n + 1):
        total = total + chunks_by_rank[(c + k) % n]
    return total
