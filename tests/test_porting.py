"""Porting a native script: the idioms around the wrapper (porting_cases.py), on 2 gloo ranks.

The user's own optimizer with param groups (and a scheduler built on it before wrapping),
torch.amp.GradScaler with an overflow on one shard, the rank-0 optimizer snapshot (refused: it
holds one rank's shard) and the full one that works, native DDP's and FSDP2's keyword arguments,
meta-device models, the default stage-3 units. Each against native DDP on every rank, bitwise
where the arithmetic allows (no clipping: ZeRO's global norm sums squares shard by shard).
"""

import pytest

import porting_cases as cases

SHARDED = ["zero1", "zero2", "zero3"]


@pytest.mark.parametrize("kind", ["ddp", *SHARDED])
def test_the_users_optimizer_with_param_groups_equals_native_ddp(ranks, kind):
    for r in ranks(2).run(cases.param_groups_match_native, kind):
        assert r["vs_native"][0], f"not bitwise equal to native DDP: {r['vs_native'][1]:.1e}"
        assert r["groups"], "learning rates / weight decays per group differ from native's"
        assert r["groups_matter"], "one-group AdamW gave the same result: the groups were not applied"
        assert r["ranks_agree"]


@pytest.mark.slow(stand_in="test_the_users_optimizer_with_param_groups_equals_native_ddp")  # at 2 ranks in make test
@pytest.mark.parametrize("kind", ["zero2", "zero3"])
def test_param_groups_at_3_ranks_padded_shards_and_empty_pieces(ranks, kind):
    """3 ranks: padded shards, and pieces of a group a rank's slice does not reach (empty)."""
    for r in ranks(3).run(cases.param_groups_match_native, kind):
        assert r["vs_native"][1] <= 1e-6, r["vs_native"]  # three partial sums: in another order than native's
        assert r["groups"] and r["groups_matter"] and r["ranks_agree"]


@pytest.mark.slow(stand_in="test_grad_scaler_skips_an_overflow_on_one_shard_on_every_rank")  # and the 2-rank param-group tests
@pytest.mark.parametrize("kind", ["hsdp2", "hsdp3"])
def test_param_groups_and_grad_scaler_on_a_2x2_mesh(ranks, kind):
    for r in ranks(4).run(cases.param_groups_match_native, kind):
        assert r["vs_native"][1] <= 1e-6 and r["groups"] and r["groups_matter"] and r["ranks_agree"], r
    for r in ranks(4).run(cases.scaler_with_overflow_on_one_shard, kind, False, timeout_s=120):
        assert r["scales"] == r["native_scales"] and r["scales_agree"] and r["ranks_agree"]
        assert r["vs_native"][1] <= 1e-6, r["vs_native"]


@pytest.mark.slow(stand_in="test_a_full_optimizer_snapshot_resumes_exactly_and_is_native_ddps")  # and test_zero's one-group resharding
@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_checkpoints_with_param_groups_reshard_4_to_2(ranks, stage):
    saved = ranks(4).run(cases.reshard_with_groups, stage)
    reference, groups = saved[0][1], saved[0][2]
    for _, state, loaded_groups in ranks(2).run(cases.reshard_with_groups, stage, [s[0] for s in saved]):
        assert cases.same(state, reference)[1] <= 1e-6  # four partial sums before, two after
        assert loaded_groups == groups


def test_optimizers_a_flat_shard_cannot_step_are_refused(ranks):
    adafactor, unknown, missing, foreign = ranks(2).run(cases.refused_optimizers)[0]
    assert "cannot shard Adafactor" in adafactor and "DataParallel" in adafactor
    assert "not known to be element-wise" in unknown and "register_elementwise_optimizer" in unknown
    assert "does not hold these trainable parameters: net.0.weight" in missing
    assert "not parameters of the wrapped module" in foreign


def test_a_registered_elementwise_optimizer_trains_as_under_native_ddp(ranks):
    for bitwise, diff in ranks(2).run(cases.registered_elementwise_optimizer):
        assert bitwise, diff


@pytest.mark.parametrize("kind", SHARDED)
def test_the_rank0_optimizer_snapshot_is_refused_when_it_is_saved(ranks, kind):
    rank0, rank1 = ranks(2).run(cases.rank0_optimizer_snapshot, kind)
    assert "holds only this rank's shard" in rank0, rank0
    assert "model.full_optim_state_dict(rank0_only=True)" in rank0 and "model.sharded_state_dict()" in rank0
    assert rank1 == "not asked"


