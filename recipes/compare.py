"""Side by side with native PyTorch and DeepSpeed: one training config, several strategies, one report.

    python recipes/compare.py                                    # ddp vs native_ddp, gpt_nano, 2 local ranks
    python recipes/compare.py compare.strategies=[ddp,native_ddp,zero1,native_zero1,zero2,ds_zero2,zero3,native_fsdp]
    python recipes/compare.py compare.timeline=true              # + one step as Chrome traces and PNGs
    torchrun --nproc_per_node 2 recipes/compare.py compare.strategies=[zero3,native_fsdp]

Every strategy starts from the same weights and sees the same batches; steps are
interleaved (a rotating order each step) so machine noise hits all alike. The run
directory (outputs/compare/DATE/TIME, or hydra.run.dir) receives report.md, results.csv,
results.json, losses.csv, TensorBoard runs (one per strategy) and PNG plots.

Exit status: 0; 1 when a minidist strategy's final parameters differ from its
reference's by more than compare.tolerance (a regression check for CI); 2 for a
config error (one line saying what and how to fix it).
"""

import shlex
import sys
from pathlib import Path

import hydra
import hydra.errors
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from minidist.compare.launch_compare import launch
from minidist.dist import launch_rank


def strategy_options(name: str, compare_cfg):
    """configs/strategy/NAME.yaml (composed, so its defaults apply), then compare.bucket_cap_mb,
    compare.shard_size and compare.overrides.NAME on top."""
    options = compose(config_name="train", overrides=[f"strategy={name}"]).strategy
    if compare_cfg.bucket_cap_mb is not None and "bucket_cap_mb" in options:
        options.bucket_cap_mb = float(compare_cfg.bucket_cap_mb)
    if compare_cfg.get("shard_size") is not None and "shard_size" in options:
        options.shard_size = int(compare_cfg.shard_size)
    return OmegaConf.merge(options, compare_cfg.overrides.get(name, {}))


@hydra.main(config_path="../configs", config_name="compare", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from minidist.compare.launch_compare import check_strategies
    from minidist.train.errors import ConfigError

    try:
        check_strategies(cfg)
        options = {name: strategy_options(name, cfg.compare) for name in cfg.compare.strategies}
    except (ConfigError, hydra.errors.MissingConfigException) as e:
        if launch_rank() == 0:
            print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    OmegaConf.set_struct(cfg, False)
    cfg.compare.options = options
    command = "python recipes/compare.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    status = launch(cfg, Path(HydraConfig.get().runtime.output_dir), command.strip())
    if status:
        sys.exit(status)


if __name__ == "__main__":
    if launch_rank() != 0:
        sys.argv.append("hydra/hydra_logging=disabled")
    main()
