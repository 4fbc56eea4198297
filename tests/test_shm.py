"""minidist.comm's shared-memory collectives (comm/shm.py) against gloo's, and their failure rules:
a dead, stuck or mismatched peer fails the collective naming the rank; nothing stays in /dev/shm;
a missing or full /dev/shm falls back to gloo with one line.
"""

import contextlib
import copy
import io
import mmap
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from minidist import comm
from minidist.comm import ring, shm

SLOT = 4096  # bytes per slot in these tests: every size below goes through in several pieces


def rank_input(rank: int, numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * seed + rank))


def in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0] + parts[1]
    for p in parts[2:]:
        total = total + p
    return total


def check_against_gloo():
    """Each collective through shm (small slots, so in pieces) against gloo's on the same group, and
    the sum against the rank-order sum: bitwise at any world size (gloo's own at 2 ranks); half
    precision summed in fp32, rounded once."""
    saved, shm.SLOT_BYTES = shm.SLOT_BYTES, SLOT
    try:
        group = dist.new_group(list(range(dist.get_world_size())))  # a new segment with the small slots
        assert comm.choose_algorithm("all_reduce", group, "auto") == "shm"
    finally:
        shm.SLOT_BYTES = saved
    r, n, failures = dist.get_rank(), dist.get_world_size(), []
    dist.barrier(group)  # rank 0 unlinks the file after the set-up's last exchange
    leftover = [p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}*")]
    for numel in (0, 1, 5, 1000, 3001 * n):
        mine, everyone = rank_input(r, numel), [rank_input(q, numel) for q in range(n)]
        got, gloo = mine.clone(), mine.clone()
        comm.all_reduce(got, group=group, algorithm="shm")
        comm.all_reduce(gloo, group=group, algorithm="backend")
        if not torch.equal(got, in_rank_order(everyone)) or (n == 2 and not torch.equal(got, gloo)):
            failures.append(("all_reduce", numel))
        got = mine.clone()
        comm.all_reduce(got, op=dist.ReduceOp.MAX, group=group, algorithm="shm", async_op=True).wait()
        if numel and not torch.equal(got, torch.stack(everyone).amax(0)):
            failures.append(("all_reduce max", numel))
        m = numel // n
        out, ref = torch.empty(m), torch.empty(m)
        comm.reduce_scatter_tensor(out, mine[:n * m], group=group, algorithm="shm")
        comm.reduce_scatter_tensor(ref, mine[:n * m], group=group, algorithm="backend")
        if not torch.equal(out, in_rank_order([x[r * m:(r + 1) * m] for x in everyone])) or (
                n == 2 and not torch.equal(out, ref)):
            failures.append(("reduce_scatter", numel))
        full, ref = torch.empty(n * m), torch.empty(n * m)
        handle = comm.all_gather_into(full, mine[:m], group=group, algorithm="shm", async_op=True)
        comm.all_gather_into(ref, mine[:m], group=group, algorithm="backend")
        handle.wait()
        if not torch.equal(full, ref):
            failures.append(("all_gather", numel))
        got = mine.clone()
        comm.broadcast(got, src=n - 1, group=group, algorithm="shm")
        if not torch.equal(got, everyone[n - 1]):
            failures.append(("broadcast", numel))
    for dtype, tiny in ((torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)):  # half an ulp of 1
        # Rank 0 holds 1, the others half an ulp each: summed in fp32 and rounded once they count
        # (1 + 2 halves = 1 ulp at 3 ranks), where rounding after each addition loses every one.
        mine = torch.full((2 * n,), 1.0 if r == 0 else tiny, dtype=dtype)
        once = torch.tensor(1.0 + (n - 1) * tiny).to(dtype)
        got, gloo, rows = mine.clone(), mine.clone(), torch.empty(2, dtype=dtype)
        comm.all_reduce(got, group=group, algorithm="shm")
        comm.all_reduce(gloo, group=group, algorithm="backend")
        comm.reduce_scatter_tensor(rows, mine, group=group, algorithm="shm")
        if not ((got == once).all() and (rows == once).all()) or (n == 2 and not torch.equal(got, gloo)):
            failures.append((f"all_reduce / reduce_scatter {dtype}", 2 * n))
    strided = rank_input(r, 64).view(8, 8)[:, ::2]  # not contiguous: through a copy, written back
    comm.all_reduce(strided, group=group, algorithm="shm")
    if not torch.equal(strided, in_rank_order([rank_input(q, 64).view(8, 8)[:, ::2] for q in range(n)])):
        failures.append(("all_reduce strided", 32))
    return failures + all_reduce_in_shared_memory(group), leftover


