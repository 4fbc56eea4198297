"""The theory of what a strategy sends and holds, priced from the two facts its spec declares
(minidist.train.strategies.StrategySpec: `collectives` and `zero_stage`), so the comparison's
expected bytes, the RSS bound, the cost model and the documents price every strategy one way.

    wire_bytes(spec("zero2"), psi=1000, n=4)          # ring-model bytes a rank sends per step, by op
    model_state_bytes(spec("zero2"), psi=1000, n=4)   # parameters + gradients + Adam's state per rank

The model and its units: docs/internals.md, "train/strategies/registry.py".
"""

from __future__ import annotations

from minidist import comm
from minidist.comm.wire import QUANT_BLOCK, Wire

# Bytes per parameter of each part of the model state, Adam (two moments):
#   fp32: 4-byte parameters and gradients, 8 bytes of moments;
#   mixed: the ZeRO paper's mixed precision, 2 + 2 bytes and K = 12 (fp32 master copy + moments).
STATE_BYTES = {"fp32": {"parameters": 4, "gradients": 4, "optimizer": 8},
               "mixed": {"parameters": 2, "gradients": 2, "optimizer": 12}}
# The part each ZeRO stage adds to what is sharded.
SHARDED_FROM_STAGE = {"optimizer": 1, "gradients": 2, "parameters": 3}


def group_sizes(spec, n: int, shard: int | None) -> dict[str, int] | None:
    """Ranks in each group on a world of n (None when a hybrid strategy's S is unknown)."""
    if not spec.hybrid:
        return {"world": n}
    if shard is None:
        return None
    return {"world": n, "shard": shard, "replicas": n // shard}


def op_group_sizes(spec, n: int, shard: int | None) -> dict[str, int]:
    """Ranks in the group each op of the spec's collectives runs on ({} where unknown): what a
    trace whose events do not say their group (the profiler's c10d events) is priced with."""
    sizes = group_sizes(spec, n, shard)
    if sizes is None:
        return {}
    ops = {c.op: sizes[c.group] for c in spec.collectives}
    if len(ops) != len({(c.op, c.group) for c in spec.collectives}):
        raise ValueError(f"StrategySpec {spec.name!r}: an op on two groups; a trace cannot tell them apart")
    return ops


def wire_bytes(spec, psi: int, n: int, shard: int | None = None, element_bytes: float = 4,
               sync_every: int = 1, options=None, micro_batches: int = 1) -> dict[str, float]:
    """Ring-model bytes one rank sends per optimizer step of `micro_batches`, per op ({} on one
    rank, or for a hybrid strategy without `shard`, the size S of its shard groups); the
    per-round collectives averaged over their round of `sync_every` steps. `options` (the
    strategy's config): a collective whose wire option it sets is priced at that format's bytes
    an element (quant_block's scales included), the others at `element_bytes`."""
    sizes = group_sizes(spec, n, shard)
    if n <= 1 or sizes is None:
        return {}
    sharded = (options or {}).get("accumulate") == "sharded"
    out: dict[str, float] = {}
    for c in spec.collectives:
        m = psi * wire_element_bytes(c.wire, options, element_bytes) / (shard if c.payload == "shard" else 1)
        sent = comm.ring_bytes_sent(c.op, m, sizes[c.group])  # the ring model, as the CommTracer counts it
        times = micro_batches if c.per_micro_batch or (sharded and c.wire == "grad_wire") else 1
        if sent:
            out[c.op] = out.get(c.op, 0.0) + times * c.count * sent / (sync_every if c.per_round else 1)
    return out


def sharded_over(spec, part: str) -> bool:
    """Whether `part` (parameters, gradients, optimizer) of the model state is sharded."""
    return spec.zero_stage >= SHARDED_FROM_STAGE[part]


def model_state_bytes(spec, psi: float, n: int, shard: int | None = None, precision: str = "fp32") -> float:
    """Parameters + gradients + Adam's state per rank: each part whole, or 1/(ranks it is
    sharded over) of it (the shard group's S for a hybrid strategy, the world's n otherwise)."""
    over = (shard or n) if spec.hybrid else n
    outer = 4 * spec.outer_copies * psi / ((shard or 1) if spec.hybrid else 1)
    return outer + sum(b * psi / (over if sharded_over(spec, part) else 1)
                       for part, b in STATE_BYTES[precision].items())


def wire_element_bytes(wire: str | None, options, default: float) -> float:
    """Bytes an element of a collective travelling as option `wire` sends under `options` (an
    int8 wire's block scales included); `default` where the option is absent or null."""
    name = (options or {}).get(wire) if wire is not None else None
    if name is None:
        return default
    block = int((options or {}).get("quant_block") or QUANT_BLOCK)
    return Wire(str(name), block=block).chunk_bytes(block) / block
