"""Scripts written for native PyTorch, run with minidist swapped in (tests/client_scripts/).

Three scripts in the style of pytorch/examples — the DDP tutorial's torchrun script (model
snapshots, resume), minGPT-ddp (decay / no-decay param groups, fp16 autocast + GradScaler,
torch.nn.utils.clip_grad_norm_, model + optimizer snapshots loaded before wrapping), and the
FSDP2 example (fully_shard per block, MixedPrecisionPolicy, DCP's full state dicts) — each run
as written (native DDP / fully_shard) and ported (client_scripts/wrappers.py: DataParallel with
only the import changed; ShardedDataParallel given the script's optimizer), on 2 ranks: every
rank's final state equals native's, and a stopped and restarted run equals an unbroken one.
The slow test runs them under torchrun as a user would.
"""

import os
import subprocess
import sys

import pytest
import torch

import client_cases as cases
from porting_cases import optimizer_states_equal, same

HERE = os.path.dirname(os.path.abspath(__file__))


def assert_same(ours: dict, reference: dict, what: str, tol: float = 0.0) -> None:
    bitwise, diff = same(ours, reference)
    assert bitwise if tol == 0 else diff <= tol, f"{what}: {diff:.1e} from the reference"


def test_ddp_tutorial_script(ranks, tmp_path):
    native = ranks(2).run(cases.tutorial, "native", str(tmp_path))
    for how in ("ddp", "zero1", "zero2"):
        for rank, ((straight, resumed), (native_straight, native_resumed)) in enumerate(
                zip(ranks(2).run(cases.tutorial, how, str(tmp_path)), native)):
            assert_same(straight, native_straight, f"{how} rank {rank} vs native")
            assert_same(resumed, straight, f"{how} rank {rank}: resumed vs unbroken")
            assert_same(native_resumed, native_straight, f"native rank {rank}: resumed vs unbroken")


# minGPT clips the scaled gradients by 1.0, so clipping acts at every step; 1e12 turns it off.
# Clipping at ZeRO stages divides by a norm made of each rank's part (sharded_grad.py): the same
# number up to its last bits, which Adam (eps=1e-8) turns into up to lr-sized steps where a
# gradient is near zero: 2.4e-5 measured (zero1/2; zero3 1.1e-5). Everything else is bitwise.
MINGPT_TOLERANCE = {(False, 1.0): 5e-5}


def test_ddp_tutorial_script_at_stage3_names_full_state_dict(ranks, tmp_path):
    rank0, rank1 = ranks(2).run(cases.tutorial_at_stage3, str(tmp_path))
    assert "model.full_state_dict()" in rank0 and "model.module.load_state_dict(full)" in rank0
    assert rank1 == "trained"  # only rank 0 saves


# make test runs one of the eight, zero2 without clipping, bitwise (DataParallel ported by the import
# alone: the nanoGPT script); make test-all the others.
SLOW = pytest.mark.slow(stand_in="test_mingpt_script[zero2-1000000000000.0]")
MINGPT_CASES = [("zero2", 1e12),
                *(pytest.param(h, c, marks=SLOW) for h, c in [("ddp", 1e12), ("ddp", 1.0), ("zero1", 1.0), ("zero2", 1.0),
                                                            ("zero3", 1.0), ("zero1", 1e12), ("zero3", 1e12)])]


@pytest.mark.parametrize("how, grad_norm_clip", MINGPT_CASES)
def test_mingpt_script(ranks, tmp_path, how, grad_norm_clip):
    native = ranks(2).run(cases.mingpt_runs, "native", str(tmp_path), grad_norm_clip)
    tol = MINGPT_TOLERANCE.get((how == "ddp", grad_norm_clip), 0.0)
    for rank, ((straight, resumed), (native_straight, _)) in enumerate(
            zip(ranks(2).run(cases.mingpt_runs, how, str(tmp_path), grad_norm_clip), native)):
        assert straight["scale"] == native_straight["scale"]
        assert_same(straight["model"], native_straight["model"], f"{how} rank {rank} vs native", tol)
        assert_same(resumed["model"], straight["model"], f"{how} rank {rank}: resumed vs unbroken")


SLOW_FSDP2 = pytest.mark.slow(stand_in="test_fsdp2_example_script[zero3-False]")


