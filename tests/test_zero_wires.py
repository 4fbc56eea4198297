"""grad_wire and param_wire on ShardedDataParallel (every stage, hybrid too) and DataParallel.

What is rounded where, checked value by value: with grad_wire, the master shards' gradient is
the exact sum of every rank's wire-rounded gradient / N, rounded once to fp32; with
param_wire, the module's parameters are the wire's rendering of the fp32 master shards (the
same on every rank), and the master shards themselves are never rounded. Then: training stays
close to native DDP's, and the bytes per step shrink as the wire says.
"""

import copy

import pytest
import torch
import torch.distributed as dist

import minidist
from ddp_cases import PER_RANK_BATCH, build, compare_with_native, global_batch, loss_fn, max_rel_diff, perturbed
from minidist.comm.wire import Wire
from zero_cases import OPTIMIZERS, compare_zero


def rank_batch(model_name: str, step: int = 0):
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(model_name, step, 0, n)
    return x[rank * PER_RANK_BATCH:(rank + 1) * PER_RANK_BATCH], y[rank * PER_RANK_BATCH:(rank + 1) * PER_RANK_BATCH]


def wire_gradient_mismatches(model_name: str, stage: int, grad_wire: str) -> list[str]:
    """One backward; the shards whose reduced gradient is not, bitwise, the fp32 rounding of the
    exact sum of every rank's gradient / n after one trip over the wire (chunk by chunk, as the
    owner receives it)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    wire = Wire(grad_wire)
    base = build(model_name)
    x, y = rank_batch(model_name)
    local = copy.deepcopy(base)
    loss_fn(model_name, local(x), y).backward()
    local_grads = {name: p.grad for name, p in local.named_parameters()}
    model = minidist.ShardedDataParallel(perturbed(base, rank), OPTIMIZERS["sgd"], stage=stage, grad_wire=grad_wire)
    loss_fn(model_name, model(x), y).backward()
    wrong = []
    for k, shard in enumerate(model._shards):
        flat = torch.zeros(shard.padded)
        for slot in shard.slots:
            torch.mul(local_grads[slot.name].reshape(-1), 1.0 / n, out=flat[slot.offset:slot.offset + slot.numel])
        everyone = [torch.empty_like(flat) for _ in range(n)]
        dist.all_gather(everyone, flat)  # copies: no arithmetic
        size = shard.shard_size
        want = torch.stack([wire.round_trip(f[rank * size:(rank + 1) * size]).double() for f in everyone]).sum(0)
        got = torch.cat([p.grad for p in shard.pieces])
        if not torch.equal(got, want.float()):
            wrong.append(f"shard {k}: {(got != want.float()).sum().item()} of {want.numel()} elements differ")
    return wrong


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("grad_wire", ["bf16", "int8"])
def test_the_master_gradient_is_the_exact_sum_of_the_wire_rounded_gradients(stage, grad_wire, ranks):
    assert ranks(3).run(wire_gradient_mismatches, "gpt", stage, grad_wire) == [[]] * 3


def parameters_as_the_wire_delivers(stage: int, param_wire: str):
    """After two steps: each shard's full parameters (what forward uses) against the wire's trip
    of the fp32 masters gathered exactly; and whether the masters stayed unrounded."""
    rank = dist.get_rank()
    wire = Wire(param_wire)
    model = minidist.ShardedDataParallel(perturbed(build("gpt"), rank), OPTIMIZERS["adamw"], stage=stage,
                                         param_wire=param_wire, **({"min_unit_params": 1000} if stage == 3 else {}))
    for step in range(2):
        x, y = rank_batch("gpt", step)
        loss_fn("gpt", model(x), y).backward()
        model.optimizer.step()
        model.optimizer.zero_grad()
    model.wait_for_parameters()
    wrong, rounded_masters = [], 0
    for k, shard in enumerate(model._shards):
        exact = shard.full_fp32()  # every rank's master, gathered without a wire
        if not shard.is_materialised:
            shard.gather_full()
        want = torch.cat([wire.round_trip(c) for c in exact.view(shard.world_size, -1)]).to(shard.full.dtype)
        if not torch.equal(shard.full, want):
            wrong.append(k)
        rounded_masters += int(torch.equal(shard.master, wire.round_trip(shard.master)))
        if stage == 3:
            shard.free_full()
    full = model.full_state_dict()
    return wrong, rounded_masters, full


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_parameters_are_what_the_wire_delivered_and_the_masters_stay_exact(stage, ranks):
    results = ranks(2).run(parameters_as_the_wire_delivers, stage, "int8")
    for wrong, rounded_masters, _ in results:
        assert wrong == []
        assert rounded_masters == 0  # AdamW's fp32 updates: an int8 grid would show
    a, b = results[0][2], results[1][2]
    assert all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("stage", [2, 3])
def test_training_with_int8_wires_stays_close_to_native_ddp(stage, ranks):
    # Adam over 10 steps of int8-rounded gradients and weights: close, not equal (the loss bound
    # over a real run is in docs/benchmarks.md).
    for out in ranks(2).run(compare_zero, stage=stage, model="gpt", references=("ddp",),
                            grad_wire="int8", param_wire="int8"):
        assert out["ranks_agree"] and out["keys_match"]
        assert out["ddp"][0] < 0.05, out


def hybrid_wire_matches(grad_wire: str):
    """hsdp on a 2x2 mesh with a gradient wire against the same run without one."""
    from zero_cases import run_ours

    mesh = minidist.init_mesh(shard=2)
    base = build("gpt")
    _, plain = run_ours(base, "gpt", "adamw", 5, 1, None, 2, dist.get_rank(), 4, mesh=mesh)
    with minidist.comm.CommTracer() as tracer:
        _, wired = run_ours(base, "gpt", "adamw", 5, 1, None, 2, dist.get_rank(), 4, mesh=mesh, grad_wire=grad_wire)
    gradient_ops = {(r.op, r.dtype) for r in tracer.records if r.op in ("reduce_scatter", "all_reduce") and r.bytes > 64}
    return max_rel_diff(wired, plain)[0], gradient_ops


def test_hybrid_sharding_sends_the_wire_within_and_across_hosts(ranks):
    for diff, gradient_ops in ranks(4).run(hybrid_wire_matches, "bf16"):
        assert diff < 0.02
        # within the host (reduce_scatter) and across (all_reduce of the shard): both on the wire
        assert gradient_ops == {("reduce_scatter", "bfloat16"), ("all_reduce", "bfloat16")}, gradient_ops


def bytes_per_step(stage: int, **wires) -> float:
    model = minidist.ShardedDataParallel(build("gpt"), OPTIMIZERS["adamw"], stage=stage, min_unit_params=1000,
                                         **wires)
    x, y = rank_batch("gpt")
    with minidist.comm.CommTracer() as tracer:
        loss_fn("gpt", model(x), y).backward()
        model.optimizer.step()
        model.optimizer.zero_grad()
        model.wait_for_parameters()
    return tracer.total_sent_bytes


def test_int8_weights_and_gradients_send_a_quarter_of_zero3s_bytes(ranks):
    plain = ranks(2).run(bytes_per_step, 3)[0]
    both = ranks(2).run(bytes_per_step, 3, grad_wire="int8", param_wire="int8")[0]
    # 1 + 4/256 bytes an element against 4, plus the few small control collectives
    assert both / plain < 0.30, (both, plain)


@pytest.mark.parametrize("grad_wire", ["bf16", "int8"])
def test_data_parallel_with_a_wire_trains_close_to_native_ddp(grad_wire, ranks):
    for out in ranks(2).run(compare_with_native, model="mlp", steps=5, single=False, grad_wire=grad_wire):
        assert out["ranks_agree"], out
        assert out["rel_native"][0] < 0.02, out


def wire_and_hook():
    with pytest.raises(ValueError, match="give one of them"):
        minidist.DataParallel(build("mlp"), comm_hook="bf16", grad_wire="int8")
    with pytest.raises(ValueError, match="grad_wire='fp8'"):
        minidist.ShardedDataParallel(build("mlp"), OPTIMIZERS["sgd"], stage=2, grad_wire="fp8")
    return True


def test_a_wire_with_a_comm_hook_or_an_unknown_format_is_refused(ranks):
    assert ranks(2).run(wire_and_hook) == [True, True]


def backward_gathers_by_group(secondary_shard, param_wire=None):
    """One step of zero3 on 4 ranks: ring bytes each group carried, by op, and the final state."""
    model = minidist.ShardedDataParallel(perturbed(build("gpt"), dist.get_rank()), OPTIMIZERS["adamw"], stage=3,
                                         min_unit_params=1000, secondary_shard=secondary_shard,
                                         param_wire=param_wire)
    by_group: dict = {}
    for step in range(3):
        x, y = rank_batch("gpt", step)
        with minidist.comm.CommTracer() as tracer:
            loss_fn("gpt", model(x), y).backward()
        model.optimizer.step()
        model.optimizer.zero_grad()
        if step == 2:
            for r in tracer.records:
                key = (r.op, len(r.group_ranks))
                by_group[key] = by_group.get(key, 0) + r.sent_bytes
    return by_group, model.full_state_dict()


@pytest.mark.parametrize("param_wire", [None, "int8"])
def test_hpz_keeps_the_backward_gathers_within_a_host_and_trains_identically(param_wire, ranks):
    plain = ranks(4).run(backward_gathers_by_group, None, param_wire)
    hpz = ranks(4).run(backward_gathers_by_group, 2, param_wire)
    for (plain_groups, plain_state), (hpz_groups, hpz_state) in zip(plain, hpz):
        # plain zero3: forward and backward gathers both over the 4 ranks
        # hpZ: the forward's over the 4, the backward's within the 2 ranks of the host
        assert ("all_gather", 2) not in plain_groups
        assert hpz_groups[("all_gather", 4)] == pytest.approx(plain_groups[("all_gather", 4)] / 2, rel=0.05)
        assert hpz_groups[("all_gather", 2)] > 0
        assert hpz_groups[("reduce_scatter", 4)] == plain_groups[("reduce_scatter", 4)]
        assert all(torch.equal(hpz_state[k], plain_state[k]) for k in plain_state)  # the same weights, bitwise


def hpz_refusals():
    with pytest.raises(ValueError, match="divides"):
        minidist.ShardedDataParallel(build("gpt"), OPTIMIZERS["sgd"], stage=3, secondary_shard=3)
    with pytest.raises(ValueError, match="give one of them"):
        minidist.ShardedDataParallel(build("gpt"), OPTIMIZERS["sgd"], stage=3, secondary_shard=2,
                                     reshard_after_forward=False)
    with pytest.raises(ValueError, match="stage"):
        minidist.ShardedDataParallel(build("gpt"), OPTIMIZERS["sgd"], stage=2, secondary_shard=2)
    # FSDP2's spelling of the same thing
    model = minidist.ShardedDataParallel(build("gpt"), OPTIMIZERS["sgd"], stage=3, reshard_after_forward=2)
    return model._secondary is not None and model._secondary.size == 2


def test_hpz_is_refused_where_it_cannot_hold_and_takes_fsdp2s_int(ranks):
    assert ranks(4).run(hpz_refusals) == [True] * 4


def state_dict_under_a_param_wire():
    model = minidist.ShardedDataParallel(build("mlp"), OPTIMIZERS["sgd"], stage=2, param_wire="int8")
    with pytest.raises(RuntimeError, match="full_state_dict"):
        model.module.state_dict()
    keys = list(model.module.state_dict(keep_vars=True))  # keys and shapes stay readable
    full = model.full_state_dict()  # the fp32 masters, exact
    return keys == list(full)


def test_state_dict_under_a_param_wire_refuses_rounded_weights_and_names_full_state_dict(ranks):
    assert ranks(2).run(state_dict_under_a_param_wire) == [True, True]
