"""ZeRO's state as torch's APIs see it: the optimizers over the shards (a built optimizer is adopted,
its groups rebound in place to this rank's pieces), their state dicts (per piece, or numbered as
an unsharded optimizer would), and the module's state_dict / load_state_dict. What users may call,
and why the rest is refused: docs/drop_in.md and docs/internals.md, "parallel/shard_optimizer.py".
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from minidist import comm
from minidist.parallel.flat_shard import merged_pieces


ELEMENTWISE_OPTIMIZERS: set[type] = {
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.ASGD,
}
# Optimizers that update each parameter as a whole (Muon orthogonalises each weight matrix's update),
# with per-parameter state of the parameter's shape: each parameter is owned whole by one rank
# (flat_shard.flat_layout), which steps it as an unsharded optimizer would.
WHOLE_PARAMETER_OPTIMIZERS: set[type] = {torch.optim.Muon} if hasattr(torch.optim, "Muon") else set()
# What makes each of these inexact on a flat slice of several parameters, and not whole-parameter either.
NOT_ELEMENTWISE = {
    "Adafactor": "factors the second moment of each matrix into row and column statistics (state of another shape)",
    "LBFGS": "takes one line-search step over all parameters at once, with a closure",
    "SparseAdam": "needs sparse gradients",
}
TAG = "minidist_shard"  # the key of the place tag in a per-piece state dict (packed(), and earlier per-rank files)
SHARD_STATE_DICT = (
    "ShardedDataParallel: model.optimizer holds only this rank's shard of the optimizer state, so its state_dict() "
    "would restore no other rank: a plain optimizer cannot load it (before wrapping torch fails on its group sizes) "
    "and a rank-0 snapshot would give every rank rank 0's shard. For one file: "
    "model.full_optim_state_dict(rank0_only=True) on every rank (a collective), torch.save on rank 0; it loads into "
    "the plain optimizer before wrapping or after, at any world size, and into native DDP. For one file per rank: "
    "model.sharded_state_dict().")


def register_elementwise_optimizer(cls: type) -> type:
    """Declare `cls` (a torch.optim.Optimizer subclass) element-wise: every element's update
    depends only on that element's gradient, its own state and per-step scalars. A decorator too."""
    return _register(cls, ELEMENTWISE_OPTIMIZERS)


def register_whole_parameter_optimizer(cls: type) -> type:
    """Declare `cls` whole-parameter, as Muon: each parameter's update depends on the whole parameter
    (its gradient, its state: tensors of its shape) and per-step scalars; each such parameter then
    gets one owner. A decorator too."""
    return _register(cls, WHOLE_PARAMETER_OPTIMIZERS)


def _register(cls: type, kinds: set) -> type:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register_*_optimizer takes a torch.optim.Optimizer subclass, got {cls!r}")
    kinds.add(cls)
    return cls


def is_whole_parameter(cls: type) -> bool:
    return any(issubclass(cls, known) for known in WHOLE_PARAMETER_OPTIMIZERS)


def check_elementwise(cls: type) -> None:
    """Raise unless `cls` steps a flat slice of many parameters exactly as it steps them one by one."""
    if is_whole_parameter(cls):
        raise TypeError(
            f"ShardedDataParallel: {cls.__name__} updates each parameter as a whole, so each rank must own whole "
            "parameters: pass the optimizer built over them (ShardedDataParallel(net, [muon, adamw], stage=k)), "
            "not a factory called with this rank's flat slice.")
    if cls.__name__ in NOT_ELEMENTWISE:
        raise TypeError(
            f"ShardedDataParallel cannot shard {cls.__name__}: it {NOT_ELEMENTWISE[cls.__name__]}, and each rank "
            "steps a flat slice cut across parameters, so its updates would silently differ. Use "
            "minidist.DataParallel with it, or an element-wise optimizer (SGD, Adam, AdamW, ...).")
    if not any(issubclass(cls, known) for known in ELEMENTWISE_OPTIMIZERS):
        raise TypeError(
            f"ShardedDataParallel: {cls.__module__}.{cls.__qualname__} is not known to be element-wise. Each rank "
            "steps a flat slice cut across parameters, which is exact only when every element's update depends "
            "on its own gradient and state alone (SGD, Adam, AdamW, ...). If yours is, declare it: "
            f"minidist.parallel.register_elementwise_optimizer({cls.__name__}) (or, if it updates each parameter as "
            "a whole with state of the parameter's shape, register_whole_parameter_optimizer); otherwise use "
            "minidist.DataParallel.")


