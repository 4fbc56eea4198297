"""minidist.ShardedDataParallel (ZeRO 1/2/3) against native references, on gloo/CPU.

References: native DDP with the same optimizer (and torch.nn.utils.clip_grad_norm_),
one process on the concatenated batch, ZeroRedundancyOptimizer (stage 1) and
fully_shard (stage 3). Tolerance 1e-6 as defined in ddp_cases.max_rel_diff; many
cases are in fact bitwise equal.
"""

import copy

import pytest
import torch
import torch.distributed as dist

import minidist
import zero_cases
from grid import grid
from ddp_cases import build, global_batch, loss_fn, max_rel_diff
from minidist.comm import CommTracer
from minidist_tools.benchmarking import live_tensor_bytes

STAGE_KW = {1: {}, 2: {}, 3: {"min_unit_params": 1000}}  # small units so the test GPT has several


def check(result, refs, tol=1e-6):
    assert result["ranks_agree"], "replicas disagree"
    assert result["keys_match"], "full_state_dict keys differ from the module's"
    for ref in refs:
        assert result[ref][0] <= tol, f"vs {ref}: {result[ref]}"


# make test: every pair of stage, world size, optimizer and model; make test-all: the whole product (grid.py).
PAIRS = pytest.mark.slow(stand_in="test_matches_ddp_and_single_process_with_clipping")


@pytest.mark.parametrize("stage, world_size, optim, model", grid([1, 2, 3], [2, 3, 4], ["adamw", "sgd"], ["gpt", "mlp"],
                                                                 slow=PAIRS))
def test_matches_ddp_and_single_process_with_clipping(ranks, stage, world_size, model, optim):
    for r in ranks(world_size).run(zero_cases.compare_zero, stage=stage, model=model, optim=optim, clip=0.1,
                                   **STAGE_KW[stage]):
        check(r, ("ddp", "single"))


# make test: each stage once, each world size once; make test-all: the rest of the grid.
@pytest.mark.parametrize("world_size, stage", [
    (w, s) if (w, s) in ((2, 3), (3, 2), (4, 1)) else
    pytest.param(w, s, marks=pytest.mark.slow(stand_in="test_accumulation_with_no_sync[2-3]"))
    for w in (2, 3, 4) for s in (1, 2, 3)])
def test_accumulation_with_no_sync(ranks, stage, world_size):
    for r in ranks(world_size).run(zero_cases.compare_zero, stage=stage, model="gpt", accumulate=4, clip=0.1,
                                   **STAGE_KW[stage]):
        check(r, ("ddp", "single"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage1_matches_zero_redundancy_optimizer(ranks, world_size):
    for r in ranks(world_size).run(zero_cases.compare_zero, stage=1, model="gpt",
                                   references=("zero_redundancy",)):
        check(r, ("zero_redundancy",))


# make test: each world size once, each accumulation once; make test-all: the four.
@pytest.mark.parametrize("world_size, accumulate", [(2, 4), (3, 1), *(pytest.param(w, a, marks=pytest.mark.slow(
    stand_in="test_stage3_matches_fully_shard[2-4]")) for w, a in ((2, 1), (3, 4)))])
def test_stage3_matches_fully_shard(ranks, world_size, accumulate):
    for r in ranks(world_size).run(zero_cases.compare_zero, stage=3, model="gpt", accumulate=accumulate,
                                   references=("fully_shard",), min_unit_params=1000):
        check(r, ("fully_shard",))


def bf16_vs_fully_shard(stage):
    import copy

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ddp_cases import perturbed
    rank, n = dist.get_rank(), dist.get_world_size()
    base = build("gpt")
    model = minidist.ShardedDataParallel(perturbed(base, rank), zero_cases.OPTIMIZERS["adamw"], stage=stage,
                                         param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                         **STAGE_KW[stage])
    ref = copy.deepcopy(base)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in ref.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(ref, mp_policy=policy)
    ref_opt = zero_cases.OPTIMIZERS["adamw"](ref.parameters())
    fp32 = copy.deepcopy(base)
    fp32_opt = zero_cases.OPTIMIZERS["adamw"](fp32.parameters())
    dtypes = set()
    for step in range(10):
        x, y = global_batch("gpt", step, 0, n)
        xs, ys = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
        out = model(xs)
        dtypes.add(out.dtype)
        loss_fn("gpt", out.float(), ys).backward()
        model.optimizer.step()
        model.optimizer.zero_grad()
        loss_fn("gpt", ref(xs).float(), ys).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn("gpt", fp32(x), y).backward()
        fp32_opt.step()
        fp32_opt.zero_grad()
    ours = model.full_state_dict()
    native = {k: v.full_tensor() for k, v in ref.state_dict().items()}
    return (max_rel_diff(ours, native)[0], max_rel_diff(ours, fp32.state_dict())[0], dtypes,
            {v.dtype for v in ours.values()}, {s.master.dtype for s in model._shards})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_compute_with_fp32_masters_matches_fully_shard_mixed_precision(ranks, stage):
    for vs_native, vs_fp32, out_dtypes, sd_dtypes, master_dtypes in ranks(2).run(bf16_vs_fully_shard, stage):
        assert out_dtypes == {torch.bfloat16} and master_dtypes == {torch.float32} and sd_dtypes == {torch.float32}
        assert vs_native <= 1e-6
        assert 0 < vs_fp32 <= 1e-2  # bf16 rounding, but close to full precision


# --------------------------------------------------------------------------- checkpoints


# make test: stage 3 (units); stages 1-2 (buckets) save their master shards in the same per-parameter pieces
@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow(stand_in="test_reshard_from_4_ranks_to_2_and_1[3]"))
                                   for s in (1, 2)] + [3])
