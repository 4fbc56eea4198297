"""The client scripts (tests/client_scripts/) run on every rank of a pool, as test_client_scripts.py
compares them: each script straight through, and stopped and restarted from its own snapshot,
under native DDP / fully_shard and under each minidist wrapper. Every function returns this
rank's final states; the directory is the test's own (snapshots are shared files, as on disk).
"""

from __future__ import annotations

import functools
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "client_scripts"))

import ddp_tutorial  # noqa: E402
import fsdp2_example  # noqa: E402
import mingpt  # noqa: E402
import nanogpt  # noqa: E402
import wrappers  # noqa: E402


def _between_runs():
    dist.barrier()  # a restart: every rank sees the snapshot rank 0 wrote


def tutorial(how: str, directory: str):
    """4 epochs straight; 2 epochs, then a restart that resumes from the snapshot to epoch 4."""
    straight = ddp_tutorial.main(4, 1, how, f"{directory}/{how}_straight.pt")
    _between_runs()
    ddp_tutorial.main(2, 1, how, f"{directory}/{how}_stopped.pt")
    _between_runs()
    resumed = ddp_tutorial.main(4, 1, how, f"{directory}/{how}_stopped.pt")
    return straight, resumed


def tutorial_at_stage3(directory: str) -> str:
    """The tutorial's rank-0 `self.model.module.state_dict()` under stage 3 (one epoch, so rank 1
    has no collective left to wait in): refused by name on rank 0."""
    try:
        ddp_tutorial.main(1, 1, "zero3", f"{directory}/zero3.pt", final_state=False)
        return "trained"
    except RuntimeError as e:
        return str(e)


# What native DDP's runs of a script gave, by their arguments (the directory aside): every port of the
# script in a test is compared with them, and a rank process runs many tests.
NATIVE: dict[tuple, object] = {}


def native_once(runs):
    """`runs(how, directory, *args)`, with how="native" run once a rank process for its arguments."""
    @functools.wraps(runs)  # its name: the pool's pickle finds it as the module's
    def wrapped(how: str, directory: str, *args, **kwargs):
        if how != "native":
            return runs(how, directory, *args, **kwargs)
        key = (runs.__name__, args, tuple(sorted(kwargs.items())))
        if key not in NATIVE:
            NATIVE[key] = runs(how, directory, *args, **kwargs)
        return NATIVE[key]
    return wrapped


@native_once
def mingpt_runs(how: str, directory: str, grad_norm_clip: float):
    """2 epochs straight; 1 epoch, then a restart that resumes (model, optimizer) to epoch 2."""
    run = lambda epochs, name: mingpt.main(epochs, how, f"{directory}/{how}_{name}_{grad_norm_clip}.pt",  # noqa: E731
                                           grad_norm_clip=grad_norm_clip)
    straight = run(2, "straight")
    _between_runs()
    run(1, "stopped")
    _between_runs()
    return straight, run(2, "stopped")


def fsdp2_runs(how: str, directory: str, mixed_precision: bool = False):
    """6 steps straight; 3 steps, a checkpoint, a restart that loads it for steps 3-5; and the
    same restart from the native run's checkpoint (DCP's full state dicts)."""
    out = {"straight": fsdp2_example.main(how, 6, mixed_precision=mixed_precision)}
    fsdp2_example.main(how, 3, checkpoint=f"{directory}/{how}.pt", mixed_precision=mixed_precision)
    _between_runs()
    out["resumed"] = fsdp2_example.main(how, 3, resume=f"{directory}/{how}.pt", mixed_precision=mixed_precision,
                                        first_step=3)
    if how != "native":
        fsdp2_example.main("native", 3, checkpoint=f"{directory}/native_for_{how}.pt",
                           mixed_precision=mixed_precision)
        _between_runs()
        out["from_native"] = fsdp2_example.main(how, 3, resume=f"{directory}/native_for_{how}.pt",
                                                mixed_precision=mixed_precision, first_step=3)
    return out


def fsdp2_init(how: str, meta: bool):
    """The example's weights as initialised (or the refusal)."""
    try:
        return fsdp2_example.main(how, 0, meta=meta)
    except ValueError as e:
        return str(e)


@native_once
def nanogpt_runs(how: str, directory: str, compiled: bool = False, **kwargs):
    """6 iterations straight; 3, then a restart with init_from="resume" to 6 (nanoGPT's checkpoint:
    rank 0 saves, every rank loads it before wrapping)."""
    run = functools.partial(nanogpt.main, how, compile=compiled, compile_backend="aot_eager", **kwargs)
    straight = run(f"{directory}/{how}_straight", 6)
    _between_runs()
    run(f"{directory}/{how}_stopped", 3)
    _between_runs()
    return straight, run(f"{directory}/{how}_stopped", 6, init_from="resume")


def nanogpt_gradient_collectives(how: str, directory: str) -> list[int]:
    """The gradient collectives (all_reduce, reduce_scatter) of 2 optimizer steps, with 1 and with 4
    micro-batches a step (the toggle): minidist's from its tracer, native DDP's from a comm hook that
    counts its bucket all_reduces."""
    from minidist.comm import CommTracer

    counts = []
    for accumulation in (1, 4):
        calls: list[str] = []

        def counting_wrap(wrap_how, model, optimizer, local_rank):
            wrapped = wrappers.wrap(wrap_how, model, optimizer, local_rank)
            if wrap_how == "native":
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                def hook(state, bucket):
                    calls.append("all_reduce")
                    return allreduce_hook(state, bucket)
                wrapped.register_comm_hook(None, hook)
            return wrapped
        nanogpt.wrap = counting_wrap
        try:
            with CommTracer() as tracer:
                nanogpt.main(how, f"{directory}/{how}_count", 2, gradient_accumulation_steps=2 * accumulation,
                             eval_interval=1000, checkpoint=False)
        finally:
            nanogpt.wrap = wrappers.wrap
        traced = [r.op for r in tracer.records if r.op in ("all_reduce", "reduce_scatter")]
        counts.append(len(calls) if how == "native" else len(traced))
    return counts


def nanogpt_rank0_evaluation_at_stage3(directory: str) -> str:
    """The script as written (evaluation on rank 0 only) under ZeRO-3: every rank's error."""
    nanogpt.evaluates_on_every_rank = lambda model: False
    try:
        nanogpt.main("zero3", f"{directory}/rank0_eval", 2, checkpoint=False)
        return "trained"
    except RuntimeError as e:
        return str(e)
    finally:
        nanogpt.evaluates_on_every_rank = _evaluates_on_every_rank


_evaluates_on_every_rank = nanogpt.evaluates_on_every_rank
