"""Resident memory, measured as the operating system sees it (recipes/bench_memory.py).

First the measurement itself: in a process started the way every strategy is measured,
RSS must rise by a tensor's size while it lives and fall back when it is freed.
Then the target: every ZeRO stage's RSS within 1.15 x the ZeRO formula + 8 MiB + the
buckets or units it keeps in flight, on every rank, at 4 ranks. And the ranks minidist starts
itself: freed large blocks go back to the system (the allocator setting run_local gives them),
and the folder torch's launcher needs is theirs to remove.
"""

import contextlib
import functools
import os
import sys
from pathlib import Path

import pytest

from test_live_recovery import needs_torchft
from train_cases import ROOT

sys.path.insert(0, str(ROOT / "recipes"))  # the benchmark recipe holds the measurement
from bench_memory import (allocate_and_free, gathers_kept, huge_pages_of_a_block, launch_fresh,  # noqa: E402
                          measure_state_rss, within_target)

MLP_8M = [1024, 2048, 2048, 1024]


@pytest.mark.slow(stand_in="test_zero.py::test_memory_matches_the_zero_paper")  # a fresh process
def test_rss_follows_a_live_tensor_and_its_release():
    results = launch_fresh(allocate_and_free, 1, (64,))
    alive, after = results[0]
    assert 63 * 2**20 <= alive <= 66 * 2**20, alive / 2**20
    assert after <= 2 * 2**20, after / 2**20  # given back: MALLOC_MMAP_THRESHOLD_ works


@pytest.mark.slow(stand_in="test_zero.py::test_memory_matches_the_zero_paper")  # and the RSS probe's own test above
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_every_zero_stage_within_the_formula(strategy):
    ranks = launch_fresh(measure_state_rss, 4, (strategy, MLP_8M, 1.0))
    for r in ranks.values():
        assert within_target(r), (f"rank {r['rank']}: RSS {r['rss_bytes'] / 2**20:.1f} MiB, formula "
                                  f"{r['formula_bytes'] / 2**20:.1f}, in flight {r['inflight_bytes'] / 2**20:.1f}")
        assert r["rss_bytes"] >= 0.9 * r["formula_bytes"]  # the state is really there: no vacuous bound


@pytest.mark.slow(stand_in="test_run_local_gives_its_ranks_the_threshold_unless_the_user_set_one")  # fresh processes
def test_ranks_minidist_starts_give_freed_large_blocks_back(monkeypatch):
    """glibc alone kept hundreds of MiB of 16 freed 32 MiB gathers (docs/trainer.md, "Memory"); the
    ranks run_local starts keep none of them."""
    from minidist.dist import MALLOC_ENV
    from minidist.train.app import run_local

    for key in MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    for kept, threshold in run_local(gathers_kept, nproc=2, args=(16, 32)).values():
        assert threshold == str(MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"])
        assert kept <= 8 * 2**20, kept / 2**20


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP.is_file() or "[never]" in THP.read_text(),
                               reason="transparent huge pages off in this kernel")


def assert_huge_pages_for_large_blocks_only(block: int, heap: int) -> None:
    """A 12 MiB tensor lies on 2 MiB pages (THP_MEM_ALLOC_ENABLE=1): a few page faults, not
    thousands; the heap does not (glibc.malloc.hugetlb=1 put >100 MiB of it there, and each start
    of a rank cost ~0.7 s more: docs/trainer.md, "Memory")."""
    assert block >= 8 * 2**20 and heap <= 8 * 2**20, (block / 2**20, heap / 2**20)


@needs_thp
def test_ranks_minidist_starts_get_huge_pages_for_large_blocks_only(monkeypatch):
    """The ranks run_local starts (assert_huge_pages_for_large_blocks_only says what and why)."""
    from minidist.dist import MALLOC_ENV
    from minidist.train.app import run_local

    for key in MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    for block, heap in run_local(huge_pages_of_a_block, nproc=1, args=(12,)).values():
        assert_huge_pages_for_large_blocks_only(block, heap)


def huge_pages_to_file(path: str, argv: list[str]) -> None:
    """A live-recovery rank's entry (in place of the trainer's main): huge_pages_of_a_block, to a file."""
    Path(path).write_text(" ".join(map(str, [*huge_pages_of_a_block(12), os.environ.get("MALLOC_MMAP_THRESHOLD_")])))


