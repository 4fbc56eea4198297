"""Checks that need CUDA: the comm layer on nccl with CUDA tensors (world size 1 on one GPU).

Skipped without a CUDA device; scripts/gpu_check.sh runs them on a GPU machine.
"""

import pytest
import torch

from rank_pool import RankPool

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run scripts/gpu_check.sh on a GPU machine)")


@pytest.fixture(scope="module")
def nccl_pool():
    pool = RankPool(1, backend="nccl")
    yield pool
    pool.close()


def cuda_collectives():
    import torch.distributed as dist

    from minidist import comm
    assert dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.arange(7, device=dev).to(dtype)
        for async_op in (False, True):
            t = x.clone()
            h = comm.all_reduce(t, async_op=async_op)
            if h:
                h.wait()
            torch.cuda.synchronize()
            assert torch.equal(t, x)
            out = torch.empty(7, device=dev, dtype=dtype)
            h = comm.all_gather_into(out, x, async_op=async_op)
            if h:
                h.wait()
            h = comm.reduce_scatter_tensor(t, out, async_op=async_op)
            if h:
                h.wait()
            comm.broadcast(t, src=0)
            torch.cuda.synchronize()
            assert torch.equal(out, x) and torch.equal(t, x)
    return "ok"


@needs_cuda
def test_comm_on_nccl_world_size_one(nccl_pool):
    assert nccl_pool.run(cuda_collectives) == ["ok"]