@pytest.mark.parametrize("how, mixed_precision", [("zero3", False), pytest.param("zero3", True, marks=SLOW_FSDP2),
                                                  pytest.param("zero2", False, marks=SLOW_FSDP2)])
def test_fsdp2_example_script(ranks, tmp_path, how, mixed_precision):
    native = ranks(2).run(cases.fsdp2_runs, "native", str(tmp_path), mixed_precision)
    for rank, (ours, ref) in enumerate(zip(ranks(2).run(cases.fsdp2_runs, how, str(tmp_path), mixed_precision),
                                           native)):
        # fully_shard and we sum the same numbers in another order: within 1e-6, not bitwise
        assert_same(ours["straight"], ref["straight"], f"{how} rank {rank} vs fully_shard", tol=1e-6)
        assert_same(ours["resumed"], ours["straight"], f"{how} rank {rank}: resumed vs unbroken")
        assert_same(ours["from_native"], ref["straight"], f"{how} rank {rank}: resumed from fully_shard's "
                    "checkpoint", tol=1e-6)


def test_fsdp2_example_built_on_meta_at_stage_3_and_below(ranks):
    """Built on meta, stage 3 initialises while wrapping what the model's constructor gives on the
    device (its modules' reset_parameters() in the order they were made), bitwise; from there the
    example trains as test_fsdp2_example_script checks. (Not against fully_shard's own meta path:
    on CPU each rank draws its DTensor shard from its own generator, another set of values.)"""
    native, ours = ranks(2).run(cases.fsdp2_init, "native", False), ranks(2).run(cases.fsdp2_init, "zero3", True)
    for rank, (ref, init) in enumerate(zip(native, ours)):
        assert_same(init, ref, f"rank {rank}: initialised on meta")
    refused = ranks(2).run(cases.fsdp2_init, "zero2", True)[0]
    assert "meta device" in refused and "ShardedDataParallel(stage=3)" in refused, refused


def assert_nanogpt_run_is(ours: dict, native: dict, what: str) -> None:
    """Weights, the optimizer's whole state and every loss computed, bitwise."""
    assert_same(ours["model"], native["model"], what)
    assert optimizer_states_equal(ours["optimizer"], native["optimizer"]), f"{what}: optimizer state differs"
    assert ours["losses"] == native["losses"], f"{what}: losses differ"


# nanoGPT's loop: 4 micro-batches a step, synchronisation switched by `model.require_backward_grad_sync
# = ...`, torch's clipping, rank-0 evaluation and checkpoints, init_from="resume"; under torch.compile
# (aot_eager here: dynamo's graphs and AOTAutograd's backward around the wrapper's hooks) too.
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow(
    stand_in="test_nanogpt_script_ported_by_the_import_alone_is_bitwise_native[False]"))])  # compiled: make test-all
def test_nanogpt_script_ported_by_the_import_alone_is_bitwise_native(ranks, tmp_path, compiled):
    native = ranks(2).run(cases.nanogpt_runs, "native", str(tmp_path), compiled)
    ours = ranks(2).run(cases.nanogpt_runs, "ddp", str(tmp_path), compiled)
    for rank, ((straight, resumed), (native_straight, native_resumed)) in enumerate(zip(ours, native)):
        assert_nanogpt_run_is(straight, native_straight, f"rank {rank} straight")
        assert_nanogpt_run_is(resumed, native_resumed, f"rank {rank} resumed")
        assert_same(resumed["model"], straight["model"], f"rank {rank}: resumed vs unbroken")


@pytest.mark.parametrize("how", ["zero1", "zero2", "zero3"])
def test_nanogpt_script_at_zero_stages_with_the_toggle_is_bitwise_native(ranks, tmp_path, how):
    """The ZeRO ports (checkpoints gathered on every rank; at stage 3 the evaluation on every rank),
    without clipping: a sharded norm's last bits are its own (MINGPT_TOLERANCE), the toggle is not."""
    native = ranks(2).run(cases.nanogpt_runs, "native", str(tmp_path), grad_clip=0.0)
    ours = ranks(2).run(cases.nanogpt_runs, how, str(tmp_path), grad_clip=0.0)
    rank0_evals = [run["losses"]["eval"] for run in native[0]]
    for rank, ((straight, resumed), (native_straight, native_resumed)) in enumerate(zip(ours, native)):
        if how == "zero3":  # every rank evaluated: what native's rank 0 alone did
            assert [run["losses"].pop("eval") for run in (straight, resumed)] == rank0_evals
            native_straight["losses"].pop("eval"), native_resumed["losses"].pop("eval")
        assert_nanogpt_run_is(straight, native_straight, f"{how} rank {rank} straight")
        assert_nanogpt_run_is(resumed, native_resumed, f"{how} rank {rank} resumed")


