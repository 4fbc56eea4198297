"""Live recovery (ft=torchft): replica groups that keep stepping when one dies, and a relaunched
group that heals from a live peer instead of reading a checkpoint.

A replica group is one launch of `ft.group_size` ranks (ft_launch.py's, or a torchrun per group)
running any flat strategy of ours inside: its process group is the whole world the strategy
sees. Across the groups, one object carries the rest: torchft's Manager (its Lighthouse's quorum,
the commit vote, peer healing over HTTP). Each step of each rank:

    batches = live.begin_step()      # quorum; a group behind loads a live peer's state here
    ... forward / backward: the gradient reduced within the group as always ...
    live.reduce_and_vote()           # the gradient summed across the groups, / participants;
                                     # False: some reduce failed, the step is discarded everywhere

Exact by construction: the gradient each participant contributes is its group's mean over
group batch `taken + p` of the sample stream (p: its place among the P participants), a
committed step moves the stream on by P group batches, a discarded one by none (its samples
are served again). Group rank 0 appends each step to <group dir>/participation.jsonl; a run
with `ft.replay=<that run's directory>` trains the same steps with the same participants and no
faults, and ends in the same state (docs/fault_tolerance.md, "Live recovery").
"""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch

from minidist.train.config import ConfigError
from minidist.train.run_files import append_file

LOG = "participation.jsonl"
LAUNCHED_AT = "MINIDIST_FT_LAUNCHED_AT"  # the launcher's time.time() at this group's launch (its heal row says it)


def require_torchft() -> None:
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side (read at import) logs every step otherwise
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError("ft=torchft needs torchft, which is not installed: pip install -e '.[ft]' "
                          "(the ft extra, torchft 0.2.0)") from None


def check_ft(cfg, world_size: int, one_group: bool = False) -> None:
    """An ft= config's checks before anything starts (one line each). `one_group`: this launch
    (torchrun's, SLURM's) is one replica group, so it must say which, of how many, and where the
    lighthouse is; otherwise the local launcher splits launcher.nproc into groups."""
    require_torchft()
    from minidist.train.strategies import names, spec

    def fits(s) -> bool:
        """Ours, flat (the group is the mesh, or DiLoCo's worker) and syncing in one piece: the
        optimizer's parameters are what a rank holds (whole, or its shards), so a rank's state is
        local and the same rank of every group holds the same part."""
        outer = "outer_lr" in s.options  # DiLoCo: its outer level becomes the one across the groups
        return s.kind == "minidist" and not s.single_rank and (outer or not s.hybrid) and "sync_delay" not in s.options
    if not fits(spec(str(cfg.strategy.name))):
        raise ConfigError(f"ft=torchft runs {', '.join(n for n in names() if fits(spec(n)))} inside each replica "
                          f"group, not strategy={cfg.strategy.name}")
    if one_group:
        if any(cfg.ft.get(k) is None for k in ("group", "groups", "lighthouse")):
            raise ConfigError("ft=torchft under torchrun or SLURM: each launch is one replica group; give ft.group, "
                              "ft.groups and ft.lighthouse (scripts/ft_group.sh sets them; docs/multinode.md)")
        return
    size = int(cfg.ft.group_size or world_size)
    if size < 1 or world_size % size:
        raise ConfigError(f"ft.group_size={cfg.ft.group_size} must divide the {world_size} ranks into equal "
                          "replica groups (launcher.nproc a multiple of ft.group_size)")


def log_rows(run_dir: Path) -> list[dict]:
    """The participation log of one group's directory, or of every group under a run's."""
    run_dir = Path(run_dir)
    paths = [run_dir / LOG] if (run_dir / LOG).is_file() else sorted(run_dir.glob(f"group_*/{LOG}"))
    return [json.loads(line) for path in paths for line in path.read_text().splitlines()]


def read_participation(run_dir: Path) -> dict[int, dict[int, tuple[int, int]]]:
    """A run's participation logs: committed step -> {group: (its place, participants)}."""
    steps: dict[int, dict[int, tuple[int, int]]] = {}
    for row in (r for r in log_rows(run_dir) if r["kind"] == "commit"):
        steps.setdefault(row["step"], {})[row["group"]] = (row["place"], row["participants"])
    return steps


def summarize(run_dir: Path) -> dict:
    """What the groups' logs say: steps discarded (each counted once), heals and their times."""
    rows = log_rows(run_dir)
    heals = [r["heal_s"] for r in rows if r["kind"] == "heal"]
    return {"steps_discarded": len({r["step"] for r in rows if r["kind"] == "discard"}), "heals": len(heals),
            "heal_s_median": statistics.median(heals) if heals else None}


def healed_since(group_dir: Path, since: float) -> bool:
    """Has this group healed from a peer since `since` (a relaunch's time)?"""
    return any(r["kind"] == "heal" and r["time"] >= since for r in log_rows(group_dir))


