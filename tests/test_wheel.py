"""The package as a user installs it (issue 27): a wheel built from the repository, installed
into a folder of its own, used from an empty directory: `torchrun -m minidist.train` trains and
checkpoints, the `minidist` command reads the checkpoint. Nothing of the checkout is on the path."""

import os
import shutil
import subprocess
import sys

import pytest

from train_cases import ROOT, TINY, TINY_GPT

pytestmark = pytest.mark.slow(stand_in="test_cli.py::test_checkpoint_info_verifies_the_files_and_says_what_it_holds")  # a wheel build and a torchrun start


def run(cmd, cwd, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_an_installed_wheel_trains_under_torchrun_and_reads_its_checkpoint(tmp_path):
    wheels, site, work, source = tmp_path / "wheels", tmp_path / "site", tmp_path / "work", tmp_path / "source"
    work.mkdir()
    # What the repository holds for the build, copied: building leaves build/ and egg-info beside it.
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(ROOT / name, source / name) if source.is_dir() or source.mkdir() is None else None
    for folder in ("minidist", "minidist_tools", "configs"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "_configs"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIP_NO_INDEX": "1"}  # no network: nothing is downloaded
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                 str(source)], cwd=tmp_path, env=env)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next(wheels.glob("minidist-*.whl"))
    done = run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)],
               cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    env = {**env, "PYTHONPATH": str(site)}
    where = run([sys.executable, "-c", "import minidist; print(minidist.__file__)"], cwd=work, env=env)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr  # the wheel's, not the checkout's
    assert (site / "minidist" / "_configs" / "strategy" / "zero2.yaml").is_file()
    assert (site / "minidist_tools" / "compare.py").is_file()  # `minidist compare` runs from the wheel too

    overrides = [*TINY_GPT, *[o for o in TINY if not o.startswith("strategy.")], "trainer.max_steps=5",
                 "strategy=zero2", "hydra.run.dir=run"]
    trained = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "-m", "minidist.train", *overrides], cwd=work, env=env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    ckpt = work / "run" / "checkpoints" / "step_00000005"
    assert (ckpt / "meta.pt").is_file(), sorted(p.name for p in (work / "run").iterdir())

    command = site / "bin" / "minidist"
    info = run([sys.executable, str(command), "checkpoint", "info", str(ckpt)], cwd=work, env=env)
    assert info.returncode == 0, info.stderr[-3000:]
    rows = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in info.stdout.splitlines() if "  " in line}
    assert rows["step"].startswith("5 of 5") and rows["strategy"].startswith("zero2, 2 rank(s)"), info.stdout
    assert "all verified" in info.stdout, info.stdout
