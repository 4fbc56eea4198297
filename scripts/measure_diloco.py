"""Train ddp and DiLoCo at several H on `make train`'s job; record each one's loss and bytes.

    .venv/bin/python scripts/measure_diloco.py                  # -> docs/benchmarks/data/diloco_quality.json
    .venv/bin/python scripts/measure_diloco.py --sync-every 8 --steps 200 --out /tmp/d.json

Each variant is `recipes/train.py` with the default model, data, optimizer and world (gpt_nano on
stdlib_text, AdamW, 2 ranks: each rank a DiLoCo worker) for --steps steps, so every variant sees
the same tokens. From each run's summary.json: the validation and training loss at the end, the
bytes each rank sent per step over the whole run (the CommTracer's: DiLoCo's once every H steps),
the model state per rank with DiLoCo's outer weights and momentum (live storages). Beside them,
the spec's theory of the bytes. scripts/make_benchmarks.py renders it into docs/benchmarks.md.
Not timed: on loopback the link is not what DiLoCo saves (scripts/diloco_local.sh shapes one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "lib"))

DEFAULT_H = (4, 8, 16, 32)


def variants(sync_every: list[int]) -> dict[str, list[str]]:
    """name -> recipes/train.py overrides: ddp, DiLoCo at each H, and at the H nearest 8 DiLoCo with
    the paper's outer optimizer (lr 0.7, momentum 0.9) and streaming DiLoCo (4 fragments, int8
    pseudo-gradients)."""
    out = {"ddp": ["strategy=ddp"]}
    out.update({f"diloco H={h}": ["strategy=diloco", f"strategy.sync_every={h}"] for h in sync_every})
    h = min(sync_every, key=lambda x: abs(x - 8))
    out[f"diloco H={h}, the paper's outer 0.7 / 0.9"] = ["strategy=diloco", f"strategy.sync_every={h}",
                                                         "strategy.outer_lr=0.7", "strategy.outer_momentum=0.9"]
    if h % 4 == 0:
        out[f"diloco_streaming H={h}, 4 fragments, int8"] = [
            "strategy=diloco_streaming", f"strategy.sync_every={h}", "strategy.fragments=4", "strategy.outer_wire=int8"]
    return out


def run_variant(overrides: list[str], steps: int, run_dir: Path) -> dict:
    args = [sys.executable, str(ROOT / "recipes/train.py"), *overrides, f"trainer.max_steps={steps}",
            "trainer.progress=false", "trainer.ckpt_every=0", f"hydra.run.dir={run_dir}"]
    subprocess.run(args, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())


def main(argv: list[str] | None = None) -> int:
    import torch
    from doc_pipeline import provenance, record

    from minidist.comm.wire import QUANT_BLOCK
    from minidist.train.strategies import spec
    from minidist_tools.theory import wire_bytes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--sync-every", type=int, nargs="+", default=list(DEFAULT_H))
    p.add_argument("--out", default=str(ROOT / "docs/benchmarks/data/diloco_quality.json"))
    a = p.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="minidist-diloco-") as tmp:
        for k, (name, overrides) in enumerate(variants(a.sync_every).items()):
            s = run_variant(overrides, a.steps, Path(tmp) / str(k))
            print(f"{name}: val {s['val/loss']:.4f}, {s['comm/bytes_per_step']:,.0f} B/step", flush=True)
            h = next((int(o.split("=")[1]) for o in overrides if o.startswith("strategy.sync_every=")), 1)
            runs.append({"variant": name, "overrides": overrides, "sync_every": h, "val_loss": s["val/loss"],
                         "train_loss": s["train/loss"], "bytes_per_step": s["comm/bytes_per_step"],
                         "model_state_bytes": s["memory/model_state_bytes"], "parameters": s["parameters"],
                         "world_size": s["config"]["world_size"]})
    psi, n = runs[0]["parameters"], runs[0]["world_size"]

    def theory_of(r: dict) -> float:  # each rank a worker: shard groups of 1; the wire its options set
        s = spec(r["overrides"][0].split("=")[1])
        options = dict(o.removeprefix("strategy.").split("=", 1) for o in r["overrides"][1:])
        return sum(wire_bytes(s, psi, n, shard=1 if s.hybrid else None, sync_every=r["sync_every"],
                              options={**options, "quant_block": QUANT_BLOCK}).values())
    theory = {r["variant"]: theory_of(r) for r in runs}
    command = "python scripts/measure_diloco.py" + ("" if a.steps == 400 else f" --steps {a.steps}") + \
        ("" if tuple(a.sync_every) == DEFAULT_H else f" --sync-every {' '.join(map(str, a.sync_every))}")
    record(Path(a.out), {"model": "gpt_nano", "steps": a.steps, "theory_bytes_per_step": theory, "runs": runs},
           provenance(command, torch.__version__))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
