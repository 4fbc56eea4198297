"""recipes/compare.py end to end (tiny GPT, 2 ranks, DeepSpeed included), and its parts.

The end-to-end runs check every output the report promises, the exit status both ways
(a lossy gradient hook on our ddp must fail the check against native DDP), the config
errors, and that DeepSpeed runs without a compiler and builds nothing into HOME.
"""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minidist_tools.report import max_state_difference, reference_for
from minidist_tools.report import theoretical_bytes
from minidist.profiling import analyse, call_payload, intersect, length, merge, subtract

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "compare.py"
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "data.max_bytes=200000",
        "trainer.micro_batch_size=4", "compare.warmup=1", "compare.steps=3"]


def compare(tmp_path, *overrides, home=None, path=None, name="run"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if home is not None:
        env["HOME"] = str(home)
    if path is not None:
        env.update(PATH=path, CC="/nonexistent/cc", CXX="/nonexistent/c++")
    run_dir = tmp_path / name
    out = subprocess.run([sys.executable, str(RECIPE), *TINY, *overrides, f"hydra.run.dir={run_dir}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return out, run_dir


@pytest.mark.slow(stand_in="test_analyse_hidden_fraction_and_bytes")  # a whole comparison with DeepSpeed
def test_compare_end_to_end_with_deepspeed(tmp_path):
    """ours vs native vs DeepSpeed: every output written, ours equal to their references, exit 0;
    DeepSpeed started with no compiler on PATH and a fresh HOME, and built nothing there."""
    home = tmp_path / "home"
    home.mkdir()
    bare_path = str(Path(sys.executable).parent)  # python and the venv's scripts only: no g++, no cc
    # Small buckets (several per step) so that overlap can show in the timeline; ddp's all_reduce on
    # gloo's own threads (shared memory's runs on a Python worker, which with one core per rank gets
    # it only once a model this small has finished its backward).
    out, run_dir = compare(tmp_path, "compare.strategies=[ddp,native_ddp,zero2,ds_zero2,zero3,native_fsdp]",
                           "compare.timeline=true", "compare.bucket_cap_mb=0.02", "+compare.overrides.ddp.collectives=backend",
                           home=home, path=bare_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    written = {str(f.relative_to(home)) for f in home.rglob("*") if f.is_file()}
    # matplotlib's font cache is expected; a compiled extension (torch_extensions) is not
    assert all(w.startswith((".cache/matplotlib/", ".config/matplotlib/")) for w in written), written
    for name in ("report.md", "results.csv", "results.json", "losses.csv", "config.yaml", "loss.png",
                 "step_time.png", "memory.png", "bytes_per_op.png", "timeline_ddp.png", "timeline_ddp.json",
                 "timeline_ddp_no_overlap.png", "timeline_zero2.png", "timeline_zero3.json", "timeline_ds_zero2.png"):
        assert (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0, name
    assert sorted(p.name for p in (run_dir / "tensorboard").iterdir()) == sorted(
        ["ddp", "native_ddp", "zero2", "ds_zero2", "zero3", "native_fsdp"])

    results = json.loads((run_dir / "results.json").read_text())
    rows = results["rows"]
    assert {r: rows[r]["reference"] for r in ("ddp", "zero2", "zero3")} == \
        {"ddp": "native_ddp", "zero2": "ds_zero2", "zero3": "native_fsdp"}
    for name in ("ddp", "zero2", "zero3"):
        r = rows[name]
        assert r["ok"] is True and r["final_param_diff"] <= 1e-5 and r["max_loss_diff"] <= 1e-5, (name, r)
        assert r["time_ratio"] > 0 and r["step_s"]["min"] <= r["step_s"]["median"] <= r["step_s"]["max"]
        assert 0.0 <= r["hidden_fraction"] <= 1.0 and r["exposed_comm_s"] >= 0
        assert r["model_state_bytes"]["total"] > 0 and r["peak_bytes"] >= r["model_state_bytes"]["parameters"]
    assert rows["ddp"]["final_param_diff"] == 0.0  # 2 ranks, same buckets order: bitwise
    # How each sent its collectives, as its tracer saw them: ddp pinned to gloo's own; zero2 and zero3
    # ("auto" on one host) their gradients and parameters through shared memory, the clipping norm's
    # few bytes through gloo's own; the references (not traced) say nothing.
    assert [rows[n]["transports"] for n in ("ddp", "zero2", "zero3", "native_ddp", "ds_zero2")] == \
        [["backend"], ["backend", "shm"], ["backend", "shm"], None, None]
    # Bytes measured from the calls themselves, next to the ring-model theory.
    psi, n = results["psi"], results["world_size"]
    assert rows["ddp"]["bytes_per_step"]["all_reduce"] == pytest.approx(2 * (n - 1) / n * 4 * psi)
    assert rows["native_ddp"]["bytes_per_step"]["all_reduce"] == pytest.approx(2 * (n - 1) / n * 4 * psi)
    assert rows["zero2"]["bytes_per_step"]["reduce_scatter"] == pytest.approx(rows["zero2"]["theory_bytes_per_step"]
                                                                           ["reduce_scatter"], rel=0.01)
    assert rows["zero3"]["bytes_per_step"]["all_gather"] == pytest.approx(2 * (n - 1) / n * 4 * psi, rel=0.01)
    # Our ddp's timeline: buckets are reduced while autograd still produces gradients; without
    # overlap, every all_reduce is issued and starts after the last backward node. Issued: on
    # every rank. Started (on gloo's thread, when the scheduler gives it a core: with one core per
    # rank, once in a while only after a backward this short): seen on at least one rank.
    ran_inside = []
    for rank in ("0", "1"):
        with_overlap, without = results["timelines"]["ddp"][rank], results["timelines"]["ddp_no_overlap"][rank]
        starts = lambda t: [a for name, a, _ in t["comm"] if name == "gloo:all_reduce"]
        issued = lambda t: [at for op, at in t["issued"] if op == "all_reduce"]
        assert len(starts(with_overlap)) >= 3 and len(issued(with_overlap)) >= 3
        assert min(issued(with_overlap)) < with_overlap["backward_nodes"][-1][1]
        assert min(issued(without)) >= without["backward_nodes"][-1][1]
        assert min(starts(without)) >= without["backward_nodes"][-1][1]
        ran_inside.append(min(starts(with_overlap)) < with_overlap["backward_nodes"][-1][1])
    assert any(ran_inside)
    trace = json.loads((run_dir / "timeline_ddp.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert any(e.get("name") == "gloo:all_reduce" for e in trace["traceEvents"])

    report = (run_dir / "report.md").read_text()
    for text in ("final param diff", "exposed comm", "Communication per optimizer step", "Model state per rank",
                 "zero2 / ds_zero2", "deepspeed 0.", "Collectives: through gloo's own: ddp; through gloo's own and "
                 "shared memory: zero2, zero3; the references through gloo's own."):
        assert text in report, text
    with open(run_dir / "losses.csv") as f:
        table = list(csv.reader(f))
    assert table[0] == ["step", "ddp", "native_ddp", "zero2", "ds_zero2", "zero3", "native_fsdp"]
    assert len(table) == 1 + 4  # warmup + steps
    assert "ddp / native_ddp" in out.stdout and "report" in out.stdout
    assert "- collectives: through gloo's own: ddp; through gloo's own and shared memory: zero2, zero3" in out.stdout


@pytest.mark.slow(stand_in="test_references_and_theory")  # a whole comparison
def test_compare_exits_1_when_ours_differs(tmp_path):
    """bf16-compressed gradients on our ddp: the final parameters drift from native DDP's -> exit 1."""
    out, run_dir = compare(tmp_path, "compare.strategies=[ddp,native_ddp]", "+compare.overrides.ddp.comm_hook=bf16")
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "final parameters differ beyond compare.tolerance" in out.stderr
    rows = json.loads((run_dir / "results.json").read_text())["rows"]
    assert rows["ddp"]["ok"] is False and rows["ddp"]["final_param_diff"] > 1e-5
    assert (run_dir / "report.md").is_file()  # the report is still written
    assert "DIFFERS" in (run_dir / "report.md").read_text()


@pytest.mark.parametrize("override, message", [
    ("compare.strategies=[ddp,nope]", "compare.strategies: ['nope'] unknown"),
    ("trainer.micro_batch_size=100000", "fewer than one micro-batch"),  # the trainer's own checks, per strategy
])
def test_config_errors_exit_2_with_one_line(tmp_path, override, message, capsys):
    """recipes/compare.py's main, in this process: the checks come before any rank starts."""
    from minidist_tools.compare import main

    run_dir, saved = tmp_path / "run", sys.argv[:]
    try:
        with pytest.raises(SystemExit) as stopped:
            main([*TINY, override, f"hydra.run.dir={run_dir}"])
    finally:
        sys.argv = saved
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], err[-2000:]
    assert not (run_dir / "report.md").exists()


@pytest.mark.parametrize("override, message", [
    ("compare.strategies=[ddp,ddp]", "names a strategy twice"),
    ("compare.strategies=[]", "compare.strategies is empty"),
    ("compare.steps=0", "compare.steps=0 must be an integer >= 1"),
    ("compare.tolerance=-1", "compare.tolerance=-1 must be >= 0"),
    ("trainer.precision=fp16", "trainer.precision=fp16: the comparison runs fp32 or bf16"),
])
def test_strategy_list_checks(override, message):
    from hydra import compose, initialize_config_dir

    from minidist_tools.compare import check_strategies
    from minidist.train.config import ConfigError

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="compare", overrides=[override])
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_strategies(cfg)


def test_deepspeed_missing_names_the_install(tmp_path, monkeypatch):
    import builtins

    from minidist_tools.deepspeed import import_deepspeed
    from minidist.train.config import ConfigError

    real_import = builtins.__import__

    def no_deepspeed(name, *args, **kwargs):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise ImportError("No module named 'deepspeed'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_deepspeed)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[deepspeed\]'"):
        import_deepspeed("cpu")


# --------------------------------------------------------------------------- the parts


def test_interval_arithmetic():
    assert merge([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert length([(0, 1), (0.5, 2)]) == 2
    assert intersect([(0, 2), (3, 5)], [(1, 4)]) == [(1, 2), (3, 4)]
    assert subtract([(0, 5)], [(1, 2), (3, 4)]) == [(0, 1), (2, 3), (4, 5)]


def test_memory_table_shows_every_part_a_row_holds():
    from minidist_tools.report import memory_table

    mib = 2**20
    rows = {"zero3": {"strategy": "zero3", "peak_bytes": 20 * mib, "model_state_bytes": {
                "parameters": 0, "master_params": 2 * mib, "gradients": 2 * mib, "optimizer_state": 4 * mib,
                "total": 8 * mib}},
            "ddp": {"strategy": "ddp", "peak_bytes": 30 * mib, "model_state_bytes": {
                "parameters": 4 * mib, "gradients": 4 * mib, "optimizer_state": 8 * mib, "total": 16 * mib}}}
    header, _, zero3, ddp = memory_table(rows).splitlines()
    # ZeRO-3's master shards are its parameters' only copy between steps: without them its parts
    # would not add up to its total; no row has comm buffers, so no column of zeros for them
    assert header == ("| strategy | parameters MiB | master_params MiB | gradients MiB | optimizer_state MiB "
                      "| total MiB | peak MiB |")
    assert zero3 == "| zero3 | 0.00 | 2.00 | 2.00 | 4.00 | 8.00 | 20.00 |"
    assert ddp == "| ddp | 4.00 | 0.00 | 4.00 | 8.00 | 16.00 | 30.00 |"


def test_call_payload_from_profiler_shapes():
    assert call_payload("c10d::allreduce_", {"Input Dims": [[[10, 3]], [], []], "Input type": ["TensorList"]}) == \
        ("all_reduce", 120)
    # all_gather: (output, input) -> S is the gathered output; reduce_scatter: the scattered input
    assert call_payload("c10d::_allgather_base_", {"Input Dims": [[16], [8], []], "Input type": ["float", "float"]}) \
        == ("all_gather", 64)
    assert call_payload("c10d::_reduce_scatter_base_", {"Input Dims": [[8], [16], []],
                                                        "Input type": ["c10::BFloat16", "c10::BFloat16"]}) == \
        ("reduce_scatter", 32)
    assert call_payload("aten::add_", {"Input Dims": [[1]]}) is None


def test_analyse_hidden_fraction_and_bytes():
    """Communication half under compute, half after: hidden fraction 0.5, exposed 1 ms."""
    us = 1000.0
    events = [
        {"name": "minidist.anchor", "ts": 0, "dur": 0, "tid": 1},
        {"name": "minidist.forward", "ts": 0, "dur": 2 * us, "tid": 1},
        {"name": "minidist.backward", "ts": 2 * us, "dur": 2 * us, "tid": 1},
        {"name": "aten::mm", "ts": 0, "dur": 4 * us, "tid": 1},
        {"name": "gloo:all_reduce", "ts": 3 * us, "dur": 2 * us, "tid": 7},
        {"name": "c10d::allreduce_", "ts": 3 * us, "dur": 1, "tid": 1,
         "args": {"Input Dims": [[[250]]], "Input type": ["TensorList"]}},
    ]
    t = analyse(events, 0, [], [], world_size=2)
    assert t["hidden_fraction"] == pytest.approx(0.5) and t["exposed_comm_s"] == pytest.approx(1e-3)
    assert t["bytes"]["all_reduce"] == {"calls": 1, "bytes": 1000, "sent_bytes": 1000.0}
    assert t["issued"] == [("all_reduce", 3e-3)]  # on the step's thread, when it was called


def test_analyse_reads_the_gpu_kernels_when_the_trace_has_them():
    """CUDA: the host only enqueues, so overlap is read from the device's kernels: an NCCL kernel
    4-8 ms beside compute kernels 0-6 ms is half hidden, whatever the host threads did."""
    us = 1000.0
    events = [
        {"name": "minidist.anchor", "ts": 0, "dur": 0, "tid": 1},
        {"name": "minidist.forward", "ts": 0, "dur": 1 * us, "tid": 1},
        {"name": "minidist.backward", "ts": 1 * us, "dur": 1 * us, "tid": 1},
        {"name": "aten::mm", "ts": 0, "dur": 2 * us, "tid": 1},  # host time: not what counts on a GPU
        {"name": "ampere_sgemm_128x64", "cat": "kernel", "ts": 0, "dur": 6 * us, "tid": 7},
        {"name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "cat": "kernel", "ts": 4 * us, "dur": 4 * us, "tid": 8},
    ]
    t = analyse(events, 0, [], [], world_size=2)
    assert t["hidden_fraction"] == pytest.approx(0.5) and t["exposed_comm_s"] == pytest.approx(2e-3)
    assert t["clock"].startswith("GPU kernels") and t["compute"] == [(0.0, 6e-3)]


def test_the_transports_line_says_how_ours_and_the_references_sent():
    from minidist_tools.report import transports_line

    ours, native = {"kind": "minidist"}, {"kind": "native", "transports": None}
    rows = {"ddp": {**ours, "transports": ["shm"]}, "native_ddp": native, "zero2": {**ours, "transports": ["shm"]}}
    assert transports_line(rows, "gloo") == "every one of ours through shared memory; the references through gloo's own"
    rows["zero2"]["transports"] = ["backend", "ring"]
    assert transports_line(rows, "gloo") == ("through shared memory: ddp; through gloo's own and our send/recv ring: "
                                             "zero2; the references through gloo's own")
    assert transports_line({"ddp": {**ours, "transports": ["shm"]}}, "gloo") == "every one of ours through shared memory"
    # one of ours whose tracer saw nothing is not a reference
    assert transports_line({"ddp": {**ours, "transports": ["shm"]}, "zero2": {**ours, "transports": None}}, "gloo") == \
        "every one of ours through shared memory"
    assert transports_line({"ddp": {**ours, "transports": None}}, "gloo") == ""  # a run recorded before transports were


def test_references_and_theory():
    names = ["ddp", "zero2", "native_ddp"]
    refs = {"ddp": "native_ddp", "zero2": "ds_zero2"}
    assert reference_for("ddp", names, refs) == "native_ddp"
    assert reference_for("zero2", names, refs) == "native_ddp"  # ds_zero2 absent: native_ddp stands in
    assert reference_for("native_ddp", names, refs) is None
    assert theoretical_bytes("zero3", psi=1000, n=4) == {"reduce_scatter": 3000.0, "all_gather": 6000.0}
    assert theoretical_bytes("ddp", psi=1000, n=1) == {}
    # hybrid on 2 replicas x 2 shard ranks: ZeRO within the pair, 2 (R-1)/R x 4 psi / S across
    assert theoretical_bytes("hsdp3", psi=1000, n=4, shard=2) == {"reduce_scatter": 2000.0, "all_gather": 4000.0,
                                                                   "all_reduce": 2000.0}
    assert theoretical_bytes("hsdp2", psi=1000, n=4, shard=4) == {"reduce_scatter": 3000.0, "all_gather": 3000.0}
    assert theoretical_bytes("hsdp3", psi=1000, n=4) == {}  # the shard size is needed
    import torch

    assert max_state_difference({"w": torch.zeros(3)}, {"w": torch.tensor([0.0, 0.5, -1.0])}) == 1.0
    # a key in one state only is a difference too (it used to be skipped)
    assert max_state_difference({"w": torch.zeros(3), "b": torch.zeros(1)}, {"w": torch.zeros(3)}) == float("inf")
    assert max_state_difference({"w": torch.zeros(3)}, {"w": torch.zeros(3), "b": torch.zeros(1)}) == float("inf")


VARIANT = "+compare.variants={zero3_int8: {of: zero3, param_wire: int8, grad_wire: int8}}"


@pytest.mark.slow(stand_in="test_variants_resolve_to_their_strategy_and_are_checked_by_the_loss")  # a whole comparison
def test_a_compressed_variant_runs_beside_its_twin_and_is_held_to_the_loss_bound(tmp_path):
    """zero3 with int8 wires beside plain zero3: its reference is its twin, its check the final loss
    (a bound of 0 cannot hold: exit 1, saying so), its bytes and their theory the wire's."""
    out, run_dir = compare(tmp_path, "compare.strategies=[zero3,zero3_int8]", VARIANT, "compare.loss_tolerance=0")
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "final loss differs beyond compare.loss_tolerance=0 (zero3_int8 vs zero3:" in out.stderr
    rows = json.loads((run_dir / "results.json").read_text())["rows"]
    row = rows["zero3_int8"]
    assert row["reference"] == "zero3" and row["checked_by"] == "loss" and row["ok"] is False
    assert 0 < row["final_loss_diff"] < 0.05  # close, not equal
    for op in ("reduce_scatter", "all_gather"):
        ratio = row["bytes_per_step"][op] / rows["zero3"]["bytes_per_step"][op]
        assert ratio == pytest.approx(row["theory_bytes_per_step"][op] / rows["zero3"]["theory_bytes_per_step"][op],
                                      rel=0.05)
        assert ratio < 0.3
    assert "a variant of it: no target" in (run_dir / "report.md").read_text()


@pytest.mark.parametrize("override, message", [
    ("+compare.variants={zero3: {of: zero3}}", "compare.variants.zero3: a strategy has that name"),
    ("+compare.variants={z: {param_wire: int8}}", "compare.variants.z: needs `of`"),
    ("compare.loss_tolerance=-1", "compare.loss_tolerance=-1 must be >= 0"),
])
def test_variant_checks(override, message):
    test_strategy_list_checks(override, message)


def test_variants_resolve_to_their_strategy_and_are_checked_by_the_loss():
    from minidist_tools.report import reference_of
    from minidist_tools.report import base_of, compressed
    from minidist_tools.theory import wire_bytes
    from minidist.train.strategies import spec

    variants = {"zero3_int8": {"of": "zero3", "grad_wire": "int8"}}
    assert base_of("zero3_int8", variants) == "zero3" and base_of("ddp", variants) == "ddp"
    assert reference_of("zero3_int8", ["zero3_int8", "zero3", "native_fsdp"], {}, variants) == "zero3"  # its twin
    assert reference_of("zero3_int8", ["zero3_int8", "native_fsdp"], {}, variants) == "native_fsdp"  # zero3's
    assert compressed({"grad_wire": "int8"}) and not compressed({"grad_wire": None, "comm_hook": "bf16"})
    # the theory prices each collective at its wire's bytes: int8 with a 4-byte scale per block, bf16 half of fp32
    plain = wire_bytes(spec("zero3"), 4096, 4)
    wired = wire_bytes(spec("zero3"), 4096, 4, options={"grad_wire": "int8", "param_wire": "bf16", "quant_block": 256})
    assert wired["reduce_scatter"] / plain["reduce_scatter"] == pytest.approx((1 + 4 / 256) / 4)
    assert wired["all_gather"] / plain["all_gather"] == 0.5
    # DiLoCo, each rank a worker: its outer all_reduce travels as outer_wire
    outer = wire_bytes(spec("diloco"), 4096, 4, shard=1, options={"outer_wire": "int8", "quant_block": 256})
    assert outer["all_reduce"] / wire_bytes(spec("diloco"), 4096, 4, shard=1)["all_reduce"] == \
        pytest.approx((1 + 4 / 256) / 4)
