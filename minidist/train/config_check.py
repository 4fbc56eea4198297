"""Check a trainer config before any work: each mistake is one line naming the key and the fix.

Runs in the launching process (or on every rank under torchrun), before a rank starts,
a data set is read, or anything is written into the run directory.
"""

from __future__ import annotations

import functools
import reprlib
from pathlib import Path

import torch

from minidist.dist import print0
from minidist.parallel.shard_optimizer import check_elementwise, is_whole_parameter
from minidist.train import data as data_mod
from minidist.train.checkpoint import check_fits, latest_checkpoint, list_checkpoints, read_meta
from minidist.train.checkpoint_safety import CheckpointRefused, verify_checkpoint_files
from minidist.train.config import ConfigError, config_changes, describe, is_fixed
from minidist.train.models import MODELS, build_model
from minidist.train.optim import CombinedOptimizer, optimizer_spec
from minidist.train.resilience import planned_kills
from minidist.train.strategies import check_options, mesh_dims, names
from minidist.train.strategies import spec as strategy_spec

PRECISIONS = ("fp32", "bf16", "fp16")


def _positive(cfg, key: str, minimum: int = 1) -> int:
    value = cfg.trainer[key]
    if not isinstance(value, int) or value < minimum:
        raise ConfigError(f"trainer.{key}={value!r} must be an integer >= {minimum}")
    return value


def grad_accum_steps(cfg, world_size: int) -> int:
    """trainer.grad_accum, or what trainer.global_batch_size implies when it is set."""
    t = cfg.trainer
    per_step = t.micro_batch_size * world_size
    if t.get("global_batch_size") is None:
        return int(t.grad_accum)
    if t.global_batch_size % per_step or t.global_batch_size < per_step:
        raise ConfigError(f"trainer.global_batch_size={t.global_batch_size} does not divide into micro-batches: it "
                          f"must be a multiple of trainer.micro_batch_size x world size = {t.micro_batch_size} x "
                          f"{world_size} = {per_step}; change one of them")
    return t.global_batch_size // per_step


def resolve_resume(cfg, run_dir: Path) -> Path | None:
    """The checkpoint to continue from, verified (its manifest, then every file opened safely:
    checkpoint_safety.py), or None for a fresh start."""
    resume = str(cfg.trainer.resume)
    if resume == "none":
        if latest_checkpoint(run_dir) is not None:
            raise ConfigError(f"the run directory {run_dir} already holds checkpoints and trainer.resume=none would "
                              "train over them: use trainer.resume=auto to continue, or a new hydra.run.dir")
        return None
    if resume == "auto":
        return newest_readable_checkpoint(run_dir)
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise ConfigError(f"trainer.resume={resume!r} is not a folder: give auto, none, or a "
                          "checkpoints/step_XXXXXXXX folder")
    return verified(path)


def verified(ckpt: Path) -> Path:
    """`ckpt`, checked against its manifest and every listed file opened safely (checkpoint_safety.py),
    saying once which files beside them it ignores; a CheckpointRefused naming the first that fails."""
    unlisted = verify_checkpoint_files(ckpt)  # no file of it runs code when opened
    if unlisted:
        print0(f"trainer.resume: ignoring {len(unlisted)} file(s) in {ckpt.name} its manifest does not list "
               f"(no part of the checkpoint; not opened): {', '.join(unlisted[:5])}{' ...' if len(unlisted) > 5 else ''}")
    return ckpt


def newest_readable_checkpoint(run_dir: Path) -> Path | None:
    """trainer.resume=auto: the newest checkpoint whose every file opens (checkpoint_safety.py), saying in
    one line each newer one skipped and why; None when there is none at all."""
    found = list_checkpoints(run_dir)
    for ckpt in reversed(found):
        try:
            return verified(ckpt)
        except CheckpointRefused as e:
            print0(f"trainer.resume=auto: skipping {ckpt.name}, it cannot be resumed from (it is kept as it is): {e}")
    if found:
        raise ConfigError(f"trainer.resume=auto: none of the {len(found)} checkpoints in {run_dir / 'checkpoints'} "
                          "can be read (each is named above): resume from a copy you trust (trainer.resume=DIR), "
                          "or start a new run in a new hydra.run.dir")
    return None


