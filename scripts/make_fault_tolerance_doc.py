"""Regenerate docs/fault_tolerance.md from a real soak run (make test-all's soak test).

    python scripts/make_fault_tolerance_doc.py                # run the soak (~2 min on 2 cores), then render
    python scripts/make_fault_tolerance_doc.py --render-only  # rewrite the document from the committed data
    sudo python scripts/make_fault_tolerance_doc.py --only elastic   # the host lost and back (~2 min, root)
    python scripts/make_fault_tolerance_doc.py --only live      # live recovery's long soak (~15 min, torchft)

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
from doc_pipeline import Document, fill, fill_quotes, load, made_by, main, provenance, record  # noqa: E402

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


LIVE = ROOT / "docs" / "fault_tolerance" / "data" / "live_soak.json"
LIVE_TEST = "tests/test_live_recovery.py::test_live_recovery_soak_kills_on_a_schedule"
LIVE_ENV = {"MINIDIST_LIVE_SOAK_JOB": "default", "MINIDIST_LIVE_SOAK_GROUP_SIZE": "2", "MINIDIST_LIVE_SOAK_STEPS": "1000",
            "MINIDIST_LIVE_SOAK_KILL_EVERY_S": "15", "MINIDIST_LIVE_SOAK_KILLING": "0.9", "MINIDIST_LIVE_SOAK_DELAY_S": "0"}
LIVE_COMMAND = " ".join(f"{k}={v}" for k, v in LIVE_ENV.items()) + f" MINIDIST_LIVE_SOAK_OUT=FILE python -m pytest {LIVE_TEST}"


def live() -> None:
    """Live recovery's long soak (the soak test with MINIDIST_LIVE_SOAK_OUT): its figures committed."""
    import torch

    out = Path(tempfile.mkdtemp(prefix="minidist-live-soak-")) / "live_soak.json"
    env = {**os.environ, **LIVE_ENV, "MINIDIST_LIVE_SOAK_OUT": str(out), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", LIVE_TEST], cwd=ROOT, env=env)
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"the live soak test failed (exit {done.returncode}): nothing written")
    results = json.loads(out.read_text())
    theirs = out.parent / "torchft_ddp.json"  # torchft's own DDP on the same schedule, as long as the restart-based run
    done = subprocess.run([sys.executable, "scripts/torchft_ddp_soak.py", "--out", str(theirs), "--steps",
                           str(results["steps"]), "--kill-every-s", str(results["kill_every_s"]),
                           "--give-up-s", str(1.2 * results["with_kills_s"])], cwd=ROOT, env=env)
    if done.returncode != 0 or not theirs.is_file():
        raise SystemExit(f"scripts/torchft_ddp_soak.py failed (exit {done.returncode}): nothing written")
    results["torchft_ddp"] = json.loads(theirs.read_text())
    record(LIVE, results, provenance(LIVE_COMMAND + "; python scripts/torchft_ddp_soak.py", torch.__version__))


def live_values() -> dict:
    """The live soak's figures as the template's values (live=False where none is committed)."""
    if not LIVE.is_file():
        return {"live": False}
    d, r = load(LIVE)["results"], load(LIVE)["results"]["restart_based"]
    per_s = lambda samples, s: samples / s  # noqa: E731
    return dict(
        live=True, l_steps=f"{d['steps']:,}", l_groups=d["groups"], l_group_size=d["group_size"],
        l_strategy=d["strategy"], l_every_s=f"{d['kill_every_s']:g}", l_kills=len(d["kills"]),
        l_job="`make train`'s job (gpt_nano on stdlib_text, micro-batch 16)" if d["job"] == "default" else "a tiny GPT",
        l_ckpt_every=d["ckpt_every"],
        l_straight_s=f"{d['straight_s']:.1f}", l_killed_s=f"{d['with_kills_s']:.1f}",
        l_straight_rate=f"{per_s(d['straight_samples'], d['straight_s']):.0f}",
        l_killed_rate=f"{per_s(d['committed_samples'], d['with_kills_s']):.0f}",
        l_ratio=f"{100 * d['ratio']:.1f}%", l_meets="meets" if d["ratio"] >= 0.85 else "falls short of",
        l_discarded=d["steps_discarded"], l_heals=d["heals"], l_heal_s=f"{d['heal_s_median']:.2f}",
        r_straight_s=f"{r['straight_s']:.1f}", r_killed_s=f"{r['with_kills_s']:.1f}", r_kills=r["kills"],
        r_ratio=f"{100 * r['ratio']:.0f}%", r_stopped="" if r["finished"] else f", then stopped: {r['steps_committed']:,} steps checkpointed",
        **torchft_ddp_values(d.get("torchft_ddp"), d["steps"]),
        **made_by(load(LIVE)["provenance"], "l_", "torch"))


