"""Data parallelism in five small steps, each a complete file you can read top to bottom.

    step1_naive.py     broadcast the weights once; after backward, all_reduce every gradient
    step2_buckets.py   the same, but gradients packed into a few flat buckets: fewer, larger messages
    step3_overlap.py   buckets launched from gradient hooks *during* backward: communication overlaps compute
    step4_zero1.py     ZeRO-1: reduce_scatter instead of all_reduce, each rank updates 1/N of the
                       parameters (and keeps 1/N of the optimizer state), then all_gather

Each class wraps a module and exposes the same three calls, so one loop drives them all:

    model = Step(net)                  # broadcast: every rank starts from rank 0's weights
    loss_fn(model(x), y).backward()    # (step 3 communicates during this)
    model.finish_gradients()           # after it, every rank holds the averaged gradient
    optimizer.step()                   # (step 4: model.step() replaces both)

`python recipes/walkthrough.py` runs them on 2 local ranks against native DDP on the same model
and batches and draws each one's timeline; docs/walkthrough.md tells the story. What
minidist.DataParallel adds on top of step 3 (bucket order rebuilt from the first backward,
no_sync for accumulation, unused parameters, comm hooks, buffers) and ShardedDataParallel on top
of step 4 (stages 2 and 3, hybrid meshes) is listed there with pointers into the code.

All communication goes through minidist.comm, so a CommTracer sees it (bytes, exposed time).
"""

from tutorial.walkthrough.step1_naive import NaiveDataParallel
from tutorial.walkthrough.step2_buckets import BucketedDataParallel
from tutorial.walkthrough.step3_overlap import OverlappedDataParallel
from tutorial.walkthrough.step4_zero1 import Zero1DataParallel

STEPS = {"1 naive": NaiveDataParallel, "2 buckets": BucketedDataParallel,
         "3 overlap": OverlappedDataParallel, "4 zero1": Zero1DataParallel}

__all__ = ["NaiveDataParallel", "BucketedDataParallel", "OverlappedDataParallel", "Zero1DataParallel", "STEPS"]
