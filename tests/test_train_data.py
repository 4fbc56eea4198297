"""The trainer's data: every data set loads through its real code (torchvision's for images, on
files written here in the real on-disk formats), and every rank gets its own disjoint shard."""

import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from minidist.train.data import (DataInfo, DataSource, ShardedBatchSampler, TokenWindows, build_datasets, collate,
                                 data_source, stdlib_files, train_size)
from minidist.train.config import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write_cifar10(root, n_train=50, n_test=20):
    """CIFAR-10's python format: pickled dicts of uint8 rows (3x32x32) and labels."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    per = n_train // 5
    for name, n in [(f"data_batch_{k}", per) for k in range(1, 6)] + [("test_batch", n_test)]:
        entry = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "labels": rng.integers(0, 10, n).tolist()}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{k}" for k in range(10)]}, f)
    return 5 * per


def write_mnist(root, n_train=40, n_test=12):
    """MNIST's idx format: big-endian magic number and sizes, then uint8 pixels / labels."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 2051, n, 28, 28) + rng.integers(0, 256, n * 784, dtype=np.uint8).tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 2049, n) + rng.integers(0, 10, n, dtype=np.uint8).tobytes())
    return n_train


@pytest.fixture
def cifar_without_md5(monkeypatch):
    # torchvision checks each CIFAR file against the real data set's MD5, which files written
    # here cannot match; everything else (unpickling, reshaping, transforms) is torchvision's own.
    import torchvision.datasets.cifar as cifar

    monkeypatch.setattr(cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))


def data_cfg(name, **overrides):
    """configs/data/NAME.yaml (its _target_ and defaults), with `overrides`."""
    return OmegaConf.merge(OmegaConf.load(CONFIGS / "data" / f"{name}.yaml"), overrides)


