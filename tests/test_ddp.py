"""minidist.DataParallel against native DDP and a single process on the full batch (gloo, CPU).

Tolerances: bitwise equal to native DDP for fp32 at world size 2 (the sum of two
numbers does not depend on the order of reduction); within 1e-6 relative at 3 and 4
ranks (gloo's ring adds partial sums in an order that depends on bucket layout);
within 1e-5 relative of the single process (a different order of summation over the
batch). "Within r" means |ours - ref| <= r * (|ref| + max|ref over the model|) element-wise
(see ddp_cases.max_rel_diff).
"""

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist.comm import CommTracer
import ddp_cases  # tests/ is on sys.path (pytest rootdir import mode); rank processes inherit it
from grid import grid

compare = ddp_cases.compare_with_native


def check(results, world_size, single=True):
    for rank, r in enumerate(results):
        assert r["ranks_agree"], f"rank {rank}: replicas diverged"
        if world_size == 2:
            assert r["bitwise_native"], f"rank {rank}: not bitwise equal to native DDP: {r['rel_native']}"
        assert r["rel_native"][0] <= 1e-6, f"rank {rank}: vs native DDP {r['rel_native']}"
        if single:
            assert r["rel_single"][0] <= 1e-5, f"rank {rank}: vs single process {r['rel_single']}"


# make test: every pair of world size, model and optimizer; make test-all: the whole product (grid.py).
@pytest.mark.parametrize("world_size, model, optim", grid([2, 3, 4], ["mlp", "gpt", "cnn"], ["sgd", "adamw"],
                                                         slow=pytest.mark.slow(
                                                             stand_in="test_matches_native_ddp_and_single_process")))
def test_matches_native_ddp_and_single_process(ranks, world_size, model, optim):
    # BatchNorm normalises with per-rank batch statistics, so a CNN with BatchNorm is not
    # equivalent to one process on the full batch; it is compared with native DDP only.
    single = model != "cnn"
    results = ranks(world_size).run(compare, model=model, optim=optim, steps=10, single=single)
    check(results, world_size, single)


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_averaged_gradients_equal_native_within_rounding_elementwise(ranks, world_size, model):
    """At 3 and 4 ranks ours and native DDP sum in other orders, so not bitwise; every gradient
    element is within the bound rounding allows (ddp_cases.gradient_excess_over_rounding), which
    a scale error of 1e-6 in the averaging exceeds."""
    for rank, (ratio, where) in enumerate(ranks(world_size).run(ddp_cases.gradient_excess_over_rounding, model)):
        assert ratio <= 1.0, f"rank {rank}: {where}'s gradient is {ratio:.3g} x what rounding allows off native's"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_gradient_accumulation_with_no_sync(ranks, world_size, model):
    results = ranks(world_size).run(compare, model=model, optim="adamw", steps=10, accumulate=4)
    check(results, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_unused_parameters(ranks, world_size):
    results = ranks(world_size).run(compare, model="unused", optim="sgd", steps=10, find_unused=True)
    check(results, world_size)


# make test: every cap at 2 ranks, the many-bucket cap at 3; make test-all: every cap at 3 too.
@pytest.mark.parametrize("world_size, cap_mb", [(2, c) for c in (0.01, 0.1, 1.0, 100.0)] + [(3, 0.01)] + [
    pytest.param(3, c, marks=pytest.mark.slow(stand_in="test_bucket_caps[3-0.01]")) for c in (0.1, 1.0, 100.0)])
def test_bucket_caps(ranks, world_size, cap_mb):
    results = ranks(world_size).run(compare, model="gpt", optim="sgd", steps=10, bucket_cap_mb=cap_mb)
    check(results, world_size)
    if cap_mb == 0.01:
        assert results[0]["buckets"] > 5  # ~100 KB of gradients in 10 KB buckets


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gradient_as_bucket_view(ranks, world_size):
    results = ranks(world_size).run(compare, model="gpt", optim="adamw", steps=10,
                                    gradient_as_bucket_view=True, accumulate=2, bucket_cap_mb=0.05)
    check(results, world_size)


# --------------------------------------------------------------------------- compression hooks


def compressed_vs_fp32_gradients(hook: str):
    """One backward with fp32 all_reduce and one with the compressing hook, same data."""
    rank, n = dist.get_rank(), dist.get_world_size()
    grads = {}
    for name in ("allreduce", hook):
        inner = ddp_cases.build("gpt")
        model = minidist.DataParallel(inner, comm_hook=name, bucket_cap_mb=0.05)
        x, y = ddp_cases.global_batch("gpt", 0, 0, n)
        x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
        ddp_cases.loss_fn("gpt", model(x), y).backward()
        grads[name] = {k: p.grad.clone() for k, p in inner.named_parameters()}
    return grads["allreduce"], grads[hook]


@pytest.mark.parametrize("hook,eps", [("fp16", 2.0 ** -10), ("bf16", 2.0 ** -7)])
@pytest.mark.parametrize("world_size", [2, 4])
def test_compression_hooks_stay_within_rounding_error(ranks, world_size, hook, eps):
    # Stated bound: each rank's gradient/n is rounded once (relative eps/2) and each of
    # the n-1 additions once more, so |compressed - fp32| <= n * eps * max|g| per tensor.
    # (fp16 only for magnitudes above its subnormal range: gradients here are ~1e-4..1.)
    for fp32, low in ranks(world_size).run(compressed_vs_fp32_gradients, hook):
        for name in fp32:
            bound = world_size * eps * fp32[name].abs().max().item() + 1e-7
            err = (low[name] - fp32[name]).abs().max().item()
            assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g}"