def _weights_only_transport(timeout: timedelta):
    """torchft's HTTP checkpoint transport, loading what a peer sends with weights_only=True:
    tensors and plain containers, never arbitrary pickles (its own loads with weights_only=False)."""
    import urllib.request

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing import HTTPTransport

    class WeightsOnlyHTTP(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    transport = WeightsOnlyHTTP(timeout=timeout, num_chunks=0)
    transport._server.RequestHandlerClass.log_message = lambda *args: None  # not a line on stderr per heal
    return transport


class LiveRecovery:
    """One rank's side of the replica groups (built by the Trainer when cfg.ft is set)."""

    def __init__(self, cfg, trainer):
        require_torchft()
        from torchft import Manager, ProcessGroupGloo

        ft, ctx = cfg.ft, trainer.ctx
        self.trainer, self.group = trainer, int(ft.group)
        self.global_rank = self.group * ctx.world_size + ctx.rank  # what debug.kill_rank names
        self.replay = read_participation(Path(ft.replay)) if ft.get("replay") else None
        # Half of ft.timeout_s for the reduce (and the vote, a heal's transfer); the lighthouse waits the
        # other half for a group that has not come to the next quorum (ft_launch.py): a group that stops
        # answering is dropped within ft.timeout_s.
        timeout = timedelta(seconds=float(ft.timeout_s) / 2)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self._load, state_dict=self._state,
            min_replica_size=int(ft.min_replicas), use_async_quorum=False,  # a healed group joins its first step
            timeout=timeout, quorum_timeout=timedelta(seconds=float(cfg.launcher.timeout_s)),
            rank=ctx.rank, world_size=ctx.world_size, replica_id=f"group{self.group}",
            store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=str(ft.lighthouse), checkpoint_transport=_weights_only_transport(timeout),
            init_sync=False)  # every group builds the same weights from trainer.seed: nothing to sync at step 0
        self.manager.load_state_dict({"step": trainer.step, "batches_committed": 0})  # a resumed run's step
        self.log = append_file(trainer.run_dir / LOG) if ctx.rank == 0 else None
        self.relaunched = bool(ft.get("relaunched"))
        self.groups, self.gathering = int(ft.groups), not self.relaunched  # a relaunched group joins those there
        self.join_timeout_s = float(cfg.launcher.timeout_s)
        self.place, self.participants, self.quorum = 0, 1, None
        self.discarded, self.heal_s = 0, []
        self.met = self.healed = False  # this sync's quorum met already; this group healed at it
        self.outer = getattr(trainer.strategy, "outer", None)  # DiLoCo: the groups meet at its outer syncs
        if self.outer is not None:
            self.outer.across = self.sync_across
        # Between backward and the optimizer step: the reduce and vote (DiLoCo: each group's own inner steps)
        self.before_optimizer = self.reduce_and_vote if self.outer is None else None

    # ------------------------------------------------------------------ the step

    def begin_step(self):
        """Before each step: join the step's quorum (healing from a peer when behind); return the
        step's batches. Under DiLoCo the groups meet at the outer syncs only (sync_across); a
        relaunched group meets its peers at their next one, and takes part in it, now."""
        sampler = self.trainer.sampler
        if self.outer is not None:
            if self.relaunched:  # the peer it heals from is inside its step `outer.step`, at the sync:
                self._quorum()   # the inner update taken, the schedule's step to come. So is this group now.
                self.met = True
                self.outer.sync_now()
                self.trainer.scheduler.step()
                self.trainer.step = self.outer.step
            sampler.seek(self.trainer.step * self.groups + self.group)  # each group its share of the stream
            return iter(sampler)
        self._quorum()
        self.place = self.manager.participating_rank()
        if self.replay is not None:  # this group's place in the logged step (None: it sat that one out)
            if (step := self.trainer.step + 1) not in self.replay:
                raise RuntimeError(f"ft.replay: the log has no committed step {step}: it ends at step "
                                   f"{max(self.replay, default=0)}; replay with trainer.max_steps at most that")
            self.place = self.replay[step].get(self.group, (None,))[0]
        self.taken = sampler.batches_taken
        sampler.seek(self.taken + (self.place or 0))
        return iter(sampler)

    def sync_across(self, delta: torch.Tensor) -> bool:
        """DiLoCo's outer sync (its `across`): this rank's pseudo-gradient slice averaged across the
        groups; a group healed at this quorum holds its peer's, and does not count it twice."""
        if not self.met:
            self._quorum()
        committed = self.average_across([delta], contributing=not self.healed)
        self._write("commit" if committed else "discard", place=0 if committed else None,
                    participants=self.participants)
        self.discarded += not committed
        self.met = self.healed = False
        return committed

    def _quorum(self) -> None:
        start = time.perf_counter()
        self.manager.start_quorum()
        # The first quorum would form with the groups that happen to be up, and a relaunched group's
        # with itself alone: wait for all of them / a live one to heal from (with others, it has healed,
        # or all are at step 0), each try a step discarded (torchft's way to end a step without an update).
        while (self.manager.num_participants() < 2 if self.relaunched else
               self.gathering and self.manager.num_participants() < self.groups):
            if time.perf_counter() - start > self.join_timeout_s:
                raise RuntimeError(
                    "this replica group was started again, but no live group was left to heal from within "
                    f"launcher.timeout_s={self.join_timeout_s:g} s: resume from a checkpoint instead"
                    if self.relaunched else f"only {self.manager.num_participants()} of the {self.groups} replica "
                    f"groups joined within launcher.timeout_s={self.join_timeout_s:g} s: see their logs")
            self.manager.report_error(RuntimeError("waiting for every replica group to join"))
            self.manager.should_commit()
            time.sleep(0.05)
            self.manager.start_quorum()
        if self.relaunched:
            self.healed = True
            self.heal_s.append(time.perf_counter() - start)
            self._write("heal", heal_s=round(self.heal_s[-1], 4), launched_at=float(os.environ.get(LAUNCHED_AT, 0)))
        self.gathering = self.relaunched = False
        self.quorum = self.manager._quorum_id

    def average_across(self, tensors: list[torch.Tensor], contributing: bool) -> bool:
        """Each of `tensors` (this rank's part, the same layout in every group) averaged in place
        over the groups that contribute (one that does not sends zeros and is not counted: the
        count travels with the sum, so every group divides alike); then the commit vote. True:
        apply the result (False: a reduce failed somewhere, and every group discards it)."""
        flat = torch.cat([t.reshape(-1).float() for t in tensors] + [torch.ones(1, device=tensors[0].device)])
        if not contributing:
            flat.zero_()
        self.manager.allreduce(flat, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        if self.manager.errored():  # a peer died mid-reduce: close our connections, so the groups waiting
            self.manager._pg.abort()  # on us in gloo's ring fail at once, not after the timeout
        self.participants = int(flat[-1].item())
        for t, mean in zip(tensors, flat[:-1].div_(max(self.participants, 1)).split([t.numel() for t in tensors])):
            t.copy_(mean.view_as(t))
        return self.manager.should_commit()

    def reduce_and_vote(self) -> bool:
        """The step's gradient, as this rank holds it, averaged across the groups; then the vote.
        True: step (the trainer's before_optimizer)."""
        params = [p for group in self.trainer.optimizer.param_groups for p in group["params"]]
        for p in (p for p in params if p.grad is None):  # every group sends the same layout, used or not
            p.grad = torch.zeros_like(p)
        committed = self.average_across([p.grad for p in params], contributing=self.place is not None)
        self.trainer.sampler.seek(self.taken + (self.participants if committed else 0))  # (discarded: served again)
        self.discarded += not committed
        self._write("commit" if committed else "discard", place=self.place if committed else None,
                    participants=self.participants)
        return committed

    def _write(self, kind: str, **fields) -> None:
        if self.log is not None:
            step = self.trainer.step + (kind != "heal")
            self.log.write(json.dumps({"kind": kind, "step": step, "group": self.group, "quorum": self.quorum,
                                       "time": round(time.time(), 3), **fields}) + "\n")

    # ------------------------------------------------------------------ what a peer heals from

    def _state(self) -> dict:
        """This rank's whole training state, local (no collective: torchft calls it from its
        quorum thread): tensors and plain values only, so the receiver loads it weights_only."""
        t, model = self.trainer, self.trainer.strategy.model
        held = ({"sharded": model.sharded_state_dict()} if hasattr(model, "sharded_state_dict") else
                {"model": t.net.state_dict(), "optimizer": t.optimizer.state_dict()})
        if self.outer is not None:
            held["outer"] = self.outer.local_state()
        return {**held, "scheduler": {k: v for k, v in t.scheduler.state_dict().items() if k != "lr_lambdas"},
                "scaler": t.scaler.state_dict(), "data": t.sampler.state_dict(), "step": t.step}

    def _load(self, state: dict) -> None:
        t = self.trainer
        if "sharded" in state:
            t.strategy.model.load_sharded_state_dict(state["sharded"])
        else:
            t.net.load_state_dict(state["model"])
            t.optimizer.load_state_dict(state["optimizer"])
        if "outer" in state:
            self.outer.load_local_state(state["outer"])
        t.scheduler.load_state_dict({**t.scheduler.state_dict(), **state["scheduler"]})
        t.scaler.load_state_dict(state["scaler"])
        t.sampler.load_state_dict(state["data"])
        t.step = int(state["step"])

    # ------------------------------------------------------------------ the trainer's view

    def scalars(self) -> dict:
        return {"ft/quorum_size": float(self.participants), "ft/steps_discarded": float(self.discarded),
                **({"ft/heal_s": self.heal_s[-1]} if self.heal_s else {})}

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        if self.log is not None:
            self.log.close()
