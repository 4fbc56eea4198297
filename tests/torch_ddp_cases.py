"""PyTorch's own DDP tests (torch.testing._internal.distributed.distributed_test, shipped in the wheel,
imported, never copied) run on the warm rank pools, with minidist.DataParallel in DDP's place."""

import os
import unittest


def _suite_class():
    os.environ.setdefault("BACKEND", "gloo")
    import torch.distributed as dist
    import torch.backends
    from torch.testing._internal.distributed import distributed_test as dt

    # Its import freezes torch.backends' flags (for its own tests); the pool's later tests set them.
    vars(torch.backends)["__allow_nonbracketed_mutation_flag"] = True

    # The suite's file barrier keys on pids and counters it resets per test: the pool's ranks live
    # across tests, so a barrier is the process group's own.
    dt.Barrier.sync = classmethod(lambda cls, wait_for=None, timeout=10: dist.barrier())
    dt.Barrier.init = classmethod(lambda cls: None)

    class Suite(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        pass

    return dt, Suite


def run_torch_ddp_test(test_name: str, temp_dir: str, ours: bool = True) -> str:
    """Run one of PyTorch's DDP tests on this rank; 'passed', 'skipped: why' (raises on failure)."""
    import torch
    import torch.distributed as dist

    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    os.environ["TEMP_DIR"] = temp_dir
    os.environ["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    dt, Suite = _suite_class()
    import minidist
    from torch.testing._internal.common_distributed import TEST_SKIPS

    native = torch.nn.parallel.DistributedDataParallel
    if ours:
        torch.nn.parallel.DistributedDataParallel = minidist.DataParallel
        dt.DistributedDataParallel = minidist.DataParallel
    try:
        case = Suite(test_name)
        case.rank = dist.get_rank()
        case.file_name = os.path.join(temp_dir, "init")
        torch.manual_seed(0)  # as in the fresh processes the suite starts per test: one seed on every rank
        dist.barrier()
        getattr(case, test_name)()
        dist.barrier()
        return "passed"
    except unittest.SkipTest as e:
        return f"skipped: {e}"
    except SystemExit as e:
        why = [k for k, v in TEST_SKIPS.items() if v.exit_code == e.code]
        if why:
            return f"skipped: {why[0]}"
        raise
    finally:
        torch.nn.parallel.DistributedDataParallel = native
        dt.DistributedDataParallel = native


# ----------------------------------------------------------------------------------------------- the suite

# Tests PyTorch's suite runs on CPU with gloo that DataParallel refuses, each naming why (docs/drop_in.md):
# they read native DDP's internal logging.
REFUSED = {"test_ddp_logging_data_cpu": "_set_ddp_runtime_logging_sample_rate",
           "test_static_graph_api_cpu": "_get_ddp_logging_data"}


def ddp_test_names() -> list[str]:
    """Every test of the suite that builds a DistributedDataParallel (by its name, or in its body or a
    helper it calls)."""
    import inspect
    import re

    dt, _ = _suite_class()
    base = dt.DistributedTest._DistTestBase
    helpers = {n for n in dir(base) if not n.startswith("test_")}

    def builds_ddp(fn, seen: set) -> bool:
        source = inspect.getsource(inspect.unwrap(fn))
        if "DistributedDataParallel" in source:
            return True
        called = set(re.findall(r"self\.(_\w+)\(", source)) & helpers - seen
        seen |= called
        return any(builds_ddp(getattr(base, h), seen) for h in called)

    return sorted(n for n in dir(base) if n.startswith("test_") and (
        re.search("ddp|DDP|DistributedDataParallel", n) or builds_ddp(getattr(base, n), set())))


def run_suite(names: list[str], temp_dir: str) -> dict[str, str]:
    """Each test's outcome on this rank: 'passed', 'skipped: why', 'refused: message' or 'failed: error'.
    A failure that leaves the other rank in a collective ends in the pool's timeout instead."""
    import traceback

    outcomes = {}
    for name in names:
        directory = os.path.join(temp_dir, name)
        for sub in ("barrier", "test_dir"):
            os.makedirs(os.path.join(directory, sub), exist_ok=True)
        try:
            outcomes[name] = run_torch_ddp_test(name, directory)
        except AttributeError as e:
            outcomes[name] = f"refused: {e}" if str(e).startswith("DataParallel has no") else \
                f"failed: {traceback.format_exc()}"
        except Exception:  # noqa: BLE001 - reported by name, with its traceback
            outcomes[name] = f"failed: {traceback.format_exc()}"
    return outcomes


# ------------------------------------------------- what PyTorch's c10d DDP tests check (written here)

def error(fn) -> str:
    """What calling fn raised, as "Type: message" ('' where nothing)."""
    try:
        fn()
        return ""
    except Exception as e:  # noqa: BLE001 - the message is what is compared
        return f"{type(e).__name__}: {e}"


def _pair(model: str = "gpt"):
    """The same model twice, wrapped by native DDP and by DataParallel (ranks > 0 perturbed first)."""
    import ddp_cases
    import minidist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import torch.distributed as dist

    base = ddp_cases.build(model)
    native_inner, ours_inner = (ddp_cases.perturbed(base, dist.get_rank()) for _ in range(2))
    return (DDP(native_inner), native_inner), (minidist.DataParallel(ours_inner), ours_inner)


def _params(module) -> list:
    return [p.detach().clone() for p in module.parameters()]


def native_comm_hook_runs(hook_name: str) -> dict:
    """Train native DDP and DataParallel, each with torch's `hook_name` registered by register_comm_hook,
    with no_sync accumulation (2 micro-batches a step): ours bitwise native's?"""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    import ddp_cases

    def then_hook(state, bucket):  # a hook of the user's own: the all_reduce, then the division in .then()
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / dist.get_world_size())

    def hook_and_state():
        if hook_name == "powerSGD":
            return powerSGD_hook.powerSGD_hook, powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=7)
        return {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook, "then": then_hook}[hook_name], None

    results = []
    for wrapper, inner in _pair("gpt"):
        hook, state = hook_and_state()
        wrapper.register_comm_hook(state, hook)
        results.append(ddp_cases.train(wrapper, inner, "gpt", "adamw", steps=6, accumulate=2,
                                       rank=dist.get_rank(), n=dist.get_world_size(), no_sync=wrapper.no_sync))
    native, ours = results
    return {"bitwise": all(torch.equal(native[k], ours[k]) for k in native),
            "rel": ddp_cases.max_rel_diff(ours, native)[0]}