@pytest.mark.parametrize("kind", ["ddp", *SHARDED])
def test_a_full_optimizer_snapshot_resumes_exactly_and_is_native_ddps(ranks, kind):
    for r in ranks(2).run(cases.full_optimizer_snapshot, kind):
        assert r["before_wrapping"][0], f"resumed as minGPT does: {r['before_wrapping'][1]:.1e}"
        assert r["after_wrapping"][0], f"resumed after wrapping: {r['after_wrapping'][1]:.1e}"
        assert r["full_state_as_native"], "full_optim_state_dict() is not what native DDP's optimizer holds"
        assert r["from_native"][0], f"a native DDP snapshot resumed here: {r['from_native'][1]:.1e}"


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("kind", SHARDED)
def test_grad_scaler_skips_an_overflow_on_one_shard_on_every_rank(ranks, kind, clip):
    for r in ranks(2).run(cases.scaler_with_overflow_on_one_shard, kind, clip, timeout_s=120):
        assert r["scales"] == r["native_scales"], (r["scales"], r["native_scales"])
        assert r["native_scales"][2] < r["native_scales"][1]  # the overflow really happened
        assert r["scales_agree"] and r["ranks_agree"]
        # clipping: the norm is the global one summed shard by shard, not torch's per-tensor norms
        assert r["vs_native"][0] if not clip else r["vs_native"][1] <= 1e-6, r["vs_native"]


def test_native_keyword_arguments_are_accepted_with_their_meaning_or_refused(ranks):
    r = ranks(2).run(cases.native_keyword_arguments)[0]
    for accepted in ("ddp: device_ids=None, static_graph, dim, check_reduction", "ddp: device_ids=[the module's device]",
                     "ddp: device_mesh (1-D)", "zero3: mp_policy", "zero3: reshard_after_forward=False",
                     "zero3: reshard_after_forward=2",  # FSDP2's reshard to G ranks: hpZ's secondary shard
                     "zero3: mesh=DeviceMesh (1-D)"):
        assert r[accepted] == "accepted", (accepted, r[accepted])
    assert "device_ids=None for a CPU module" in r["ddp: device_ids=[1]"]
    assert "one process drives one device" in r["ddp: device_ids=[cpu, cpu]"]
    assert "outputs stay where the module computes" in r["ddp: output_device=1"]
    assert "does not take mixed_precision" in r["ddp: mixed_precision"] and "comm_hook" in r["ddp: mixed_precision"]
    assert "unexpected keyword argument(s) ['bucket_capmb']" in r["ddp: a typo"]
    assert "cannot reshard after forward: use stage=3" in r["zero2: reshard_after_forward=True"]
    assert "divides the shard group's 2" in r["zero3: reshard_after_forward=3"]
    assert "give True" in r["zero3: reshard_after_forward='yes'"]
    assert "does not take offload_policy" in r["zero3: offload_policy"] and "no CPU offload" in r["zero3: offload_policy"]
    assert "minidist.init_mesh" in r["zero3: mesh=DeviceMesh (2-D)"]
    for stage in (2, 3):  # names the argument, not an internal class
        message = r[f"zero{stage}: no optimizer"]
        assert "needs the optimizer" in message and "ZeroStage" not in message
    assert "unexpected keyword argument(s) ['min_unit_param']" in r["zero3: a typo"]


def test_init_sync_false_broadcasts_nothing(ranks):
    assert ranks(2).run(cases.init_sync_false) == [True, True]


@pytest.mark.parametrize("stage", [2, 3])
def test_fsdp2_mixed_precision_policy_means_param_and_reduce_dtype(ranks, stage):
    import torch
    for (bitwise, diff), policy_dtypes, argument_dtypes in ranks(2).run(cases.mixed_precision_policy, stage):
        assert bitwise, diff
        assert policy_dtypes == {torch.float32} and argument_dtypes == {torch.bfloat16}  # output_dtype


def test_reshard_after_forward_false_keeps_units_gathered_until_backward(ranks):
    for r in ranks(2).run(cases.reshard_after_forward_false):
        assert r["equal"][0], r["equal"]
        reshard, keep = r["after_forward"]
        assert not any(reshard) and all(keep)
        assert not any(r["after_inference"])  # no backward will come: freed
        assert r["gathers"] == (2 * r["units"], r["units"])  # forward and backward, or forward only


def test_meta_device_models_are_refused_below_stage_3_naming_the_ways(ranks):
    for name, message in ranks(2).run(cases.meta_device_is_refused)[0].items():
        assert "ShardedDataParallel(stage=3)" in message and "to_empty" in message, (name, message)


def test_moving_or_casting_a_wrapped_model_is_refused_unless_a_no_op(ranks):
    r = ranks(2).run(cases.move_or_cast_after_wrapping)[0]
    for stage in (2, 3):
        assert r[f"zero{stage} .to(cpu)"] == "accepted"
        assert "Move or cast the module before wrapping" in r[f"zero{stage} .double()"]


def test_default_units_are_the_repeated_blocks(ranks):
    r = ranks(2).run(cases.default_units)[0]
    assert r["gpt"] == ["<root>"] + [f"blocks.{i}" for i in range(10)]  # blocks of ~3k parameters each
    assert r["gpt_size_rule"] == ["<root>"]
    assert r["resnet18"] == ["<root>"] + [f"layer{a}.{b}" for a in range(1, 5) for b in range(2)]


def test_stage3_state_dict_refusal_names_the_loading_side_too(ranks):
    message, same_keys = ranks(2).run(cases.stage3_state_dict_refusal)[0]
    assert "model.full_state_dict()" in message and "model.module.load_state_dict(full)" in message
    assert same_keys


def test_data_parallel_has_the_full_optimizer_state_api_too(ranks):
    assert ranks(2).run(cases.data_parallel_full_optim_state) == [(True, False), (True, True)]