def parameter_groups(optimizer, module: nn.Module, trainable: list[nn.Parameter], names: list[str]):
    """(the optimizer group of each trainable parameter, the groups' parameters as given, the
    optimizers with the first of their groups, the groups whose optimizer is whole-parameter).

    A factory has one group: every parameter of the module. Built optimizers (one, or a list:
    Muon over the hidden matrices, AdamW over the rest) must together hold every trainable
    parameter of the module, each once, and nothing else; their groups are numbered in order."""
    if not isinstance(optimizer, (torch.optim.Optimizer, list, tuple)):
        if not callable(optimizer):
            raise TypeError(f"ShardedDataParallel: optimizer must be a torch.optim.Optimizer built over the "
                            f"module's parameters (or a list of them), or a factory such as "
                            f"functools.partial(torch.optim.AdamW, lr=3e-4); got {type(optimizer).__name__}")
        cls = getattr(optimizer, "func", optimizer)  # a class, or functools.partial of one
        if isinstance(cls, type) and is_whole_parameter(cls):
            check_elementwise(cls)  # refused, naming the way
        return [0] * len(trainable), [list(module.parameters())], [(optimizer, 0)], frozenset()
    if isinstance(getattr(optimizer, "optimizers", None), list):  # several stepped as one (train/optim.py's
        optimizer = optimizer.optimizers                            # CombinedOptimizer, torchtitan's container)
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise TypeError("ShardedDataParallel: a list of optimizers must hold torch.optim.Optimizer objects built "
                        "over the module's parameters, at least one")
    for o in optimizers:
        if not is_whole_parameter(type(o)):
            check_elementwise(type(o))
    given, spans, whole = [], [], set()
    for o in optimizers:
        spans.append((o, len(given)))
        if is_whole_parameter(type(o)):
            whole.update(range(len(given), len(given) + len(o.param_groups)))
        given += [list(g["params"]) for g in o.param_groups]
    group_of_id = {}
    for g, params in enumerate(given):
        for p in params:
            if id(p) in group_of_id:
                raise ValueError("ShardedDataParallel: a parameter is in two optimizer groups (or optimizers); "
                                 "give each parameter to exactly one")
            group_of_id[id(p)] = g
    in_module = {id(p) for p in module.parameters()}
    foreign = [p for params in given for p in params if id(p) not in in_module]
    if foreign:
        raise ValueError(
            f"ShardedDataParallel: the optimizer holds {len(foreign)} tensor(s) that are not parameters of the "
            f"wrapped module (the first has shape {list(foreign[0].shape)}). Build it over the module's own "
            "parameters (net.parameters(), or param groups of them), before wrapping.")
    missing = [n for n, p in zip(names, trainable) if id(p) not in group_of_id]
    if missing:
        raise ValueError(
            f"ShardedDataParallel: the optimizer does not hold these trainable parameters: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}. Native DDP would leave them unchanged; a shard steps all its "
            "elements, so add them to a param group, or set requires_grad=False on them before wrapping.")
    return [group_of_id[id(p)] for p in trainable], given, spans, frozenset(whole)


