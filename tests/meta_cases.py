"""Rank functions of tests/test_meta_init.py: models built on the meta device, wrapped at stage 3."""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import minidist


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.out(torch.relu(self.fc(self.norm(x))))


class Net(nn.Module):
    """Built-in layers only (each has reset_parameters); the head tied to the embedding."""

    def __init__(self, vocab: int = 64, d: int = 64, n_blocks: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class Scaled(nn.Module):
    """A parameter and a buffer of its own, and no reset_parameters: init_fn gives them values."""

    def __init__(self, d: int):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(d))
        self.register_buffer("offset", torch.empty(d))
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(x) * self.gain + self.offset


class Tangled(nn.Module):
    """A parameter of its own and a reset_parameters that writes its submodule's too (meta_init refuses it)."""

    def __init__(self, d: int):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(d))
        self.lin = nn.Linear(d, d)

    def reset_parameters(self):
        nn.init.ones_(self.scale)
        nn.init.zeros_(self.lin.weight)

    def forward(self, x):
        return self.lin(x) * self.scale


def init_scaled(m: nn.Module) -> None:
    if isinstance(m, Scaled):
        nn.init.normal_(m.gain)
        nn.init.uniform_(m.offset)
    elif isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(m.bias)


class PeakBytes(TorchDispatchMode):
    """The most CPU tensor bytes alive at once among the storages made while it is active, read
    after every operation (a storage's current size: a freed unit's resized-to-0 storage counts 0)."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, weakref.ref] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                s = t.untyped_storage()
                ref = self.refs.get(id(s))
                if ref is None or ref() is not s:
                    self.refs[id(s)] = weakref.ref(s)
        live = sum(s.nbytes() for s in (r() for r in self.refs.values()) if s is not None)
        self.peak = max(self.peak, live)
        return out


def reference(build, seed: int, init=None) -> tuple[dict, torch.Tensor]:
    """Materialise the whole model and initialise it module by module (what stage 3 must equal);
    and the next random numbers the generator gives after it."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        net = build()
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # in place: the tied head stays tied
    try:
        net.to_empty(device="cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    with torch.no_grad():
        for m in net.modules():
            if next(m.parameters(recurse=False), None) is None and next(m.buffers(recurse=False), None) is None:
                continue  # containers
            (init or type(m).reset_parameters)(m)
    return {k: v.clone() for k, v in net.state_dict().items()}, torch.rand(4)


def wrap_meta_built(mesh_shape=None) -> dict:
    """Every rank seeds differently (rank 0's generator is everyone's, as rank 0's values are for a
    built model); the wrapped model's full state, the generator after it, the peak while wrapping."""
    mesh = minidist.init_mesh(*mesh_shape, env={}) if mesh_shape else None
    optim = functools.partial(torch.optim.AdamW, lr=1e-3)
    torch.manual_seed(7 + dist.get_rank())
    with torch.device("meta"):
        net = Net()
    with PeakBytes() as peak:
        model = minidist.ShardedDataParallel(net, optim, stage=3, mesh=mesh)
    after = torch.rand(4)
    state = model.full_state_dict()
    units = [u.shard for u in model._units]
    expected, expected_after = reference(Net, 7)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(idx).float().pow(2).mean().backward()  # it trains: every unit gathers and reduces
    model.optimizer.step()
    return {"same": all(torch.equal(state[k], expected[k]) for k in expected) and state.keys() == expected.keys(),
            "after_same": torch.equal(after, expected_after), "peak": peak.peak,
            "shards": sum(s.shard_size * 4 for s in units), "largest_unit": max(s.padded * 4 for s in units),
            "model": sum(p.numel() * 4 for p in Net().parameters())}


def init_fn_and_refusals() -> dict:
    out = {}
    optim = functools.partial(torch.optim.SGD, lr=0.1)
    build = lambda: nn.Sequential(Scaled(16), nn.Linear(16, 16), Scaled(16))  # noqa: E731
    torch.manual_seed(3)
    with torch.device("meta"):
        net = build()
    model = minidist.ShardedDataParallel(net, optim, stage=3, init_fn=init_scaled, min_unit_params=1)
    state = model.full_state_dict()
    expected, _ = reference(build, 3, init_scaled)
    out["init_fn_same"] = state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)
    out["to_empty"] = model.to_empty(device="cpu") is model
    out["reset"] = _error(model.reset_parameters)

    def meta(b):
        with torch.device("meta"):
            return b()
    out["no_reset"] = _error(lambda: minidist.ShardedDataParallel(meta(build), optim, stage=3))
    out["tangled"] = _error(lambda: minidist.ShardedDataParallel(meta(lambda: Tangled(8)), optim, stage=3))
    out["stage2"] = _error(lambda: minidist.ShardedDataParallel(meta(Net), optim, stage=2))
    out["ddp"] = _error(lambda: minidist.DataParallel(meta(Net)))
    out["init_fn_built"] = _error(lambda: minidist.ShardedDataParallel(Net(), optim, stage=3, init_fn=init_scaled))
    out["init_fn_stage2"] = _error(lambda: minidist.ShardedDataParallel(Net(), optim, stage=2, init_fn=init_scaled))
    return out


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
