"""Opening a checkpoint never runs code and never trusts a file: only tensors and plain containers,
read with torch's restricted unpickler (weights_only=True); DCP's metadata and DeepSpeed's files too.

    state = load_tensors(path)                 # CheckpointRefused (a ConfigError) names the file
    verify_checkpoint_files(ckpt)              # its manifest, then every file, before anything loads

The manifest, DCP's metadata and DeepSpeed's classes: docs/internals.md, "train/checkpoint_safety.py".
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
import stat
from pathlib import Path
from typing import Any

import torch

from minidist.train.config import CheckpointRefused  # noqa: F401  (raised here; public from here too)


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
        # In 64 KiB pieces: one write() of many MiB keeps its CPU in the kernel until it returns
        # where the kernel does not preempt (PREEMPT_NONE), so a background writer would hold up
        # every training thread woken on its core; a piece is some microseconds.
        view = memoryview(data).cast("B")
        for at in range(0, len(view), 1 << 16):
            piece = view[at:at + (1 << 16)]
            self._sha.update(piece)
            self.file.write(piece)
        self.bytes += len(view)
        return len(view)

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


METADATA = ".metadata"

# What DCP's .metadata holds (checked against torch 2.14): its dataclasses, the tensor properties'
# enum, torch.Size, dtypes and layouts, and the checkpoint id (a path).
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointRefused(f"{self.path} was not loaded: it names {module}.{name}, which no metadata that "
                                "torch.distributed.checkpoint writes holds, so nothing in it was run; do not resume "
                                "from this checkpoint")


def read_metadata(folder: Path):
    """DCP's Metadata of `folder`, unpickled with only its own classes allowed."""
    path = Path(folder) / METADATA
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f, path).load()
    except CheckpointRefused:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or garbled file fails in any way
        raise CheckpointRefused(f"{path} could not be read ({e.__class__.__name__}: {str(e)[:160]}): the checkpoint is "
                                "truncated or not torch.distributed.checkpoint's; resume from another one") from e


DEEPSPEED_DIR = "deepspeed"  # where the ds_zero* strategies keep DeepSpeed's own files


def deepspeed_classes() -> list:
    """The classes DeepSpeed's own checkpoints pickle (checked against deepspeed 0.19)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address]


def load_tensors(path: Path, map_location="cpu", mmap: bool = False, allow: list | None = None) -> Any:
    """torch.load with weights_only=True; a file holding anything else is refused, naming it."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(list(allow or [])):
            try:
                obj = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
            except RuntimeError as e:
                if not (mmap and "mmap" in str(e)):
                    raise
                # not torch.save's zip format (a bare pickle): read it whole, still restricted
                obj = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        detail = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line), str(e).splitlines()[0])
        raise CheckpointRefused(
            f"{path} was not loaded: it holds Python objects other than tensors and plain containers "
            f"({detail[:160]}), which minidist never saves, so nothing in it was run. Use a checkpoint that "
            "minidist wrote; if this one was tampered with or comes from other code, do not resume from it.") from e
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - garbage makes torch's reader fail in any way (IndexError, KeyError...)
        first = (str(e).splitlines() or [""])[0][:160]
        raise CheckpointRefused(f"{path} could not be read ({e.__class__.__name__}: {first}): the file is "
                                "truncated or not a torch checkpoint; resume from another checkpoint") from e
    return check_bounded(obj, path)


# What a file minidist wrote can hold: its containers nest a few levels deep and hold entries in
# proportion to the model's tensors. A small file can still unpickle into a structure of shared
# parts that is astronomically large when walked as a tree (a list holding the previous list
# twice, sixty times): anything that formats or traverses it would never finish.
MAX_DEPTH = 64
MAX_VISITS = 2_000_000


def check_bounded(obj: Any, path: Path) -> Any:
    """`obj`, once its containers are walked as a tree within MAX_VISITS entries and MAX_DEPTH
    levels (shared parts counted each time they are reached); else CheckpointRefused."""
    visits, stack = 0, [(obj, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            children = list(item)
        else:
            continue
        visits += len(children)
        if depth >= MAX_DEPTH or visits > MAX_VISITS:
            how = f"deeper than {MAX_DEPTH} levels" if depth >= MAX_DEPTH else f"into more than {MAX_VISITS:,} entries"
            raise CheckpointRefused(f"{path} was not loaded: its containers nest {how}, which no file minidist "
                                    "writes does (a structure built to be too large to read); do not resume from it")
        stack.extend((child, depth + 1) for child in children)
    return obj


FULL_DISK_BYTES = 1 << 20  # free space under which a short write is taken for a full disk


def save_tensors(obj: Any, path: Path) -> dict:
    """torch.save into a file opened here: a failed write raises the OS's own OSError (errno,
    message), where torch's path-based writer only reports "unexpected pos". Returns the file's
    manifest entry ({"bytes", "sha256"} of what was written)."""
    with open(path, "wb") as f:
        try:
            out = Digesting(f)
            torch.save(obj, out)
            return out.entry()
        except RuntimeError as e:  # torch's writer saw a short write: the OS's reason is the context
            if isinstance(e.__context__, OSError):
                os_error = e.__context__
                raise OSError(os_error.errno, os_error.strerror, str(path)) from e
            # A short write the OS did not raise for (buffered: it accepted part of the bytes) on a
            # disk with next to nothing left: that is a full disk, say so as the OS would.
            if shutil.disk_usage(Path(path).parent).free < FULL_DISK_BYTES:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e
            raise


def verify_checkpoint_files(ckpt: Path) -> list[str]:
    """Check checkpoint `ckpt` against its manifest (verify_manifest), then open every file it lists
    under the restricted unpickler (memory-mapped, so cheap); raise a ConfigError naming the first
    that fails. Return the files in the folder the manifest does not list: never opened (a stray
    copy, a FIFO), they are no part of the checkpoint, and the caller says so."""
    ckpt = Path(ckpt)
    listed = verify_manifest(ckpt)
    ds_allow = None
    for name in sorted(n for n in listed if n.endswith(".pt")):
        allow = None
        if DEEPSPEED_DIR in Path(name).parts:
            ds_allow = ds_allow if ds_allow is not None else deepspeed_classes()
            allow = ds_allow
        load_tensors(ckpt / name, mmap=True, allow=allow)
    for name in (n for n in listed if Path(n).name == ".metadata"):  # torch.distributed.checkpoint's (read_metadata)

        read_metadata((ckpt / name).parent)
    known = {*listed, NAME}
    return sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*")
                  if not p.is_dir() and p.relative_to(ckpt).as_posix() not in known)
