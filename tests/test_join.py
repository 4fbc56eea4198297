"""Uneven inputs: minidist.Join against native DDP under torch's Join, shard lengths differing by rank.

Rank r trains on 3 + 2r batches of its own (uneven shards), with SGD + momentum. Without
Join the rank that finishes first would leave the others waiting in an all_reduce until the
timeout; under Join every rank ends, and each rank's whole state_dict (parameters and
BatchNorm buffers) equals what native DDP under torch.distributed.algorithms.join.Join
leaves on that rank. Under ShardedDataParallel (stages 1-3) the ranks that left keep
stepping their shards, so every rank ends with what native DDP's longest-training rank ends with.
"""

import contextlib

import pytest
import torch

from ddp_cases import PER_RANK_BATCH, build, global_batch, loss_fn, make_optimizer, max_rel_diff, perturbed


def accumulating(wrapped, wrapper_name: str, step: int, sync: bool):
    """Native: no_sync() for every micro-batch but a step's last. Ours: the same at even steps, and
    nanoGPT's `model.require_backward_grad_sync = sync` at odd ones (the two spellings, one switch)."""
    if sync:
        return contextlib.nullcontext()
    if wrapper_name == "ours" and step % 2:
        wrapped.require_backward_grad_sync = False
        return _sync_after(wrapped)
    return wrapped.no_sync()


@contextlib.contextmanager
def _sync_after(wrapped):
    yield
    wrapped.require_backward_grad_sync = True


def uneven_run(wrapper_name: str, model: str, accumulate: int):
    import torch.distributed as dist

    import minidist

    rank, n = dist.get_rank(), dist.get_world_size()
    net = perturbed(build(model), rank)
    if wrapper_name == "ours":
        wrapped = minidist.DataParallel(net, bucket_cap_mb=0.001)  # several buckets
        join = minidist.Join(wrapped)
    else:
        from torch.distributed.algorithms.join import Join as TorchJoin
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(net, bucket_cap_mb=0.001)
        join = TorchJoin([wrapped])
    opt = make_optimizer("sgd", net.parameters())
    steps = 3 + 2 * rank
    with join:
        for step in range(steps):
            for micro in range(accumulate):
                x, y = global_batch(model, 100 * rank + step, micro, n)
                x, y = x[:PER_RANK_BATCH], y[:PER_RANK_BATCH]
                with accumulating(wrapped, wrapper_name, step, sync=micro == accumulate - 1):
                    (loss_fn(model, wrapped(x), y) / accumulate).backward()
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def ours_and_native(model: str, accumulate: int):
    return uneven_run("ours", model, accumulate), uneven_run("native", model, accumulate)


@pytest.mark.parametrize("world, model, accumulate", [(2, "mlp", 1), (3, "mlp", 2), (2, "cnn", 1), (3, "cnn", 1)])
def test_uneven_shards_end_like_native_join(ranks, world, model, accumulate):
    out = ranks(world).run(ours_and_native, model, accumulate, timeout_s=120)
    for rank, (ours, native) in enumerate(out):
        assert list(ours) == list(native)
        worst, where = max_rel_diff(ours, native)
        assert worst <= 1e-6, f"rank {rank}: {where} differs by {worst:.2e}"
    # and every rank ends with the same model (no drift on the ranks that stopped early)
    for rank in range(1, world):
        for key, value in out[0][0].items():
            assert torch.equal(out[rank][0][key], value), f"rank {rank}: {key}"


# --------------------------------------------------------------------------- ShardedDataParallel

