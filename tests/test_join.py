"""Uneven inputs: minidist.Join against native DDP under torch's Join, shard lengths differing by rank.

Rank r trains on 3 + 2r batches of its own (uneven shards), with SGD + momentum. Without
Join the rank that finishes first would leave the others waiting in an all_reduce until the
timeout; under Join every rank ends, and each rank's whole state_dict (parameters and
BatchNorm buffers) equals what native DDP under torch.distributed.algorithms.join.Join
leaves on that rank.
"""

import pytest
import torch

from ddp_cases import PER_RANK_BATCH, build, global_batch, loss_fn, make_optimizer, max_rel_diff, perturbed


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
                sync = micro == accumulate - 1
                ctx = wrapped.no_sync() if not sync else torch.enable_grad()
                with ctx:
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


def joined_without_join():
    """A ShardedDataParallel under Join: refused with the reason, not a hang later."""
    import minidist

    net = build("mlp")
    model = minidist.ShardedDataParallel(net, torch.optim.SGD, stage=2)
    try:
        minidist.Join(model)
    except TypeError as e:
        return str(e)
    return "accepted"


def test_sharded_models_are_refused_clearly(ranks):
    message = ranks(2).run(joined_without_join, timeout_s=60)[0]
    assert "ShardedDataParallel has no uneven-input support yet" in message
