"""Collect scripts/diloco_local.sh's runs into one data file: per link rate and variant, the
validation loss against the training time spent so far.

    python scripts/lib/diloco_curves.py OUT STEPS DELAY HOSTS PER_HOST RATE... -- VARIANT...

Each run's rank-0 TensorBoard holds, every log window (trainer.log_every steps, = eval_every),
`time/step_s` (the window's mean step time, its slowest rank's) and `val/loss`; the training
time at a window's end is the sum of the windows' step_s x log_every so far. Its summary.json
gives tokens per second and the bytes that left each host per step (its network device's count).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_pipeline import provenance, record  # noqa: E402


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def sync_every(run_dir: Path) -> int | None:
    """strategy.sync_every as the run's saved config has it (None: a strategy without rounds)."""
    from omegaconf import OmegaConf

    value = OmegaConf.load(run_dir / "config.yaml").strategy.get("sync_every")
    return None if value is None else int(value)


def curve(run_dir: Path) -> dict:
    s = scalars(run_dir)
    steps = sorted(s["time/step_s"])
    elapsed, points, previous = 0.0, [], 0
    for step in steps:
        elapsed += s["time/step_s"][step] * (step - previous)
        previous = step
        if step in s.get("val/loss", {}):
            points.append({"step": step, "train_s": elapsed, "val_loss": s["val/loss"][step]})
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"curve": points, "tokens_per_s": summary["throughput/tokens_per_s"],
            "strategy": summary["config"]["strategy"], "sync_every": sync_every(run_dir),
            "host_tx_bytes_per_step": summary.get("net/cross_host_tx_bytes_per_step"),
            "bytes_per_step": summary.get("comm/bytes_per_step"), "final_val_loss": summary["val/loss"]}


def main(argv: list[str]) -> int:
    split = argv.index("--")
    out, steps, delay, hosts, per_host, *rates = argv[:split]
    variants = argv[split + 1:]
    result = {"steps": int(steps), "delay": delay, "hosts": int(hosts), "per_host": int(per_host),
              "reference": variants[0], "rates": {}}  # the script runs the reference first
    for rate in rates:
        result["rates"][rate] = {v: curve(Path(out) / rate / v) for v in variants}
        for v, r in result["rates"][rate].items():
            print(f"{rate:>8} {v:<11} {r['tokens_per_s']:9,.0f} tokens/s, val {r['final_val_loss']:.4f} after "
                  f"{r['curve'][-1]['train_s']:7.1f} s of training")
    command = f"sudo RATES=\"{' '.join(rates)}\"" + ("" if delay == "none" else f" DELAY={delay}") + \
        f" STEPS={steps} scripts/diloco_local.sh"
    record(Path(out) / "diloco_shaped.json", result, provenance(command, torch.__version__))
    print(f"wrote {out}/diloco_shaped.json (docs/benchmarks/data/diloco_shaped.json is its committed copy)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
