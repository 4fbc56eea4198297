"""scripts/gpu_check.sh's verdict on its training runs, from the summary.json each run wrote.

    python scripts/gpu_check_summaries.py OUT_DIR

Reads every OUT_DIR/**/summary.json, copies them to OUT_DIR/summaries/ (one file per run, named
after its folder), and checks:

- every run finished and its loss is a finite number;
- within each sweep (runs in one folder with the same precision), every strategy's final training
  loss is within LOSS_RTOL of the first's: the strategies compute the same training;
- exposed communication is a plausible time: at least 0 and under the step time, and above 0
  when there is more than one rank (at world size 1 nothing is communicated);
- MFU, where reported, is above 0 and at most 100%.

Prints one line per check and exits 1 if any fails.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

LOSS_RTOL = 0.05  # bf16 / fp16 runs of different strategies: the same loss to a few percent after ~20 steps


def load_summaries(out: Path) -> dict[str, dict]:
    """run name (its folder relative to `out`, '/' -> '_') -> summary; copied to out/summaries/."""
    runs = {}
    copies = out / "summaries"
    copies.mkdir(exist_ok=True)
    for f in sorted(out.rglob("summary.json")):
        if copies in f.parents:
            continue
        name = str(f.parent.relative_to(out)).replace("/", "_")
        runs[name] = json.loads(f.read_text())
        shutil.copy(f, copies / f"{name}.json")
    return runs


def checks(runs: dict[str, dict]) -> list[tuple[bool, str]]:
    out: list[tuple[bool, str]] = []
    if not runs:
        return [(False, "no summary.json found: no training run finished")]
    sweeps: dict[tuple[str, str], dict[str, float]] = {}
    for name, s in runs.items():
        loss = s.get("train/loss")
        out.append((loss is not None and math.isfinite(loss), f"{name}: finished at step {s.get('step')}, "
                    f"train loss {loss}"))
        cfg = s.get("config", {})
        sweeps.setdefault((name.rsplit("_", 1)[0], cfg.get("precision", "?")), {})[cfg.get("strategy", name)] = loss
        step, exposed = s.get("time/step_s"), s.get("time/exposed_comm_s")
        if exposed is not None and step:
            needs_comm = cfg.get("world_size", 1) > 1
            ok = 0 <= exposed < step and (exposed > 0 or not needs_comm)
            out.append((ok, f"{name}: exposed communication {exposed * 1e3:.2f} ms of a {step * 1e3:.1f} ms step "
                        f"({s.get('time/clock', 'clock not stated')}; world size {cfg.get('world_size', '?')})"))
        if "mfu" in s:
            out.append((0 < s["mfu"] <= 1, f"{name}: MFU {100 * s['mfu']:.1f}%"))
    for (sweep, precision), losses in sweeps.items():
        if len(losses) < 2:
            continue
        (first, ref), *rest = losses.items()
        for strategy, loss in rest:
            ok = loss is not None and ref is not None and abs(loss - ref) <= LOSS_RTOL * abs(ref)
            out.append((ok, f"{sweep} ({precision}): {strategy} loss {loss} vs {first} {ref} "
                        f"(within {LOSS_RTOL:.0%})"))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip())
        return 2
    results = checks(load_summaries(Path(argv[0])))
    for ok, line in results:
        print(f"{'ok  ' if ok else 'FAIL'} {line}")
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