def compression_changes_bytes_on_the_wire(hook: str):
    inner = ddp_cases.build("mlp")
    model = minidist.DataParallel(inner, comm_hook=hook)
    x, y = ddp_cases.global_batch("mlp", 0, 0, dist.get_world_size())
    with CommTracer() as tracer:
        ddp_cases.loss_fn("mlp", model(x[:4]), y[:4]).backward()
    return [(r.op, r.dtype, r.bytes) for r in tracer.records], sum(p.numel() for p in inner.parameters())


def test_compression_halves_the_bytes(ranks):
    records, numel = ranks(2).run(compression_changes_bytes_on_the_wire, "bf16")[0]
    reduces = [r for r in records if r[0] == "all_reduce"]
    assert {r[1] for r in reduces} == {"bfloat16"}
    assert sum(r[2] for r in reduces) == 2 * numel


# --------------------------------------------------------------------------- error paths


class Wider(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, width)


def mismatched_model():
    rank = dist.get_rank()
    try:
        minidist.DataParallel(Wider(5 if rank == 1 else 4))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_mismatched_models_raise_on_every_rank_naming_the_parameter(ranks):
    messages = ranks(3).run(mismatched_model, timeout_s=60)
    for msg in messages:
        assert "differs across ranks" in msg
        assert "'b.weight' shape [4, 4]" in msg and "rank 1 has 'b.weight' shape [5, 4]" in msg


def unused_without_flag():
    inner = ddp_cases.build("unused")
    model = minidist.DataParallel(inner)
    x = torch.randn(4, 16)
    try:
        model(x).sum().backward()
    except RuntimeError as e:
        msg = str(e)
    else:
        msg = "no error"
    # the process group is still usable afterwards: nothing was left half done
    t = torch.ones(1)
    dist.all_reduce(t)
    return msg, t.item()


def test_parameter_without_gradient_raises_with_names_and_fix(ranks):
    for msg, total in ranks(2).run(unused_without_flag, timeout_s=60):
        assert "unused.weight" in msg and "unused.bias" in msg
        assert "find_unused_parameters=True" in msg
        assert total == 2.0


def bad_arguments():
    errors = []
    for kwargs in ({"bucket_cap_mb": 0}, {"comm_hook": "int8"}):
        try:
            minidist.DataParallel(ddp_cases.build("mlp"), **kwargs)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_bad_arguments_say_what_is_wrong(ranks):
    errors = ranks(2).run(bad_arguments)[0]
    assert "bucket sizes must be positive" in errors[0]
    assert "unknown comm_hook 'int8'" in errors[1] and "bf16" in errors[1]


# --------------------------------------------------------------------------- communication and memory


