"""What checkpoints cost training: none, synchronous, and trainer.checkpoint_async=true.

    python recipes/bench_checkpoint.py                      # gpt_small, 2 ranks, ddp, zero2 and zero3
    python recipes/bench_checkpoint.py strategies=[zero2] rounds=5

Each round trains the same run three ways per strategy, in rotating order (so drift cancels in
their ratios), each a fresh `recipes/train.py` in its own run directory: `none` (trainer.ckpt_every=0:
the final checkpoint alone, as every run has), `sync` and `async` (a checkpoint every `ckpt_every`
steps). From each run's summary.json: `checkpoint/blocked_s` (the training thread's time in saves),
`checkpoint/write_s`, `time/run_s` (the loop, up to the last checkpoint committed), the median
step and, for async, the median step while a write was in flight. Ratios are per round, then
their median and bootstrap 95% interval: async's blocked time over sync's, each way's run over
none's, and async's steps beside a write over none's steps.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from minidist_tools.benchmarking import paired_ratio, write_json
from minidist.train.app import hydra_app

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("none", "sync", "async")


def one_run(cfg: DictConfig, strategy: str, way: str, run_dir: Path) -> dict:
    args = [sys.executable, str(ROOT / "recipes" / "train.py"), f"launcher.nproc={cfg.nproc}",
            f"strategy={strategy}", f"model={cfg.model_name}", f"trainer.max_steps={cfg.steps}",
            f"trainer.ckpt_every={0 if way == 'none' else cfg.ckpt_every}",
            f"trainer.micro_batch_size={cfg.micro_batch_size}", f"trainer.checkpoint_async={way != 'sync'}",
            "trainer.eval_batches=0", "trainer.progress=false", "trainer.log_every=10", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(args, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{strategy} {way} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    return {"blocked_s": s["checkpoint/blocked_s"], "write_s": s["checkpoint/write_s"], "run_s": s["time/run_s"],
            "step_s": s["time/step_median_s"], "writing_step_s": s.get("checkpoint/step_median_writing_s")}


def ratios(runs: dict[str, list[dict]]) -> dict:
    """The per-round ratios that say what checkpoints cost, each as paired_ratio gives it."""
    of = lambda way, key: [r[key] for r in runs[way]]  # noqa: E731
    return {"blocked_async_over_sync": paired_ratio(of("async", "blocked_s"), of("sync", "blocked_s")),
            "run_async_over_none": paired_ratio(of("async", "run_s"), of("none", "run_s")),
            "run_sync_over_none": paired_ratio(of("sync", "run_s"), of("none", "run_s")),
            "writing_step_over_none": paired_ratio(of("async", "writing_step_s"), of("none", "step_s"))}


@hydra_app("bench_checkpoint")
def main(cfg: DictConfig) -> None:
    out_dir = Path(cfg.out).parent
    runs = {s: {way: [] for way in WAYS} for s in cfg.strategies}
    for k in range(int(cfg.rounds)):
        for strategy in cfg.strategies:
            for way in WAYS[k % 3:] + WAYS[:k % 3]:
                r = one_run(cfg, strategy, way, out_dir / f"round{k}_{strategy}_{way}")
                runs[strategy][way].append(r)
                print(f"round {k} {strategy} {way:>5}: run {r['run_s']:.2f} s, blocked {r['blocked_s']:.2f} s, "
                      f"writing {r['write_s']:.2f} s", flush=True)
    results = {}
    for strategy, by_way in runs.items():
        medians = {way: {key: statistics.median(r[key] for r in rs) for key in rs[0] if rs[0][key] is not None}
                   for way, rs in by_way.items()}
        results[strategy] = {"runs": by_way, "medians": medians, "ratios": ratios(by_way)}
        blocked = results[strategy]["ratios"]["blocked_async_over_sync"]
        print(f"{strategy}: async / sync blocked time {blocked['median']:.3f} "
              f"(95% interval {blocked['ci'][0]:.3f}-{blocked['ci'][1]:.3f})")
    write_json(cfg.out, {"strategies": list(cfg.strategies), "model": cfg.model_name, "world_size": int(cfg.nproc),
                         "steps": int(cfg.steps), "ckpt_every": int(cfg.ckpt_every), "rounds": int(cfg.rounds),
                         "cpus": os.cpu_count(), "results": results})


if __name__ == "__main__":
    main()
