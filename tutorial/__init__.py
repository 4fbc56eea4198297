"""Reading material that runs: the torch.distributed primitives tour (tour.py, `python recipes/tour.py`)
and data parallelism built in four steps (walkthrough/, `python recipes/walkthrough.py`). Not part of the
installed package: minidist itself never imports them."""