def cuda_ddp_matches_native(gradient_as_bucket_view: bool):
    """DataParallel vs native DDP on CUDA/nccl (world size 1): 5 AdamW steps of a small GPT."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    import minidist
    from minidist.train.models import GPT
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    base = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32).to(dev)
    out = {}
    for kind in ("native", "ours"):
        net = copy.deepcopy(base)
        if kind == "native":
            model = DDP(net, bucket_cap_mb=0.05, gradient_as_bucket_view=gradient_as_bucket_view)
        else:
            model = minidist.DataParallel(net, bucket_cap_mb=0.05, gradient_as_bucket_view=gradient_as_bucket_view)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        g = torch.Generator(device="cpu").manual_seed(0)
        for _ in range(5):
            x = torch.randint(0, 64, (4, 16), generator=g).to(dev)
            GPT.loss(model(x), torch.roll(x, -1, 1)).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        out[kind] = {k: v.cpu() for k, v in net.state_dict().items()}
    return all(torch.equal(out["ours"][k], out["native"][k]) for k in out["native"])


@needs_cuda
@pytest.mark.parametrize("as_view", [False, True])
def test_data_parallel_on_nccl_matches_native(nccl_pool, as_view):
    assert nccl_pool.run(cuda_ddp_matches_native, as_view) == [True]


def cuda_zero_matches_native(stage: int, param_dtype: str | None):
    """ShardedDataParallel on CUDA/nccl (world size 1) vs native DDP (fp32) or fully_shard (bf16)."""
    import copy
    import functools

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import minidist
    from minidist.train.models import GPT
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    base = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32).to(dev)
    factory = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    dtype = getattr(torch, param_dtype) if param_dtype else None
    ours = minidist.ShardedDataParallel(copy.deepcopy(base), factory, stage=stage, param_dtype=dtype,
                                        **({"min_unit_params": 1000} if stage == 3 else {}))
    ref_net = copy.deepcopy(base)
    if dtype is None:
        ref = DDP(ref_net)
    else:
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        for block in ref_net.blocks:
            fully_shard(block, mp_policy=policy)
        ref = fully_shard(ref_net, mp_policy=policy)
    ref_opt = factory(ref_net.parameters())
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randint(0, 64, (4, 16), generator=g).to(dev)
        y = torch.roll(x, -1, 1)
        GPT.loss(ours(x).float(), y).backward()
        ours.clip_grad_norm_(0.5)
        ours.optimizer.step()
        ours.optimizer.zero_grad()
        GPT.loss(ref(x).float(), y).backward()
        torch.nn.utils.clip_grad_norm_(ref_net.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
    torch.cuda.synchronize()
    mine = ours.full_state_dict()
    theirs = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in ref_net.state_dict().items()}
    return max(((mine[k] - theirs[k]).abs().max() / (theirs[k].abs().max() + 1e-12)).item() for k in theirs)


@needs_cuda
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("param_dtype", [None, "bfloat16"])
def test_sharded_data_parallel_on_nccl(nccl_pool, stage, param_dtype):
    (rel,) = nccl_pool.run(cuda_zero_matches_native, stage, param_dtype)
    assert rel <= (1e-6 if param_dtype is None else 1e-2), rel


def cuda_compiled_matches_native(strategy: str, placement: str, device: str = "cuda"):
    """Drop-in on CUDA (world size 1): the loop with torch.compile (inductor) under our wrapper
    against native DDP compiled the same way, 4 AdamW steps of a small GPT (the drop-in matrix's
    wrappers and clipping). device="cpu" runs the same check on gloo."""
    import copy

    from ddp_cases import max_rel_diff
    from drop_in_cases import build, full_state, loss_of, wrap
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    base = build("gpt").to(dev)

    def train(kind):
        torch._dynamo.reset()
        plain = copy.deepcopy(base)
        net = torch.compile(plain) if placement == "inner" else plain
        model, opt, clip = wrap(kind, net, False, "gpt")
        forward = torch.compile(model) if placement == "outer" else model
        g = torch.Generator().manual_seed(0)
        for _ in range(4):
            x = torch.randint(0, 64, (4, 8), generator=g).to(dev)
            loss_of(forward(x).float(), torch.roll(x, -1, 1)).backward()
            clip()
            opt.step()
            opt.zero_grad()
        return {k: v.cpu() for k, v in full_state(kind, model, plain).items()}

    return max_rel_diff(train(strategy), train("native_ddp"))[0]


@needs_cuda
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("placement", ["inner", "outer"])
def test_compiled_on_cuda_matches_native_ddp_compiled(nccl_pool, strategy, placement):
    """torch.compile of the module before wrapping ("inner") or of the wrapper ("outer")."""
    (rel,) = nccl_pool.run(cuda_compiled_matches_native, strategy, placement, timeout_s=600)
    # Inductor fuses each graph its own way: zero3's graph breaks at every unit give other kernels
    # than native's one graph, so not bitwise (zero3 on CPU: 1.1e-5 by a per-tensor measure).
    assert rel <= 1e-5, rel


def sync_free_steps(cfg_dict: dict, run_dir: str) -> dict:
    """Rank function: train steps between log steps under torch.cuda.set_sync_debug_mode("error")
    (any host synchronisation raises), then what a log step reads and the device-timed figures."""
    from omegaconf import OmegaConf

    from minidist.train.trainer import Trainer

    trainer = Trainer(OmegaConf.create(cfg_dict), run_dir)
    try:
        batches = iter(trainer.sampler)
        history = [trainer.train_step(batches)]  # the first step: lazy allocations, cuBLAS handles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                history.append(trainer.train_step(batches))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        metrics = trainer._reduce_metrics(history[1:])
        records = [r for h in history[1:] if h.comm for r in h.comm.records]
        return {"step_s": metrics["time/step_s"], "exposed_s": metrics.get("time/exposed_comm_s"),
                "device_timed": all(r.device_timed for r in records), "records": len(records)}
    finally:
        trainer.close()


@needs_cuda
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_steps_between_log_steps_never_synchronise_the_gpu(nccl_pool, tmp_path, strategy):
    """No .item(), no torch.cuda.synchronize, no host-read norm between log steps (fused AdamW
    skips non-finite steps on the device); the step and its communication are timed by CUDA events."""
    from train_cases import tiny

    cfg = tiny("launcher.backend=nccl", "trainer.precision=bf16", strategy=strategy)
    r = nccl_pool.run(sync_free_steps, cfg, str(tmp_path))[0]
    assert r["step_s"] > 0 and r["exposed_s"] is not None and 0 <= r["exposed_s"] < r["step_s"]
    assert r["device_timed"]


GPU_TRAINER_CASES = {  # the trainer on nccl, world size 1: the CUDA paths of each option
    "ddp_accumulation": ("ddp", ["trainer.grad_accum=2"]),
    "ddp_unused_parameters": ("ddp", ["strategy.find_unused_parameters=true"]),
    "ddp_no_overlap": ("ddp", ["strategy.overlap=false"]),
    "ddp_fp16_hook": ("ddp", ["strategy.comm_hook=fp16"]),
    "ddp_bf16_hook": ("ddp", ["strategy.comm_hook=bf16"]),
    "ddp_powersgd": ("ddp", ["strategy.comm_hook=powersgd"]),
    "ddp_hierarchical": ("ddp_hierarchical", []),
    "hsdp2_1x1": ("hsdp2", []),
    "hsdp3_1x1": ("hsdp3", []),
}


@needs_cuda
@pytest.mark.parametrize("case", list(GPU_TRAINER_CASES))
def test_trainer_options_on_cuda(nccl_pool, tmp_path, case):
    import math

    from train_cases import tiny, train_on_rank

    strategy, extra = GPU_TRAINER_CASES[case]
    out = nccl_pool.run(train_on_rank, tiny("launcher.backend=nccl", "trainer.max_steps=6", *extra,
                                            strategy=strategy), str(tmp_path))[0]
    assert out["step"] == 6 and math.isfinite(out["train/loss"]) and out["skipped_steps"] == 0


@needs_cuda
@pytest.mark.parametrize("checkpoint_async", [False, True])
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_checkpoint_round_trip_on_cuda_is_exact(nccl_pool, tmp_path, strategy, checkpoint_async):
    """4 steps straight, or 2, a checkpoint (sharded for ZeRO; async: staged in pinned memory,
    written by the writer process), and 2 more resumed: the same state."""
    from train_cases import assert_same, tiny, train_on_rank

    straight = nccl_pool.run(train_on_rank, tiny("launcher.backend=nccl", "trainer.max_steps=4", strategy=strategy),
                             str(tmp_path / "straight"))[0]
    nccl_pool.run(train_on_rank, tiny("launcher.backend=nccl", "trainer.max_steps=4", "trainer.stop_at=2",
                                      f"trainer.checkpoint_async={checkpoint_async}", strategy=strategy),
                  str(tmp_path / "resumed"))
    resumed = nccl_pool.run(train_on_rank, tiny("launcher.backend=nccl", "trainer.max_steps=4", strategy=strategy),
                            str(tmp_path / "resumed"), str(sorted((tmp_path / "resumed" / "checkpoints").iterdir())[-1]))[0]
    assert_same(resumed["full_state"], straight["full_state"])


@needs_cuda
def test_checkpoint_staging_pins_its_buffer_for_gpu_tensors():
    """Async checkpoints stage GPU tensors into pinned shared memory (non-blocking copies, one
    synchronisation), re-pin a grown buffer, and stage CPU-only state without touching CUDA's pinning."""
    from minidist.train.async_checkpoint import Staging, staged_view, unstaged

    staging = Staging()
    tensors, skeleton, fresh = staging.stage({"model.pt": {"cpu": torch.ones(3)}})
    assert fresh and not staging.pinned
    live = {"model.pt": {"w": torch.randn(1000, 100, device="cuda"), "cpu": torch.arange(5.0)}}
    tensors, skeleton, fresh = staging.stage(live)
    assert fresh and staging.pinned and staged_view(staging.buffer, *tensors[0]).is_pinned()
    before = live["model.pt"]["w"].cpu()
    live["model.pt"]["w"].add_(1.0)  # training goes on, on the GPU: the staged copy does not move
    back = unstaged(staging.buffer, tensors, skeleton)["model.pt"]
    assert torch.equal(back["w"], before) and torch.equal(back["cpu"], live["model.pt"]["cpu"])
    grown = {"model.pt": {"w": torch.randn(2000, 100, device="cuda")}}
    tensors, skeleton, fresh = staging.stage(grown)
    assert fresh and staging.pinned and staged_view(staging.buffer, *tensors[0]).is_pinned()
    assert torch.equal(unstaged(staging.buffer, tensors, skeleton)["model.pt"]["w"], grown["model.pt"]["w"].cpu())
    staging.close()
    assert not staging.pinned and staging.buffer is None
