"""The checks of scripts/elastic_local.sh, once its elastic run has finished.

    python scripts/lib/elastic_check.py OUT TOLERANCE TIMEOUT_S OVERRIDES...

The elastic run (OUT/elastic) changed world size at each restart; its rank-0 log says each time
"resumed step K of S at W ranks as S at W' ranks". The same training is switched by hand at
the same checkpoints on one host: the first world size from the start, stopped at step K
(trainer.stop_at) and resumed from that checkpoint, copied into a new run directory, at the next
world size, and so on to the end (OUT/hand_0, hand_1, ...). Checked: the final models are equal
within TOLERANCE (relative to the largest parameter), and every step consumed the same sample
ids on every rank (trainer.log_samples); reported, and written to OUT/elastic.json: the seconds
(from the times the script wrote into OUT/lost_at, recovered_at, rejoined_at and back_at)
from the loss of the host to the end of the first step at the smaller size, the steps redone,
and, where the host came back, the seconds from its return to the first step at the full size.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from minidist.train.checkpoint import consolidate, latest_checkpoint, read_meta, step_dir_name  # noqa: E402

RESUMED = re.compile(r"resumed step (\d+) of \S+ at (\d+) ranks as \S+ at (\d+) ranks")


def resumes(run: Path) -> list[tuple[int, int, int]]:
    """(step, world before, world after) of each restart, in order, from the rank-0 log."""
    return [tuple(map(int, m.groups())) for m in RESUMED.finditer((run / "logs" / "rank_0.log").read_text())]


def sample_lines(path: Path) -> list[tuple[int, list[str]]]:
    return [(int(p[0]), p[1:]) for p in (line.split() for line in path.read_text().splitlines()) if p]


def consumed(run: Path, segments: list[tuple[int, int, int]]) -> dict[int, list[str]]:
    """step -> the sample ids every rank consumed in it, in rank order, as the run's final history
    has it. `segments`: (first step, last step, world size) of that history. A rank's file is
    appended to by every attempt it took part in, so its last line for a step is that of the last
    attempt that ran the step; the ranks of a step are those of its segment's world size (a
    rank of a lost host wrote lines for steps the survivors then redid without it)."""
    last = {int(f.stem.split("_")[1]): dict(sample_lines(f)) for f in (run / "samples").glob("rank_*.txt")}
    return {step: [i for r in range(world) for i in last.get(r, {}).get(step, ["<missing>"])]
            for first, end, world in segments for step in range(first, end + 1)}


def torchrun(nproc: int, run_dir: Path, overrides: list[str], timeout_s: float) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(ROOT / "recipes" / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    (run_dir.parent / f"{run_dir.name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"elastic_check: the hand-switched run in {run_dir} failed:\n{done.stderr[-3000:]}")


def largest_relative_difference(mine: dict, ref: dict) -> float:
    scale = max(v.abs().max().item() for v in ref.values() if v.is_floating_point())
    return max(((mine[k].double() - v.double()).abs() / (v.double().abs() + scale)).max().item()
               for k, v in ref.items() if v.is_floating_point())


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        raise SystemExit(__doc__)
    out, tolerance, timeout_s, overrides = Path(argv[0]), float(argv[1]), float(argv[2]), argv[3:]
    run = out / "elastic"
    steps = int(read_meta(latest_checkpoint(run))["step"])
    changes = resumes(run)
    if not changes:
        raise SystemExit(f"elastic_check: {run} never resumed at another world size")
    # Segments of the final history: (first step, last step) at each world size.
    bounds = [0, *[k for k, _, _ in changes], steps]
    worlds = [changes[0][1], *[w for _, _, w in changes]]
    segments = [(a + 1, b) for a, b in zip(bounds, bounds[1:])]
    hands = []
    for i, (world, (first, last)) in enumerate(zip(worlds, segments)):
        hand = out / f"hand_{i}"
        if i > 0:  # the previous segment's checkpoint of the step the elastic run resumed from
            (hand / "checkpoints").mkdir(parents=True)
            shutil.copytree(hands[-1] / "checkpoints" / step_dir_name(first - 1), hand / "checkpoints" / step_dir_name(first - 1))
        stop = [f"trainer.stop_at={last}"] if last < steps else []
        torchrun(world, hand, [*overrides, *stop], timeout_s)
        hands.append(hand)
    history = [(first, last, world) for (first, last), world in zip(segments, worlds)]
    reference = {}
    for hand, segment in zip(hands, history):
        reference.update(consumed(hand, [segment]))
    mine = consumed(run, history)
    samples_same = mine == reference and not any("<missing>" in ids for ids in mine.values())
    a, b = latest_checkpoint(run), latest_checkpoint(hands[-1])
    x, y = consolidate(a), consolidate(b)
    worst = largest_relative_difference(x, y)
    bitwise = x.keys() == y.keys() and all(x[k].equal(v) for k, v in y.items())
    meta = read_meta(a)
    stamp = lambda name: float((out / name).read_text()) if (out / name).is_file() else None  # noqa: E731
    lost_step, before, after = changes[0]
    reached = next_reached(run, lost_step)
    result = {"world_sizes": worlds, "resumed_at_steps": [k for k, _, _ in changes], "final_step": meta["step"],
              "final_world_size": meta["world_size"], "reached_before_loss": reached,
              "steps_redone_after_loss": reached - lost_step,
              "seconds_loss_to_first_step": round(stamp("recovered_at") - stamp("lost_at"), 2),
              "seconds_loss_to_leaving": left_after(run, stamp("lost_at"))}
    if stamp("back_at") is not None:
        result["seconds_return_to_first_step"] = round(stamp("back_at") - stamp("rejoined_at"), 2)
        result["steps_redone_after_return"] = (next_reached(run, changes[1][0]) - changes[1][0]) if len(changes) > 1 else None
    settings = dict(o.split("=", 1) for o in [*overrides, *os.environ.get("RDZV_CONF", "").split(",")] if "=" in o)
    result.update({"peer_timeout_s": float(settings.get("launcher.peer_timeout_s", 0)),
                   "last_call_timeout_s": float(settings.get("last_call_timeout", 30))})  # torch's default: 30 s
    result.update({"largest_relative_difference": worst, "bitwise": bitwise, "samples_identical": samples_same,
                   "tolerance": tolerance})
    result["ok"] = a.name == b.name and worst <= tolerance and samples_same
    (out / "elastic.json").write_text(json.dumps(result, indent=1))
    print(f"elastic_check: world sizes {' -> '.join(map(str, worlds))}, switched at steps "
          f"{', '.join(str(k) for k, _, _ in changes)}; {before} ranks reached step {reached} before the loss: "
          f"{reached - lost_step} step(s) redone; {result['seconds_loss_to_first_step']:.1f} s from the loss to the end "
          f"of the first step at {after} ranks (the survivors left after {result['seconds_loss_to_leaving']} s)")
    if "seconds_return_to_first_step" in result:
        print(f"elastic_check: the host came back: {result['seconds_return_to_first_step']:.1f} s to the end of the "
              f"first step at {worlds[-1]} ranks, {result['steps_redone_after_return']} step(s) redone")
    print(f"elastic_check: final {a.name} at {meta['world_size']} ranks vs the hand-switched run's {b.name}: largest "
          f"relative difference {worst:.1e} ({'bitwise equal' if bitwise else 'within ' if worst <= tolerance else 'ABOVE '}"
          f"{'' if bitwise else f'{tolerance:g}'}); sample ids of every step {'identical' if samples_same else 'DIFFERENT'}")
    return 0 if result["ok"] else 1


def left_after(run: Path, lost_at: float) -> float | None:
    """Seconds from the loss to rank 0's leaving the group (its PeerLost failure record), if it left so."""
    try:
        record = json.loads((run / "logs" / "rank_0.failure.json").read_text())
    except (OSError, ValueError):
        return None
    return round(record["time"] - lost_at, 2) if "PeerLost" in record.get("line", "") else None


def next_reached(run: Path, resumed_step: int) -> int:
    """The last step rank 0 finished before the restart that resumed from `resumed_step`: the end
    of the stretch of its sample lines that the restart cut short."""
    reached, previous = resumed_step, None
    for step, _ in sample_lines(run / "samples" / "rank_0.txt"):
        if previous is not None and step != previous + 1 and step == resumed_step + 1 and previous >= resumed_step:
            return previous
        previous = step
    return reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
