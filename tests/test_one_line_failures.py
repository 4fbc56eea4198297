"""One line, the right one (issue 26, items 10 to 12): failures that used to end under a
traceback, in a bare "training failed on rank(s) [0]", or after training with no summary."""

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from minidist.train.checkpoint import latest_checkpoint
from minidist.train.run_files import format_summary
from train_cases import PYTHON, RECIPE, ROOT, tiny, tiny_overrides, train_on_rank, train_or_error

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def recipe(*overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, str(RECIPE), *tiny_overrides("trainer.max_steps=2", *overrides)], cwd=ROOT,
                          env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=180)


@pytest.mark.slow(stand_in="test_fault_tolerance.py::test_a_rendezvous_failure_is_said_with_its_address_and_fix")
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
    from minidist.train.app import launch
    from train_cases import compose_cfg
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "logs").write_text("not a folder")
    assert launch(compose_cfg(tiny_overrides("trainer.max_steps=2")), tmp_path / "run") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "cannot be written (FileExistsError" in lines[0] and "writable hydra.run.dir" in lines[0], lines


def test_a_failure_whose_log_cannot_be_written_still_says_what_failed(tmp_path):
    from minidist.train.resilience import report_failure
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

    from minidist.train.resilience import who_failed_first

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


# ---------------------------------------------------------------- issue 40: hostile run directories


def plant(link: Path, target: Path, is_dir: bool = False) -> Path:
    """A symbolic link at `link` (its folder made) to `target`, which holds known content."""
    if is_dir:
        target.mkdir(parents=True, exist_ok=True)
        (target / "theirs.txt").write_text("not the run's")
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("not the run's")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target, target_is_directory=is_dir)
    return target


def contents(folder: Path) -> dict:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("where, is_dir, extra", [
    ("run.lock", False, ()), ("logs/rank_0.log", False, ()), ("logs/rank_1.console", False, ()),
    ("tensorboard", True, ()), ("checkpoints", True, ()), ("checkpoints/.step_00000002.tmp", True, ()),
    ("samples/rank_0.txt", False, ("trainer.log_samples=true",)), ("samples", True, ("trainer.log_samples=true",)),
])
def test_a_link_planted_where_the_run_writes_is_refused_before_any_rank_starts(tmp_path, capsys, where, is_dir,
                                                                                 extra):
    from minidist.train.app import launch
    from train_cases import compose_cfg

    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    plant(run_dir / where, outside / "target", is_dir)
    before = contents(outside)
    assert launch(compose_cfg(tiny_overrides("trainer.max_steps=2", *extra)), run_dir) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"{run_dir / where} is a symbolic link" in lines[0], \
        lines
    assert contents(outside) == before and not (run_dir / "config.yaml").exists()  # no rank started


def test_files_the_run_rewrites_replace_a_planted_link_and_never_write_through_it(ranks, tmp_path):
    """config.yaml and summary.json, planted as links before a run: the run writes its own files in
    their place (renamed over the links), what they pointed to is untouched; a late `.step_N.tmp` link
    (planted after the start-up check) stops the save on every rank, naming the link; and appending
    to a planted log refuses it."""
    from minidist.train.run_files import PlantedLink, append_file

    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    for name in ("config.yaml", "summary.json"):
        plant(run_dir / name, outside / name)
    before = contents(outside)
    ranks(2).run(train_on_rank, tiny("trainer.max_steps=2"), str(run_dir), timeout_s=240)
    assert contents(outside) == before
    for name in ("config.yaml", "summary.json"):
        assert not (run_dir / name).is_symlink() and (run_dir / name).read_text() != "not the run's"
    plant(run_dir / "checkpoints" / ".step_00000004.tmp", outside / "tmp", is_dir=True)
    said = ranks(2).run(train_or_error, tiny("trainer.max_steps=4"), str(run_dir), timeout_s=240)
    assert said[0] == said[1] and ".step_00000004.tmp is a symbolic link" in said[0], said
    assert "where this run writes its checkpoint" in said[0]
    plant(run_dir / "logs" / "planted.log", outside / "planted.log")
    with pytest.raises(PlantedLink, match="planted.log is a symbolic link"):
        append_file(run_dir / "logs" / "planted.log")
    assert contents(outside) == {**before, **contents(outside / "tmp"), outside / "planted.log": b"not the run's"}


