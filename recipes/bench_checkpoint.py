"""Training time blocked by checkpoints: synchronous vs trainer.checkpoint_async=true.

    python recipes/bench_checkpoint.py                 # gpt_small, 2 ranks, a checkpoint every 10 steps
    python recipes/bench_checkpoint.py strategy=zero2 rounds=5

Each round trains the same run twice, once each way, in alternating order (pairs ran back to
back, so drift cancels in their ratio), each run a fresh `recipes/train.py` in its own run
directory. Reported per way: `checkpoint/blocked_s` (the training thread's time in checkpoint
saves, all of them; the end of the run's wait for the last write is training no longer) and
`checkpoint/write_s` (writing and fsyncing the files), from each run's summary.json; and the
median of the rounds' blocked-time ratios, async / sync, with its bootstrap 95% interval.
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
WAYS = {"sync": "false", "async": "true"}


def one_run(cfg: DictConfig, way: str, run_dir: Path) -> dict:
    args = [sys.executable, str(ROOT / "recipes" / "train.py"), f"launcher.nproc={cfg.nproc}",
            f"strategy={cfg.strategy}", f"model={cfg.model_name}", f"trainer.max_steps={cfg.steps}",
            f"trainer.ckpt_every={cfg.ckpt_every}", f"trainer.micro_batch_size={cfg.micro_batch_size}",
            f"trainer.checkpoint_async={WAYS[way]}", "trainer.eval_batches=0", "trainer.progress=false",
            "trainer.log_every=10", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(args, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{way} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    return {"blocked_s": s["checkpoint/blocked_s"], "write_s": s["checkpoint/write_s"], "step_s": s["time/step_s"]}


@hydra_app("bench_checkpoint")
def main(cfg: DictConfig) -> None:
    out_dir = Path(cfg.out).parent
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for k in range(int(cfg.rounds)):
        for way in (list(WAYS) if k % 2 == 0 else list(WAYS)[::-1]):
            r = one_run(cfg, way, out_dir / f"round{k}_{way}")
            runs[way].append(r)
            print(f"round {k} {way:>5}: blocked {r['blocked_s']:.2f} s, writing {r['write_s']:.2f} s", flush=True)
    ratio = paired_ratio([r["blocked_s"] for r in runs["async"]], [r["blocked_s"] for r in runs["sync"]])
    medians = {way: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for way, rs in runs.items()}
    print(f"async / sync blocked time: {ratio['median']:.3f} (95% interval {ratio['ci'][0]:.3f}-{ratio['ci'][1]:.3f})")
    write_json(cfg.out, {"strategy": cfg.strategy, "model": cfg.model_name, "world_size": int(cfg.nproc),
                         "steps": int(cfg.steps), "ckpt_every": int(cfg.ckpt_every), "rounds": int(cfg.rounds),
                         "cpus": os.cpu_count(),
                         "runs": runs, "medians": medians, "blocked_ratio": ratio})


if __name__ == "__main__":
    main()
