"""One owner per checkpoint layout (issue 28, part 0): checkpoint_layouts.py's Full, Sharded and
DeepSpeedLayout save, load, report shapes and consolidate; strategies expose state, not files;
the sharded format is read in one module (minidist.parallel.flat_shard)."""

import ast
from types import SimpleNamespace

import pytest
import torch

from minidist.parallel.flat_shard import assemble, full_parameters
from minidist.train.checkpoint_layouts import LAYOUTS, layout_of
from minidist.train.strategies import specs
from train_cases import ROOT


def test_every_strategy_has_a_layout_and_a_checkpoint_names_its_own():
    assert {s.checkpoint for s in specs()} <= set(LAYOUTS)
    assert layout_of({"layout": "sharded", "world_size": 4}).name == "sharded"
    # written before meta.pt named its layout: the sharded flag, else the strategy's spec
    assert layout_of({"sharded": True, "strategy": "zero2", "world_size": 2}).name == "sharded"
    assert layout_of({"sharded": False, "strategy": "ds_zero2", "world_size": 2}).name == "deepspeed"
    assert layout_of({"sharded": False, "strategy": "ddp", "world_size": 2}).name == "full"
    assert LAYOUTS["sharded"].shards({"world_size": 4}) == 4 and LAYOUTS["sharded"].shards({"world_size": 4,
                                                                                              "shards": 2}) == 2


def test_strategies_expose_state_and_never_open_files():
    for path in sorted((ROOT / "minidist" / "train" / "strategies").glob("*.py")):
        names = {a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)
                 for a in n.names}
        assert not names & {"save_tensors", "load_tensors", "verify_checkpoint_files"}, path.name


def test_pieces_from_any_cut_assemble_the_whole_parameter_and_a_gap_is_named():
    whole = torch.arange(10.0).view(2, 5)
    flat = whole.reshape(-1)
    states = [{"shapes": {"w": (2, 5)}, "params": {"w": [(0, flat[:3])]}},
              {"shapes": {"w": (2, 5)}, "params": {"w": [(3, flat[3:7]), (7, flat[7:])]}}]
    assert torch.equal(full_parameters(states)["w"], whole)
    with pytest.raises(ValueError, match="the shards hold 7 of the 10 values of 'w'; is a shard file missing"):
        assemble("w", (2, 5), states[1]["params"]["w"])


@pytest.mark.parametrize("rank,world,files", [(0, 2, {"model.pt"}), (1, 2, {"optimizer.pt"}),
                                              (1, 4, set()), (0, 1, {"model.pt", "optimizer.pt"})])
def test_a_full_checkpoint_has_two_writers_the_model_on_rank_0_the_optimizer_on_the_last(rank, world, files):
    class Replicated:  # as base.Strategy answers: the model on rank 0, the optimizer on the rank asked for
        ctx = SimpleNamespace(rank=rank, world_size=world)
        full_state_dict = staticmethod(lambda: {"w": torch.ones(2)} if rank == 0 else {})
        optimizer_state_dict = staticmethod(lambda on=0: {"state": {}, "param_groups": []} if rank == on else {})
        name_groups = staticmethod(lambda optim: optim)

    assert set(LAYOUTS["full"].collect(Replicated())) == files
