"""Strategies over a process_group that is not the world: two independent data-parallel groups."""

import pytest
import torch
import torch.distributed as dist

import ddp_cases
import minidist
import zero_cases


def two_groups(strategy: str):
    """Ranks {0,1} and {2,3} each train their own replica; groups must not mix."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    mine = groups[rank // 2]
    torch.manual_seed(0)
    net = ddp_cases.build("mlp")
    if rank >= 2:  # the second group starts from different weights
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(2.0)
    import copy
    reference = copy.deepcopy(net)  # one process on the group's two batches together
    if strategy == "ddp":
        model = minidist.DataParallel(net, process_group=mine)
        opt = zero_cases.OPTIMIZERS["sgd"](net.parameters())
    else:
        stage = int(strategy[-1])
        model = minidist.ShardedDataParallel(net, zero_cases.OPTIMIZERS["sgd"], stage=stage, process_group=mine,
                                             **({"min_unit_params": 100} if stage == 3 else {}))
        opt = model.optimizer
    x, y = ddp_cases.global_batch("mlp", 0, 0, 4)
    ddp_cases.loss_fn("mlp", model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
    opt.step()
    state = model.full_state_dict() if strategy != "ddp" else {k: v.clone() for k, v in net.state_dict().items()}
    first = (rank // 2) * 2
    ref_opt = zero_cases.OPTIMIZERS["sgd"](reference.parameters())
    ddp_cases.loss_fn("mlp", reference(x[first * 4:(first + 2) * 4]), y[first * 4:(first + 2) * 4]).backward()
    ref_opt.step()
    return state, ddp_cases.max_rel_diff(state, reference.state_dict())[0]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_each_group_averages_only_within_itself(ranks, strategy):
    results = ranks(4).run(two_groups, strategy)
    s = [r[0] for r in results]
    assert all(r[1] <= 1e-6 for r in results), [r[1] for r in results]  # = one process on the group's data
    assert all(torch.equal(s[0][k], s[1][k]) for k in s[0])   # group {0,1} agrees
    assert all(torch.equal(s[2][k], s[3][k]) for k in s[2])   # group {2,3} agrees
    assert not all(torch.equal(s[0][k], s[2][k]) for k in s[0])  # and the groups differ
