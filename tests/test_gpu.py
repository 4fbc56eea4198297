"""Checks that need CUDA: the comm layer on nccl with CUDA tensors (world size 1 on one GPU).

Skipped without a CUDA device; scripts/gpu_check.sh runs them on a GPU machine.
"""

import pytest
import torch

from minidist.testing import RankPool

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
