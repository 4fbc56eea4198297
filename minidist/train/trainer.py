"""The training loop: one loop for every strategy, ours and native.

    trainer = Trainer(cfg, run_dir, resume_from=None)   # on every rank, after init_distributed
    summary = trainer.fit()                              # train, evaluate, checkpoint, log
    trainer.close()

One optimizer step = grad_accum micro-batches (all but the last under the strategy's
no_sync), clipping through the strategy, then optimizer, scheduler and (fp16) scaler.
global batch = micro_batch_size x grad_accum x world_size samples.

Per step the time is split into data (fetching batches), exposed communication (time
blocked on communication: for our strategies from minidist.comm's tracer; native ones
cannot tell, so their compute includes it) and compute (the rest).
"""

from __future__ import annotations

import array
import collections
import contextlib
import datetime
import math
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

import minidist
from minidist import comm
from minidist.measure import Span, clock_name, to_host
from minidist.profiling import settle
from minidist.train.async_checkpoint import AsyncCheckpoints, start_writer
from minidist.train.checkpoint import (latest_checkpoint, list_checkpoints, load_checkpoint, prune, read_meta,
                                       remove_partial_saves, save_checkpoint)
from minidist.train.checkpoint_layouts import layout_for
from minidist.train.config import config_changes, describe, schedule_changed
from minidist.train.config_check import grad_accum_on_resume, grad_accum_steps
from minidist.train.data import collate
from minidist.train.models import count_parameters, gpt_flops_per_token
from minidist.train.resilience import (FaultPlan, HostTraffic, PeerWatch, collective_failure, cross_host_sent,
                                       write_record)
from minidist.train.run_files import RunLog, append_file, replacing
from minidist.train.state import (build_data, build_training_state, configure_device, peak_tflops, reseed_per_rank,
                                  to_device)
from minidist.train.stop_signal import StopSignals, signal_name
from minidist.train.strategies import local_tensor


# How many of the latest steps' losses a step's is compared with (trainer.diverged_loss): enough that a
# noisy batch stays within their highest (from the second step on: a run can diverge in its first).
RECENT_STEPS = 20


class Diverged(FloatingPointError):
    """The run diverged (trainer.diverged_after / diverged_loss): every rank stops alike."""


def state_digest(module: torch.nn.Module) -> str:
    """SHA-256 of a module's state_dict as this rank holds it (names, dtypes, shapes, bytes)."""
    import hashlib

    h = hashlib.sha256()
    for name, t in module.state_dict(keep_vars=True).items():  # keep_vars: ZeRO-3 refuses values
        t = local_tensor(t).detach()
        if t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size():
            h.update(f"{name}:freed".encode())  # ZeRO-3 frees a unit's storage between uses
            continue
        t = t.cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the allocator's peak; CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass
class StepRecord:
    """One optimizer step on this rank, as train_step leaves it: device values, read only at the
    next log, eval or checkpoint step."""

    loss: torch.Tensor                  # the mean micro-batch loss (on the device)
    grad_norm: torch.Tensor             # the global gradient norm before clipping (on the device)
    span: Span                          # the step's time, on the device's clock
    data_s: float                       # host seconds spent fetching and copying batches
    comm: comm.CommTracer | None        # the step's collectives (None: the strategy's are not traced)
    comm_bytes: float | None            # bytes this rank sent (None: not traced)
    cross_host: tuple[float, int] | None  # (bytes, calls) that crossed hosts, on more than one host
    writing: bool = False               # a background checkpoint was in flight during it


