"""A training script in the style of the FSDP2 example (pytorch/examples, distributed/FSDP2),
written here: a Transformer sharded with fully_shard per block and at the root, an optional
MixedPrecisionPolicy, torch.nn.utils.clip_grad_norm_, and a full checkpoint (DCP's state-dict
API) saved on rank 0 and loaded on restart.

    torchrun --nproc_per_node 2 tests/client_scripts/fsdp2_example.py --wrap native
    torchrun --nproc_per_node 2 tests/client_scripts/fsdp2_example.py --wrap zero3 --mixed-precision

The port to minidist (`--wrap zero3`), what differs:
- `fully_shard(layer)` per block, then `fully_shard(model)`  ->  `ShardedDataParallel(model, optim,
  stage=3)`: its units are the repeated blocks by default; `mp_policy=` is the same policy.
- the optimizer is built before wrapping (ShardedDataParallel takes it), not after.
- `get_model_state_dict` / `get_optimizer_state_dict(full_state_dict=True)` -> `model.full_state_dict()`
  / `model.full_optim_state_dict(optim)`; `set_*_state_dict` -> `model.module.load_state_dict(full)` /
  `optim.load_state_dict(full)` on every rank. Either side reads the other's files.
- meta-device construction (`--meta`): `ShardedDataParallel(stage=3)` materialises the model while
  wrapping, each block's parameters straight into its shard (each module's reset_parameters()), so the
  `to_empty()` / `reset_parameters()` after wrapping go; stages 1-2 refuse a meta-built model.
"""

import argparse
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group, is_initialized

import minidist
from wrappers import device_for


@dataclass
class ModelArgs:
    n_layers: int = 4
    vocab_size: int = 64
    max_seq_len: int = 16
    dim: int = 32
    n_heads: int = 4


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.n_heads, args.dim // args.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.size()
        q, k, v = (w(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, t, -1))

    def reset_parameters(self):
        for w in (self.wq, self.wk, self.wv, self.wo):
            w.reset_parameters()


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden_dim), nn.Linear(hidden_dim, dim)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))

    def reset_parameters(self):
        self.w1.reset_parameters()
        self.w2.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(args.dim), nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def reset_parameters(self):
        for m in (self.attention_norm, self.attention, self.ffn_norm, self.feed_forward):
            m.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.size(1), device=tokens.device))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()

    def reset_parameters(self):
        for m in (self.tok_embeddings, self.pos_embeddings, *self.layers, self.norm, self.output):
            m.reset_parameters()


def shard(how: str, model: nn.Module, optim_factory, mixed_precision: bool):
    """(the sharded model, its optimizer): the part of the script a port rewrites."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
        if mixed_precision else {}
    if how == "native":
        for layer in model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        return model, optim_factory(model.parameters())
    optim = optim_factory(model.parameters())  # built before wrapping: minidist shards it
    return minidist.ShardedDataParallel(model, optim, stage=int(how[-1]), **kwargs), optim


def save(how: str, model, optim, path: str) -> None:
    if how == "native":
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(model, options=options)
        optim_sd = get_optimizer_state_dict(model, optim, options=options)
    else:
        model_sd, optim_sd = model.full_state_dict(rank0_only=True), model.full_optim_state_dict(optim, rank0_only=True)
    if torch.distributed.get_rank() == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, path)


def load(how: str, model, optim, path: str) -> None:
    full = torch.load(path, map_location="cpu", weights_only=True)
    if how == "native":
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, full["model"], options=options)
        set_optimizer_state_dict(model, optim, full["optim"], options=options)
    else:
        model.module.load_state_dict(full["model"])
        optim.load_state_dict(full["optim"])


def main(how: str, steps: int, checkpoint: str | None = None, resume: str | None = None,
         mixed_precision: bool = False, meta: bool = False, first_step: int = 0) -> dict:
    """Train steps first_step .. first_step + steps - 1 (after loading `resume`, if given), save to
    `checkpoint`; return this rank's full final state_dict."""
    if not is_initialized():
        init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    device = device_for(int(os.environ.get("LOCAL_RANK", torch.distributed.get_rank())))
    torch.manual_seed(0)
    args = ModelArgs()
    with torch.device("meta" if meta else device):
        model = Transformer(args)
    model, optim = shard(how, model, lambda params: torch.optim.Adam(params, lr=1e-2), mixed_precision)
    if meta and how == "native":  # (ours: initialised while wrapping)
        model.to_empty(device=device)
        model.reset_parameters()
    if resume:
        load(how, model, optim, resume)
    for step in range(first_step, first_step + steps):
        g = torch.Generator().manual_seed(1000 * torch.distributed.get_rank() + step)
        x = torch.randint(0, args.vocab_size, (4, args.max_seq_len + 1), generator=g).to(device)
        loss = F.cross_entropy(model(x[:, :-1]).view(-1, args.vocab_size), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
    if checkpoint:
        save(how, model, optim, checkpoint)
    if how == "native":
        state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    else:
        state = model.full_state_dict()
    return {k: v.detach().cpu().clone() for k, v in state.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="FSDP2-style example")
    parser.add_argument("--wrap", default="native", help="native (fully_shard) | zero1 | zero2 | zero3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--first-step", type=int, default=0)
    parser.add_argument("--checkpoint", default="checkpoint.pt")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--mixed-precision", action="store_true")
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--out", default=None, help="save the final parameters here (rank 0)")
    a = parser.parse_args()
    final = main(a.wrap, a.steps, a.checkpoint, a.resume, a.mixed_precision, a.meta, a.first_step)
    if a.out and torch.distributed.get_rank() == 0:
        torch.save(final, a.out)
    destroy_process_group()
