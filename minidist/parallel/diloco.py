"""DiLoCo and streaming DiLoCo: workers train apart for H steps, then average what they learned
(what each setting does, and the proofs: docs/multinode.md, "Across slow links: DiLoCo").

    outer = minidist.DiLoCo(net.parameters(), sync_every=8, outer_lr=0.5, outer_momentum=0.5)
    for x, y in batches:                      # each worker (a rank, or a host's ranks) its own
        loss_fn(net(x), y).backward()
        inner_optimizer.step(); inner_optimizer.zero_grad()
        outer.after_inner_step()              # every H steps: the outer step, across the workers

Groups and slices: docs/internals.md, "parallel/diloco.py".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from minidist import comm
from minidist.comm.wire import as_wire


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


class Replicated:
    """Where a fragment's values live when every rank of the worker holds its whole parameters
    (one rank, or DDP within the worker): rank s of S owns slice s of the flat fragment, padded to
    a multiple of S, for the outer step; the updated slices are gathered within the worker."""

    def __init__(self, params: list[torch.Tensor], group):
        self.params, self.group = params, group
        S, s = (group_size(group), group_rank(group)) if group is not None else (1, 0)
        self.shard = S
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // S) * S
        self.lo, self.hi = s * self.padded // S, (s + 1) * self.padded // S

    def local(self) -> torch.Tensor:
        """This rank's slice of the fragment's current weights, flat, fp32 (a new tensor)."""
        flat = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        return torch.nn.functional.pad(flat, (0, self.padded - flat.numel()))[self.lo:self.hi].clone()

    @torch.no_grad()
    def write(self, piece: torch.Tensor, mixing: float) -> None:
        """Every rank of the worker: the whole fragment's new outer weights (from each rank's
        slice `piece`) into its parameters, keeping `mixing` of their own values."""
        full = self._padded(piece.detach())
        offset = 0
        for p in self.params:
            new = full[offset:offset + p.numel()].view_as(p).to(p.dtype)
            p.copy_(new if mixing == 0 else torch.lerp(new, p, mixing))
            offset += p.numel()

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        """The whole fragment, unpadded and a copy, from every rank's slice: the form that loads
        at any S and any placement (a collective within the worker)."""
        return self._padded(piece.detach())[:self.numel].clone()

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole fragment (`whole`'s form), a new fp32 tensor."""
        full = torch.nn.functional.pad(full.float(), (0, self.padded - full.numel()))
        return full[self.lo:self.hi].clone()

    def _padded(self, piece: torch.Tensor) -> torch.Tensor:
        if self.shard == 1:
            return piece
        full = torch.empty(self.padded, dtype=piece.dtype, device=piece.device)
        comm.all_gather_into(full, piece.contiguous(), group=self.group)
        return full


class ShardedWithin:
    """Where a fragment's values live under ZeRO within the worker: each rank holds its pieces of
    the fragment's parameters in its fp32 master shards (`model`, a ShardedDataParallel); its
    slice is those pieces in parameter order, written in place. Slices differ in length from rank
    to rank, but the same place in every worker owns the same pieces, so the all_reduce across
    the workers lines up."""

    def __init__(self, params: list[torch.Tensor], model):
        self.model, self.group = model, model.process_group
        slots = [model.shard_slot(p) for p in params]
        self.views = [shard.owned_master(k) for shard, k in slots]  # empty where this rank owns none
        self.numel = sum(p.numel() for p in params)
        # Where each rank's slice lies in the whole fragment: (offset, length) per piece, in order.
        self.layout: list[list[tuple[int, int]]] = [[] for _ in range(model.world_size)]
        offset = 0
        for p, (shard, k) in zip(params, slots):
            for r in range(model.world_size):
                a, b = shard.owned_range(k, r)
                if b > a:
                    self.layout[r].append((offset + a, b - a))
            offset += p.numel()
        self.longest = max(sum(n for _, n in pieces) for pieces in self.layout)
        self.mine = self.layout[model.rank]

    def local(self) -> torch.Tensor:
        return torch.cat([v.detach().float() for v in self.views])

    @torch.no_grad()
    def write(self, piece: torch.Tensor, mixing: float) -> None:
        """Into this rank's master pieces only; the caller makes the wrapper gather them."""
        self.model.wait_for_parameters()  # no gather still reading the masters
        offset = 0
        for v in self.views:
            new = piece[offset:offset + v.numel()].to(v.dtype)
            v.copy_(new if mixing == 0 else torch.lerp(new, v, mixing))
            offset += v.numel()

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(piece.detach(), (0, self.longest - piece.numel()))
        gathered = torch.empty(self.longest * len(self.layout), dtype=piece.dtype, device=piece.device)
        comm.all_gather_into(gathered, padded.contiguous(), group=self.group)
        full = torch.empty(self.numel, dtype=piece.dtype, device=piece.device)
        for r, pieces in enumerate(self.layout):
            at = r * self.longest
            for offset, n in pieces:
                full[offset:offset + n] = gathered[at:at + n]
                at += n
        return full

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        full = full.float()
        return torch.cat([full[offset:offset + n] for offset, n in self.mine]) if self.mine \
            else full.new_zeros(0)