def all_reduce_in_shared_memory(group) -> list:
    """A tensor every rank maps (shm.shared_zeros, as DataParallel's buckets), or a slice of one:
    each rank reads the others' in place, no slots; the same bits as through the slots. Its
    segment goes with its last tensor."""
    r, n, failures, labels = dist.get_rank(), dist.get_world_size(), [], []
    listen = lambda label, *_: labels.append(label)  # noqa: E731
    ring.span_listeners.append(listen)
    try:
        shared = shm.shared_zeros(3001 * n, torch.float32, group)
        halves = shm.shared_zeros(2 * n, torch.bfloat16, group)
        zeros = torch.equal(shared, torch.zeros(3001 * n))
        for what, part, op in (("sum", shared, dist.ReduceOp.SUM), ("slice", shared[7:1007], dist.ReduceOp.SUM),
                               ("max", shared, dist.ReduceOp.MAX), ("bf16", halves, dist.ReduceOp.SUM)):
            part.copy_(rank_input(r, part.numel(), seed=3) if what != "bf16" else 1.0 if r == 0 else 2.0 ** -8)
            through_slots = part.clone()
            comm.all_reduce(through_slots, op=op, group=group, algorithm="shm")
            comm.all_reduce(part, op=op, group=group, algorithm="auto", async_op=True).wait()
            if not (zeros and torch.equal(part, through_slots)):
                failures.append(("all_reduce in shared memory", what))
    finally:
        ring.span_listeners.remove(listen)
    if labels.count("shm:all_reduce shared") != 4 or labels.count("shm:all_reduce") != 4:
        failures.append(("all_reduce in shared memory: not read in place", labels))
    ch = shm.channel(group, "auto")
    del shared, halves, part
    shm._shared_at(ch, torch.ones(1))  # (forgets the segments no tensor holds)
    if ch.shared:
        failures.append(("a shared segment outlived its tensors", len(ch.shared)))
    return failures


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shm_collectives_equal_gloo_and_the_rank_order_sum(world_size, ranks):
    results = ranks(world_size).run(check_against_gloo, timeout_s=60)
    assert [failures for failures, _ in results] == [[]] * world_size
    assert [leftover for _, leftover in results] == [[]] * world_size  # unlinked once every rank mapped it


def ddp_uses_shm():
    """DataParallel's default ("auto") reduces through shared memory on one host, its buckets in
    memory the other rank reads in place, and its gradients are bitwise native DDP's at 2 ranks."""
    from torch.nn.parallel import DistributedDataParallel

    import minidist

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    native = DistributedDataParallel(copy.deepcopy(net))
    ours = minidist.DataParallel(net)
    x = rank_input(dist.get_rank(), 16 * 32, seed=5).view(16, 32)
    with comm.CommTracer() as tracer:
        ours(x).square().sum().backward()
    native(x).square().sum().backward()
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(net.parameters(), native.module.parameters()))
    in_place = all(shm._shared_at(shm.channel(None, "auto"), b.buffer) for b in ours._buckets)
    return {r.algorithm for r in tracer.records if r.op == "all_reduce"}, in_place, same


def test_data_parallel_reduces_through_shm_bitwise_as_native_ddp(ranks):
    assert ranks(2).run(ddp_uses_shm, timeout_s=60) == [({"shm"}, True, True)] * 2


# --------------------------------------------------------------------------- failure rules, in one process


def _pair(tmp_path: Path, timeout_s: float = 5.0):
    """A two-rank segment: this process is rank 0; the returned function starts rank 1 in a child."""
    size = shm.header_bytes(2) + 2 * 2 * SLOT
    path = tmp_path / "segment"
    path.write_bytes(b"\0" * size)
    mm = mmap.mmap(os.open(path, os.O_RDWR), size)
    return mm, lambda pids: shm.Channel(mm, [0, 1], 0, pids, timeout_s, SLOT)


