"""The drop-in matrix: strategies x idioms a PyTorch user writes, each compared with native DDP.

Every cell trains the same model from the same weights on the same batches, written the way a
user writes the loop with native DDP (torch.compile, torch.nn.utils, `state_dict()`, ...), and
ends in one of two ways:

- "equal": the whole state_dict (buffers included) on this rank is within 1e-6 of native DDP's
  on this rank (ddp_cases.max_rel_diff; most cells are bitwise);
- "refused": the loop raised, and the message names the supported way (REFUSALS).

Anything else — a difference, or an error that names nothing — fails the test. Native DDP runs
the same idiom in the same process: once per idiom and model (REFERENCES), every strategy's cell
compared with it; a compiled idiom's just before each cell (which is also what exposes a compiled
graph cached for another instance of the model's class).
"""

from __future__ import annotations

import collections
import functools
import io
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import minidist
from ddp_cases import max_rel_diff

STEPS = 3
PER_RANK = 4
# eps=1e-6 as in the other suites: with 1e-8, Adam turns the reduction-order rounding of a
# near-zero gradient into a full +-lr step, and even native DDP drifts from one process.
ADAMW = {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.1}
# resnet18 trains with SGD-momentum: ZeRO's global norm sums squares shard by shard (not bitwise
# torch's norm of per-tensor norms), and Adam through 20 BatchNorms turns that last-bit difference
# into 2.6e-3 in 3 steps (measured); SGD keeps it at the last bits, as the other suites do for CNNs.
SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}


def optimizer_for(model: str):
    return (torch.optim.SGD, SGD) if model == "resnet18" else (torch.optim.AdamW, ADAMW)
CLIP = 0.05  # small enough that clipping changes every step
Pair = collections.namedtuple("Pair", "logits hidden")

# (idiom or model, strategy family) -> a phrase the error must contain: the supported way it names.
REFUSALS = {
    ("state_dict", "stage3"): "full_state_dict",
    ("grad_penalty", "stage3"): "create_graph",
    # unused on every rank at some steps: native's optimizer skips it, a flat shard cannot
    ("unused", "sharded"): "requires_grad=False",
    # used on some ranks only: stage 3's reduce order would differ across ranks (as FSDP2's)
    ("unused_on_one_rank", "stage3"): "find_unused_parameters",
}


class Net(nn.Module):
    """A residual MLP whose variants are the idioms' models: dict / namedtuple outputs, a block
    under activation checkpointing, a branch used on some steps, a frozen layer, BatchNorm."""

    def __init__(self, variant: str = "plain"):
        super().__init__()
        self.variant = variant
        self.inp = nn.Linear(16, 32, bias=variant != "batchnorm")  # no bias before BatchNorm, as usual
        self.norm = nn.BatchNorm1d(32) if variant == "batchnorm" else nn.Identity()
        self.mid = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.branch = nn.Linear(32, 32)
        self.out = nn.Linear(32, 8)
        if variant == "frozen":
            self.inp.requires_grad_(False)

    def forward(self, x, use_branch: bool = True):
        h = F.relu(self.norm(self.inp(x)))
        if self.variant == "checkpoint":
            h = h + checkpoint(self.mid, h, use_reentrant=False)
        else:
            h = h + self.mid(h)
        if not self.variant.startswith("unused") or use_branch:
            h = h + self.branch(h)
        logits = self.out(h)
        if self.variant == "dict":
            return {"logits": logits, "hidden": h}
        if self.variant == "namedtuple":
            return Pair(logits, h)
        return logits


def build(model: str) -> nn.Module:
    torch.manual_seed(0)
    if model == "gpt":  # tied embedding and head
        from minidist.train.models import GPT
        return GPT(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32)
    if model == "resnet18":  # torchvision's: BatchNorm everywhere, not written by us
        import torchvision
        return torchvision.models.resnet18(num_classes=8)
    if model == "hf_gpt2":  # Hugging Face's: tied head, dropout, a ModelOutput (a dict) as output
        from transformers import GPT2Config, GPT2LMHeadModel
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                          bos_token_id=0, eos_token_id=0))
    return Net(model)


def batch(model: str, step: int, rank: int, n: int):
    g = torch.Generator().manual_seed(step)
    rows = PER_RANK * n
    if model in ("gpt", "hf_gpt2"):
        x = torch.randint(0, 64, (rows, 8), generator=g)
        y = torch.roll(x, -1, dims=1)
    elif model == "resnet18":
        x, y = torch.randn(rows, 3, 16, 16, generator=g), torch.randint(0, 8, (rows,), generator=g)
    else:
        x, y = torch.randn(rows, 16, generator=g), torch.randint(0, 8, (rows,), generator=g)
    part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return x[part], y[part]