class Trainer:
    def __init__(self, cfg, run_dir: str | Path, resume_from: str | Path | None = None,
                 stop: StopSignals | None = None):
        """`stop`: the rank's stop signals (launch_train.run_rank's); with them the ranks agree
        after every step whether to stop, and a stop checkpoints the step reached."""
        self.cfg, self.run_dir = cfg, Path(run_dir)
        t = cfg.trainer
        self.ctx = ctx = minidist.init_distributed(backend=cfg.launcher.backend, timeout_s=cfg.launcher.timeout_s)
        self.grad_accum, self.batch_note = grad_accum_steps(cfg, ctx.world_size), None
        if resume_from is not None:  # the checkpoint's global batch, kept at this world size
            self.grad_accum, self.batch_note = grad_accum_on_resume(cfg, read_meta(resume_from), ctx.world_size)
        configure_device(ctx.device, bool(t.tf32))
        self.global_batch = t.micro_batch_size * self.grad_accum * ctx.world_size
        self.log = RunLog(cfg, self.run_dir, ctx)
        # trainer.checkpoint_async: the writer process, started now, beside the rest of the start-up
        writer = start_writer(ctx.rank) if t.get("checkpoint_async") else None

        # Same initial weights on every rank (the strategies also broadcast rank 0's), built as the
        # comparison builds them (state.py).
        self.data = build_data(cfg, ctx, self.grad_accum)
        self.train_set, self.val_set, self.info, self.sampler = (self.data.train_set, self.data.val_set,
                                                                 self.data.info, self.data.sampler)
        self.is_text = self.info.kind == "text"
        self.tokens_per_sample = self.data.block_size if self.is_text else 0
        self.state = build_training_state(cfg, cfg.strategy, ctx, self.info, int(t.max_steps))
        self.net, self.model, self.strategy = self.state.net, self.state.model, self.state.strategy
        self.optimizer, self.scheduler, self.scaler = self.state.optimizer, self.state.scheduler, self.state.scaler
        self.n_params = count_parameters(self.net)
        self.flops_per_token = gpt_flops_per_token(self.net) if self.is_text else None
        self.step = 0
        self.saved: tuple[int, Path] | None = None  # (step, folder) of the checkpoint last written or resumed
        self.stop = stop
        if stop is not None:
            stop.where = lambda: f"after step {self.step}"
            stop.latest = lambda: latest_checkpoint(self.run_dir)
            stop.on_stuck = lambda line: write_record(self.run_dir, ctx.rank, "stuck", self.step, line)
        # The agreement between steps is a CPU tensor's all_reduce: on NCCL, over a gloo group of its own.
        self._stop_group = None if stop is None or ctx.backend == "gloo" else torch.distributed.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=float(cfg.launcher.timeout_s)))
        debug = cfg.get("debug")
        self.faults = FaultPlan(debug)  # debug.kill_* / stall_* / nan_*: fault injection
        if debug is not None and debug.get("check_collectives"):
            comm.check_collectives(True)  # each collective first compares a fingerprint across ranks
        self.skipped_steps = 0
        self.skipped_in_a_row = 0  # updates skipped for a non-finite norm since the last one taken
        self.recent_losses: collections.deque = collections.deque(maxlen=RECENT_STEPS)  # agreed, per step
        # This run's traced bytes by op, all steps together: per step on average is what a strategy
        # that communicates every H steps sends (DiLoCo), where the last log window's may not be.
        self.sent_by_op: dict[str, float] = {}
        self.sent_by_shm = 0.0  # of those bytes, the ones through shared memory (ranks on one host)
        self.traced_steps = 0
        self.peak_tflops = peak_tflops(t.peak_tflops, ctx.device, t.precision)  # for MFU
        if self.peak_tflops is None:
            self.log.info(f"no MFU: {torch.cuda.get_device_name(ctx.device)} is not in peak_flops.KNOWN_GPUS; "
                          "set trainer.peak_tflops to its peak TFLOP/s in this precision")
        self.host_traffic = HostTraffic(ctx.rank, ctx.world_size)  # bytes between hosts (resilience.py)
        self.cross_host_theory: list[tuple[float, int]] = []
        reseed_per_rank(t.seed, ctx.rank)
        if ctx.rank == 0:  # a save that did not finish (killed, disk full) left its partial folder
            for name in remove_partial_saves(self.run_dir):
                self.log.info(f"removed {name}, left by a checkpoint save that did not finish")
        if resume_from is not None:
            self._resume(Path(resume_from))
        self.checkpoints = None  # trainer.checkpoint_async: the background writer (async_checkpoint.py)
        self.sync_save_s = 0.0  # the synchronous saves' time: training blocked, all of it writing
        self.step_seconds = {False: array.array("f"), True: array.array("f")}  # by: a write was in flight
        if writer is not None:
            self.checkpoints = AsyncCheckpoints(self.run_dir, self.strategy, writer)
            if (layout := layout_for(self.strategy)).collect is None:
                self.checkpoints.close()
                self.checkpoints = None
                self.log.info(f"trainer.checkpoint_async: {self.strategy.name}'s checkpoints are written by "
                              f"{layout.writer}, communicating as it does: they stay synchronous")
        # A host that vanishes makes the others leave within launcher.peer_timeout_s (resilience.py)
        self.peer_watch = PeerWatch.start(ctx, float(cfg.launcher.get("peer_timeout_s", 0)), step=lambda: self.step,
                                          run_dir=self.run_dir)
        self.live = None  # ft=torchft: this rank's replica group and the others (live_recovery.py)
        if cfg.get("ft") is not None:
            from minidist.train.live_recovery import LiveRecovery
            self.live = LiveRecovery(cfg, self)
        self.fault_rank = ctx.rank if self.live is None else self.live.global_rank  # what debug.*_rank names
        self.samples_log = None
        if t.get("log_samples"):  # appended to: a resumed run continues the same files
            (self.run_dir / "samples").mkdir(parents=True, exist_ok=True)
            self.samples_log = append_file(self.run_dir / "samples" / f"rank_{ctx.rank}.txt")
        self.log.info(f"{self.strategy.name}: {cfg.model.name} ({self.n_params / 1e6:.2f}M parameters) on "
                      f"{cfg.data.name} ({len(self.train_set):,} training samples), {ctx.world_size} rank(s), "
                      f"{ctx.backend}, global batch {self.global_batch} = {t.micro_batch_size} x {self.grad_accum} x "
                      f"{ctx.world_size}, {t.precision}, run directory {self.run_dir}")

    # ------------------------------------------------------------------ one step

    def train_step(self, batches) -> StepRecord | None:
        """One optimizer step over grad_accum micro-batches; returns this rank's measurements
        (None: live recovery discarded the step).

        Nothing in it waits for the device: the step and the communication are timed on the
        device's clock (minidist.measure: CUDA events on CUDA), and the loss, the gradient norm and
        the times stay unread until a log step (`_reduce_metrics`) or a check (`_check_progress`)."""
        span = Span(self.ctx.device).start()
        self.faults.maybe_stall(self.fault_rank, self.step + 1)
        with comm.CommTracer() as tracer, self._collectives_named(tracer.records):
            t0 = time.perf_counter()
            micro_batches = self.data.micro_batches(batches, self.grad_accum, self.ctx.device)
            data_s = time.perf_counter() - t0
            loss_fn = self.state.loss
            if self.faults.nan_loss(self.fault_rank, self.step + 1):
                loss_fn = lambda out, y: self.state.loss(out, y) * float("nan")  # noqa: E731
            loss_sum, grad_norm = self.state.step(micro_batches, loss_fn,
                                                  self.live.before_optimizer if self.live is not None else None)
            span.stop()
        if grad_norm is None:  # discarded by live recovery's vote: the step did not happen
            return None
        if self.samples_log is not None:  # trainer.log_samples: the step, then the ids this rank consumed
            self.samples_log.write(f"{self.step + 1} {' '.join(map(str, self.data.last_ids))}\n")
        traced = self.strategy.traces_comm
        return StepRecord(loss_sum, grad_norm.detach().float(), span, data_s, tracer if traced else None,
                          tracer.total_sent_bytes if traced else None,
                          cross_host_sent(tracer.records, self.ctx.rank, self.host_traffic.per_host)
                          if traced and self.host_traffic.multi_host else None)

    def traced_step(self, batches) -> dict:
        """train_step under torch.profiler: rank 0 writes <run dir>/timeline_step_N.json (Chrome
        trace, every rank) and .png (what recipes/compare.py compare.timeline=true draws)."""
        from minidist.profiling import timeline_plot
        from minidist.profiling import record_step, write_chrome_trace

        result: list[StepRecord] = []
        trace = record_step(lambda: result.append(self.train_step(batches)), self.ctx.world_size, self.model)
        traces = dict(enumerate(comm.all_gather_object(trace)))
        if self.ctx.rank == 0:
            stem = self.run_dir / f"timeline_step_{self.step + 1}"
            title = f"{self.strategy.name} step {self.step + 1}"
            with replacing(stem.with_suffix(".json")) as json_file, replacing(stem.with_suffix(".png")) as png:
                write_chrome_trace(traces, json_file, title)
                timeline_plot(traces, title, png)
            hidden = [t["hidden_fraction"] for t in traces.values() if t["hidden_fraction"] is not None]
            share = f"; {100 * sum(hidden) / len(hidden):.0f}% of communication hidden behind compute" if hidden else ""
            self.log.info(f"step {self.step + 1}: timeline {stem}.json / .png{share}")
        return result[0]

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss (and accuracy for classifiers) on the first eval_batches micro-batches of every rank."""
        t = self.cfg.trainer
        per_batch = t.micro_batch_size * self.ctx.world_size
        batches = min(int(t.eval_batches), len(self.val_set) // per_batch)
        self.model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)  # loss x count, correct, count
        for b in range(batches):
            first = b * per_batch + self.ctx.rank * t.micro_batch_size
            x, y = collate(self.val_set, list(range(first, first + t.micro_batch_size)))
            x, y = to_device(x, self.ctx.device), to_device(y, self.ctx.device)
            with self.state.autocast():
                out = self.model(x)
            n = y.numel()
            sums[0] += self.state.loss(out, y).double() * n
            sums[2] += n
            if not self.is_text:
                sums[1] += (out.argmax(-1) == y).sum()
        self.model.train()
        comm.all_reduce(sums)
        loss_sum, correct, count = to_host(sums, "validation sums")
        count = max(1.0, count)
        result = {"val/loss": loss_sum / count}
        if not self.is_text:
            result["val/accuracy"] = correct / count
        return result

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> Path:
        if not self._parameters_finite():
            raise FloatingPointError(f"step {self.step}: the parameters hold nan or inf on some rank: refusing to "
                                     "write a checkpoint of them (the previous ones are kept)")
        meta = {"strategy": self.strategy.name, "world_size": self.ctx.world_size,
                "layout": layout_for(self.strategy).name, "config": OmegaConf.to_container(self.cfg, resolve=True),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "data": self.sampler.state_dict(),
                "shards": self.strategy.checkpoint_shards}  # files of a sharded one
        step = self.step
        kill = lambda: self.faults.maybe_kill(self.run_dir, self.fault_rank, step, during="save")  # noqa: E731
        if self.checkpoints is not None:
            path = self.checkpoints.save(step, meta, before_commit=kill)
            self.log.info(f"step {step}: checkpoint {path} (written in the background)")
            return path
        start = time.perf_counter()
        path = save_checkpoint(self.run_dir, step, self.strategy, meta, before_commit=kill)
        self.sync_save_s += time.perf_counter() - start
        self.log.info(f"step {step}: checkpoint {path}")
        self.saved = step, path
        return path

    def _prune(self) -> None:
        """Rank 0: keep the newest trainer.keep_last checkpoints. Called once the steps since the last
        checkpoint have passed `_check_progress`: a checkpoint written just after the update that made a
        run diverge shows it only in the next steps' losses, and must not have pruned the last good one."""
        keep = int(self.cfg.trainer.keep_last)
        if self.checkpoints is not None:
            self.checkpoints.prune(keep)
        elif self.ctx.rank == 0:
            prune(self.run_dir, keep)

    def _committed(self, saved: tuple[int, Path] | None) -> Path | None:
        """A background write committed ((step, folder)): the checkpoint a stop or resume names now."""
        if saved is not None:
            self.saved = saved
            self.log.info(f"checkpoint {saved[1]} committed")
        return saved[1] if saved is not None else None

    def _checkpoint_times(self) -> dict:
        """checkpoint/blocked_s (training time checkpoints took) and checkpoint/write_s (writing)."""
        every = [*self.step_seconds[False], *self.step_seconds[True]]
        steps = {"time/step_median_s": statistics.median(every)} if every else {}
        if self.step_seconds[True]:  # the steps that ran beside a background write
            steps["checkpoint/step_median_writing_s"] = statistics.median(self.step_seconds[True])
        if self.checkpoints is None:
            return {"checkpoint/blocked_s": self.sync_save_s, "checkpoint/write_s": self.sync_save_s, **steps}
        return {"checkpoint/blocked_s": self.checkpoints.blocked_s, "checkpoint/write_s": self.checkpoints.write_s,
                **steps}

    def _resume(self, ckpt: Path) -> None:
        built = [{k: v for k, v in group.items() if k != "lr" and isinstance(v, (int, float, tuple))
                  and not isinstance(v, bool)} for group in self.optimizer.param_groups]  # flags stay as built
        meta = load_checkpoint(ckpt, self.strategy)
        self.scheduler.load_state_dict(meta["scheduler"])
        self.scaler.load_state_dict(meta["scaler"])
        self.sampler.load_state_dict(meta["data"])
        self.step = int(meta["step"])
        self.strategy.resumed_at(self.step)
        self.saved = self.step, ckpt
        converted = (meta["strategy"], meta["world_size"]) != (self.strategy.name, self.ctx.world_size)
        if meta["world_size"] != self.ctx.world_size:  # not the same ranks: fresh per-rank streams, reproducibly
            reseed_per_rank(int(self.cfg.trainer.seed) + 1_000_003 * self.step, self.ctx.rank)
        changes = config_changes(meta["config"], OmegaConf.to_container(self.cfg, resolve=True))
        if schedule_changed(changes):
            self._follow_optim_config(built)
        self.log.info((f"resumed step {self.step} of {meta['strategy']} at {meta['world_size']} ranks as "
                       f"{self.strategy.name} at {self.ctx.world_size} ranks (from {ckpt})" if converted else
                       f"resumed from {ckpt} at step {self.step}") +
                      (f"; {self.batch_note}" if self.batch_note else ""))
        if changes:  # the console had them before the ranks started (config_check.resume_notice)
            self.log.logger.info(f"settings changed since {ckpt.name}: {describe(changes)} (applied)")

    def _follow_optim_config(self, built: list[dict]) -> None:
        """The optimizer state came back with the checkpoint's learning rates and options: take this
        run's, `built` (each group's numbers as the config built them; config_check refused those
        that may not change), and the schedule's point for this step under this run's schedule."""
        s = self.scheduler
        for group, options, factor in zip(self.optimizer.param_groups, built, s.lr_lambdas):
            group.update(options)  # its peak, initial_lr, among them
            group["lr"] = group["initial_lr"] * factor(s.last_epoch)
        s.base_lrs = [group["initial_lr"] for group in self.optimizer.param_groups]
        s._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        t, began = self.cfg.trainer, time.perf_counter()
        end = int(t.stop_at) if t.stop_at is not None else int(t.max_steps)
        batches = iter(self.sampler)
        self.log.start_progress(self.step, int(t.max_steps))
        last_eval: dict = {}
        history: list[StepRecord] = []
        unchecked: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, grad norm, loss) not yet read
        start = self.step
        while self.step < end:
            if signum := self._agreed_between_steps():
                return self._stopped(signum)
            if self.live is not None:  # this step's quorum (and heal) first; its batches follow from it
                batches = self.live.begin_step()
            if t.timeline_step is not None and self.step + 1 == int(t.timeline_step):
                m = self.traced_step(batches)
            else:
                m = self.train_step(batches)
            if m is None:
                continue
            self.step += 1
            m.writing = self.checkpoints is not None and self.checkpoints.in_flight
            self.host_traffic.after_step(self.step, start, end, settle=lambda: settle(self.model))
            if m.cross_host is not None and self.step > start + 1:  # the steps the counters span
                self.cross_host_theory.append(m.cross_host)
            self.faults.maybe_kill(self.run_dir, self.fault_rank, self.step)
            history.append(m)
            if m.comm is not None:
                self.traced_steps += 1
                for op, row in m.comm.summary().items():
                    self.sent_by_op[op] = self.sent_by_op.get(op, 0.0) + row["sent_bytes"]
                self.sent_by_shm += sum(r.sent_bytes for r in m.comm.records if r.algorithm == "shm")
            unchecked.append((self.step, m.grad_norm, m.loss))
            log_now = self.step % t.log_every == 0 or self.step == end
            eval_now = t.eval_batches and ((t.eval_every and self.step % t.eval_every == 0) or self.step == end)
            save_now = (t.ckpt_every and self.step % t.ckpt_every == 0) or self.step == end  # and always the last
            # The host reads device values only at these steps, where a stuck collective of the
            # steps since shows up (on NCCL, nothing waits for one before): name it then.
            if log_now or eval_now or save_now:
                with self._collectives_named([r for h in history if h.comm for r in h.comm.records], self.step):
                    self._check_progress(unchecked)
                    unchecked = []
                    self._prune()  # every checkpoint there is now followed by steps that checked out
                    if log_now:
                        self.log.scalars(self.step, {**self._reduce_metrics(history),
                                                     **(self.live.scalars() if self.live is not None else {})})
                        history = []
            self.log.advance(self.step)
            if eval_now:
                last_eval = self.evaluate()
                self.log.scalars(self.step, last_eval)
            if save_now and self.skipped_in_a_row and self.step != end:  # not while updates are being skipped:
                self.log.info(f"step {self.step}: checkpoint postponed: the last {self.skipped_in_a_row} "  # the
                              "update(s) were skipped for a non-finite gradient norm")  # last good one stays
            elif save_now:
                self.save()
        self.log.stop_progress()
        if self.checkpoints is not None:  # training is over: the last write's wait blocks nothing
            self._committed(self.checkpoints.wait(training=False))
        self._prune()
        if self.checkpoints is not None:
            self.checkpoints.wait(training=False)  # (its background deletions)
        if not last_eval and t.eval_batches:  # resumed with nothing left to train: still report
            last_eval = self.evaluate()
        summary = {"step": self.step, **self.log.last, **last_eval, "skipped_steps": self.skipped_steps,
                   "parameters": self.n_params, **self._checkpoint_times(),
                   "time/run_s": time.perf_counter() - began}  # the loop, up to the last checkpoint committed
        if self.scaler.is_enabled():
            summary["loss_scale"] = float(self.scaler.get_scale())  # fp16: where the overflows left it
        # This rank's own parameters and buffers, hashed: equal on every rank of a replicated
        # strategy (ddp, zero1/2 after the final gather), and across runs that should match.
        summary["state_digest"] = state_digest(self.net)
        if self.host_traffic.multi_host:
            summary.update(self._cross_host_traffic())
        # Bytes sent: this rank's mean over every step this process ran, not the last log window's
        # (a strategy that communicates every H steps, DiLoCo, sends unevenly across windows).
        for key in [k for k in self.log.last if k.startswith("comm/") and "cross_host" not in k]:
            del summary[key]
        if self.traced_steps:
            summary["comm/bytes_per_step"] = sum(self.sent_by_op.values()) / self.traced_steps
            summary["comm/steps"] = self.traced_steps
            summary.update({f"comm/{op}_bytes_per_step": b / self.traced_steps
                            for op, b in self.sent_by_op.items() if b})
            summary["comm/shm_share"] = self.sent_by_shm / max(1.0, sum(self.sent_by_op.values()))
        summary["time/clock"] = clock_name(self.ctx.device)
        summary["memory/model_state_bytes"] = self.strategy.memory_report()["total"]
        summary["memory/peak_bytes"] = peak_memory_bytes(self.ctx.device)
        self.log.finish(summary)
        return summary

    def _agreed_between_steps(self) -> int:
        """One collective between steps, on every rank: the stop signal any rank has received (0:
        none) and, with a checkpoint in flight, how far every rank's writer got (a write every rank
        has finished: committed now), in one all_reduce."""
        flight = self.checkpoints if self.checkpoints is not None and self.checkpoints.in_flight else None
        if self.stop is None and flight is None:
            return 0
        with self._collectives_named([], self.step + 1):
            signum, progress = comm.max_over_ranks(self.stop.requested if self.stop is not None else 0,
                                                   flight.progress() if flight is not None else 0,
                                                   group=self._stop_group)
            if flight is not None:
                self._committed(flight.advance(progress))
        return int(signum)

    def _stopped(self, signum: int) -> dict:
        """A stop signal reached some rank: checkpoint the step every rank has finished (unless it
        has one already), say so in one line, and end the run as stopped."""
        self.log.stop_progress()
        name = signal_name(signum)
        if self.checkpoints is not None:  # the write in flight, finished first
            self._committed(self.checkpoints.wait())
        if self.saved is not None and self.saved[0] == self.step:
            path = self.saved[1]
        elif self.step > 0:
            path = self.save()
            if self.checkpoints is not None:
                path = self._committed(self.checkpoints.wait())
        else:
            path = None
        again = ("resume with the same command" if str(self.cfg.trainer.resume) == "auto" else
                 f"resume with trainer.resume=auto (this run has trainer.resume={self.cfg.trainer.resume})")
        line = (f"stopped by {name} after step {self.step}; checkpoint {path}; {again}" if path is not None else
                f"stopped by {name} before the first step: nothing to keep")
        self.log.logger.info(line)
        if self.ctx.rank == 0:
            print(line, file=sys.stderr, flush=True)
        return {"step": self.step, "stopped_by": signum, "checkpoint": str(path) if path else None}

    @contextlib.contextmanager
    def _collectives_named(self, records: list, step: int | None = None):
        """A communication failure inside becomes a CollectiveFailure naming the step (`step`, else
        the one running) and the collective this rank was waiting for (the first pending one among
        `records`)."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - re-raised, described or as it was
            failure = collective_failure(e, records, self.step + 1 if step is None else step, self.strategy.name,
                                         float(self.cfg.launcher.timeout_s))
            if failure is None:
                raise
            raise failure from e  # launch_train.run_rank prints it, in one line

    def _cross_host_traffic(self) -> dict:
        """Per step, all hosts together: the payload between hosts the ring model predicts from this
        run's collectives and the most TCP packets it takes (absent for strategies whose collectives
        minidist does not see), and what the network interfaces sent (resilience.py). A collective."""
        n = max(1, len(self.cross_host_theory))
        sent = sum(b for b, _ in self.cross_host_theory) / n
        packets = sum(p for _, p in self.cross_host_theory) / n
        both = torch.tensor([sent, packets, self.host_traffic.tx_bytes_per_step()], dtype=torch.float64,
                            device=self.ctx.device)
        comm.all_reduce(both)
        out = {"net/cross_host_tx_bytes_per_step": both[2].item()}
        if self.cross_host_theory:
            out["comm/cross_host_bytes_per_step"] = both[0].item()
            out["comm/cross_host_packets_per_step"] = both[1].item()
        return out

    def _check_progress(self, unchecked: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Read the gradient norms and losses of the steps since the last check (one small all_reduce
        of the losses, then one host read, at a log, eval or checkpoint step: none in between); report
        the nan or inf norms, and stop a run that diverged (Diverged) before it checkpoints anything.

        The strategy already skipped a non-finite norm's update on the device (every rank alike, the
        norm being global). fp16: an overflow is the scaler's routine (it skipped the step and lowered
        its scale on every rank alike), not a non-finite step to count or stop for. Diverged: the
        last trainer.diverged_after updates all skipped, or a step's loss (the mean over ranks, so
        every rank decides alike) above trainer.diverged_loss times the highest of the RECENT_STEPS
        steps before it (a spike, not noise). Periodic checkpoints wait while updates are being
        skipped (fit), so none written after a divergence prunes one from before it."""
        if not unchecked:
            return
        losses = torch.stack([loss for _, _, loss in unchecked]).reshape(-1).float()
        comm.all_reduce(losses)
        read = to_host(torch.cat([losses / self.ctx.world_size, torch.stack([n for _, n, _ in unchecked]).reshape(-1)
                                  .to(losses.device)]), "losses and gradient norms")
        read = read if isinstance(read, list) else [read]
        t = self.cfg.trainer
        limit, ratio = int(t.get("diverged_after", 0)), float(t.get("diverged_loss", 0))
        for (step, _, _), loss, norm in zip(unchecked, read[:len(unchecked)], read[len(unchecked):]):
            if not self.scaler.is_enabled():
                if not math.isfinite(norm):
                    self.skipped_in_a_row += 1
                    self._non_finite(step, norm)
                    if limit and self.skipped_in_a_row >= limit:
                        self._diverged(step, step - limit + 1, f"its last {limit} updates were all skipped for a "
                                                               "non-finite gradient norm", "trainer.diverged_after")
                    continue
                self.skipped_in_a_row = 0
            if ratio and self.recent_losses and loss > ratio * max(self.recent_losses):
                self._diverged(step, step, f"train loss {loss:.4g} is over {ratio:g} times the highest of the "
                                           f"{len(self.recent_losses)} steps before it ({max(self.recent_losses):.4g})",
                               "trainer.diverged_loss")
            if math.isfinite(loss):
                self.recent_losses.append(loss)

    def _diverged(self, step: int, first_bad: int, why: str, setting: str) -> None:
        """Stop the run, every rank alike, at `step`. Step `first_bad`'s loss or gradient was the first
        to show it, so the update before it made the weights a checkpoint of that step holds: such
        checkpoints are set aside (`step_XXXXXXXX.diverged`, which no resume picks), and the newest
        one left, from before the divergence, is named (none was pruned since: `_prune`)."""
        if self.ctx.rank == 0:
            for ckpt in list_checkpoints(self.run_dir):
                if int(ckpt.name.removeprefix("step_")) >= first_bad - 1:
                    ckpt.rename(ckpt.with_name(f"{ckpt.name}.diverged"))
        comm.barrier()
        latest = latest_checkpoint(self.run_dir)
        where = (f"the last checkpoint from before it is {latest} (trainer.resume=auto continues there)" if latest
                 else "no checkpoint is from before it (start afresh)")
        raise Diverged(f"step {step}: the run diverged: {why}; {where}, later ones are kept as step_*.diverged. Try "
                       f"a smaller optim.lr, or change {setting} (0: off)")

    def _non_finite(self, step: int, norm: float) -> None:
        """Step `step`'s gradient norm was nan or inf and its update was skipped. Count it, and stop
        if trainer.nonfinite=stop (at this check, which comes at the next log, eval or checkpoint
        step: trainer.log_every=1 stops at once)."""
        self.skipped_steps += 1
        policy = str(self.cfg.trainer.nonfinite)
        message = (f"step {step}: non-finite gradient norm ({norm}): the update was skipped "
                   f"({self.skipped_steps} skipped so far)")
        if policy == "stop":
            latest = latest_checkpoint(self.run_dir)
            raise FloatingPointError(f"{message}; stopping at step {self.step} (trainer.nonfinite=stop). Latest "
                                     f"checkpoint: {latest or 'none'}")
        self.log.info(f"warning: {message}; training goes on (trainer.nonfinite=skip)")

    def _parameters_finite(self) -> bool:
        """Are the parameters the optimizer updates (ZeRO's shards, fully_shard's local shards,
        the model's own otherwise) finite on every rank? A collective. (Not the module's own
        tensors: ZeRO-3 frees their storage between uses.)"""
        local = [local_tensor(p) for g in self.optimizer.param_groups for p in g["params"]]
        checks = [torch.isfinite(t).all() for t in local if t.numel()]
        finite = to_host(torch.stack(checks).all(), "parameters finite") if checks else True  # one read
        return comm.max_over_ranks(0.0 if finite else 1.0) == 0.0

    def _reduce_metrics(self, history: list[StepRecord]) -> dict:
        """Averages over the steps since the last log, over ranks (loss) or of the slowest rank (time)."""
        n = len(history)
        loss = torch.stack([h.loss for h in history]).mean().reshape(1)
        comm.all_reduce(loss)
        steps = [h.span.seconds() for h in history]  # on CUDA: waits for the last step's end event
        for h, seconds in zip(history, steps):  # every step's, for the run's medians (summary.json)
            self.step_seconds[h.writing].append(seconds)
        comms = [h.comm.blocked_s if h.comm is not None else 0.0 for h in history]
        step_s = comm.max_over_ranks(sum(steps) / n)  # as long as its slowest rank
        samples_s = self.global_batch / step_s
        data_s = sum(h.data_s for h in history) / n
        out = {
            "train/loss": to_host(loss, "loss") / self.ctx.world_size,
            "grad_norm": to_host(history[-1].grad_norm, "gradient norm"),
            "lr": self.scheduler.get_last_lr()[0],
            "time/step_s": step_s,
            "time/data_s": data_s,
            "time/compute_s": sum(steps) / n - data_s - sum(comms) / n,
            "throughput/samples_per_s": samples_s,
            "throughput/samples_per_s_per_rank": samples_s / self.ctx.world_size,
            "memory/model_state_bytes": self.strategy.memory_report()["total"],
            "memory/peak_bytes": peak_memory_bytes(self.ctx.device),
        }
        if history[-1].comm is not None:
            out["time/exposed_comm_s"] = sum(comms) / n
            out["comm/bytes_per_step"] = sum(h.comm_bytes for h in history) / n
            for op, row in history[-1].comm.summary().items():  # by collective: the last step's
                if row["sent_bytes"]:
                    out[f"comm/{op}_bytes_per_step"] = row["sent_bytes"]
        if self.is_text:
            tokens_s = samples_s * self.tokens_per_sample
            out["throughput/tokens_per_s"] = tokens_s
            out["throughput/tokens_per_s_per_rank"] = tokens_s / self.ctx.world_size
            if self.peak_tflops is not None:
                out["mfu"] = self.flops_per_token * tokens_s / (self.peak_tflops * 1e12 * self.ctx.world_size)
        return out

    def close(self) -> None:
        if getattr(self, "checkpoints", None) is not None:
            self.checkpoints.close()
        if getattr(self, "live", None) is not None:
            self.live.close()
        if getattr(self, "peer_watch", None) is not None:
            self.peer_watch.stop()
        if getattr(self, "samples_log", None) is not None:
            self.samples_log.close()
        self.log.close()
