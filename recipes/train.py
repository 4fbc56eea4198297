"""Train a model with any strategy, ours or native: the minidist trainer.

    python recipes/train.py                                  # the default: ddp, gpt_nano, stdlib_text, 2 ranks
    python recipes/train.py strategy=zero3 launcher.nproc=4  # this process starts 4 local ranks
    torchrun --nproc_per_node 2 recipes/train.py strategy=native_fsdp
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 recipes/train.py
    python recipes/train.py -m strategy=ddp,zero2,zero3      # a sweep: one run directory per job
    python recipes/train.py hydra.run.dir=runs/a trainer.resume=auto   # continue where runs/a stopped

Everything (logs, TensorBoard, checkpoints, config.yaml) lands in the run directory,
outputs/train/DATE/TIME unless hydra.run.dir says otherwise. Configuration: configs/train.yaml.
Once installed, the same is `minidist train ...` or `python -m minidist.train ...` (minidist/train/app.py).
"""

from minidist.train.app import main

if __name__ == "__main__":
    main(prog="python recipes/train.py")
