"""Regenerate docs/fault_tolerance.md from a real soak run (make test-all's soak test).

    python scripts/make_fault_tolerance_doc.py                # run the soak (~2 min on 2 cores), then render
    python scripts/make_fault_tolerance_doc.py --render-only  # rewrite the document from the committed data

The soak is tests/test_fault_tolerance.py::test_soak_three_kills_in_a_thousand_steps, run by
pytest with MINIDIST_SOAK_OUT set: it asserts the final state equals the uninterrupted run's,
bitwise, and writes its figures, which are committed as docs/fault_tolerance/data/soak.json with
the commit, command and date. Every figure in the document is computed from that file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "scripts" / "lib"))
from doc_pipeline import Document, fill_quotes, load, main, provenance, record  # noqa: E402

DOC = ROOT / "docs" / "fault_tolerance.md"
DATA = ROOT / "docs" / "fault_tolerance" / "data" / "soak.json"
TEST = "tests/test_fault_tolerance.py::test_soak_three_kills_in_a_thousand_steps"
COMMAND = f"MINIDIST_SOAK_OUT=FILE python -m pytest {TEST}"


def soak() -> None:
    """Run the soak test; commit its figures with where they came from."""
    import torch

    out = Path(tempfile.mkdtemp(prefix="minidist-soak-")) / "soak.json"
    env = {**os.environ, "MINIDIST_SOAK_OUT": str(out), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST], cwd=ROOT, env=env)
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"the soak test failed (exit {done.returncode}): nothing written")
    record(DATA, json.loads(out.read_text()), provenance(COMMAND, torch.__version__))


def soak_section(data: dict) -> list[str]:
    d, p = data["results"], data["provenance"]
    kills = d["kills"]
    redone = d["redone_steps"]
    per_step = d["straight_s"] / d["steps"]
    back_to = ", ".join(str(step - r) for (_, step), r in zip(kills, redone))
    return [
        f"## Soak: {d['steps']:,} steps, {d['ranks']} ranks, {len(kills)} kills",
        "",
        f"`make test-all` (`{TEST.split('/')[-1]}`): a tiny GPT with `strategy={d['strategy']}` on "
        f"{d['ranks']} ranks, {d['steps']:,} steps, a checkpoint every {d['ckpt_every']}, launched with "
        f"`torchrun --standalone --nproc_per_node {d['ranks']} --max-restarts {len(kills)}`. "
        f"{len(kills)} ranks SIGKILL themselves at steps drawn with a fixed seed (`debug.kill_rank="
        f"[{','.join(str(r) for r, _ in kills)}] debug.kill_at_step=[{','.join(str(s) for _, s in kills)}]`); "
        "each time torchrun stops the group and starts it again, and the trainer resumes from the latest "
        "complete checkpoint.",
        "",
        "| run | wall time | restarts | steps redone |",
        "| --- | --- | --- | --- |",
        f"| uninterrupted | {d['straight_s']:.1f} s | 0 | 0 |",
        f"| {len(kills)} kills | {d['with_kills_s']:.1f} s | {len(kills)} | {sum(redone)} "
        f"({' + '.join(map(str, redone))}: back to steps {back_to}) |",
        "",
        f"Time lost to the restarts: {d['lost_s']:.1f} s, about {d['lost_s'] / len(kills):.1f} s per restart, of "
        f"which about {sum(redone) * per_step:.1f} s is the {sum(redone)} steps trained again (at the uninterrupted "
        f"run's {1e3 * per_step:.0f} ms a step) and the rest is starting {d['ranks']} processes (Python, torch, "
        "Hydra), the rendezvous and loading the checkpoint. The final checkpoint (model, optimizer, scheduler, "
        "every rank's RNG and data position) equals the uninterrupted run's bitwise: the test asserts it.",
        "",
        f"Measured on the development machine (torch {p['torch']}, gloo), {p['date']}, commit {p['commit'][:12]}.",
        "",
    ]


PROVEN = """## What else is proven, and where

