"""A guided, verified walk through every torch.distributed primitive data parallelism is made of.

    python recipes/tour.py                       # launches 2 local ranks itself
    python recipes/tour.py nproc=4               # ... or 4
    torchrun --nproc_per_node 3 recipes/tour.py  # under torchrun (any N >= 2)

Each step prints what every rank held before and after, a line or two on what
happened, and checks the result against a reference computed locally. The
tour ends non-zero if any step fails verification on any rank. The tour itself:
tutorial/tour.py. Configuration: configs/tour.yaml.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tutorial/ lives in the checkout, not the package
from tutorial.tour import main  # noqa: E402

if __name__ == "__main__":
    main(prog="python recipes/tour.py")
