"""Does a change cost DataParallel anything? ddp against native_ddp before and after it.

    .venv/bin/python scripts/measure_ddp_before_after.py --before b063f74   # -> docs/benchmarks/data/ddp_before_after.json

For each model (gpt_nano, the default; mlp_wide, communication-bound), `recipes/compare.py
compare.strategies=[ddp,native_ddp]` runs in a git worktree of the commit --before and in this
checkout, one after the other (before, after, before, after: drift hits both alike). Each run
already pairs ddp with native_ddp step by step, so what is compared across the two commits is
that ratio (its median and 95% bootstrap interval), not absolute times. scripts/make_benchmarks.py
renders the result into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "lib"))

MODELS = {"gpt_nano": [], "mlp_wide": ["model=mlp_wide", "data=fake_images", "trainer.micro_batch_size=8"]}
COMMON = ["compare.strategies=[ddp,native_ddp]"]


def ratio(tree: Path, extra: list[str], run_dir: Path, steps: int = 30) -> dict:
    """ddp / native_ddp in one comparison run from `tree` (the modules it imports are that tree's)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(tree / "recipes/compare.py"), *extra, *COMMON, f"compare.steps={steps}", f"hydra.run.dir={run_dir}"],
                   check=True, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    row = json.loads((run_dir / "results.json").read_text())["rows"]["ddp"]
    return {"ratio": row["time_ratio"], "ci": row["time_ratio_ci"], "step_s": row["step_s"]["median"]}


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    import torch
    from doc_pipeline import provenance, record

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the commit before the change")
    p.add_argument("--steps", type=int, default=30, help="timed steps of each comparison (more: a tighter interval)")
    p.add_argument("--change", default="the change", help="what changed since --before, in words for the document")
    p.add_argument("--out", default=str(ROOT / "docs/benchmarks/data/ddp_before_after.json"))
    a = p.parse_args(argv)
    before = git("rev-parse", a.before)
    results = {"before": before, "change": a.change, "models": {}}
    with tempfile.TemporaryDirectory(prefix="minidist-before-") as tmp:
        tree = Path(tmp) / "tree"
        git("worktree", "add", "--detach", str(tree), before)
        try:
            for model, extra in MODELS.items():
                row = {}
                for when, where in (("before", tree), ("after", ROOT)):
                    row[when] = ratio(where, extra, Path(tmp) / f"{model}-{when}", a.steps)
                    print(f"{model} {when}: ddp / native_ddp {row[when]['ratio']:.3f} {row[when]['ci']}", flush=True)
                results["models"][model] = row
        finally:
            git("worktree", "remove", "--force", str(tree))
    command = (f"python scripts/measure_ddp_before_after.py --before {a.before} --steps {a.steps} "
               f"--change {shlex.quote(a.change)}")
    record(Path(a.out), results, provenance(command, torch.__version__))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
