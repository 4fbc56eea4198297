"""A checkpoint's manifest: every file's size and checksum, written last, inside the atomic rename.

    manifest.json   {"format": "minidist.manifest.v1", "files": {"meta.pt": {"bytes": N, "sha256": "..."}, ...}}

A checkpoint folder whose files all open can still be wrong: truncated by a full disk after a
copy, half-replaced by a sync tool, or edited. The manifest is what the writer saw once every
rank had written and synced its files (each rank's writer hashes the bytes it writes as it writes
them, `Digesting`, so the commit need not read the checkpoint back); `verify_manifest` checks the folder against it before
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


class Digesting:
    """A file opened for writing that counts and hashes every byte written through it: the
    manifest entry of what was written, without reading it back (`entry()`)."""

    def __init__(self, file):
        self.file, self.bytes, self._sha = file, 0, hashlib.sha256()

    def write(self, data) -> int:
        self._sha.update(data)
        self.bytes += memoryview(data).nbytes
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def entry(self) -> dict:
        return {"bytes": self.bytes, "sha256": self._sha.hexdigest()}

    @property
    def name(self) -> str:
        return self.file.name

    def __repr__(self) -> str:
        return f"Digesting({self.file!r})"


def describe_files(folder: Path, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """{relative path: {"bytes", "sha256"}} for every file under `folder` but the manifest. `known`:
    entries the writers made as they wrote (Digesting), used for the files of the size they say;
    any other file (one a library wrote itself, DeepSpeed's) is read and hashed here."""
    folder, known = Path(folder), known or {}
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != NAME:
            name, size = p.relative_to(folder).as_posix(), p.stat().st_size
            entry = known.get(name)
            out[name] = entry if entry is not None and entry["bytes"] == size else \
                {"bytes": size, "sha256": file_digest(p)}
    return out


def write_manifest(folder: Path, known: dict[str, dict] | None = None) -> Path:
    """Describe every file under `folder` in folder/manifest.json, synced to disk (`known`: see
    describe_files)."""
    path = Path(folder) / NAME
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "files": describe_files(folder, known)}, f, indent=1, sort_keys=True)
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
