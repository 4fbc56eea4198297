"""Train a model with any strategy, ours or native: the minidist trainer.

    python recipes/train.py                                  # the default: ddp, gpt_nano, stdlib_text, 2 ranks
    python recipes/train.py strategy=zero3 launcher.nproc=4  # this process starts 4 local ranks
    torchrun --nproc_per_node 2 recipes/train.py strategy=native_fsdp
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 recipes/train.py
    python recipes/train.py -m strategy=ddp,zero2,zero3      # a sweep: one run directory per job
    python recipes/train.py hydra.run.dir=runs/a trainer.resume=auto   # continue where runs/a stopped

Everything (logs, TensorBoard, checkpoints, config.yaml) lands in the run directory,
outputs/train/DATE/TIME unless hydra.run.dir says otherwise. Configuration: configs/train.yaml.
"""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from minidist.dist import launch_rank
from minidist.train.launch_train import launch


@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    status = launch(cfg, HydraConfig.get().runtime.output_dir)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    if launch_rank() != 0:
        sys.argv.append("hydra/hydra_logging=disabled")  # Hydra's own lines come from rank 0 only
    main()
