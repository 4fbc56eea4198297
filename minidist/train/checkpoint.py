"""Trainer checkpoints: atomic, complete, resumable exactly; consolidated offline for any strategy.

    <run dir>/checkpoints/step_00000100/   meta.pt, rank00000.pt, the strategy's layout
                                           (checkpoint_layouts.py), manifest.json (written last)
    minidist checkpoint consolidate CKPT_DIR OUT.pt   # a plain state_dict

Files are loaded with weights_only=True (checkpoint_safety.py). How saving is atomic and durable:
docs/internals.md, "train/checkpoint.py".
"""

from __future__ import annotations

import os
import random
import re
import shutil
import stat
import sys
from pathlib import Path

import torch

from minidist import comm
from minidist.dist import get_logger
from minidist.train.checkpoint_layouts import layout_for, layout_of, write_files
from minidist.train.checkpoint_safety import NAME as MANIFEST, load_tensors, verify_checkpoint_files, write_manifest
from minidist.train.config import ConfigError

FORMAT = "minidist.train.v1"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_folders(run_dir: Path, step: int) -> tuple[Path, Path]:
    """(the checkpoint of `step`, the `.tmp` folder it is written in until the rename)."""
    final = Path(run_dir) / "checkpoints" / step_dir_name(step)
    return final, final.with_name(f".{final.name}.tmp")


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints under run_dir/checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / "meta.pt").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def read_meta(ckpt: Path) -> dict:
    meta_file = Path(ckpt) / "meta.pt"
    if not meta_file.is_file():
        raise ConfigError(f"{ckpt} is not a minidist checkpoint (no meta.pt): give trainer.resume a "
                          "checkpoints/step_XXXXXXXX folder, auto, or none")
    meta = load_tensors(meta_file)
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{ckpt} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def rank_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank:05d}.pt"


def rank_state(module) -> dict:
    """What differs between ranks and the model/optimizer files do not hold: RNG and buffers."""
    return {"rng": rng_state(), "buffers": {k: v.detach().cpu().clone() for k, v in module.named_buffers()}}


def load_rank_state(state: dict, module) -> None:
    set_rng_state(state["rng"])
    with torch.no_grad():
        for key, value in module.named_buffers():
            value.copy_(state["buffers"][key])


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointWriteFailed(RuntimeError):
    """A checkpoint could not be written (no space, no permission, an I/O error); the previous
    checkpoints are untouched."""


def remove_partial_saves(run_dir: Path) -> list[str]:
    """Remove the `.step_*.tmp` folders a save that did not finish left behind, and the
    `.step_*.removing` ones a background removal did not finish (prune); their names."""
    root = Path(run_dir) / "checkpoints"
    stale = sorted(f for f in [*root.glob(".step_*.tmp"), *root.glob(".step_*.removing")] if not f.is_symlink()) \
        if root.is_dir() else []
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)  # (a link there is left alone: begin_save refuses it)
    return [folder.name for folder in stale]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def _write_error(error: BaseException) -> bool:
    """Is this the file system refusing a write (as opposed to a bug)? torch's own writer, where
    a library writes by path (DeepSpeed), reports a short write only as "unexpected pos"."""
    return isinstance(error, OSError) or (isinstance(error, RuntimeError) and "inline_container" in str(error))


def _any_rank(failed: bool) -> bool:
    """Did the write fail on any rank? A collective: every rank learns it, so all stop alike."""
    return comm.max_over_ranks(1.0 if failed else 0.0) > 0


def _describe_failure(error: BaseException | None, run_dir: Path, root: Path, written: int, step: int) -> str:
    """One line: which step and folder, what the OS said, bytes needed and free, what is intact."""
    previous = list_checkpoints(run_dir)
    need = (f"it needs about {folder_bytes(previous[-1]) / 2**20:.1f} MiB (the size of {previous[-1].name})"
            if previous else f"it needs more than the {written / 2**20:.1f} MiB written before the failure")
    free = shutil.disk_usage(root).free
    said = f"{error.__class__.__name__}: {error}" if error is not None else "another rank's write failed"
    kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "there is no earlier checkpoint"
    return (f"step {step}: the checkpoint could not be written to {root} ({said}); {need}, "
            f"{free / 2**20:.1f} MiB are free there (the partial one removed); {kept}; free space (or fix the "
            "folder's permissions) and resume with trainer.resume=auto")