def test_reshard_from_4_ranks_to_2_and_1(ranks, stage):
    """Saved at 4 ranks, loaded at 2 and 1: the shards are re-cut, which moves bytes, so the model
    and optimizer state as loaded equal what was saved bitwise (a second moment rounded on the
    way would fail here); after 5 more steps, the 4-rank run's result within rounding (other sums)."""
    from train_cases import assert_same

    results = ranks(4).run(zero_cases.save_then_continue, stage)
    saved = [r[0] for r in results]
    reference, at_save = results[0][1], results[0][2]
    assert {s["world_size"] for s in saved} == {4}
    for world_size in (2, 1):
        for rank, (state, lr, loaded) in enumerate(ranks(world_size).run(zero_cases.load_and_continue, stage, saved)):
            assert_same(loaded, at_save, f"stage {stage}, loaded at {world_size} ranks, rank {rank}")
            assert lr == pytest.approx(1e-3 * 0.5 ** 3)  # the scheduler's lr came back
            rel, where = max_rel_diff(state, reference)
            assert rel <= 1e-6, f"stage {stage} at {world_size} ranks vs 4-rank run: {rel} at {where}"


def full_state_into_plain_module(stage):
    model, _ = zero_cases.make_sharded(stage)
    zero_cases.train_global(model, model.optimizer, range(3))
    state = model.full_state_dict()
    only0 = model.full_state_dict(rank0_only=True)
    plain = build("gpt")
    plain.load_state_dict(state)  # same keys, shapes: a plain nn.Module takes it
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        same = torch.equal(plain(x), model(x))
    return same, bool(only0) == (dist.get_rank() == 0), plain.head.weight is plain.tok_emb.weight


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_state_dict_loads_into_a_plain_module(ranks, stage):
    for same, rank0_only_ok, tied in ranks(2).run(full_state_into_plain_module, stage):
        assert same and rank0_only_ok and tied


def bad_checkpoint():
    model, _ = zero_cases.make_sharded(2)
    errors = []
    for bad in ({"format": "something else"},
                {**model.sharded_state_dict(), "shapes": {"nope": (1,)}}):
        try:
            model.load_sharded_state_dict(bad)
        except ValueError as e:
            errors.append(str(e))
    sd = model.sharded_state_dict()
    try:  # this rank's shard alone cannot fill a 1-rank layout... but at the same size it works
        model.load_sharded_state_dict(sd)
        errors.append("same-size reload ok")
    except ValueError as e:
        errors.append(f"unexpected: {e}")
    return errors


