"""Collectives through shared memory, for the ranks of a gloo group that share one host: each rank
copies its piece into its slot of one segment per group, waits at a barrier, and reads what it
needs straight from the others' slots. Memory bandwidth is the limit, not loopback TCP.

    comm.all_reduce(t, algorithm="shm")    # or "auto": shm wherever every rank is on this host

Sums run in rank order (((x0 + x1) + x2) + ...) on every rank alike: bitwise what gloo gives at
2 ranks, deterministic beyond. The segment, the barrier and the failure rules: docs/internals.md,
"comm/shm.py".
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import secrets
import socket
import time
import weakref
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.comm import ring
from minidist.dist import process_alive, remove_left_by_dead

SHM_DIR = Path(os.environ.get("MINIDIST_SHM_DIR", "/dev/shm"))
PREFIX = "minidist-shm-"
SLOT_BYTES = 2 << 20  # per rank and per set of slots: a larger collective goes through in pieces
LINE = 64  # each rank's barrier count and piece descriptors on a cache line of their own
# A waiting barrier looks SPINS times in a tight loop (~2 us here), then until YIELDS looks giving
# the CPU away between them (~0.25 ms: the peer, or this rank's training thread, may need this
# core), then sleeps on the futex: a sleeper's wake-up costs more than a small collective.
SPINS, YIELDS = 50, 1000
CHECK_S = 0.05  # a sleeping waiter wakes this often to see whether the rank it waits for still lives
_SYS_FUTEX = {"x86_64": 202}.get(platform.machine())  # x86-64's stores are seen in order: no fences needed
REDUCE = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.PRODUCT: torch.mul,
           dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum}
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex(word: ctypes.c_int64, op: int, value: int, seconds: float = 0.0) -> None:
    """FUTEX_WAIT (op 0: sleep while the word's low half is `value`, at most `seconds`) or
    FUTEX_WAKE (op 1: wake every sleeper). Shared, not private: the sleepers are other processes."""
    ts = _Timespec(int(seconds), int(seconds % 1 * 1e9))
    _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(ctypes.addressof(word)), ctypes.c_int(op),
                  ctypes.c_uint32(value & 0xFFFFFFFF), ctypes.byref(ts) if op == 0 else None, None, ctypes.c_int(0))


class Channel:
    """One group's segment: per rank a line [barriers passed, two piece descriptors], then two sets
    of one slot per rank. Piece k uses set k % 2, so a rank may fill the next piece's slot while
    the others still read this one; the barrier of piece k+1 proves they finished piece k."""

    def __init__(self, mm: mmap.mmap, ranks: list[int], me: int, pids: list[int], timeout_s: float,
                 slot_bytes: int):
        self.mm, self.ranks, self.me, self.pids, self.timeout_s = mm, ranks, me, pids, timeout_s
        self.slot_bytes = slot_bytes
        self.lines = [(ctypes.c_int64 * 3).from_buffer(mm, LINE * q) for q in range(len(ranks))]
        self.passed = self.pieces = 0  # barriers passed, pieces begun
        self.error: str | None = None
        self.shared: list[tuple[weakref.ref, int, int]] = []  # shared_zeros': (segment, bytes a rank, my address)

    def next_slots(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The slots of the next piece, one per rank, as `dtype` (views made per piece: the segment
        is not a tensor that lives on, so memory counts of live tensors leave it out)."""
        n, size = len(self.ranks), self.slot_bytes
        self.pieces += 1
        slots = torch.frombuffer(self.mm, dtype=torch.uint8, count=n * size,
                                 offset=header_bytes(n) + self.pieces % 2 * n * size)
        return [s.view(dtype) for s in slots.view(n, size)]

    def barrier(self, what: str, descriptor: int) -> None:
        """Arrive (this piece's slot filled), then wait for every rank: each must have arrived with
        the same descriptor (the same collective and size), be alive, and arrive in time."""
        if self.error:
            raise RuntimeError(self.error)
        self.passed += 1
        mine = self.lines[self.me]
        mine[1 + self.passed % 2] = descriptor  # before the count: whoever sees the count sees it
        mine[0] = self.passed
        _futex(mine, 1, 0x7FFFFFFF)  # wake every sleeper
        deadline = time.monotonic() + self.timeout_s
        for q, line in enumerate(self.lines):
            spins = 0
            while (seen := line[0]) < self.passed:
                spins += 1
                if SPINS < spins <= YIELDS:
                    os.sched_yield()  # (lets go of the GIL too)
                elif spins > YIELDS:
                    _futex(line, 0, seen, CHECK_S)
                    if line[0] != seen:  # woken by its arrival: reading /proc costs more than a small collective
                        continue
                    if not process_alive(self.pids[q]):
                        self._fail(f"shared-memory {what}: peer rank {self.ranks[q]} (pid {self.pids[q]}) exited "
                                   "mid-collective")
                    if time.monotonic() > deadline:
                        self._fail(f"shared-memory {what} timed out: rank {self.ranks[q]} did not arrive within "
                                   f"{self.timeout_s:g} s (it is stuck or issued another collective)")
            if line[1 + self.passed % 2] != descriptor:
                self._fail(f"shared-memory {what} on rank {self.ranks[self.me]}, but rank {self.ranks[q]} issued a "
                           "different collective or size: every rank must issue the same collectives in order")

    def _fail(self, message: str):
        self.error = message  # the segment's state is unknown now: every later call fails alike
        raise RuntimeError(message)


def header_bytes(n: int) -> int:
    return -(-LINE * n // 4096) * 4096  # the slots start page-aligned: any dtype views them


_channels: dict = {}  # group (None: the world) -> Channel, or None where shm cannot run
_warned = False


def _host() -> str:
    """What two ranks on the same host (and the same /dev/shm) share, and emulated hosts (network
    namespaces: scripts/lib/netns.sh) do not."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    shm_dev = os.stat(SHM_DIR).st_dev if SHM_DIR.is_dir() else -1
    return f"{socket.gethostname()}/{boot}/{os.stat('/proc/self/ns/net').st_ino}/{shm_dev}"


def _timeout_s(group) -> float:
    try:
        return (group or dist.group.WORLD)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return 1800.0  # torch's default for gloo


def _segment(group, size: int) -> tuple[mmap.mmap, list[int]] | str:
    """A shared segment of `size` bytes that every rank of `group` maps (a collective), and the
    ranks' pids; or why there is none. The file is unlinked as soon as every rank has mapped it,
    so nothing stays in /dev/shm whatever happens to the ranks later."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    path, problem = None, None
    if me == 0:
        try:
            remove_left_by_dead(SHM_DIR, PREFIX)  # (a creator killed within its set-up)
            path = SHM_DIR / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # room now, or ENOSPC now: never SIGBUS mid-collective
            finally:
                os.close(fd)
        except OSError as e:
            problem = f"{SHM_DIR}: {e.strerror or e}"
    infos = [None] * n
    dist.all_gather_object(infos, (_host(), os.getpid(), str(path) if path else None, problem), group=group)
    problem = infos[0][3] or (None if len({i[0] for i in infos}) == 1 else "the ranks are on different hosts")
    mm = None
    if problem is None:
        try:
            with open(infos[0][2], "r+b") as f:
                mm = mmap.mmap(f.fileno(), size)
        except OSError as e:
            problem = f"{infos[0][2]}: {e.strerror or e}"
    problems = [None] * n
    dist.all_gather_object(problems, problem, group=group)
    if path is not None and path.exists():
        path.unlink()
    problem = next((p for p in problems if p), None)
    return problem if problem is not None else (mm, [i[1] for i in infos])


def _open(group) -> Channel | str:
    """Set up `group`'s channel (every rank of the group calls this at the same collective), or why there is none."""
    n = dist.get_world_size(group)
    got = _segment(group, header_bytes(n) + 2 * n * SLOT_BYTES)
    if isinstance(got, str):
        return got
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    return Channel(got[0], ranks, dist.get_rank(group), got[1], _timeout_s(group), SLOT_BYTES)


def channel(group, requested: str) -> Channel | None:
    """`group`'s channel, set up at its first use (a collective of the group), or None: the group is
    not gloo's, has one rank, or its ranks cannot share memory (then one line says why, where
    shm was asked for by name or /dev/shm let us down)."""
    global _warned
    key = group if group is not None else dist.group.WORLD
    if key not in _channels:
        if _SYS_FUTEX is None or dist.get_backend(group) != "gloo" or dist.get_world_size(group) == 1:
            _channels[key] = None
        else:
            got = _open(group)
            _channels[key] = got if isinstance(got, Channel) else None
            if not isinstance(got, Channel) and dist.get_rank(group) == 0 and not _warned and (
                    requested == "shm" or "different hosts" not in got):
                _warned = True
                print(f"minidist: shared-memory collectives unavailable ({got}): using gloo", flush=True)
    return _channels[key]


def shared_zeros(numel: int, dtype: torch.dtype, group) -> torch.Tensor:
    """A zeroed 1-D CPU tensor in a segment every rank of `group` maps (a collective): all_reduce
    on it, or on a contiguous slice of it, skips the slots (each rank sums its chunk straight from
    the others' tensors: half the memory traffic). Where the group has no channel or no segment
    can be had, a private tensor (one line says why)."""
    global _warned
    ch = channel(group, "shm")
    nbytes = -(-numel * dtype.itemsize // 4096) * 4096  # each rank's part page-aligned
    if ch is None or numel == 0:
        return torch.zeros(numel, dtype=dtype)
    got = _segment(group, len(ch.ranks) * nbytes)
    if isinstance(got, str):
        if ch.me == 0 and not _warned:
            _warned = True
            print(f"minidist: shared-memory buffers unavailable ({got}): copying through the slots", flush=True)
        return torch.zeros(numel, dtype=dtype)
    mine = torch.frombuffer(got[0], dtype=dtype, count=numel, offset=ch.me * nbytes)
    ch.shared.append((weakref.ref(got[0]), nbytes, mine.data_ptr()))  # (weak: the segment goes with its tensors)
    return mine


def _shared_at(ch: Channel, t: torch.Tensor) -> tuple[mmap.mmap, int, int] | None:
    """Where `t` (shared_zeros' or a slice of it) lies: (its segment, bytes a rank, its offset in
    this rank's part); None where it is not shared."""
    ch.shared = [entry for entry in ch.shared if entry[0]() is not None]
    size = t.numel() * t.element_size()
    for ref, nbytes, base in ch.shared:
        offset = t.data_ptr() - base
        if size and t.is_contiguous() and t.device.type == "cpu" and 0 <= offset <= nbytes - size and \
                (mm := ref()) is not None:
            return mm, nbytes, offset
    return None


def _descriptor(op: str, *shape) -> int:
    return zlib.crc32(repr((op, *shape)).encode())


def _reduce_into(out: torch.Tensor, parts: list[torch.Tensor], op) -> None:
    """out = ((parts[0] op parts[1]) op parts[2]) ...: the same order on every rank. Half precision
    is summed in fp32 and rounded once (as torch adds two halves: bitwise gloo's at 2 ranks)."""
    fn = REDUCE[op]
    if len(parts) > 2 and out.dtype in (torch.bfloat16, torch.float16):
        acc = parts[0].float()
        for p in parts[1:]:
            fn(acc, p, out=acc)
        out.copy_(acc)
        return
    fn(parts[0], parts[1], out=out)
    for p in parts[2:]:
        fn(out, p, out=out)


def _chunks(m: int, n: int) -> list[slice]:
    """Rank q's chunk of `m` elements, as an all_reduce beyond 2 ranks splits them (the last may be short or empty)."""
    c = -(-m // n)
    return [slice(min(q * c, m), min((q + 1) * c, m)) for q in range(n)]


def _all_reduce(ch: Channel, flat: torch.Tensor, op) -> None:
    """At 2 ranks each sums the whole piece (fewer bytes than a reduce_scatter and an all_gather,
    one barrier); beyond, rank r sums chunk r of it, publishes that, and copies the others' chunks
    (every rank reading every slot whole would cost n times the bytes)."""
    n, desc = len(ch.ranks), _descriptor("all_reduce", flat.numel(), flat.dtype, op)
    for a, b in ring.piece_bounds(flat.numel(), flat.element_size(), ch.slot_bytes):
        piece, slots = flat[a:b], [s[:b - a] for s in ch.next_slots(flat.dtype)]
        slots[ch.me].copy_(piece)
        ch.barrier("all_reduce", desc)
        if n == 2:
            _reduce_into(piece, slots, op)
            continue
        chunk = _chunks(b - a, n)
        _reduce_into(piece[chunk[ch.me]], [s[chunk[ch.me]] for s in slots], op)
        slots[ch.me][chunk[ch.me]].copy_(piece[chunk[ch.me]])
        ch.barrier("all_reduce", desc)
        for q in range(n):
            if q != ch.me:
                piece[chunk[q]].copy_(slots[q][chunk[q]])


def _all_reduce_shared(ch: Channel, t: torch.Tensor, where: tuple[mmap.mmap, int, int], op) -> None:
    """All_reduce of shared_zeros' `t`, no slots: rank r reduces chunk r of every rank's tensor
    into its own, then copies each other chunk from its owner's. The last barrier keeps every
    tensor as it is until every rank has read it."""
    mm, nbytes, offset = where
    n, m, size = len(ch.ranks), t.numel(), t.element_size()

    def of(q: int, a: int, b: int) -> torch.Tensor:  # rank q's t[a:b], viewed piece by piece: the
        return t[a:b] if q == ch.me else torch.frombuffer(  # others' memory is not this rank's live tensors
            mm, dtype=t.dtype, count=b - a, offset=q * nbytes + offset + a * size)

    desc = _descriptor("all_reduce shared", m, t.dtype, op)
    pieces = [[(c.start + a, c.start + b) for a, b in ring.piece_bounds(c.stop - c.start, size, ch.slot_bytes)]
              for c in _chunks(m, n)]
    ch.barrier("all_reduce", desc)
    for a, b in pieces[ch.me]:
        target = t[a:b] if n == 2 else torch.empty(b - a, dtype=t.dtype)  # (beyond 2: an addend overwritten)
        _reduce_into(target, [of(q, a, b) for q in range(n)], op)
        if n > 2:
            t[a:b].copy_(target)
    ch.barrier("all_reduce", desc)
    for q in (q for q in range(n) if q != ch.me):
        for a, b in pieces[q]:
            t[a:b].copy_(of(q, a, b))
    ch.barrier("all_reduce", desc)


def _reduce_scatter(ch: Channel, out: torch.Tensor, inp: torch.Tensor, op) -> None:
    n, m = len(ch.ranks), out.numel()
    rows, desc = inp.view(n, m), _descriptor("reduce_scatter", m, out.dtype, op)
    for a, b in ring.piece_bounds(m, out.element_size(), ch.slot_bytes // n):
        slots = [s[:n * (b - a)].view(n, b - a) for s in ch.next_slots(out.dtype)]
        slots[ch.me].copy_(rows[:, a:b])
        ch.barrier("reduce_scatter", desc)
        _reduce_into(out[a:b], [s[ch.me] for s in slots], op)


def _all_gather(ch: Channel, out: torch.Tensor, inp: torch.Tensor, _=None) -> None:
    n, m = len(ch.ranks), inp.numel()
    rows, desc = out.view(n, m), _descriptor("all_gather", m, inp.dtype)
    for a, b in ring.piece_bounds(m, inp.element_size(), ch.slot_bytes):
        slots = [s[:b - a] for s in ch.next_slots(inp.dtype)]
        slots[ch.me].copy_(inp[a:b])
        ch.barrier("all_gather", desc)
        for q in range(n):
            rows[q, a:b].copy_(inp[a:b] if q == ch.me else slots[q])


def _broadcast(ch: Channel, flat: torch.Tensor, src: int) -> None:
    desc = _descriptor("broadcast", flat.numel(), flat.dtype, src)
    for a, b in ring.piece_bounds(flat.numel(), flat.element_size(), ch.slot_bytes):
        slot = ch.next_slots(flat.dtype)[src][:b - a]
        if ch.me == src:
            slot.copy_(flat[a:b])
        ch.barrier("broadcast", desc)
        if ch.me != src:
            flat[a:b].copy_(slot)


def run(op: str, group, async_op: bool, *tensors, arg=None):
    """Run collective `op` ("all_reduce", "reduce_scatter", "all_gather", "broadcast") on `group`'s
    channel (set up already: channel()), in issue order on the group's own worker (ring.run): in
    place where the tensors are contiguous, else through a contiguous copy written back at the
    end. `arg`: the ReduceOp, or broadcast's source as a rank of the group."""
    ch = _channels[group if group is not None else dist.group.WORLD]
    if op == "all_reduce" and (where := _shared_at(ch, tensors[0])) is not None:
        return ring.run(lambda: _all_reduce_shared(ch, tensors[0], where, arg), async_op, "shm:all_reduce shared",
                        queue=ch)
    flats = [t if t.is_contiguous() else t.contiguous() for t in tensors]

    def job():
        _OPS[op](ch, *(f.view(-1) for f in flats), arg)
        if flats[0] is not tensors[0]:
            tensors[0].copy_(flats[0])
    return ring.run(job, async_op, f"shm:{op}", queue=ch)


_OPS = {"all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter, "all_gather": _all_gather, "broadcast": _broadcast}
