"""A checkpoint folder is untrusted input (issue 26, items 1-4): whatever it holds, resuming and
consolidating end in one line naming the file, in bounded time, and never lose a checkpoint.

- a FIFO or a stray, unlisted file beside the files the manifest lists is ignored (said once),
  never opened: the checkpoint is used;
- a listed file that is a FIFO or a symbolic link is refused unopened;
- garbage in a listed file (its manifest re-signed) is one line naming the file, and
  trainer.resume=auto falls back to the previous checkpoint;
- a small file that unpickles into an astronomically large structure (shared nested lists) is
  refused quickly, and no error message formats what a checkpoint holds without a bound;
- a checkpoint that could not be read is never overwritten by the run that resumed before it.
"""

import contextlib
import io
import os
import shutil
import time

import pytest
import torch

from minidist.train import checkpoint
from minidist.train.checkpoint import latest_checkpoint
from minidist.train.config_check import resolve_resume
from minidist.train.checkpoint_safety import write_manifest
from test_checkpoint_safety import RunsCode
from train_cases import compose_cfg, tiny, tiny_overrides, train_on_rank

AUTO = compose_cfg(tiny_overrides("trainer.max_steps=2", "trainer.resume=auto"))


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    """A ddp run's checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("untrusted") / "run"
    ranks(2).run(train_on_rank, tiny("trainer.max_steps=4", "trainer.ckpt_every=2", "trainer.keep_last=2"),
                 str(run_dir), timeout_s=240)
    return run_dir


def copy_run(saved, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    return run_dir, run_dir / "checkpoints" / "step_00000004"


def resume_auto(run_dir, capsys):
    started = time.monotonic()
    chosen = resolve_resume(AUTO, run_dir)
    return chosen.name, capsys.readouterr().out, time.monotonic() - started


def consolidate(ckpt, tmp_path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = checkpoint.main(["consolidate", str(ckpt), str(tmp_path / "out.pt")])
    return code, err.getvalue()


def test_an_unlisted_fifo_is_ignored_never_opened(saved, tmp_path, capsys):
    run_dir, newest = copy_run(saved, tmp_path)
    os.mkfifo(newest / "x.pt")  # opening it would block forever
    name, said, seconds = resume_auto(run_dir, capsys)
    assert name == "step_00000004" and seconds < 30
    assert "ignoring 1 file(s) in step_00000004 its manifest does not list" in said and "x.pt" in said, said


def test_a_stray_unlisted_pickle_beside_a_valid_checkpoint_is_ignored(saved, tmp_path, capsys):
    run_dir, newest = copy_run(saved, tmp_path)
    marker = tmp_path / "code_ran"
    torch.save({"payload": RunsCode(marker)}, newest / "notes.pt")
    name, said, _ = resume_auto(run_dir, capsys)
    assert name == "step_00000004", said  # used, not skipped (and later overwritten) as before
    assert "notes.pt" in said and not marker.exists()
    code, err = consolidate(newest, tmp_path)
    assert code == 0 and "ignoring 1 file(s)" in err and not marker.exists()


@pytest.mark.parametrize("what", ["fifo", "symlink"])
def test_a_listed_file_that_is_not_a_regular_file_is_refused_unopened(saved, tmp_path, capsys, what):
    run_dir, newest = copy_run(saved, tmp_path)
    if what == "fifo":
        os.mkfifo(newest / "extra.pt")
    else:
        os.symlink("/etc/passwd", newest / "extra.pt")
    manifest = (newest / "manifest.json").read_text()  # re-signed by hand: the FIFO is no file to hash
    (newest / "manifest.json").write_text(manifest.replace('"files": {', '"files": {"extra.pt": {"bytes": 0, '
                                                           '"sha256": "0"}, ', 1))
    name, said, seconds = resume_auto(run_dir, capsys)
    assert name == "step_00000002" and seconds < 30  # fell back
    kind = "a FIFO" if what == "fifo" else "a symbolic link"
    assert f"extra.pt is {kind}, not a file minidist wrote: refused unopened" in said, said
    code, err = consolidate(newest, tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1 and kind in err


@pytest.mark.parametrize("garbage", [b"just some text\n", b"text, then bytes " + bytes(range(256)) * 4])
def test_garbage_in_a_listed_file_is_one_line_and_resume_falls_back(saved, tmp_path, capsys, garbage):
    run_dir, newest = copy_run(saved, tmp_path)
    (newest / "model.pt").write_bytes(garbage)
    write_manifest(newest)  # re-signed: only the reader stands in the way
    name, said, _ = resume_auto(run_dir, capsys)
    assert name == "step_00000002"
    assert "skipping step_00000004" in said and "model.pt could not be read" in said, said
    code, err = consolidate(newest, tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "model.pt could not be read" in err, err


def test_a_structure_too_large_to_walk_is_refused_quickly(saved, tmp_path, capsys):
    """3.5 KB on disk, 2**60 entries as a tree: every formatter or traversal would never finish."""
    run_dir, newest = copy_run(saved, tmp_path)
    meta = checkpoint.read_meta(newest)
    nested: list = []
    for _ in range(60):
        nested = [nested, nested]
    meta["config"]["model"] = nested
    torch.save(meta, newest / "meta.pt")
    write_manifest(newest)
    assert (newest / "meta.pt").stat().st_size < 20_000
    name, said, seconds = resume_auto(run_dir, capsys)
    assert name == "step_00000002" and seconds < 30, seconds
    assert "meta.pt was not loaded: its containers nest into more than" in said, said


def test_an_unreadable_checkpoint_is_set_aside_not_overwritten(ranks, saved, tmp_path):
    run_dir, newest = copy_run(saved, tmp_path)
    (newest / "optimizer.pt").write_bytes(b"damaged")
    write_manifest(newest)
    chosen = resolve_resume(AUTO, run_dir)
    assert chosen.name == "step_00000002"
    ranks(2).run(train_on_rank, tiny("trainer.max_steps=4", "trainer.ckpt_every=2", "trainer.keep_last=2"),
                 str(run_dir), str(chosen), timeout_s=240)
    aside = run_dir / "checkpoints" / "step_00000004.unreadable"
    assert aside.is_dir() and (aside / "optimizer.pt").read_bytes() == b"damaged"  # kept as it was
    assert latest_checkpoint(run_dir).name == "step_00000004"
    assert resolve_resume(AUTO, run_dir).name == "step_00000004"  # the new one reads


@pytest.fixture(scope="module")
def saved_dcp(ranks, tmp_path_factory):
    """A native_fsdp run's checkpoints (torch.distributed.checkpoint's folders) at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("untrusted_dcp") / "run"
    ranks(2).run(train_on_rank, tiny("trainer.max_steps=4", "trainer.ckpt_every=2", "trainer.keep_last=2",
                                     strategy="native_fsdp"), str(run_dir), timeout_s=240)
    return run_dir