def test_bad_checkpoints_are_refused_clearly(ranks):
    errors = ranks(2).run(bad_checkpoint)[0]
    assert "not a minidist sharded checkpoint" in errors[0]
    assert "does not match the model" in errors[1] and "missing" in errors[1]
    assert errors[2] == "same-size reload ok"


def incomplete_shards(saved):
    model, _ = zero_cases.make_sharded(2)
    try:
        model.load_sharded_state_dict(saved[:1])  # only rank 0's file of a 4-rank checkpoint
    except ValueError as e:
        return str(e)
    return "no error"


def test_missing_shards_are_named(ranks):
    saved = [r[0] for r in ranks(4).run(zero_cases.save_then_continue, 2)]
    msg = ranks(2).run(incomplete_shards, saved)[1]
    assert "are all ranks' shards loaded?" in msg


class Attention(torch.nn.Module):
    """nn.MultiheadAttention computes with its out_proj's weight without calling out_proj."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = torch.nn.Linear(16, 8)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.attn(h, h, h, need_weights=False)[0]).mean(1)


def late_gathers_against_ddp():
    """Stage 2 with every after-step gather landing only when waited for (the slowest network): a
    forward must wait for each bucket before anything reads it. Bitwise native DDP's, at 2 ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from minidist.parallel.flat_shard import FlatShard
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = Attention()
    model = minidist.ShardedDataParallel(copy.deepcopy(base), zero_cases.OPTIMIZERS["adamw"], stage=2,
                                         bucket_cap_mb=0.001)

    class Late:  # the gather happens when waited for
        def __init__(self, shard):
            self.shard = shard

        def wait(self):
            FlatShard.gather_full(self.shard)
    for shard in model._shards:
        shard.gather_full = lambda async_op=False, shard=shard: Late(shard) if async_op else \
            FlatShard.gather_full(shard)
    ref_net = copy.deepcopy(base)
    ref, ref_opt = DDP(ref_net), zero_cases.OPTIMIZERS["adamw"](ref_net.parameters())
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * n, 4, 8, generator=g), torch.randn(2 * n, 8, generator=g)
        for m, opt in ((model, model.optimizer), (ref, ref_opt)):
            torch.nn.functional.mse_loss(m(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]).backward()
            opt.step()
            opt.zero_grad()
    return max_rel_diff(model.full_state_dict(), ref_net.state_dict())


def test_a_forward_waits_for_the_parameters_a_module_reads_of_its_submodules(ranks):
    for rel, where in ranks(2).run(late_gathers_against_ddp):
        assert rel == 0.0, (rel, where)


# --------------------------------------------------------------------------- memory


def measure_memory(strategy: str):
    from minidist.train.models import GPT
    n = dist.get_world_size()
    before = live_tensor_bytes()
    torch.manual_seed(0)
    net = GPT(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_embd=128)  # ~0.46M parameters
    psi = sum(p.numel() for p in net.parameters())
    if strategy == "ddp":
        model = minidist.DataParallel(net, gradient_as_bucket_view=True)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    else:
        stage = int(strategy[-1])
        kw = {"min_unit_params": 100_000} if stage == 3 else {}
        model = minidist.ShardedDataParallel(net, torch.optim.Adam, stage=stage, **kw)
        opt = model.optimizer
    x = torch.randint(0, 512, (2, 32))
    GPT.loss(model(x), x).backward()
    opt.step()
    del x
    report = model.memory_report(opt) if strategy == "ddp" else model.memory_report()
    counted = live_tensor_bytes() - before
    return psi, n, report, counted


FORMULAS = {  # bytes per rank, fp32 parameters (4 bytes), Adam (8 bytes of state per element)
    "ddp": lambda psi, n: 16 * psi,
    "zero1": lambda psi, n: 8 * psi + 8 * psi / n,
    "zero2": lambda psi, n: 4 * psi + 12 * psi / n,
    "zero3": lambda psi, n: 16 * psi / n,
}


