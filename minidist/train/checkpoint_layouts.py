"""The ways a checkpoint folder holds a strategy's state, each one class that collects the files,
loads them, reports the saved shapes and consolidates: full, sharded and workers here; dcp and deepspeed registered
by the reference strategies' plugins (minidist_tools/native.py, deepspeed.py) through
register_layout (a strategy spec's `checkpoint`; meta.pt's `layout`). Every layout but DeepSpeed's
also gives a portable form that a run of another strategy or world size loads. The files of each:
docs/internals.md, "train/checkpoint_layouts.py".
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils._pytree import tree_map

from minidist.parallel.flat_shard import assemble, full_parameters, merged_pieces
from minidist.train.checkpoint_safety import load_tensors, save_tensors

MODEL = "model.pt"
OPTIMIZER = "optimizer.pt"
LAYOUT = "layout.pt"


def shard_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"shard_rank{rank:05d}.pt"


def state_dict_layout(net: torch.nn.Module) -> dict:
    """The state_dict's keys in order, and which parameter each parameter key holds (tied weights:
    two keys, one parameter) — what consolidating sharded checkpoints needs to rebuild it."""
    names = {id(p): n for n, p in net.named_parameters()}
    keys = net.state_dict(keep_vars=True)
    return {"order": list(keys), "params": {k: names[id(v)] for k, v in keys.items() if id(v) in names}}


def write_files(directory: Path, files: dict[str, object]) -> dict[str, dict]:
    """What a layout's collect() gave, into `directory` (no communication: a background writer may).
    Returns each file's manifest entry, hashed as it was written (checkpoint_safety.py). A view of
    a larger tensor is copied first: torch.save would write all of what it views."""
    files = tree_map(lambda x: x.clone() if torch.is_tensor(x) and x.untyped_storage().nbytes() > x.nbytes else x,
                     files)
    return {name: save_tensors(payload, Path(directory) / name) for name, payload in files.items()}


class Full:
    """The plain state_dict and the optimizer's, as one process holds them."""

    name = "full"

    def collect(self, strategy) -> dict[str, object]:
        """This rank's files: {name in the folder: what it holds}. The collectives happen here.
        Rank 0 writes the model, the last rank the optimizer (twice the model's bytes, under Adam):
        two writers, where one would write it all."""
        rank, last = strategy.ctx.rank, strategy.ctx.world_size - 1
        model, optim = strategy.full_state_dict(), strategy.optimizer_state_dict(on=last)
        files = {MODEL: model} if rank == 0 else {}
        if rank == last:
            files[OPTIMIZER] = strategy.name_groups(optim)
        return files

    def load(self, strategy, directory: Path, meta: dict) -> None:
        device = strategy.ctx.device
        strategy.load_full_state_dict(load_tensors(directory / MODEL, map_location=device))
        strategy.load_optimizer_state_dict(load_tensors(directory / OPTIMIZER, map_location=device))

    def shapes(self, ckpt: Path, meta: dict) -> dict[str, tuple]:
        return {k: tuple(v.shape) for k, v in load_tensors(ckpt / MODEL, mmap=True).items()}

    def consolidate(self, ckpt: Path, meta: dict) -> dict:
        return load_tensors(ckpt / MODEL)

    def portable(self, ckpt: Path, meta: dict, names: list[str]) -> tuple[dict, dict]:
        """`names`: the model's parameters in order (the optimizer's numbering, where its state is
        numbered; fully_shard's is keyed by name already)."""
        return load_tensors(ckpt / MODEL), named_optimizer_state(load_tensors(ckpt / OPTIMIZER), names)

    def describe(self, meta: dict) -> str:
        return f"a full state_dict ({MODEL}, {OPTIMIZER})"