def split_evenly(params: list[torch.Tensor], parts: int) -> list[list[torch.Tensor]]:
    """`params` in order, cut into `parts` contiguous runs of about equal numbers of elements
    (a GPT's blocks fall into consecutive fragments); none empty."""
    if not 1 <= parts <= len(params):
        raise ValueError(f"fragments={parts}: choose between 1 and the {len(params)} parameters")
    total, out, run, seen = sum(p.numel() for p in params), [], [], 0
    for i, p in enumerate(params):
        run.append(p)
        seen += p.numel()
        left_params, left_parts = len(params) - i - 1, parts - len(out) - 1
        if left_parts and (seen >= total * (len(out) + 1) / parts or left_params == left_parts):
            out.append(run)
            run = []
    out.append(run)
    return out


@dataclass
class Fragment:
    """One fragment: its parameters, where its values live (`place`), this rank's slice of its
    outer weights, its outer optimizer, and its all_reduce while in flight."""

    index: int
    params: list[torch.Tensor]
    place: Replicated | ShardedWithin
    start: torch.nn.Parameter                 # the outer weights' slice (fp32): the round's start
    outer: torch.optim.SGD
    phase: int                                # its outer update comes at the steps t with t % H == phase
    delta: torch.Tensor | None = None         # the pseudo-gradient being averaged
    handle: object = None
    kept: bool = True                         # False: the groups' vote discarded the round's average
    apply_at: int | None = None
    synced_at: int = 0                        # the last step its outer update was applied
    taken_at: int = 0                         # the step of the weights its last pseudo-gradient was taken from

    @property
    def numel(self) -> int:
        return self.place.numel

    def restore(self, start: torch.Tensor, momentum: torch.Tensor | None, synced_at: int, taken_at: int) -> None:
        """Its outer state from a saved one, given as this rank's slices."""
        with torch.no_grad():
            self.start.copy_(start)
        self.outer.state.clear()
        if momentum is not None:
            self.outer.state[self.start] = {"momentum_buffer": momentum}
        self.synced_at, self.taken_at = int(synced_at), int(taken_at)


