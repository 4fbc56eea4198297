"""Training runs shared by the DataParallel tests: ours vs native DDP vs one process on the full batch.

Every rank builds the same model (seed 0), then ranks > 0 perturb their copy so
the wrappers' broadcast-from-rank-0 is exercised. Each step draws one global
batch (seeded by the step); rank r trains on slice r of it, the single-process
reference on all of it. Losses are means over equal-sized per-rank batches, so
the average of per-rank gradients equals the full-batch gradient.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import minidist
from minidist.train.models import GPT, MLP


class ConvNet(nn.Module):
    """conv-BN-ReLU x2, pool, linear: small, but with BatchNorm buffers."""

    def __init__(self, channels: int = 3, classes: int = 10, width: int = 8):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        self.fc = nn.Linear(8 * width, classes)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


PER_RANK_BATCH = 4


class MLPWithUnused(nn.Module):
    """An MLP with a layer forward never touches."""

    def __init__(self):
        super().__init__()
        self.used = MLP((16, 32, 8))
        self.unused = nn.Linear(16, 16)

    def forward(self, x):
        return self.used(x)


def build(model: str) -> nn.Module:
    torch.manual_seed(0)
    if model == "mlp":
        return MLP((16, 32, 32, 8))
    if model == "gpt":
        return GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    if model == "cnn":
        return ConvNet(channels=3, classes=8, width=4)
    if model == "unused":
        return MLPWithUnused()
    raise ValueError(model)


def global_batch(model: str, step: int, micro: int, n: int):
    g = torch.Generator().manual_seed(1000 * step + micro)
    rows = n * PER_RANK_BATCH
    if model == "gpt":
        x = torch.randint(0, 64, (rows, 16), generator=g)
        return x, torch.roll(x, -1, dims=1)
    if model == "cnn":
        return torch.randn(rows, 3, 8, 8, generator=g), torch.randint(0, 8, (rows,), generator=g)
    return torch.randn(rows, 16, generator=g), torch.randint(0, 8, (rows,), generator=g)


def loss_fn(model: str, out, y):
    return GPT.loss(out, y) if model == "gpt" else F.cross_entropy(out, y)


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        # eps=1e-6, not 1e-8: at step 1 Adam's update is g/(|g|+eps), so with a tiny eps a
        # near-zero gradient's rounding noise becomes a full +-lr step. With eps=1e-8 native
        # DDP itself ends ~1e-4 (relative) away from the single process on the GPT case.
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)
    raise ValueError(name)


def step_loop(forward, no_sync, step_fn, model: str, steps: int, accumulate: int, rank: int | None, n: int):
    """`steps` optimizer steps of `accumulate` micro-batches; rank=None: the full batch, one process.
    Every micro-batch but the last runs inside no_sync() (when given)."""
    for step in range(steps):
        for micro in range(accumulate):
            x, y = global_batch(model, step, micro, n)
            if rank is not None:
                x, y = x[rank * PER_RANK_BATCH:(rank + 1) * PER_RANK_BATCH], y[rank * PER_RANK_BATCH:(rank + 1) * PER_RANK_BATCH]
            last = micro == accumulate - 1
            with (no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()):
                (loss_fn(model, forward(x), y) / accumulate).backward()
        step_fn()


def train(wrapper, inner: nn.Module, model: str, optim: str, steps: int, accumulate: int,
          rank: int | None, n: int, no_sync=None):
    """Train `wrapper` (whose parameters live in `inner`) with `optim`; return inner's state_dict."""
    opt = make_optimizer(optim, inner.parameters())

    def step():
        opt.step()
        opt.zero_grad()
    step_loop(wrapper, no_sync, step, model, steps, accumulate, rank, n)
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def perturbed(base: nn.Module, rank: int) -> nn.Module:
    m = copy.deepcopy(base)
    if rank > 0:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    return m


def max_rel_diff(a: dict, b: dict) -> tuple[float, str]:
    """Worst |a - b| / (|b| + scale) over floating tensors, scale = the largest |b| in the model.

    So "within r" means |a - b| <= r * (|b| + scale) element-wise: relative for large
    elements, with an absolute floor for elements near zero (zero-initialised biases
    after a few small steps), whose plain relative error says nothing about the model.
    """
    floats = [k for k in b if b[k].is_floating_point()]
    scale = max(b[k].double().abs().max().item() for k in floats)
    worst, where = 0.0, ""
    for k in floats:
        ratio = ((a[k].double() - b[k].double()).abs() / (b[k].double().abs() + scale)).max().item()
        if ratio > worst:
            worst, where = ratio, k
    return worst, where


