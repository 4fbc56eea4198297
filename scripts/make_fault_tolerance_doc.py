"""Regenerate docs/fault_tolerance.md from a real soak run (make test-all's soak test).

    python scripts/make_fault_tolerance_doc.py                # run the soak (~2 min on 2 cores), then render
    python scripts/make_fault_tolerance_doc.py --render-only  # rewrite the document from the committed data
    sudo python scripts/make_fault_tolerance_doc.py --only elastic   # the host lost and back (~2 min, root)

The soak is tests/test_fault_tolerance.py::test_soak_three_kills_and_the_same_state_bitwise, run by
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
TEST = "tests/test_fault_tolerance.py::test_soak_three_kills_and_the_same_state_bitwise"
COMMAND = f"MINIDIST_SOAK_STEPS=1000 MINIDIST_SOAK_OUT=FILE python -m pytest {TEST}"


def soak() -> None:
    """Run the soak test; commit its figures with where they came from."""
    import torch

    out = Path(tempfile.mkdtemp(prefix="minidist-soak-")) / "soak.json"
    env = {**os.environ, "MINIDIST_SOAK_STEPS": "1000", "MINIDIST_SOAK_OUT": str(out), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST], cwd=ROOT, env=env)
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"the soak test failed (exit {done.returncode}): nothing written")
    record(DATA, json.loads(out.read_text()), provenance(COMMAND, torch.__version__))


ELASTIC = ROOT / "docs" / "fault_tolerance" / "data" / "elastic.json"
ELASTIC_ARGS = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.max_bytes=200000",
                "trainer.micro_batch_size=4"]
ELASTIC_COMMAND = "sudo scripts/elastic_local.sh " + " ".join(ELASTIC_ARGS)


def elastic() -> None:
    """scripts/elastic_local.sh on emulated hosts (root): a host lost and back; its figures committed."""
    import torch

    out = Path(tempfile.mkdtemp(prefix="minidist-elastic-"))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "elastic_local.sh"), *ELASTIC_ARGS], cwd=ROOT,
                          env={**os.environ, "OUT": str(out), "PREFIX": "mdd"})
    if done.returncode != 0 or not (out / "elastic.json").is_file():
        raise SystemExit(f"scripts/elastic_local.sh failed (exit {done.returncode}): nothing written; see {out}")
    record(ELASTIC, json.loads((out / "elastic.json").read_text()), provenance(ELASTIC_COMMAND, torch.__version__))


def elastic_section(data: dict) -> list[str]:
    d, p = data["results"], data["provenance"]
    w = d["world_sizes"]
    same = "bitwise equal" if d["bitwise"] else f"within {d['largest_relative_difference']:.1e} relative"
    return [
        f"## Elastic: a host lost, and back ({' -> '.join(map(str, w))} ranks)",
        "",
        f"`{p['command']}`: 2 emulated hosts (network namespaces) x 2 ranks train `strategy=zero2` under `torchrun "
        "--nnodes 1:2 --max-restarts 3`. After step 25 host 2 vanishes as a host that loses power does: its link "
        "goes first, then its processes. Nothing tells the survivors; their collectives would wait out "
        "`launcher.timeout_s`. Each rank's heartbeat (`minidist/train/resilience.py`) finds its ring neighbour "
        "silent, and the survivors leave. torchrun re-forms the group from the host that is left. The trainer "
        "resumes from the latest checkpoint at the smaller world size, with the same global batch (grad_accum "
        f"{w[0] // w[1]}x as large). Then host 2 comes back, and torchrun restarts the group with it.",
        "",
        "| event | figure |",
        "| --- | --- |",
        f"| the loss noticed: the survivors leave | {d['seconds_loss_to_leaving']:.1f} s after the loss "
        f"(launcher.peer_timeout_s={d['peer_timeout_s']:g}) |",
        f"| the first step at {w[1]} ranks ends | {d['seconds_loss_to_first_step']:.1f} s after the loss |",
        f"| steps redone | {d['steps_redone_after_loss']} (step {d['reached_before_loss']} reached, resumed from "
        f"{d['resumed_at_steps'][0]}) |",
        *([f"| the host back: the first step at {w[2]} ranks ends | {d['seconds_return_to_first_step']:.1f} s after "
           f"it rejoined; {d['steps_redone_after_return']} steps redone"
           f"{' (torchrun stops the group with a SIGTERM, and the step reached is checkpointed)' if d['steps_redone_after_return'] == 0 else ''} |"]
          if "seconds_return_to_first_step" in d else []),
        f"| final model vs the same switches made by hand (`trainer.stop_at`, the checkpoint copied, the next "
        f"world size) | {same} |",
        f"| every step's sample ids vs the hand-switched run's | {'identical' if d['samples_identical'] else 'DIFFERENT'} |",
        "",
        f"Between leaving and the first step: torchrun's rendezvous waits its last call for more hosts "
        f"(`--rdzv-conf last_call_timeout={d['last_call_timeout_s']:g}`), then the "
        f"{w[1]} processes start (Python, torch, Hydra) and load the checkpoint. The host that serves the rendezvous "
        "(and the store the heartbeats go through) must be one that survives, as for any torchrun c10d rendezvous. "
        "A returning host needs `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: with torch's shared rendezvous store, a host "
        "that joins a later round never gets the store's address, and waits forever. "
        f"Measured on the development machine (torch {p['torch']}, gloo), {p['date']}, commit {p['commit'][:12]}; "
        "`test_multinode.py::test_a_lost_host_is_left_within_seconds_and_a_returning_one_rejoins` (root) runs it.",
        "",
    ]


def soak_section(data: dict) -> list[str]:
    d, p = data["results"], data["provenance"]
    kills = d["kills"]
    redone = d["redone_steps"]
    per_step = d["straight_s"] / d["steps"]
    back_to = ", ".join(str(step - r) for (_, step), r in zip(kills, redone))
    return [
        f"## Soak: {d['steps']:,} steps, {d['ranks']} ranks, {len(kills)} kills",
        "",
        f"`MINIDIST_SOAK_STEPS={d['steps']} pytest {TEST.split('/')[-1]}` (`make test-all` runs it at 100 "
        f"steps, which show the same three restarts): a tiny GPT with `strategy={d['strategy']}` on "
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
| a host lost (link cut, no word): the survivors leave within launcher.peer_timeout_s, torchrun re-forms the group, resumed at 2 ranks; the host back, 4 again; equal to the hand-switched run, sample ids identical | `test_multinode.py::test_a_lost_host_is_left_within_seconds_and_a_returning_one_rejoins` (root) |
| the heartbeat: a silent neighbour named within the peer timeout, every rank told; a finished rank never taken for lost | `test_peer_watch.py` |
| bytes between the emulated hosts, from the veth counters, within the ring model's theory plus headers and ACKs (ddp, zero2, zero3, hsdp2, hsdp3, ddp_hierarchical) | `test_multinode.py` |"""


