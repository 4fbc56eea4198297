"""Small trainer configs composed from the real configs/ (Hydra's compose API), and rank functions.

`tiny(...)` is the default config shrunk to seconds: a 2-layer GPT on 200 kB of stdlib
text, 4 samples per micro-batch, no progress bar. Rank functions run on the RankPool.
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
RECIPE = ROOT / "recipes" / "train.py"
PYTHON = sys.executable

TINY_GPT = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "data.max_bytes=200000"]
TINY = [
    "trainer.micro_batch_size=4", "trainer.max_steps=20", "trainer.eval_every=0", "trainer.eval_batches=2",
    "trainer.ckpt_every=0", "trainer.log_every=5", "trainer.progress=false", "optim.warmup_steps=5",
    "strategy.min_unit_params=1000",  # zero3 / native_fsdp: each GPT block is a unit
]


def tiny_overrides(*extra: str, strategy: str = "ddp") -> list[str]:
    other_model = any(o.startswith(("model=", "data=")) for o in extra)
    overrides = [f"strategy={strategy}", *([] if other_model else TINY_GPT), *TINY, *extra]
    from minidist.train.strategies import spec

    if "min_unit_params" not in spec(strategy).options:  # only stage-3 sharding cuts units (others refuse it)
        overrides = [o for o in overrides if not o.lstrip("+").startswith("strategy.min_unit_params")]
    return overrides


def compose_cfg(overrides: list[str]):
    """train.yaml with `overrides`, composed once per distinct list in a test run (the fast suite
    asks for the same few dozens again and again); a copy each call, which the caller may change."""
    return copy.deepcopy(_composed(tuple(overrides)))


@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple[str, ...]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def world_for(strategy: str) -> int:
    """The ranks a strategy's trainer tests run on, read from its spec: 1 for a single-rank one,
    4 for a hybrid one (a 2x2 mesh: mesh_options), so its replica path runs; else 2."""
    from minidist.train.strategies import spec

    s = spec(strategy)
    return 1 if s.single_rank else 4 if s.hybrid else 2


def mesh_options(strategy: str) -> tuple[str, ...]:
    """A hybrid strategy's overrides for world_for's 2x2 mesh: shard groups of 2, 2 replicas (DiLoCo's:
    2 workers of 2 ranks, DDP within each)."""
    from minidist.train.strategies import spec

    s = spec(strategy)
    return (("strategy.shard_size=2",) + (("strategy.inner=ddp",) if "inner" in s.options else ())) if s.hybrid else ()


def tiny(*extra: str, strategy: str = "ddp") -> dict:
    return OmegaConf.to_container(compose_cfg(tiny_overrides(*extra, strategy=strategy)), resolve=True)


def train_on_rank(cfg_dict: dict, run_dir: str, resume_from: str | None = None) -> dict:
    """Run the Trainer on this pool rank (the process group already exists); return a summary
    plus the final full state_dict (rank 0)."""
    from minidist.train.trainer import Trainer

    trainer = Trainer(OmegaConf.create(cfg_dict), run_dir, resume_from=resume_from)
    try:
        summary = trainer.fit()
        summary["full_state"] = trainer.strategy.full_state_dict()
        summary["buffers"] = {k: v.detach().cpu().clone() for k, v in trainer.net.named_buffers()}  # this rank's
        return summary
    finally:
        trainer.close()


def load_everything(ckpt: Path) -> dict:
    """Every file of a checkpoint (subfolders too: DeepSpeed's) except meta.pt, loaded:
    relative path -> object (for bitwise comparison)."""
    from minidist.train.checkpoint_safety import DEEPSPEED_DIR, deepspeed_classes, load_tensors

    def allowed(f: Path) -> list:  # DeepSpeed's own files hold three of its classes (checkpoint_safety.py)
        return deepspeed_classes() if DEEPSPEED_DIR in f.relative_to(ckpt).parts else []
    return {str(f.relative_to(ckpt)): load_tensors(f, allow=allowed(f))
            for f in sorted(ckpt.rglob("*.pt")) if f.name != "meta.pt"}


def assert_same(a, b, where: str = "") -> None:
    """Recursive bitwise equality of nested tensors / containers / scalars."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where}: max difference {(a.double() - b.double()).abs().max().item()}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)[:5]} vs {list(b)[:5]}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{k}]")
    elif hasattr(a, "__dict__") and type(a).__eq__ is object.__eq__:  # e.g. DeepSpeed's LossScaler: by fields
        assert type(a) is type(b), where
        assert_same(vars(a), vars(b), where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def train_or_error(cfg_dict: dict, run_dir: str, resume_from: str | None = None) -> str:
    """train_on_rank, for a run that stops with an error every rank raises alike (a diverged run, a
    checkpoint that cannot be written): the error's message (the pool goes on: no rank is left
    inside a collective), or "trained"."""
    try:
        train_on_rank(cfg_dict, run_dir, resume_from)
    except Exception as e:  # noqa: BLE001 - the test reads it
        return f"{type(e).__name__}: {e}"
    return "trained"