def check_run_fits(cfg, ckpt: Path, world_size: int) -> None:
    """Model, strategy, shapes and world size of a verified checkpoint against this run's."""
    meta = read_meta(ckpt)
    saved = meta["config"]
    if not isinstance(saved, dict) or saved.get("model") != _plain(cfg.model):
        model = saved.get("model") if isinstance(saved, dict) else saved
        raise ConfigError(f"trainer.resume: {ckpt} holds model {short(model)}, this run builds {_plain(cfg.model)}: "
                          "resume with the same model= settings, or start a new run (trainer.resume=none in a new "
                          "hydra.run.dir)")
    check_layouts_meet(cfg, ckpt, meta, world_size)
    with torch.device("meta"):  # the model's shapes, no memory
        shapes = {k: tuple(v.shape) for k, v in build_model(cfg.model, data_mod.data_info(cfg.data)).state_dict().items()}
    try:
        check_fits(ckpt, meta, shapes)
    except ValueError as e:
        raise ConfigError(f"trainer.resume: {e}: resume with the model that wrote it, or start a new run") from e
    grad_accum_on_resume(cfg, meta, world_size)  # the global batch: kept, or refused with the fix
    changes = config_changes(saved, _plain(cfg))
    fixed = [(k, a, b) for k, a, b in changes if is_fixed(k)]
    if fixed:
        why = "; ".join(sorted({f"{k.rstrip('.')}: {is_fixed(k)}" for k, _, _ in fixed}))
        raise ConfigError(f"trainer.resume: {describe(fixed)} since {ckpt.name} was written, and these may not change "
                          f"on resume ({why}): resume with the checkpoint's settings, or start a new run in a new "
                          "hydra.run.dir")


def resume_notice(cfg, ckpt: Path, typed: set[str] = frozenset()) -> tuple[str | None, bool]:
    """(the one line to say before resuming `ckpt`, or None; whether any step is left to train).

    A run whose checkpoint is already at (or past) its last step trains nothing and writes nothing:
    the line says so and names the setting to raise. Otherwise the line lists the settings changed
    since the checkpoint was written (`typed`: the keys the command line set, see describe)."""
    meta = read_meta(ckpt)
    t, step = cfg.trainer, int(meta["step"])
    end_key, end = ("trainer.stop_at", int(t.stop_at)) if t.stop_at is not None else ("trainer.max_steps",
                                                                                    int(t.max_steps))
    if step >= end:
        where = "at" if step == end else "already past"
        return (f"nothing to train: {ckpt} is {where} {end_key}={end} (step {step}); the run directory is left as it "
                f"was. To train on, raise {end_key} above {step}"), False
    changes = config_changes(meta["config"], _plain(cfg))
    if not changes:
        return None, True
    return (f"trainer.resume: settings changed since {ckpt.name} was written: {describe(changes, typed=typed)} "
            f"(applied from step {step})"), True


def check_layouts_meet(cfg, ckpt: Path, meta: dict, world_size: int) -> None:
    """Any strategy resumes any other's checkpoint at any world size (checkpoint_layouts.py's
    portable form), but DeepSpeed's: its engine reads only its own, at its own world size."""
    from minidist.train.checkpoint_layouts import layout_of
    from minidist.train.strategies import spec

    saved, ours = layout_of(meta).name, spec(cfg.strategy.name, cfg.strategy).checkpoint
    same = meta["strategy"] == cfg.strategy.name and meta["world_size"] == world_size
    if "deepspeed" in (saved, ours) and not same:
        raise ConfigError(f"trainer.resume: {ckpt} ({meta['strategy']} at {meta['world_size']} ranks) cannot resume "
                          f"as strategy={cfg.strategy.name} at {world_size} ranks: DeepSpeed's engine reads only its own "
                          f"checkpoints, at the world size that wrote them. Resume with strategy={meta['strategy']} "
                          f"launcher.nproc={meta['world_size']}, or start from its weights: minidist checkpoint "
                          "consolidate")


