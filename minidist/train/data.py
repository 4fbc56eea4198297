"""Data sets for the trainer, and the sampler that gives each rank its own shard.

    train_set, val_set, info = build_datasets(cfg.data, block_size=128)
    sampler = ShardedBatchSampler(len(train_set), rank, world, micro_batch_size=8, seed=0)
    for indices in sampler: ...               # this rank's next micro-batch
    sampler.state_dict() / load_state_dict()  # the data position, part of every checkpoint

Text sets are byte-level: a token is a byte (vocabulary 256), a sample is a window
of block_size + 1 bytes (input = the first block_size, target = shifted by one),
windows do not overlap. `stdlib_text` — the default — is the running
interpreter's own standard library: real text on every machine, no download.

Image sets go through torchvision's own classes (CIFAR10, MNIST, FakeData), so
the real on-disk formats are read by the real loading code.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from minidist.train.errors import ConfigError

TEXT_SETS = ("stdlib_text", "text_file")
IMAGE_SETS = ("cifar10", "mnist", "fake_images")


@dataclass(frozen=True)
class DataInfo:
    """What a model needs to know about its data."""

    kind: str              # "text" or "image"
    vocab_size: int = 256  # text
    channels: int = 3      # images
    image_size: int = 32
    num_classes: int = 10


# --------------------------------------------------------------------------- text


def stdlib_files() -> list[Path]:
    """The standard library's .py files (third-party site-packages excluded), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def text_files(path: str) -> list[Path]:
    """A file, or every file under a folder (sorted, hidden ones skipped)."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file() and not any(part.startswith(".") for part in
                                                                        f.relative_to(p).parts))
    raise ConfigError(f"data.path={path!r} does not exist: give a text file or a folder of text files")


def read_bytes(files: list[Path], max_bytes: int | None) -> torch.Tensor:
    """Concatenate files (each followed by a newline) into one uint8 tensor of at most max_bytes."""
    chunks, total = [], 0
    for f in files:
        data = f.read_bytes() + b"\n"
        if max_bytes is not None and total + len(data) > max_bytes:
            chunks.append(data[: max_bytes - total])
            break
        chunks.append(data)
        total += len(data)
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class TokenWindows(Dataset):
    """Non-overlapping windows of a token stream: sample i -> (x, y) with y = x shifted by one."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, i: int):
        start = i * self.block_size
        window = self.tokens[start:start + self.block_size + 1].long()
        return window[:-1], window[1:]


def text_sources(data_cfg) -> list[Path]:
    if data_cfg.name == "stdlib_text":
        return stdlib_files()
    return text_files(data_cfg.path)


def text_size_bytes(data_cfg) -> int:
    """Bytes the text set will hold, from file sizes alone (cheap: used to validate the config)."""
    total = sum(f.stat().st_size + 1 for f in text_sources(data_cfg))
    return min(total, data_cfg.max_bytes) if data_cfg.get("max_bytes") else total


def build_text(data_cfg, block_size: int):
    tokens = read_bytes(text_sources(data_cfg), data_cfg.get("max_bytes"))
    # A fixed split: the last val_fraction of the stream is validation, never trained on.
    cut = int(len(tokens) * (1.0 - float(data_cfg.val_fraction)))
    return TokenWindows(tokens[:cut], block_size), TokenWindows(tokens[cut:], block_size), DataInfo("text")


# --------------------------------------------------------------------------- images

_NORMALISE = {"cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
              "mnist": ((0.1307,), (0.3081,)), "fake_images": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))}

# Where torchvision looks for each set's files under data.root (what must be there offline).
EXPECTED_FILES = {
    "cifar10": ["cifar-10-batches-py/data_batch_1", "cifar-10-batches-py/test_batch",
                "cifar-10-batches-py/batches.meta"],
    "mnist": ["MNIST/raw/train-images-idx3-ubyte", "MNIST/raw/train-labels-idx1-ubyte",
              "MNIST/raw/t10k-images-idx3-ubyte", "MNIST/raw/t10k-labels-idx1-ubyte"],
}
TRAIN_SIZES = {"cifar10": 50_000, "mnist": 60_000}


def check_image_files(data_cfg) -> None:
    """Offline and missing: say where torchvision expects the files."""
    if data_cfg.name not in EXPECTED_FILES or data_cfg.get("download"):
        return
    root = Path(data_cfg.root).expanduser()
    missing = [f for f in EXPECTED_FILES[data_cfg.name] if not (root / f).is_file()]
    if missing:
        raise ConfigError(f"data.root={str(root)!r} has no {data_cfg.name} files (missing {missing[0]}): put the "
                          f"data set there in torchvision's layout, or set data.download=true where there is internet")


