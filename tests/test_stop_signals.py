"""Stop signals (issue 26, item 9): Ctrl-C, SIGTERM and SIGUSR1 end a run after the step every
rank finished, with that step checkpointed, one line and exit status 128 + the signal; a second
Ctrl-C stops at once; resuming gives what an uninterrupted run gives, bitwise."""

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from minidist.train.checkpoint import latest_checkpoint
from train_cases import PYTHON, RECIPE, ROOT, assert_same, load_everything, tiny_overrides

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# ---------------------------------------------------------------- StopSignals alone


def test_a_stop_signal_sets_the_flag_and_the_process_lives_on():
    from minidist.train.stop_signal import StopSignals

    before = signal.getsignal(signal.SIGTERM)
    with StopSignals(grace_s=60) as stop:
        assert stop.requested == 0
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # within the repeat window: the launcher's copy, ignored
        deadline = time.monotonic() + 5
        while stop.requested == 0 and time.monotonic() < deadline:  # the watcher thread records it
            time.sleep(0.01)
        assert stop.requested == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # handlers (and the wakeup fd) given back


# stop_signal.py alone, loaded from its file: what it does needs no torch (whose import would
# be most of this test's time).
FORCED = textwrap.dedent("""
    import importlib.util, os, signal, sys, time
    spec = importlib.util.spec_from_file_location("stop_signal", "minidist/train/stop_signal.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    StopSignals = module.StopSignals
    with StopSignals(grace_s=float(sys.argv[1]), repeat_window_s=0.2, where=lambda: "after step 7",
                     latest=lambda: "checkpoints/step_00000005") as stop:
        stop.on_stuck = lambda line: open(sys.argv[2], "w").write(line)
        os.kill(os.getpid(), signal.SIGINT)
        if sys.argv[3] == "twice":
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)
        if sys.argv[3] == "twice_the_launchers_copy_first":
            # What two of a rank's threads taking the terminal's SIGINT and the agent's SIGTERM at
            # once can write: both bytes, the SIGTERM's first, found by one read (CI saw it).
            time.sleep(0.3)
            os.write(stop._write, bytes([signal.SIGTERM, signal.SIGINT]))
        time.sleep(60)  # a step that does not end (the main thread never looks at the flag)
    print("not reached")
""")


