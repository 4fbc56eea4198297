"""Every data-parallel strategy behind one interface (base.py), each declared once by a spec
in the registry (registry.py): minidist's own (ours.py); native PyTorch's and DeepSpeed's
(optional) are plugins in minidist_tools/ (native.py, deepspeed.py) their configs name.

    from minidist.train.strategies import build_strategy, spec, names
    strategy = build_strategy(cfg.strategy, ctx, precision)

Adding a strategy: a Strategy subclass and register(StrategySpec(...)) in one module, and its
defaults in configs/strategy/NAME.yaml (docs/trainer.md: "Adding a strategy").
"""

from minidist.train.strategies.base import (Strategy, agree_on_overflow, build_mesh, local_tensor, mesh_dims,
                                            step_unless_nonfinite)
from minidist.train.strategies.registry import (Collective, StrategySpec, build_strategy, check_options, names,
                                                register, spec, specs)

__all__ = ["Collective", "Strategy", "StrategySpec", "agree_on_overflow", "build_mesh", "build_strategy",
           "check_options", "local_tensor", "mesh_dims", "names", "register", "spec",
           "specs", "step_unless_nonfinite"]
