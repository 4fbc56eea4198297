"""Opening a checkpoint never runs code: a tampered file of any checkpoint kind is refused, by the
resume check and by `minidist checkpoint consolidate`, naming the file, and the code
in it never runs (a marker file it would create stays absent).

The tampered file is a pickle whose unpickling calls open(MARKER, "w"): with
torch.load(weights_only=False) that creates the marker; minidist must refuse it unread.
Two lines of defence, each tested alone: the manifest (a changed file no longer matches its
recorded size and sha256), and, for a tamperer who rewrote the manifest too, the restricted
unpickler.
"""

import contextlib
import io
import shutil

import pytest
import torch

from minidist.train import checkpoint
from minidist.train.checkpoint import latest_checkpoint
from minidist.train.config_check import check_run_fits, verified
from minidist.train.checkpoint_safety import ManifestMismatch, write_manifest
from minidist.train.checkpoint_safety import CheckpointRefused
from train_cases import compose_cfg, tiny, tiny_overrides, train_on_rank

KINDS = {  # kind: (strategy, overrides, the files replaced in turn)
    "full": ("ddp", [], ["meta.pt", "optimizer.pt", "model.pt", "rank00001.pt"]),
    "sharded": ("zero2", [], ["shard_rank00001.pt", "layout.pt"]),
    "hybrid": ("hsdp2", ["strategy.shard_size=1"], ["shard_rank00000.pt", "rank00000.pt"]),
    "deepspeed": ("ds_zero2", [], ["deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
}


class RunsCode:
    """Unpickling this calls open(path, "w"): the marker file appears if the pickle is trusted."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class Checkpoints(dict):
    """kind -> a checkpoint of it, each written when a test first asks for it (2 steps, 2 ranks)."""

    def __init__(self, ranks, root):
        super().__init__()
        self.ranks, self.root = ranks, root

    def __missing__(self, kind: str):
        strategy, overrides, _ = KINDS[kind]
        if strategy.startswith("ds_"):
            pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra (pip install -e '.[deepspeed]')")
        self.ranks(2).run(train_on_rank, tiny("trainer.max_steps=2", *overrides, strategy=strategy),
                          str(self.root / kind), timeout_s=240)
        self[kind] = latest_checkpoint(self.root / kind)
        return self[kind]


@pytest.fixture(scope="module")
def checkpoints(ranks, tmp_path_factory):
    return Checkpoints(ranks, tmp_path_factory.mktemp("ckpts"))


def tampered(checkpoints, kind: str, name: str, tmp_path, manifest_too: bool = True):
    """A copy of the checkpoint with `name` replaced by a code-running pickle; with manifest_too,
    its manifest rewritten to match (so that only the restricted unpickler stands in the way)."""
    ckpt = tmp_path / "step_00000002"
    shutil.copytree(checkpoints[kind], ckpt)
    marker = tmp_path / "code_ran"
    torch.save({"format": "minidist.train.v1", "step": 2, "payload": RunsCode(marker)}, ckpt / name)
    if manifest_too:
        write_manifest(ckpt)
    return ckpt, marker


# make test-all: DeepSpeed's own files too (its engine's start-up costs seconds)
@pytest.mark.parametrize("kind, name", [pytest.param(k, n, marks=pytest.mark.slow(
    stand_in="test_tampered_file_is_refused_by_resume_and_consolidate[full-meta.pt]")) if k == "deepspeed" else (k, n)
                                        for k, (_, _, names) in KINDS.items() for n in names])
def test_tampered_file_is_refused_by_resume_and_consolidate(checkpoints, kind, name, tmp_path):
    strategy, overrides, _ = KINDS[kind]
    ckpt, marker = tampered(checkpoints, kind, name, tmp_path)
    cfg = compose_cfg(tiny_overrides("trainer.max_steps=2", *overrides, strategy=strategy))
    with pytest.raises(CheckpointRefused, match=rf"{name.split('/')[-1]} was not loaded: .* nothing in it was run"):
        check_run_fits(cfg, verified(ckpt), 2)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert checkpoint.main(["consolidate", str(ckpt), str(tmp_path / "out.pt")]) == 2
    assert name.split("/")[-1] in err.getvalue() and "was not loaded" in err.getvalue(), err.getvalue()
    assert not marker.exists(), "the tampered pickle's code ran"
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow(stand_in="test_a_changed_file_fails_the_manifest[full]"))
                                  if k == "deepspeed" else k for k in KINDS])  # DeepSpeed's start-up: make test-all
def test_a_changed_file_fails_the_manifest(checkpoints, kind, tmp_path):
    """Without the manifest rewritten, the changed file is refused by its checksum, unopened."""
    name = KINDS[kind][2][0]
    ckpt, marker = tampered(checkpoints, kind, name, tmp_path, manifest_too=False)
    cfg = compose_cfg(tiny_overrides("trainer.max_steps=2", *KINDS[kind][1], strategy=KINDS[kind][0]))
    with pytest.raises(ManifestMismatch, match=rf"{name} (has \d+ bytes, its manifest says \d+|does not match the "
                                               r"sha256 in its manifest).* none of the checkpoint was loaded"):
        check_run_fits(cfg, verified(ckpt), 2)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert checkpoint.main(["consolidate", str(ckpt), str(tmp_path / "out.pt")]) == 2
    assert name in err.getvalue() and "manifest" in err.getvalue(), err.getvalue()
    assert not marker.exists()


def test_a_missing_file_or_manifest_is_named(checkpoints, tmp_path):
    cfg = compose_cfg(tiny_overrides("trainer.max_steps=2"))
    ckpt = tmp_path / "step_00000002"
    shutil.copytree(checkpoints["full"], ckpt)
    (ckpt / "rank00001.pt").unlink()
    with pytest.raises(ManifestMismatch, match="rank00001.pt is missing .* incomplete"):
        check_run_fits(cfg, verified(ckpt), 2)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(ManifestMismatch, match="manifest.json is missing or unreadable"):
        check_run_fits(cfg, verified(ckpt), 2)


def test_a_truncated_file_is_named(checkpoints, tmp_path):
    ckpt = tmp_path / "step_00000002"
    shutil.copytree(checkpoints["full"], ckpt)
    data = (ckpt / "meta.pt").read_bytes()
    (ckpt / "meta.pt").write_bytes(data[: len(data) // 2])
    cfg = compose_cfg(tiny_overrides("trainer.max_steps=2"))
    with pytest.raises(ManifestMismatch, match=rf"meta.pt has {len(data) // 2} bytes, its manifest says {len(data)}"):
        check_run_fits(cfg, verified(ckpt), 2)
    write_manifest(ckpt)  # truncated before the manifest was written: the reader still names it
    with pytest.raises(CheckpointRefused, match="meta.pt could not be read .* truncated"):
        check_run_fits(cfg, verified(ckpt), 2)


def test_a_file_changed_in_place_at_its_size_fails_the_sha256(checkpoints, tmp_path):
    """One byte flipped, the size unchanged: only the checksum can tell (a bit flip on disk)."""
    ckpt = tmp_path / "step_00000002"
    shutil.copytree(checkpoints["full"], ckpt)
    data = bytearray((ckpt / "model.pt").read_bytes())
    data[-100] ^= 0xFF
    (ckpt / "model.pt").write_bytes(bytes(data))
    cfg = compose_cfg(tiny_overrides("trainer.max_steps=2"))
    with pytest.raises(ManifestMismatch, match="model.pt does not match the sha256 in its manifest"):
        check_run_fits(cfg, verified(ckpt), 2)


def test_the_trainer_refuses_in_one_line_with_exit_2(checkpoints, tmp_path, capsys):
    """Through the recipe's entry (launch: the checks come before any rank starts)."""
    from minidist.train.app import launch
    from train_cases import compose_cfg

    ckpt, marker = tampered(checkpoints, "full", "optimizer.pt", tmp_path)
    status = launch(compose_cfg(tiny_overrides("trainer.max_steps=3", f"trainer.resume={ckpt}")), tmp_path / "run")
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "optimizer.pt was not loaded" in lines[0], lines[0]
    assert not marker.exists()


def test_every_file_and_folder_is_synced_to_disk(tmp_path, monkeypatch):
    """Durability: what save_checkpoint fsyncs before its rename (each rank) and after it (rank 0)."""
    import os
    (tmp_path / "ckpt" / "deepspeed").mkdir(parents=True)
    for name in ("meta.pt", "rank00000.pt", "deepspeed/state.pt"):
        (tmp_path / "ckpt" / name).write_bytes(b"x")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    checkpoint.sync_to_disk(tmp_path / "ckpt")
    expected = {str(tmp_path / "ckpt" / n) for n in ("meta.pt", "rank00000.pt", "deepspeed/state.pt", "deepspeed", "")}
    assert {s.rstrip("/") for s in synced} == {e.rstrip("/") for e in expected}


def resident_pages(path) -> int:
    """How many of `path`'s pages are in the page cache (mincore over a mapping of the file)."""
    import ctypes
    import mmap
    size = path.stat().st_size
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        start = ctypes.c_char.from_buffer(mm)
        assert ctypes.CDLL(None).mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec) == 0
        del start
        mm.close()
    return sum(v & 1 for v in vec)


def test_a_file_synced_to_disk_leaves_the_page_cache(tmp_path):
    """A checkpoint's files, once fsynced, are dropped from memory (a checkpoint kept there makes
    the next one's pages cost the writer more: checkpoint.sync_to_disk)."""
    import os
    # The control drops its pages by hand, not through sync_to_disk: were sync_to_disk to keep them,
    # this test must fail, not skip.
    control = tmp_path / "control.bin"
    control.write_bytes(os.urandom(1 << 20))
    fd = os.open(control, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if resident_pages(control):
        pytest.skip("this file system keeps files in memory (tmpfs): there is no page cache to leave")
    (tmp_path / "ckpt").mkdir()
    model = tmp_path / "ckpt" / "model.pt"
    model.write_bytes(os.urandom(4 << 20))
    assert resident_pages(model) > 0  # written: in the page cache
    checkpoint.sync_to_disk(tmp_path / "ckpt")
    assert resident_pages(model) == 0


def test_resume_auto_falls_back_to_the_newest_readable_checkpoint(checkpoints, tmp_path, capsys):
    from minidist.train.config_check import resolve_resume
    from minidist.train.config import ConfigError
    run_dir = tmp_path / "run"
    for step in (2, 4):
        shutil.copytree(checkpoints["full"], run_dir / "checkpoints" / f"step_{step:08d}")
    newest = run_dir / "checkpoints" / "step_00000004" / "meta.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, e.g. by a full disk
    cfg = compose_cfg(tiny_overrides("trainer.max_steps=2", "trainer.resume=auto"))
    assert resolve_resume(cfg, run_dir).name == "step_00000002"
    said = capsys.readouterr().out
    assert "skipping step_00000004" in said and "meta.pt has 100 bytes, its manifest says" in said, said
    older = run_dir / "checkpoints" / "step_00000002" / "optimizer.pt"
    older.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="none of the 2 checkpoints .* can be read"):
        resolve_resume(cfg, run_dir)


def test_a_short_write_on_a_nearly_full_disk_is_reported_as_one(tmp_path, monkeypatch):
    """torch's writer can see a short write the OS did not raise for (buffered); with next to no
    space left it is a full disk, reported with the OS's errno; elsewhere torch's error stands."""
    import collections
    import errno

    import pytest
    import torch

    from minidist.train import checkpoint_safety

    def short_write(obj, f):
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", short_write)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint_safety.shutil, "disk_usage", lambda p: usage(10, 10, 0))
    with pytest.raises(OSError) as raised:
        checkpoint_safety.save_tensors({}, tmp_path / "x.pt")
    assert raised.value.errno == errno.ENOSPC and "x.pt" in str(raised.value)
    monkeypatch.setattr(checkpoint_safety.shutil, "disk_usage", lambda p: usage(1 << 40, 0, 1 << 40))
    with pytest.raises(RuntimeError, match="file write failed"):
        checkpoint_safety.save_tensors({}, tmp_path / "y.pt")