def comm_hook_rules() -> dict[str, str]:
    """register_comm_hook's rules (test_c10d_gloo's): each case's error message ('' where none)."""
    import torch
    import torch.distributed as dist
    import minidist
    from torch import nn

    def fresh(**kwargs):
        torch.manual_seed(0)
        return minidist.DataParallel(nn.Linear(4, 4), **kwargs)

    def backward(model):
        model(torch.ones(2, 4) * (dist.get_rank() + 1)).sum().backward()

    def simple_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = torch.futures.Future()
        fut.set_result(torch.ones_like(bucket.buffer()))
        return fut.then(lambda f: f.value() + torch.ones_like(f.value()))

    def bad_bucket(state, bucket: int) -> torch.futures.Future[torch.Tensor]:
        return torch.futures.Future()

    def bad_return(state, bucket: dist.GradBucket) -> int:
        return torch.futures.Future()

    out = {}
    model = fresh()
    model.register_comm_hook(None, simple_hook)
    out["twice"] = error(lambda: model.register_comm_hook(None, simple_hook))
    backward(model)
    out["future value"] = "" if all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in model.parameters()) \
        else "the gradients are not the Future's value"
    out["not callable"] = error(lambda: fresh().register_comm_hook(None, 1))
    out["bucket annotation"] = error(lambda: fresh().register_comm_hook(None, bad_bucket))
    out["return annotation"] = error(lambda: fresh().register_comm_hook(None, bad_return))
    no_future = fresh()
    no_future.register_comm_hook(None, lambda state, bucket: 1)
    out["no future"] = error(lambda: backward(no_future))
    late = fresh()
    backward(late)
    out["after backward"] = error(lambda: late.register_comm_hook(None, simple_hook))
    out["beside comm_hook="] = error(lambda: fresh(comm_hook="bf16").register_comm_hook(None, simple_hook))
    return out


def pickled_wrapper_trains_like_native(gradient_as_bucket_view: bool, directory: str) -> dict:
    """torch.save(model) of the wrapper after 3 steps, torch.load on every rank, 3 more steps (a new SGD
    over the loaded parameters): ours bitwise native DDP doing the same, and the ranks in sync?"""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_cases
    import minidist

    rank, n = dist.get_rank(), dist.get_world_size()
    base = ddp_cases.build("gpt")
    finals = []
    for wrap in (DDP, minidist.DataParallel):
        model = wrap(ddp_cases.perturbed(base, rank), gradient_as_bucket_view=gradient_as_bucket_view)
        for phase in range(2):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)

            def step():
                opt.step()
                opt.zero_grad()
            ddp_cases.step_loop(model, None, step, "gpt", 3, 1, rank, n)
            if phase == 0:
                path = os.path.join(directory, f"{wrap.__name__}_{rank}.pt")
                torch.save(model, path)
                model = torch.load(path, weights_only=False)  # the test's own file: a whole module
        finals.append({k: v.clone() for k, v in model.module.state_dict().items()})
    native, ours = finals
    everyone = minidist.comm.all_gather_object(ours)
    return {"bitwise": all(torch.equal(native[k], ours[k]) for k in native),
            "ranks_agree": all(torch.equal(everyone[0][k], sd[k]) for sd in everyone for k in sd)}