def all_sets(tmp_path):
    """(name, config, expected number of training samples or None) for every data set."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world\n" * 400)
    (corpus / "b.txt").write_text("the quick brown fox\n" * 300)
    (corpus / ".hidden").write_text("never read")
    n_cifar = write_cifar10(tmp_path / "cifar")
    n_mnist = write_mnist(tmp_path / "mnist")
    return [
        ("stdlib_text", data_cfg("stdlib_text", max_bytes=20000, val_fraction=0.1), None),
        ("text_file", data_cfg("text_file", path=str(corpus), max_bytes=None, val_fraction=0.1), None),
        ("cifar10", data_cfg("cifar10", root=str(tmp_path / "cifar"), download=False), n_cifar),
        ("mnist", data_cfg("mnist", root=str(tmp_path / "mnist"), download=False), n_mnist),
        ("fake_images", data_cfg("fake_images", train_size=30, val_size=8, image_size=16, num_classes=4), 30),
    ]


def test_every_data_set_loads_and_shards(tmp_path, cifar_without_md5):
    for name, cfg, expected in all_sets(tmp_path):
        train, val, info = build_datasets(cfg, block_size=16)
        if expected is not None:
            assert len(train) == expected, name
        assert len(val) > 0, name
        x, y = collate(train, [0, 1])
        if info.kind == "text":
            assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1]), name  # y is x shifted by one
        else:
            assert x.shape == (2, info.channels, info.image_size, info.image_size), name
            assert y.dtype == torch.int64 and y.shape == (2,), name
        for world in (1, 2, 3):
            shards = [ShardedBatchSampler(len(train), r, world, micro_batch_size=2, seed=5) for r in range(world)]
            per_rank = [[i for b in _one_epoch(s) for i in b] for s in shards]
            seen = [i for mine in per_rank for i in mine]
            assert len(seen) == len(set(seen)), f"{name}: a sample appears twice in an epoch at world {world}"
            assert len({len(m) for m in per_rank}) == 1, f"{name}: ranks got different amounts"
            assert len(train) - len(seen) < world * 2, f"{name}: more left out than one global batch"
        if name not in ("cifar10", "mnist"):  # those are estimated from the real sets' sizes
            assert train_size(cfg, 16) in (len(train), len(train) - 1), name  # the cheap estimate agrees


def _one_epoch(sampler):
    it = iter(sampler)
    return [next(it) for _ in range(sampler.batches_per_epoch)]


def test_stdlib_text_is_the_standard_library_in_sorted_order():
    files = stdlib_files()
    assert list(files) == sorted(files) and len(files) > 100
    assert not any("site-packages" in f.parts for f in files)
    train, val, _ = build_datasets(data_cfg("stdlib_text", max_bytes=50000, val_fraction=0.1), 64)
    assert bytes(train.tokens[:200].tolist()) == files[0].read_bytes()[:200]
    assert len(train.tokens) + len(val.tokens) == 50000


def test_text_file_skips_hidden_files(tmp_path):
    (tmp_path / "a.txt").write_text("abc" * 50)
    (tmp_path / ".secret").write_text("zzz" * 50)
    train, _, _ = build_datasets(data_cfg("text_file", path=str(tmp_path), max_bytes=None, val_fraction=0.1), 8)
    assert b"z" not in bytes(train.tokens.tolist())


def test_sampler_resumes_mid_epoch_with_the_same_batches():
    a = ShardedBatchSampler(100, rank=1, world_size=3, micro_batch_size=4, seed=0)
    it = iter(a)
    straight = [next(it) for _ in range(20)]  # crosses an epoch boundary (8 batches per epoch)
    b = ShardedBatchSampler(100, rank=1, world_size=3, micro_batch_size=4, seed=0)
    it = iter(b)
    first = [next(it) for _ in range(11)]
    state = b.state_dict()
    c = ShardedBatchSampler(100, rank=1, world_size=3, micro_batch_size=4, seed=0)
    c.load_state_dict(state)
    it = iter(c)
    assert first + [next(it) for _ in range(9)] == straight
    assert a.epoch_indices(0) != a.epoch_indices(1)  # reshuffled each epoch


def global_steps(world: int, micro: int, accum: int, steps: int, state=None, n: int = 100) -> tuple[list, dict]:
    """The sample ids of each of `steps` optimizer steps, over every rank (sorted), and the position after."""
    samplers = [ShardedBatchSampler(n, r, world, micro, seed=3, grad_accum=accum) for r in range(world)]
    for s in samplers:
        if state is not None:
            s.load_state_dict(state)
    its = [iter(s) for s in samplers]
    out = [sorted(i for it in its for _ in range(accum) for i in next(it)) for _ in range(steps)]
    return out, samplers[0].state_dict()


def test_the_global_sample_order_is_the_same_at_every_world_size_and_a_position_translates():
    """A global batch of 16: 4 ranks x 2 x 2, 2 x 4 x 2, 1 x 16 x 1, 8 x 2 x 1 consume the same samples
    in each optimizer step, across epoch boundaries (100 samples: 6 steps an epoch); a position
    saved at one resumes exactly at another (issue 28)."""
    straight, _ = global_steps(4, 2, 2, 15)
    for world, micro, accum in ((2, 4, 2), (1, 16, 1), (8, 2, 1)):
        assert global_steps(world, micro, accum, 15)[0] == straight
        first, state = global_steps(4, 2, 2, 5)
        rest, _ = global_steps(world, micro, accum, 10, state)
        assert first + rest == straight, (world, micro, accum)
    ids = [i for step in straight[:6] for i in step]
    assert len(ids) == len(set(ids)) == 96  # an epoch: no sample twice, fewer than a global batch left out


def test_sampler_refuses_a_position_it_cannot_continue_from():
    state = ShardedBatchSampler(100, 0, 2, 4, seed=0).state_dict()
    with pytest.raises(ConfigError, match="trainer.seed"):
        ShardedBatchSampler(100, 0, 2, 4, seed=1).load_state_dict(state)
    sampler = ShardedBatchSampler(100, 0, 2, 4, seed=0)
    next(iter(sampler))  # 8 samples into the epoch: not a whole micro-step of 3 ranks x 4
    with pytest.raises(ConfigError, match="not a whole number of this run's micro-steps"):
        ShardedBatchSampler(100, 0, 3, 4, seed=0).load_state_dict(sampler.state_dict())


def test_missing_image_files_say_where_they_go(tmp_path):
    for name in ("cifar10", "mnist"):
        with pytest.raises(ConfigError, match=r"data.root=.*download=true"):
            build_datasets(data_cfg(name, root=str(tmp_path / "nothing"), download=False), 16)


def test_too_few_samples_for_the_ranks():
    with pytest.raises(ConfigError, match="micro_batch_size"):
        ShardedBatchSampler(7, 0, 4, 2, seed=0)


@pytest.mark.parametrize("n, world, micro", [(103, 3, 4), (10, 4, 1), (4097, 2, 16)])
def test_every_rank_gets_the_same_number_of_steps(n, world, micro):
    """The trainer never gives ranks different step counts (so no rank runs out of data first):
    each epoch is trimmed to a multiple of world x micro-batch, the same on every rank."""
    from itertools import islice

    samplers = [ShardedBatchSampler(n, r, world, micro, seed=0) for r in range(world)]
    assert len({s.batches_per_epoch for s in samplers}) == 1
    per_epoch = samplers[0].batches_per_epoch
    assert per_epoch == n // (world * micro)
    for s in samplers:  # across an epoch boundary too
        batches = list(islice(iter(s), 2 * per_epoch + 1))
        assert all(len(b) == micro for b in batches)


class Counting(DataSource):
    """A data set of our own, as a user would write one: the stream 0, 1, 2, ... mod 256."""

    def __init__(self, length: int):
        self.length = length

    def info(self) -> DataInfo:
        return DataInfo("text")

    def train_size(self, block_size: int) -> int:
        return (self.length - 1) // block_size

    def build(self, block_size: int):
        tokens = torch.arange(self.length) % 256
        return TokenWindows(tokens, block_size), TokenWindows(tokens[:4 * block_size + 1], block_size), self.info()


def test_a_data_set_of_your_own_is_the_data_groups_target():
    cfg = OmegaConf.create({"_target_": f"{__name__}.Counting", "name": "counting", "module": __name__, "length": 1000})
    train, val, info = build_datasets(cfg, block_size=10)
    assert info.kind == "text" and len(train) == train_size(cfg, 10) == 99 and len(val) == 4
    assert torch.equal(train[3][0], torch.arange(30, 40))


@pytest.mark.parametrize("target,says", [
    ("os.system", "was not imported: only minidist's classes are"),
    ("minidist.train.data.NoSuchSet", "cannot be imported"),
    ("minidist.train.models.GPT", "is not a subclass of minidist.train.data.DataSource: name one, e.g. "
                                  "minidist.train.data.StdlibText"),
])
def test_the_data_target_must_be_a_data_source(target, says):
    with pytest.raises(ConfigError, match=says):
        data_source(OmegaConf.create({"_target_": target, "name": "x"}))


def test_a_key_the_data_set_does_not_take_is_named():
    with pytest.raises(ConfigError, match=r"data=stdlib_text: .*'max_byte'.*StdlibText"):
        data_source(data_cfg("stdlib_text", max_byte=10))
    with pytest.raises(ConfigError, match=r"missing a required argument: 'path'"):
        data_source(OmegaConf.create({"_target_": "minidist.train.data.TextFile", "name": "t", "max_bytes": None,
                                      "val_fraction": 0.1}))