def test_dcp_metadata_that_would_run_code_is_refused_and_resume_falls_back(saved_dcp, tmp_path, capsys):
    """DCP's own reader would pickle.load its .metadata; ours resolves only DCP's classes."""
    import pickle

    run_dir, newest = copy_run(saved_dcp, tmp_path)
    marker = tmp_path / "ran"
    (newest / "dcp" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    write_manifest(newest)  # re-signed: only the reader stands in the way
    name, said, _ = resume_auto(run_dir, capsys)
    assert name == "step_00000002" and not marker.exists()
    assert "was not loaded: it names io.open" in said, said
    code, err = consolidate(newest, tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "io.open" in err and not marker.exists(), err


def test_a_dcp_item_that_would_run_code_is_refused_before_dcp_unpickles_it(saved_dcp, tmp_path):
    """A non-tensor item (a param group's lr) is unpickled by DCP with weights_only=False: ours
    first proves it under torch's restricted unpickler."""
    import pickle

    from minidist.train import checkpoint_safety
    from minidist.train.config import CheckpointRefused
    from minidist_tools.native import read_full

    ckpt = saved_dcp / "checkpoints" / "step_00000004" / "dcp"
    folder = tmp_path / "dcp"
    shutil.copytree(ckpt, folder)
    meta = checkpoint_safety.read_metadata(folder)
    key = next(k for k in meta.state_dict_metadata if k.endswith("param_groups.0.lr"))
    where = meta.storage_data[next(i for i in meta.storage_data if i.fqn == key)]
    payload = io.BytesIO()
    torch.save(RunsCode(tmp_path / "ran"), payload)
    data = bytearray((folder / where.relative_path).read_bytes())
    blob = payload.getvalue()
    data[where.offset:where.offset + where.length] = blob[:where.length].ljust(where.length, b"\0")
    if len(blob) <= where.length:
        (folder / where.relative_path).write_bytes(bytes(data))
    else:  # longer than the slot: append it and point the metadata there (as a writer could)
        where.offset, where.length = len(data), len(blob)
        (folder / where.relative_path).write_bytes(bytes(data) + blob)
        (folder / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointRefused, match="param_groups.0.lr in a torch.distributed.checkpoint folder holds"):
        read_full(folder)
    assert not (tmp_path / "ran").exists()