@pytest.mark.parametrize("how", ["native", "ddp", "zero1", "zero2", "zero3"])
def test_the_toggle_holds_back_every_gradient_collective_but_the_steps_last(ranks, tmp_path, how):
    """Gradient collectives over 2 optimizer steps: as many with 4 micro-batches a step as with 1,
    and DataParallel's all_reduces as many as native DDP's."""
    one, four = ranks(2).run(cases.nanogpt_gradient_collectives, how, str(tmp_path))[0]
    assert one == four > 0, f"{how}: {one} gradient collectives with 1 micro-batch a step, {four} with 4"
    if how == "ddp":
        assert four == ranks(2).run(cases.nanogpt_gradient_collectives, "native", str(tmp_path))[0][1]


def test_nanogpt_rank0_evaluation_at_stage3_fails_on_every_rank_naming_the_fix(ranks, tmp_path):
    """Rank 0's evaluation forward meets rank 1's training forward: each gathers from every rank, so
    both stop at once, saying which forward each rank ran and what to do, not gloo's size mismatch."""
    for rank, message in enumerate(ranks(2).run(cases.nanogpt_rank0_evaluation_at_stage3, str(tmp_path))):
        assert "rank 0: forward #1, no_grad, eval; rank 1: forward #1, with grad, train" in message, message
        assert "run the evaluation on every rank" in message and "model.full_state_dict()" in message
        assert len(message.splitlines()) == 1


# torch 2.14's gloo now and then aborts a rank as a script destroys its process group at the end:
# 2 of 30 runs of a 12-line native DDP script under torchrun here, and the native tutorial 1 of 16
# (its port, 0 of 16), FSDP2's example 2 of 30 (2026-12-06; a make test-all saw it abort twice in a row).
# The native runs are the reference here, not what is tested: such a run is run again, up to twice,
# each time in a folder of its own (the tutorial resumes from a snapshot it finds).
TORCH_TEARDOWN_ABORT = "terminate called without an active exception"


def torchrun(script: str, *args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(HERE, "client_scripts")}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--standalone", os.path.join(HERE, "client_scripts", script), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow(stand_in="test_mingpt_script")  # the same scripts under torchrun; make test runs them in-process
def test_client_scripts_under_torchrun(tmp_path):
    """As a user runs them: each script under torchrun, as written and ported; the ported run's
    final parameters equal the native run's. The tutorial's rank-0 model snapshot at stage 3 ends
    the job with the error naming full_state_dict() (rank 0 raises, torchrun stops rank 1)."""
    runs = [("ddp_tutorial.py", ["3", "1"], "zero2", 0.0),
            ("mingpt.py", ["--epochs", "1"], "zero3", MINGPT_TOLERANCE[(False, 1.0)]),
            ("fsdp2_example.py", ["--steps", "4"], "zero3", 1e-6)]
    for script, args, how, tol in runs:
        finals = {}
        for wrap in ("native", how):
            d = tmp_path / f"{script}_{wrap}"
            d.mkdir()
            done = torchrun(script, *args, "--wrap", wrap, "--out", "final.pt", cwd=d)
            for again in range(2):  # (the reference, aborted by torch at its teardown: see above)
                if wrap != "native" or done.returncode == 0 or TORCH_TEARDOWN_ABORT not in done.stderr:
                    break
                d = tmp_path / f"{script}_{wrap}_again{again}"
                d.mkdir()
                done = torchrun(script, *args, "--wrap", wrap, "--out", "final.pt", cwd=d)
            assert done.returncode == 0, f"{script} --wrap {wrap}:\n" + done.stderr[-3000:]
            finals[wrap] = torch.load(d / "final.pt", weights_only=True)
        assert_same(finals[how], finals["native"], f"{script} --wrap {how}", tol)
    d = tmp_path / "tutorial_zero3"
    d.mkdir()
    done = torchrun("ddp_tutorial.py", "2", "1", "--wrap", "zero3", cwd=d)
    assert done.returncode != 0 and "model.full_state_dict()" in done.stderr
