"""Muon under ZeRO: each hidden weight matrix owned whole by one rank, beside AdamW's flat shards.

The recipe Muon's users write: Muon over the 2-D weights inside the transformer blocks, AdamW over
the embeddings, norms and biases, two optimizers stepping in turn. ShardedDataParallel(net, [muon,
adamw], stage=k) against native DDP with the same two optimizers (ddp_cases' set-up: rank r trains
on slice r of one global batch, ranks > 0 start perturbed).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import minidist
from ddp_cases import PER_RANK_BATCH, build, global_batch, loss_fn, max_rel_diff, perturbed

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")

STAGE_KW = {1: {"bucket_cap_mb": 0.02}, 2: {"bucket_cap_mb": 0.02}, 3: {"min_unit_params": 1000}}


@minidist.parallel.register_whole_parameter_optimizer
class NormalisedSGD(torch.optim.Optimizer):
    """A matrix optimizer as a user writes one: momentum SGD whose step is each matrix's momentum
    over its Frobenius norm, so it needs the whole matrix; in fp32 throughout (torch's Muon
    orthogonalises in bf16)."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.mul_(group["momentum"]).add_(p.grad)
                    p.add_(buf / (buf.norm() + 1e-8), alpha=-group["lr"])


def muon_and_adamw(net, matrix_optimizer=None):
    """Muon (or `matrix_optimizer`) for the blocks' weight matrices, AdamW (with its own lr) for the rest."""
    hidden = [p for n, p in net.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    rest = [p for n, p in net.named_parameters() if not (n.startswith("blocks.") and p.dim() == 2)]
    matrices = matrix_optimizer(hidden) if matrix_optimizer else torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01)
    return [matrices, torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.1, eps=1e-6)]