def sharded_uneven_run(wrapper_name: str, model: str, accumulate: int, clip: float | None, stage: int = 0,
                       mesh=None):
    """Rank r trains 3 + 2r steps; SGD + momentum, a StepLR schedule and optional clipping.
    Returns the final full state_dict (ours: every rank; native DDP: that rank's own)."""
    import torch.distributed as dist

    import minidist

    rank, n = dist.get_rank(), dist.get_world_size()
    net = perturbed(build(model), rank)
    if wrapper_name == "ours":
        kwargs = {"min_unit_params": 50} if stage == 3 else {"bucket_cap_mb": 0.001}  # several units / buckets
        wrapped = minidist.ShardedDataParallel(net, lambda ps: make_optimizer("sgd", ps), stage=stage, mesh=mesh,
                                               **kwargs)
        opt, join = wrapped.optimizer, minidist.Join(wrapped)
        clip_fn = wrapped.clip_grad_norm_
    else:
        from torch.distributed.algorithms.join import Join as TorchJoin
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(net, bucket_cap_mb=0.001)
        opt, join = make_optimizer("sgd", net.parameters()), TorchJoin([wrapped])
        clip_fn = lambda c: torch.nn.utils.clip_grad_norm_(net.parameters(), c)  # noqa: E731
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with join:
        for step in range(3 + 2 * rank):
            for micro in range(accumulate):
                x, y = global_batch(model, 100 * rank + step, micro, n)
                x, y = x[:PER_RANK_BATCH], y[:PER_RANK_BATCH]
                with accumulating(wrapped, wrapper_name, step, sync=micro == accumulate - 1):
                    (loss_fn(model, wrapped(x), y) / accumulate).backward()
            if clip:
                clip_fn(clip)
            opt.step()
            scheduler.step()
            opt.zero_grad()
    state = wrapped.full_state_dict() if wrapper_name == "ours" else net.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def sharded_and_native(model: str, accumulate: int, clip: float | None, mesh_shape=None):
    import minidist

    native = sharded_uneven_run("native", model, accumulate, clip)
    mesh = minidist.init_mesh(*mesh_shape, env={}) if mesh_shape else None  # hybrid sharding: Join spans the world
    return native, {stage: sharded_uneven_run("ours", model, accumulate, clip, stage, mesh) for stage in (1, 2, 3)}


@pytest.mark.parametrize("world, model, accumulate, clip, mesh_shape", [
    (2, "mlp", 1, None, None), (3, "mlp", 2, 0.5, None), (2, "cnn", 1, 0.5, None), (3, "cnn", 1, None, None),
    (4, "mlp", 1, 0.5, (2, 2)),  # on a 2x2 mesh (hybrid sharding)
])
def test_sharded_uneven_shards_end_like_the_longest_native_rank(ranks, world, model, accumulate, clip, mesh_shape):
    """Under ZeRO every rank ends with the model native DDP's longest-training rank ends with:
    the ranks that left kept stepping their shards with the others' gradients (no drift)."""
    out = ranks(world).run(sharded_and_native, model, accumulate, clip, mesh_shape, timeout_s=180)
    longest_native = out[-1][0]  # the highest rank trained longest: its state is the true one
    for stage in (1, 2, 3):
        for rank, (_, ours) in enumerate(out):
            assert list(ours[stage]) == list(longest_native)
            worst, where = max_rel_diff(ours[stage], longest_native)
            assert worst <= 1e-6, f"stage {stage}, rank {rank}: {where} differs by {worst:.2e}"
            for key, value in out[0][1][stage].items():
                assert torch.equal(ours[stage][key], value), f"stage {stage}, rank {rank} differs from rank 0: {key}"


def rank_without_batches(stage: int):
    """Rank 0 has no batch at all: it cannot mirror the others, and every rank says so."""
    import torch.distributed as dist

    import minidist

    rank = dist.get_rank()
    model = minidist.ShardedDataParallel(build("mlp"), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=stage)
    try:
        with minidist.Join(model):
            for step in range(2 * rank):
                x, y = global_batch("mlp", step, 0, 2)
                loss_fn("mlp", model(x[:PER_RANK_BATCH]), y[:PER_RANK_BATCH]).backward()
                model.optimizer.step()
                model.optimizer.zero_grad()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_sharded_rank_without_any_batch_raises_everywhere(ranks):
    messages = ranks(2).run(rank_without_batches, 3, timeout_s=60)
    for message in messages:
        assert "rank 0 left its loop without running a forward" in message, message


def not_a_model():
    import minidist

    try:
        minidist.Join(torch.nn.Linear(2, 2))
    except TypeError as e:
        return str(e)
    return "accepted"


def test_join_refuses_a_plain_module(ranks):
    message = ranks(2).run(not_a_model, timeout_s=60)[0]
    assert "takes a minidist.DataParallel or ShardedDataParallel, not Linear" in message
