"""Bucket plans and flat buffers (pure, single process)."""

import pytest
import torch

from minidist.parallel.buckets import FlatBuffers, flatten, plan_buckets, split_by_size, unflatten_into

KB = 1024


def tensors(*kbs, dtype=torch.float32):
    return [torch.zeros(kb * KB // 4, dtype=dtype) for kb in kbs]


def sizes(params, buckets):
    return [sum(params[i].numel() * 4 // KB for i in b) for b in buckets]


def test_caps_first_and_last_small_and_order_kept():
    params = tensors(4, 4, 8, 8, 8, 8, 8, 4, 2, 2)
    order = list(reversed(range(len(params))))
    buckets = plan_buckets(params, order, cap_bytes=16 * KB, first_cap_bytes=4 * KB)
    assert [i for b in buckets for i in b] == order          # every parameter once, in order
    s = sizes(params, buckets)
    assert s[0] <= 4 and s[-1] <= 4                           # small at both ends
    assert all(x <= 16 for x in s)


def test_oversized_tensor_gets_its_own_bucket():
    params = tensors(1, 64, 1)
    buckets = plan_buckets(params, [2, 1, 0], cap_bytes=16 * KB, first_cap_bytes=4 * KB)
    assert buckets == [[2], [1], [0]]


def test_one_dtype_per_bucket():
    params = tensors(1, 1) + tensors(1, 1, dtype=torch.float16)
    buckets = plan_buckets(params, [3, 2, 1, 0], cap_bytes=1 << 20, first_cap_bytes=1 << 20)
    for b in buckets:
        assert len({params[i].dtype for i in b}) == 1


@pytest.mark.parametrize("cap", [1, 3, 100])
def test_split_by_size_partitions(cap):
    ts = tensors(1, 2, 1, 1)
    runs = split_by_size(ts, cap * KB)
    assert [t for r in runs for t in r] == ts
    assert all(sum(t.numel() * 4 for t in r) <= cap * KB or len(r) == 1 for r in runs)


def test_flatten_round_trip():
    a, b = torch.randn(2, 3), torch.randn(5)
    flat = flatten([a, b])
    a2, b2 = torch.empty_like(a), torch.empty_like(b)
    unflatten_into(flat, [a2, b2])
    assert torch.equal(a, a2) and torch.equal(b, b2)


def test_flat_buffers_track_in_place_updates_and_reassignment():
    import minidist
    minidist.init_distributed(backend="gloo")  # a world of one
    try:
        bn = torch.nn.BatchNorm1d(3)
        fb = FlatBuffers(bn)
        bn(torch.randn(8, 3))  # updates running stats in place: inside the flat tensor
        assert torch.equal(fb.flats[0][:3], bn.running_mean)
        bn.running_mean = torch.full((3,), 7.0)  # replaced by assignment
        fb.broadcast(src=0)                      # noticed: laid out again before sending
        assert torch.equal(fb.flats[0][:3], torch.full((3,), 7.0))
        assert bn.running_mean.data_ptr() == fb.flats[0].data_ptr()
    finally:
        minidist.shutdown()


def test_buffer_pool_reuses_buffers_for_any_smaller_request():
    from minidist.parallel.buckets import BufferPool
    pool = BufferPool(capacity=100)
    a = pool.get(40, torch.float32, torch.device("cpu"))
    assert a.numel() == 40
    b = pool.get(100, torch.float32, torch.device("cpu"))
    assert len(pool.tensors()) == 2
    pool.put(a)
    c = pool.get(90, torch.float32, torch.device("cpu"))  # served by a's buffer (capacity 100)
    assert c.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    pool.put(b)
    pool.put(c)
    assert len(pool.tensors()) == 2 and all(t.numel() == 100 for t in pool.tensors())
    d = pool.get(10, torch.float16, torch.device("cpu"))  # another dtype: a new buffer
    assert d.dtype == torch.float16 and len(pool.tensors()) == 3


def test_reach_closing_is_native_ddps_layout():
    """closing="reach": a bucket closes once it reaches its cap (so it may exceed it by its last
    tensor), and no separate small last bucket: what torch's reducer does with the same caps."""
    params = [torch.zeros(1024), torch.zeros(256), torch.zeros(1024), torch.zeros(4), torch.zeros(1024)]  # 4 KB each
    order = [4, 3, 2, 1, 0]
    at_most = plan_buckets(params, order, cap_bytes=4 * KB, first_cap_bytes=4 * KB)
    reach = plan_buckets(params, order, cap_bytes=4 * KB, first_cap_bytes=4 * KB, closing="reach")
    assert reach == [[4], [3, 2], [1, 0]]
    assert len(at_most) > len(reach)
    native = torch.distributed._compute_bucket_assignment_by_size([params[i] for i in order], [4 * KB])
    assert [[order[j] for j in bucket] for bucket in native[0]] == reach