def torchft_ddp_values(t: dict | None, steps: int) -> dict:
    """torchft's own DDP on the soak's schedule (scripts/torchft_ddp_soak.py), where it was run."""
    if t is None:
        return {"torchft_ddp": False}
    crashed = (f" {t['crashed']} of its surviving groups died with a peer ({'; '.join(t['crash_lines'])}: its "
               "comm hook when a peer dies mid-reduce), and it keeps no checkpoint, so where every group had died "
               "it began again from step 0." if t["crashed"] else " No surviving group died with a peer.")
    return dict(torchft_ddp=True, t_groups=t["groups"], t_group_size=t["group_size"], t_kills=t["kills"],
                t_killed_s=f"{t['with_kills_s']:.1f}", t_straight_s=f"{t['straight_s']:.1f}",
                t_stopped="" if t["finished"] else f", then stopped: step {t['steps_kept']:,} of {steps:,} held",
                t_ratio=f"{100 * t['ratio']:.0f}%", t_crashed=crashed)


def render() -> str:
    soak, elastic = load(DATA), load(ELASTIC) if ELASTIC.is_file() else None
    d, p = soak["results"], soak["provenance"]
    kills, redone = d["kills"], d["redone_steps"]
    per_step = d["straight_s"] / d["steps"]
    values = dict(
        steps=f"{d['steps']:,}", steps_plain=d["steps"], ranks=d["ranks"], kills=len(kills), test=TEST.split("/")[-1],
        strategy=d["strategy"], ckpt_every=d["ckpt_every"], kill_ranks=",".join(str(r) for r, _ in kills),
        kill_steps=",".join(str(s) for _, s in kills), straight_s=f"{d['straight_s']:.1f}",
        with_kills_s=f"{d['with_kills_s']:.1f}", redone=sum(redone), redone_each=" + ".join(map(str, redone)),
        back_to=", ".join(str(step - r) for (_, step), r in zip(kills, redone)), lost_s=f"{d['lost_s']:.1f}",
        lost_per_restart_s=f"{d['lost_s'] / len(kills):.1f}", redone_s=f"{sum(redone) * per_step:.1f}",
        step_ms=f"{1e3 * per_step:.0f}", torch=p["torch"], date=p["date"], commit=p["commit"][:12],
        elastic=elastic is not None, **live_values())
    if elastic is not None:
        e, w = elastic["results"], elastic["results"]["world_sizes"]
        values.update(
            worlds=" -> ".join(map(str, w)), accum_factor=w[0] // w[1],
            leave_s=f"{e['seconds_loss_to_leaving']:.1f}", peer_timeout_s=f"{e['peer_timeout_s']:g}", smaller=w[1],
            first_step_s=f"{e['seconds_loss_to_first_step']:.1f}", e_redone=e["steps_redone_after_loss"],
            reached=e["reached_before_loss"], resumed_at=e["resumed_at_steps"][0],
            returned="seconds_return_to_first_step" in e, back_world=w[-1],
            return_s=f"{e.get('seconds_return_to_first_step', 0):.1f}", return_redone=e.get("steps_redone_after_return"),
            stopped_cleanly=e.get("steps_redone_after_return") == 0,
            same="bitwise equal" if e["bitwise"] else f"within {e['largest_relative_difference']:.1e} relative",
            samples="identical" if e["samples_identical"] else "DIFFERENT", last_call_s=f"{e['last_call_timeout_s']:g}",
            **made_by(elastic["provenance"], "e_", "torch"))
    return fill("fault_tolerance.md", **values)


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


DOCUMENT = Document(Path(__file__), DOC, render, {"soak": soak, "elastic": elastic, "live": live}, readme_quotes=with_quotes,
                    quote_tag="fault_tolerance")

if __name__ == "__main__":
    sys.exit(main(DOCUMENT))