def compare_with_native(model="mlp", optim="sgd", steps=10, accumulate=1, bucket_cap_mb=25.0,
                        gradient_as_bucket_view=False, find_unused=False, single=True,
                        comm_hook=None, grad_wire=None):
    """One rank's part: returns how far ours is from native DDP and from the single process."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = dist.get_rank(), dist.get_world_size()
    base = build(model)

    native_inner = perturbed(base, rank)
    native = DDP(native_inner, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view,
                 find_unused_parameters=find_unused)
    native_sd = train(native, native_inner, model, optim, steps, accumulate, rank, n, native.no_sync)

    ours_inner = perturbed(base, rank)
    ours = minidist.DataParallel(ours_inner, bucket_cap_mb=bucket_cap_mb,
                                 gradient_as_bucket_view=gradient_as_bucket_view,
                                 find_unused_parameters=find_unused, comm_hook=comm_hook, grad_wire=grad_wire)
    ours_sd = train(ours, ours_inner, model, optim, steps, accumulate, rank, n, ours.no_sync)

    result = {
        "bitwise_native": all(torch.equal(ours_sd[k], native_sd[k]) for k in native_sd),
        "rel_native": max_rel_diff(ours_sd, native_sd),
        "buckets": len(ours._buckets),
    }
    if single:
        ref_inner = copy.deepcopy(base)
        ref_sd = train(ref_inner, ref_inner, model, optim, steps, accumulate, None, n)
        result["rel_single"] = max_rel_diff(ours_sd, ref_sd)
    # every rank must hold the same parameters
    # every rank must hold the same parameters (buffers such as BatchNorm statistics are
    # only re-synchronised at the next forward, as in native DDP)
    params = {k: v for k, v in ours_sd.items() if k in dict(ours_inner.named_parameters())}
    everyone = minidist.comm.all_gather_object(params)
    result["ranks_agree"] = all(torch.equal(everyone[0][k], sd[k]) for sd in everyone for k in sd)
    return result


def gradient_excess_over_rounding(model: str = "mlp") -> tuple[float, str]:
    """One backward on this rank's batch through native DDP and through ours: the worst ratio,
    over every gradient element, of |ours - native| to what rounding allows them to differ by.

    The averaged gradient is (g_1 + ... + g_n) / n of the ranks' local gradients g_i. Summed in
    any order, divided before or after, each of the two is within u * sum_i |g_i| of the exact
    value (u = 2**-24, fp32's unit roundoff), so they differ by at most 2u * sum_i |g_i|: a ratio
    above 1 is an error, not rounding. A scale error of 1e-6 in the averaging exceeds it wherever
    the ranks' gradients do not largely cancel (the parameter comparisons, after the optimizer,
    cannot see it: Adam's update is almost scale-free, and SGD's is a small part of the weight)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = dist.get_rank(), dist.get_world_size()
    base = build(model)
    x, y = global_batch(model, 0, 0, n)
    x, y = x[rank * PER_RANK_BATCH:(rank + 1) * PER_RANK_BATCH], y[rank * PER_RANK_BATCH:(rank + 1) * PER_RANK_BATCH]

    native_inner = perturbed(base, rank)
    native = DDP(native_inner)  # rank 0's weights, broadcast
    local = copy.deepcopy(native_inner)
    ours_inner = copy.deepcopy(native_inner)
    ours = minidist.DataParallel(ours_inner)
    for net in (native, ours, local):
        loss_fn(model, net(x), y).backward()
    u = 2.0 ** -24
    worst, where = 0.0, ""
    for (name, p_native), p_ours, p_local in zip(native_inner.named_parameters(), ours_inner.parameters(),
                                                 local.parameters()):
        abs_sum = p_local.grad.detach().abs().double()
        dist.all_reduce(abs_sum)
        allowed = 2 * u * abs_sum + 1e-45  # a gradient that is exactly 0 everywhere must be 0 in both
        ratio = ((p_ours.grad.double() - p_native.grad.double()).abs() / allowed).max().item()
        if ratio > worst:
            worst, where = ratio, name
    return worst, where
