"""`python -m minidist.train [overrides]`: the trainer (so `torchrun -m minidist.train` works
from any directory). See minidist/train/app.py."""

from minidist.train.app import main

if __name__ == "__main__":
    main()
