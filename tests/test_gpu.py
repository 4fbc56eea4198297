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