BATCH_KEYS = ("trainer.micro_batch_size", "trainer.grad_accum", "trainer.global_batch_size")


def saved_global_batch(meta: dict) -> int:
    """The global batch a checkpoint's run trained with."""
    from omegaconf import OmegaConf

    data = meta["data"]
    if "global_batch" in data:
        return int(data["global_batch"])
    saved = OmegaConf.create(meta["config"])
    return int(data["micro_batch_size"]) * int(data["world_size"]) * grad_accum_steps(saved, int(data["world_size"]))


def grad_accum_on_resume(cfg, meta: dict, world_size: int) -> tuple[int, str | None]:
    """This run's grad_accum when resuming `meta`'s checkpoint, and what it changed (None: nothing).

    Where this run's batch settings are the checkpoint's, its global batch is kept: grad_accum
    adapts to this world size, and a world size that cannot keep it is refused with the fix.
    Settings changed on purpose are this run's, and the note says the global batch changed."""
    t = cfg.trainer
    before = saved_global_batch(meta)
    changed = [k for k, _, _ in config_changes(meta["config"], _plain(cfg)) if k in BATCH_KEYS]
    if changed:
        accum = grad_accum_steps(cfg, world_size)
        after = t.micro_batch_size * accum * world_size
        return accum, (None if after == before else f"global batch {before} -> {after} ({', '.join(changed)} set)")
    per_step = t.micro_batch_size * world_size
    if before % per_step:
        raise ConfigError(f"trainer.resume: the checkpoint trained with a global batch of {before}, which {world_size} "
                          f"ranks x trainer.micro_batch_size={t.micro_batch_size} = {per_step} does not divide: choose "
                          f"a world size and trainer.micro_batch_size whose product divides {before} (grad_accum "
                          "follows), or set trainer.global_batch_size to train on with another global batch")
    return before // per_step, None


def short(value) -> str:
    """repr of something read from a checkpoint, bounded whatever it holds (for error messages)."""
    shortener = reprlib.Repr()
    shortener.maxlevel, shortener.maxdict, shortener.maxlist, shortener.maxstring, shortener.maxother = 3, 8, 8, 60, 60
    return shortener.repr(value)[:300]


def _plain(node) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if not isinstance(node, dict) else node


def check_mesh(strategy_cfg, spec, world_size: int) -> None:
    """Hybrid strategies (`spec`, strategy_cfg's): strategy.shard_size must split the world."""
    if spec.hybrid and strategy_cfg.get("shard_size") is not None:  # null: one host, known once launched
        mesh_dims(strategy_cfg, world_size)


# The groups whose keys the trainer reads by name: a key added to them (+trainer.foo=1) is read by
# nothing, so it is refused rather than silently ignored. (model, data, optim: their keys are the
# builder's or the class's arguments, checked against its signature; strategy: its spec's options.)
READ_BY_NAME = ("trainer", "launcher", "debug")


def check_keys_read(cfg) -> None:
    """Refuse keys no part of minidist reads, and required values left unset (???)."""
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{missing[0]} is required and has no value: give it, e.g. {missing[0]}=...")
    defaults = compose_defaults()
    for group in READ_BY_NAME:
        extra = sorted(set(cfg.get(group, {}).keys()) - set(defaults[group].keys()))
        if extra:
            raise ConfigError(f"{group}.{extra[0]} is not a setting minidist reads (the {group} keys are "
                              f"{', '.join(sorted(defaults[group].keys()))}): remove it, or check its spelling")


