"""What scripts written for native DDP / FSDP2 do around the wrapper, run against native DDP.

Each function runs on every rank of a pool (tests/test_porting.py): the same model from the same
weights (ranks > 0 perturbed, so the wrappers' broadcast is exercised), the same batches, once
under native DDP and once under the wrapper named by `kind` ("ddp", "zero1", "zero2", "zero3").
They return what the test compares: whole state_dicts, scales, learning rates, messages.
"""

from __future__ import annotations

import copy
import functools
import io

import torch
import torch.distributed as dist
from torch import nn

import minidist
from ddp_cases import PER_RANK_BATCH, build, global_batch, loss_fn, max_rel_diff, perturbed
from minidist.comm import CommTracer

STAGE_KW = {1: {"bucket_cap_mb": 0.01}, 2: {"bucket_cap_mb": 0.01}, 3: {"min_unit_params": 1000}}


def local_batch(model: str, step: int):
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(model, step, 0, n)
    part = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
    return x[part], y[part]


def decay_groups(net: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """nanoGPT's / minGPT's split: matrices and embeddings decay, biases and norms do not."""
    params = [p for p in net.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def user_optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(decay_groups(net), lr=1e-2, betas=(0.9, 0.95), eps=1e-6)


def wrap(kind: str, net: nn.Module, optimizer: torch.optim.Optimizer, **kwargs):
    """The one line a script changes: native DDP, or our wrapper of the same net and optimizer
    (hsdp2 / hsdp3: on a mesh of two shard groups)."""
    if kind == "native":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(net, **kwargs)
    if kind == "ddp":
        return minidist.DataParallel(net, **kwargs)
    if kind.startswith("hsdp"):
        kwargs["mesh"] = minidist.init_mesh(replicate=2, shard=dist.get_world_size() // 2, env={})
    stage = int(kind[-1])
    model = minidist.ShardedDataParallel(net, optimizer, stage=stage, **{**STAGE_KW[stage], **kwargs})
    assert isinstance(optimizer, functools.partial) or model.optimizer is optimizer  # the script's own object
    return model


def whole_state(kind: str, model, net: nn.Module) -> dict:
    """This rank's whole state_dict as the plain module holds it (a collective under ZeRO)."""
    state = model.full_state_dict() if kind.startswith(("zero", "hsdp")) else net.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def same(a: dict, b: dict) -> tuple[bool, float]:
    """(bitwise equal, worst max_rel_diff): the comparison every case reports."""
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in b), max_rel_diff(a, b)[0]


def ranks_agree(state: dict) -> bool:
    everyone = minidist.comm.all_gather_object(state)
    return all(torch.equal(everyone[0][k], s[k]) for s in everyone for k in s)


# --------------------------------------------------------------------------- the user's own optimizer


def train_with_schedule(kind: str, make_optimizer=None, steps: int = 6):
    """`steps` steps of GPT with the optimizer a script builds (default: minGPT's groups) and a
    scheduler built on it before wrapping; the whole state and each group's (lr, weight decay)."""
    net = perturbed(build("gpt"), dist.get_rank())
    opt = (make_optimizer or user_optimizer)(net)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model = wrap(kind, net, opt)
    for step in range(steps):
        x, y = local_batch("gpt", step)
        loss_fn("gpt", model(x), y).backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    return whole_state(kind, model, net), [(g["lr"], g["weight_decay"]) for g in opt.param_groups]


def param_groups_match_native(kind: str):
    """minGPT's decay / no-decay groups and a scheduler built on the optimizer before wrapping; the
    same with weight decay on everything must differ (the groups are really applied)."""
    ours, ours_groups = train_with_schedule(kind)
    native, native_groups = train_with_schedule("native")
    one_group, _ = train_with_schedule(kind, lambda net: torch.optim.AdamW(
        net.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1))
    return {"vs_native": same(ours, native), "groups": ours_groups == native_groups,
            "groups_matter": not same(one_group, native)[0], "ranks_agree": ranks_agree(ours)}


def refused_optimizers():
    """Optimizers a flat shard cannot step exactly, and ones that do not fit the module."""
    out = []
    for make in (lambda net: torch.optim.Adafactor(net.parameters()),
                 lambda net: type("MyOpt", (torch.optim.Optimizer,), {})(net.parameters(), {"lr": 1.0}),
                 lambda net: torch.optim.SGD(list(net.parameters())[1:], lr=0.1),
                 lambda net: torch.optim.SGD([*net.parameters(), nn.Parameter(torch.zeros(3))], lr=0.1)):
        net = build("mlp")
        try:
            minidist.ShardedDataParallel(net, make(net), stage=2)
            out.append("accepted")
        except (TypeError, ValueError) as e:
            out.append(str(e))
    return out


def registered_elementwise_optimizer():
    """A class of the user's, declared element-wise, trains as the same update under native DDP."""
    @minidist.parallel.register_elementwise_optimizer
    class SignSGD(torch.optim.Optimizer):
        def __init__(self, params, lr=0.01):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad.sign(), alpha=-group["lr"])
    states = {}
    for kind in ("native", "zero2"):
        net = perturbed(build("mlp"), dist.get_rank())
        opt = SignSGD(net.parameters())
        model = wrap(kind, net, opt)
        for step in range(3):
            x, y = local_batch("mlp", step)
            loss_fn("mlp", model(x), y).backward()
            opt.step()
            opt.zero_grad()
        states[kind] = whole_state(kind, model, net)
    return same(states["zero2"], states["native"])


def reshard_with_groups(stage: int, saved: list | None = None):
    """sharded_state_dict() of an optimizer with param groups, saved at one world size (saved=None:
    5 steps, save, 3 more) and loaded at another (the saved list: load, the same 3 more)."""
    net = build("gpt")
    opt = user_optimizer(net)
    model = wrap(f"zero{stage}", net, opt)
    if saved is None:
        train_global_batch(model, opt, range(5))
        state = model.sharded_state_dict()
    else:
        model.load_sharded_state_dict(saved)
        state = None
    train_global_batch(model, opt, range(5, 8))
    return state, whole_state(f"zero{stage}", model, net), [(g["lr"], g["weight_decay"]) for g in opt.param_groups]


def train_global_batch(model, opt, steps: range) -> None:
    """The same global batch of 8 at any world size (each rank its slice)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for step in steps:
        x, y = global_batch("gpt", step, 0, 2)
        per = len(x) // n
        loss_fn("gpt", model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()


# --------------------------------------------------------------------------- optimizer checkpoints


def rank0_optimizer_snapshot(kind: str):
    """minGPT / imagenet / nanoGPT: rank 0 saves optimizer.state_dict() (to load it on every rank,
    before wrapping). Under ZeRO that is one rank's shard: refused at the save, on the rank that asks."""
    net = perturbed(build("gpt"), dist.get_rank())
    opt = user_optimizer(net)
    model = wrap(kind, net, opt)
    for step in range(2):
        x, y = local_batch("gpt", step)
        loss_fn("gpt", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if dist.get_rank() != 0:
        return "not asked"
    try:
        opt.state_dict()
        return "saved"
    except RuntimeError as e:
        return str(e)


def shared_file(obj):
    """What rank 0 torch.saves, as every rank reads it back (weights_only)."""
    buffer = io.BytesIO()
    if dist.get_rank() == 0:
        torch.save(obj, buffer)
    data = minidist.comm.all_gather_object(buffer.getvalue())[0]
    return torch.load(io.BytesIO(data), weights_only=True)


def train_steps(model, opt, steps: range, model_name: str = "gpt") -> None:
    for step in steps:
        x, y = local_batch(model_name, step)
        loss_fn(model_name, model(x), y).backward()
        opt.step()
        opt.zero_grad()


def full_optimizer_snapshot(kind: str):
    """The one-file snapshot done the working way (full_optim_state_dict() on every rank, rank 0
    saves), resumed as minGPT does (loaded into the plain model and optimizer before wrapping) and
    as FSDP2 scripts do (after wrapping); and loaded from / into a native DDP run's optimizer."""
    rank = dist.get_rank()
    straight_net = perturbed(build("gpt"), rank)
    straight_opt = user_optimizer(straight_net)
    straight = wrap(kind, straight_net, straight_opt)
    train_steps(straight, straight_opt, range(3))
    model_file = shared_file(straight.full_state_dict() if kind.startswith("zero") else straight_net.state_dict())
    optim_file = shared_file(straight.full_optim_state_dict(straight_opt, rank0_only=True))
    train_steps(straight, straight_opt, range(3, 6))
    reference = whole_state(kind, straight, straight_net)
    out = {}
    for when in ("before_wrapping", "after_wrapping"):
        net = perturbed(build("gpt"), rank)
        opt = user_optimizer(net)
        # Each resume reads the files afresh (torch's load_state_dict keeps the loaded tensors).
        model_state, optim_state = copy.deepcopy(model_file), copy.deepcopy(optim_file)
        if when == "before_wrapping":  # minGPT's _load_snapshot, then DDP(...)
            net.load_state_dict(model_state)
            opt.load_state_dict(optim_state)
            model = wrap(kind, net, opt)
        else:
            model = wrap(kind, net, opt)
            getattr(model, "module", model).load_state_dict(model_state)
            model.load_full_optim_state_dict(optim_state, opt)
        train_steps(model, opt, range(3, 6))
        out[when] = same(whole_state(kind, model, net), reference)
    # A native DDP run's snapshot resumed here, and ours resumed by native DDP.
    native_net = perturbed(build("gpt"), rank)
    native_opt = user_optimizer(native_net)
    native = wrap("native", native_net, native_opt)
    train_steps(native, native_opt, range(3))
    native_optim_file = shared_file(native_opt.state_dict())
    out["full_state_as_native"] = optimizer_states_equal(optim_file, native_optim_file)
    native_model_file = shared_file(native_net.state_dict())
    train_steps(native, native_opt, range(3, 6))
    native_end = whole_state("native", native, native_net)
    net = perturbed(build("gpt"), rank)
    opt = user_optimizer(net)
    net.load_state_dict(native_model_file)
    model = wrap(kind, net, opt)
    opt.load_state_dict(native_optim_file)
    train_steps(model, opt, range(3, 6))
    out["from_native"] = same(whole_state(kind, model, net), native_end)
    return out


def optimizer_states_equal(a: dict, b: dict) -> bool:
    """Two torch optimizer state_dicts hold the same groups' options and the same state, bitwise."""
    if [{k: v for k, v in g.items()} for g in a["param_groups"]] != [dict(g) for g in b["param_groups"]]:
        return False
    if sorted(a["state"]) != sorted(b["state"]):
        return False
    return all(sorted(a["state"][i]) == sorted(b["state"][i]) and
               all(torch.equal(a["state"][i][k], b["state"][i][k]) for k in a["state"][i]) for i in a["state"])


# --------------------------------------------------------------------------- GradScaler


def scaler_with_overflow_on_one_shard(kind: str, clip: bool):
    """fp16-style training with torch.amp.GradScaler; at step 2, rank 0's gradient of one element
    of one bias is inf (an overflow in one layer on one rank). Under native DDP the all_reduce
    spreads it, so every rank skips that step and halves its scale."""
    runs = {}
    for k in ("native", kind):
        rank = dist.get_rank()
        net = perturbed(build("mlp"), rank)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, eps=1e-6)
        model = wrap(k, net, opt)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
        now = {"step": 0}

        def overflow(grad):
            if now["step"] == 2 and rank == 0:
                grad = grad.clone()
                grad[0] = float("inf")
            return grad
        list(net.parameters())[-1].register_hook(overflow)  # the last layer's bias
        scales = []
        for step in range(6):
            now["step"] = step
            x, y = local_batch("mlp", step)
            scaler.scale(loss_fn("mlp", model(x), y)).backward()
            if clip:
                scaler.unscale_(opt)
                if k.startswith("zero"):
                    model.clip_grad_norm_(1.0)
                else:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        runs[k] = (whole_state(k, model, net), scales)
    ours, native = runs[kind], runs["native"]
    return {"vs_native": same(ours[0], native[0]), "scales": ours[1], "native_scales": native[1],
            "scales_agree": len({tuple(s) for s in minidist.comm.all_gather_object(ours[1])}) == 1,
            "ranks_agree": ranks_agree(ours[0])}


# --------------------------------------------------------------------------- native arguments


def attempt(fn) -> str:
    try:
        fn()
        return "accepted"
    except (TypeError, ValueError, RuntimeError) as e:
        return str(e)


def native_keyword_arguments():
    """What GPU scripts pass to DDP(...) / fully_shard(...): accepted with its meaning, or refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    n = dist.get_world_size()
    cpu = torch.device("cpu")
    DP, SDP = minidist.DataParallel, minidist.ShardedDataParallel
    opt = functools.partial(torch.optim.SGD, lr=0.1)  # a factory: called with the shards
    mlp = lambda: build("mlp")  # noqa: E731
    cases = {
        "ddp: device_ids=None, static_graph, dim, check_reduction":
            lambda: DP(mlp(), device_ids=None, output_device=None, dim=0, static_graph=True, check_reduction=False),
        "ddp: device_ids=[the module's device]": lambda: DP(mlp(), [cpu], cpu),
        "ddp: device_ids=[1]": lambda: DP(mlp(), device_ids=[1]),
        "ddp: device_ids=[cpu, cpu]": lambda: DP(mlp(), device_ids=[cpu, cpu]),
        "ddp: output_device=1": lambda: DP(mlp(), output_device=1),
        "ddp: mixed_precision": lambda: DP(mlp(), mixed_precision=object()),
        "ddp: a typo": lambda: DP(mlp(), bucket_capmb=1),
        "ddp: device_mesh (1-D)": lambda: DP(mlp(), device_mesh=init_device_mesh("cpu", (n,))),
        "zero3: mp_policy": lambda: SDP(build("gpt"), opt, stage=3, mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
        "zero3: reshard_after_forward=False": lambda: SDP(mlp(), opt, stage=3, reshard_after_forward=False),
        "zero2: reshard_after_forward=True": lambda: SDP(mlp(), opt, stage=2, reshard_after_forward=True),
        "zero3: reshard_after_forward=2": lambda: SDP(mlp(), opt, stage=3, reshard_after_forward=2),  # hpZ
        "zero3: reshard_after_forward=3": lambda: SDP(mlp(), opt, stage=3, reshard_after_forward=3),
        "zero3: reshard_after_forward='yes'": lambda: SDP(mlp(), opt, stage=3, reshard_after_forward="yes"),
        "zero3: offload_policy": lambda: SDP(mlp(), opt, stage=3, offload_policy=CPUOffloadPolicy()),
        "zero3: mesh=DeviceMesh (1-D)": lambda: SDP(mlp(), opt, stage=3, mesh=init_device_mesh("cpu", (n,))),
        "zero3: mesh=DeviceMesh (2-D)": lambda: SDP(mlp(), opt, stage=3,
                                                    mesh=init_device_mesh("cpu", (1, n), mesh_dim_names=("r", "s"))),
        "zero2: no optimizer": lambda: SDP(mlp(), stage=2),
        "zero3: no optimizer": lambda: SDP(mlp(), stage=3),
        "zero3: a typo": lambda: SDP(mlp(), opt, stage=3, min_unit_param=5),
    }
    return {name: attempt(fn) for name, fn in cases.items()}


def init_sync_false():
    """init_sync=False: the ranks already agree, so the wrapper broadcasts nothing."""
    net = perturbed(build("mlp"), dist.get_rank())
    before = {k: v.clone() for k, v in net.state_dict().items()}
    minidist.DataParallel(net, init_sync=False)
    return all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def mixed_precision_policy(stage: int):
    """FSDP2's MixedPrecisionPolicy gives what param_dtype / reduce_dtype give, outputs in its output_dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    runs = {}
    for how in ("policy", "arguments"):
        net = perturbed(build("gpt"), dist.get_rank())
        opt = user_optimizer(net)
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                output_dtype=torch.float32)} if how == "policy" else \
            {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
        model = wrap(f"zero{stage}", net, opt, **kw)
        dtypes = set()
        for step in range(3):
            x, y = local_batch("gpt", step)
            out = model(x)
            dtypes.add(out.dtype)
            loss_fn("gpt", out.float(), y).backward()
            opt.step()
            opt.zero_grad()
        runs[how] = (whole_state(f"zero{stage}", model, net), dtypes)
    return same(runs["policy"][0], runs["arguments"][0]), runs["policy"][1], runs["arguments"][1]


def reshard_after_forward_false():
    """Stage 3 keeps each unit gathered from forward to backward: one all_gather per unit and
    step instead of two, the same result bitwise, also when a forward with gradients on and no
    backward comes between backward and the step (its units are gathered again after the step)."""
    runs = {}
    for keep in (True, False):
        net = perturbed(build("gpt"), dist.get_rank())
        opt = user_optimizer(net)
        model = wrap("zero3", net, opt, reshard_after_forward=keep)
        for step in range(3):
            x, y = local_batch("gpt", step)
            with CommTracer() as tracer:
                out = model(x)
                gathered_after_forward = [u.shard.is_materialised for u in model._units]
                loss_fn("gpt", out, y).backward()
            model(x)  # a metric with gradients on, between backward and step: units stay gathered
            opt.step()  # ... holding the old values, so the step frees them
            opt.zero_grad()
        gathers = sum(1 for r in tracer.records if r.op == "all_gather")
        with torch.no_grad():  # no backward follows: freed after forward whatever the setting
            model(local_batch("gpt", 0)[0])
        inference = [u.shard.is_materialised for u in model._units]
        runs[keep] = (whole_state("zero3", model, net), gathers, gathered_after_forward, inference,
                      [u.shard.is_materialised for u in model._units])
    return {"equal": same(runs[False][0], runs[True][0]), "gathers": (runs[True][1], runs[False][1]),
            "after_forward": (runs[True][2], runs[False][2]), "after_inference": runs[False][3],
            "units": len(runs[False][2])}


# --------------------------------------------------------------------------- FSDP2's way of building models


def meta_device_is_refused():
    with torch.device("meta"):
        net = build("mlp")
    out = {"ddp": attempt(lambda: minidist.DataParallel(net))}
    for stage in (1, 2):  # (stage 3 materialises it: test_meta_init.py)
        out[f"zero{stage}"] = attempt(lambda: minidist.ShardedDataParallel(net, torch.optim.SGD(net.parameters(),
                                                                                              lr=0.1), stage=stage))
    return out


def move_or_cast_after_wrapping():
    """model.to() / .double() after wrapping: no-ops pass, real moves and casts are refused."""
    out = {}
    for stage in (2, 3):
        model = wrap(f"zero{stage}", build("mlp"), functools.partial(torch.optim.SGD, lr=0.1))
        out[f"zero{stage} .to(cpu)"] = attempt(lambda: model.to("cpu").float())
        out[f"zero{stage} .double()"] = attempt(lambda: model.double())
    return out


def default_units():
    """The default unit policy follows the repeated blocks (FSDP2's fully_shard per block), also
    when each block is small; the size rule when asked."""
    import torchvision
    from minidist.train.models import GPT
    def units(net, **kwargs):
        return minidist.ShardedDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3,
                                            **kwargs).unit_names
    small_gpt = lambda: GPT(vocab_size=64, block_size=8, n_layer=10, n_head=2, n_embd=16)  # noqa: E731
    return {"gpt": units(small_gpt()), "gpt_size_rule": units(small_gpt(), min_unit_params=100_000),
            "resnet18": units(torchvision.models.resnet18(num_classes=8))}


def stage3_state_dict_refusal():
    net = build("gpt")
    model = minidist.ShardedDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3)
    try:
        model.state_dict()
    except RuntimeError as e:
        message = str(e)
    full = model.full_state_dict()
    model.module.load_state_dict(full)  # what the message says works
    return message, list(full) == list(net.state_dict(keep_vars=True))


def data_parallel_full_optim_state():
    net = build("mlp")
    opt = torch.optim.AdamW(net.parameters())
    model = minidist.DataParallel(net)
    train_steps(model, opt, range(2), "mlp")
    full = model.full_optim_state_dict(opt)
    model.load_full_optim_state_dict(full, opt)
    return optimizer_states_equal(full, opt.state_dict()), model.full_optim_state_dict(opt, rank0_only=True) == {}

