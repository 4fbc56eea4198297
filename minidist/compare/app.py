"""The comparison's command line: `python recipes/compare.py`, `minidist compare`.

Exit status: 0; 1 when a minidist strategy's final parameters differ from its reference's by
more than compare.tolerance (a regression check for CI); 2 for a config error (one line saying
what and how to fix it).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def strategy_options(name: str, compare_cfg):
    """configs/strategy/NAME.yaml (composed, so its defaults apply; a variant's: its `of`'s, with
    the variant's options), then compare.bucket_cap_mb, compare.shard_size and
    compare.overrides.NAME on top."""
    from hydra import compose
    from omegaconf import OmegaConf

    from minidist.compare.variants import base_of, variant_options

    variants = compare_cfg.get("variants") or {}
    options = compose(config_name="train", overrides=[f"strategy={base_of(name, variants)}"]).strategy
    options = OmegaConf.merge(options, variant_options(name, variants))
    if compare_cfg.bucket_cap_mb is not None and "bucket_cap_mb" in options:
        options.bucket_cap_mb = float(compare_cfg.bucket_cap_mb)
    # (DiLoCo with inner=null: every rank is a worker, there are no shard groups to size)
    if compare_cfg.get("shard_size") is not None and "shard_size" in options and options.get("inner", "") is not None:
        options.shard_size = int(compare_cfg.shard_size)
    return OmegaConf.merge(options, compare_cfg.overrides.get(name, {}))


def compare(cfg) -> None:
    """Check the strategies named, then run the comparison (launch_compare.launch); exit with its status."""
    import hydra.errors
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from minidist.compare.launch_compare import check_strategies, launch
    from minidist.dist import launch_rank
    from minidist.train.config import ConfigError

    try:
        check_strategies(cfg)
        options = {name: strategy_options(name, cfg.compare) for name in cfg.compare.strategies}
    except (ConfigError, hydra.errors.MissingConfigException) as e:
        if launch_rank() == 0:
            print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    OmegaConf.set_struct(cfg, False)
    cfg.compare.options = options
    command = f"{sys.argv[0]} " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    status = launch(cfg, Path(HydraConfig.get().runtime.output_dir), command.strip())
    if status:
        sys.exit(status)


def main(argv: list[str] | None = None, prog: str = "minidist compare") -> None:
    from minidist.train.app import run_app

    run_app("compare", compare, sys.argv[1:] if argv is None else argv, prog)
