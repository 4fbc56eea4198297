"""Resume anywhere (issue 28, part 1): a checkpoint of any strategy at any world size continues as
another strategy at another world size, with the global batch kept (grad_accum adapts), the data
stream exact (trainer.log_samples: every optimizer step consumes the same sample ids as the
straight run's) and the optimizer state carried (every Adam moment of every element).

The proof: 16 steps of zero3 at 4 ranks equal, within 1e-5 relative on every parameter and every
Adam moment and on the losses, 8 steps of zero3 at 4 ranks resumed for 8 more as ddp at 2 ranks,
zero2 at 3 and single at 1. A seeded random chain of (world size, strategy) hops does the same.

Reproducible across a world-size change: the model, the optimizer, the schedule, the data
stream. Not bitwise: the sums over ranks run in another order (hence 1e-5), and each rank's own
random stream (dropout) restarts from (trainer.seed, step, rank), as the ranks are not the same
ranks; at the same world size, another strategy keeps every rank's stream.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from minidist.train.checkpoint import list_checkpoints, read_meta
from minidist.train.checkpoint_layouts import layout_of
from train_cases import mesh_options, tiny, train_on_rank

# A global batch of 12 samples keeps at 4, 3, 2 and 1 ranks: micro-batches of 1, grad_accum 3 at 4.
BATCH = ("trainer.micro_batch_size=1", "trainer.grad_accum=3", "trainer.log_samples=true", "trainer.log_every=1",
         "trainer.ckpt_every=4", "trainer.keep_last=10")
TOL = 1e-5


def cfg(strategy: str, *extra: str) -> dict:
    return tiny(*BATCH, "trainer.max_steps=16", *mesh_options(strategy), *extra, strategy=strategy)


def steps_consumed(run_dir: Path) -> dict[int, list[int]]:
    """step -> the sample ids every rank consumed in it, sorted (trainer.log_samples' files)."""
    out: dict[int, list[int]] = {}
    for f in sorted((run_dir / "samples").glob("rank_*.txt")):
        for line in f.read_text().splitlines():
            step, *ids = map(int, line.split())
            out.setdefault(step, []).extend(ids)
    return {s: sorted(ids) for s, ids in out.items()}


def portable(ckpt: Path) -> tuple[dict, dict]:
    """(the model state, the optimizer state by parameter name) of any checkpoint."""
    meta = read_meta(ckpt)
    return layout_of(meta).portable(ckpt, meta, list(portable_names(ckpt, meta)))


def portable_names(ckpt: Path, meta: dict):
    from minidist.train.data import data_info
    from minidist.train.models import build_model
    from omegaconf import OmegaConf

    c = OmegaConf.create(meta["config"])
    return [n for n, _ in build_model(c.model, data_info(c.data)).named_parameters()]


def assert_close(a: dict, b: dict, where: str) -> None:
    """Every tensor within TOL of the other, relative to its largest element: max |a - b| / max |a|."""
    assert set(a) == set(b), where
    for k in a:
        if isinstance(a[k], dict):
            assert_close(a[k], b[k], f"{where}/{k}")
        elif torch.is_tensor(a[k]) and a[k].is_floating_point():
            x, y = a[k].double(), b[k].double()
            worst = ((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item()
            assert worst <= TOL, f"{where}/{k}: relative difference {worst:.2e}"


def compare_with_straight(straight_dir: Path, resumed_dir: Path, straight_loss: float, resumed_loss: float,
                          label: str, first_step: int = 9) -> None:
    a, b = (list_checkpoints(d)[-1] for d in (straight_dir, resumed_dir))
    assert a.name == b.name == "step_00000016", label
    (model_a, optim_a), (model_b, optim_b) = portable(a), portable(b)
    assert_close(model_a, model_b, f"{label}: model")
    assert_close(optim_a["state"], optim_b["state"], f"{label}: optimizer")  # exp_avg, exp_avg_sq, step
    assert abs(straight_loss - resumed_loss) <= TOL * abs(straight_loss), (label, straight_loss, resumed_loss)
    straight_ids, resumed_ids = steps_consumed(straight_dir), steps_consumed(resumed_dir)
    assert sorted(resumed_ids) == list(range(first_step, 17)), (label, sorted(resumed_ids))
    for step, ids in resumed_ids.items():
        assert ids == straight_ids[step], f"{label}: step {step} consumed other samples"


@pytest.fixture(scope="module")
def straight(ranks, tmp_path_factory):
    """zero3 at 4 ranks, 16 steps, checkpoints every 4."""
    run_dir = tmp_path_factory.mktemp("anywhere") / "straight"
    summary = ranks(4).run(train_on_rank, cfg("zero3"), str(run_dir), timeout_s=300)[0]
    return run_dir, summary["train/loss"]


# zero2 at 3 and single at 1 in make test-all; ddp at 2 stands in for them in make test
SLOW = pytest.mark.slow(stand_in="test_zero3_at_4_ranks_resumes_at_another_world_size_as_another_strategy[2-ddp]")


@pytest.mark.parametrize("world, strategy", [(2, "ddp"), pytest.param(3, "zero2", marks=SLOW),
                                             pytest.param(1, "single", marks=SLOW)])
def test_zero3_at_4_ranks_resumes_at_another_world_size_as_another_strategy(ranks, straight, tmp_path,
                                                                            world, strategy):
    straight_dir, straight_loss = straight
    ckpt = straight_dir / "checkpoints" / "step_00000008"
    resumed = ranks(world).run(train_on_rank, cfg(strategy), str(tmp_path / "resumed"), str(ckpt), timeout_s=300)
    log = (tmp_path / "resumed" / "logs" / "rank_0.log").read_text()
    assert f"resumed step 8 of zero3 at 4 ranks as {strategy} at {world} ranks" in log
    assert f"global batch 12 = 1 x {12 // world} x {world}" in log  # kept: grad_accum adapted
    compare_with_straight(straight_dir, tmp_path / "resumed", straight_loss, resumed[0]["train/loss"],
                          f"zero3@4 -> {strategy}@{world}")


HOPS = [(1, "single"), (2, "ddp"), (3, "zero2"), (4, "zero3"), (2, "zero1"), (4, "hsdp2"), (4, "hsdp3"),
        (2, "native_ddp"), (3, "native_zero1"), (3, "native_fsdp"), (4, "native_hsdp"), (4, "ddp_hierarchical")]
SEEDS = range(7)  # together, their chains visit every hop (test_the_chains_visit_every_strategy)


def chain_of(seed: int) -> list[tuple[int, str]]:
    return random.Random(seed).sample(HOPS, 3)


def test_the_chains_visit_every_strategy_but_deepspeeds():
    """Every strategy that computes what the others do (DiLoCo's are other algorithms, checked by
    the loss: tests/test_diloco.py resumes them across strategies and world sizes)."""
    from minidist.train.strategies import specs

    assert {h for s in SEEDS for h in chain_of(s)} == set(HOPS)
    assert {name for _, name in HOPS} == {s.name for s in specs(shipped_only=True)
                                          if s.checkpoint != "deepspeed" and s.checked_by == "parameters"}


@pytest.mark.slow(stand_in="test_zero3_at_4_ranks_resumes_at_another_world_size_as_another_strategy")
@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_chain_of_world_sizes_and_strategies_equals_the_straight_run(ranks, straight, tmp_path, seed):
    """16 steps in four hops of 4, each hop a random (world size, strategy) from the checkpoint
    the previous one left (the first from the straight run's step 4)."""
    straight_dir, straight_loss = straight
    chain = chain_of(seed)
    ckpt, run_dir, loss = straight_dir / "checkpoints" / "step_00000004", None, None
    for k, (world, strategy) in enumerate(chain):
        run_dir = tmp_path / f"hop{k}"
        end = 8 + 4 * k if k < len(chain) - 1 else 16
        summary = ranks(world).run(train_on_rank, cfg(strategy, f"trainer.stop_at={end}"), str(run_dir), str(ckpt),
                                   timeout_s=300)[0]
        ckpt, loss = list_checkpoints(run_dir)[-1], summary["train/loss"]
    ids = {}
    for k in range(len(chain)):
        ids.update(steps_consumed(tmp_path / f"hop{k}"))
    assert ids == {s: v for s, v in steps_consumed(straight_dir).items() if s > 4}, chain
    last_hop_from = 8 + 4 * (len(chain) - 2) + 1
    compare_with_straight(straight_dir, run_dir, straight_loss, loss, f"chain {chain}", first_step=last_hop_from)


def test_what_cannot_continue_is_refused_in_one_line_naming_the_fix():
    from minidist.train.config_check import check_layouts_meet, grad_accum_on_resume
    from minidist.train.config import ConfigError
    from train_cases import compose_cfg, tiny_overrides

    cfg = compose_cfg(tiny_overrides(*BATCH))
    meta = {"strategy": "zero3", "world_size": 4, "layout": "sharded", "config": tiny(*BATCH, strategy="zero3"),
            "data": {"global_batch": 12, "consumed": 96, "epoch": 0, "num_samples": 5937, "seed": 1337}}
    assert grad_accum_on_resume(cfg, meta, 2) == (6, None) and grad_accum_on_resume(cfg, meta, 12) == (1, None)
    with pytest.raises(ConfigError, match="global batch of 12, which 5 ranks x trainer.micro_batch_size=1 = 5 does not "
                                          "divide"):
        grad_accum_on_resume(cfg, meta, 5)
    changed = compose_cfg(tiny_overrides(*BATCH, "trainer.grad_accum=1"))  # the user's own choice: said
    assert grad_accum_on_resume(changed, meta, 4) == (1, "global batch 12 -> 4 (trainer.grad_accum set)")
    ds = {**meta, "strategy": "ds_zero2", "layout": "deepspeed"}
    with pytest.raises(ConfigError, match="DeepSpeed's engine reads only its own checkpoints, at the world size that "
                                          "wrote them. Resume with strategy=ds_zero2 launcher.nproc=4"):
        check_layouts_meet(cfg, Path("ckpt"), ds, 4)
    check_layouts_meet(compose_cfg(tiny_overrides(*BATCH, strategy="ds_zero2")), Path("ckpt"), ds, 4)  # its own


@pytest.mark.slow(stand_in="test_zero3_at_4_ranks_resumes_at_another_world_size_as_another_strategy[2-ddp]")
@pytest.mark.parametrize("world, strategy", [(3, "native_fsdp"), (2, "zero2")])
def test_a_dcp_checkpoint_written_without_a_gather_resumes_anywhere(ranks, straight, tmp_path, world, strategy):
    """native_fsdp saves through torch.distributed.checkpoint: a file per rank, nothing gathered to
    rank 0. Its checkpoint continues at another world size (DCP re-cuts the shards) and as one of
    our strategies (read whole, it is the portable form), equal to the straight run."""
    straight_dir, straight_loss = straight
    fsdp = tmp_path / "fsdp"
    ranks(2).run(train_on_rank, cfg("native_fsdp", "trainer.stop_at=12"), str(fsdp),
                 str(straight_dir / "checkpoints" / "step_00000008"), timeout_s=300)
    ckpt = list_checkpoints(fsdp)[-1]
    assert ckpt.name == "step_00000012" and read_meta(ckpt)["layout"] == "dcp"
    assert sorted(p.name for p in (ckpt / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (ckpt / "model.pt").exists() and not (ckpt / "optimizer.pt").exists()
    resumed = ranks(world).run(train_on_rank, cfg(strategy), str(tmp_path / "resumed"), str(ckpt), timeout_s=300)
    log = (tmp_path / "resumed" / "logs" / "rank_0.log").read_text()
    assert f"resumed step 12 of native_fsdp at 2 ranks as {strategy} at {world} ranks" in log
    compare_with_straight(straight_dir, tmp_path / "resumed", straight_loss, resumed[0]["train/loss"],
                          f"native_fsdp@2 (dcp) -> {strategy}@{world}", first_step=13)