def logits_of(out):
    return out["logits"] if isinstance(out, dict) else out.logits if isinstance(out, Pair) else out


def loss_of(out, y):
    out = logits_of(out)
    return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


def family(strategy: str) -> set[str]:
    """Which REFUSALS apply: "sharded" for our ZeRO strategies, "stage3" for ours at stage 3."""
    from minidist.train.strategies import spec

    s, out = spec(strategy), set()
    if s.kind == "minidist" and s.zero_stage >= 1:
        out.add("sharded")
    if s.kind == "minidist" and s.zero_stage == 3:
        out.add("stage3")
    return out


def wrap(strategy: str, net: nn.Module, unused: bool, model_name: str):
    """(the model to call, the optimizer, how the loop clips) for `strategy`, as a user writes it."""
    opt_class, opt_kwargs = optimizer_for(model_name)
    opt_factory = functools.partial(opt_class, **opt_kwargs)

    def torch_clip():  # the parameters as they are once wrapped (fully_shard makes them DTensors)
        torch.nn.utils.clip_grad_norm_(list(net.parameters()), CLIP)
    if strategy == "native_ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(net, find_unused_parameters=unused)
        return model, opt_factory(net.parameters()), torch_clip
    if strategy == "native_zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(net, find_unused_parameters=unused)
        return model, ZeroRedundancyOptimizer(net.parameters(), optimizer_class=opt_class, **opt_kwargs), torch_clip
    if strategy == "native_fsdp":
        from torch.distributed.fsdp import fully_shard
        plain = getattr(net, "_orig_mod", net)
        with torch.no_grad():  # fully_shard does not broadcast: start from rank 0's weights
            for t in list(plain.parameters()) + list(plain.buffers()):
                dist.broadcast(t, src=0)
        from minidist.parallel.zero3 import plan_units
        trainable = [p for p in plain.parameters() if p.requires_grad]
        for _, unit in plan_units(plain, trainable, None, 100):  # the units zero3 picks (ties stay in the root)
            fully_shard(unit)
        fully_shard(plain)
        return net, opt_factory(net.parameters()), torch_clip
    if strategy == "ddp":
        model = minidist.DataParallel(net, bucket_cap_mb=0.001, find_unused_parameters=unused)
        return model, opt_factory(net.parameters()), torch_clip
    from minidist.train.strategies import spec

    stage = spec(strategy).zero_stage
    kwargs = {"min_unit_params": 100} if stage == 3 else {"bucket_cap_mb": 0.001}  # several units / buckets
    # Stage 3 refuses find_unused_parameters=True; with False, a parameter no rank used raises when
    # backward ends (the runtime check). Stages 1-2 take it, and then refuse only what no rank used.
    kwargs["find_unused_parameters"] = unused and not (stage == 3 and model_name == "unused")
    if spec(strategy).hybrid:  # 2 replicas: the replica path runs
        kwargs["mesh"] = minidist.init_mesh(replicate=2, shard=dist.get_world_size() // 2, env={})
    model = minidist.ShardedDataParallel(net, opt_factory, stage=stage, **kwargs)
    return model, model.optimizer, functools.partial(model.clip_grad_norm_, CLIP)


def train(strategy: str, idiom: str, model_name: str) -> dict:
    """STEPS steps of `idiom`; this rank's whole state_dict at the end."""
    rank, n = dist.get_rank(), dist.get_world_size()
    net = build(model_name)
    if rank > 0:  # the wrappers' broadcast from rank 0 is exercised
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    plain = net
    if idiom == "compile_inner":
        net = torch.compile(net, backend=COMPILE_BACKEND)
    model, opt, clip = wrap(strategy, net, model_name.startswith("unused"), model_name)
    if idiom == "torch_clip":
        clip = functools.partial(torch.nn.utils.clip_grad_norm_, list(net.parameters()), CLIP)
    forward = torch.compile(model, backend=COMPILE_BACKEND) if idiom == "compile_outer" else model
    saved, initial = None, None
    for step in range(STEPS):
        x, y = batch(model_name, step, rank, n)
        kwargs = {}
        if model_name == "unused":  # the branch is skipped at odd steps, on every rank
            kwargs = {"use_branch": step % 2 == 0}
        if model_name == "unused_on_one_rank":  # ... on rank 1 only
            kwargs = {"use_branch": step % 2 == 0 or rank != 1}
        if idiom == "grad_penalty":
            x.requires_grad_(True)
            loss = loss_of(forward(x, **kwargs), y)
            (g,) = torch.autograd.grad(loss, x, create_graph=True)
            (loss + 0.1 * g.pow(2).sum()).backward()
        elif idiom in ("toggle", "fsdp_toggle"):  # nanoGPT's accumulation: switched by assignment, or FSDP2's call
            for micro in range(PER_RANK):
                sync = micro == PER_RANK - 1
                if idiom == "fsdp_toggle" and hasattr(model, "set_requires_gradient_sync"):
                    model.set_requires_gradient_sync(sync)
                else:  # native DDP's attribute (what its no_sync() sets)
                    model.require_backward_grad_sync = sync
                (loss_of(forward(x[micro:micro + 1], **kwargs), y[micro:micro + 1]) / PER_RANK).backward()
        elif idiom == "two_forwards":
            half = PER_RANK // 2
            (loss_of(forward(x[:half]), y[:half]) + loss_of(forward(x[half:]), y[half:])).backward()
        else:
            loss_of(forward(x, **kwargs), y).backward()
        if idiom == "grad_norm_log":  # a user logging the gradient norm by hand
            norm = torch.stack([p.grad.norm() for p in net.parameters() if p.grad is not None]).norm()
            assert torch.isfinite(norm)
        clip()
        opt.step()
        opt.zero_grad()
        if idiom == "inference_between":
            with torch.no_grad():
                forward(batch(model_name, 100 + step, rank, n)[0])
        if idiom == "eval_between":
            model.eval()
            with torch.no_grad():
                forward(batch(model_name, 100 + step, rank, n)[0])
            model.train()
        if idiom == "state_dict":  # right after the step, saved and loaded into a plain module
            buffer = io.BytesIO()
            torch.save(getattr(model, "module", model).state_dict(), buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=True)
        if idiom == "load_state_dict":  # back to the weights after step 0, then on
            if step == 0:
                initial = {k: v.detach().clone() for k, v in full_state(strategy, model, plain).items()}
            if step == 1:
                getattr(model, "module", model).load_state_dict(initial)
    if saved is not None:
        probe = build(model_name)
        probe.load_state_dict(saved)
        return {k: v.detach().clone() for k, v in probe.state_dict().items()}
    return full_state(strategy, model, plain)


def full_state(strategy: str, model, plain: nn.Module) -> dict:
    """This rank's whole state_dict as a plain module would hold it (a collective for ZeRO)."""
    if hasattr(model, "full_state_dict") and "sharded" in family(strategy):
        state = model.full_state_dict()
    else:
        state = plain.state_dict()
    return {k.replace("_orig_mod.", ""): (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in state.items()}


COMPILE_BACKEND = "aot_eager"


# Native DDP's result for each (idiom, model, backend), kept in the rank process: the pool runs the
# strategies' cells one test after another, and the reference of a cell is the same for all of them.
REFERENCES: dict[tuple[str, str, str], dict] = {}


def reference(idiom: str, model_name: str, backend: str) -> dict:
    key = (idiom, model_name, backend)
    if key not in REFERENCES:
        REFERENCES[key] = train("native_ddp", idiom, model_name)
    return REFERENCES[key]


def cell(strategy: str, idiom: str, model_name: str, backend: str) -> tuple[str, str]:
    """("equal", how close) or ("refused", the message) or ("differs" / "error", what) for one cell."""
    global COMPILE_BACKEND
    COMPILE_BACKEND = backend
    if idiom.startswith("compile"):  # the reference's graphs are to be in the cache, as in a user's process
        REFERENCES.pop((idiom, model_name, backend), None)
    reference_state = reference(idiom, model_name, backend)
    try:
        ours = train(strategy, idiom, model_name)
    except Exception as e:  # noqa: BLE001 - the cell's outcome is judged by the test
        message = str(e)
        wanted = [REFUSALS[(k, f)] for k in (idiom, model_name) for f in family(strategy) if (k, f) in REFUSALS]
        if wanted and all(w in message for w in wanted):
            return "refused", message.splitlines()[0][:200]
        return "error", traceback.format_exc()[-2500:]
    finally:
        torch._dynamo.reset()  # each cell compiles afresh (the reference's graphs were still reused above)
    if list(ours) != list(reference_state):
        return "differs", f"keys {list(ours)[:4]}... vs native {list(reference_state)[:4]}..."
    worst, where = max_rel_diff(ours, reference_state)
    # resnet18: 20 BatchNorms carry the clip norm's last-bit difference (see SGD) into the running
    # variances; native fully_shard is itself 1.2e-6 from native DDP there (measured).
    tolerance = 1e-5 if model_name == "resnet18" else 1e-6
    return ("equal" if worst <= tolerance else "differs"), f"{worst:.1e} at {where}"


def matrix(cells: list[tuple[str, str, str]], backend: str = "aot_eager") -> dict:
    """Run `cells` [(strategy, idiom, model)] on this rank; {cell: (outcome, detail)}."""
    return {c: cell(*c, backend) for c in cells}


def expected(strategy: str, idiom: str, model: str) -> str:
    return "refused" if any((k, f) in REFUSALS for k in (idiom, model) for f in family(strategy)) else "equal"

