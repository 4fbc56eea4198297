"""Opening a checkpoint never runs code: every file is read with torch.load(weights_only=True).

A checkpoint directory may come from anywhere (a shared file system, a downloaded run).
A pickle can name any Python callable, and `torch.load(weights_only=False)` calls it.
So minidist saves only tensors and plain containers (dicts, lists, tuples, numbers,
strings), and reads every file with torch's restricted unpickler, which refuses
anything else before it is constructed.

    state = load_tensors(path)                 # CheckpointRefused (a ConfigError) names the file
    verify_checkpoint_files(ckpt)              # its manifest, then every file, before anything loads
    save_tensors(state, path)                  # torch.save through an opened file: a full disk is
                                               # the OS's OSError (errno 28), not "unexpected pos"

torch.distributed.checkpoint's folders (native_fsdp, native_hsdp) are read by dcp_files.py, whose
metadata reader resolves only DCP's own classes (checked here too, before anything loads).

DeepSpeed's own checkpoint files (ds_zero*) hold three small DeepSpeed classes besides
tensors, and DeepSpeed's loader unpickles without restriction. Before a directory is
handed to it, each of its files must load under the restricted unpickler with those
three classes, and nothing else, allowed: then the full unpickler can resolve nothing
beyond them either.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

from minidist.train.errors import CheckpointRefused  # noqa: F401  (raised here; public from here too)
from minidist.train.manifest import NAME as MANIFEST, Digesting
from minidist.train.manifest import verify_manifest

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
    """Check checkpoint `ckpt` against its manifest (manifest.py), then open every file it lists
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
    for name in (n for n in listed if Path(n).name == ".metadata"):  # torch.distributed.checkpoint's (dcp_files.py)
        from minidist.train.dcp_files import read_metadata

        read_metadata((ckpt / name).parent)
    known = {*listed, MANIFEST}
    return sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*")
                  if not p.is_dir() and p.relative_to(ckpt).as_posix() not in known)
