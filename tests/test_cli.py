"""The `minidist` command (minidist/cli.py) in-process: its help, a wrong command in one line,
and `minidist checkpoint info` on a real checkpoint, a tampered one refused. The installed
wheel, end to end: test_wheel.py (slow)."""

from minidist import cli
from minidist.train.checkpoint import latest_checkpoint
from minidist.train.config import config_dir
from train_cases import ROOT, tiny, train_on_rank


def test_help_and_a_wrong_command(capsys):
    assert cli.main(["--help"]) == 0
    assert "checkpoint  info CKPT | consolidate CKPT OUT.pt" in capsys.readouterr().out
    assert cli.main([]) == 2
    capsys.readouterr()
    assert cli.main(["trian"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["error: minidist trian: no such command; the commands are train, compare, checkpoint "
                     "(minidist --help)"]
    assert cli.main(["tour"]) == 2  # moved out of the package: said in one line
    assert capsys.readouterr().err == ("error: minidist tour: the primitives tour is reading material in the "
                                       "repository now: python recipes/tour.py in a checkout\n")


def test_checkpoint_info_verifies_the_files_and_says_what_it_holds(ranks, tmp_path, capsys):
    ranks(2).run(train_on_rank, tiny("trainer.max_steps=2", strategy="zero2"), str(tmp_path), timeout_s=240)
    ckpt = latest_checkpoint(tmp_path)
    assert cli.main(["checkpoint", "info", str(ckpt)]) == 0
    out = " ".join(capsys.readouterr().out.split(" "))
    rows = {line[:13].strip(): line[13:].strip() for line in out.splitlines()}
    assert rows["step"] == "2 of 2 (trainer.max_steps)"
    assert rows["strategy"] == "zero2, 2 rank(s); sharded: 2 shard file(s)"
    assert rows["data position"] == ("epoch 0, 16 samples into it (global batch 8: resumes exactly at any world "
                                     "size that divides it)")
    assert "listed in its manifest, all verified" in out and f"trainer.resume={ckpt}" in out
    with open(ckpt / "meta.pt", "ab") as f:  # one byte more than its manifest says
        f.write(b"\0")
    assert cli.main(["checkpoint", "info", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "meta.pt" in err[0], err


def test_the_configs_are_the_repository_s_in_a_checkout():
    assert config_dir() == ROOT / "configs"  # a wheel carries its copy as minidist/_configs (test_wheel.py)


def test_help_imports_no_torch():
    """`minidist --help` answers at once: no torch import (it took 9 s on a cold machine)."""
    import subprocess
    import sys

    code = "import sys; from minidist import cli; cli.main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr
