"""`python -m minidist.checkpoint consolidate CKPT_DIR OUT.pt`: a plain state_dict from any trainer checkpoint.

The implementation lives with the trainer (minidist/train/checkpoint.py); this module is the command.
"""

import sys

from minidist.train.checkpoint import consolidate, main

__all__ = ["consolidate", "main"]

if __name__ == "__main__":
    sys.exit(main())
