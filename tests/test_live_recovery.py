"""Live recovery (ft=torchft): replica groups that keep stepping when one dies, a relaunched group
that heals from a live peer (no checkpoint read), and a replay of the participation log that ends
in the same state. The end-to-end runs need torchft (the ft extra, which make test-all installs)."""

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
           timeout_s: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(AUDIT),
           "MINIDIST_AUDIT_OPENS": str(run_dir.parent / f"{run_dir.name}.opens")}
    cmd = [PYTHON, str(RECIPE), *tiny_overrides("ft=torchft", f"launcher.nproc={nproc}", f"ft.group_size={group_size}",
                                                "ft.timeout_s=5", "launcher.timeout_s=60", "trainer.ckpt_every=5",
                                                "trainer.log_every=5", *overrides, f"hydra.run.dir={run_dir}",
                                                strategy=strategy)]
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
    assert cmd[1:3] == ["-m", "minidist.train"]
    assert cmd[3:] == ["strategy=zero2", "ft=torchft", "hydra.run.dir=/runs/a/group_1", "launcher.nproc=2", "ft.group=1",
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


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """Each layout's run with its last rank SIGKILLed after step KILL_AT, made once."""
    made = {}

    def run(strategy: str, group_size: int):
        if (strategy, group_size) not in made:
            run_dir = tmp_path_factory.mktemp(f"ft_{strategy}_{group_size}") / "run"
            out = ft_run(run_dir, "debug.kill_rank=3", f"debug.kill_at_step={KILL_AT}", "trainer.max_steps=100",
                         "debug.step_delay_s=0.12", strategy=strategy, group_size=group_size)
            assert out.returncode == 0, out.stderr[-4000:]
            made[strategy, group_size] = run_dir, out
        return made[strategy, group_size]
    return run


@needs_torchft
@pytest.mark.slow(stand_in="test_the_average_counts_only_the_groups_that_contribute")
@pytest.mark.parametrize("strategy,group_size", [("ddp", 2), ("zero2", 2), ("ddp", 1)])
def test_a_killed_rank_is_survived_and_its_group_heals_from_a_peer(killed_runs, strategy, group_size):
    run_dir, out = killed_runs(strategy, group_size)
    dead = 3 // group_size  # the killed rank's group
    groups = 4 // group_size
    killed_at = marker(run_dir / f"group_{dead}", 3, KILL_AT).stat().st_mtime
    # No survivor exited: the launcher relaunched the dead group only, once.
    said = [line[line.index("live recovery"):] for line in out.stderr.splitlines()  # (after a progress bar's \r)
            if "live recovery: replica group" in line]
    assert len(said) == 1 and said[0].startswith(f"live recovery: replica group {dead} ended"), out.stderr[-3000:]
    assert f"live recovery: {groups} groups x {group_size} ranks; failures survived 1" in out.stderr
    # The survivors' first committed step after the kill within 2 s, at most one step discarded.
    survivor = rows(run_dir, 0)
    after = [r for r in survivor if r["kind"] == "commit" and r["time"] > killed_at]
    assert after[0]["time"] - killed_at < 2.0, (after[0], killed_at)
    assert sum(r["kind"] == "discard" for r in survivor) <= 1
    assert any(r["participants"] == groups - 1 for r in after)  # it did step without the dead group
    # The relaunched group: healed from a live peer, its first committed step soon after its launch,
    # and not one checkpoint file read by it.
    back = rows(run_dir, dead)
    heal = next(r for r in back if r["kind"] == "heal")
    first = next(r for r in back if r["kind"] == "commit" and r["time"] > heal["time"])
    assert first["time"] - heal["launched_at"] < (10.0 if group_size == 2 else 5.0), (heal, first)
    opens = (run_dir.parent / "run.opens").read_text().splitlines() if (run_dir.parent / "run.opens").exists() else []
    assert not [line for line in opens if line.split()[0] == repr(heal["launched_at"])], opens[:5]
    # Every group ends in the same state: model and optimizer, bitwise.
    digests = {json.loads((run_dir / f"group_{g}" / "summary.json").read_text())["state_digest"] for g in range(groups)}
    assert len(digests) == 1
    for g in range(1, groups):
        assert_same(final(run_dir, 0), final(run_dir, g), f"group {g}")


@needs_torchft
@pytest.mark.slow(stand_in="test_the_average_counts_only_the_groups_that_contribute")
def test_the_participation_log_replayed_without_faults_ends_in_the_same_state(killed_runs, tmp_path):
    run_dir, _ = killed_runs("ddp", 2)
    steps = read_participation(run_dir)
    assert {len(groups) for groups in steps.values()} == {1, 2}  # steps with one group and with both
    replay = ft_run(tmp_path / "replay", "trainer.max_steps=100", f"ft.replay={run_dir}")
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
