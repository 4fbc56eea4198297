"""Live recovery (ft=torchft): replica groups that keep stepping when one dies, a relaunched group
that heals from a live peer (no checkpoint read), and a replay of the participation log that ends
in the same state. The end-to-end runs need torchft (the ft extra, which make test-all installs)."""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minidist.train.config import ConfigError
from minidist.train.data import ShardedBatchSampler
from minidist.train.ft_launch import group_command
from minidist.train.live_recovery import LiveRecovery, check_ft, read_participation, summarize
from minidist.train.resilience import marker
from train_cases import PYTHON, RECIPE, ROOT, assert_same, load_everything, tiny_overrides

AUDIT = Path(__file__).parent / "ft_audit"  # its sitecustomize logs every checkpoint file a process reads
needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                   reason="torchft is not installed (the ft extra: pip install -e '.[ft]'; make test-all "
                                   "installs it)")


def ft_run(run_dir: Path, *overrides, strategy: str = "ddp", nproc: int = 4, group_size: int = 2,
           timeout_s: float = 240, ckpt_every: int = 5, tiny: bool = True) -> subprocess.CompletedProcess:
    """recipes/train.py ft=torchft at `nproc` ranks in groups of `group_size`: the tiny GPT (tiny=False:
    make train's job), `overrides` after ours."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(AUDIT),
           "MINIDIST_AUDIT_OPENS": str(run_dir.parent / f"{run_dir.name}.opens")}
    ours = ["ft=torchft", f"launcher.nproc={nproc}", f"ft.group_size={group_size}", "launcher.timeout_s=60",
            f"trainer.ckpt_every={ckpt_every}", *overrides, f"hydra.run.dir={run_dir}"]
    cmd = [PYTHON, str(RECIPE), *(tiny_overrides(*ours, strategy=strategy) if tiny else [f"strategy={strategy}", *ours])]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def rows(run_dir: Path, group: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"group_{group}" / "participation.jsonl").read_text().splitlines()]


def final(run_dir: Path, group: int) -> dict:
    """The group's last checkpoint's model and optimizer files (the RNG streams are each rank's own)."""
    ckpts = sorted((run_dir / f"group_{group}" / "checkpoints").glob("step_*"))
    return {k: v for k, v in load_everything(ckpts[-1]).items() if "rng" not in k}


# ---------------------------------------------------------------------------------- fast, no torchft needed

def test_ft_without_torchft_is_refused_in_one_line_naming_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` raises ImportError
    from minidist.train.app import main

    with pytest.raises(SystemExit) as e:
        main(["ft=torchft", "launcher.nproc=2", f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "ft=torchft needs torchft" in err[0] and "pip install -e '.[ft]'" in err[0], err
    assert not (tmp_path / "run" / "group_0").exists()  # nothing started


def test_ft_checks_the_groups_and_the_strategy(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", object())  # (installed or not: these come first)
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"strategy": {"name": "ddp"}, "ft": {"group_size": 3}})
    with pytest.raises(ConfigError, match="ft.group_size=3 must divide the 4 ranks"):
        check_ft(cfg, 4)
    cfg = OmegaConf.create({"strategy": {"name": "native_ddp"}, "ft": {"group_size": 2}})
    with pytest.raises(ConfigError, match="not strategy=native_ddp"):
        check_ft(cfg, 4)


def test_each_group_is_launched_with_its_own_settings_over_the_users():
    cmd = group_command(["strategy=zero2", "launcher.nproc=4", "hydra.run.dir=/x", "ft=torchft", "ft.group=7"],
                        Path("/runs/a"), 1, 2, 2, "http://h:1", relaunched=True)
    assert cmd == ["strategy=zero2", "ft=torchft", "hydra.run.dir=/runs/a/group_1", "launcher.nproc=2", "ft.group=1",
                    "ft.groups=2", "ft.lighthouse=http://h:1", "ft.relaunched=true", "trainer.progress=false"]


def test_the_sample_stream_is_numbered_in_global_batches_across_epochs():
    s = ShardedBatchSampler(100, rank=1, world_size=2, micro_batch_size=4, seed=0, grad_accum=2)  # 6 a epoch
    first = [b for _, b in zip(range(4), iter(s))]  # global batches 0 and 1
    assert s.batches_taken == 2
    s.seek(1)
    assert [b for _, b in zip(range(2), iter(s))] == first[2:]  # batch 1 again: the same samples
    s.seek(6 * 3 + 4)  # epoch 3, batch 4
    assert (s.epoch, s.taken, s.batches_taken) == (3, 8, 22)


class TwoGroups:
    """A stand-in for torchft's Manager in one process: the allreduce adds what another group sends."""

    def __init__(self, other: torch.Tensor, commit: bool = True):
        self.other, self.commit = other, commit

    def allreduce(self, flat, reduce_op):
        flat += self.other
        return type("Done", (), {"wait": lambda self: None})()

    def should_commit(self):
        return self.commit

    def errored(self):
        return None


def test_the_average_counts_only_the_groups_that_contribute():
    live = LiveRecovery.__new__(LiveRecovery)
    mine = [torch.tensor([2.0, 4.0]), torch.tensor([[6.0]])]
    live.manager = TwoGroups(torch.tensor([4.0, 8.0, 2.0, 1.0]))  # the other group's values and its count 1
    assert live.average_across(mine, contributing=True) and live.participants == 2
    assert mine[0].tolist() == [3.0, 6.0] and mine[1].tolist() == [[4.0]]
    live.manager = TwoGroups(torch.tensor([4.0, 8.0, 2.0, 1.0]), commit=False)
    mine = [torch.tensor([2.0, 4.0]), torch.tensor([[6.0]])]  # sitting out: the other's alone, undivided
    assert not live.average_across(mine, contributing=False) and live.participants == 1
    assert mine[0].tolist() == [4.0, 8.0] and mine[1].tolist() == [[2.0]]


def test_a_discarded_step_serves_its_samples_again_and_a_commit_moves_on_by_the_participants():
    from types import SimpleNamespace

    p = torch.nn.Parameter(torch.ones(3))
    sampler = ShardedBatchSampler(1000, rank=0, world_size=1, micro_batch_size=4, seed=0)
    live = LiveRecovery.__new__(LiveRecovery)
    live.trainer = SimpleNamespace(optimizer=torch.optim.SGD([p], lr=1.0), sampler=sampler, step=0)
    live.log, live.group, live.quorum, live.discarded, live.taken, live.place = None, 0, 1, 0, 5, 0
    for commit, taken in ((False, 5), (True, 7)):  # group batches 5 and 6 were this step's
        p.grad = torch.full((3,), 2.0)
        live.manager = TwoGroups(torch.tensor([4.0, 4.0, 4.0, 1.0]), commit=commit)
        assert live.reduce_and_vote() is commit and sampler.batches_taken == taken
        assert p.grad.tolist() == [3.0, 3.0, 3.0] and live.discarded == 1


def test_the_participation_log_is_read_per_step_and_summarized(tmp_path):
    for g, lines in {0: [("commit", 1, 0, 2), ("discard", 2, None, None), ("commit", 2, 0, 1)],
                     1: [("commit", 1, 1, 2), ("heal", 5, None, None)]}.items():
        (tmp_path / f"group_{g}").mkdir()
        (tmp_path / f"group_{g}" / "participation.jsonl").write_text("".join(json.dumps(
            {"kind": k, "step": s, "group": g, "quorum": 3, "time": 0, "place": p, "participants": n,
             "heal_s": 0.5}) + "\n" for k, s, p, n in lines))
    assert read_participation(tmp_path) == {1: {0: (0, 2), 1: (1, 2)}, 2: {0: (0, 1)}}
    assert summarize(tmp_path) == {"steps_discarded": 1, "heals": 1, "heal_s_median": 0.5}


# ---------------------------------------------------------------------------------- end to end, with torchft

KILL_AT = 8


def assert_survived(run_dir: Path, dead: int, killed_at: float, groups: int, launch_limit_s: float,
                    killed_after: int = 0) -> None:
    """After a rank of group `dead` died at `killed_at` (once its step `killed_after` was done, where
    known): every other group's first committed step within 2 s, at most one step discarded before
    it, and it went on without the dead group (or with it, relaunched and healed by then); the
    relaunched group healed from a peer, not one checkpoint file read by it, and its first committed
    step came within `launch_limit_s` of its launch. (The survivors' record of step `killed_after`
    can come a few ms after the kill: that commit had the dead rank's part, and is not "after". Where
    the step is not known, a kill on a schedule, a commit with every group in it before the dead group
    healed shows it: the dead rank gave its part before it died. One step at most.)"""
    back = [r for r in rows(run_dir, dead) if r["time"] > killed_at]
    heal = next(r for r in back if r["kind"] == "heal")
    for g in (g for g in range(groups) if g != dead):
        after = [r for r in rows(run_dir, g) if r["time"] > killed_at and r["step"] > killed_after]
        in_flight = {r["step"] for r in after
                     if r["kind"] == "commit" and r["participants"] == groups and r["time"] < heal["time"]}
        assert len(in_flight) <= 1, (g, sorted(in_flight), killed_at)
        after = [r for r in after if r["step"] > max(in_flight, default=killed_after)]
        first = next(r for r in after if r["kind"] == "commit")
        assert first["time"] - killed_at < 2.0, (g, first, killed_at)
        assert sum(r["kind"] == "discard" and r["time"] < first["time"] for r in after) <= 1
        assert any(r["kind"] == "commit" and r["participants"] < groups for r in after) or heal["time"] < first["time"]
    first = next(r for r in back if r["kind"] == "commit" and r["time"] > heal["time"])
    assert first["time"] - heal["launched_at"] < launch_limit_s, (heal, first)
    opens = run_dir.parent / f"{run_dir.name}.opens"
    read = [line for line in (opens.read_text().splitlines() if opens.exists() else [])
            if line.split()[0] in (repr(heal["launched_at"]), "-")]  # (-: a process without a launch time)
    assert not read, read[:5]


def events(out: subprocess.CompletedProcess) -> list[str]:
    """The launcher's lines about groups that ended (after a progress bar's \r, where one shares the line)."""
    return [line[line.index("live recovery"):] for line in out.stderr.splitlines() if "live recovery: replica group" in line]


def same_state(run_dir: Path, groups: int) -> None:
    """Every group ends in the same state: the digest of its model, and its last checkpoint's model
    and optimizer, bitwise."""
    digests = {json.loads((run_dir / f"group_{g}" / "summary.json").read_text())["state_digest"] for g in range(groups)}
    assert len(digests) == 1
    for g in range(1, groups):
        assert_same(final(run_dir, 0), final(run_dir, g), f"group {g}")


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """2 groups x 2 ranks, made once per strategy: rank 3 (group 1) SIGKILLs itself after step
    KILL_AT; under ddp, once group 1 has healed and stepped on, rank 1 (group 0) is stopped with
    SIGSTOP (a hang: the process stays, its sockets open). (strategy) -> (run dir, output, the hang's time)."""
    import threading
    import time

    made = {}

    def run(strategy: str):
        if strategy not in made:
            run_dir, hung = tmp_path_factory.mktemp(f"ft_{strategy}") / "run", {}

            def hang():
                committed_past(run_dir, 1, 40)
                if (p := rank_process(run_dir / "group_0", 1)) is not None:
                    p.suspend()
                    hung["at"] = time.time()
            if strategy == "ddp":
                threading.Thread(target=hang, daemon=True).start()
            out = ft_run(run_dir, "debug.kill_rank=3", f"debug.kill_at_step={KILL_AT}", "trainer.max_steps=150",
                         "debug.step_delay_s=0.12", "ft.timeout_s=4", "launcher.peer_timeout_s=3", strategy=strategy)
            assert out.returncode == 0, out.stderr[-4000:]
            made[strategy] = run_dir, out, hung.get("at")
        return made[strategy]
    return run


@needs_torchft
@pytest.mark.slow(stand_in="test_the_average_counts_only_the_groups_that_contribute")
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_a_killed_rank_is_survived_and_its_group_heals_from_a_peer(killed_runs, strategy):
    """2 x 2 ranks (ddp, zero2 inside); 4 x 1 is the soak's. The launcher relaunched the dead group
    once, no survivor exited, and every group ends alike."""
    run_dir, out, hung_at = killed_runs(strategy)
    said = events(out)
    assert said and said[0].startswith("live recovery: replica group 1 ended"), out.stderr[-3000:]
    assert len(said) == (2 if hung_at else 1), said
    assert f"live recovery: 2 groups x 2 ranks; failures survived {len(said)}" in out.stderr
    assert_survived(run_dir, 1, marker(run_dir / "group_1", 3, KILL_AT).stat().st_mtime, 2, launch_limit_s=10.0,
                    killed_after=KILL_AT)
    same_state(run_dir, 2)


@needs_torchft
@pytest.mark.slow(stand_in="test_the_average_counts_only_the_groups_that_contribute")
def test_a_hung_rank_is_named_and_its_group_dropped_within_the_timeout(killed_runs):
    """The ddp run's SIGSTOP on rank 1 of group 0 (ft.timeout_s=4, launcher.peer_timeout_s=3): group 1
    discards at most the step whose reduce waits for it and steps on within ft.timeout_s of it (plus
    the step): alone, or with group 0 relaunched, if it took the hung group's place and healed first;
    group 0 names its silent rank in one line and is relaunched, and heals."""
    run_dir, out, hung_at = killed_runs("ddp")
    assert hung_at is not None, "the hang never happened: group 1 never reached step 40"
    after = [r for r in rows(run_dir, 1) if r["time"] > hung_at]
    first = next(r for r in after if r["kind"] == "commit")
    replaced = any(r["kind"] == "heal" and hung_at < r["time"] < first["time"] for r in rows(run_dir, 0))
    assert (first["participants"] == 1 or replaced) and first["time"] - hung_at < 4 + 1.0, (first, hung_at)
    assert sum(r["kind"] == "discard" and r["time"] < first["time"] for r in after) <= 1
    said = [line for line in events(out) if line.startswith("live recovery: replica group 0 ended")]
    assert len(said) == 1 and "rank 1 sent no heartbeat for 3 s" in said[0], said
    assert any(r["kind"] == "heal" and r["time"] > hung_at for r in rows(run_dir, 0))


@needs_torchft
@pytest.mark.slow(stand_in="test_the_average_counts_only_the_groups_that_contribute")
def test_the_participation_log_replayed_without_faults_ends_in_the_same_state(tmp_path):
    """2 groups x 1 rank, group 1 killed after step 10 and, with ft.relaunch=false, not started
    again: group 0 ends the run alone (steps with both groups, then with one, whatever the timing:
    a relaunched group can rejoin before the survivor's next quorum). Replayed without faults,
    both groups end as group 0 did."""
    run_dir, steps = tmp_path / "run", ["trainer.max_steps=30", "trainer.eval_every=0"]
    out = ft_run(run_dir, *steps, "debug.kill_rank=1", "debug.kill_at_step=10", "ft.relaunch=false",
                 nproc=2, group_size=1)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "live recovery: 2 groups x 1 rank; failures survived 0" in out.stderr and "groups [1] failed" in out.stderr
    assert {s: len(groups) for s, groups in read_participation(run_dir).items()} == {
        s: 2 if s <= 10 else 1 for s in range(1, 31)}
    replay = ft_run(tmp_path / "replay", *steps, f"ft.replay={run_dir}", nproc=2, group_size=1)
    assert replay.returncode == 0, replay.stderr[-4000:]
    for g in range(2):
        assert_same(final(run_dir, 0), final(tmp_path / "replay", g), f"replay group {g}")


@needs_torchft
@pytest.mark.slow(stand_in="test_the_average_counts_only_the_groups_that_contribute")
def test_a_diloco_worker_killed_between_syncs_rejoins_at_the_next_sync_from_a_peer(tmp_path):
    """2 workers of 2 ranks (DDP within each), an outer sync every 8 steps; a rank of worker 1 dies
    after step 12. Worker 0 keeps stepping and syncing alone; the relaunched worker heals at worker
    0's next sync, takes part in it without counting its copy twice, and both end alike."""
    run_dir = tmp_path / "run"
    out = ft_run(run_dir, "strategy.inner=ddp", "strategy.sync_every=8", "debug.kill_rank=3", "debug.kill_at_step=12",
                 "trainer.max_steps=100", "debug.step_delay_s=0.12", strategy="diloco")
    assert out.returncode == 0, out.stderr[-4000:]
    survivor, back = rows(run_dir, 0), rows(run_dir, 1)
    assert [r["step"] for r in survivor if r["kind"] == "commit"] == [*range(8, 100, 8), 100]  # every sync
    alone = [r["step"] for r in survivor if r["kind"] == "commit" and r["participants"] == 1]
    heal = next(r for r in back if r["kind"] == "heal")
    rejoined = next(r for r in back if r["kind"] == "commit" and r["time"] > heal["time"])
    assert alone and alone[0] == 16 and rejoined["step"] % 8 == 0  # synced alone, then joined at a sync
    assert rejoined["step"] in alone  # its first sync: the survivor's average alone, its copy not counted
    digests = {json.loads((run_dir / f"group_{g}" / "summary.json").read_text())["state_digest"] for g in range(2)}
    assert len(digests) == 1


def rank_process(run_dir: Path, rank: int):
    """The live process of `rank` in the replica group whose directory is `run_dir` (the launcher's
    logs/ranks.jsonl names it), or in the torchrun run whose hydra.run.dir it is."""
    import psutil

    ranks = run_dir.parent / "logs" / "ranks.jsonl"
    if run_dir.name.startswith("group_"):
        lines = ranks.read_text().splitlines() if ranks.is_file() else []
        pids = [r["pid"] for r in map(json.loads, lines) if f"group_{r['group']}" == run_dir.name and r["rank"] == rank]
        with contextlib.suppress(psutil.NoSuchProcess):
            return psutil.Process(pids[-1]) if pids else None
        return None
    for p in psutil.process_iter(["cmdline"]):
        try:
            if f"hydra.run.dir={run_dir}" in (p.info["cmdline"] or []) and p.environ().get("RANK") == str(rank):
                return p
        except psutil.NoSuchProcess:
            continue
    return None


def committed_past(run_dir: Path, group: int, step: int, timeout_s: float = 120) -> None:
    import time

    log, end = run_dir / f"group_{group}" / "participation.jsonl", time.monotonic() + timeout_s
    while time.monotonic() < end:
        if log.is_file() and any(r["kind"] == "commit" and r["step"] >= step for r in rows(run_dir, group)):
            return
        time.sleep(0.05)
    raise AssertionError(f"group {group} never committed step {step}")


def training(where: Path) -> bool:
    """Is this run or group stepping now (a step committed within the last 2 s; a run under torchrun:
    started)? A group still healing from its last kill is not killed again."""
    import time

    log = where / "participation.jsonl"
    if not log.is_file():
        return (where / "logs").is_dir() and not (where / "group_0").exists()
    last = log.read_text().splitlines()[-1:]
    return bool(last) and json.loads(last[0])["kind"] == "commit" and json.loads(last[0])["time"] > time.time() - 2


class Killer:
    """SIGKILLs a random live rank every `every_s` seconds once `started()` is true, until
    `done()`: faults on a wall-clock schedule, landing wherever a step is (mid-reduce or not)."""

    def __init__(self, dirs: list[Path], ranks: int, every_s: float, started, done, seed: int = 2026):
        import random
        import threading

        self.dirs, self.ranks, self.every_s, self.started, self.done = dirs, ranks, every_s, started, done
        self.rng, self.kills = random.Random(seed), []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import time

        while not self.started():
            time.sleep(0.05)
        next_at = time.time() + self.every_s
        while not self.done():
            if time.time() < next_at:
                time.sleep(0.05)
                continue
            where, rank = self.rng.choice(self.dirs), self.rng.randrange(self.ranks)
            if training(where) and (p := rank_process(where, rank)) is not None:
                p.kill()
                self.kills.append((where.name, rank, round(time.time(), 3)))
                next_at = time.time() + self.every_s


def committed_samples(run_dir: Path, group_batch: int) -> int:
    """Samples in committed steps: per step, its participants x the group batch (any group's row)."""
    steps = read_participation(run_dir)
    return sum(next(iter(groups.values()))[1] for groups in steps.values()) * group_batch


@needs_torchft
@pytest.mark.slow(stand_in=None, why="the live-recovery soak, whose figures docs/fault_tolerance.md renders")
@pytest.mark.timeout(3600)  # the document's: 1,000 steps of make train's job, four runs
def test_live_recovery_soak_kills_on_a_schedule(tmp_path):
    """A random rank SIGKILLed every MINIDIST_LIVE_SOAK_KILL_EVERY_S s of wall time (landing wherever
    the step is) while the first MINIDIST_LIVE_SOAK_KILLING of the steps run. make test-all: 4 groups x
    1 rank (ddp, the tiny GPT), 150 steps of 0.1 s more each, a kill every 6 s: each kill survived
    as test_a_killed_rank_is_survived_and_its_group_heals_from_a_peer's (the first commit within 2 s,
    the relaunched group's within 5 s of its launch, no checkpoint read), and the groups end alike.
    The document's (scripts/make_fault_tolerance_doc.py --only live; MINIDIST_LIVE_SOAK_OUT=FILE): 2
    x 2 ranks of make train's job, 1,000 steps, a kill every 15 s; committed samples per second set
    against the same run without faults, and the restart-based recovery (torchrun --max-restarts,
    from checkpoints) on the same schedule beside it."""
    import time

    env = os.environ.get
    total, size = int(env("MINIDIST_LIVE_SOAK_STEPS", "150")), int(env("MINIDIST_LIVE_SOAK_GROUP_SIZE", "1"))
    tiny = env("MINIDIST_LIVE_SOAK_JOB", "tiny") == "tiny"  # default: make train's job (ddp, gpt_nano)
    every, every_s, groups = (total // 20 if tiny else 50), float(env("MINIDIST_LIVE_SOAK_KILL_EVERY_S", "6")), 4 // size
    common = [f"trainer.max_steps={total}", f"trainer.log_every={every}", "trainer.eval_every=0",
              "trainer.eval_batches=1", f"debug.step_delay_s={env('MINIDIST_LIVE_SOAK_DELAY_S', '0.1')}"]
    run = lambda d: ft_run(d, *common, group_size=size, timeout_s=3000, ckpt_every=every, tiny=tiny)  # noqa: E731
    run_dir, group_dirs = tmp_path / "killed", [tmp_path / "killed" / f"group_{g}" for g in range(groups)]
    reached = lambda: max((r["step"] for d in group_dirs if (d / "participation.jsonl").is_file()  # noqa: E731
                           for r in rows(run_dir, int(d.name[6:]))), default=0)
    killer = Killer(group_dirs, size, every_s, lambda: reached() > 0,
                    lambda: reached() > float(env("MINIDIST_LIVE_SOAK_KILLING", "0.5")) * total)
    start = time.monotonic()
    killed = run(run_dir)
    killed_s = time.monotonic() - start
    assert killed.returncode == 0, killed.stderr[-4000:]
    assert killer.kills, "no kill landed: the run ended before the first"
    for where, _, at in killer.kills:
        assert_survived(run_dir, int(where[6:]), at, groups, launch_limit_s=5.0 if size == 1 else 10.0)
    same_state(run_dir, groups)
    figures = {"steps": total, "groups": groups, "group_size": size, "strategy": "ddp", "ckpt_every": every,
               "job": "tiny" if tiny else "default", "kill_every_s": every_s, "kills": killer.kills,
               "with_kills_s": round(killed_s, 1), **summarize(run_dir)}
    if env("MINIDIST_LIVE_SOAK_OUT"):
        start = time.monotonic()
        straight = run(tmp_path / "straight")
        figures["straight_s"] = round(time.monotonic() - start, 1)
        assert straight.returncode == 0, straight.stderr[-4000:]
        group_batch = size * (4 if tiny else 16)  # trainer.micro_batch_size
        figures.update(straight_samples=committed_samples(tmp_path / "straight", group_batch),
                       committed_samples=committed_samples(run_dir, group_batch))
        figures["ratio"] = round(figures["committed_samples"] / killed_s /
                                 (figures["straight_samples"] / figures["straight_s"]), 3)
        figures["restart_based"] = restart_based(tmp_path, common, every, every_s, tiny, total, 1.2 * killed_s)
        Path(env("MINIDIST_LIVE_SOAK_OUT")).write_text(json.dumps(figures))
    print("live soak:", json.dumps(figures))


def restart_based(tmp_path: Path, common: list[str], every: int, every_s: float, tiny: bool, total: int,
                  give_up_s: float) -> dict:
    """The same job on 4 ranks under torchrun --max-restarts, a checkpoint every `every` steps, the
    same kill schedule, given `give_up_s` (the live run's time, and a fifth more): what a restart
    from the last checkpoint commits per second. Committed = the steps its checkpoints hold (a
    restart that cannot reach its next checkpoint between two kills commits nothing)."""
    import signal
    import time

    from minidist.train.checkpoint import latest_checkpoint

    def torchrun(run_dir: Path, limit_s: float) -> tuple[float, bool]:
        job = [*common, f"trainer.ckpt_every={every}", f"hydra.run.dir={run_dir}"]
        cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", "--max-restarts", "100",
               "--monitor-interval", "0.1", str(RECIPE), *(tiny_overrides(*job) if tiny else ["strategy=ddp", *job])]
        start = time.monotonic()
        p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            finished = p.wait(timeout=limit_s) == 0
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            finished = False
        return time.monotonic() - start, finished
    straight_s, finished = torchrun(tmp_path / "restart_straight", 3000)
    assert finished
    run_dir, done = tmp_path / "restart_killed", []
    killer = Killer([run_dir], 4, every_s, lambda: (run_dir / "logs").is_dir(), lambda: bool(done))
    killed_s, finished = torchrun(run_dir, give_up_s)
    done.append(True)
    ckpt = latest_checkpoint(run_dir)
    steps = total if finished else int(ckpt.name.split("_")[-1]) if ckpt is not None else 0
    return {"straight_s": round(straight_s, 1), "with_kills_s": round(killed_s, 1), "kills": len(killer.kills),
            "finished": finished, "steps_committed": steps, "ratio": round(steps / killed_s / (total / straight_s), 3)}
