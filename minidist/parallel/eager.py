"""`eager`: keep communication out of torch.compile's graphs.

The wrappers' hooks wait for collectives, resize storages and register autograd
hooks. Traced by dynamo, such a hook is either folded into the graph or dropped,
and a dropped `Work.wait()` means a compiled forward reads a parameter before its
all_gather has landed: a different number, silently. Every function that talks to
the communication layer from inside a forward is therefore marked `eager`: dynamo
breaks the graph at the call and runs it as plain Python, so `torch.compile(net)`
before wrapping and `torch.compile(model)` of the wrapper both compute what the
uncompiled model computes; the layers between the breaks are still compiled.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager(fn: F) -> F:
    """Run `fn` (and everything it calls) outside torch.compile: a graph break at each call."""
    return torch.compiler.disable(fn, recursive=True)


def runs_compiled_code(module: torch.nn.Module) -> bool:
    """Whether a forward of `module` may run torch.compile'd code (now, while dynamo traces the
    caller, or in a compiled submodule).

    Per-module forward hooks cannot be relied on inside compiled code: dynamo does not guard
    on module hooks by default (torch._dynamo.config.skip_nnmodule_hook_guards), so a graph
    traced earlier for another instance of the same class runs without ours. A wrapper whose
    correctness needs a hook must do that work before entering such a module instead.
    """
    if torch.compiler.is_compiling():
        return True
    from torch._dynamo.eval_frame import OptimizedModule

    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in module.modules())


_HOOKED_CLASSES: dict[type, type] = {}


def mark_hooked(module: torch.nn.Module) -> None:
    """Give `module` a subclass of its class (same behaviour, name prefixed "Sharded"), as
    FSDP2's fully_shard does.

    Why: a graph dynamo traced for a plain instance of the class (e.g. a reference model
    compiled earlier in the process) carries no guard on module hooks, and would run for this
    instance without the hooks that gather its parameters. Dynamo does guard on the module's
    type, so a distinct class makes it trace this module afresh, hooks included.
    """
    cls = type(module)
    if cls in _HOOKED_CLASSES.values():
        return
    if cls not in _HOOKED_CLASSES:
        _HOOKED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (cls,), {"__module__": cls.__module__})
    module.__class__ = _HOOKED_CLASSES[cls]
