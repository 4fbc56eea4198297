"""Bytes each rank should send per optimizer step, by op, under the ring model (fp32 gradients):
each strategy's spec declares its collectives (minidist/train/strategies/spec.py), this reads them.

Ψ parameters of 4 bytes, n ranks; one optimizer step without accumulation:

| strategy                 | all_reduce     | reduce_scatter | all_gather         | broadcast |
| ddp, native_ddp          | 2(n-1)/n · 4Ψ  |                |                    |           |
| native_zero1             | 2(n-1)/n · 4Ψ  |                |                    | 4Ψ        |
| zero1, zero2, ds_zero1/2 |                | (n-1)/n · 4Ψ   | (n-1)/n · 4Ψ       |           |
| zero3, native_fsdp, ds_zero3 |            | (n-1)/n · 4Ψ   | 2 · (n-1)/n · 4Ψ   |           |

Hybrid strategies on a mesh of R replicas x S shard ranks (n = R S): within the shard group
as ZeRO on S ranks, plus the all_reduce of each rank's 1/S across the R replicas:

| hsdp2, ddp_hierarchical  | 2(R-1)/R · 4Ψ/S | (S-1)/S · 4Ψ  | (S-1)/S · 4Ψ       |           |
| hsdp3, native_hsdp       | 2(R-1)/R · 4Ψ/S | (S-1)/S · 4Ψ  | 2 · (S-1)/S · 4Ψ   |           |

(ZeroRedundancyOptimizer broadcasts each parameter from the rank that updated it: one
broadcast of S bytes per parameter, counted S for every rank as minidist.comm does.)
The small all_reduce of the gradient norm for clipping is left out.
"""

from __future__ import annotations

from minidist.train.strategies import spec


def theoretical_bytes(strategy: str, psi: int, n: int, element_bytes: int = 4,
                      shard: int | None = None, sync_every: int = 1, options=None) -> dict[str, float]:
    """Ring-model bytes sent per rank per optimizer step, per op ({} for one rank, or n == 1).
    Hybrid strategies need `shard`, the size S of their shard groups ({} without it); DiLoCo's
    outer collectives are averaged over their round of `sync_every` steps. `options`: the
    strategy's config, where an option changes what it sends (DiLoCo's strategy.inner) or what
    it sends it as (grad_wire, param_wire, outer_wire)."""
    return spec(strategy).for_options(options).wire_bytes(psi, n, shard=shard, element_bytes=element_bytes,
                                                          sync_every=sync_every, options=options)