def traced_steps(cap_mb: float, overlap: bool):
    inner = ddp_cases.build("gpt")
    model = minidist.DataParallel(inner, bucket_cap_mb=cap_mb, overlap=overlap)
    opt = torch.optim.SGD(inner.parameters(), lr=0.01)
    n, rank = dist.get_world_size(), dist.get_rank()
    per_step = []
    for step in range(3):
        x, y = ddp_cases.global_batch("gpt", step, 0, n)
        with CommTracer() as tracer:
            ddp_cases.loss_fn("gpt", model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
        opt.step()
        opt.zero_grad()
        per_step.append([(r.op, r.bytes, r.async_op) for r in tracer.records])
    grad_bytes = sum(p.numel() * p.element_size() for p in inner.parameters())
    return per_step, [b.nbytes for b in model._buckets], grad_bytes


@pytest.mark.parametrize("overlap", [True, False])
def test_one_all_reduce_per_bucket_adding_up_to_the_gradients(ranks, overlap):
    for per_step, bucket_bytes, grad_bytes in ranks(2).run(traced_steps, 0.02, overlap):
        assert len(bucket_bytes) > 3 and sum(bucket_bytes) == grad_bytes
        for step, records in enumerate(per_step):
            reduces = [r for r in records if r[0] == "all_reduce"]
            others = [r for r in records if r[0] != "all_reduce"]
            assert all(r[2] for r in reduces)  # asynchronous
            assert sum(r[1] for r in reduces) == grad_bytes
            if step == 0:
                # the first backward also broadcasts rank 0's ready order, to rebuild the buckets
                assert [r[0] for r in others] == ["broadcast"]
            else:
                assert [r[1] for r in reduces] == bucket_bytes  # exactly one all_reduce per bucket
                assert others == []


def memory_of(gradient_as_bucket_view: bool):
    inner = ddp_cases.build("gpt")
    model = minidist.DataParallel(inner, gradient_as_bucket_view=gradient_as_bucket_view)
    opt = torch.optim.Adam(inner.parameters(), lr=1e-3)
    x, y = ddp_cases.global_batch("gpt", 0, 0, 1)
    ddp_cases.loss_fn("gpt", model(x), y).backward()
    opt.step()
    psi = sum(p.numel() for p in inner.parameters())
    return model.memory_report(opt), psi, len(opt.state)


@pytest.mark.parametrize("as_view", [False, True])
def test_memory_report_counts_live_storages(ranks, as_view):
    report, psi, n_state = ranks(2).run(memory_of, as_view)[0]
    assert report["parameters"] == 4 * psi
    assert report["gradients"] == 4 * psi
    # the buckets: a second copy of the gradients, or (as views) the very same storage
    assert report["comm_buffers"] == (0 if as_view else 4 * psi)
    # Adam: exp_avg and exp_avg_sq per parameter, plus a scalar step tensor each
    assert report["optimizer_state"] == 8 * psi + 4 * n_state
    assert report["total"] == sum(v for k, v in report.items() if k != "total")


def buffer_stats_after_two_steps(broadcast_buffers: bool):
    rank = dist.get_rank()
    inner = ddp_cases.build("cnn")
    model = minidist.DataParallel(inner, broadcast_buffers=broadcast_buffers)
    model(torch.randn(4, 3, 8, 8) + rank).sum().backward()   # per-rank statistics diverge
    model(torch.ones(4, 3, 8, 8)).sum().backward()           # same batch on every rank
    return inner.features[1].running_mean.clone()


def test_buffers_are_broadcast_from_rank_zero_before_forward(ranks):
    # With the broadcast, the second forward starts every rank from rank 0's statistics and
    # applies the same update, so all ranks agree; without it they keep their own.
    synced = ranks(3).run(buffer_stats_after_two_steps, True)
    assert all(torch.equal(synced[0], m) for m in synced)
    unsynced = ranks(3).run(buffer_stats_after_two_steps, False)
    assert not torch.equal(unsynced[0], unsynced[1])


def tied_weights_reduced_once():
    inner = ddp_cases.build("gpt")
    model = minidist.DataParallel(inner)
    names = [n for bucket in model.bucket_plan for n in bucket]
    return names.count("tok_emb.weight"), "head.weight" in names, inner.head.weight is inner.tok_emb.weight


def test_tied_parameters_are_reduced_once(ranks):
    assert ranks(2).run(tied_weights_reduced_once)[0] == (1, False, True)


def frozen_parameters_are_skipped():
    inner = ddp_cases.build("mlp")
    inner.net[0].weight.requires_grad_(False)
    model = minidist.DataParallel(inner)
    x = torch.randn(4, 16)
    model(x).sum().backward()
    names = [n for bucket in model.bucket_plan for n in bucket]
    return "net.0.weight" in names, inner.net[0].weight.grad is None


def test_frozen_parameters_are_skipped(ranks):
    assert ranks(2).run(frozen_parameters_are_skipped)[0] == (False, True)
