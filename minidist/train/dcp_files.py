"""torch.distributed.checkpoint (DCP) folders, written by every rank at once and read without
running code: the native_fsdp / native_hsdp checkpoints (checkpoint_layouts.Distributed).

    save(state, folder)                  # a collective: each rank writes its own shards, no gather
    load_into(state, folder)             # a collective: fills `state` (DTensors re-cut at any world size)
    read_full(folder, only={"model"})    # no process group: the nested state (or its model), plain tensors
    saved_shapes(folder)                 # {key: shape} from the metadata alone

DCP's reader unpickles `.metadata` with pickle.load and the non-tensor items (param_groups' lr,
betas, ...) with torch.load(weights_only=False): a folder from someone else could run code. So
the metadata is read here by an unpickler that resolves only DCP's own metadata classes and a
few torch and pathlib names, and each non-tensor item must load under torch's restricted
unpickler before DCP's own loader is given it. Tensors DCP already reads with weights_only=True.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path

import torch

from minidist.train.errors import CheckpointRefused

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


def _reader(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))


def _safe_bytes(planner_class):
    """`planner_class` whose non-tensor items must first load under torch's restricted unpickler."""

    class SafeBytes(planner_class):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                detail = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line), str(e)[:160])
                raise CheckpointRefused(f"{read_item.dest_index.fqn} in a torch.distributed.checkpoint folder holds "
                                        f"Python objects other than plain values ({detail[:160]}); "
                                        "nothing in it was run; do not resume from this checkpoint") from e
            value.seek(0)
            super().load_bytes(read_item, value)  # DCP's own, given bytes proven to resolve nothing else

    return SafeBytes


def _refusals_raised(load) -> None:
    """Run `load`; a refusal of ours inside DCP (which wraps every rank's errors in one
    CheckpointException) is raised as itself, on every rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        load()
    except CheckpointException as e:
        for exc, _ in e.failures.values():  # (the exception, its stack) per failed rank
            if isinstance(exc, CheckpointRefused):
                raise exc from None
        raise


def save(state: dict, folder: Path) -> None:
    """Every rank writes its own shards of `state` into `folder`; rank 0 the metadata. A collective."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)))


def load_into(state: dict, folder: Path) -> None:
    """Fill `state` (this run's sharded state dict) from `folder`, at any world size. A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    _refusals_raised(lambda: dcp.load(state, storage_reader=_reader(folder), planner=_safe_bytes(DefaultLoadPlanner)()))


def read_full(folder: Path, only: set[str] | None = None) -> dict:
    """The whole state `folder` holds (`only`: just these top-level keys, e.g. {"model"}), as
    plain tensors and values, in this process alone."""
    # DCP's own planner that builds the state from the metadata, and the loader that fills the dict
    # it is given (dcp.load fills a copy): what torch's format_utils.dcp_to_torch_save uses.
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    with warnings.catch_warnings():  # no process group is the point here, not a mistake to warn of
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        _refusals_raised(lambda: _load_state_dict(state, storage_reader=_reader(folder),
                                                  planner=_safe_bytes(_EmptyStateDictLoadPlanner)(keys=only),
                                                  no_dist=True))
    return state


def saved_shapes(folder: Path, prefix: str) -> dict[str, tuple]:
    """{key: shape} of the tensors saved under `prefix` (e.g. "model."), from the metadata alone."""
    return {key[len(prefix):]: tuple(md.size) for key, md in read_metadata(folder).state_dict_metadata.items()
            if key.startswith(prefix) and hasattr(md, "size")}
