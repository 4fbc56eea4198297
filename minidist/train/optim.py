"""The optimizer, its schedule, and one optimizer step, the same code for the trainer and the
comparison (train/state.py builds both).

    loss, grad_norm = accumulate_and_step(strategy, micro_batches, loss_fn, max_norm, scaler)

The optimizer is handed on as (class, arguments): ZeRO builds it over its own shards. Several
optimizers step as one (CombinedOptimizer: optim=muon). Accumulation: docs/internals.md, "train/optim.py".
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from minidist.train.config import class_named


# The optim group's keys that are not the optimizer's own arguments.
NOT_ARGUMENTS = ("_target_", "name", "module", "warmup_steps", "min_lr_ratio", "fused")


def lr_lambda(warmup_steps: int, max_steps: int, min_ratio: float):
    """Linear warm-up to the peak, then a cosine decay to min_ratio x peak at max_steps."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def optimizer_spec(optim_cfg, device: torch.device = torch.device("cpu")) -> tuple[type, dict]:
    """(optimizer class, keyword arguments) from the optim config group. `fused: auto` takes the
    fused kernels wherever the class has them (torch's AdamW, Adam, SGD; MuonWithAdamW's
    AdamW) on CUDA or CPU: on CUDA they skip a non-finite step without a host synchronisation
    (strategy.step_unless_nonfinite); on a CPU core AdamW's step takes a fifth of foreach's time
    (6.5 against 34 ms for 6.3M parameters). Their sums round differently from foreach's (by an ulp)."""
    from omegaconf import OmegaConf

    cls = class_named(str(optim_cfg._target_), torch.optim.Optimizer, "optim._target_", "torch.optim.AdamW",
                      module=optim_cfg.get("module"))
    kwargs = {k: tuple(v) if isinstance(v, list) else v  # betas: a tuple, as torch writes them
              for k, v in OmegaConf.to_container(optim_cfg, resolve=True).items() if k not in NOT_ARGUMENTS}
    fused = optim_cfg.fused
    has_fused = device.type in ("cuda", "cpu") and "fused" in inspect.signature(cls).parameters
    if fused is True or fused == "auto" and has_fused:
        kwargs["fused"] = True
    return cls, kwargs


def merged_state_dicts(states: list[dict]) -> dict:
    """Several optimizers' state_dicts as one optimizer over all their groups, in order, would
    write it: the parameters numbered on from one to the next."""
    merged, offset = {"state": {}, "param_groups": []}, 0
    for state in states:
        merged["state"].update({offset + i: v for i, v in state["state"].items()})
        merged["param_groups"] += [{**g, "params": [offset + i for i in g["params"]]} for g in state["param_groups"]]
        offset += sum(len(g["params"]) for g in state["param_groups"])
    return merged


def split_state_dict(state: dict, optimizers: list[torch.optim.Optimizer]) -> list[dict]:
    """merged_state_dicts' inverse: one state_dict per optimizer, each holding as many groups as
    that optimizer has, numbered from 0."""
    group_counts = [len(o.param_groups) for o in optimizers]
    if sum(group_counts) != len(state["param_groups"]):
        raise ValueError(f"the optimizer state holds {len(state['param_groups'])} param groups, these optimizers "
                         f"{sum(group_counts)} ({' + '.join(map(str, group_counts))}): it was saved from others")
    out, start = [], 0
    for n in group_counts:
        groups, start = state["param_groups"][start:start + n], start + n
        number = {i: k for k, i in enumerate(i for g in groups for i in g["params"])}
        out.append({"state": {number[i]: v for i, v in state["state"].items() if i in number},
                    "param_groups": [{**g, "params": [number[i] for i in g["params"]]} for g in groups]})
    return out


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped, scheduled and checkpointed as one (torchtitan's container's idea):
    `param_groups` are theirs in order (the same dicts: a scheduler sets each group's lr), and
    state_dict() numbers their parameters as one optimizer over all those groups would.
    ShardedDataParallel takes its `optimizers` as the list they are."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = []  # empty while torch's __init__ adds its (discarded) group
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})
        self.optimizers = list(optimizers)

    # Read from the optimizers (torch's __init__ assigns both, to no effect here). `state`: a view,
    # each parameter's state dict theirs; a parameter without state reads as {}, as in torch's.
    param_groups = property(lambda self: [g for o in self.optimizers for g in o.param_groups], lambda self, _: None)
    state = property(lambda self: collections.defaultdict(
        dict, {p: s for o in self.optimizers for p, s in o.state.items()}), lambda self, _: None)

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("CombinedOptimizer.step takes no closure (each optimizer would run it)")
        for o in self.optimizers:
            o.step()

    def state_dict(self) -> dict:
        return merged_state_dicts([o.state_dict() for o in self.optimizers])

    def load_state_dict(self, state_dict: dict) -> None:
        for o, part in zip(self.optimizers, split_state_dict(state_dict, self.optimizers)):
            o.load_state_dict(part)