def one_ft_group(seen: str) -> None:
    """ft=torchft's launcher with one group of one rank, huge_pages_to_file its entry; then whether
    the launcher's own environment holds any of MALLOC_ENV, appended to `seen`."""
    from omegaconf import OmegaConf

    from minidist.dist import MALLOC_ENV
    from minidist.train import ft_launch

    ft_launch.PRELOAD = ["minidist.train.app"]  # (not torchft's 3 s of imports: not needed here)
    cfg = OmegaConf.create({"ft": {"group_size": 1, "lighthouse": None, "min_replicas": 1, "timeout_s": 10,
                                   "heartbeat_ms": 1000, "relaunch": False}})
    code = ft_launch.launch_groups(cfg, Path(seen).parent / "run", [], 1, entry=functools.partial(huge_pages_to_file, seen))
    with open(seen, "a") as f:
        f.write(f" {code} {any(k in os.environ for k in MALLOC_ENV)}")


@pytest.mark.slow(stand_in="test_ranks_minidist_starts_get_huge_pages_for_large_blocks_only")  # needs torchft
@needs_thp
@needs_torchft
def test_live_recovery_ranks_get_the_allocator_too(tmp_path):
    """ft=torchft's ranks, forked from one fork server, are given MALLOC_ENV as run_local's are
    (through the fork server's environment); the launcher's own is left as it was. In a fresh
    process: the fork server is one per process, and this one's may be the rank pools'."""
    import subprocess

    from minidist.dist import MALLOC_ENV

    seen = tmp_path / "seen"
    script = (f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(ROOT / 'recipes')!r}]; "
              f"import test_rss; test_rss.one_ft_group({str(seen)!r})")
    done = subprocess.run([sys.executable, "-c", script], env={k: v for k, v in os.environ.items() if k not in MALLOC_ENV},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    block, heap, threshold, code, launchers = seen.read_text().split()
    assert_huge_pages_for_large_blocks_only(int(block), int(heap))
    assert (threshold, code, launchers) == (str(MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]), "0", "False")


@pytest.mark.parametrize("users", [None, "65536"])
def test_run_local_gives_its_ranks_the_threshold_unless_the_user_set_one(monkeypatch, users):
    """What the ranks' environment holds when run_local starts them (the launch itself replaced), and
    that this process's environment is left as it was. The trim threshold comes with ours (a fixed
    mmap threshold switches off glibc's own); a user's threshold leaves the allocator to them."""
    import torch.distributed.launcher.api as launcher
    from minidist.dist import MALLOC_ENV
    from minidist.train.app import run_local

    seen = {}
    monkeypatch.setattr(launcher, "elastic_launch", lambda config, entrypoint: lambda *args: seen.update(
        {k: os.environ.get(k) for k in MALLOC_ENV}) or {0: None})
    for key in MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    if users is not None:
        monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", users)
    run_local(print, nproc=2)
    assert seen == ({k: str(v) for k, v in MALLOC_ENV.items()} if users is None else
                    {**dict.fromkeys(MALLOC_ENV), "MALLOC_MMAP_THRESHOLD_": users})
    assert {k: os.environ.get(k) for k in MALLOC_ENV} == {**dict.fromkeys(MALLOC_ENV), "MALLOC_MMAP_THRESHOLD_": users}


@pytest.mark.parametrize("fails", [False, True])
def test_run_local_gives_torch_a_folder_of_its_own_and_removes_it(monkeypatch, tmp_path, fails):
    """torch's elastic agent, left to choose, makes a /tmp/torchelastic_* folder per launch and leaves
    it there: run_local hands it one in the temporary folder and removes it, whether the ranks
    succeed or fail; one a killed launcher left (kill -9) goes at the next launch, never a live one's."""
    import subprocess
    import tempfile

    import torch.distributed.launcher.api as launcher
    from minidist.train.app import run_local

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    for owner in (dead.pid, os.getpid()):
        (tmp_path / f"minidist-launch-{owner}-abcd" / "attempt_0").mkdir(parents=True)
    seen = []

    def launch(config, entrypoint):
        def ranks(*args):
            seen.append(config.logs_specs.root_log_dir)
            assert Path(seen[0]).is_dir() and Path(seen[0]).parent == tmp_path
            assert not (tmp_path / f"minidist-launch-{dead.pid}-abcd").exists()
            if fails:
                raise RuntimeError("a rank failed")
            return {0: None}
        return ranks

    monkeypatch.setattr(launcher, "elastic_launch", launch)
    with pytest.raises(RuntimeError, match="a rank failed") if fails else contextlib.nullcontext():
        run_local(print, nproc=1)
    assert seen and Path(seen[0]).name.startswith(f"minidist-launch-{os.getpid()}-")
    assert [p.name for p in tmp_path.iterdir()] == [f"minidist-launch-{os.getpid()}-abcd"]