| property | test |
| --- | --- |
| a rank killed at step 12 of 20, group restarted: final state bitwise equal (ddp, zero2) | `test_fault_tolerance.py::test_killed_rank_restarts_and_ends_bitwise_equal` |
| killed while a checkpoint is written: the previous one is complete and resumed from | `test_train_recipe.py::test_a_kill_while_saving_leaves_no_checkpoint_that_looks_complete` |
| zero2 at 2 ranks, rank 1 killed while the step-10 checkpoint is written (`debug.kill_during=save`): the partial folder removed at the restart, resumed from step 5, final state bitwise equal | `test_fault_tolerance.py::test_a_kill_while_saving_a_sharded_checkpoint_leaves_none_that_looks_complete` |
| the survivor of a kill prints one line (rank, step, error, restart and checkpoint), its traceback in its log | `test_fault_tolerance.py::test_killed_rank_restarts_and_ends_bitwise_equal` |
| a full disk (1.2 MiB tmpfs): one line with the OS error, MiB needed and free; previous checkpoint intact, partial one removed; `resume=auto` continues | `test_checkpoint_disk.py` (root) |
| a checkpoint file missing, truncated or changed: refused by its manifest, naming the file; `resume=auto` falls back to the newest that verifies | `test_checkpoint_safety.py` |
| a stalled rank: the others fail within `launcher.timeout_s`, naming step and collective; exit non-zero; no process left | `test_fault_tolerance.py::test_a_stalled_rank_fails_the_others_within_the_timeout` |
| ranks about to issue different collectives raise on every rank (`debug.check_collectives`) | `test_comm_check.py` |
| nan gradients: skipped on every rank, or the run stops; no checkpoint of non-finite values | `test_fault_tolerance.py::test_nan_gradients_skip_the_update_or_stop`, `::test_no_checkpoint_of_non_finite_parameters` |
| port in use, unreachable master: one message with the fix | `test_fault_tolerance.py::test_port_in_use_is_named`, `::test_unreachable_master_fails_within_the_timeout` |
| a checkpoint that does not fit the model: the first mismatching key | `test_train_recipe.py::test_command_line_errors_are_one_line_and_write_nothing` |
| uneven inputs under `minidist.Join` (DataParallel) equal native DDP under torch's Join, every rank | `test_join.py` |
| uneven inputs under `minidist.Join` (ShardedDataParallel 1-3): every rank ends with native DDP's longest-training rank's state; a rank with no batch makes every rank raise | `test_join.py` |
| 2 emulated hosts (network namespaces) x 2 ranks equal one 4-rank host, bitwise (ddp, zero2) | `test_multinode.py` |
| bytes between the emulated hosts, from the veth counters, within the ring model's theory plus headers and ACKs (ddp, zero2, zero3, hsdp2, hsdp3, ddp_hierarchical) | `test_multinode.py` |"""


def render() -> str:
    lines = [
        "# Fault tolerance: measured",
        "",
        "Generated by `python scripts/make_fault_tolerance_doc.py` (`--render-only` rewrites it from the committed "
        "data, `docs/fault_tolerance/data/soak.json`); do not edit by hand.",
        "",
        *soak_section(load(DATA)),
        PROVEN,
    ]
    return "\n".join(lines).rstrip() + "\n"


def with_quotes(text: str) -> str:
    """`text` (the README) with its quote of the soak rendered from the same data."""
    d = load(DATA)["results"]
    return fill_quotes(text, "fault_tolerance", {"soak": (
        f"{d['lost_s']:.0f} s lost to {len(d['kills'])} restarts in a {d['straight_s']:.0f} s run, final state "
        "bitwise equal")})


DOCUMENT = Document(Path(__file__), DOC, render, {"soak": soak}, readme_quotes=with_quotes)

if __name__ == "__main__":
    sys.exit(main(DOCUMENT))
