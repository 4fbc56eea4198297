"""Train zero3 with and without ZeRO++'s int8 wires; record what each sent and where it ended.

    .venv/bin/python scripts/measure_wires.py                    # -> docs/benchmarks/data/wires_zero3.json
    .venv/bin/python scripts/measure_wires.py --steps 200 400 --out /tmp/w.json

Each variant is `recipes/train.py strategy=zero3` (the default model, data and world: `make
train`'s, gpt_nano on stdlib_text, 2 ranks) with its wire options, for each length in --steps.
From each run's summary.json: the validation and training loss, and the bytes each rank sent
per step by collective (the CommTracer's, i.e. the wire's bytes). Beside them, the spec's theory
for plain zero3 (3 x (n-1)/n x 4 bytes a parameter) and what an int8 wire of quant_block
elements per fp32 scale makes of it. scripts/make_benchmarks.py renders the result into
docs/benchmarks.md. Not timed: the loss and the bytes are the figures (step times on shaped
links come from scripts/validate_sim.sh).
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

VARIANTS = {  # name -> strategy overrides
    "plain": {},
    "int8 weights (qwZ)": {"param_wire": "int8"},
    "int8 gradients (qgZ)": {"grad_wire": "int8"},
    "int8 both": {"param_wire": "int8", "grad_wire": "int8"},
}


def run_variant(overrides: dict, steps: int, run_dir: Path) -> dict:
    args = [sys.executable, str(ROOT / "recipes/train.py"), "strategy=zero3", f"trainer.max_steps={steps}",
            "trainer.progress=false", f"hydra.run.dir={run_dir}"]
    args += [f"strategy.{k}={v}" for k, v in overrides.items()]
    subprocess.run(args, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())


def main(argv: list[str] | None = None) -> int:
    import torch
    from doc_pipeline import provenance, record

    from minidist.comm.wire import QUANT_BLOCK
    from minidist.train.strategies import spec
    from minidist_tools.theory import wire_bytes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, nargs="+", default=[200, 400])
    p.add_argument("--out", default=str(ROOT / "docs/benchmarks/data/wires_zero3.json"))
    a = p.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="minidist-wires-") as tmp:
        for steps in a.steps:
            for name, overrides in VARIANTS.items():
                s = run_variant(overrides, steps, Path(tmp) / f"{steps}-{len(runs)}")
                print(f"{steps} steps, {name}: val {s['val/loss']:.4f}, {s['comm/bytes_per_step']:,.0f} B/step",
                      flush=True)
                runs.append({"variant": name, "overrides": overrides, "steps": steps,
                             "val_loss": s["val/loss"], "train_loss": s["train/loss"],
                             "bytes_per_step": s["comm/bytes_per_step"],
                             "by_op": {k.split("/")[1].removesuffix("_bytes_per_step"): v for k, v in s.items()
                                       if k.startswith("comm/") and k.endswith("_bytes_per_step")
                                       and k != "comm/bytes_per_step"},
                             "parameters": s["parameters"], "world_size": s["config"]["world_size"]})
    psi, n = runs[0]["parameters"], runs[0]["world_size"]
    int8 = {"grad_wire": "int8", "param_wire": "int8", "quant_block": QUANT_BLOCK}
    theory = {"plain": wire_bytes(spec("zero3"), psi, n), "int8": wire_bytes(spec("zero3"), psi, n, options=int8)}
    command = "python scripts/measure_wires.py" + ("" if a.steps == [200, 400] else f" --steps {' '.join(map(str, a.steps))}")
    record(Path(a.out), {"model": "gpt_nano", "strategy": "zero3", "quant_block": QUANT_BLOCK, "theory": theory,
                         "runs": runs}, provenance(command, torch.__version__))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
