"""The `minidist` command, installed with the package (`pip install .`): the recipes, from any
directory.

    minidist train strategy=zero3 launcher.nproc=4         # = python recipes/train.py ...
    minidist compare compare.strategies=[ddp,native_ddp]   # = python recipes/compare.py ...
    minidist checkpoint info outputs/train/DATE/TIME/checkpoints/step_00000400
    minidist checkpoint consolidate CKPT OUT.pt            # a plain state_dict
    torchrun --nproc_per_node 4 -m minidist.train strategy=zero3   # the trainer under torchrun

Hydra overrides as with the recipes; outputs land under the current directory.
"""

from __future__ import annotations

import importlib
import sys

# Commands that left the package, and where they went: one line each.
MOVED = {"tour": "the primitives tour is reading material in the repository now: python recipes/tour.py in a checkout"}

# command -> (its module, whose main(argv, prog) runs it; what it does)
COMMANDS = {
    "train": ("minidist.train.app", "train a model with any strategy (Hydra overrides: strategy=zero3 ...)"),
    "compare": ("minidist_tools.compare", "several strategies side by side, against native PyTorch and DeepSpeed"),
    "checkpoint": ("minidist.train.checkpoint", "info CKPT | consolidate CKPT OUT.pt"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "\n".join(["usage: minidist COMMAND [ARGS...]", "", "commands:"] +
                     [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name in MOVED:
        print(f"error: minidist {name}: {MOVED[name]}", file=sys.stderr)
        return 2
    if name not in COMMANDS:
        print(f"error: minidist {name}: no such command; the commands are {', '.join(COMMANDS)} "
              "(minidist --help)", file=sys.stderr)
        return 2
    status = importlib.import_module(COMMANDS[name][0]).main(rest, prog=f"minidist {name}")
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
