"""A guided, verified walk through every torch.distributed primitive data parallelism is made of.

    python recipes/tour.py                       # launches 2 local ranks itself
    python recipes/tour.py nproc=4               # ... or 4
    torchrun --nproc_per_node 3 recipes/tour.py  # under torchrun (any N >= 2)

Each step prints what every rank held before and after, a line or two on what
happened, and checks the result against a reference computed locally. The
tour ends non-zero if any step fails verification on any rank. The tour itself:
minidist/tour.py (also `minidist tour` once installed). Configuration: configs/tour.yaml.
"""

from minidist.tour import main

if __name__ == "__main__":
    main(prog="python recipes/tour.py")
