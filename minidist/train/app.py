"""The trainer's command line, wherever it is started from: `python recipes/train.py`,
`minidist train` (the installed command), `python -m minidist.train` (so that
`torchrun --nproc_per_node 4 -m minidist.train strategy=zero3` works from any directory).

Hydra overrides as usual; outputs under the current directory (outputs/train/DATE/TIME, or
hydra.run.dir); the configs from minidist.train.config_dir (the repository's, or the copy a
wheel carries).
"""

from __future__ import annotations

import sys
from typing import Callable


def run_app(config_name: str, body: Callable, argv: list[str], prog: str) -> None:
    """Run `body(cfg)` as a Hydra app on configs/<config_name>.yaml with `argv`'s overrides."""
    import hydra

    from minidist.dist import launch_rank
    from minidist.train.config_dir import config_dir

    sys.argv = [prog, *argv]
    if launch_rank() != 0:
        sys.argv.append("hydra/hydra_logging=disabled")  # Hydra's own lines come from rank 0 only
    hydra.main(config_path=str(config_dir()), config_name=config_name, version_base="1.3")(body)()


def train(cfg) -> None:
    """Validate and train (launch_train.launch); exit with its status."""
    from hydra.core.hydra_config import HydraConfig

    from minidist.train.launch_train import launch

    status = launch(cfg, HydraConfig.get().runtime.output_dir)
    if status:
        sys.exit(status)


def main(argv: list[str] | None = None, prog: str = "python -m minidist.train") -> None:
    run_app("train", train, sys.argv[1:] if argv is None else argv, prog)
