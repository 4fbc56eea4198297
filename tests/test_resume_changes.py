"""A run resumed with changed settings (issue 26, item 5): the keys that differ from the
checkpoint's config are listed in one line; those that may change (the learning rate and its
schedule, max_steps, cadences, clipping, the batch, the strategy) are applied and said so; those
that may not (model, data, seed, precision, the optimizer's class) are refused before any rank
starts, in one line; config.yaml records what the resumed run uses."""

import pytest
from omegaconf import OmegaConf

from minidist.train.checkpoint import latest_checkpoint, read_meta
from minidist.train.config_check import resume_notice, validate
from minidist.train.config import ConfigError
from minidist.train.optim import lr_lambda
from minidist.train.config import typed_keys
from train_cases import compose_cfg, tiny, tiny_overrides, train_on_rank

FIRST = ("trainer.max_steps=6",)


@pytest.fixture(scope="module")
def run_dir(ranks, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("resume_changes") / "run"
    ranks(2).run(train_on_rank, tiny(*FIRST), str(run_dir), timeout_s=240)
    return run_dir


@pytest.mark.parametrize("overrides, named", [
    (["model.n_layer=3"], "holds model"),
    (["data.max_bytes=100000"], "data.max_bytes 200000 -> 100000"),
    (["trainer.seed=7"], "trainer.seed 1337 -> 7"),
    (["trainer.precision=bf16"], "trainer.precision 'fp32' -> 'bf16'"),
    (["optim=sgd"], "optim._target_ 'torch.optim.AdamW' -> 'torch.optim.SGD'"),
])
def test_settings_that_may_not_change_are_refused_in_one_line(run_dir, overrides, named):
    cfg = compose_cfg(tiny_overrides("trainer.max_steps=10", *overrides))
    with pytest.raises(ConfigError) as refused:
        validate(cfg, 2, run_dir)
    message = str(refused.value)
    assert named in message and "\n" not in message, message
    if "holds model" not in message:
        assert "may not change on resume" in message and "new hydra.run.dir" in message


def test_settings_that_may_change_are_listed_and_applied(ranks, run_dir):
    cfg = compose_cfg(tiny_overrides("trainer.max_steps=10", "optim.lr=0.5", "trainer.grad_clip=0.5"))
    ckpt = validate(cfg, 2, run_dir)
    line, to_train = resume_notice(cfg, ckpt)
    assert ckpt == latest_checkpoint(run_dir) and to_train
    assert line == "trainer.resume: settings changed since step_00000006 was written: optim.lr 0.003 -> 0.5, " \
                   "trainer.grad_clip 1.0 -> 0.5, trainer.max_steps 6 -> 10 (applied from step 6)", line
    (lr_at_6, end, console), _ = ranks(2).run(resumed_lr, OmegaConf.to_container(cfg, resolve=True), str(run_dir),
                                              str(ckpt))
    assert "settings changed" not in console  # the launcher said it once, before the ranks started
    expected = 0.5 * lr_lambda(int(cfg.optim.warmup_steps), 10, float(cfg.optim.min_lr_ratio))(6)
    assert lr_at_6 == pytest.approx(expected, rel=1e-12)  # the new peak, on the new schedule, at step 6
    assert end == 10
    assert read_meta(latest_checkpoint(run_dir))["config"]["optim"]["lr"] == 0.5
    assert OmegaConf.load(run_dir / "config.yaml").optim.lr == 0.5  # what this run used


def resumed_lr(cfg_dict, run_dir, ckpt):
    """(the learning rate at the resumed step, the last step, what the trainer printed)."""
    import contextlib
    import io

    from minidist.train.trainer import Trainer
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        trainer = Trainer(OmegaConf.create(cfg_dict), run_dir, resume_from=ckpt)
        try:
            lr = trainer.optimizer.param_groups[0]["lr"]
            trainer.fit()
        finally:
            trainer.close()
    return lr, trainer.step, console.getvalue()


def test_another_strategy_is_one_item_beside_the_keys_the_command_line_set(run_dir):
    """A ddp checkpoint resumed as zero2: the new strategy's defaults (strategy.collectives, ...)
    are summed up in one item; strategy.bucket_cap_mb, set on the command line, is listed."""
    typed = typed_keys(["strategy=zero2", "strategy.bucket_cap_mb=4", "trainer.max_steps=10"])
    cfg = compose_cfg(tiny_overrides("strategy.bucket_cap_mb=4", "trainer.max_steps=10", strategy="zero2"))
    line, _ = resume_notice(cfg, run_dir / "checkpoints" / "step_00000006", typed)
    assert line == "trainer.resume: settings changed since step_00000006 was written: strategy ddp -> zero2 (its " \
                   "defaults), strategy.bucket_cap_mb 25 -> 4, trainer.max_steps 6 -> 10 (applied from step 6)"
