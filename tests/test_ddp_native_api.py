"""Native DDP's public behaviours PyTorch's own c10d tests check on CPU (test_c10d_gloo.py and the common
tests it inherits; read, not copied), with DataParallel: register_comm_hook with torch's hooks and its
rules, torch.save / torch.load of the wrapper, a state_dict checkpoint, ignored outputs, locally and globally unused parameters,
and the modules it refuses (no trainable parameter, sparse gradients). Cases: torch_ddp_cases.py. Bucket
assignment: test_buckets.py::test_reach_closing_is_native_ddps_layout."""

import pytest

import torch_ddp_cases


@pytest.mark.parametrize("hook", ["allreduce", "fp16", "bf16", "powerSGD", "then"])
def test_native_comm_hooks_equal_native_ddp(ranks, hook):
    for rank, r in enumerate(ranks(2).run(torch_ddp_cases.native_comm_hook_runs, hook)):
        assert r["bitwise"], f"rank {rank}: {hook} hook differs from native DDP's by {r['rel']:.3g}"


def test_comm_hook_registration_rules_are_natives(ranks):
    errors = ranks(2).run(torch_ddp_cases.comm_hook_rules)[0]
    assert "register_comm_hook or register_builtin_comm_hook can only be called once" in errors["twice"]
    assert errors["future value"] == ""  # the Future's tensor is what the gradients become
    assert errors["not callable"] == "TypeError: Communication hook must be callable."
    assert errors["bucket annotation"].startswith("ValueError: Communication hook: bucket annotation")
    assert errors["return annotation"].startswith("ValueError: Communication hook: return annotation")
    assert "callback must return a torch.futures.Future object, but got <class 'int'>" in errors["no future"]
    assert "before training" in errors["after backward"]
    assert "can only be called once" in errors["beside comm_hook="]


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True])
def test_a_pickled_wrapper_trains_in_sync_as_natives(ranks, tmp_path, gradient_as_bucket_view):
    for rank, r in enumerate(ranks(2).run(torch_ddp_cases.pickled_wrapper_trains_like_native,
                                          gradient_as_bucket_view, str(tmp_path))):
        assert r["ranks_agree"], f"rank {rank}: the loaded wrapper trains out of sync"
        assert r["bitwise"], f"rank {rank}: the loaded wrapper's training differs from native DDP's"


def test_a_state_dict_checkpoint_resumes_as_natives(ranks, tmp_path):
    for rank, r in enumerate(ranks(2).run(torch_ddp_cases.state_dict_checkpoint_like_native, str(tmp_path))):
        assert r["plain_loads"], f"rank {rank}: the wrapper's state_dict, prefix consumed, loads otherwise into a module"
        assert r["resumed_as_unbroken"] and r["as_native"], f"rank {rank}: {r}"


def test_construction_refuses_what_it_cannot_reduce(ranks):
    errors = ranks(2).run(torch_ddp_cases.construction_errors)[0]
    assert errors["no trainable parameter"].startswith("RuntimeError: DataParallel: the module has no parameter")
    assert errors["frozen"].startswith("RuntimeError")
    assert "sparse=False" in errors["sparse"] and "'0' (EmbeddingBag)" in errors["sparse"]
    assert errors["sparse frozen"] == ""
    assert "default process group" in errors["pickle on a subgroup"] and "state_dict()" in errors["pickle on a subgroup"]


def test_ignored_outputs_and_unused_parameters_as_natives(ranks):
    for rank, r in enumerate(ranks(2).run(torch_ddp_cases.unused_and_ignored_outputs)):
        assert r["same_none"] and r["unused_none"], f"rank {rank}: .grad None where native's is not, or back"
        assert r["equal"], f"rank {rank}: gradients differ from native DDP's"


def test_sharded_data_parallel_refuses_a_ddp_scripts_native_calls_naming_the_way(ranks):
    errors = ranks(2).run(torch_ddp_cases.sharded_refusals)[0]
    for stage in (1, 2, 3):
        assert errors[f"save {stage}"].startswith("TypeError: ShardedDataParallel cannot be pickled"), errors
        assert "full_state_dict()" in errors[f"save {stage}"]
        assert errors[f"hook {stage}"].startswith("NotImplementedError") and "grad_wire=" in errors[f"hook {stage}"]