def _child(mm, body) -> int:
    """Run body() in a forked child; it exits 1 if body raised."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            body()
            code = 0
        finally:
            os._exit(code)
    return pid


@pytest.mark.parametrize("peer", ["killed", "stuck", "mismatched"])
def test_a_failed_peer_fails_the_collective_naming_it(peer, tmp_path):
    mm, channel = _pair(tmp_path, timeout_s=1.0)
    me = os.getpid()

    def rank1():
        ch = shm.Channel(mm, [0, 1], 1, [me, os.getpid()], 5.0, SLOT)
        if peer == "killed":  # after the first of the three pieces
            ch.barrier("all_reduce", shm._descriptor("all_reduce", 3 * SLOT // 4, torch.float32, dist.ReduceOp.SUM))
            os.kill(os.getpid(), 9)
        elif peer == "stuck":
            time.sleep(3)
        else:
            shm._all_gather(ch, torch.empty(2 * 7), torch.ones(7))

    pid = _child(mm, rank1)
    ch = channel([me, pid])
    began = time.monotonic()
    with pytest.raises(RuntimeError) as failure:
        shm._all_reduce(ch, torch.ones(3 * SLOT // 4), dist.ReduceOp.SUM)
    took = time.monotonic() - began
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    assert {"killed": f"rank 1 (pid {pid}) exited", "stuck": "rank 1 did not arrive within 1 s",
            "mismatched": "rank 1 issued a different collective"}[peer] in str(failure.value)
    assert took < 2.0
    with pytest.raises(RuntimeError, match="rank 1"):  # the segment's state is unknown: later calls fail too
        shm._broadcast(ch, torch.ones(4), 0)


def test_stale_segments_of_dead_runs_go_and_live_ones_stay(tmp_path):
    """(minidist.dist.remove_left_by_dead, as shm's set-up calls it; the launcher's folders: test_rss.py)"""
    from minidist.dist import remove_left_by_dead

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"{shm.PREFIX}{dead.pid}-abcd").write_bytes(b"x")
    (tmp_path / f"{shm.PREFIX}{os.getpid()}-abcd").write_bytes(b"x")
    (tmp_path / f"{shm.PREFIX}abcd").write_bytes(b"x")  # no owner's pid in its name: not ours to judge
    (tmp_path / "someone-elses").write_bytes(b"x")
    remove_left_by_dead(tmp_path, shm.PREFIX)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{shm.PREFIX}{os.getpid()}-abcd", f"{shm.PREFIX}abcd",
                                                          "someone-elses"]


def falls_back(shm_dir: str):
    """A new group's first collective with /dev/shm at `shm_dir`: the algorithm used, gloo's
    result, and what the rank printed."""
    shm.SHM_DIR, shm._warned, printed = Path(shm_dir), False, io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            group = dist.new_group(list(range(dist.get_world_size())))
            chosen = comm.choose_algorithm("all_reduce", group, "shm")
            t = torch.full((5,), float(dist.get_rank() + 1))
            comm.all_reduce(t, group=group, algorithm="shm")
    finally:
        shm.SHM_DIR = Path("/dev/shm")
    return chosen, t.tolist(), printed.getvalue().splitlines()


def test_a_missing_dev_shm_falls_back_to_gloo_with_one_line(ranks):
    (chosen, summed, lines), other = ranks(2).run(falls_back, "/nonexistent/shm", timeout_s=60)
    assert (chosen, summed) == ("backend", [3.0] * 5) and other == (chosen, summed, [])
    assert lines == ["minidist: shared-memory collectives unavailable (/nonexistent/shm: No such file or directory): "
                     "using gloo"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tiny tmpfs (a full /dev/shm) needs root")
def test_a_full_dev_shm_falls_back_to_gloo(ranks):
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d], check=True)
        try:
            (chosen, summed, lines), _ = ranks(2).run(falls_back, d, timeout_s=60)
            assert (chosen, summed) == ("backend", [3.0] * 5) and "No space left on device" in lines[0]
            assert os.listdir(d) == []
        finally:
            subprocess.run(["umount", d], check=True)


def test_every_sleeping_waiter_is_woken_by_the_arrival(tmp_path, monkeypatch):
    """Ranks 0 and 1 sleep on rank 2's word (past their spins); rank 2's arrival must wake both at
    once, not one (FUTEX_WAKE's count), the other left to its timed check. A waiter woken by an
    arrival goes on without reading /proc (its peer's liveness: only after a wait that saw none)."""
    monkeypatch.setattr(shm, "SPINS", 0)
    monkeypatch.setattr(shm, "YIELDS", 0)
    monkeypatch.setattr(shm, "CHECK_S", 6.0)
    checked = []
    monkeypatch.setattr(shm, "process_alive", lambda pid: checked.append(pid) or True)
    size = shm.header_bytes(3) + 2 * 3 * SLOT
    (tmp_path / "segment").write_bytes(b"\0" * size)
    mm = mmap.mmap(os.open(tmp_path / "segment", os.O_RDWR), size)
    pids = [os.getpid(), 0, 0]

    def rank(r, delay):
        def body():
            time.sleep(delay)
            began = time.monotonic()
            shm.Channel(mm, [0, 1, 2], r, pids, 30.0, SLOT).barrier("test", 7)
            os._exit(0 if time.monotonic() - began < 5.0 else 1)
        return body

    pids[2] = _child(mm, rank(2, 0.5))  # long enough for ranks 0 and 1 to be asleep
    pids[1] = _child(mm, rank(1, 0.0))  # (forked last: it knows every pid, as it checks they live)
    began = time.monotonic()
    shm.Channel(mm, [0, 1, 2], 0, pids, 30.0, SLOT).barrier("test", 7)
    took = time.monotonic() - began
    assert [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids[1:]] == [0, 0]
    assert took < 5.0 and checked == []