class MuonWithAdamW(CombinedOptimizer):
    """The Muon recipe as one optimizer: torch.optim.Muon over `muon_params` (the hidden weight
    matrices; default: every 2-D parameter), AdamW over the rest (embeddings, the head, norms,
    biases), each with its own lr and options (AdamW's prefixed adamw_). optim=muon in the trainer,
    which passes hidden_matrices(net); under ZeRO each matrix is owned whole by one rank."""

    def __init__(self, params, muon_params=None, lr: float = 0.02, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr_fn: str | None = None, adamw_lr: float = 3e-3,
                 adamw_betas=(0.9, 0.95), adamw_eps: float = 1e-8, adamw_weight_decay: float = 0.1, fused=None):
        params = list(params)
        hidden = {id(p) for p in (muon_params if muon_params is not None else [p for p in params if p.ndim == 2])}
        matrices, rest = [p for p in params if id(p) in hidden], [p for p in params if id(p) not in hidden]
        optimizers = [torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                       ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)] if matrices else []
        if rest:
            optimizers.append(torch.optim.AdamW(rest, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                                                weight_decay=adamw_weight_decay, fused=fused))
        super().__init__(optimizers)


def hidden_matrices(net: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon is for: 2-D weights but those of embeddings (tied ones too) and of the
    output head (the model's last nn.Linear)."""
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    skip = {id(m.weight) for m in net.modules() if isinstance(m, nn.Embedding)}
    skip |= {id(linears[-1].weight)} if linears else set()
    return [p for p in net.parameters() if p.ndim == 2 and p.requires_grad and id(p) not in skip]


def task_loss(out: torch.Tensor, y: torch.Tensor, is_text: bool) -> torch.Tensor:
    """Cross-entropy in fp32: per token for a language model, per sample for a classifier."""
    if is_text:
        return F.cross_entropy(out.float().reshape(-1, out.size(-1)), y.reshape(-1))
    return F.cross_entropy(out.float(), y)


def accumulate_and_step(strategy, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                        loss_fn: Callable, max_norm: float, scaler,
                        autocast: Callable = contextlib.nullcontext,
                        before_optimizer: Callable[[], object] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one optimizer step over `micro_batches` (a list of (x, y) already on the device).
    `before_optimizer()`, when given, runs once the gradients are complete, just before the
    optimizer step (what the comparison measures the model state at); if it returns False the
    step is discarded: no update, the gradients zeroed, and the norm returned is None.

    Returns (the summed loss over micro-batches, each divided by their number, detached;
    the global gradient norm before clipping)."""
    micro_batches = list(micro_batches)
    n = len(micro_batches)
    local = strategy.cfg.get("accumulate", "local") == "local"
    loss_sum = None
    for k, (x, y) in enumerate(micro_batches):
        with (strategy.no_sync() if local and k < n - 1 else contextlib.nullcontext()):
            with record_function("minidist.forward"), autocast():
                loss = loss_fn(strategy.model(x), y) / n
            with record_function("minidist.backward"):
                strategy.backward(scaler.scale(loss))
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    if before_optimizer is not None and before_optimizer() is False:  # live recovery's vote: discarded
        strategy.optimizer.zero_grad(set_to_none=True)
        return loss_sum, None
    with record_function("minidist.optimizer"):
        norm = strategy.optimizer_step(max_norm, scaler)
    return loss_sum, norm