def train(model, optimizers, steps: int, rank: int, n: int, clip: float | None = 1.0):
    for step in range(steps):
        x, y = global_batch("gpt", step, 0, n)
        x, y = x[rank * PER_RANK_BATCH:(rank + 1) * PER_RANK_BATCH], y[rank * PER_RANK_BATCH:(rank + 1) * PER_RANK_BATCH]
        loss_fn("gpt", model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def against_ddp(stage: int, mesh_shard: int | None = None, steps: int = 6, muon: bool = True):
    """Ours and native DDP, the same two optimizers (Muon, else NormalisedSGD, and AdamW): the max
    relative difference of the final states, of all of them and of AdamW's parameters."""
    matrix_optimizer = None if muon else NormalisedSGD
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, n = dist.get_rank(), dist.get_world_size()
    base = build("gpt")
    net = perturbed(base, rank)
    kw = dict(STAGE_KW[stage])
    if mesh_shard is not None:
        kw["mesh"] = minidist.init_mesh(shard=mesh_shard)
    model = minidist.ShardedDataParallel(net, muon_and_adamw(net, matrix_optimizer), stage=stage, **kw)
    train(model, model.optimizers, steps, rank, n)
    ref_net = perturbed(base, rank)
    ref = DDP(ref_net)
    train(ref, muon_and_adamw(ref_net, matrix_optimizer), steps, rank, n)
    ours, theirs = model.full_state_dict(), ref_net.state_dict()
    hidden = {k for k, v in theirs.items() if k.startswith("blocks.") and v.dim() == 2}
    return (max_rel_diff(ours, theirs), max_rel_diff({k: ours[k] for k in theirs if k not in hidden},
                                                     {k: v for k, v in theirs.items() if k not in hidden}))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_muon_and_adamw_under_zero_equal_native_ddp_bitwise_at_2_ranks(ranks, stage):
    for (rel, where), _ in ranks(2).run(against_ddp, stage):
        assert rel == 0.0, (rel, where)


@pytest.mark.parametrize("world_size, stage, mesh_shard", [(3, 2, None), (4, 3, None), (4, 2, 2), (4, 3, 2)])
def test_whole_matrix_optimizers_at_3_and_4_ranks_and_on_a_mesh(ranks, world_size, stage, mesh_shard):
    """At 3-4 ranks gloo's all_reduce and our reduce_scatter sum in other orders (an ulp apart), and
    torch's Muon orthogonalises in bf16, where an ulp can move a rounding: its run stays within 1e-2
    of native DDP's (a wrong owner or a cut matrix is off by far more). A whole-matrix optimizer
    computed in fp32 (NormalisedSGD, registered as a user's) equals it within 1e-6 (ddp_cases'
    measure), as AdamW beside it. On a 2x2 mesh (hybrid sharding) too."""
    if mesh_shard is None:  # (torch's Muon on a mesh: the same code path as the fp32 optimizer's below)
        for (rel, where), _ in ranks(world_size).run(against_ddp, stage, mesh_shard):
            assert rel <= 1e-2, (rel, where)
    for (rel, where), _ in ranks(world_size).run(against_ddp, stage, mesh_shard, 6, False):
        assert rel <= 1e-6, (rel, where)


def vit_against_ddp(stage: int, steps: int = 4):
    """torchvision's VisionTransformer (a model we did not write): Muon for its encoder layers' matrices,
    AdamW for the rest (patch convolution, class token, positions, norms, biases, head)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torchvision.models import VisionTransformer
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                             num_classes=8)

    def optimizers(net):
        hidden = [p for n_, p in net.named_parameters() if n_.startswith("encoder.layers.") and p.dim() == 2]
        rest = [p for n_, p in net.named_parameters() if not (n_.startswith("encoder.layers.") and p.dim() == 2)]
        return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-3, eps=1e-6)]

    def train_vit(model, opts):
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4 * n, 3, 16, 16, generator=g), torch.randint(0, 8, (4 * n,), generator=g)
            torch.nn.functional.cross_entropy(model(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4]).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
    net = perturbed(base, rank)
    model = minidist.ShardedDataParallel(net, optimizers(net), stage=stage, **STAGE_KW[stage])
    train_vit(model, model.optimizers)
    ref_net = perturbed(base, rank)
    train_vit(DDP(ref_net), optimizers(ref_net))
    return max_rel_diff(model.full_state_dict(), ref_net.state_dict())


@pytest.mark.parametrize("stage", [2, 3])
def test_muon_on_torchvisions_vision_transformer_equals_native_ddp_bitwise(ranks, stage):
    pytest.importorskip("torchvision")
    for rel, where in ranks(2).run(vit_against_ddp, stage):
        assert rel == 0.0, (rel, where)


def ownership(stage: int):
    """Which rank owns each hidden matrix (its Muon state), and the Muon state bytes per rank."""
    rank = dist.get_rank()
    net = build("gpt")
    model = minidist.ShardedDataParallel(net, muon_and_adamw(net), stage=stage, **STAGE_KW[stage])
    train(model, model.optimizers, 1, rank, dist.get_world_size())
    muon = model.optimizers[0]
    pieces = [p for g in muon.param_groups for p in g["params"] if p.dim() == 2]
    state = sum(s["momentum_buffer"].numel() for s in muon.state.values() if "momentum_buffer" in s)
    hidden = [p for n, p in net.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    return [tuple(p.shape) for p in pieces], state, sum(p.numel() for p in hidden), max(p.numel() for p in hidden)


@pytest.mark.parametrize("stage", [2, 3])
def test_each_matrix_has_one_owner_and_the_state_is_balanced(ranks, stage):
    """Muon steps whole matrices (2-D, their own shapes), each on one rank; every rank holds ~1/N of
    the Muon state, within the largest matrix (measured: the momentum buffers' elements)."""
    out = ranks(2).run(ownership, stage)
    shapes = sorted(s for shapes, *_ in out for s in shapes)
    total, largest = out[0][2], out[0][3]
    assert sum(torch.Size(s).numel() for s in shapes) == total  # every matrix once, whole
    for _, state, _, _ in out:
        assert abs(state - total / 2) <= largest, (state, total, largest)


def make(stage: int, muon: bool):
    net = build("gpt")
    return minidist.ShardedDataParallel(net, muon_and_adamw(net, None if muon else NormalisedSGD), stage=stage,
                                        **STAGE_KW[stage])


def resumed_elsewhere(stage: int, muon: bool, saved: list | None):
    """Train 4 steps and save (saved=None), or load what 2 ranks saved and train 4 more steps."""
    model = make(stage, muon)
    if saved is None:
        train_global(model, range(4))
        return model.sharded_state_dict(), [model.full_optim_state_dict(o) for o in model.optimizers]
    model.load_sharded_state_dict(saved)
    train_global(model, range(4, 8))
    return model.full_state_dict()


def train_global(model, steps):
    """One global batch of 16 per step, at any world size (the same samples in all)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    per = 16 // n
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 64, (16, 16), generator=g)
        y = torch.roll(x, -1, dims=1)
        loss_fn("gpt", model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        for opt in model.optimizers:
            opt.step()
            opt.zero_grad()


def straight_through(stage: int, muon: bool):
    model = make(stage, muon)
    train_global(model, range(8))
    full = model.full_state_dict()  # (a collective)
    return full if dist.get_rank() == 0 else None


@pytest.mark.parametrize("stage, muon", [(2, False), (3, False), (3, True)])
def test_whole_matrix_checkpoints_resume_at_another_world_size(ranks, stage, muon):
    """Saved by 2 ranks, loaded by 4, trained on: where 2 ranks training straight through end, within
    1e-6 for the fp32 matrix optimizer (torch's Muon, orthogonalising in bf16 after sums in another
    order: 1e-2). The full optimizer states are a plain optimizer's: they load into the bare ones."""
    saved = ranks(2).run(resumed_elsewhere, stage, muon, None)
    resumed = ranks(4).run(resumed_elsewhere, stage, muon, [s for s, _ in saved])[0]
    straight = ranks(2).run(straight_through, stage, muon)[0]
    rel, where = max_rel_diff(resumed, straight)
    assert rel <= (1e-2 if muon else 1e-6), (rel, where)
    matrices, adamw = muon_and_adamw(build("gpt"), None if muon else NormalisedSGD)
    for bare, full in zip((matrices, adamw), saved[0][1]):
        bare.load_state_dict(full)
        shapes = [tuple(p.shape) for g in bare.param_groups for p in g["params"]]
        assert len(bare.state) == len(shapes)
        assert all(tuple(st[k].shape) == tuple(p.shape) for p, st in bare.state.items() for k in st if st[k].dim())


def refusals():
    import functools
    net = build("gpt")
    errors = []
    for optimizer in (functools.partial(torch.optim.Muon, lr=0.02), [torch.optim.Adafactor(net.parameters())],
                      muon_and_adamw(net)[:1]):
        try:
            minidist.ShardedDataParallel(copy.deepcopy(net) if callable(optimizer) else net, optimizer, stage=2)
            errors.append("accepted")
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    return errors


def test_what_is_refused_names_the_way(ranks):
    factory, adafactor, missing = ranks(2).run(refusals)[0]
    assert "pass the optimizer built over them" in factory and "[muon, adamw]" in factory
    assert "Adafactor" in adafactor and "row and column statistics" in adafactor
    assert "does not hold these trainable parameters" in missing


# ---------------------------------------------------------------------------- the trainer: optim=muon
# Trainer runs without gradient clipping: ZeRO sums the clipping norm's squares shard by shard, an ulp
# from native DDP's order, and Muon's bf16 orthogonalisation can turn an ulp into 1e-3; without it,
# the arithmetic is the same and so are the bits.
NO_CLIP = ("optim=muon", "trainer.grad_clip=0", "trainer.max_steps=4", "trainer.ckpt_every=2")


@pytest.fixture(scope="module")
def native_muon(ranks, tmp_path_factory):
    """optim=muon under native DDP, 4 steps at 2 ranks: the trainer's reference."""
    from train_cases import tiny, train_on_rank
    run_dir = tmp_path_factory.mktemp("muon") / "native_ddp"
    return ranks(2).run(train_on_rank, tiny(*NO_CLIP, strategy="native_ddp"), str(run_dir), timeout_s=120)[0]


@pytest.mark.parametrize("strategy", [pytest.param(s, marks=pytest.mark.slow(
    stand_in="test_optim_muon_in_the_trainer_equals_native_ddp_bitwise[zero2]")) if s in ("ddp", "zero1") else s
    for s in ("ddp", "zero1", "zero2", "zero3")])
def test_optim_muon_in_the_trainer_equals_native_ddp_bitwise(ranks, native_muon, strategy, tmp_path):
    """optim=muon (Muon over the hidden matrices, AdamW over embeddings, head, norms and biases) under
    our strategies ends where native DDP with the same two optimizers ends, to the bit; the
    checkpoint holds Muon's momentum for the hidden matrices, AdamW's moments for the rest (the head is
    tied to the token embedding: AdamW's)."""
    from minidist.train.checkpoint import list_checkpoints
    from train_cases import assert_same, tiny, train_on_rank
    from test_resume_anywhere import portable
    ours = ranks(2).run(train_on_rank, tiny(*NO_CLIP, strategy=strategy), str(tmp_path), timeout_s=120)[0]
    assert_same(ours["full_state"], native_muon["full_state"])
    _, optim = portable(list_checkpoints(tmp_path)[-1])
    assert set(optim["state"]["blocks.0.attn.qkv.weight"]) == {"momentum_buffer"}
    assert {"exp_avg", "exp_avg_sq"} <= set(optim["state"]["tok_emb.weight"]) & set(optim["state"]["blocks.0.ln1.bias"])
    assert [g["lr"] for g in optim["param_groups"]] != [optim["param_groups"][0]["lr"]] * 2  # each its own


@pytest.mark.slow(stand_in="test_optim_muon_in_the_trainer_equals_native_ddp_bitwise[zero2]")
def test_optim_muon_on_a_2x2_mesh_in_the_trainer_is_native_ddps_first_step(ranks, tmp_path):
    """hsdp2 at 4 ranks (2 replicas of 2 shard ranks) against native DDP at 4: the reduce_scatter then
    the replicas' all_reduce sum in another order than gloo's all_reduce, an ulp apart: after one
    step within 1e-6 (a misplaced matrix or group would be off by far more). After 2 and 4 steps
    8.6e-4 and 3.3e-2 (measured): Muon's bf16 orthogonalisation and AdamW's first, sign-like steps
    on this tiny model carry the ulp on, as test_whole_matrix_optimizers_at_3_and_4_ranks_and_on_a_mesh
    shows with an fp32 matrix optimizer (within 1e-6 there)."""
    from train_cases import mesh_options, tiny, train_on_rank
    finals = {s: ranks(4).run(train_on_rank, tiny("optim=muon", "trainer.grad_clip=0", "trainer.max_steps=1",
                                                   *mesh_options(s), strategy=s), str(tmp_path / s),
                              timeout_s=120)[0]["full_state"] for s in ("native_ddp", "hsdp2")}
    for key, ref in finals["native_ddp"].items():
        assert (finals["hsdp2"][key] - ref).abs().max() <= 1e-6 * ref.abs().max(), key


def groups_after_resume(cfg: dict, run_dir: str, ckpt: str) -> list[tuple[float, float]]:
    from omegaconf import OmegaConf

    from minidist.train.trainer import Trainer
    trainer = Trainer(OmegaConf.create(cfg), run_dir, resume_from=ckpt)
    try:
        return [(g["initial_lr"], g["lr"]) for g in trainer.optimizer.param_groups]
    finally:
        trainer.close()


def test_optim_muon_resumes_as_another_strategy_exactly_and_takes_each_lr(ranks, native_muon, tmp_path):
    """Saved by zero2 after 2 steps (its sharded layout: Muon's and AdamW's groups, named), resumed as
    zero3 and as ddp (the portable form, each parameter's state found by name): native DDP's 4 steps,
    to the bit. Resumed with a new AdamW lr, the AdamW group takes it and Muon's keeps its own."""
    from minidist.train.checkpoint import list_checkpoints
    from train_cases import assert_same, tiny, train_on_rank
    pool = ranks(2)
    pool.run(train_on_rank, tiny(*NO_CLIP, "trainer.stop_at=2", strategy="zero2"), str(tmp_path / "a"), timeout_s=120)
    ckpt = str(list_checkpoints(tmp_path / "a")[-1])
    for strategy in ("zero3", "ddp"):
        resumed = pool.run(train_on_rank, tiny(*NO_CLIP, strategy=strategy), str(tmp_path / strategy), ckpt,
                           timeout_s=120)[0]
        assert_same(resumed["full_state"], native_muon["full_state"], strategy)
    cfg = tiny(*NO_CLIP, "optim.adamw_lr=1e-3", strategy="zero3")
    (muon, adamw), _ = pool.run(groups_after_resume, cfg, str(tmp_path / "c"), ckpt, timeout_s=120)
    assert muon[0] == cfg["optim"]["lr"] and adamw[0] == 1e-3
    assert muon[1] / muon[0] == pytest.approx(adamw[1] / adamw[0])  # one schedule, each group's peak