def construction_errors() -> dict[str, str]:
    """What DataParallel refuses at construction: no trainable parameter (as native), sparse gradients,
    and pickling a wrapper on another group than the default."""
    import torch
    import torch.distributed as dist
    from torch import nn
    import minidist

    import io
    frozen = nn.Linear(2, 2).requires_grad_(False)
    group = dist.new_group(list(range(dist.get_world_size())))
    return {
        "no trainable parameter": error(lambda: minidist.DataParallel(nn.Module())),
        "frozen": error(lambda: minidist.DataParallel(frozen)),
        "sparse": error(lambda: minidist.DataParallel(nn.Sequential(nn.EmbeddingBag(10, 4, sparse=True)))),
        "sparse frozen": error(lambda: minidist.DataParallel(
            nn.Sequential(nn.EmbeddingBag(10, 4, sparse=True).requires_grad_(False), nn.Linear(4, 2)))),
        "pickle on a subgroup": error(lambda: torch.save(minidist.DataParallel(nn.Linear(2, 2), process_group=group),
                                                         io.BytesIO())),
    }


def unused_and_ignored_outputs() -> dict:
    """test_c10d_gloo's: an output dropped without backward (with and without find_unused_parameters), and
    a parameter used on rank 0 only, one on no rank: native DDP's .grad on each (None for the one no rank
    used), and the ranks' gradients equal to native's."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    import minidist

    class Tasks(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.t0, self.t1, self.unused = (nn.Parameter(torch.randn(4, 3)) for _ in range(3))

        def forward(self, x, rank):
            return x * self.t0 if rank == 0 else x * self.t1

    rank = dist.get_rank()
    grads = []
    for wrap in (DDP, minidist.DataParallel):
        for find_unused in (True, False):
            torch.manual_seed(0)
            model = wrap(Tasks() if find_unused else nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)),
                         find_unused_parameters=find_unused)
            x = torch.ones(4, 3) * (rank + 1)
            for _ in range(3):
                model(x, rank) if find_unused else model(x)  # ignored outputs: no backward
            for _ in range(2):
                (model(x, rank) if find_unused else model(x)).mean().backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in model.module.parameters()])
    native, ours = grads[:2], grads[2:]
    flat_native, flat_ours = native[0] + native[1], ours[0] + ours[1]
    return {"same_none": [g is None for g in flat_native] == [g is None for g in flat_ours],
            "unused_none": ours[0][2] is None and ours[0][1] is not None,
            "equal": all(a is None or torch.equal(a, b) for a, b in zip(flat_native, flat_ours))}


def sharded_refusals() -> dict[str, str]:
    """What a DDP script's native calls get from ShardedDataParallel: torch.save(model) and
    register_comm_hook are refused at once, naming the way (each stage)."""
    import functools
    import io

    import torch
    from torch import nn
    import minidist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    out = {}
    for stage in (1, 2, 3):
        model = minidist.ShardedDataParallel(nn.Linear(4, 4), functools.partial(torch.optim.SGD, lr=0.1), stage=stage)
        out[f"save {stage}"] = error(lambda: torch.save(model, io.BytesIO()))
        out[f"hook {stage}"] = error(lambda: model.register_comm_hook(None, allreduce_hook))
    return out


def state_dict_checkpoint_like_native(directory: str) -> dict:
    """test_c10d_gloo's save/load checkpoint: 3 steps, rank 0 saves the wrapper's state_dict ("module."
    keys), every rank zeroes its parameters and loads it into the wrapper and, prefix consumed, into a
    plain copy (which then holds the wrapper's values); 3 more steps. Ours ends as a run without the
    checkpoint, and as native DDP does."""
    import torch
    import torch.distributed as dist
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_cases
    import minidist

    rank, n = dist.get_rank(), dist.get_world_size()
    base = ddp_cases.build("mlp")

    def train(model, steps):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            opt.step()
            opt.zero_grad()
        ddp_cases.step_loop(model, None, step, "mlp", steps, 1, rank, n)

    finals = {}
    for wrap in (DDP, minidist.DataParallel):
        model, plain, unbroken = wrap(ddp_cases.perturbed(base, rank)), ddp_cases.build("mlp"), wrap(
            ddp_cases.perturbed(base, rank))
        train(model, 3)
        path = os.path.join(directory, f"{wrap.__name__}.pt")
        if rank == 0:
            torch.save(model.state_dict(), path)
        dist.barrier()
        state = torch.load(path, weights_only=True)
        with torch.no_grad():
            for p in [*model.parameters(), *plain.parameters()]:
                p.zero_()
        model.load_state_dict(state)
        consume_prefix_in_state_dict_if_present(state, "module.")
        plain.load_state_dict(state)
        loaded_alike = all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.module.parameters()))
        train(model, 3)
        train(unbroken, 3)
        train(unbroken, 3)  # (the same batches as the run that was saved and loaded between them)
        finals[wrap.__name__] = [dict(model.module.named_parameters()), dict(unbroken.module.named_parameters()),
                                 loaded_alike]
    (native, _, _), (ours, ours_unbroken, loaded_alike) = finals.values()
    return {"resumed_as_unbroken": all(torch.equal(ours[k], ours_unbroken[k]) for k in ours),
            "as_native": all(torch.equal(ours[k], native[k]) for k in ours), "plain_loads": loaded_alike}