def build_images(data_cfg):
    import torchvision
    from torchvision import transforms as T

    name = data_cfg.name
    mean, std = _NORMALISE[name]
    tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    if name == "fake_images":
        size = int(data_cfg.image_size)
        make = lambda n, offset: torchvision.datasets.FakeData(  # noqa: E731
            size=n, image_size=(3, size, size), num_classes=int(data_cfg.num_classes), transform=tf,
            random_offset=offset)
        return (make(int(data_cfg.train_size), 0), make(int(data_cfg.val_size), 10_000_000),
                DataInfo("image", channels=3, image_size=size, num_classes=int(data_cfg.num_classes)))
    check_image_files(data_cfg)
    cls = {"cifar10": torchvision.datasets.CIFAR10, "mnist": torchvision.datasets.MNIST}[name]
    root = os.path.expanduser(data_cfg.root)
    train = cls(root, train=True, download=bool(data_cfg.download), transform=tf)
    val = cls(root, train=False, download=False, transform=tf)
    info = DataInfo("image", channels=1 if name == "mnist" else 3, image_size=28 if name == "mnist" else 32,
                    num_classes=10)
    return train, val, info


# --------------------------------------------------------------------------- entry points


def build_datasets(data_cfg, block_size: int):
    """(train, validation, DataInfo) for `data_cfg.name`."""
    if data_cfg.name in TEXT_SETS:
        return build_text(data_cfg, block_size)
    if data_cfg.name in IMAGE_SETS:
        return build_images(data_cfg)
    raise ConfigError(f"data={data_cfg.name!r} is not a data set; choose one of {list(TEXT_SETS + IMAGE_SETS)}")


def train_size(data_cfg, block_size: int) -> int:
    """Number of training samples, cheaply (no data loaded): for validating the config."""
    if data_cfg.name in TEXT_SETS:
        return int(text_size_bytes(data_cfg) * (1.0 - float(data_cfg.val_fraction)) - 1) // block_size
    if data_cfg.name == "fake_images":
        return int(data_cfg.train_size)
    check_image_files(data_cfg)
    return TRAIN_SIZES[data_cfg.name]


def data_info(data_cfg) -> DataInfo:
    """What build_datasets would report, without loading anything."""
    if data_cfg.name in TEXT_SETS:
        return DataInfo("text")
    if data_cfg.name == "mnist":
        return DataInfo("image", channels=1, image_size=28)
    if data_cfg.name == "fake_images":
        return DataInfo("image", image_size=int(data_cfg.image_size), num_classes=int(data_cfg.num_classes))
    return DataInfo("image")


# --------------------------------------------------------------------------- sampling


class ShardedBatchSampler:
    """Micro-batches of sample indices for one rank: its own shard, resumable mid-epoch.

    Each epoch, the indices 0..n-1 are shuffled with a generator seeded by (seed, epoch)
    — the same permutation on every rank — and trimmed to a multiple of
    world_size * micro_batch_size; rank r takes positions r, r + world, r + 2 world, ...
    So across ranks an epoch holds no sample twice, every rank does the same number of
    steps, and at most world * micro_batch_size - 1 samples are left out per epoch.

    The position (epoch, micro-batches taken) is all a checkpoint needs to continue
    with exactly the batches an uninterrupted run would have seen.
    """

    def __init__(self, num_samples: int, rank: int, world_size: int, micro_batch_size: int, seed: int,
                 shuffle: bool = True):
        if num_samples < world_size * micro_batch_size:
            raise ConfigError(f"the data set has {num_samples} samples, fewer than one micro-batch per rank "
                              f"({world_size} ranks x trainer.micro_batch_size={micro_batch_size}): use more data "
                              "or a smaller micro-batch / fewer ranks")
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.micro_batch_size, self.seed, self.shuffle = micro_batch_size, seed, shuffle
        self.epoch, self.taken = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // (self.world_size * self.micro_batch_size)

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's indices for `epoch`, in order."""
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.num_samples)
        used = self.batches_per_epoch * self.world_size * self.micro_batch_size
        return order[:used][self.rank::self.world_size].tolist()

    def __iter__(self):
        """Endless: micro-batches from the current position on, epoch after epoch."""
        while True:
            mine = self.epoch_indices(self.epoch)
            while self.taken < self.batches_per_epoch:
                start = self.taken * self.micro_batch_size
                self.taken += 1
                yield mine[start:start + self.micro_batch_size]
            self.epoch, self.taken = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "taken": self.taken, "num_samples": self.num_samples,
                "world_size": self.world_size, "micro_batch_size": self.micro_batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_samples", "world_size", "micro_batch_size", "seed"):
            if state[key] != getattr(self, key):
                raise ConfigError(f"the checkpoint's data position was saved with {key}={state[key]}, this run has "
                                  f"{getattr(self, key)}: resume with the same data and batch settings")
        self.epoch, self.taken = int(state["epoch"]), int(state["taken"])


def collate(dataset: Dataset, indices: list[int]):
    """Stack dataset[i] for i in indices into (inputs, targets) tensors."""
    xs, ys = zip(*(dataset[i] for i in indices))
    return torch.stack(xs), torch.as_tensor(ys) if not torch.is_tensor(ys[0]) else torch.stack(ys)