class Sharded:
    """One file per rank of a shard group, pieces with offsets: loadable at any shard count."""

    name = "sharded"

    @staticmethod
    def shards(meta: dict) -> int:
        return int(meta.get("shards", meta["world_size"]))

    def collect(self, strategy) -> dict[str, object]:
        state = strategy.sharded_state_dict()  # views of the live state, written or staged at once
        files = {}
        if strategy.writes_shard:  # one copy of each shard, whatever the number of replicas
            files[shard_path(Path(), state["rank"]).name] = state
        if strategy.ctx.rank == 0:
            files[LAYOUT] = state_dict_layout(strategy.net)
        return files

    def load(self, strategy, directory: Path, meta: dict) -> None:
        saved = self.shards(meta)
        if saved == strategy.checkpoint_shards:
            state = load_tensors(shard_path(directory, strategy.shard_rank))
        else:  # another shard count (world size or mesh): every saved shard, re-cut for this one
            state = self.all_shards(directory, meta)
        strategy.load_sharded_state_dict(state)

    def shapes(self, ckpt: Path, meta: dict) -> dict[str, tuple]:
        """The parameters' shapes by state_dict key (sharded files list parameters only)."""
        shard = load_tensors(shard_path(ckpt, 0))
        layout = load_tensors(ckpt / LAYOUT)
        by_param = {name: tuple(shape) for name, shape in shard["shapes"].items()}
        return {key: by_param[name] for key, name in layout["params"].items() if name in by_param}

    def all_shards(self, ckpt: Path, meta: dict) -> list[dict]:
        return [load_tensors(shard_path(ckpt, r)) for r in range(self.shards(meta))]

    def consolidate(self, ckpt: Path, meta: dict, shards: list[dict] | None = None) -> dict:
        """`shards`: every shard file, where the caller has read them already."""
        shards = self.all_shards(ckpt, meta) if shards is None else shards
        params = full_parameters(shards, where=str(ckpt))
        layout = load_tensors(ckpt / LAYOUT)
        # In the module's own key order; a tied weight appears under each of its keys; frozen
        # parameters and buffers are not sharded and come from the replicated part.
        return {key: params[layout["params"][key]] if layout["params"].get(key) in params
                else shards[0]["replicated"][key] for key in layout["order"]}

    def portable(self, ckpt: Path, meta: dict, names: list[str]) -> tuple[dict, dict]:
        shards = self.all_shards(ckpt, meta)
        shapes, groups = shards[0]["shapes"], shards[0]["param_groups"]
        if len(groups) > 1 and not all("param_names" in g for g in groups):
            raise ValueError(f"{ckpt}: {len(groups)} param groups, not named; resuming in another layout takes one")
        members = [g.get("param_names", list(shapes)) for g in groups]  # (files before optim=muon: one group)
        state: dict[str, dict] = {name: {} for name in shapes}
        for key in sorted(set().union(*(s["optim"] for s in shards))):  # Muon's keys are not AdamW's
            holding = [n for n in shapes if any(n in s["optim"].get(key, {}) for s in shards)]
            for name, pieces in merged_pieces(shards, "optim", key, holding).items():
                state[name][key] = assemble(name, shapes[name], pieces, f"{ckpt} ({key})")
        # Per-step scalars (Adam's step) are the same in every shard's piece of a group: any one's.
        per_shard = [groups if isinstance(groups, list) else [groups]  # (one dict in older files)
                     for s in shards for groups in s["optim_scalars"].values()]
        for g, names_in_group in enumerate(members):
            scalars = next((gs[g] for gs in per_shard if g < len(gs) and gs[g]), {})
            for name in names_in_group:
                state[name].update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})
        return self.consolidate(ckpt, meta, shards), {"state": state, "param_groups": [
            {**{k: v for k, v in g.items() if k != "param_names"}, "params": list(m)} for g, m in zip(groups, members)]}

    def describe(self, meta: dict) -> str:
        return f"sharded: {self.shards(meta)} shard file(s)"


def named_optimizer_state(optim: dict, names: list[str]) -> dict:
    """A torch optimizer's state_dict keyed by parameter name (`names`: the parameters in its
    numbering, unless its groups name theirs; a state keyed by name already stays so)."""
    groups = optim["param_groups"]
    if all("param_names" in g for g in groups):
        names = [n for g in groups for n in g["param_names"]]
    name = lambda key: key if isinstance(key, str) else names[int(key)]  # noqa: E731
    return {"state": {name(k): v for k, v in optim["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "param_names"},
                              "params": [name(k) for k in g["params"]]} for g in groups]}


OUTER = "outer.pt"


def worker_path(directory: Path, worker: int) -> Path:
    return Path(directory) / f"worker{worker:05d}.pt"


