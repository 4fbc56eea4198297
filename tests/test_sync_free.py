"""A training step reads nothing from the device between log steps (issue 18, items 2 and 3).

On CUDA every host read of a device value (`.item()`, `bool(t)`, `float(t)`) waits for the GPU
and serialises the step. The trainer reads device values only through `minidist.measure.to_host`,
and only at log / eval / checkpoint steps; `HostReads` counts the reads, so these CPU tests show
that the steps in between make none. Timing is device-true (CUDA events) behind `Span`, tested
here on its host-clock side; tests/test_gpu.py runs the same step under
torch.cuda.set_sync_debug_mode("error") on a GPU.
"""

from __future__ import annotations

import time

import pytest
import torch
from omegaconf import OmegaConf

from minidist.measure import HostReads, Span, clock_name, to_host
from minidist.train.strategies import step_unless_nonfinite
from train_cases import tiny


def test_a_span_on_the_host_clock_measures_what_it_covers():
    before = time.perf_counter()
    span = Span("cpu").start()
    time.sleep(0.05)
    span.stop()
    around = time.perf_counter() - before
    # Bounded by what it covers: the sleep (at least 50 ms) and a clock read around it; no guess
    # of how slow a loaded machine may be.
    assert span.done() and 0.05 <= span.seconds() <= around
    assert clock_name(torch.device("cpu")).startswith("host clock")
    assert clock_name(torch.device("cuda")).startswith("CUDA events")
    with pytest.raises(RuntimeError, match="start.*stop"):
        Span("cpu").seconds()


def test_host_reads_are_counted():
    with HostReads() as reads:
        assert to_host(torch.tensor(2.0), "a scalar") == 2.0
        assert to_host(torch.tensor([1.0, 2.0]), "a vector") == [1.0, 2.0]
    assert reads.count == 2 and reads.what == ["a scalar", "a vector"]


def _adamw(fused: bool):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8))
    opt = torch.optim.AdamW([p], lr=0.1, fused=fused)
    p.grad = torch.randn(8)
    opt.step()  # state exists
    return p, opt


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_norm_skips_the_update(fused):
    """A fused optimizer decides on the device (no host read); any other reads the norm once."""
    p, opt = _adamw(fused)
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    p.grad = torch.randn(8)
    with HostReads() as reads:
        step_unless_nonfinite(opt, torch.tensor(float("inf")))
    assert reads.count == (0 if fused else 1)
    assert torch.equal(p.detach(), before[0])
    for k, v in opt.state[p].items():
        assert torch.equal(v, before[1][k]), k  # moments and the step count untouched
    assert not hasattr(opt, "found_inf")


def test_a_finite_norm_steps_as_the_optimizer_would():
    p, opt = _adamw(True)
    q, ref = _adamw(True)
    p.grad = q.grad = torch.randn(8)
    step_unless_nonfinite(opt, torch.tensor(1.0))
    ref.step()
    assert torch.equal(p.detach(), q.detach())


def count_reads_per_step(cfg_dict: dict, run_dir: str) -> dict:
    """Rank function: the host reads of each of 6 steps, and what fit() reads at a log step."""
    from minidist.train.trainer import Trainer

    trainer = Trainer(OmegaConf.create(cfg_dict), run_dir)
    try:
        batches = iter(trainer.sampler)
        per_step = []
        for _ in range(6):
            with HostReads() as reads:
                m = trainer.train_step(batches)
            per_step.append(reads.what)
        with HostReads() as reads:
            trainer._reduce_metrics([m])
        return {"per_step": per_step, "at_log": reads.count, "fused": "fused" in str(trainer.optimizer.defaults)}
    finally:
        trainer.close()


SLOW = pytest.mark.slow(stand_in="test_steps_between_log_steps_read_nothing_from_the_device[zero2]")


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=SLOW), "zero2",
                                      pytest.param("zero3", marks=SLOW)])
def test_steps_between_log_steps_read_nothing_from_the_device(ranks, tmp_path, strategy):
    out = ranks(2).run(count_reads_per_step, tiny("optim.fused=true", strategy=strategy), str(tmp_path))
    for rank, r in enumerate(out):
        assert r["fused"]
        assert all(what == [] for what in r["per_step"]), (rank, r["per_step"])
        assert r["at_log"] >= 2  # the loss and the gradient norm, read once per log step


def test_non_finite_steps_are_found_at_the_next_check(ranks, tmp_path):
    """The norm is read at log steps only (log_every=5): a nan at step 3 is reported then, with its
    own step number, and the update was skipped on the device (fused AdamW)."""
    from train_cases import train_on_rank

    out = ranks(2).run(train_on_rank, tiny("optim.fused=true", "debug.nan_at_step=3", "debug.nan_rank=1",
                                           "trainer.max_steps=6"), str(tmp_path))
    assert all(r["skipped_steps"] == 1 for r in out)
    log = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "step 3: non-finite gradient norm (nan): the update was skipped" in log
