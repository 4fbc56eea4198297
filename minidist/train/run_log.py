"""What a run shows: per-rank log files, rank 0's console, progress bar, TensorBoard, summary.

    <run dir>/config.yaml           the resolved config of this run (rank 0; rewritten by a resumed run)
    <run dir>/logs/rank_N.log       every rank's own log
    <run dir>/tensorboard/          rank 0's scalars and hparams

Only rank 0 writes to the console: a tqdm progress bar (step, loss, throughput, ETA)
and, at the end, a summary table with the `tensorboard --logdir` command.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from omegaconf import OmegaConf

from minidist.train.run_lock import append_file, write_replacing


class RunLog:
    def __init__(self, cfg, run_dir: Path, ctx):
        self.cfg, self.run_dir, self.ctx = cfg, Path(run_dir), ctx
        self.main = ctx.rank == 0
        self.last: dict = {}
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.logger = logging.getLogger(f"minidist.train.rank{ctx.rank}")
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        # A Hydra sweep configures logging again for every job, and its disable_existing_loggers
        # switches off this logger, created by the previous job: the later jobs' logs stayed empty.
        self.logger.disabled = False
        self._file = logging.StreamHandler(append_file(self.run_dir / "logs" / f"rank_{ctx.rank}.log"))
        self._file.setFormatter(logging.Formatter("%(asctime)s rank %(rank)s  %(message)s", "%H:%M:%S"))
        self._file.addFilter(lambda record: setattr(record, "rank", ctx.rank) or True)
        self.logger.addHandler(self._file)
        self.bar = None
        self.writer = None
        if self.main:
            # What this run uses (a resumed run with changed settings: its own; each checkpoint's
            # meta.pt keeps the config it was written with).
            write_replacing(self.run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))

    def info(self, message: str) -> None:
        """Into this rank's log file; on rank 0 to the console too (above the progress bar)."""
        self.logger.info(message)
        if self.main:
            if self.bar is not None:
                self.bar.write(message)
            else:
                print(message, flush=True)

    # -- progress
    def start_progress(self, step: int, total: int) -> None:
        if self.main and self.cfg.trainer.progress:
            from tqdm.auto import tqdm

            # Into a file or pipe, every 30 s instead of ten times a second: a log, not an animation.
            self.bar = tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr, mininterval=0.1 if sys.stderr.isatty() else 30.0)

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def stop_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    # -- metrics
    def scalars(self, step: int, metrics: dict) -> None:
        self.last.update(metrics)
        self.logger.info(f"step {step}: " + ", ".join(f"{k}={v:.6g}" for k, v in metrics.items()))
        if not self.main:
            return
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        if self.bar is not None:
            post = {"loss": f"{self.last.get('train/loss', float('nan')):.3f}"}
            if "val/loss" in self.last:
                post["val"] = f"{self.last['val/loss']:.3f}"
            rate = self.last.get("throughput/tokens_per_s") or self.last.get("throughput/samples_per_s")
            if rate:
                post["tok/s" if "throughput/tokens_per_s" in self.last else "samples/s"] = f"{rate:,.0f}"
            self.bar.set_postfix(post, refresh=False)

    def finish(self, summary: dict) -> None:
        self.logger.info("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
        if not self.main:
            return
        hparams = {"strategy": self.cfg.strategy.name, "model": self.cfg.model.name, "data": self.cfg.data.name,
                   "world_size": self.ctx.world_size, "micro_batch_size": self.cfg.trainer.micro_batch_size,
                   "grad_accum": self.cfg.trainer.grad_accum, "lr": float(self.cfg.optim.lr),
                   "precision": self.cfg.trainer.precision}
        finals = {f"final/{k}": v for k, v in summary.items() if isinstance(v, (int, float)) and k != "step"}
        self.writer.add_hparams(hparams, finals, run_name=".")
        self.writer.flush()
        # the same figures for scripts (e.g. scripts/make_components.py), beside the resolved config
        write_replacing(self.run_dir / "summary.json",
                        json.dumps({**summary, "config": hparams}, indent=1, default=str) + "\n")
        print(format_summary(summary, self.run_dir), flush=True)

    def close(self) -> None:
        self.stop_progress()
        if self.writer is not None:
            self.writer.close()
        self.logger.removeHandler(self._file)
        self._file.close()
        self._file.stream.close()


def _bytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_summary(s: dict, run_dir: Path) -> str:
    """The end-of-run table: losses, speed, memory, and where everything is."""
    rows = [("steps", f"{s['step']}")]
    if s.get("skipped_steps"):
        rows.append(("skipped steps", f"{s['skipped_steps']} (a non-finite gradient norm: their updates skipped)"))
    for key, label in (("train/loss", "train loss"), ("val/loss", "validation loss"), ("val/accuracy", "val accuracy")):
        if key in s:
            rows.append((label, f"{s[key]:.4f}"))
    if "throughput/tokens_per_s" in s:
        rows.append(("throughput", f"{s['throughput/tokens_per_s']:,.0f} tokens/s "
                                   f"({s['throughput/tokens_per_s_per_rank']:,.0f} per rank)" +
                                   (f", MFU {s['mfu']:.1%}" if "mfu" in s else "")))
    elif "throughput/samples_per_s" in s:
        rows.append(("throughput", f"{s['throughput/samples_per_s']:,.1f} samples/s "
                                   f"({s['throughput/samples_per_s_per_rank']:,.1f} per rank)"))
    if "time/step_s" in s:
        split = f"data {s['time/data_s'] * 1e3:.1f}, compute {s['time/compute_s'] * 1e3:.1f}"
        if "time/exposed_comm_s" in s:
            split += f", exposed comm {s['time/exposed_comm_s'] * 1e3:.1f}"
        clock = f"; {s['time/clock']}" if "time/clock" in s else ""
        rows.append(("step time", f"{s['time/step_s'] * 1e3:.1f} ms ({split} ms{clock})"))
    if "comm/bytes_per_step" in s:
        rows.append(("communication", f"{_bytes(s['comm/bytes_per_step'])} sent per step and rank (mean of "
                                      f"{s.get('comm/steps', s['step'])} steps)"))
    if s.get("checkpoint/write_s"):
        rows.append(("checkpointing", f"{s['checkpoint/blocked_s']:.2f} s of training blocked, "
                                      f"{s['checkpoint/write_s']:.2f} s writing"))
    rows.append(("memory (rank 0)", f"model state {_bytes(s['memory/model_state_bytes'])}, "
                                    f"peak {_bytes(s['memory/peak_bytes'])}"))
    rows += [("run directory", str(run_dir)), ("checkpoints", str(run_dir / "checkpoints")),
             ("logs", str(run_dir / "logs")), ("tensorboard", f"tensorboard --logdir {run_dir / 'tensorboard'}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["", "summary", "-" * 7] + [f"{k:<{width}}  {v}" for k, v in rows])