@pytest.fixture(scope="module")
def clean_ranks():
    """Rank pools of this module's own, forked clean: counting every live tensor walks every Python
    object of the rank, and the shared pools hold what the whole suite left there (seconds a walk)."""
    from rank_pool import RankPools

    pools = RankPools()
    yield pools
    pools.close()


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow(
    stand_in="test_memory_matches_the_zero_paper[2-zero3]"))])  # 4 ranks: make test-all
def test_memory_matches_the_zero_paper(clean_ranks, strategy, world_size):
    for psi, n, report, counted in clean_ranks(world_size).run(measure_memory, strategy):
        expected = FORMULAS[strategy](psi, n)
        # Everything the strategy holds between steps, its communication buffers included: ZeRO-2/3
        # free their reduce buffers after backward (here one bucket holds the whole model, whose
        # buffer would be 4 Psi: 1.4x the formula at stage 2).
        model_state = report["total"] - report.get("replicated", 0)
        assert abs(model_state - expected) <= 0.05 * expected, (strategy, n, model_state, expected, report)
        # An independent count of every live tensor agrees with the report (plus a few small
        # tensors the report does not own, e.g. the GPT's position indices: < 1%).
        assert abs(counted - report["total"]) <= 0.01 * report["total"], (counted, report)


def gradient_bytes_between_backwards(stage: int, sync_each: bool) -> tuple[int, int, list[int]]:
    """Live bytes above those before the step, after each of 4 micro-batches' backwards but the last,
    accumulating by backward after backward (FSDP2's loop) or under no_sync."""
    import contextlib

    from minidist.train.models import GPT
    torch.manual_seed(0)
    net = GPT(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_embd=128)
    psi = sum(p.numel() for p in net.parameters())
    model = minidist.ShardedDataParallel(net, torch.optim.Adam, stage=stage, **STAGE_KW.get(stage, {}))
    x = torch.randint(0, 512, (4, 2, 32))
    held = []
    before = live_tensor_bytes()
    for k in range(4):
        with contextlib.nullcontext() if sync_each or k == 3 else model.no_sync():
            (GPT.loss(model(x[k]), x[k]) / 4).backward()
        if k < 3:
            held.append(live_tensor_bytes(collect=False) - before)
    return psi, dist.get_world_size(), held


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_accumulation_holds_the_gradient_shard_alone(clean_ranks, stage):
    """Between micro-batches, accumulating backward after backward holds the gradient shard, 4 Psi/N
    (no full gradient, no reduce buffer); under no_sync, the full gradient 4 Psi."""
    for psi, n, held in clean_ranks(2).run(gradient_bytes_between_backwards, stage, True):
        assert all(abs(b - 4 * psi / n) <= 0.05 * 4 * psi / n for b in held), (held, 4 * psi / n)
    for psi, n, held in clean_ranks(2).run(gradient_bytes_between_backwards, stage, False):
        assert all(b >= 4 * psi for b in held), (held, 4 * psi)


# --------------------------------------------------------------------------- communication


def traced_step(stage: int):
    kw = STAGE_KW[stage] if stage == 3 else {"bucket_cap_mb": 0.02}
    model = minidist.ShardedDataParallel(build("gpt"), zero_cases.OPTIMIZERS["adamw"], stage=stage, **kw)
    n, rank = dist.get_world_size(), dist.get_rank()
    for step in range(2):
        x, y = global_batch("gpt", step, 0, n)
        with CommTracer() as tracer:
            loss_fn("gpt", model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
            model.optimizer.step()
            model.optimizer.zero_grad()
    padded = [s.padded * 4 for s in model._shards]
    psi = sum(p.numel() for p in model.module.parameters())
    return ([(r.op, r.bytes) for r in tracer.records], tracer.summary(), padded, psi, len(model._shards))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 4])