class ShardOptimizer:
    """The optimizer over `shards`' pieces, for one ShardedDataParallel: binds it, tags and checks
    its per-rank state dicts, gathers and re-cuts its full state.

    `full_groups`: the user's groups' parameters (a factory: the module's), whose order numbers
    the full state; `param_names`: their names, which number DCP's full state instead."""

    def __init__(self, optimizer, shards: list, full_groups: list[list[nn.Parameter]], param_names: dict[int, str],
                 place: dict, extra_param: nn.Parameter | None = None, first_group: int = 0):
        self.shards = shards
        self.param_names = param_names  # id(parameter) -> its name in the plain module (DCP's keys)
        self.full_groups = full_groups  # this optimizer's groups: the shards number them from first_group on
        self.g0 = first_group
        self.place = {**place, "layout": _layout_fingerprint(shards)}
        pieces_of_group = [[piece for s in shards for piece, pg in zip(s.pieces, s.piece_group) if pg == g + self.g0]
                           for g in range(len(full_groups))]
        if isinstance(optimizer, torch.optim.Optimizer):
            held = optimizer.state_dict() if any(optimizer.state.values()) else None
            self.group_names = [g.get("param_names") for g in optimizer.param_groups]
            for g, group in enumerate(optimizer.param_groups):  # rebind: the user's object steps the shards
                group["params"] = list(pieces_of_group[g])
                if "param_names" in group:
                    group["param_names"] = [f"<shard {k} of group {g}>" for k in range(len(shards))]
            optimizer.state.clear()
            self.optimizer = optimizer
        else:
            held, self.group_names = None, [None]
            self.optimizer = optimizer(pieces_of_group[0])
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise TypeError(f"the optimizer factory returned {type(self.optimizer).__name__}, not a "
                                "torch.optim.Optimizer")
            check_elementwise(type(self.optimizer))
        if extra_param is not None:  # GradScaler's agreement (sharded_grad.py): in the last group
            last = self.optimizer.param_groups[-1]
            last["params"].append(extra_param)
            if "param_names" in last:
                last["param_names"].append("<found-inf agreement>")
        self.optimizer.register_state_dict_pre_hook(self._refuse_shard_state_dict)
        self.optimizer.register_load_state_dict_pre_hook(self._check_or_recut)
        # Where each piece stands in the optimizer's numbering of its parameters (group by group).
        self.index_of = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        if held is not None:  # a full state, re-cut (see _check_or_recut)
            try:
                self.optimizer.load_state_dict(held)
            except ValueError as e:
                raise ValueError(
                    f"ShardedDataParallel: the optimizer already holds state that does not fit its parameters ({e}). "
                    "Was it loaded before wrapping from a ShardedDataParallel optimizer's state_dict()? That is one "
                    "rank's shard; save model.full_optim_state_dict() instead, which loads here or natively.") from None

    # ------------------------------------------------------------------ per-rank state dicts

    @staticmethod
    def _refuse_shard_state_dict(optimizer) -> None:
        """optimizer.state_dict() is refused when it is called (rank 0 saving a snapshot), not when a
        plain optimizer fails to load the file much later with torch's "doesn't match the size of
        optimizer's group" (as ZeroRedundancyOptimizer refuses until consolidate_state_dict)."""
        raise RuntimeError(SHARD_STATE_DICT)

    def _check_or_recut(self, optimizer, state_dict: dict) -> dict:
        saved = state_dict.get(TAG)
        if saved is None:
            return self.shard_of_full(state_dict)
        if saved != self.place:  # a per-rank file an earlier minidist wrote, of another rank
            raise ValueError(
                f"optimizer.load_state_dict: this state is the shard of rank {saved.get('rank')} of "
                f"{saved.get('ranks')} under ShardedDataParallel(stage={saved.get('stage')}), but this optimizer is "
                f"the shard of rank {self.place['rank']} of {self.place['ranks']} (stage {self.place['stage']})"
                + ("" if saved.get("layout") == self.place["layout"] else ", with another layout") + ". "
                + SHARD_STATE_DICT)
        return {k: v for k, v in state_dict.items() if k != TAG}

    # ------------------------------------------------------------------ the sharded checkpoint

    def owned_state(self, copy: bool = True) -> tuple[dict, dict]:
        """For sharded_state_dict: this rank's per-element state as per-parameter pieces
        ({key: {name: [(start, values)]}}), and each shard's per-step scalars, one dict per group."""
        optim: dict[str, dict[str, list]] = {}
        scalars: dict[int, list[dict]] = {}
        for k, shard in enumerate(self.shards):
            pieces = self._pieces(shard)
            states = [self.optimizer.state.get(piece, {}) for piece in pieces]
            ours = {slot.name for slot, g in zip(shard.slots, shard.groups) if self._ours(g)}
            for key in _per_element_keys(states, pieces):
                for name, piece in shard.owned_pieces(_flat_state(shard, pieces, states, key, copy), copy).items():
                    if name in ours:
                        optim.setdefault(key, {}).setdefault(name, []).append(piece)
            scalars[k] = [self._scalars(shard, g) for g in range(len(self.full_groups))]
        return optim, scalars

    def _ours(self, g: int) -> bool:
        """Is the shards' group g one of this optimizer's? (A model may have several optimizers.)"""
        return self.g0 <= g < self.g0 + len(self.full_groups)

    def _pieces(self, shard) -> list[nn.Parameter]:
        """`shard`'s pieces this optimizer steps."""
        return [p for p, g in zip(shard.pieces, shard.piece_group) if self._ours(g)]

    def _scalars(self, shard, g: int) -> dict:
        """The per-step values (step) of group g's pieces in `shard`: the same for each of them."""
        for piece, pg in zip(shard.pieces, shard.piece_group):
            if pg == g + self.g0:
                return {key: v.clone() if torch.is_tensor(v) else v
                        for key, v in self.optimizer.state.get(piece, {}).items() if not _elementwise(v, piece)}
        return {}

    def load_owned_state(self, saved: list[dict]) -> None:
        """Load the optimizer part of sharded_state_dict()s (one, or every saved rank's: re-cut)."""
        first = saved[0]
        names = {slot.name for s in self.shards for slot, g in zip(s.slots, s.groups) if self._ours(g)}
        state: dict[int, dict] = {}
        for key in first["optim"]:
            pieces = merged_pieces(saved, "optim", key, names)
            if not any(pieces.values()):
                continue  # another optimizer's state (a model with several)
            for shard in self.shards:
                flat = torch.zeros(shard.shard_size, dtype=torch.float32)
                shard.fill_from_pieces(flat, pieces, only=names)
                for piece, (a, b) in zip(shard.pieces, shard.piece_bounds):
                    if id(piece) in self.index_of:
                        state.setdefault(self.index_of[id(piece)], {})[key] = flat[a:b].clone().view(piece.shape)
        saved_scalars = first["optim_scalars"]
        for k, shard in enumerate(self.shards):
            per_group = saved_scalars.get(k, saved_scalars.get(str(k)))
            if per_group is None:  # another shard count (stage 3's units vs buckets): any shard's, they agree
                per_group = next(iter(saved_scalars.values()), {})
            if isinstance(per_group, dict):  # written before param groups: one dict for the one group
                per_group = [per_group]
            for piece, g in zip(shard.pieces, shard.piece_group):
                if id(piece) in self.index_of:
                    state.setdefault(self.index_of[id(piece)], {}).update(per_group[min(g, len(per_group) - 1)])
        self.optimizer.load_state_dict(self.packed(state, first["param_groups"][self.g0:]))

    def packed(self, state: dict[int, dict], saved_groups: list[dict]) -> dict:
        """A state_dict of this optimizer's own layout, with the groups' options as saved."""
        groups, index = [], 0
        for g, group in enumerate(self.optimizer.param_groups):
            options = saved_groups[g] if g < len(saved_groups) else group
            n = len(group["params"])
            groups.append({**{k: v for k, v in options.items() if k not in ("params", "param_names")},
                           "params": list(range(index, index + n))})
            index += n
        return {"state": state, "param_groups": groups, TAG: dict(self.place)}

    # ------------------------------------------------------------------ the full state

    def full_state_dict(self, rank0_only: bool = False, rank: int = 0) -> dict:
        """The state of an unsharded optimizer of the same class over the user's parameters (its
        groups, their options, per-parameter tensors of the parameters' shapes). A collective over
        the shard group: every rank calls it. With rank0_only, ranks other than 0 get {}."""
        opt = self.optimizer
        values: dict[int, dict] = {}  # id(parameter) -> its full state
        # The per-element keys, agreed: under the whole layout a rank may hold none of a shard's pieces.
        here = set()
        for shard in self.shards:
            pieces = self._pieces(shard)
            here.update(_per_element_keys([opt.state.get(p, {}) for p in pieces], pieces))
        keys = sorted(set().union(*comm.all_gather_object(sorted(here), group=self.shards[0].group)))
        for shard in self.shards:
            pieces = self._pieces(shard)
            states = [opt.state.get(piece, {}) for piece in pieces]
            for key in keys:
                full = shard.gather_flat(_flat_state(shard, pieces, states, key))
                for slot, p, g in zip(shard.slots, shard.params, shard.groups):
                    if self._ours(g):
                        values.setdefault(id(p), {})[key] = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
            for slot, p, g in zip(shard.slots, shard.params, shard.groups):
                if self._ours(g):
                    values.setdefault(id(p), {}).update(self._scalars(shard, g - self.g0))
        if rank0_only and rank != 0:
            return {}
        state, groups, index = {}, [], 0
        for g, params in enumerate(self.full_groups):
            options = {k: v for k, v in opt.param_groups[g].items() if k not in ("params", "param_names")}
            ids = list(range(index, index + len(params)))
            for i, p in zip(ids, params):
                if id(p) in values:
                    state[i] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in values[id(p)].items()}
            group = {**options, "params": ids}
            if self.group_names[g] is not None:
                group["param_names"] = list(self.group_names[g])
            groups.append(group)
            index += len(params)
        return {"state": state, "param_groups": groups}

    def shard_of_full(self, full: dict) -> dict:
        """This rank's per-piece state dict, cut from a full one (no communication)."""
        if not (isinstance(full, dict) and isinstance(full.get("state"), dict)
                and isinstance(full.get("param_groups"), list)):
            raise ValueError("optimizer.load_state_dict: expected a dict with 'state' and 'param_groups' (a torch "
                             "optimizer's state_dict)")
        saved_groups = full["param_groups"]
        sizes = [len(g) for g in self.full_groups]
        if [len(g.get("params", ())) for g in saved_groups] != sizes:
            raise ValueError(
                f"optimizer.load_state_dict: the state holds groups of {[len(g.get('params', ())) for g in saved_groups]}"
                f" parameters, this optimizer's groups have {sizes}: it was saved by an optimizer over other "
                "parameters or param groups.")
        by_param: dict[int, dict] = {}
        for g, (params, saved) in enumerate(zip(self.full_groups, saved_groups)):
            if all(isinstance(i, str) for i in saved["params"]):  # DCP's full state: keyed by parameter name
                named = {self.param_names.get(id(p)): p for p in params}
                unknown = [i for i in saved["params"] if i not in named]
                if unknown:
                    raise ValueError(f"optimizer.load_state_dict: group {g} of the state names parameters this "
                                     f"optimizer's group {g} does not hold: {unknown[:3]}")
                pairs = [(named[i], i) for i in saved["params"]]
            else:
                pairs = list(zip(params, saved["params"]))
            for p, i in pairs:
                st = full["state"].get(i, full["state"].get(str(i)))
                if st:
                    by_param[id(p)] = st
        # Which keys hold one value per element (exp_avg), told by parameters with at least one
        # dimension; the others (step) are per-step scalars, also for a 0-dim parameter.
        per_element = {key for params in self.full_groups for p in params if p.dim() >= 1
                       for key, v in by_param.get(id(p), {}).items()
                       if torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape)}
        pieces_state: dict[int, dict] = {}
        for g, shard in [(g, shard) for g in range(len(self.full_groups)) for shard in self.shards]:
            members = [(slot, p) for slot, p, gi in zip(shard.slots, shard.params, shard.groups) if gi == g + self.g0]
            sources = [by_param[id(p)] for _, p in members if id(p) in by_param]
            if not (sources or any(id(p) in by_param for p in self.full_groups[g])):
                continue
            template = sources[0] if sources else next(by_param[id(p)] for p in self.full_groups[g] if id(p) in by_param)
            st = {}
            for key, value in template.items():
                if key in per_element:
                    st[key] = torch.zeros(shard.shard_size, dtype=value.dtype)
                    for slot, p in members:
                        self._cut_into(st[key], shard, slot, by_param.get(id(p), {}).get(key), key)
                else:
                    st[key] = value
            for piece, (a, b), pg in zip(shard.pieces, shard.piece_bounds, shard.piece_group):
                if pg == g + self.g0 and st:
                    pieces_state[self.index_of[id(piece)]] = {
                        key: v[a:b].clone().view(piece.shape) if key in per_element else
                        v.clone() if torch.is_tensor(v) else v for key, v in st.items()}
        packed = self.packed(pieces_state, saved_groups)
        del packed[TAG]  # what the pre-hook returns goes straight to torch
        return packed

    @staticmethod
    def _cut_into(flat: torch.Tensor, shard, slot, value, key: str) -> None:
        """Copy this rank's part of one parameter's full state `value` into the shard-sized `flat`."""
        if value is None:
            return
        if tuple(value.shape) != slot.shape:
            raise ValueError(f"optimizer.load_state_dict: state {key!r} of parameter {slot.name!r} has shape "
                             f"{list(value.shape)}, the parameter has {list(slot.shape)}")
        lo, hi = max(slot.offset, shard.lo), min(slot.offset + slot.numel, shard.hi)
        if lo < hi:
            flat[lo - shard.lo:hi - shard.lo].copy_(value.detach().reshape(-1)[lo - slot.offset:hi - slot.offset])