def save_checkpoint(run_dir: Path, step: int, strategy, meta: dict, before_commit=None) -> Path:
    """Write the checkpoint of `step` atomically. A collective. (Older checkpoints go later, when
    the steps after this one have shown it healthy: `prune`, the trainer's divergence guard.)

    `before_commit()` runs on each rank once its files are written, before the rename (fault
    injection: debug.kill_during=save). A write that fails on any rank raises
    CheckpointWriteFailed on every rank, with the partial folder removed and the previous
    checkpoints untouched. (async_checkpoint.py runs the same three phases, the middle one in
    the background.)"""
    tmp = begin_save(run_dir, step, strategy)
    error, written = None, {}
    try:
        layout = layout_for(strategy)
        if layout.collect is None:  # DeepSpeed's engine or DCP writes its own files (hashed at the commit)
            layout.save(strategy, tmp)
            written = write_files(tmp, own_files(strategy, step, meta, {}))
        else:
            written = write_files(tmp, collect_files(strategy, step, meta))
        sync_to_disk(tmp)  # on disk, on every host, before the rename makes them a checkpoint
    except Exception as e:  # noqa: BLE001 - a write error is agreed on below; anything else re-raised
        if not _write_error(e):
            raise
        error = e
    if before_commit is not None:
        before_commit()
    return commit_save(run_dir, step, strategy, error, written)


def begin_save(run_dir: Path, step: int, strategy) -> Path:
    """Rank 0 makes the checkpoint's `.tmp` folder (removing what an unfinished save left); every
    rank waits for it. A collective. Returns the folder."""
    _, tmp = checkpoint_folders(run_dir, step)
    error = None
    if strategy.ctx.rank == 0:
        try:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            remove_partial_saves(run_dir)
            tmp.mkdir()  # fails on anything there: a link planted there is never written through
        except OSError as e:
            error = e
    if _any_rank(error is not None):  # every rank stops alike
        if os.path.islink(tmp):
            raise CheckpointWriteFailed(f"step {step}: {tmp} is a symbolic link (to {os.readlink(tmp)}), where this "
                                        "run writes its checkpoint; it never writes through a link it did not make: "
                                        "remove the link and resume with trainer.resume=auto")
        raise CheckpointWriteFailed(_describe_failure(error, run_dir, tmp.parent, 0, step)) from error
    return tmp


def collect_files(strategy, step: int, meta: dict) -> dict[str, object]:
    """Every file this rank writes for the checkpoint of `step`, not yet written: the layout's
    (the collectives happen here), its own state and, on rank 0, the meta."""
    return own_files(strategy, step, meta, layout_for(strategy).collect(strategy))


def own_files(strategy, step: int, meta: dict, files: dict) -> dict[str, object]:
    files = {**files, rank_path(Path(), strategy.ctx.rank).name: rank_state(strategy.net)}
    if strategy.ctx.rank == 0:
        files["meta.pt"] = {"format": FORMAT, "step": step, **meta}
    return files


def commit_save(run_dir: Path, step: int, strategy, error: BaseException | None, written: dict[str, dict]) -> Path:
    """Once every rank has written (and fsynced) its files, or failed to: agree; rank 0 writes the
    manifest and renames the folder. A collective. `written`: this rank's files' manifest entries (write_files).
    A failure anywhere raises CheckpointWriteFailed on every rank, the partial folder removed."""
    final, tmp = checkpoint_folders(run_dir, step)
    reports = comm.all_gather_object((error is not None, written))  # did any fail; what each wrote
    if not any(f for f, _ in reports) and strategy.ctx.rank == 0:  # every rank's files are written
        try:
            if note := finish_folder(tmp, final, {name: entry for _, files in reports for name, entry in files.items()}):
                get_logger().info(note)
        except OSError as e:
            error = e
    if _any_rank(error is not None):
        fail_save(run_dir, step, strategy, error)
    comm.barrier()
    return final


def finish_folder(tmp: Path, final: Path, entries: dict[str, dict]) -> str | None:
    """Rank 0 (or its writer), once every rank's files are written: the manifest, last (what every
    file should be: checkpoint_safety.py, from the writers' `entries`), then the atomic rename.
    Returns a line to log where an unreadable checkpoint of the same step was set aside."""
    write_manifest(tmp, entries)
    sync_to_disk(tmp, files=False)
    note = set_aside_or_remove(final) if final.exists() else None  # the same step saved again (a resumed run)
    tmp.rename(final)
    sync_to_disk(final.parent, files=False)  # the rename itself survives a power loss
    return note