def test_a_diverged_run_stops_and_sets_aside_the_checkpoint_of_its_diverged_weights(ranks, tmp_path):
    """An absurd learning rate: the loss jumps at step 2 (the update of step 1 made it), so step 1's
    checkpoint holds diverged weights: it is set aside, and the run stops on every rank alike
    naming the step, what to do and the setting (the console's one line: the slow test below)."""
    said = ranks(2).run(train_or_error, tiny("optim.lr=1000", "optim.warmup_steps=0", "trainer.ckpt_every=1",
                                             "trainer.keep_last=1", "trainer.max_steps=8", "trainer.log_every=2"),
                        str(tmp_path), timeout_s=240)
    assert said[0] == said[1] and said[0].startswith("Diverged: step 2: the run diverged: train loss"), said
    assert "no checkpoint is from before it" in said[0] and "trainer.diverged_loss (0: off)" in said[0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001.diverged"]


@pytest.mark.slow(stand_in="test_a_diverged_run_stops_and_sets_aside_the_checkpoint_of_its_diverged_weights")
def test_a_diverged_run_stops_in_one_line_and_keeps_the_checkpoint_from_before_it(tmp_path):
    """An absurd learning rate: the loss jumps at step 2 (the update of step 1 made it), so step 1's
    checkpoint holds diverged weights: it is set aside, the run stops in one line naming what to do,
    exit 1, and the checkpoint from before (step 0 has none: here none) is never pruned."""
    out = recipe("optim.lr=1000", "optim.warmup_steps=0", "trainer.ckpt_every=1", "trainer.keep_last=1",
                 "trainer.max_steps=8", "trainer.log_every=2", f"hydra.run.dir={tmp_path}")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    assert "step 2: the run diverged: train loss" in lines[0] and "trainer.diverged_loss (0: off)" in lines[0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001.diverged"]


def test_updates_skipped_in_a_row_stop_the_run_before_it_checkpoints_their_state(ranks, tmp_path):
    """The same learning rate with the loss guard off: the gradient norms turn inf and their updates
    are skipped; checkpoints wait while they are; after 3 in a row the run stops, the checkpoint
    before the divergence (step 1's update was its cause: set aside) never pruned by a later one."""
    from minidist.train.checkpoint import list_checkpoints

    said = ranks(2).run(train_or_error, tiny("optim.lr=1000", "optim.warmup_steps=0", "trainer.diverged_loss=0",
                                             "trainer.ckpt_every=1", "trainer.keep_last=1", "trainer.max_steps=10",
                                             "trainer.log_every=1"), str(tmp_path), timeout_s=240)
    assert "the run diverged: its last 3 updates were all skipped for a non-finite" in said[0], said
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert list_checkpoints(tmp_path) == [] and all(n.endswith(".diverged") for n in names) and names, names


def test_a_read_only_checkpoints_folder_is_found_before_the_first_step(tmp_path, capsys):
    from minidist.train.app import launch
    from train_cases import compose_cfg

    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("chattr +i (an immutable folder, read-only for root too) is not supported on this file system")
    try:
        assert launch(compose_cfg(tiny_overrides("trainer.max_steps=2")), tmp_path / "run") == 2
    finally:
        subprocess.run(["chattr", "-i", str(folder)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"the folder {folder} cannot be written" in lines[0], lines
    assert "found before the first step" in lines[0] and not (tmp_path / "run" / "logs" / "rank_0.log").exists()


def test_a_data_set_smaller_than_one_global_batch_is_refused_before_anything_is_written(tmp_path, capsys):
    from minidist.train.app import launch
    from train_cases import compose_cfg

    cfg = compose_cfg(tiny_overrides("trainer.max_steps=2", "data.max_bytes=20000", "trainer.grad_accum=100"))
    assert launch(cfg, tmp_path / "run") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "fewer than one global batch (2 ranks x trainer.micro_batch_size=4 x 100" in lines[0]
    assert not (tmp_path / "run").exists()


def test_the_rendezvous_is_bounded_by_the_timeout_whatever_blocks_it():
    """The bound init_distributed puts around torch's rendezvous: past it, one line and exit 1,
    whatever the body is doing (torch's store handshake blocks in C, where nothing else runs)."""
    import time

    from minidist.dist import _bounded

    # A child forked from this process (torch already imported: no second import to wait for),
    # its stderr a pipe: the watcher's line and exit are the whole of what it does.
    read, write = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.dup2(write, 2)
            with _bounded(0.5, lambda: "why, in one line"):
                time.sleep(10)
        finally:
            os._exit(3)  # not reached when the watcher ends the process
    os.close(write)
    with os.fdopen(read) as err:
        said = err.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1 and said == "error: why, in one line\n", said[-2000:]
    assert time.monotonic() - start < 30


@pytest.mark.slow(stand_in="test_the_rendezvous_is_bounded_by_the_timeout_whatever_blocks_it")
def test_a_rank_blocked_in_the_rendezvous_leaves_within_the_timeout_or_at_a_stop_signal(tmp_path):
    """srun-style, rank 1 alone, its rendezvous port held by a listener that accepts and never
    answers (torch's store client does not bound that handshake): without a signal it leaves when
    launcher.timeout_s runs out; a SIGTERM ends it launcher.stop_grace_s later; one line each."""
    import signal
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        env = {**ENV, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NNODES": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(s.getsockname()[1])}
        for timeout_s, stop in ((60, True), (3, False)):
            start = time.monotonic()
            p = subprocess.Popen([PYTHON, str(RECIPE), *tiny_overrides("trainer.max_steps=2"), "launcher.stop_grace_s=2",
                                  f"launcher.timeout_s={timeout_s}", f"hydra.run.dir={tmp_path / str(timeout_s)}"],
                                 cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if stop:
                time.sleep(8)  # well inside the rendezvous (the imports take ~3 s)
                p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=120)
            lines = err.strip().splitlines()
            assert len(lines) == 1, err[-3000:]
            if stop:
                assert p.returncode == 143 and lines[0].startswith("error: stopped by SIGTERM before training "
                                                                   "started: still unfinished launcher.stop_grace_s=2")
            else:
                assert p.returncode == 1 and "rank 1 of 2: the rendezvous at MASTER_ADDR=127.0.0.1" in lines[0]
                assert "was not reached within 3 s" in lines[0] and time.monotonic() - start < 60


def sweep_in_process(argv: list[str], capsys) -> tuple[int, list[str]]:
    """recipes/train.py's main in this process (a sweep: -m): its exit status and stderr's lines."""
    import sys

    from minidist.train.app import main

    saved = sys.argv[:]
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as stopped:
            main(argv)
    finally:
        sys.argv = saved
    return stopped.value.code, capsys.readouterr().err.strip().splitlines()


def test_a_sweep_checks_every_job_before_the_first_launches(tmp_path, capsys):
    status, lines = sweep_in_process(["-m", *tiny_overrides("trainer.max_steps=2", "optim.lr=-1,1e-3,-2"),
                                      f"hydra.sweep.dir={tmp_path}"], capsys)
    assert status == 2 and lines == [
        "error: job 0 (optim.lr=-1): optim (AdamW): Invalid learning rate: -1; fix the optim.* setting it names",
        "error: job 2 (optim.lr=-2): optim (AdamW): Invalid learning rate: -2; fix the optim.* setting it names",
        "sweep: 2 of 3 job(s) have settings to fix: nothing was launched"], lines
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_sweep_runs_every_job_after_one_fails(tmp_path, capsys, monkeypatch):
    """Each job's launch (its ranks replaced by a stand-in that fails job 0, as a run that stops with
    an error does): the next jobs still run, and a tally ends the sweep with a non-zero status."""
    import minidist.train.app as launch_train

    launched = []

    def launch(cfg, run_dir, job=None):
        launched.append((job, cfg.strategy.name))
        return 1 if cfg.strategy.name == "zero2" else 0
    monkeypatch.setattr(launch_train, "launch", launch)
    status, lines = sweep_in_process(["-m", *tiny_overrides("trainer.max_steps=2", "strategy=zero2,ddp,zero3"),
                                      f"hydra.sweep.dir={tmp_path}"], capsys)
    assert launched == [("job 0 (strategy=zero2)", "zero2"), ("job 1 (strategy=ddp)", "ddp"),
                        ("job 2 (strategy=zero3)", "zero3")]
    assert status == 1 and lines[-1] == "sweep: 3 job(s), 2 done, 1 failed (job 0 (strategy=zero2))", lines


@pytest.mark.slow(stand_in="test_a_sweep_runs_every_job_after_one_fails")
def test_a_sweep_checks_every_job_first_and_runs_every_job_after_one_fails(tmp_path):
    bad = subprocess.run([PYTHON, str(RECIPE), "-m", *tiny_overrides("trainer.max_steps=2", "optim.lr=-1,1e-3"),
                          f"hydra.sweep.dir={tmp_path / 'bad'}"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=180)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: job 0 (optim.lr=-1): optim (AdamW): Invalid learning rate: -1; fix the optim.* setting it names",
        "sweep: 1 of 2 job(s) have settings to fix: nothing was launched"], bad.stderr[-3000:]
    assert not (tmp_path / "bad").exists()
    failing = subprocess.run([PYTHON, str(RECIPE), "-m", *tiny_overrides(
        "trainer.max_steps=2", "trainer.nonfinite=stop,skip", "debug.nan_at_step=1"), f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    errors = [line for line in failing.stderr.splitlines() if line.startswith(("error: ", "sweep: "))]
    assert failing.returncode == 1 and len(errors) == 2, failing.stderr[-3000:]
    assert errors[0].startswith("error: job 0 (trainer.nonfinite=stop): rank 0 stopped after step 2: "
                                "FloatingPointError: step 1: non-finite gradient norm"), errors
    assert errors[1] == "sweep: 2 job(s), 1 done, 1 failed (job 0 (trainer.nonfinite=stop))"
    assert (tmp_path / "1" / "summary.json").is_file()  # the job after the failed one ran
