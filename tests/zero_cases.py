"""Training runs shared by the ShardedDataParallel tests: ours vs native references.

Same set-up as ddp_cases: identical model on every rank (ranks > 0 perturbed, so the
broadcast from rank 0 is exercised), one global batch per step, rank r trains on
slice r. The reference is native DDP with the same optimizer over the ordinary
parameters (and torch.nn.utils.clip_grad_norm_), or ZeroRedundancyOptimizer, or
fully_shard; plus one process on the full batch.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.distributed as dist

import minidist
from ddp_cases import PER_RANK_BATCH, build, global_batch, loss_fn, max_rel_diff, perturbed, step_loop

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1, eps=1e-6),
}


def run_reference(kind, base, model_name, optim, steps, accumulate, clip, rank, n):
    """Native DDP / ZeroRedundancyOptimizer / fully_shard / single process; returns a full state_dict."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    net = perturbed(base, rank) if rank is not None else copy.deepcopy(base)
    if kind == "single":
        model, ctx = net, contextlib.nullcontext
        opt = OPTIMIZERS[optim](net.parameters())
    elif kind == "ddp":
        model = DDP(net)
        ctx, opt = model.no_sync, OPTIMIZERS[optim](net.parameters())
    elif kind == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        model = DDP(net)
        ctx = model.no_sync
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=OPTIMIZERS[optim].func,
                                      **OPTIMIZERS[optim].keywords)
    elif kind == "fully_shard":
        from torch.distributed.fsdp import fully_shard
        with torch.no_grad():  # fully_shard does not broadcast: start from rank 0's weights
            for p in net.parameters():
                dist.broadcast(p, src=0)
        for block in getattr(net, "blocks", []):
            fully_shard(block)
        fully_shard(net)
        model = net
        ctx = contextlib.nullcontext if accumulate == 1 else (lambda: _fsdp_no_sync(net))
        opt = OPTIMIZERS[optim](net.parameters())
    else:
        raise ValueError(kind)

    def step():
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
    step_loop(model, ctx, step, model_name, steps, accumulate, rank, n)
    if kind == "fully_shard":
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in net.state_dict().items()}
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@contextlib.contextmanager
def _fsdp_no_sync(net):
    net.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        net.set_requires_gradient_sync(True)


def run_ours(base, model_name, optim, steps, accumulate, clip, stage, rank, n, **kwargs):
    net = perturbed(base, rank)
    model = minidist.ShardedDataParallel(net, OPTIMIZERS[optim], stage=stage, **kwargs)

    def step():
        if clip:
            model.clip_grad_norm_(clip)
        model.optimizer.step()
        model.optimizer.zero_grad()
    step_loop(model, model.no_sync, step, model_name, steps, accumulate, rank, n)
    return model, model.full_state_dict()


def compare_zero(stage=2, model="mlp", optim="adamw", steps=10, accumulate=1, clip=None,
                 references=("ddp", "single"), **kwargs):
    rank, n = dist.get_rank(), dist.get_world_size()
    base = build(model)
    _, ours = run_ours(base, model, optim, steps, accumulate, clip, stage, rank, n, **kwargs)
    out = {}
    for ref in references:
        sd = run_reference(ref, base, model, optim, steps, accumulate, clip, None if ref == "single" else rank, n)
        out[ref] = max_rel_diff(ours, sd)
    everyone = minidist.comm.all_gather_object(ours)
    out["ranks_agree"] = all(torch.equal(everyone[0][k], sd[k]) for sd in everyone for k in sd)
    out["keys_match"] = list(ours) == list(base.state_dict())
    return out


# --------------------------------------------------------------------------- resharding

GLOBAL_BATCH = 16  # divisible by 1, 2 and 4 ranks: the same global batch at every world size


def train_global(model, optimizer, steps: range, model_name="gpt"):
    rank, n = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // n
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=g)
        y = torch.roll(x, -1, dims=1)
        loss_fn(model_name, model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        model.clip_grad_norm_(0.5)
        optimizer.step()
        optimizer.zero_grad()


def make_sharded(stage: int):
    kwargs = {"min_unit_params": 1000} if stage == 3 else {"bucket_cap_mb": 0.02}
    model = minidist.ShardedDataParallel(build("gpt"), OPTIMIZERS["adamw"], stage=stage, **kwargs)
    # an LR scheduler on the real optimizer: its effect must survive the checkpoint
    scheduler = torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=3, gamma=0.5)
    return model, scheduler


def save_then_continue(stage: int):
    """At the saving world size: 10 steps, save, then 5 more steps (the reference)."""
    model, scheduler = make_sharded(stage)
    for s in range(10):
        train_global(model, model.optimizer, range(s, s + 1))
        scheduler.step()
    saved = model.sharded_state_dict()
    at_save = model.full_state_dict(), model.full_optim_state_dict()  # what any world size must load back
    train_global(model, model.optimizer, range(10, 15))
    return saved, model.full_state_dict(), at_save


def load_and_continue(stage: int, saved: list):
    """Load the 4-rank shards at this world size; the state as loaded (re-cut: the same bytes,
    to be compared bitwise), then the state after 5 more steps."""
    model, _ = make_sharded(stage)
    model.load_sharded_state_dict(saved)
    loaded = model.full_state_dict(), model.full_optim_state_dict()
    train_global(model, model.optimizer, range(10, 15))
    return model.full_state_dict(), model.optimizer.param_groups[0]["lr"], loaded


def reduced_gradient_mismatches(model_name: str, stage: int, collectives: str) -> list[str]:
    """One backward through ShardedDataParallel on this rank's batch; the shards (buckets or
    units) whose reduced gradient is not, bitwise, what the test computes itself from every
    rank's local gradient: each scaled by 1/n as the wrapper does, then summed in the order
    `collectives` names: the ring's stated order (ring_order.py, written without minidist.comm),
    or torch.distributed.reduce_scatter_tensor called here on the same layout (backend)."""
    from ring_order import ring_order_sum

    rank, n = dist.get_rank(), dist.get_world_size()
    base = build(model_name)
    x, y = global_batch(model_name, 0, 0, n)
    x, y = x[rank * PER_RANK_BATCH:(rank + 1) * PER_RANK_BATCH], y[rank * PER_RANK_BATCH:(rank + 1) * PER_RANK_BATCH]
    local = copy.deepcopy(base)  # rank 0's weights: what the wrapper broadcasts
    loss_fn(model_name, local(x), y).backward()
    local_grads = {name: p.grad for name, p in local.named_parameters()}

    model = minidist.ShardedDataParallel(perturbed(base, rank), OPTIMIZERS["sgd"], stage=stage, collectives=collectives)
    loss_fn(model_name, model(x), y).backward()
    wrong = []
    for k, shard in enumerate(model._shards):
        flat = torch.zeros(shard.padded)  # this rank's contribution, laid out as the shard is
        for slot in shard.slots:
            torch.mul(local_grads[slot.name].reshape(-1), 1.0 / n, out=flat[slot.offset:slot.offset + slot.numel])
        if collectives == "ring":
            everyone = [torch.empty_like(flat) for _ in range(n)]
            dist.all_gather(everyone, flat)  # copies: no arithmetic
            size = shard.shard_size
            want = ring_order_sum([f[rank * size:(rank + 1) * size] for f in everyone], rank, n)
        else:
            want = torch.empty(shard.shard_size)
            dist.reduce_scatter_tensor(want, flat)
        got = torch.cat([p.grad for p in shard.pieces])
        if not torch.equal(got, want):
            wrong.append(f"shard {k}: {(got != want).sum().item()} of {want.numel()} elements differ")
    return wrong