def _elementwise(value, piece: torch.Tensor) -> bool:
    """A per-element state of `piece` (exp_avg, momentum_buffer), not a per-step scalar (step)."""
    return torch.is_tensor(value) and value.dim() >= 1 and value.shape == piece.shape


def _per_element_keys(states: list[dict], pieces: list[torch.Tensor]) -> list[str]:
    """The per-element state keys of one shard's pieces, in an order every rank shares."""
    return sorted({k for st, piece in zip(states, pieces) for k, v in st.items() if _elementwise(v, piece)})


def _flat_state(shard, pieces: list[torch.Tensor], states: list[dict], key: str, copy: bool = True) -> torch.Tensor:
    """One shard-sized tensor of state `key`, from the pieces that hold it (zeros elsewhere);
    `copy=False`: the state itself where one piece covers the shard (one group)."""
    if not copy and len(pieces) == 1 and key in states[0] and shard.piece_bounds == [(0, shard.master.numel())]:
        return states[0][key].view(-1)
    dtype = next((st[key].dtype for st in states if key in st), shard.master.dtype)
    flat = torch.zeros_like(shard.master, dtype=dtype)
    bounds = dict(zip(map(id, shard.pieces), shard.piece_bounds))
    for piece, st in zip(pieces, states):
        if key in st:
            a, b = bounds[id(piece)]
            flat[a:b].copy_(st[key].reshape(-1))
    return flat