def test_communication_volume(ranks, stage, world_size):
    for records, summary, padded, psi, groups in ranks(world_size).run(traced_step, stage):
        n = world_size
        assert groups > 1
        ops = {op for op, _ in records}
        assert ops == {"reduce_scatter", "all_gather"}  # nothing else, in particular no all_reduce
        gathers = [b for op, b in records if op == "all_gather"]
        scatters = [b for op, b in records if op == "reduce_scatter"]
        copies = 2 if stage == 3 else 1  # stage 3 gathers before forward and again before backward
        assert sorted(gathers) == sorted(padded * copies)
        assert sorted(scatters) == sorted(padded)
        total = sum(padded)
        assert total - 4 * psi < 4 * n * groups  # padding only
        sent = summary["all_gather"]["sent_bytes"] + summary["reduce_scatter"]["sent_bytes"]
        assert sent == pytest.approx((copies + 1) * (n - 1) / n * total)


# --------------------------------------------------------------------------- API details


def stage3_units_and_ties():
    model = minidist.ShardedDataParallel(build("gpt"), zero_cases.OPTIMIZERS["sgd"], stage=3, min_unit_params=1000)
    root_params = model._units[0].shard.slots
    return model.unit_names, [s.name for s in root_params]


def test_stage3_units_are_blocks_and_tied_weights_stay_in_the_root(ranks):
    names, root = ranks(2).run(stage3_units_and_ties)[0]
    assert names == ["<root>", "blocks.0", "blocks.1"]
    assert "tok_emb.weight" in root and not any(n.startswith("head") for n in root)  # head.weight IS tok_emb.weight


def stage3_frees_full_parameters():
    model = minidist.ShardedDataParallel(build("gpt"), zero_cases.OPTIMIZERS["sgd"], stage=3, min_unit_params=1000)
    alive_during = []
    for u in model._units[1:]:
        u.module.register_forward_hook(lambda m, i, o: alive_during.append(
            sum(x.shard.is_materialised for x in model._units)))
    x = torch.randint(0, 64, (2, 16))
    GPT_loss = loss_fn("gpt", model(x), torch.roll(x, -1, 1))
    after_forward = [u.shard.is_materialised for u in model._units]
    GPT_loss.backward()
    after_backward = [u.shard.is_materialised for u in model._units]
    return alive_during, after_forward, after_backward


def test_stage3_keeps_few_units_alive(ranks):
    alive_during, after_forward, after_backward = ranks(2).run(stage3_frees_full_parameters)[0]
    assert max(alive_during) <= 3  # the root, the running unit, the prefetched next one
    assert not any(after_forward) and not any(after_backward)


def bad_sharded_arguments():
    errors = []
    for kwargs in ({"stage": 4}, {"stage": 2, "bucket_cap_mb": -1}, {"stage": 1, "min_unit_params": 5},
                   {"stage": 3, "bucket_cap_mb": 4.0}, {"stage": 1, "overlap": True}):
        try:
            minidist.ShardedDataParallel(build("mlp"), zero_cases.OPTIMIZERS["sgd"], **kwargs)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    try:
        minidist.ShardedDataParallel(build("mlp"), "adam")
    except TypeError as e:
        errors.append(str(e))
    return errors


def test_bad_arguments_are_explained(ranks):
    errors = ranks(2).run(bad_sharded_arguments)[0]
    assert "stage must be 1, 2 or 3" in errors[0]
    assert "bucket_cap_mb must be positive" in errors[1]
    assert "min_unit_params" in errors[2] and "Use stage=3" in errors[2]
    assert "stage=3) does not take bucket_cap_mb=4.0" in errors[3]  # once silently ignored
    assert "stage=1) does not take overlap=True" in errors[4] and "Use stage=2" in errors[4]  # once too
    assert "optimizer must be a torch.optim.Optimizer" in errors[5] and "functools.partial" in errors[5]


def pool_size_with_max_inflight(stage: int, max_inflight: int):
    kw = {"min_unit_params": 1000} if stage == 3 else {"bucket_cap_mb": 0.01}
    model = minidist.ShardedDataParallel(build("gpt"), zero_cases.OPTIMIZERS["sgd"], stage=stage,
                                         max_inflight=max_inflight, **kw)
    x = torch.randint(0, 64, (2, 16))
    loss_fn("gpt", model(x), torch.roll(x, -1, 1)).backward()
    groups = len(model._shards)
    return groups, len(model._pool.tensors())


