"""A checkpoint's manifest: every file's size and checksum, written last, inside the atomic rename.

    manifest.json   {"format": "minidist.manifest.v1", "files": {"meta.pt": {"bytes": N, "sha256": "..."}, ...}}

A checkpoint folder whose files all open can still be wrong: truncated by a full disk after a
copy, half-replaced by a sync tool, or edited. The manifest is what the writer saw once every
rank had written and synced its files; `verify_manifest` checks the folder against it before
anything is loaded, and names the first file that differs. JSON, not a pickle: reading it runs
no code either.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from minidist.train.errors import CheckpointRefused

NAME = "manifest.json"
FORMAT = "minidist.manifest.v1"


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def describe_files(folder: Path) -> dict[str, dict]:
    """{relative path: {"bytes", "sha256"}} for every file under `folder` but the manifest."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": file_digest(p)}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != NAME}


def write_manifest(folder: Path) -> Path:
    """Describe every file under `folder` in folder/manifest.json, synced to disk."""
    path = Path(folder) / NAME
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "files": describe_files(folder)}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return path


class ManifestMismatch(CheckpointRefused):
    """A checkpoint folder that differs from its manifest (or has none)."""


def verify_manifest(ckpt: Path) -> list[str]:
    """Raise ManifestMismatch naming the first file that is missing, not a regular file (a link, a
    FIFO: never opened), of another size, or of another checksum than the manifest says; or when
    there is no readable manifest at all. Return the files it lists (relative paths): those alone
    make the checkpoint, anything else in the folder is not read."""
    ckpt = Path(ckpt)
    path = ckpt / NAME
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"] if manifest.get("format") == FORMAT else None
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise ManifestMismatch(f"{path} is missing or unreadable ({e.__class__.__name__}): the checkpoint was not "
                               "completely written or copied, so none of it was loaded") from e
    if not isinstance(files, dict):
        raise ManifestMismatch(f"{path} is not a minidist manifest (format {manifest.get('format')!r}, expected "
                               f"{FORMAT!r}); none of the checkpoint was loaded")
    for name, want in files.items():
        file = ckpt / name
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
            raise ManifestMismatch(f"{path} lists {str(name)[:80]!r}, a path outside the checkpoint folder: refused; "
                                   "none of the checkpoint was loaded")
        if not isinstance(want, dict) or not isinstance(want.get("bytes"), int) or \
                not isinstance(want.get("sha256"), str):
            raise ManifestMismatch(f"{path}: its entry for {name!r} is not {{bytes, sha256}}; none of the checkpoint "
                                   "was loaded")
        try:
            mode = file.lstat().st_mode
            inside = file.resolve().is_relative_to(ckpt.resolve())  # a linked folder on the way leads out
        except OSError:
            raise ManifestMismatch(f"{file} is missing (the checkpoint's manifest lists it): the checkpoint is "
                                   "incomplete; none of it was loaded") from None
        if not inside:
            mode = stat.S_IFLNK
        if not stat.S_ISREG(mode):  # never opened: a FIFO would block, a link would read another file
            kind = "a symbolic link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
                "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            raise ManifestMismatch(f"{file} is {kind}, not a file minidist wrote: refused unopened; none of the "
                                   "checkpoint was loaded")
        size = file.stat().st_size
        if size != want["bytes"]:
            raise ManifestMismatch(f"{file} has {size} bytes, its manifest says {want['bytes']}: it was truncated or "
                                   "changed after it was written; none of the checkpoint was loaded")
        if file_digest(file) != want["sha256"]:
            raise ManifestMismatch(f"{file} does not match the sha256 in its manifest: it was changed after it was "
                                   "written; none of the checkpoint was loaded")
    return list(files)