@functools.lru_cache(maxsize=1)
def compose_defaults():
    """The trainer's default config, as configs/ defines it (what every key's existence is checked
    against); composed once a process (read only)."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra

    from minidist.train.config import compose_fresh

    if GlobalHydra.instance().is_initialized():  # inside a Hydra app: compose on its own
        return compose(config_name="train")
    return compose_fresh("train")


def check_optimizer_arguments(cls, kwargs: dict) -> None:
    """Build the optimizer once on a probe parameter: a bad value (optim.lr=-1) or argument is
    refused here, naming it, instead of inside every rank after start-up."""
    try:
        probe = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(2, 2))]  # (a matrix for Muon)
        cls(probe, **{k: v for k, v in kwargs.items() if k != "fused"})
    except (ValueError, TypeError) as e:
        raise ConfigError(f"optim ({cls.__name__}): {e}; fix the optim.* setting it names") from None


def validate(cfg, world_size: int, run_dir: Path) -> Path | None:
    """Raise ConfigError for the first problem found; return the checkpoint to resume from (or None)."""
    t = cfg.trainer
    check_keys_read(cfg)
    spec = check_options(cfg.strategy)  # a known strategy, and only keys it reads
    if spec.single_rank and world_size != 1:
        raise ConfigError(f"strategy={spec.name} runs on one rank, but {world_size} were asked for: set "
                          "launcher.nproc=1, or use a data-parallel strategy (strategy=ddp)")
    check_mesh(cfg.strategy, spec, world_size)
    for key in ("max_steps", "micro_batch_size", "grad_accum", "keep_last", "log_every"):
        _positive(cfg, key)
    for key in ("eval_every", "ckpt_every", "eval_batches"):
        _positive(cfg, key, minimum=0)
    if t.stop_at is not None and not (isinstance(t.stop_at, int) and 1 <= t.stop_at <= t.max_steps):
        raise ConfigError(f"trainer.stop_at={t.stop_at!r} must be a step between 1 and trainer.max_steps={t.max_steps}")
    for key in (k for k in ("timeout_s", "stop_grace_s") if k in cfg.launcher):  # the comparison has no stop_grace_s
        value = cfg.launcher.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"launcher.{key}={value!r} must be a positive number of seconds")
    peer = cfg.launcher.get("peer_timeout_s", 0)
    if isinstance(peer, bool) or not isinstance(peer, (int, float)) or peer < 0:
        raise ConfigError(f"launcher.peer_timeout_s={peer!r} must be a number of seconds (0: no heartbeat)")
    grad_accum_steps(cfg, world_size)  # raises if the global batch does not divide
    try:
        kills = planned_kills(cfg.get("debug"))
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from e
    if str(cfg.get("debug", {}).get("kill_during", "step")) not in ("step", "save"):
        raise ConfigError(f"debug.kill_during={cfg.debug.kill_during!r} must be step (after the optimizer step) or "
                          "save (while writing that step's checkpoint)")
    ft = cfg.get("ft")
    in_group = ft is not None and ft.get("group") is not None  # a replica group: its launcher checked the ranks
    bad = [r for r, _ in kills if not 0 <= r < world_size and not in_group]
    if bad:
        raise ConfigError(f"debug.kill_rank={bad[0]} is not a rank of this {world_size}-rank run: give 0..{world_size - 1}")
    if str(t.nonfinite) not in ("skip", "stop"):
        raise ConfigError(f"trainer.nonfinite={t.nonfinite!r} must be skip (skip the update, go on) or stop")
    if not isinstance(t.diverged_after, int) or isinstance(t.diverged_after, bool) or t.diverged_after < 0:
        raise ConfigError(f"trainer.diverged_after={t.diverged_after!r} must be a number of steps >= 0 (0: never)")
    ratio = t.diverged_loss
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (ratio == 0 or ratio > 1):
        raise ConfigError(f"trainer.diverged_loss={ratio!r} must be a factor above 1 (0: never)")
    peak = t.peak_tflops
    if str(peak) != "auto" and not (isinstance(peak, (int, float)) and peak > 0):
        raise ConfigError(f"trainer.peak_tflops={peak!r} must be auto (the device's peak) or a positive number of TFLOP/s")
    optim_cls, optim_kwargs = optimizer_spec(cfg.optim)  # a class it can import, or a ConfigError naming optim._target_
    if is_whole_parameter(optim_cls):
        raise ConfigError(f"optim._target_={cfg.optim._target_}: it steps weight matrices only, and the trainer builds "
                          "one optimizer over every parameter: use optim=muon (Muon for the hidden matrices, AdamW "
                          "for the rest)")
    if issubclass(optim_cls, CombinedOptimizer):  # ZeRO checks each of its optimizers when it adopts them
        if not spec.several_optimizers:
            takers = [n for n in names() if strategy_spec(n).several_optimizers]
            raise ConfigError(f"optim={cfg.optim.get('name')} with strategy={spec.name}: it takes one optimizer class "
                              "over partitions of its own (fully_shard's Muon would orthogonalise a slice of each "
                              f"matrix); {cfg.optim.get('name')} runs under {', '.join(takers)}")
    elif spec.flat_optimizer_shards:
        try:
            check_elementwise(optim_cls)
        except TypeError as e:
            raise ConfigError(f"optim._target_={cfg.optim._target_} with strategy={spec.name}: {e}") from None
    check_optimizer_arguments(optim_cls, optim_kwargs)
    if t.precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision={t.precision!r} is not one of {list(PRECISIONS)}")
    if t.precision == "fp16" and not spec.fp16:  # the others take torch's GradScaler, on CPU as on CUDA
        raise ConfigError(f"trainer.precision=fp16 with strategy={spec.name}: its fp16 loss scaling is its own "
                          "(DeepSpeed's config), which this adapter does not wire; use trainer.precision=bf16")
    data = data_mod.data_source(cfg.data)  # a DataSource class it can import, with arguments it takes
    if cfg.model.name not in MODELS:
        raise ConfigError(f"model.name={cfg.model.name!r} is unknown: choose one of {list(MODELS)}")
    if MODELS[cfg.model.name][0] != data.info().kind:  # the kind of data it takes
        raise ConfigError(f"model={cfg.model.name} cannot train on data={cfg.data.name}: pick a matching pair "
                          "(gpt_* with stdlib_text or text_file; resnet18 or mlp with cifar10, mnist or fake_images)")
    block = int(cfg.model.get("block_size", 1))
    val = data.validation_size(block)
    if t.eval_batches and val is not None and val < world_size * t.micro_batch_size:
        raise ConfigError(f"data={cfg.data.name} leaves {max(val, 0)} validation samples (data.val_fraction="
                          f"{cfg.data.get('val_fraction')}), fewer than one micro-batch on each of {world_size} ranks, "
                          "so there would be no validation loss: raise data.val_fraction, or set "
                          "trainer.eval_batches=0 to train without validation")
    n = data.train_size(block)
    # verified once, there (hashing a large checkpoint twice costs); a relaunched replica group opens
    # none: it heals from a live group (live_recovery.py)
    ckpt = None if in_group and ft.get("relaunched") else resolve_resume(cfg, run_dir)
    if ckpt is not None:
        check_run_fits(cfg, ckpt, world_size)
    accum = grad_accum_on_resume(cfg, read_meta(ckpt), world_size)[0] if ckpt is not None else \
        grad_accum_steps(cfg, world_size)
    if n < world_size * t.micro_batch_size * accum:  # what the sampler needs: one global batch an epoch
        raise ConfigError(f"data={cfg.data.name} has {n} training samples, fewer than one global batch "
                          f"({world_size} ranks x trainer.micro_batch_size={t.micro_batch_size} x "
                          f"{accum} micro-batches a step = {world_size * t.micro_batch_size * accum}): use more data, "
                          "a smaller trainer.micro_batch_size or trainer.grad_accum, or fewer ranks")
    return ckpt