class DiLoCo:
    """The outer loop over a worker's parameters (how: docs/internals.md, "parallel/diloco.py").
    Call `after_inner_step()` after every inner optimizer step; `finish()` ends a partial round
    (the last step does it by itself when `total_steps` is given), so the workers end with the
    same weights.

    Args:
        params: the parameters the inner optimizer updates (the same on the ranks of a worker).
        sync_every: H, the inner steps between a fragment's outer updates.
        outer_lr, outer_momentum: the outer Nesterov SGD's (momentum 0: plain SGD). The defaults
            are the DiLoCo paper's, for rounds of hundreds of steps; configs/strategy/diloco.yaml
            takes 0.5 / 0.5 for the short rounds it measured (docs/benchmarks.md).
        fragments, sync_delay, mixing: streaming DiLoCo; 1, 0, 0 is DiLoCo.
        wire: what the pseudo-gradients travel as (None: fp32; "bf16", "fp16", "int8", a Wire).
        worker_group, across_group: the ranks of this worker, and those of the same place in
            every worker (None with one rank).
        sharded_by: the worker's ShardedDataParallel (ZeRO within the worker, over worker_group,
            which may then be left out): the outer loop works on this rank's master shards;
            None: the parameters are whole on every rank of the worker.
        total_steps: the run's last step, at which every fragment is synced.
    """

    def __init__(self, params, *, sync_every: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 fragments: int = 1, sync_delay: int = 0, mixing: float = 0.0, wire=None,
                 worker_group=None, across_group=None, sharded_by=None, total_steps: int | None = None):
        params = [p for p in params if p.requires_grad]
        check_schedule(sync_every, fragments, sync_delay, mixing, outer_lr, outer_momentum)
        self.sync_every, self.sync_delay, self.mixing = sync_every, sync_delay, mixing
        self.wire = as_wire(wire)
        if sharded_by is not None and worker_group not in (None, sharded_by.process_group):
            raise ValueError("DiLoCo: worker_group must be sharded_by's process group (or left out)")
        self.sharded_by, self.across_group = sharded_by, across_group
        self.workers = group_size(across_group) if across_group is not None else 1
        self.total_steps = total_steps
        # Live recovery (ft=torchft) sets it: across(delta) averages a pseudo-gradient across the replica
        # groups in place and returns the vote (False: every group discards it); the workers are groups.
        self.across: Callable[[torch.Tensor], bool] | None = None
        self.step = 0  # inner steps taken
        self._written = False  # master shards written since the wrapper last gathered them
        self.fragments: list[Fragment] = []
        for f, run in enumerate(split_evenly(params, fragments)):
            place = ShardedWithin(run, sharded_by) if sharded_by is not None else Replicated(run, worker_group)
            frag = Fragment(f, run, place, start=None, outer=None,
                            phase=((f + 1) * sync_every // fragments) % sync_every)
            frag.start = torch.nn.Parameter(place.local(), requires_grad=False)
            frag.outer = torch.optim.SGD([frag.start], lr=outer_lr, momentum=outer_momentum,
                                         nesterov=outer_momentum > 0)
            self.fragments.append(frag)

    # -- the schedule
    def after_inner_step(self) -> None:
        """Count the step; start the all_reduce of every fragment due `sync_delay` steps from now,
        and apply every outer update due now (all of them at the last step)."""
        self.step += 1
        for f in self.fragments:
            due = self.step + self.sync_delay
            if f.handle is None and due % self.sync_every == f.phase and \
                    (self.total_steps is None or due <= self.total_steps):
                self._launch(f, due)
        for f in self.fragments:
            if f.apply_at == self.step:
                self._apply(f, self.mixing)
        if self.total_steps is not None and self.step >= self.total_steps:
            self.finish()
        self._refresh()

    def finish(self) -> None:
        """End the round now: an update in flight lands as scheduled, then every fragment whose last
        pseudo-gradient is older than this step (the steps behind a sync_delay included) is synced
        at once, with no mixing: every worker ends with the same weights, all steps counted. A
        fragment whose update landed at this step with no mixing already holds the outer weights,
        the same in every worker: syncing it again would be an outer step on a zero
        pseudo-gradient, which momentum alone would move."""
        for f in self.fragments:
            if f.handle is not None:
                self._apply(f, self.mixing)
            holds_outer = f.synced_at == self.step and self.mixing == 0.0
            if f.taken_at != self.step and not holds_outer:
                self._launch(f, self.step)
                self._apply(f, 0.0)
        self._refresh()

    def _launch(self, f: Fragment, apply_at: int) -> None:
        f.delta = f.start.detach() - f.place.local()  # the round's pseudo-gradient, this rank's slice
        f.apply_at, f.taken_at = apply_at, self.step
        if self.across is not None:
            f.kept, f.handle = self.across(f.delta), _Done()
            return
        # (An empty slice, a ZeRO rank owning none of the fragment, is empty at that place in every
        # worker: nothing to exchange.)
        f.handle = comm.all_reduce(f.delta, group=self.across_group, async_op=True, wire_dtype=self.wire) \
            if self.workers > 1 and f.delta.numel() else _Done()

    def _apply(self, f: Fragment, mixing: float) -> None:
        f.handle.wait()
        if not f.kept:  # discarded: no outer step; the round's progress rides on into the next
            f.delta, f.handle, f.apply_at, f.kept = None, None, None, True
            return
        f.start.grad = f.delta.div_(self.workers)
        f.outer.step()
        f.start.grad, f.delta, f.handle, f.apply_at = None, None, None, None
        f.synced_at = self.step
        f.place.write(f.start.detach(), mixing)
        self._written = True

    def _refresh(self) -> None:
        """After outer updates: the ZeRO wrapper gathers its parameters from the written masters."""
        if self._written and self.sharded_by is not None:
            self.sharded_by.refresh_parameters()
        self._written = False

    # -- state
    def full_state_dict(self) -> dict:
        """The outer state, whole (a collective within the worker): per fragment the outer weights,
        the outer momentum and an all_reduce in flight (waited for here: its averaged result is
        kept, to be applied at its step on resume); and the step. Loadable at any S."""
        frags = []
        for f in self.fragments:
            pending = None
            if f.handle is not None:
                f.handle.wait()
                f.handle = _Done()
                pending = {"apply_at": f.apply_at, "delta": f.place.whole(f.delta)}
            buf = f.outer.state.get(f.start, {}).get("momentum_buffer")
            frags.append({"start": f.place.whole(f.start), "pending": pending, "synced_at": f.synced_at,
                          "taken_at": f.taken_at,
                          "momentum": None if buf is None else f.place.whole(buf)})
        return {"step": self.step, "fragments": frags}

    def load_full_state_dict(self, state: dict) -> None:
        if len(state["fragments"]) != len(self.fragments):
            raise ValueError(f"the checkpoint's outer state has {len(state['fragments'])} fragment(s), this run "
                             f"{len(self.fragments)}: resume with the same strategy.fragments")
        self.step = int(state["step"])
        for f, saved in zip(self.fragments, state["fragments"]):
            mine = lambda whole: f.place.slice(whole.to(f.start.device))  # noqa: E731
            if saved["start"].numel() != f.numel:
                raise ValueError(f"fragment {f.index}: the checkpoint's has {saved['start'].numel()} elements, "
                                 f"this model's {f.numel}")
            f.restore(mine(saved["start"]), mine(m) if (m := saved["momentum"]) is not None else None,
                      saved["synced_at"], saved["taken_at"])
            pending = saved["pending"]
            f.delta, f.apply_at = (mine(pending["delta"]), int(pending["apply_at"])) if pending \
                else (None, None)
            f.handle = _Done() if pending else None

    def restart(self, step: int) -> None:
        """A new round from the parameters as they are now, at `step` (weights loaded from another
        strategy's checkpoint): outer weights = the current ones, no momentum, nothing in flight."""
        self.step = step
        for f in self.fragments:
            with torch.no_grad():
                f.start.copy_(f.place.local())
            f.outer.state.clear()
            f.delta, f.handle, f.apply_at, f.synced_at, f.taken_at = None, None, None, step, step

    def sync_now(self) -> None:
        """The outer updates due at this step, now (a relaunched replica group, healed at the step
        its peers sync at, takes part in their sync)."""
        for f in self.fragments:
            if self.step % self.sync_every == f.phase:
                self._launch(f, self.step)
                self._apply(f, self.mixing)
        self._refresh()

    def local_state(self) -> dict:
        """This rank's slices of the outer state, no collective (what the same rank of another replica
        group heals from, keeping the tensors it received; torchft asks from a thread of its own)."""
        return {"step": self.step, "fragments": [
            {"start": f.start.detach().clone(), "synced_at": f.synced_at, "taken_at": f.taken_at,
             "momentum": f.outer.state.get(f.start, {}).get("momentum_buffer")} for f in self.fragments]}

    def load_local_state(self, state: dict) -> None:
        self.step = int(state["step"])
        for f, saved in zip(self.fragments, state["fragments"]):
            f.restore(saved["start"], saved["momentum"], saved["synced_at"], saved["taken_at"])

    def memory_tensors(self) -> list[torch.Tensor]:
        """What the outer loop adds on this rank: the outer weights' slices, their momentum and the
        pseudo-gradients in flight."""
        out = []
        for f in self.fragments:
            out.append(f.start)
            out += [v for st in f.outer.state.values() for v in st.values() if torch.is_tensor(v)]
            if f.delta is not None:
                out.append(f.delta)
        return out


class _Done:
    """A completed operation (one worker: nothing to average; a restored one: already averaged)."""

    def wait(self, timeout=None) -> None:
        pass


def check_schedule(sync_every, fragments, sync_delay, mixing, outer_lr, outer_momentum) -> None:
    """Errors naming the option and the fix, before any work."""
    def whole(name, value, low):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be a whole number >= {low}")
    whole("sync_every", sync_every, 1)
    whole("fragments", fragments, 1)
    whole("sync_delay", sync_delay, 0)
    if sync_every % fragments:
        raise ValueError(f"sync_every={sync_every} with fragments={fragments}: each fragment syncs every "
                         f"sync_every steps, one every sync_every/fragments: choose fragments dividing sync_every")
    if sync_delay >= sync_every // fragments:
        raise ValueError(f"sync_delay={sync_delay}: a fragment's all_reduce must land before the next fragment's "
                         f"starts, {sync_every // fragments} step(s) later: choose sync_delay < "
                         f"sync_every/fragments = {sync_every // fragments}")
    if not 0.0 <= mixing <= 1.0:
        raise ValueError(f"mixing={mixing} must be between 0 (take the outer weights) and 1 (keep the local ones)")
    if outer_lr <= 0 or not 0.0 <= outer_momentum < 1.0:
        raise ValueError(f"outer_lr={outer_lr}, outer_momentum={outer_momentum}: need outer_lr > 0 and "
                         "0 <= outer_momentum < 1")
