"""The `minidist.sharded.v1` format: what ShardedDataParallel.sharded_state_dict() writes, read in
one place. Its loader, the optimizer's re-cut and offline consolidation all read through here.

One dict per saved shard (a rank of the shard group):

    {"format": "minidist.sharded.v1", "world_size": W, "rank": r, "stage": k, "mesh": [R, S] | None,
     "shapes": {name: shape},                          # every sharded parameter
     "params": {name: [(start, values), ...]},         # this rank's pieces, start = offset in the flattened parameter
     "optim": {key: {name: [(start, values), ...]}},   # per-element optimizer state (exp_avg, ...), likewise
     "optim_scalars": {shard index: [per group {key: value}]},   # step counters and the like
     "param_groups": [{option: value}],                # the optimizer's groups, without their parameters
     "replicated": {state_dict key: tensor}}           # what is not sharded: buffers, frozen parameters

Pieces carry their offsets, so any set of shards that covers a parameter rebuilds it, whatever
world size or bucketing cut them: FlatShard.fill_from_pieces re-cuts them for a live shard,
`assemble` joins them into the whole tensor.
"""

from __future__ import annotations

import torch

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
