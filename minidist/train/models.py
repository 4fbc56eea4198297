"""Small reference models used by tests, benchmarks and the trainer.

- MLP: the simplest thing with several layers.
- GPT: a GPT-2-style decoder (pre-norm blocks, causal self-attention, tied
  token embedding and output head) — the transformer every strategy is tested on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, sizes=(32, 64, 64, 10)):
        super().__init__()
        layers = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b), nn.GELU()]
        self.net = nn.Sequential(*layers[:-1])  # no activation after the last layer

    def forward(self, x):
        return self.net(x)


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    tie_weights: bool = True
    # No bias on q/k/v: the key bias gets an exactly-zero gradient (softmax ignores a shift
    # shared by all keys), and Adam would turn its rounding noise into full-size updates.
    qkv_bias: bool = False
    # Dropout on the embeddings and on each residual branch (attention, MLP), as in GPT-2; 0 adds
    # no op at all, so results and random streams stay those of the model without it.
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(x, p, training) if p > 0 else x


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.p = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x):
        x = x + dropout(self.attn(self.ln1(x)), self.p, self.training)
        return x + dropout(self.mlp(self.ln2(x)), self.p, self.training)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None, **overrides):
        super().__init__()
        cfg = cfg or GPTConfig(**overrides)
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight  # one tensor, two uses
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        T = idx.shape[1]
        x = dropout(self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device)), self.cfg.dropout,
                    self.training)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @staticmethod
    def loss(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- built from a config


def resnet18_small(num_classes: int, channels: int = 3) -> nn.Module:
    """torchvision's resnet18 for 32x32 inputs: a 3x3 stride-1 stem and no max-pool, as is
    usual for CIFAR (the ImageNet stem would shrink 32x32 to 8x8 before the first block)."""
    import torchvision

    net = torchvision.models.resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


class ImageMLP(nn.Module):
    """Flatten an image, then the MLP."""

    def __init__(self, in_features: int, hidden: list[int], classes: int):
        super().__init__()
        self.mlp = MLP((in_features, *hidden, classes))

    def forward(self, x):
        return self.mlp(x.flatten(1))


def _gpt(model_cfg, info) -> nn.Module:
    return GPT(vocab_size=info.vocab_size, block_size=int(model_cfg.block_size), n_layer=int(model_cfg.n_layer),
               n_head=int(model_cfg.n_head), n_embd=int(model_cfg.n_embd), tie_weights=bool(model_cfg.tie_weights),
               dropout=float(model_cfg.dropout))


def _resnet18(model_cfg, info) -> nn.Module:
    return resnet18_small(info.num_classes, info.channels)


def _mlp(model_cfg, info) -> nn.Module:
    return ImageMLP(info.channels * info.image_size ** 2, list(model_cfg.hidden), info.num_classes)


# model.name -> (the kind of data it takes, its builder(model_cfg, data info)): one entry per model.
MODELS = {"gpt": ("text", _gpt), "resnet18": ("image", _resnet18), "mlp": ("image", _mlp)}


def build_model(model_cfg, info) -> nn.Module:
    """The model `model_cfg.name` names, sized for the data described by `info` (a DataInfo).

    Raises ValueError when the model is unknown or cannot take that data (config_check turns
    both into a ConfigError naming the keys first).
    """
    name = model_cfg.name
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose one of {list(MODELS)}")
    kind, build = MODELS[name]
    if info.kind != kind:
        raise ValueError(f"{name} takes {kind} data, not {info.kind}")
    return build(model_cfg, info)


def gpt_flops_per_token(model: GPT) -> float:
    """Training FLOPs per token (forward + backward): 6 per parameter plus attention's
    12 * layers * embedding * context (the PaLM appendix estimate nanoGPT uses)."""
    cfg = model.cfg
    n_params = count_parameters(model) - model.pos_emb.weight.numel()
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