@pytest.mark.parametrize("stage", [2, 3])
def test_max_inflight_bounds_the_full_size_gradient_buffers(ranks, stage):
    groups, buffers = ranks(2).run(pool_size_with_max_inflight, stage, 1)[0]
    assert groups >= 3
    assert buffers <= 2  # one in reduction, at most one being filled
    # and the results stay exact while backward waits
    for r in ranks(2).run(zero_cases.compare_zero, stage=stage, model="gpt", max_inflight=1,
                          **({"min_unit_params": 1000} if stage == 3 else {"bucket_cap_mb": 0.01})):
        check(r, ("ddp", "single"))


def clip_norms(stage: int, norm_type: float):
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, n = dist.get_rank(), dist.get_world_size()
    base = build("gpt")
    ours = minidist.ShardedDataParallel(copy.deepcopy(base), zero_cases.OPTIMIZERS["sgd"], stage=stage,
                                        **STAGE_KW[stage])
    ref_net = copy.deepcopy(base)
    ref = DDP(ref_net)
    x, y = global_batch("gpt", 0, 0, n)
    xs, ys = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
    loss_fn("gpt", ours(xs), ys).backward()
    loss_fn("gpt", ref(xs), ys).backward()
    mine = ours.clip_grad_norm_(1e-3, norm_type=norm_type)
    theirs = torch.nn.utils.clip_grad_norm_(ref_net.parameters(), 1e-3, norm_type=norm_type)
    return mine.item(), theirs.item()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_returns_the_unsharded_norm(ranks, stage, norm_type):
    for mine, theirs in ranks(3).run(clip_norms, stage, norm_type):
        assert mine == pytest.approx(theirs, rel=1e-6)


def two_backwards_one_step(stage: int):
    """Gradients of two synced backward passes add up before the step (no zero_grad between)."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, n = dist.get_rank(), dist.get_world_size()
    base = build("gpt")
    ours = minidist.ShardedDataParallel(copy.deepcopy(base), zero_cases.OPTIMIZERS["sgd"], stage=stage,
                                        **STAGE_KW[stage])
    ref_net = copy.deepcopy(base)
    ref = DDP(ref_net)
    ref_opt = zero_cases.OPTIMIZERS["sgd"](ref_net.parameters())
    for step in range(3):
        for micro in range(2):
            x, y = global_batch("gpt", step, micro, n)
            xs, ys = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
            loss_fn("gpt", ours(xs), ys).backward()
            loss_fn("gpt", ref(xs), ys).backward()
        ours.optimizer.step()
        ours.optimizer.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return max_rel_diff(ours.full_state_dict(), ref_net.state_dict())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_accumulate_across_synced_backwards(ranks, stage):
    for rel, where in ranks(2).run(two_backwards_one_step, stage):
        assert rel <= 1e-6, (rel, where)


def forward_on_rank0_alone():
    """Rank 0 runs a stage-3 forward that rank 1 never joins (it is busy elsewhere): rank 0 stops
    within the shard group's timeout (1 s here), naming what to do."""
    import datetime
    import time

    group = dist.new_group(timeout=datetime.timedelta(seconds=1))
    model = minidist.ShardedDataParallel(build("gpt"), zero_cases.OPTIMIZERS["sgd"], stage=3, process_group=group,
                                         **STAGE_KW[3])
    if dist.get_rank() == 1:
        time.sleep(1.5)
        return "elsewhere"
    start = time.monotonic()
    try:
        with torch.no_grad():
            model(torch.randint(0, 64, (2, 8)))
    except RuntimeError as e:
        return time.monotonic() - start, str(e)
    return "no error"


def test_a_stage3_forward_no_other_rank_joins_fails_within_the_timeout(ranks):
    (seconds, message), _ = ranks(2).run(forward_on_rank0_alone)
    assert seconds < 2, seconds
    assert "forward #1 on rank 0 found no matching forward on the other ranks" in message
    assert "run the evaluation on every rank" in message
