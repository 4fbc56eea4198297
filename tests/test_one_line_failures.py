"""One line, the right one (issue 26, items 10 to 12): failures that used to end under a
traceback, in a bare "training failed on rank(s) [0]", or after training with no summary."""

import os
import shutil
import socket
import subprocess

import pytest

from minidist.train.checkpoint import latest_checkpoint
from minidist.train.run_log import format_summary
from train_cases import PYTHON, RECIPE, ROOT, tiny, tiny_overrides, train_on_rank

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def recipe(*overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, str(RECIPE), *tiny_overrides("trainer.max_steps=2", *overrides)], cwd=ROOT,
                          env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=180)


def test_a_port_in_use_under_env_var_launch_is_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = recipe(f"hydra.run.dir={tmp_path / 'run'}", "launcher.timeout_s=10",
                     env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    assert f"port {port} is already in use on this machine" in lines[0] and lines[0].startswith("error: ")


def test_a_run_directory_that_cannot_be_written_is_named_on_the_console(tmp_path, capsys):
    """Its logs cannot be written (a file where the logs folder goes: unwritable for root too):
    the cause on the console, before any rank starts, not a bare "training failed on rank(s) [0]".
    (launch() in-process: the recipe's own entry, as test_train_recipe calls it.)"""
    from minidist.train.launch_train import launch
    from train_cases import compose_cfg
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "logs").write_text("not a folder")
    assert launch(compose_cfg(tiny_overrides("trainer.max_steps=2")), tmp_path / "run") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "cannot be written (FileExistsError" in lines[0] and "writable hydra.run.dir" in lines[0], lines


def test_a_failure_whose_log_cannot_be_written_still_says_what_failed(tmp_path):
    from minidist.train.failure_report import report_failure
    (tmp_path / "logs").write_text("not a folder")
    line = report_failure(ValueError("the real cause"), 1, 3, tmp_path)
    assert "rank 1 stopped after step 3: ValueError: the real cause" in line and "no traceback kept" in line


def test_a_checkpoint_folder_that_is_a_link_is_pruned_as_a_link(ranks, tmp_path):
    """Checkpoints moved to another disk and linked back: pruning removes the link, not the data
    behind it (it used to stop the run after training: Cannot call rmtree on a symbolic link)."""
    run_dir = tmp_path / "run"
    ranks(2).run(train_on_rank, tiny("trainer.max_steps=2"), str(run_dir), timeout_s=240)
    ckpt = latest_checkpoint(run_dir)
    elsewhere = tmp_path / "other_disk" / ckpt.name
    shutil.move(str(ckpt), str(elsewhere.parent / ckpt.name) if elsewhere.parent.mkdir() is None else None)
    ckpt.symlink_to(elsewhere, target_is_directory=True)
    summary = ranks(2).run(train_on_rank, tiny("trainer.max_steps=4", "trainer.ckpt_every=2", "trainer.keep_last=1"),
                           str(run_dir), str(ckpt), timeout_s=240)[0]
    assert summary["step"] == 4
    assert not ckpt.exists() and not ckpt.is_symlink()  # the link pruned
    assert (elsewhere / "meta.pt").is_file()  # what it pointed to, untouched
    assert latest_checkpoint(run_dir).name == "step_00000004"


def test_skipped_steps_are_on_the_console_summary(tmp_path):
    base = {"step": 10, "memory/model_state_bytes": 1, "memory/peak_bytes": 2}
    assert "skipped steps" not in format_summary({**base, "skipped_steps": 0}, tmp_path)
    assert "skipped steps    3 (a non-finite gradient norm" in format_summary({**base, "skipped_steps": 3}, tmp_path)


# ---------------------------------------------------------------- item 11: who failed first


def test_the_rank_that_failed_first_is_named_not_the_ones_that_waited_for_it(tmp_path):
    import json
    import time

    from minidist.train.failure_report import who_failed_first

    def records(**kinds):  # rank -> (kind, seconds after the launch)
        logs = tmp_path / "logs"
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir()
        for rank, (kind, dt) in kinds.items():
            r = int(rank[1:])
            (logs / f"rank_{r}.failure.json").write_text(json.dumps(
                {"rank": r, "kind": kind, "step": 7, "time": t0 + dt, "line": "..."}))

    t0 = time.time()
    records(r0=("waited", 4.0), r1=("stuck", 7.0))  # rank 1 stalled; rank 0 timed out on it first
    assert who_failed_first(tmp_path, t0, {0: 1}) == ("rank(s) [1] first (rank 1 stalled after step 7: still inside "
                                                      "its step when the launcher stopped it); then rank(s) [0], "
                                                      "waiting for it")
    records(r0=("error", 1.0), r1=("error", 1.2), r2=("waited", 2.0))  # two failed alike, at once
    assert who_failed_first(tmp_path, t0, {0: 1}).startswith("rank(s) [0, 1] first (rank 0 failed after step 7; "
                                                             "rank 1 failed after step 7); then rank(s) [2]")
    records(r0=("waited", 1.0))  # rank 1 was killed: no record of its own, the launcher saw -9
    assert who_failed_first(tmp_path, t0, {1: -9}) == ("rank(s) [1] first (rank 1 killed by SIGKILL); then "
                                                       "rank(s) [0], waiting for it")
    records(r0=("waited", 1.0), r1=("waited", 1.5))  # all waited: the earliest
    assert who_failed_first(tmp_path, t0, {0: 1}).startswith("rank(s) [0, 1] first")
    records(r0=("error", -5.0))  # a record of an earlier launch in the same run directory
    assert who_failed_first(tmp_path, t0, {0: 1}) == "rank(s) [0]"


@pytest.mark.slow(stand_in="test_the_rank_that_failed_first_is_named_not_the_ones_that_waited_for_it")
def test_a_killed_rank_is_named_first_on_the_console(tmp_path):
    out = recipe("launcher.nproc=2", "trainer.max_steps=6", "debug.kill_rank=1", "debug.kill_at_step=3",
                 f"hydra.run.dir={tmp_path}")
    assert out.returncode == 1, out.stderr[-3000:]
    assert ("error: training failed on rank(s) [1] first (rank 1 killed by SIGKILL); then rank(s) [0], waiting for "
            "it") in out.stderr, out.stderr[-3000:]
