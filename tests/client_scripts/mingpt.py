"""A training script in the style of minGPT-ddp (pytorch/examples, distributed/minGPT-ddp), written
here: a character-level GPT on torch's nn.MultiheadAttention, an optimizer with decay / no-decay
param groups, fp16 autocast with torch.amp.GradScaler, torch.nn.utils.clip_grad_norm_, and
snapshots (model, optimizer, epoch) that a restarted run resumes from, loaded before wrapping.

    torchrun --nproc_per_node 2 tests/client_scripts/mingpt.py --epochs 2 --wrap native
    torchrun --nproc_per_node 2 tests/client_scripts/mingpt.py --epochs 2 --wrap zero2

The ports: `--wrap ddp` changes only the import. `--wrap zero1/2/3` passes the optimizer to
ShardedDataParallel, and the snapshot gathers the sharded state on every rank
(`snapshot_states`, the one function that differs): rank 0 alone calling
optimizer.state_dict() would save its own shard only (refused when another rank loads it).
GradScaler and torch.nn.utils.clip_grad_norm_ run unchanged.
"""

import argparse
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group, is_initialized
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import minidist
from wrappers import device_for, wrap

TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First Citizen: You are all "
        "resolved rather to die than to famish? All: Resolved. resolved.")


@dataclass
class GPTConfig:
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    vocab_size: int = 0
    block_size: int = 16
    pdrop: float = 0.0  # minGPT's dropouts; 0 here so that a resumed run can equal an unbroken one


class CharDataset(Dataset):
    def __init__(self, text: str, block_size: int):
        chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size, self.block_size = len(chars), block_size
        self.data = text

    def __len__(self):
        return len(self.data) - self.block_size

    def __getitem__(self, idx):
        chunk = [self.stoi[c] for c in self.data[idx:idx + self.block_size + 1]]
        return torch.tensor(chunk[:-1]), torch.tensor(chunk[1:])


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(config.n_embd), nn.LayerNorm(config.n_embd)
        self.attn = nn.MultiheadAttention(config.n_embd, config.n_head, dropout=config.pdrop, batch_first=True)
        self.register_buffer("mask", torch.triu(torch.ones(config.block_size, config.block_size), 1).bool())
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd), nn.Dropout(config.pdrop))

    def forward(self, x):
        t = x.size(1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Parameter(torch.zeros(1, config.block_size, config.n_embd))
        self.blocks = nn.Sequential(*[Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        x = self.tok_emb(idx) + self.pos_emb[:, :idx.size(1)]
        logits = self.head(self.ln_f(self.blocks(x)))
        loss = None if targets is None else F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def create_optimizer(model: nn.Module, lr: float = 3e-3, weight_decay: float = 0.1):
    """minGPT's split: Linear and attention projection weights decay; biases, LayerNorm and
    Embedding weights and the positional embedding do not."""
    decay, no_decay = set(), set()
    for mn, m in model.named_modules():
        for pn, _ in m.named_parameters(recurse=False):
            fpn = f"{mn}.{pn}" if mn else pn
            if pn.endswith("bias") or pn == "pos_emb" or isinstance(m, (nn.LayerNorm, nn.Embedding)):
                no_decay.add(fpn)
            else:
                decay.add(fpn)
    params = dict(model.named_parameters())
    groups = [{"params": [params[n] for n in sorted(decay)], "weight_decay": weight_decay},
              {"params": [params[n] for n in sorted(no_decay)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


@dataclass
class Snapshot:
    model_state: dict
    optimizer_state: dict
    finished_epoch: int


def snapshot_states(model, optimizer) -> tuple[dict, dict]:
    """(model state, optimizer state) for the snapshot; called on every rank, rank 0 saves them."""
    if not isinstance(model, minidist.ShardedDataParallel):  # native DDP, or minidist.DataParallel
        return model.module.state_dict(), optimizer.state_dict()
    return model.full_state_dict(rank0_only=True), model.full_optim_state_dict(optimizer, rank0_only=True)


class Trainer:
    def __init__(self, model, optimizer, train_dataset, how: str, epochs: int, snapshot_path: str,
                 use_amp: bool = True, grad_norm_clip: float = 1.0, batch_size: int = 8):
        self.local_rank = int(os.environ.get("LOCAL_RANK", torch.distributed.get_rank()))
        self.global_rank = torch.distributed.get_rank()
        self.device = device_for(self.local_rank)
        self.train_loader = DataLoader(train_dataset, batch_size=batch_size, shuffle=False,
                                       sampler=DistributedSampler(train_dataset))
        self.epochs, self.epochs_run = epochs, 0
        self.model = model.to(self.device)
        self.optimizer = optimizer
        self.use_amp, self.grad_norm_clip = use_amp, grad_norm_clip
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=use_amp)
        self.snapshot_path = snapshot_path
        self._load_snapshot()
        self.model = wrap(how, self.model, self.optimizer, self.local_rank)  # the one line a port changes

    def _load_snapshot(self):
        if not os.path.exists(self.snapshot_path):
            return
        snapshot = Snapshot(**torch.load(self.snapshot_path, map_location="cpu", weights_only=True))
        self.model.load_state_dict(snapshot.model_state)
        self.optimizer.load_state_dict(snapshot.optimizer_state)
        self.epochs_run = snapshot.finished_epoch

    def _run_batch(self, source, targets) -> float:
        with torch.amp.autocast(device_type=self.device.type, dtype=torch.float16, enabled=self.use_amp):
            _, loss = self.model(source, targets)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_norm_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.item()

    def _run_epoch(self, epoch: int):
        self.train_loader.sampler.set_epoch(epoch)
        for source, targets in self.train_loader:
            self._run_batch(source.to(self.device), targets.to(self.device))

    def _save_snapshot(self, epoch: int):
        model_state, optimizer_state = snapshot_states(self.model, self.optimizer)
        if self.global_rank == 0:
            torch.save(asdict(Snapshot(model_state, optimizer_state, epoch)), self.snapshot_path)

    def train(self):
        for epoch in range(self.epochs_run, self.epochs):
            epoch += 1
            self._run_epoch(epoch)
            self._save_snapshot(epoch)


def main(epochs: int, how: str, snapshot_path: str, use_amp: bool = True, grad_norm_clip: float = 1.0) -> dict:
    """Train; return this rank's final parameters and the scaler's scale."""
    if not is_initialized():
        init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    cfg = GPTConfig()
    dataset = CharDataset(TEXT, cfg.block_size)
    cfg.vocab_size = dataset.vocab_size
    model = GPT(cfg)
    optimizer = create_optimizer(model)
    trainer = Trainer(model, optimizer, dataset, how, epochs, snapshot_path, use_amp=use_amp,
                      grad_norm_clip=grad_norm_clip)
    trainer.train()
    state = trainer.model.full_state_dict() if how.startswith("zero") else model.state_dict()
    return {"model": {k: v.detach().cpu().clone() for k, v in state.items()}, "scale": trainer.scaler.get_scale()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="minGPT-style training")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--wrap", default="native", help="native | ddp | zero1 | zero2 | zero3")
    parser.add_argument("--snapshot", default="snapshot.pt")
    parser.add_argument("--out", default=None, help="save the final parameters here (rank 0)")
    args = parser.parse_args()
    final = main(args.epochs, args.wrap, args.snapshot)
    if args.out and torch.distributed.get_rank() == 0:
        torch.save(final["model"], args.out)
    destroy_process_group()
