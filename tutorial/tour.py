"""A guided, verified walk through every torch.distributed primitive data parallelism is made of.

    python recipes/tour.py                       # launches 2 local ranks itself
    python recipes/tour.py nproc=4               # ... or 4
    torchrun --nproc_per_node 3 recipes/tour.py  # under torchrun (any N >= 2)

Each step prints what every rank held before and after, a line or two on what
happened, and checks the result against a reference computed locally. The
tour ends non-zero if any step fails verification on any rank.
"""

from __future__ import annotations

import time

import torch
from omegaconf import OmegaConf

import minidist
from minidist import comm
from minidist.train.app import run_recipe


# --------------------------------------------------------------------------- presentation


def fmt(t: torch.Tensor | None) -> str:
    if t is None or t.numel() == 0:
        return "-"
    vals = t.flatten().tolist()
    return "[" + " ".join(f"{v:g}" for v in vals) + "]"


class Tour:
    def __init__(self, ctx: minidist.DistContext, cfg):
        self.ctx, self.cfg = ctx, cfg
        self.rank, self.n, self.dev = ctx.rank, ctx.world_size, ctx.device
        self.failed: list[str] = []
        self.step_no = 0

    def tensor(self, values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.float32, device=self.dev)

    def step(self, title: str, before, after, expected, explain: str) -> None:
        """Print a per-rank before/after table and verify `after` against `expected` on every rank."""
        self.step_no += 1
        ok = expected is None or (after is not None and torch.equal(after.cpu(), expected.cpu()))
        rows = comm.all_gather_object((fmt(before), fmt(after), ok))
        all_ok = all(r[2] for r in rows)
        if self.rank == 0:
            width = max(12, *(len(r[0]) for r in rows)) + 2
            print(f"\n== {self.step_no}. {title}")
            print(f"   {'rank':<6}{'before':<{width}}after")
            for r, (b, a, _) in enumerate(rows):
                print(f"   {r:<6}{b:<{width}}{a}")
            for line in explain.strip().splitlines():
                print(f"   {line.strip()}")
            print(f"   {'verified' if all_ok else 'FAILED'} on all {self.n} ranks" if all_ok
                  else f"   FAILED on ranks {[r for r, row in enumerate(rows) if not row[2]]}")
        if not all_ok:
            self.failed.append(title)

    def note(self, text: str) -> None:
        if self.rank == 0:
            for line in text.strip().splitlines():
                print(f"   {line.strip()}")

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    # ----------------------------------------------------------------------- steps

    def point_to_point(self) -> None:
        r, n = self.rank, self.n
        t = self.tensor([r * 10 + 1, r * 10 + 2]) if r == 0 else torch.zeros(2, device=self.dev)
        before = t.clone()
        if r == 0:
            comm.send(t, dst=1)
        elif r == 1:
            comm.recv(t, src=0)
        expected = self.tensor([1, 2]) if r in (0, 1) else before
        self.step("send / recv: rank 0 sends to rank 1", before, t, expected,
                  "send blocks until the message is handed over; recv blocks until it arrives.\n"
                  "Only the two ranks named take part; the others are idle.")

        mine = self.tensor([r, r])
        got = torch.full((2,), -1.0, device=self.dev)
        left, right = (r - 1) % n, (r + 1) % n
        reqs = [comm.irecv(got, src=left), comm.isend(mine, dst=right)]
        for req in reqs:
            req.wait()
        self.step("isend / irecv: every rank passes its tensor to the right (a ring shift)", mine, got,
                  self.tensor([left, left]),
                  "Both calls return at once with a request; req.wait() blocks until that one transfer is\n"
                  "done. Posting all sends and receives before waiting is what makes a ring safe.")

    def one_to_all(self) -> None:
        r, n = self.rank, self.n
        t = self.tensor([7, 8, 9]) if r == 0 else torch.zeros(3, device=self.dev)
        before = t.clone()
        comm.broadcast(t, src=0)
        self.step("broadcast from rank 0", before, t, self.tensor([7, 8, 9]),
                  "Rank 0's tensor is copied to every rank: how DDP makes all replicas start equal.")

        chunks = [self.tensor([10 * q, 10 * q + 1]) for q in range(n)]
        out = torch.zeros(2, device=self.dev)
        comm.scatter(out, chunks if r == 0 else None, src=0)
        self.step("scatter from rank 0", torch.cat(chunks) if r == 0 else None, out, chunks[r],
                  "Rank 0 holds one chunk per rank; rank q receives chunk q.")

    def all_to_one(self) -> None:
        r, n = self.rank, self.n
        t = self.tensor([r + 1, 10 * (r + 1)])
        before = t.clone()
        comm.reduce(t, dst=0)
        total = self.tensor([sum(q + 1 for q in range(n)), sum(10 * (q + 1) for q in range(n))])
        self.step("reduce (sum) to rank 0", before, t, total if r == 0 else None,
                  "Rank 0 receives the element-wise sum. The other ranks' buffers are scratch space\n"
                  "afterwards: do not rely on their contents.")

        mine = self.tensor([r, r * r])
        gathered = [torch.zeros(2, device=self.dev) for _ in range(n)] if r == 0 else None
        comm.gather(mine, gathered, dst=0)
        after = torch.cat(gathered) if r == 0 else None
        expected = torch.cat([self.tensor([q, q * q]) for q in range(n)]) if r == 0 else None
        self.step("gather to rank 0", mine, after, expected,
                  "Rank 0 receives every rank's tensor, in rank order.")

    def all_to_all(self) -> None:
        r, n = self.rank, self.n
        t = self.tensor([r + 1, 2 * (r + 1)])
        before = t.clone()
        comm.all_reduce(t)
        s = sum(q + 1 for q in range(n))
        self.step("all_reduce (sum)", before, t, self.tensor([s, 2 * s]),
                  "Every rank ends with the sum: DDP averages gradients this way (sum, then / n).\n"
                  "A ring all_reduce sends 2(n-1)/n of the tensor per rank, whatever n is.")

        mine = self.tensor([r, -r])
        out = torch.zeros(2 * n, device=self.dev)
        comm.all_gather_into(out, mine)
        self.step("all_gather", mine, out, torch.cat([self.tensor([q, -q]) for q in range(n)]),
                  "Every rank ends with every rank's tensor: ZeRO-3 rebuilds a layer's weights this way.\n"
                  "Each rank sends (n-1)/n of the gathered size.")

        full = self.tensor([10 * r + q for q in range(n)])  # element q is destined for rank q
        out = torch.zeros(1, device=self.dev)
        comm.reduce_scatter_tensor(out, full)
        self.step("reduce_scatter (sum)", full, out, self.tensor([sum(10 * q + r for q in range(n))]),
                  "Rank q receives the sum over ranks of slice q: ZeRO-2 keeps just its gradient shard.\n"
                  "all_reduce = reduce_scatter followed by all_gather.")

    def ring_all_reduce(self) -> None:
        """all_reduce built in front of you from isend/irecv: what minidist.comm.ring does."""
        r, n = self.rank, self.n
        nxt, prv = (r + 1) % n, (r - 1) % n
        buf = self.tensor([10 * r + q for q in range(n)])  # chunk q is element q
        before = buf.clone()
        reference = before.clone()
        comm.all_reduce(reference)  # the backend's answer, to check ours against
        incoming = torch.zeros(1, device=self.dev)

        def exchange(send_chunk: int) -> None:
            # Post the receive first, then send: each rank talks only to its two ring neighbours.
            handles = [comm.irecv(incoming, src=prv), comm.isend(buf[send_chunk:send_chunk + 1].clone(), dst=nxt)]
            for h in handles:
                h.wait()

        for s in range(n - 1):  # phase 1, reduce_scatter: pass a partial sum on, add your own piece
            exchange((r - s - 1) % n)
            buf[(r - s - 2) % n] += incoming[0]
        checked = buf.clone()
        checked[r] = reference[r]  # what phase 1 promises: chunk r complete on rank r (the rest is partial)
        self.step("ring all_reduce from send/recv, phase 1: reduce_scatter", before, buf.clone(), checked,
                  f"{n - 1} steps: send the partial sum of chunk (r-s-1) mod n to rank r+1, receive chunk\n"
                  "(r-s-2) mod n from rank r-1 and add yours to it. Now chunk r holds the full sum on rank r\n"
                  "(the other chunks are partial sums).")
        for s in range(n - 1):  # phase 2, all_gather: pass the finished chunks round the ring
            exchange((r - s) % n)
            buf[(r - s - 1) % n] = incoming[0]
        self.step("ring all_reduce from send/recv, phase 2: all_gather", before, buf, reference,
                  f"{n - 1} more steps pass each finished chunk on. Every rank now holds the sum: equal to\n"
                  f"the backend's all_reduce. Each rank sent 2(n-1)/n of the tensor, the least possible.\n"
                  "minidist.comm.ring does this with pipelined pieces (comm.all_reduce(t, algorithm='ring')).")

    def sync_vs_async(self) -> None:
        numel = int(self.cfg.async_numel)
        a = torch.randn(256, 256, device=self.dev)
        work = lambda: [a @ a for _ in range(int(self.cfg.compute_matmuls))]  # noqa: E731

        t = torch.ones(numel, device=self.dev)
        start = time.perf_counter()
        comm.all_reduce(t)                     # blocks here
        work()
        self.sync()
        blocking = time.perf_counter() - start

        u = torch.ones(numel, device=self.dev)
        start = time.perf_counter()
        handle = comm.all_reduce(u, async_op=True)   # returns at once
        work()                                      # ... compute while the data moves
        handle.wait()                               # blocks on this one operation only
        self.sync()
        overlapped = time.perf_counter() - start
        times = comm.all_gather_object((blocking, overlapped))
        self.step("synchronous vs asynchronous all_reduce",
                  self.tensor([1.0]), u[:1], self.tensor([float(self.n)]),
                  "blocking: all_reduce(t) then compute          async: h = all_reduce(u, async_op=True);\n"
                  "compute; h.wait(). Same result; the async version overlaps the two.")
        if self.rank == 0:
            for q, (b, o) in enumerate(times):
                print(f"   rank {q}: blocking {b * 1e3:7.1f} ms   async+compute+wait {o * 1e3:7.1f} ms")
        self.note("On GPU, collectives are queued on a stream: wait() makes the *current stream* wait for\n"
                  "that one operation (it returns quickly on the host), while torch.cuda.synchronize()\n"
                  "blocks the host on *all* queued work of the device - use it to time, not to order.")

    def pitfall_read_before_wait(self) -> None:
        numel = int(self.cfg.async_numel)
        t = torch.ones(numel, device=self.dev)
        handle = comm.all_reduce(t, async_op=True)
        peek = t[-1:].clone()     # WRONG: the operation may not have finished
        handle.wait()
        self.step("pitfall: reading an async result before wait()", peek, t[-1:], self.tensor([float(self.n)]),
                  f"Read before wait() the last element was {peek.item():g} on rank 0 here; it may be the old\n"
                  f"value (1), the result ({self.n}) or, on GPU, anything. After wait() it is always correct.")

    def pitfall_deadlock(self) -> None:
        import datetime

        import torch.distributed as dist

        # A private gloo group: a timed-out transfer leaves its pair of ranks unusable,
        # and we must not break the group the rest of the tour (or a caller) uses.
        timeout = float(self.cfg.deadlock_timeout_s)
        group = dist.new_group(ranks=[0, 1], backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        outcome = torch.zeros(1)
        if self.rank in (0, 1):
            buf = torch.zeros(1)
            req = comm.irecv(buf, src=1 - self.rank, group=group)  # both ranks receive first ...
            start = time.perf_counter()
            why = "returned"
            try:
                req.wait(timeout=timeout)                           # ... and nobody ever sends
                outcome[0] = -1.0
            except RuntimeError as e:
                waited = time.perf_counter() - start
                # The timeout fired only if the wait lasted it and says so (not another error).
                # The first rank to time out closes the pair, so its peer, which waited just as
                # long, may hear "connection closed by peer" an instant before its own timeout.
                said = str(e).lower()
                fired = waited >= 0.9 * timeout and ("timed out" in said or "closed by peer" in said)
                outcome[0] = round(waited, 1) if fired else -1.0
                why = f"failed after {waited:.1f} s with: {str(e).splitlines()[0][:120]}"
        self.step(f"pitfall: both ranks recv first -> deadlock (shown with a {timeout:g} s timeout)",
                  None, outcome if self.rank in (0, 1) else None, None,
                  "Ranks 0 and 1 each wait to receive before sending, so neither ever sends. Without a\n"
                  "timeout this hangs forever; here each gave up after the time shown (or saw its peer give\n"
                  "up then). Fix: order the calls (one sends first), or post isend/irecv and wait on\n"
                  "both, as in step 2.")
        if self.rank in (0, 1) and not outcome[0] > 0:
            self.failed.append(f"deadlock demo did not time out after {timeout:g} s (the wait {why})")


def tour_main(cfg_dict: dict) -> list[str]:
    """The tour on one rank (called under torchrun, or by run_local for each local rank)."""
    cfg = OmegaConf.create(cfg_dict)
    owned = not torch.distributed.is_initialized()  # (a test's rank pool keeps its own group)
    ctx = minidist.init_distributed(backend=cfg.backend, timeout_s=cfg.timeout_s)
    tour = Tour(ctx, cfg)
    minidist.print0(f"minidist primitives tour: {ctx.world_size} ranks, backend {ctx.backend}, device {ctx.device.type}")
    single = ctx.world_size == 1
    if single:  # e.g. a one-GPU machine: the collectives still run (trivially), point to point cannot
        minidist.print0("world size 1: the point-to-point and deadlock steps need 2 ranks and are skipped")
    else:
        tour.point_to_point()
    tour.one_to_all()
    tour.all_to_one()
    tour.all_to_all()
    if not single:
        tour.ring_all_reduce()
    tour.sync_vs_async()
    tour.pitfall_read_before_wait()
    comm.barrier()
    if not single and cfg.deadlock_demo:
        tour.pitfall_deadlock()
    failed = comm.all_gather_object(tour.failed)
    bad = sorted({f for per_rank in failed for f in per_rank})
    minidist.print0(f"\n{tour.step_no} steps, " + ("all verified." if not bad else f"FAILED: {bad}"))
    # Tear the groups down before the interpreter exits: left to the interpreter's own
    # teardown, gloo can abort the process ("terminate called without an active exception").
    comm.barrier()
    if owned:
        minidist.shutdown()
    if bad:
        raise SystemExit(1)
    return bad


def tour(cfg) -> None:
    """The Hydra app's body: start (or be) the ranks, each running tour_main."""
    if int(cfg.nproc) < 1:
        raise SystemExit(f"nproc={cfg.nproc}: need at least 1 rank (2 or more to see every step)")
    run_recipe(tour_main, cfg)


def main(argv: list[str] | None = None, prog: str = "python recipes/tour.py") -> None:
    """`python recipes/tour.py`: Hydra overrides on configs/tour.yaml."""
    import sys

    from minidist.train.app import run_app

    run_app("tour", tour, sys.argv[1:] if argv is None else argv, prog)
