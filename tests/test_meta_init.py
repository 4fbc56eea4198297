"""A model built on the meta device, wrapped at stage 3 (and hsdp3): materialised unit by unit
into the shards (minidist/parallel/meta_init.py), bitwise the values of initialising the whole
model (drawn slice by slice), at a peak of the shards plus one unit's buffer that nothing writes (so
none of its pages is resident: scripts/measure_meta_wrap.py measures the resident set); what stages
1-2, DataParallel and FSDP2's own idiom get instead."""

import itertools

import pytest
import torch

from meta_cases import init_fn_and_refusals, wrap_meta_built


@pytest.mark.parametrize("world, mesh_shape", [(2, None), (4, (2, 2))])
def test_a_meta_built_model_is_materialised_into_its_shards_as_a_whole_one_would_be(ranks, world, mesh_shape):
    for r in ranks(world).run(wrap_meta_built, mesh_shape):
        assert r["same"], "the weights differ from materialising the whole model with rank 0's seed"
        assert r["after_same"], "the generator is not where initialising the whole model leaves it"
        # live storages while wrapping: at most this rank's shards plus one unit's unwritten buffer (and 64 KiB
        # of small tensors: the buffer random fills are drawn through)
        assert r["largest_unit"] <= r["peak"] <= r["shards"] + r["largest_unit"] + 64 * 1024, r
        assert r["peak"] < 0.75 * r["model"], r  # the whole model never was


def test_init_fn_and_what_is_refused(ranks):
    out = ranks(2).run(init_fn_and_refusals)[0]
    assert out["init_fn_same"] and out["to_empty"], out
    assert "already initialised the model while wrapping" in out["reset"] and "Drop the" in out["reset"], out
    assert "(gain, offset) and no reset_parameters()" in out["no_reset"] and "init_fn=" in out["no_reset"], out
    assert "touches a tensor of another module" in out["tangled"] and "init_fn=" in out["tangled"], out
    for wrapper in ("stage2", "ddp"):
        assert "meta device" in out[wrapper] and "ShardedDataParallel(stage=3)" in out[wrapper], (wrapper, out)
    assert "leave init_fn out" in out["init_fn_built"], out
    assert "Use stage=3" in out["init_fn_stage2"], out


@pytest.mark.parametrize("build", [lambda: torch.nn.Embedding(1001, 33), lambda: torch.nn.Linear(301, 129)],
                         ids=["normal_", "uniform_"])
def test_a_layer_initialised_slice_by_slice_gets_the_whole_draws(build):
    """_SliceInit draws a random fill in chunks (33,033 elements: two chunks and a tail for normal_'s
    blocks of 16); every rank's slice holds the whole initialisation's values, and the generator ends
    where it would."""
    from minidist.parallel.meta_init import _SliceInit

    torch.manual_seed(5)
    whole = build()
    expected, after = torch.cat([p.detach().reshape(-1) for p in whole.parameters()]), torch.rand(3)
    with torch.device("meta"):
        net = build()
    offsets = itertools.accumulate([p.numel() for p in net.parameters()], initial=0)
    where = {id(p): at for p, at in zip(net.parameters(), offsets)}
    for lo, hi in [(0, 7), (5000, 21000), (16370, expected.numel())]:
        torch.manual_seed(5)
        out = torch.full((hi - lo,), float("nan"))
        with _SliceInit(where, out, lo, hi), torch.no_grad():
            net.reset_parameters()
        assert torch.equal(out, expected[lo:hi]) and torch.equal(torch.rand(3), after), (lo, hi)
