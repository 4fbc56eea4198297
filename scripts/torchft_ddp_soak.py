"""torchft's own DDP on the live-recovery soak's kill schedule: the comparison docs/fault_tolerance.md
sets beside minidist's live recovery (scripts/make_fault_tolerance_doc.py --only live runs it).

torchft's DDP (torchft.ddp.DistributedDataParallel, torchft.optim.OptimizerWrapper, as its
train_ddp.py example uses them) averages across replica groups only, so its groups are of one
rank: 4 x 1 here, make train's model and data (gpt_nano on stdlib_text, micro-batch 16: the same
64 samples a step at 4 groups as minidist's 2 x 2), AdamW at make train's settings, torchft's
defaults but the timeouts (the soak's ft.timeout_s: 5 s for a collective, 1 s heartbeat). A
launcher runs a lighthouse and the 4 groups and relaunches a dead one (cold, as one torchrun per
group would): first without kills, then with a random training group SIGKILLed every
--kill-every-s, given --give-up-s. What it keeps: the furthest step a live group holds at the end
(no checkpoints: a step lost when every group restarted from step 0 is not kept), per second, over
the run without kills'; and how many survivors died with a peer, and of what.

    python scripts/torchft_ddp_soak.py --out FILE [--steps 1000 --kill-every-s 15 --give-up-s S]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

GROUPS, MICRO_BATCH = 4, 16


def worker(group: int, steps: int, lighthouse: str, log: Path) -> None:
    """One replica group of one rank: torchft's DDP loop, each committed step a line in `log`."""
    import torch
    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    from minidist.dist import free_port
    from minidist.train.config import compose_fresh
    from minidist.train.data import build_datasets
    from minidist.train.models import GPT, build_model

    cfg = compose_fresh("train")
    train, _, info = build_datasets(cfg.data, int(cfg.model.block_size))
    torch.manual_seed(int(cfg.trainer.seed))
    model = build_model(cfg.model, info)
    timeout, holder, port = timedelta(seconds=5), {}, free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 - the group's
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1, timeout=timeout,
                      load_state_dict=lambda s: (model.load_state_dict(s["model"]), holder["optim"].load_state_dict(s["optim"])),
                      state_dict=lambda: {"model": model.state_dict(), "optim": holder["optim"].state_dict()},
                      replica_id=f"group{group}", rank=0, world_size=1, store_addr="127.0.0.1", store_port=port,
                      lighthouse_addr=lighthouse)
    ddp = DistributedDataParallel(manager, model)
    optim = holder["optim"] = OptimizerWrapper(manager, torch.optim.AdamW(
        model.parameters(), lr=float(cfg.optim.lr), betas=tuple(cfg.optim.betas), weight_decay=float(cfg.optim.weight_decay)))
    rng = torch.Generator()
    with open(log, "a") as out:
        while manager.current_step() < steps:
            rng.manual_seed(manager.current_step() * GROUPS + group)  # (which samples: not what is measured)
            x, y = zip(*(train[int(i)] for i in torch.randint(len(train), (MICRO_BATCH,), generator=rng)))
            optim.zero_grad()  # starts the quorum
            GPT.loss(ddp(torch.stack(x)), torch.stack(y)).backward()
            step, participants = manager.current_step(), manager.num_participants()
            optim.step()  # commits (the vote) or not
            if manager.current_step() > step:
                out.write(json.dumps({"step": step, "participants": participants, "time": time.time()}) + "\n")
                out.flush()


def run(work: Path, steps: int, kill_every_s: float, give_up_s: float) -> dict:
    """The 4 groups until one finishes or `give_up_s` passes, a kill every `kill_every_s` (0: none):
    the time, and the steps kept (the furthest step a live group holds at the end: a step lost to a
    restart from step 0 is not kept)."""
    os.environ.setdefault("RUST_LOG", "warn")  # (read at torchft's import: its Rust side logs every quorum)
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2500, heartbeat_timeout_ms=1000)
    work.mkdir(parents=True)
    logs = [work / f"group_{g}.jsonl" for g in range(GROUPS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}

    def start(g: int) -> subprocess.Popen:
        with open(work / f"group_{g}.out", "a") as out:
            return subprocess.Popen([sys.executable, __file__, "--group", str(g), "--steps", str(steps),
                                     "--lighthouse", lighthouse.address(), "--log", str(logs[g])],
                                    env=env, stdout=out, stderr=out, start_new_session=True)

    def last(g: int) -> dict | None:  # the group's last committed step
        rows = logs[g].read_text().splitlines() if logs[g].is_file() else []
        return json.loads(rows[-1]) if rows else None

    started, procs, rng = time.monotonic(), {g: start(g) for g in range(GROUPS)}, random.Random(2026)
    kills, deaths, next_kill, finished = 0, [], time.monotonic() + kill_every_s, False
    try:
        while time.monotonic() - started < give_up_s:
            time.sleep(0.1)
            if finished := any((r := last(g)) and r["step"] >= steps - 1 for g in range(GROUPS)):
                break
            g = rng.randrange(GROUPS)  # a group training (committed within 2 s) is killed, on the schedule
            if kill_every_s and time.monotonic() >= next_kill and (r := last(g)) and r["time"] > time.time() - 2:
                procs[g].kill()
                kills, next_kill = kills + 1, time.monotonic() + kill_every_s
            for g, p in procs.items():
                if (code := p.poll()) is not None and code != 0:
                    deaths.append({"group": g, "killed": code == -signal.SIGKILL})
                    procs[g] = start(g)
        elapsed = time.monotonic() - started
        kept = max((r["step"] + 1 for g in range(GROUPS) if procs[g].poll() is None and (r := last(g))), default=0)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        lighthouse.shutdown()
    crashed = [d for d in deaths if not d["killed"]]  # survivors that did not survive a peer's death
    return {"s": round(elapsed, 1), "finished": finished, "steps_kept": steps if finished else kept, "kills": kills,
            "crashed": len(crashed),
            "crash_lines": sorted({line for d in crashed for line in tail_error(work / f"group_{d['group']}.out")})}


def tail_error(path: Path) -> list[str]:
    """The last error line of a group's output (what killed a survivor)."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if "Error" in line]
    return lines[-1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out"), parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--kill-every-s", type=float, default=15)
    parser.add_argument("--give-up-s", type=float, help="the run with kills stops after this (default: twice the straight run's)")
    parser.add_argument("--group", type=int), parser.add_argument("--lighthouse"), parser.add_argument("--log")
    a = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (the launcher's finally stops its groups)
    if a.group is not None:
        return worker(a.group, a.steps, a.lighthouse, Path(a.log))
    work = Path(tempfile.mkdtemp(prefix="minidist-torchft-ddp-"))
    straight = run(work / "straight", a.steps, 0, 3000)
    assert straight["finished"], f"torchft's DDP without kills did not finish: see {work}"
    killed = run(work / "killed", a.steps, a.kill_every_s, a.give_up_s or 2 * straight["s"])
    figures = {"groups": GROUPS, "group_size": 1, "steps": a.steps, "kill_every_s": a.kill_every_s,
               "straight_s": straight["s"], "with_kills_s": killed["s"],
               **{k: killed[k] for k in ("finished", "steps_kept", "kills", "crashed", "crash_lines")},
               "ratio": round(killed["steps_kept"] / killed["s"] / (a.steps / straight["s"]), 3)}
    print(json.dumps(figures))
    if a.out:
        Path(a.out).write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
