"""A training script in the style of nanoGPT's train.py (karpathy/nanoGPT), written here: a GPT with
a tied head and F.scaled_dot_product_attention, AdamW with decay / no-decay param groups by
dimension, gradient accumulation that switches DDP's synchronisation by assignment
(`model.require_backward_grad_sync = ...`), torch.amp.GradScaler, torch's clip_grad_norm_, the
evaluation on rank 0 only (`estimate_loss`, through the wrapper), rank-0 checkpoints of
`raw_model.state_dict()` and `optimizer.state_dict()`, `init_from="resume"` loading both before
wrapping, and torch.compile before wrapping.

    torchrun --nproc_per_node 2 tests/client_scripts/nanogpt.py --max_iters 6 --wrap native
    torchrun --nproc_per_node 2 tests/client_scripts/nanogpt.py --max_iters 6 --wrap ddp

`--wrap ddp` changes only the import (wrappers.py). The ZeRO ports (`--wrap zero1/2/3`) differ in
two places, each refused by name if left as written: the checkpoint gathers the optimizer's shards
on every rank (`checkpoint_states`), and at stage 3 the evaluation runs on every rank
(`evaluates_on_every_rank`), since each forward gathers parameters from every rank.
"""

import argparse
import math
import os

import torch
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group, is_initialized
from torch.nn import functional as F

import minidist
from wrappers import device_for, wrap

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
        "in want of a wife. However little known the feelings or views of such a man may be on his first "
        "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families.").encode()


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # nanoGPT's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) if targets is not None else None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def get_batch(split: str, it: int, micro: int, rank: int, batch_size: int, block_size: int, device):
    """Random windows of the text, drawn from a generator seeded by where they are used, so that a
    resumed run draws what the unbroken one drew (nanoGPT draws from the global RNG instead)."""
    data = torch.tensor(list(TEXT[:160] if split == "train" else TEXT[160:]), dtype=torch.long)
    g = torch.Generator().manual_seed(((it * 1000 + micro) * 64 + rank) * 2 + (split == "val"))
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=g)
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


def checkpoint_states(model, raw_model, optimizer) -> tuple[dict, dict]:
    """(model state, optimizer state) for rank 0's checkpoint; called on every rank (the ZeRO port:
    the shards are gathered, a collective). nanoGPT as written: rank 0's raw_model and optimizer."""
    if isinstance(model, minidist.ShardedDataParallel):
        return model.full_state_dict(rank0_only=True), model.full_optim_state_dict(rank0_only=True)
    return raw_model.state_dict(), optimizer.state_dict()


def evaluates_on_every_rank(model) -> bool:
    """At stage 3 a forward gathers every unit from every rank: the evaluation runs on every rank."""
    return isinstance(model, minidist.ShardedDataParallel) and model.stage == 3


def main(how: str, out_dir: str, max_iters: int = 6, init_from: str = "scratch", compile: bool = False,
         compile_backend: str = "inductor", gradient_accumulation_steps: int = 8, eval_interval: int = 3,
         eval_iters: int = 2, batch_size: int = 2, grad_clip: float = 1.0, checkpoint: bool = True) -> dict:
    """Train; return this rank's final weights, full optimizer state and every loss it computed."""
    if not is_initialized():
        init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    master_process = rank == 0
    if master_process:
        os.makedirs(out_dir, exist_ok=True)
    device = device_for(int(os.environ.get("LOCAL_RANK", rank)))
    gradient_accumulation_steps //= world
    torch.manual_seed(1337)
    learning_rate, min_lr, warmup_iters, lr_decay_iters = 6e-3, 6e-4, 2, max(max_iters, 3)

    iter_num, best_val_loss = 0, 1e9
    model = GPT()
    checkpoint_path = os.path.join(out_dir, f"{how}_ckpt.pt")
    if init_from == "resume":
        ckpt = torch.load(checkpoint_path, map_location=device, weights_only=True)
        state_dict = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
        model.load_state_dict(state_dict)
        iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
    model.to(device)
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # nanoGPT: enabled for float16 only
    optimizer = model.configure_optimizers(0.1, learning_rate, (0.9, 0.95))
    if init_from == "resume":
        optimizer.load_state_dict(ckpt["optimizer"])
        ckpt = None
    raw_model = model
    if compile:
        model = torch.compile(model, backend=compile_backend)
    model = wrap(how, model, optimizer, rank)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                X, Y = get_batch(split, iter_num, 100 + k, 0, batch_size, raw_model.block_size, device)
                _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    def get_lr(it):
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(decay_ratio, 1.0))) * (learning_rate - min_lr)

    seen = {"train": [], "eval": []}
    X, Y = get_batch("train", iter_num, 0, rank, batch_size, raw_model.block_size, device)
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % eval_interval == 0 and (master_process or evaluates_on_every_rank(model)):
            losses = estimate_loss()
            seen["eval"].append((iter_num, losses["train"], losses["val"]))
            best_val_loss = min(best_val_loss, losses["val"])
        if iter_num % eval_interval == 0 and iter_num > 0 and checkpoint:
            model_state, optimizer_state = checkpoint_states(model, raw_model, optimizer)
            if master_process:
                torch.save({"model": model_state, "optimizer": optimizer_state, "iter_num": iter_num,
                            "best_val_loss": best_val_loss}, checkpoint_path)
        if iter_num == max_iters:
            break
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
            _, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            seen["train"].append(loss.item())
            X, Y = get_batch("train", iter_num + (micro_step + 1) // gradient_accumulation_steps,
                             (micro_step + 1) % gradient_accumulation_steps, rank, batch_size, raw_model.block_size,
                             device)
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
    model_state, optimizer_state = checkpoint_states(model, raw_model, optimizer)
    if isinstance(model, minidist.ShardedDataParallel):  # every rank's view, for the comparison
        model_state, optimizer_state = model.full_state_dict(), model.full_optim_state_dict()
    return {"model": {k.removeprefix("_orig_mod."): v.detach().clone() for k, v in model_state.items()},
            "optimizer": optimizer_state, "losses": seen}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="nanoGPT-style training")
    parser.add_argument("--wrap", default="native", help="native | ddp | zero1 | zero2 | zero3")
    parser.add_argument("--out_dir", default=".")
    parser.add_argument("--max_iters", type=int, default=6)
    parser.add_argument("--init_from", default="scratch", help="scratch | resume")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    main(args.wrap, args.out_dir, args.max_iters, args.init_from, args.compile)
    destroy_process_group()