def render() -> str:
    lines = [
        "# Fault tolerance: measured",
        "",
        "Generated by `python scripts/make_fault_tolerance_doc.py` (`--render-only` rewrites it from the committed "
        "data, `docs/fault_tolerance/data/soak.json`); do not edit by hand.",
        "",
        *soak_section(load(DATA)),
        *(elastic_section(load(ELASTIC)) if ELASTIC.is_file() else []),
        PROVEN,
    ]
    return "\n".join(lines).rstrip() + "\n"


def with_quotes(text: str) -> str:
    """`text` (the README) with its quote of the soak rendered from the same data."""
    d, e = load(DATA)["results"], load(ELASTIC)["results"]
    return fill_quotes(text, "fault_tolerance", {
        "soak": (f"{d['lost_s']:.0f} s lost to {len(d['kills'])} restarts in a {d['straight_s']:.0f} s run, final "
                 "state bitwise equal"),
        "elastic": (f"the survivors left {e['seconds_loss_to_leaving']:.1f} s after the loss and ended their first step "
                    f"at {e['world_sizes'][1]} ranks after {e['seconds_loss_to_first_step']:.1f} s, "
                    f"{e['steps_redone_after_loss']} steps redone; the final model "
                    f"{'bitwise equal to' if e['bitwise'] else 'within tolerance of'} the hand-switched run's, "
                    f"every step's sample ids {'the same' if e['samples_identical'] else 'DIFFERENT'}")})


DOCUMENT = Document(Path(__file__), DOC, render, {"soak": soak, "elastic": elastic}, readme_quotes=with_quotes,
                    quote_tag="fault_tolerance")

if __name__ == "__main__":
    sys.exit(main(DOCUMENT))