@pytest.mark.parametrize("case", ["twice", "twice_the_launchers_copy_first", "stuck"])
def test_a_second_ctrl_c_or_the_end_of_the_grace_stops_at_once(tmp_path, case):
    start = time.monotonic()
    out = subprocess.run([PYTHON, "-c", FORCED, "1" if case == "stuck" else "30", str(tmp_path / "stuck"), case],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 30  # not the 60 s sleep
    assert out.returncode == 130, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "not reached" not in out.stdout, out.stderr
    assert lines[0].endswith("; the latest checkpoint is checkpoints/step_00000005; resume with the same command")
    if case.startswith("twice"):
        assert lines[0].startswith("error: stopped at once by a second SIGINT after step 7;")
        assert not (tmp_path / "stuck").exists()
    else:
        assert lines[0].startswith("error: stopped by SIGINT after step 7: still unfinished launcher.stop_grace_s=1 "
                                   "s later")
        assert (tmp_path / "stuck").read_text() == lines[0]  # the record the launcher reads


# ---------------------------------------------------------------- the trainer, stopped


def start(run_dir: Path, *overrides: str, torchrun: bool = False) -> subprocess.Popen:
    """A 2-rank run long enough to be signalled mid-run, in a session of its own (the test is
    its terminal: a signal to the process group is a Ctrl-C)."""
    args = tiny_overrides("trainer.max_steps=400", "trainer.log_every=10", *overrides, f"hydra.run.dir={run_dir}")
    launcher = ([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                 "--monitor-interval", "0.1"] if torchrun else [PYTHON])
    cmd = [*launcher, str(RECIPE), *args, *([] if torchrun else ["launcher.nproc=2"])]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until rank 0 has logged `step` (bounded)."""
    log = run_dir / "logs" / "rank_0.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.is_file() and f"step {step}: " in log.read_text():
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout_s} s")


def finish(proc: subprocess.Popen, timeout_s: float = 60) -> tuple[int, str, float]:
    start = time.monotonic()
    _, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, err, time.monotonic() - start


def rank_processes(launcher_pid: int) -> list:
    import psutil

    return [p for p in psutil.Process(launcher_pid).children() if "spawn_main" in " ".join(p.cmdline())]


def stopped_line(err: str, name: str, run_dir: Path) -> int:
    """The one line (nothing else on stderr); the step it names, checkpointed and latest."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]
    words = lines[0].split()
    assert lines[0].startswith(f"stopped by {name} after step ") and lines[0].endswith("resume with the same command")
    step = int(words[5].rstrip(";"))
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / f"step_{step:08d}"
    assert f"checkpoint {latest_checkpoint(run_dir)};" in lines[0]
    return step


def run_rank_signalled(cfg_dict: dict, run_dir: str, signalled_rank: int) -> tuple[int, int]:
    """A rank of the trainer's run (launch_train.run_rank, as the launcher runs it) on this pool rank;
    rank `signalled_rank` sends itself SIGUSR1 once the run is under way. (its exit status, the last
    step of its log)"""
    import os
    import re
    import signal
    import threading

    import torch.distributed as dist

    from minidist.train.app import run_rank

    if dist.get_rank() == signalled_rank:
        threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
    try:
        run_rank(cfg_dict, run_dir, None)
        status = 0
    except SystemExit as e:
        status = e.code
    log = (Path(run_dir) / "logs" / f"rank_{dist.get_rank()}.log").read_text()
    return status, int(re.findall(r"stopped by SIGUSR1 after step (\d+)", log)[-1])


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step_checkpointed(ranks, tmp_path):
    """The ranks' part of a stop (the launcher's, its one line and its exit status: the launch
    below): SIGUSR1 to rank 1 alone, both ranks leave after the same step with 138, that step's
    checkpoint written."""
    from train_cases import tiny

    cfg = tiny("trainer.max_steps=400", "trainer.log_every=10", "debug.step_delay_s=0.02")
    (code0, step0), (code1, step1) = ranks(2).run(run_rank_signalled, cfg, str(tmp_path), 1, timeout_s=120)
    assert code0 == code1 == 128 + signal.SIGUSR1 and step0 == step1 < 400
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / f"step_{step0:08d}"


@pytest.mark.slow(stand_in="test_a_signal_to_one_rank_stops_every_rank_after_the_same_step_checkpointed")
@pytest.mark.parametrize("checkpoints", ["sync", "async"])
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, checkpoints):
    """SIGUSR1 (SLURM's warning) to rank 1 alone: both ranks agree, the step is checkpointed, the
    launcher exits 138 with rank 0's one line, and no rank is left. With background checkpoints,
    the stop waits for the write in flight and commits the stop's own before the line."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, *(["trainer.checkpoint_async=true", "trainer.ckpt_every=7"] if checkpoints == "async" else []))
    wait_for_step(run_dir, 20, proc)
    ranks = rank_processes(proc.pid)
    assert len(ranks) == 2
    ranks[1].send_signal(signal.SIGUSR1)  # the children's order is not the ranks': either will do
    code, err, took = finish(proc)
    assert code == 128 + signal.SIGUSR1, err[-3000:]
    step = stopped_line(err, "SIGUSR1", run_dir)
    assert 20 <= step < 400 and took < 30
    assert not any(p.is_running() and p.status() != "zombie" for p in ranks)
    for r in (0, 1):  # each rank wrote its shard of the same step (ddp: its own copy of the state)
        assert f"stopped by SIGUSR1 after step {step}" in (run_dir / "logs" / f"rank_{r}.log").read_text()


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory) -> Path:
    """The last checkpoint of a 200-step run that was never stopped, made once for both ways of
    stopping below (how the ranks were started does not change what they compute)."""
    straight = tmp_path_factory.mktemp("straight")
    code, err, _ = finish(start(straight, "trainer.max_steps=200"), timeout_s=240)
    assert code == 0, err[-3000:]
    return latest_checkpoint(straight)


@pytest.mark.slow(stand_in="test_a_signal_to_one_rank_stops_every_rank_after_the_same_step_checkpointed")
@pytest.mark.parametrize("how", ["ctrl_c", "sigterm_torchrun"])
def test_stopped_then_resumed_equals_an_uninterrupted_run(tmp_path, how, never_stopped):
    """Ctrl-C to the whole process group (our launcher: exit 130, one line), SIGTERM to torchrun
    (Kubernetes' preemption: torchrun passes it on to the ranks, which exit 143): the step is
    checkpointed, and the same command again resumes there and ends bitwise equal to a run that
    was never stopped."""
    torchrun = how == "sigterm_torchrun"
    run_dir = tmp_path / "run"
    proc = start(run_dir, "trainer.max_steps=200", torchrun=torchrun)
    wait_for_step(run_dir, 20, proc)
    if torchrun:
        os.kill(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    code, err, took = finish(proc)
    name = "SIGTERM" if torchrun else "SIGINT"
    ours = [line for line in err.splitlines() if line.startswith("stopped by")]
    if torchrun:  # torchrun reports the signal it received its own way (a traceback, status 1)
        assert code == 1 and "SignalException: Process" in err and len(ours) == 1, err[-3000:]
    else:  # our launcher adds nothing to the ranks' line
        assert code == 128 + signal.Signals[name], err[-3000:]
    step = stopped_line(ours[0] if torchrun else err, name, run_dir)
    assert 20 <= step < 200 and took < 30
    code, err, _ = finish(start(run_dir, "trainer.max_steps=200", torchrun=torchrun), timeout_s=240)
    assert code == 0, err[-3000:]
    assert latest_checkpoint(run_dir).name == never_stopped.name == "step_00000200"
    assert_same(load_everything(never_stopped), load_everything(latest_checkpoint(run_dir)), how)


@pytest.mark.slow(stand_in="test_a_second_ctrl_c_or_the_end_of_the_grace_stops_at_once")
def test_a_second_ctrl_c_stops_a_run_at_once(tmp_path):
    """Rank 1 stalls, so the first Ctrl-C cannot finish its step; the second (seconds later, as a
    person presses it) ends every rank and the launcher at once: exit 130, the last checkpoint
    named, no rank left."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "trainer.ckpt_every=5", "debug.stall_rank=1", "debug.stall_at_step=8",
                 "launcher.stop_grace_s=120", "launcher.timeout_s=120")
    wait_for_step(run_dir, 5, proc)  # log_every=10: step 5's line is its checkpoint's
    ranks = rank_processes(proc.pid)
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGINT)
    code, err, took = finish(proc)
    assert code == 130 and took < 15, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: stopped at once by a second SIGINT after step 7"), err
    assert "the latest checkpoint is " + str(run_dir / "checkpoints" / "step_00000005") in lines[0]
    assert not any(p.is_running() and p.status() != "zombie" for p in ranks)
