"""PowerSGD comm hook: replicas stay identical, fewer bytes, plain all_reduce before start_iter, learning."""

import pytest
import torch
import torch.distributed as dist

import ddp_cases
import minidist
from minidist.comm import CommTracer
from minidist.parallel.powersgd import PowerSGD, orthonormalise


def test_orthonormalise():
    q = orthonormalise(torch.randn(50, 4))
    assert torch.allclose(q.t() @ q, torch.eye(4), atol=1e-5)


def train_with(powersgd: dict | None, steps=10):
    """powersgd: PowerSGD keyword arguments, or None for the plain all_reduce."""
    rank, n = dist.get_rank(), dist.get_world_size()
    inner = ddp_cases.perturbed(ddp_cases.build("gpt"), rank)
    model = minidist.DataParallel(inner, comm_hook=PowerSGD(**powersgd) if powersgd else "allreduce", bucket_cap_mb=0.05)
    opt = torch.optim.SGD(inner.parameters(), lr=0.5, momentum=0.9)
    losses, wire = [], []
    for step in range(steps):
        x, y = ddp_cases.global_batch("gpt", step % 3, 0, n)  # revisit 3 batches: loss must fall
        with CommTracer() as tracer:
            loss = ddp_cases.loss_fn("gpt", model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4])
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        wire.append(sum(r.bytes for r in tracer.records if r.op == "all_reduce"))
    params = {k: v.detach().clone() for k, v in inner.named_parameters()}
    everyone = minidist.comm.all_gather_object(params)
    agree = all(torch.equal(everyone[0][k], p[k]) for p in everyone for k in p)
    return losses, wire, agree, {k: v for k, v in params.items()}


def test_powersgd_keeps_replicas_identical_and_sends_less(ranks):
    for (losses, wire, agree, _), (_, plain_wire, _, _) in zip(
            ranks(2).run(train_with, {"rank": 2}), ranks(2).run(train_with, None)):
        assert agree  # every rank applies the same approximation
        assert max(wire) < 0.15 * plain_wire[-1]  # 12 KB instead of 111 KB per step here
        assert all(torch.isfinite(torch.tensor(losses)))


def rank_one_gradient_grads(powersgd: dict | None):
    """A bias-free linear layer, one sample, the same on every rank: its gradient is
    an outer product (rank 1), which one power iteration at rank 1 recovers exactly."""
    torch.manual_seed(0)
    inner = torch.nn.Linear(64, 48, bias=False)
    model = minidist.DataParallel(inner, comm_hook=PowerSGD(**powersgd) if powersgd else "allreduce")
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).sum().backward()
    return inner.weight.grad.clone()


def test_rank_one_gradient_is_recovered_exactly(ranks):
    for compressed, plain in zip(ranks(2).run(rank_one_gradient_grads, {"rank": 1}),
                                 ranks(2).run(rank_one_gradient_grads, None)):
        assert torch.allclose(compressed, plain, rtol=1e-4, atol=1e-6)


def test_plain_all_reduce_before_start_iter(ranks):
    # With start_iter beyond the run, PowerSGD must be exactly the plain all_reduce.
    for (_, _, _, a), (_, _, _, b) in zip(ranks(2).run(train_with, {"rank": 2, "start_iter": 100}, 4),
                                          ranks(2).run(train_with, None, 4)):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_rank_must_be_positive():
    with pytest.raises(ValueError, match="rank must be >= 1"):
        PowerSGD(rank=0)
