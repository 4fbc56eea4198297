"""PowerSGD gradient compression (Vogels et al., 2019) as a DataParallel comm hook.

    model = DataParallel(net, comm_hook=PowerSGD(rank=4))

Each gradient matrix M (a parameter reshaped to rows x cols) is replaced by a rank-r
approximation P Q^T found with one step of power iteration, so a rank sends
r (rows + cols) numbers instead of rows x cols:

    M += error                      error feedback: what compression lost last time
    P = M Q;   all_reduce(P);  P = orthonormalise(P)
    Q = M^T P; all_reduce(Q)
    M_hat = P Q^T;  error = M - M_hat / world

The bucket already holds grad / world_size, so the all_reduced P and Q are those of
the average, and M_hat approximates the average gradient; this rank's error is kept at
the bucket's scale (hence M_hat / world), as torch's powerSGD_hook keeps it at the
gradient's. Q is kept between steps (warm start), which is what makes one power
iteration enough. Vectors (biases, norms) and matrices too small to gain are
all_reduced uncompressed, in one flat message per bucket. The first
`start_iter` steps are plain all_reduce (compression hurts most early).
"""

from __future__ import annotations

import torch

from minidist import comm
from minidist.buckets import Bucket


def orthonormalise(p: torch.Tensor) -> torch.Tensor:
    """Columns of p made orthonormal (reduced QR), done in fp32."""
    q, _ = torch.linalg.qr(p.float(), mode="reduced")
    return q.to(p.dtype)


class PowerSGD:
    """A stateful comm hook: call it with a bucket, get an object with wait()."""

    def __init__(self, rank: int = 4, start_iter: int = 0, seed: int = 0):
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank, self.start_iter, self.seed = rank, start_iter, seed
        self.step = 0            # counts buckets of bucket index 0: one per backward
        # Keyed by the parameter's index in the model (stable when buckets are rebuilt).
        self._q: dict[int, torch.Tensor] = {}       # warm-started Q per matrix
        self._error: dict[int, torch.Tensor] = {}   # error feedback per matrix

    def __call__(self, bucket: Bucket):
        if bucket.index == 0:
            self.step += 1
        if self.step <= self.start_iter:
            return comm.all_reduce(bucket.buffer, group=bucket.process_group, async_op=True)
        return _PowerStep(self, bucket)

    def compressible(self, view: torch.Tensor) -> bool:
        if view.dim() < 2:
            return False
        rows, cols = view.shape[0], view[0].numel()
        return self.rank * (rows + cols) < rows * cols  # only where it actually saves bytes

    def q_for(self, key: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        if key not in self._q:
            # The same random start on every rank (a seeded generator), as the algorithm needs.
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
            self._q[key] = orthonormalise(torch.randn(cols, self.rank, generator=g)).to(like)
        return self._q[key]


class _PowerStep:
    """The two rounds of one bucket: P's all_reduce is in flight when created; wait() does the rest."""

    def __init__(self, hook: PowerSGD, bucket: Bucket):
        self.hook, self.bucket = hook, bucket
        group = bucket.process_group
        self.matrices, vectors = [], []
        for k, view in enumerate(bucket.views):
            (self.matrices if hook.compressible(view) else vectors).append((k, view))
        # Uncompressed part: one flat all_reduce.
        self.flat = torch.cat([v.reshape(-1) for _, v in vectors]) if vectors else None
        self.flat_handle = comm.all_reduce(self.flat, group=group, async_op=True) if vectors else None
        self.vectors = vectors
        # Round 1: P = M Q for every matrix, all_reduced together.
        self.ms, ps = [], []
        for k, view in self.matrices:
            key = bucket.param_ids[k]
            m = view.reshape(view.shape[0], -1)
            if key in hook._error:
                m.add_(hook._error[key])  # in place: m is the bucket's view
            q = hook.q_for(key, m.shape[1], m)
            self.ms.append((key, m, q))
            ps.append(m @ q)
        self.p_flat = torch.cat([p.reshape(-1) for p in ps]) if ps else None
        self.p_shapes = [p.shape for p in ps]
        self.p_handle = comm.all_reduce(self.p_flat, group=group, async_op=True) if ps else None

    def wait(self) -> None:
        hook, group = self.hook, self.bucket.process_group
        world = torch.distributed.get_world_size(group)
        if self.p_handle is not None:
            self.p_handle.wait()
            ps, offset = [], 0
            for shape in self.p_shapes:
                n = shape[0] * shape[1]
                ps.append(orthonormalise(self.p_flat[offset:offset + n].view(shape)))
                offset += n
            # Round 2: Q = M^T P, all_reduced together.
            qs = [m.t() @ p for (_, m, _), p in zip(self.ms, ps)]
            q_flat = torch.cat([q.reshape(-1) for q in qs])
            comm.all_reduce(q_flat, group=group)
            offset = 0
            for (key, m, _), p, q in zip(self.ms, ps, qs):
                n = q.numel()
                q = q_flat[offset:offset + n].view(q.shape)
                offset += n
                approx = p @ q.t()
                # What this rank's compression lost, kept at the bucket's scale (1/world of the
                # gradient): m is this rank's (gradient + error) / world, approx the average's
                # approximation. Comparing m with approx itself, as this did, stored the other
                # ranks' gradients as "error" and fed them back: training barely progressed.
                hook._error[key] = m - approx / world
                m.copy_(approx)
                hook._q[key] = q.clone()            # warm start for the next step
        if self.flat_handle is not None:
            self.flat_handle.wait()
            offset = 0
            for _, view in self.vectors:
                view.copy_(self.flat[offset:offset + view.numel()].view_as(view))
                offset += view.numel()
