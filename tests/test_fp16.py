"""fp16 with every strategy, on CPU: torch's GradScaler, its overflow decision agreed across ranks.

Under ZeRO and fully_shard each rank's scaler sees only its gradient shard; Strategy.optimizer_step
makes the found-inf decision the MAX over ranks (strategy.agree_on_overflow), so every rank skips
the same steps and the scale evolves identically. Each strategy in fp16, with a nan injected on
rank 1 at step 3, ends where ddp in fp16 ends: the same loss scale (so the same skipped steps:
the early overflows at 2**16 and the injected one) and the same weights, as close as native
fully_shard gets. fp16 compute on CPU rounds by the machine: native fully_shard ended 5.4e-6 from
ddp where this was first measured and 1.2e-5 on a later machine (an AMD EPYC), where every ZeRO
stage ended the same 1.2e-5 away; so the bound is twice native's gap on the machine at hand, at
least 1e-5.
"""

import pytest
import torch

from ddp_cases import max_rel_diff
from train_cases import tiny, train_on_rank

FP16 = ("trainer.precision=fp16", "trainer.max_steps=8", "debug.nan_rank=1", "debug.nan_at_step=3")


@pytest.fixture(scope="module")
def reference(ranks, tmp_path_factory):
    return ranks(2).run(train_on_rank, tiny(*FP16), str(tmp_path_factory.mktemp("ddp")), timeout_s=180)


def fp16_gap(out: list[dict], ref: list[dict], strategy: str) -> tuple[float, str]:
    """The same loss scale and no non-finite steps on every rank; then the weights' largest
    relative difference from ddp's (and where)."""
    assert ref[0]["loss_scale"] < 2.0 ** 16  # overflows happened and were skipped
    for rank in range(2):
        assert out[rank]["loss_scale"] == ref[0]["loss_scale"], (strategy, rank, out[rank]["loss_scale"])
        assert out[rank]["skipped_steps"] == 0  # fp16 overflows are the scaler's, not non-finite steps
    return max_rel_diff(out[0]["full_state"], ref[0]["full_state"])


@pytest.fixture(scope="module")
def native_bound(ranks, reference, tmp_path_factory):
    """Twice native fully_shard's own distance from ddp in fp16 on this machine, at least 1e-5."""
    out = ranks(2).run(train_on_rank, tiny(*FP16, strategy="native_fsdp"), str(tmp_path_factory.mktemp("fsdp")),
                       timeout_s=180)
    gap, _ = fp16_gap(out, reference, "native_fsdp")
    assert gap <= 1e-4, f"native fully_shard itself ends {gap:.1e} from ddp in fp16: more than fp16's rounding"
    return max(1e-5, 2 * gap)


@pytest.mark.parametrize("strategy", ["native_ddp", "zero1", "zero2", "zero3"])
def test_fp16_equals_ddp_in_fp16(ranks, reference, native_bound, strategy, tmp_path):
    out = ranks(2).run(train_on_rank, tiny(*FP16, strategy=strategy), str(tmp_path), timeout_s=180)
    worst, where = fp16_gap(out, reference, strategy)
    assert worst <= native_bound, f"{strategy}: {where} differs from ddp by {worst:.1e} (bound {native_bound:.1e})"


def overflow_on_one_rank(agree: bool):
    """Rank 1's gradient holds an inf, rank 0's does not (as when it lies in rank 1's shard)."""
    import torch.distributed as dist

    from minidist.train.strategies import agree_on_overflow
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # the loss would be scaled first: this creates the scale
    p.grad = torch.tensor([1.0, float("inf") if dist.get_rank() == 1 else 2.0, 3.0])
    scaler.unscale_(opt)
    if agree:
        agree_on_overflow(scaler, opt, torch.device("cpu"))
    scaler.step(opt)
    scaler.update()
    return p.detach().clone(), scaler.get_scale()


def test_the_overflow_decision_is_the_same_on_every_rank(ranks):
    (p0, s0), (p1, s1) = ranks(2).run(overflow_on_one_rank, True)
    assert torch.equal(p0, torch.ones(3)) and torch.equal(p1, torch.ones(3))  # both skipped
    assert s0 == s1 == 2.0 ** 15
    (p0, s0), (p1, s1) = ranks(2).run(overflow_on_one_rank, False)  # without it, the ranks part ways
    assert not torch.equal(p0, p1) and s0 != s1


@pytest.mark.slow(stand_in="test_fp16_equals_ddp_in_fp16[zero3]")  # 4 ranks; the flat stage 3 at 2 in make test
def test_fp16_hybrid_on_a_2x2_mesh_equals_native_hsdp_in_fp16(ranks, tmp_path):
    """At 4 ranks fp16 separates the implementations more (native DDP ends 3.6e-5 from our ddp,
    measured): the hybrids are held to their own native twin, fully_shard on the same 2x2 mesh."""
    pool = ranks(4)
    mesh = "strategy.shard_size=2"
    ref = pool.run(train_on_rank, tiny(*FP16, mesh, strategy="native_hsdp"), str(tmp_path / "ref"), timeout_s=240)[0]
    for strategy in ("hsdp2", "hsdp3"):
        out = pool.run(train_on_rank, tiny(*FP16, mesh, strategy=strategy), str(tmp_path / strategy), timeout_s=240)
        assert all(o["loss_scale"] == ref["loss_scale"] < 2.0 ** 16 for o in out), strategy
        worst, where = max_rel_diff(out[0]["full_state"], ref["full_state"])
        assert worst <= 1e-5, f"{strategy}: {where} differs from native_hsdp by {worst:.1e}"