class Workers:
    """DiLoCo's workers each hold their own weights and inner optimizer state: one file per worker,
    and the outer state once. At another number of workers, worker w resumes from saved worker
    w mod (the saved number), with the outer state as saved."""

    name = "workers"

    def collect(self, strategy) -> dict[str, object]:
        outer = strategy.outer.full_state_dict()  # collectives within each worker: every rank calls them
        worker = strategy.worker_state()
        files = {}
        if strategy.worker_rank == 0:
            files[worker_path(Path(), strategy.worker).name] = worker
        if strategy.ctx.rank == 0:
            trained = [n for n, p in strategy.net.named_parameters() if p.requires_grad]
            files[OUTER] = {**outer, "params": fragment_names(trained, strategy.outer.fragments)}
            files[LAYOUT] = state_dict_layout(strategy.net)
        return files

    def load(self, strategy, directory: Path, meta: dict) -> None:
        device = strategy.ctx.device
        own = load_tensors(worker_path(directory, strategy.worker % Sharded.shards(meta)), map_location=device)
        strategy.load_worker_state(own)
        strategy.outer.load_full_state_dict(load_tensors(Path(directory) / OUTER, map_location=device))

    def shapes(self, ckpt: Path, meta: dict) -> dict[str, tuple]:
        return {k: tuple(v.shape) for k, v in load_tensors(worker_path(ckpt, 0), mmap=True)["model"].items()}

    def consolidate(self, ckpt: Path, meta: dict) -> dict:
        """Worker 0's state_dict with every trained parameter the outer weights: the model every
        worker agrees on (at the end of training, and after every round, their own weights)."""
        model = load_tensors(worker_path(ckpt, 0))["model"]
        outer, layout = load_tensors(Path(ckpt) / OUTER), load_tensors(Path(ckpt) / LAYOUT)
        key_of = {name: key for key, name in layout["params"].items()}
        weights = {}
        for names, frag in zip(outer["params"], outer["fragments"]):
            offset = 0
            for name in names:
                like = model[key_of[name]]
                weights[name] = frag["start"][offset:offset + like.numel()].view(like.shape).to(like.dtype)
                offset += like.numel()
        return {key: weights[layout["params"][key]] if layout["params"].get(key) in weights else value
                for key, value in model.items()}

    def portable(self, ckpt: Path, meta: dict, names: list[str]) -> tuple[dict, dict]:
        """The outer weights, and worker 0's inner optimizer state by parameter name."""
        optim = load_tensors(worker_path(ckpt, 0))["optimizer"]
        return self.consolidate(ckpt, meta), named_optimizer_state(optim, names)

    def describe(self, meta: dict) -> str:
        inner = ((meta.get("config") or {}).get("strategy") or {}).get("inner")
        return (f"DiLoCo's: {Sharded.shards(meta)} worker file(s)" + (f" (strategy.inner={inner})" if inner else "")
                + f" and the outer state ({OUTER}); at another number of workers, worker w resumes as saved "
                f"worker w mod {Sharded.shards(meta)}")


def fragment_names(trained: list[str], fragments) -> list[list[str]]:
    """The trained parameters' names, fragment by fragment (each fragment's params in order)."""
    out, i = [], 0
    for f in fragments:
        out.append(trained[i:i + len(f.params)])
        i += len(f.params)
    return out


LAYOUTS = {layout.name: layout for layout in (Full(), Sharded(), Workers())}


def register_layout(layout) -> None:
    """Add a layout (an object with name, load, shapes, consolidate, portable, describe; and collect
    (the files, written by the trainer), or collect = None and save where its library writes the
    files itself): a plugin's own format."""
    LAYOUTS[layout.name] = layout


def _layout(name: str):
    from minidist.train.strategies import specs

    specs()  # the registry's families, which register their layouts, loaded
    return LAYOUTS[name]


def layout_for(strategy):
    """The layout a strategy's checkpoints use: its spec's `checkpoint`."""
    return _layout(strategy.spec.checkpoint if strategy.spec is not None else "full")


def layout_of(meta: dict):
    """The layout a checkpoint was written in (meta.pt's `layout`; older ones said `sharded`, and
    DeepSpeed's were told apart by their strategy)."""
    from minidist.train.config import ConfigError
    from minidist.train.strategies import spec

    if "layout" in meta:
        return _layout(meta["layout"])
    if meta.get("sharded"):
        return LAYOUTS["sharded"]
    try:
        return _layout(spec(meta["strategy"]).checkpoint)
    except ConfigError:  # a strategy this process does not know: its full state_dict is what is readable
        return LAYOUTS["full"]