def fail_save(run_dir: Path, step: int, strategy, error: BaseException | None):
    """Every rank, once the save of `step` failed on any (`error`: this rank's, if its own): the
    partial folder removed, its space back, and CheckpointWriteFailed raised alike. A collective."""
    final, tmp = checkpoint_folders(run_dir, step)
    partial_bytes = folder_bytes(tmp) if tmp.is_dir() else 0
    comm.barrier()  # every rank has measured the folder (and finished with it) before it goes
    if strategy.ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    comm.barrier()
    raise CheckpointWriteFailed(_describe_failure(error, run_dir, final.parent, partial_bytes, step)) from error


def prune(run_dir: Path, keep_last: int, later: bool = False) -> list[Path]:
    """Remove the checkpoints beyond the newest `keep_last` (rank 0). `later`: each is only renamed
    out of sight (`.step_XXXXXXXX.removing`, which no resume looks at) and returned, for the caller
    to delete in the background; one left by a kill goes at the next start (remove_partial_saves)."""
    doomed = []
    for old in list_checkpoints(run_dir)[:-keep_last]:
        if later and not old.is_symlink():
            doomed.append(old.with_name(f".{old.name}.removing"))
            old.rename(doomed[-1])
        else:
            remove_checkpoint(old)
    return doomed


def set_aside_or_remove(old: Path) -> str | None:
    """Make room for a new checkpoint of the same step. A readable one is replaced; one that could
    not be read (resume=auto skipped it, so this run retraces its steps) is never deleted for that:
    it is renamed aside (`step_XXXXXXXX.unreadable`, which no resume or pruning looks at), and the
    line that says so returned."""
    try:
        verify_checkpoint_files(old)
    except ConfigError as e:
        aside = old.with_name(f"{old.name}.unreadable")
        n = 1
        while aside.exists():
            n += 1
            aside = old.with_name(f"{old.name}.unreadable{n}")
        old.rename(aside)
        return (f"checkpoint {old.name} could not be read ({str(e)[:200]}); kept as {aside.name}, "
                f"and the new {old.name} written beside it")
    remove_checkpoint(old)
    return None


def remove_checkpoint(ckpt: Path) -> None:
    """Delete a checkpoint folder; one that is a symbolic link loses the link only (what it points
    to is not the run's to delete)."""
    if ckpt.is_symlink():
        ckpt.unlink()
    else:
        shutil.rmtree(ckpt)


def sync_to_disk(folder: Path, files: bool = True) -> None:
    """fsync every file under `folder` (each host its own writes: every rank calls it), then the
    folders themselves, so that a power loss after the rename cannot leave a checkpoint that looks
    complete with missing data. Each file, once on disk, leaves the page cache: a checkpoint is
    written once and seldom read, and one kept there makes the next one's pages come from memory
    not yet reused (3-5x the writer's kernel time, measured on gpt_small's 153 MB optimizer file)."""
    folder = Path(folder)
    for path in [*(folder.rglob("*") if files else []), folder]:  # its files and folders, then itself
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean now: dropped at once
        finally:
            os.close(fd)


def saved_shapes(ckpt: Path, meta: dict) -> dict[str, tuple]:
    """Parameter (and, for full checkpoints, buffer) shapes a checkpoint holds, by state_dict key."""
    return layout_of(meta).shapes(Path(ckpt), meta)


def check_fits(ckpt: Path, meta: dict, model_shapes: dict[str, tuple]) -> None:
    """Raise ValueError naming the first key whose presence or shape differs between the
    checkpoint and the model about to load it (before any strategy touches the files)."""
    saved = saved_shapes(ckpt, meta)
    for key, shape in model_shapes.items():
        if key in saved and saved[key] != shape:
            raise ValueError(f"{ckpt} does not fit this model: first mismatching key {key!r} has shape "
                             f"{list(saved[key])} in the checkpoint, {list(shape)} in the model")
        if key not in saved and layout_of(meta).name != "sharded":  # sharded files list parameters only
            raise ValueError(f"{ckpt} does not fit this model: it has no {key!r} (the first model key it lacks)")
    for key in saved:
        if key not in model_shapes:
            raise ValueError(f"{ckpt} does not fit this model: it holds {key!r}, which the model does not have")