def _layout_fingerprint(shards: list) -> str:
    """What must be equal for one rank's per-piece state to fit another optimizer."""
    desc = [(s.world_size, s.padded, s.piece_bounds, [(slot.name, slot.offset) for slot in s.slots]) for s in shards]
    return hashlib.sha256(repr(desc).encode()).hexdigest()[:16]


def plain_module(module: nn.Module) -> nn.Module:
    """The module itself, or the original module inside a torch.compile wrapper."""
    return getattr(module, "_orig_mod", module)


class ModuleStateHooks:
    """Installs the state_dict / load_state_dict hooks for one ShardedDataParallel `wrapper`."""

    def __init__(self, wrapper):
        self.wrapper = wrapper
        target = plain_module(wrapper.module)
        # Parameter names as the plain module spells them (without torch.compile's "_orig_mod.").
        strip = "_orig_mod." if target is not wrapper.module else ""
        self._slot_keys = {slot.name: slot.name.removeprefix(strip) for s in wrapper._shards for slot in s.slots}
        target.register_state_dict_pre_hook(self._before_state_dict)
        target.register_load_state_dict_pre_hook(self._before_load)
        target.register_load_state_dict_post_hook(self._after_load)

    def _before_state_dict(self, module, prefix, keep_vars) -> None:
        w = self.wrapper
        if w.stage < 3 and getattr(w, "param_wire", None) is not None and not keep_vars:
            raise RuntimeError(
                f"ShardedDataParallel(stage={w.stage}, param_wire={w.param_wire.name!r}): state_dict() would return "
                "the weights as the wire delivered them (rounded), not the fp32 master shards the optimizer steps: "
                "a checkpoint of it would resume from rounded values. Use model.full_state_dict() on every rank "
                "(a collective; rank0_only=True keeps the result on rank 0) or model.sharded_state_dict() (per "
                "rank, no communication).")
        if w.stage < 3:
            w.wait_for_parameters()
        elif not keep_vars:
            raise RuntimeError(
                "ShardedDataParallel(stage=3): state_dict() has no values to return, since each rank holds "
                "only its shard of the parameters. Use full = model.full_state_dict() on every rank (a "
                "collective; rank0_only=True keeps the result on rank 0 only), then torch.save it on rank 0; its "
                "keys are the plain module's (no 'module.' prefix), so load it with "
                "model.module.load_state_dict(full) (every rank keeps its slice) or into the bare model. Or "
                "model.sharded_state_dict() for a per-rank checkpoint without communication "
                "(load_sharded_state_dict reloads it at any world size).")

    def _before_load(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                     error_msgs) -> None:
        w = self.wrapper
        w.wait_for_parameters()
        with torch.no_grad():
            for shard in w._shards:
                self._load_master_slice(shard, state_dict, prefix)
                if w.stage == 3 and not shard.is_materialised:
                    # Room for torch's own copy into the parameters; freed again after the load.
                    shard.full.untyped_storage().resize_(shard.padded * shard.full.element_size())

    def _after_load(self, module, incompatible_keys) -> None:
        if self.wrapper.stage == 3:
            for shard in self.wrapper._shards:
                shard.free_full()

    def _load_master_slice(self, shard, state_dict: dict, prefix: str) -> None:
        """Write the loaded values of this rank's slice into the fp32 master shard."""
        for slot in shard.slots:
            value = state_dict.get(prefix + self._slot_keys[slot.name])
            if not torch.is_tensor(value) or tuple(value.shape) != slot.shape:
                continue  # missing or mismatched: torch's own load reports it
            a, b = max(slot.offset, shard.lo), min(slot.offset + slot.numel, shard.hi)
            if a < b:
                piece = value.detach().reshape(-1)[a - slot.offset:b - slot.offset]
                shard.master.data[a - shard.lo:b - shard.lo].copy_(piece)
