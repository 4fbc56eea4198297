"""Bytes each rank should send per optimizer step, by op, under the ring model (fp32 gradients).

Ψ parameters of 4 bytes, n ranks; one optimizer step without accumulation:

| strategy                 | all_reduce     | reduce_scatter | all_gather         | broadcast |
| ddp, native_ddp          | 2(n-1)/n · 4Ψ  |                |                    |           |
| native_zero1             | 2(n-1)/n · 4Ψ  |                |                    | 4Ψ        |
| zero1, zero2, ds_zero1/2 |                | (n-1)/n · 4Ψ   | (n-1)/n · 4Ψ       |           |
| zero3, native_fsdp, ds_zero3 |            | (n-1)/n · 4Ψ   | 2 · (n-1)/n · 4Ψ   |           |

Hybrid strategies on a mesh of R replicas x S shard ranks (n = R S): within the shard group
as ZeRO on S ranks, plus the all_reduce of each rank's 1/S across the R replicas:

| hsdp2                    | 2(R-1)/R · 4Ψ/S | (S-1)/S · 4Ψ  | (S-1)/S · 4Ψ       |           |
| hsdp3, native_hsdp       | 2(R-1)/R · 4Ψ/S | (S-1)/S · 4Ψ  | 2 · (S-1)/S · 4Ψ   |           |

(ZeroRedundancyOptimizer broadcasts each parameter from the rank that updated it: one
broadcast of S bytes per parameter, counted S for every rank as minidist.comm does.)
The small all_reduce of the gradient norm for clipping is left out.
"""

from __future__ import annotations

THEORY = {
    "ddp": {"all_reduce": 2.0},
    "native_ddp": {"all_reduce": 2.0},
    "native_zero1": {"all_reduce": 2.0, "broadcast": "psi"},
    "zero1": {"reduce_scatter": 1.0, "all_gather": 1.0},
    "zero2": {"reduce_scatter": 1.0, "all_gather": 1.0},
    "ds_zero1": {"reduce_scatter": 1.0, "all_gather": 1.0},
    "ds_zero2": {"reduce_scatter": 1.0, "all_gather": 1.0},
    "zero3": {"reduce_scatter": 1.0, "all_gather": 2.0},
    "native_fsdp": {"reduce_scatter": 1.0, "all_gather": 2.0},
    "ds_zero3": {"reduce_scatter": 1.0, "all_gather": 2.0},
}
HYBRID = {"hsdp2": 1.0, "hsdp3": 2.0, "native_hsdp": 2.0}  # all_gathers per step within the shard group


def theoretical_bytes(strategy: str, psi: int, n: int, element_bytes: int = 4,
                      shard: int | None = None) -> dict[str, float]:
    """Ring-model bytes sent per rank per optimizer step, per op ({} for `single` or n == 1).
    Hybrid strategies need `shard`, the size S of their shard groups ({} without it)."""
    if strategy in HYBRID:
        if shard is None or n <= 1:
            return {}
        S, R, size = shard, n // shard, psi * element_bytes
        out = {"reduce_scatter": (S - 1) / S * size, "all_gather": HYBRID[strategy] * (S - 1) / S * size,
               "all_reduce": 2 * (R - 1) / R * size / S}
        return {op: b for op, b in out.items() if b}
    if n <= 1 or strategy not in THEORY:
        return {}
    out = {}
    for op, factor in THEORY[strategy].items():
        out[op] = float(psi * element_bytes) if factor == "psi" else factor * (n - 1) / n * psi * element_bytes
    return out