def load_checkpoint(ckpt: Path, strategy) -> dict:
    """Restore model and optimizer from `ckpt`, written by any strategy at any world size, and this
    rank's own state (RNG, rank-local buffers) where the world size is the same; return its meta.

    The same strategy loads its own layout (a sharded one re-cut for another shard count); another
    strategy loads the checkpoint's portable form (checkpoint_layouts.py). At another world size the
    ranks are not the same ranks: buffers come from the model state (rank 0's), and each rank's
    random stream restarts from (trainer.seed, step, rank), which the caller does."""
    meta = read_meta(ckpt)
    ckpt, layout = Path(ckpt), layout_of(meta)
    if meta["strategy"] == strategy.name:
        layout.load(strategy, ckpt, meta)
    else:
        strategy.load_portable(*layout.portable(ckpt, meta, [n for n, _ in strategy.net.named_parameters()]))
    if meta["world_size"] == strategy.ctx.world_size:
        load_rank_state(load_tensors(rank_path(ckpt, strategy.ctx.rank)), strategy.net)
    return meta


# --------------------------------------------------------------------------- consolidation


def consolidate(ckpt: Path) -> dict:
    """The plain state_dict of the bare model from any strategy's checkpoint (no process group)."""
    ckpt = Path(ckpt)
    unlisted = verify_checkpoint_files(ckpt)  # every file, before any is used
    if unlisted:
        print(f"note: ignoring {len(unlisted)} file(s) in {ckpt.name} its manifest does not list (no part of the "
              f"checkpoint; not opened): {', '.join(unlisted[:5])}", file=sys.stderr)
    meta = read_meta(ckpt)
    return layout_of(meta).consolidate(ckpt, meta)


def position(data: dict) -> str:
    """A checkpoint's data position, as `checkpoint info` says it."""
    if "consumed" not in data:
        return f"epoch {data.get('epoch', '?')}, {data.get('taken', '?')} micro-batches per rank into it"
    return (f"epoch {data['epoch']}, {data['consumed']:,} samples into it (global batch {data['global_batch']}: resumes "
            "exactly at any world size that divides it)")


def describe(ckpt: Path) -> str:
    """`minidist checkpoint info`: what a checkpoint holds, every file checked against its manifest
    first (a ConfigError names the first that fails)."""
    ckpt = Path(ckpt).absolute()
    unlisted = verify_checkpoint_files(ckpt)
    meta = read_meta(ckpt)
    files = [p for p in ckpt.rglob("*") if p.is_file() and p.relative_to(ckpt).as_posix() not in {*unlisted, MANIFEST}]
    cfg = meta.get("config") or {}
    model, data, optim = cfg.get("model", {}), cfg.get("data", {}), cfg.get("optim", {})
    layout = layout_of(meta).describe(meta)
    rows = [("checkpoint", str(ckpt)),
            ("step", f"{meta['step']} of {cfg.get('trainer', {}).get('max_steps', '?')} (trainer.max_steps)"),
            ("strategy", f"{meta['strategy']}, {meta['world_size']} rank(s); {layout}"),
            *([("mesh", f"shard groups of {shard_size} ranks, {meta['world_size'] // int(shard_size)} replica(s)")]
              if (shard_size := cfg.get("strategy", {}).get("shard_size")) else []),
            ("data position", position(meta.get("data") or {})),
            ("model", f"{model.get('name', '?')} on {data.get('name', '?')}"),
            ("optimizer", f"{optim.get('_target_', '?')}, lr {optim.get('lr', '?')}"),
            ("files", f"{len(files)} listed in its manifest, all verified: {folder_bytes(ckpt) / 2**20:,.1f} MiB"),
            ("resume", f"trainer.resume={ckpt} (or trainer.resume=auto with hydra.run.dir={ckpt.parent.parent})")]
    if unlisted:
        rows.append(("not part of it", f"{len(unlisted)} unlisted file(s), never opened: {', '.join(unlisted[:5])}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None, prog: str = "python -m minidist.train.checkpoint") -> int:
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description="Tools for minidist trainer checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    i = sub.add_parser("info", help="what a checkpoint holds (step, strategy, model, files verified)")
    i.add_argument("ckpt_dir", type=Path, help="a checkpoints/step_XXXXXXXX folder")
    c = sub.add_parser("consolidate", help="write a plain full state_dict (torch.load-able into the bare model)")
    c.add_argument("ckpt_dir", type=Path, help="a checkpoints/step_XXXXXXXX folder")
    c.add_argument("out", type=Path, help="the .pt file to write")
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            print(describe(args.ckpt_dir))
            return 0
        state = consolidate(args.ckpt_dir)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out.exists():
        print(f"error: {args.out} exists; choose another name or remove it first", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, args.out)
    n = sum(v.numel() for v in state.values())
    print(f"wrote {args.out}: {len(state)} tensors, {n:,} values (strategy {read_meta(args.ckpt_dir)['strategy']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
