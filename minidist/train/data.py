"""Data sets for the trainer, and the sampler that gives each rank its own shard.

    train_set, val_set, info = build_datasets(cfg.data, block_size=128)   # cfg.data._target_: a DataSource
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

import functools
import inspect
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from minidist.train.config import ConfigError, class_named


@dataclass(frozen=True)
class DataInfo:
    """What a model needs to know about its data."""

    kind: str              # "text" or "image"
    vocab_size: int = 256  # text
    channels: int = 3      # images
    image_size: int = 32
    num_classes: int = 10


class DataSource:
    """A data set the trainer can train on. The data config group's `_target_` names the class
    and its other keys (but `name`, the run's label for the set) are the constructor's
    arguments, so a YAML in configs/data/ is the one place a set's defaults live. Subclass it
    to train on your own data: `python recipes/train.py data._target_=my_pkg.MyData ...`."""

    def info(self) -> DataInfo:
        """What `build` would report, without loading anything (the config check's view)."""
        raise NotImplementedError

    def train_size(self, block_size: int) -> int:
        """Number of training samples, cheaply (no data loaded): for validating the config."""
        raise NotImplementedError

    def validation_size(self, block_size: int) -> int | None:
        """Number of validation samples, cheaply; None where it is not known without loading."""
        return None

    def build(self, block_size: int) -> tuple[Dataset, Dataset, DataInfo]:
        """(training set, validation set, info); each item is an (input, target) pair."""
        raise NotImplementedError


# --------------------------------------------------------------------------- text


@functools.lru_cache(maxsize=1)
def stdlib_files() -> tuple[Path, ...]:
    """The standard library's .py files (third-party site-packages excluded), sorted by path. Listed
    once a process, with os.walk: pathlib's rglob took most of a small run's start-up (0.7 s of 0.9)."""
    found = []
    for folder, subfolders, files in os.walk(sysconfig.get_paths()["stdlib"]):
        subfolders[:] = [d for d in subfolders if d != "site-packages"]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return tuple(p for p in sorted(found) if p.is_file())


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


class TextBytes(DataSource):
    """Files as one byte stream (a token is a byte); the last val_fraction of it is validation."""

    def __init__(self, max_bytes: int | None, val_fraction: float):
        if not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
            raise ConfigError(f"data.val_fraction={val_fraction!r} must be a fraction in [0, 1): the last part of the "
                              "stream that is validation (0 with trainer.eval_batches=0: no validation)")
        self.max_bytes, self.val_fraction = max_bytes, float(val_fraction)

    def files(self) -> list[Path]:
        raise NotImplementedError

    def info(self) -> DataInfo:
        return DataInfo("text")

    @functools.cached_property
    def _total_bytes(self) -> int:
        total = 0
        for f in self.files():  # from file sizes alone, up to max_bytes
            total += f.stat().st_size + 1
            if self.max_bytes and total >= self.max_bytes:
                return self.max_bytes
        return total

    def train_size(self, block_size: int) -> int:
        return int(self._total_bytes * (1.0 - self.val_fraction) - 1) // block_size

    def validation_size(self, block_size: int) -> int:
        total = self._total_bytes
        return (total - int(total * (1.0 - self.val_fraction)) - 1) // block_size

    def build(self, block_size: int):
        tokens = read_bytes(self.files(), self.max_bytes)
        # A fixed split: the last val_fraction of the stream is validation, never trained on.
        cut = int(len(tokens) * (1.0 - self.val_fraction))
        return TokenWindows(tokens[:cut], block_size), TokenWindows(tokens[cut:], block_size), self.info()


class StdlibText(TextBytes):
    """The running interpreter's standard library: real text on every machine, no download."""

    def files(self) -> list[Path]:
        return stdlib_files()


class TextFile(TextBytes):
    """Any text file, or every file under a folder (sorted, hidden ones skipped)."""

    def __init__(self, path: str, max_bytes: int | None, val_fraction: float):
        super().__init__(max_bytes, val_fraction)
        self.path = path

    def files(self) -> list[Path]:
        return text_files(self.path)


# --------------------------------------------------------------------------- images


def _normalised(mean: tuple, std: tuple):
    from torchvision import transforms as T

    return T.Compose([T.ToTensor(), T.Normalize(mean, std)])


class FakeImages(DataSource):
    """torchvision.datasets.FakeData: random images with random labels, for smoke runs."""

    def __init__(self, train_size: int, val_size: int, image_size: int, num_classes: int):
        self.size, self.val_size = int(train_size), int(val_size)
        self.image_size, self.num_classes = int(image_size), int(num_classes)

    def info(self) -> DataInfo:
        return DataInfo("image", channels=3, image_size=self.image_size, num_classes=self.num_classes)

    def train_size(self, block_size: int) -> int:
        return self.size

    def validation_size(self, block_size: int) -> int:
        return self.val_size

    def build(self, block_size: int):
        import torchvision

        tf = _normalised((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
        make = lambda n, offset: torchvision.datasets.FakeData(  # noqa: E731
            size=n, image_size=(3, self.image_size, self.image_size), num_classes=self.num_classes,
            transform=tf, random_offset=offset)
        return make(self.size, 0), make(self.val_size, 10_000_000), self.info()


class TorchvisionImages(DataSource):
    """A torchvision image set read from data.root by torchvision's own class, so the real
    on-disk format is read by the real loading code. A subclass states the set's facts."""

    name: str                   # the config group's name, for messages
    dataset: str                # the torchvision.datasets class
    expected_files: list[str]   # where torchvision looks for the files under root (what must be there offline)
    size: int                   # training samples
    normalise: tuple            # (mean, std) per channel
    shape: DataInfo

    def __init__(self, root: str, download: bool):
        self.root, self.download = os.path.expanduser(root), bool(download)

    def check_files(self) -> None:
        """Offline and missing: say where torchvision expects the files."""
        if self.download:
            return
        missing = [f for f in self.expected_files if not (Path(self.root) / f).is_file()]
        if missing:
            raise ConfigError(f"data.root={self.root!r} has no {self.name} files (missing {missing[0]}): put the data "
                              "set there in torchvision's layout, or set data.download=true where there is internet")

    def info(self) -> DataInfo:
        return self.shape

    def train_size(self, block_size: int) -> int:
        self.check_files()
        return self.size

    def build(self, block_size: int):
        import torchvision

        self.check_files()
        cls, tf = getattr(torchvision.datasets, self.dataset), _normalised(*self.normalise)
        train = cls(self.root, train=True, download=self.download, transform=tf)
        return train, cls(self.root, train=False, download=False, transform=tf), self.info()


class CIFAR10(TorchvisionImages):
    """CIFAR-10 (files in ROOT/cifar-10-batches-py/)."""

    name, dataset, size = "cifar10", "CIFAR10", 50_000
    expected_files = ["cifar-10-batches-py/data_batch_1", "cifar-10-batches-py/test_batch",
                      "cifar-10-batches-py/batches.meta"]
    normalise = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    shape = DataInfo("image", channels=3, image_size=32, num_classes=10)


class MNIST(TorchvisionImages):
    """MNIST (files in ROOT/MNIST/raw/)."""

    name, dataset, size = "mnist", "MNIST", 60_000
    expected_files = ["MNIST/raw/train-images-idx3-ubyte", "MNIST/raw/train-labels-idx1-ubyte",
                      "MNIST/raw/t10k-images-idx3-ubyte", "MNIST/raw/t10k-labels-idx1-ubyte"]
    normalise = ((0.1307,), (0.3081,))
    shape = DataInfo("image", channels=1, image_size=28, num_classes=10)


# --------------------------------------------------------------------------- entry points

NOT_ARGUMENTS = ("_target_", "name", "module")  # name: the run's label for the set; module: the package trusted


def data_source(data_cfg) -> DataSource:
    """The DataSource the data group's `_target_` names, built with the group's other keys.
    Only DataSource classes are accepted, so a config cannot name arbitrary code to run."""
    from omegaconf import OmegaConf

    cls = class_named(str(data_cfg.get("_target_")), DataSource, "data._target_", "minidist.train.data.StdlibText",
                      module=data_cfg.get("module"))
    kwargs = {k: v for k, v in OmegaConf.to_container(data_cfg, resolve=True).items() if k not in NOT_ARGUMENTS}
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"data={data_cfg.get('name')}: {e} for {cls.__name__} (the data group's keys but "
                          f"{' and '.join(NOT_ARGUMENTS)} are its arguments)") from None
    return cls(**kwargs)


def build_datasets(data_cfg, block_size: int):
    """(train, validation, DataInfo) for the data group `data_cfg`."""
    return data_source(data_cfg).build(block_size)


def train_size(data_cfg, block_size: int) -> int:
    """Number of training samples, cheaply (no data loaded): for validating the config."""
    return data_source(data_cfg).train_size(block_size)


def data_info(data_cfg) -> DataInfo:
    """What build_datasets would report, without loading anything."""
    return data_source(data_cfg).info()


# --------------------------------------------------------------------------- sampling


class ShardedBatchSampler:
    """Micro-batches of sample indices for one rank: its own shard, resumable mid-epoch, at
    any world size.

    The global sample order does not depend on the world size: each epoch, the indices 0..n-1
    are shuffled with a generator seeded by (seed, epoch), the same permutation on every rank,
    and trimmed to a multiple of the global batch (world_size x micro_batch_size x grad_accum).
    Micro-step k of every rank together takes the k-th window of world_size x micro_batch_size
    positions, rank r the positions r, r + world, r + 2 world, ... of it; so optimizer step s
    consumes positions [s B, (s + 1) B) of the order (B: the global batch), whichever world size
    and micro-batch size make B up. Across ranks an epoch holds no sample twice, every rank does
    the same number of steps, and at most B - 1 samples are left out per epoch.

    The position is (epoch, global samples consumed in it): a checkpoint taken after an
    optimizer step continues, at another world size with the same global batch, with exactly
    the next global batch an uninterrupted run would have seen.
    """

    def __init__(self, num_samples: int, rank: int, world_size: int, micro_batch_size: int, seed: int,
                 shuffle: bool = True, grad_accum: int = 1):
        if num_samples < world_size * micro_batch_size:
            raise ConfigError(f"the data set has {num_samples} samples, fewer than one micro-batch per rank "
                              f"({world_size} ranks x trainer.micro_batch_size={micro_batch_size}): use more data "
                              "or a smaller micro-batch / fewer ranks")
        if num_samples < world_size * micro_batch_size * grad_accum:
            raise ConfigError(f"the data set has {num_samples} samples, fewer than one global batch "
                              f"({world_size} ranks x trainer.micro_batch_size={micro_batch_size} x grad_accum "
                              f"{grad_accum}): use more data or a smaller batch / fewer ranks")
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.micro_batch_size, self.seed, self.shuffle, self.grad_accum = micro_batch_size, seed, shuffle, grad_accum
        self.epoch, self.taken = 0, 0

    @property
    def window(self) -> int:
        """Samples one micro-step of every rank takes together."""
        return self.world_size * self.micro_batch_size

    @property
    def global_batch(self) -> int:
        return self.window * self.grad_accum

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches per rank and epoch."""
        return self.num_samples // self.global_batch * self.grad_accum

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The global order of `epoch`: the positions every rank's micro-batches take, in turn."""
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.num_samples)
        return order[:self.batches_per_epoch * self.window]

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's indices for `epoch`, in order."""
        return self.epoch_order(epoch)[self.rank::self.world_size].tolist()

    def __iter__(self):
        """Endless: micro-batches from the current position on, epoch after epoch."""
        while True:
            mine = self.epoch_indices(self.epoch)
            while self.taken < self.batches_per_epoch:
                start = self.taken * self.micro_batch_size
                self.taken += 1
                yield mine[start:start + self.micro_batch_size]
            self.epoch, self.taken = self.epoch + 1, 0

    @property
    def batches_taken(self) -> int:
        """Global batches taken so far, epoch after epoch: the stream's position in whole steps."""
        return self.epoch * (self.batches_per_epoch // self.grad_accum) + self.taken // self.grad_accum

    def seek(self, batches: int) -> None:
        """Stand before global batch number `batches` of the stream (live recovery numbers them)."""
        epoch, k = divmod(batches, self.batches_per_epoch // self.grad_accum)
        self.epoch, self.taken = epoch, k * self.grad_accum

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.taken * self.window, "num_samples": self.num_samples,
                "global_batch": self.global_batch, "seed": self.seed,
                "world_size": self.world_size, "micro_batch_size": self.micro_batch_size}  # (for the record)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position saved at any world size and micro-batch size: with the same
        global batch, exactly; with another (the trainer says so), from the same global sample."""
        for key in ("num_samples", "seed"):
            if state[key] != getattr(self, key):
                raise ConfigError(f"the checkpoint's data position was saved with {key}={state[key]}, this run has "
                                  f"{getattr(self, key)}: resume with the same data and trainer.seed")
        # Written before positions were counted in samples: micro-batches of that world's window.
        consumed = int(state["consumed"]) if "consumed" in state else \
            int(state["taken"]) * int(state["world_size"]) * int(state["micro_batch_size"])
        if consumed % self.window:
            raise ConfigError(f"the checkpoint's data position ({consumed} samples into epoch {state['epoch']}) is "
                              f"not a whole number of this run's micro-steps ({self.world_size} ranks x "
                              f"trainer.micro_batch_size={self.micro_batch_size}): choose a micro-batch size and "
                              f"world size whose product divides {consumed}")
        self.epoch, self.taken = int(state["epoch"]), consumed // self.window


def collate(dataset: Dataset, indices: list[int]):
    """Stack dataset[i] for i in indices into (inputs, targets) tensors."""
    xs, ys = zip(*(dataset[i] for i in indices))
    return torch.stack(xs), torch.as_tensor(ys) if not torch.is_tensor(ys[0]) else torch.stack(ys)
