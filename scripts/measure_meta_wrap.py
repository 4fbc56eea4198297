"""The resident set of wrapping a meta-built model at stage 3, against FSDP2's meta path.

    .venv/bin/python scripts/measure_meta_wrap.py        # -> docs/benchmarks/data/meta_wrap.json (~5 min)

16 blocks of two Linear(2048, 2048) (513 MiB in fp32), built under torch.device("meta"), in fresh
ranks. Ours: `ShardedDataParallel(net, AdamW, stage=3)` (each block a unit: materialised into this
rank's shard, meta_init.py). FSDP2's: `fully_shard` on each block and the root, `to_empty`,
`reset_parameters`, then its AdamW. A thread samples the rank's anonymous resident memory (RssAnon,
/proc/self/status: heap and anonymous mappings, where tensors and Python's objects live) every
0.5 ms from before the model is built: the peak while wrapping and what is kept after it, above
what the process held before; and the file-backed part (RssFile: torch's libraries paged in as
they first run, shared with every process that maps them) kept after it. Both allocators:
glibc's default (ranks started by torchrun, as a user starts them) and the ranks minidist starts
(launcher.nproc: MALLOC_MMAP_THRESHOLD_, minidist/train/app.py). 2 and 4 ranks, the two wrappers
interleaved, each case ROUNDS times. scripts/make_benchmarks.py renders docs/benchmarks.md's section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "lib"))
sys.path.insert(0, str(ROOT / "recipes"))
from bench_memory import rss_bytes  # noqa: E402

BLOCKS, WIDTH, ROUNDS, WORLDS = 16, 2048, 2, (2, 4)
OUT = ROOT / "docs" / "benchmarks" / "data" / "meta_wrap.json"


class Sampler:
    """The peak of RssAnon over a span, sampled every 0.5 ms by a thread."""

    def __init__(self):
        self.peak, self._stop = 0, False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.0005)

    def stop(self) -> int:
        self._stop = True
        self._thread.join()
        return max(self.peak, rss_bytes())


def build():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    with torch.device("meta"):
        return nn.Sequential(*(Block() for _ in range(BLOCKS)))


def wrap(kind: str, net):
    import torch
    import minidist

    if kind == "ours":
        return minidist.ShardedDataParallel(net, torch.optim.AdamW(net.parameters(), lr=1e-3), stage=3)
    from torch.distributed.fsdp import fully_shard
    for block in net:
        fully_shard(block)
    fully_shard(net)
    net.to_empty(device="cpu")
    for m in net.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    net.optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)  # (ours builds its optimizer while wrapping)
    return net


def measure(kind: str) -> dict:
    """On each rank: the resident set the wrap added, at its peak and after it; and the model state."""
    import gc

    import torch
    import torch.distributed as dist
    import minidist

    from torch.distributed.fsdp import fully_shard  # noqa: F401 - imported before the baseline, as minidist is

    torch.set_num_threads(1)
    minidist.init_distributed(backend="gloo", timeout_s=300)
    gc.collect()
    before, file_before = rss_bytes(), rss_bytes("RssFile")
    sampler = Sampler()
    model = wrap(kind, build())
    dist.barrier()
    gc.collect()
    peak = sampler.stop() - before
    state = sum(s.master.numel() * s.master.element_size() for s in model._shards) if kind == "ours" else \
        sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    result = {"peak": peak, "kept": rss_bytes() - before, "kept_file": rss_bytes("RssFile") - file_before,
              "state": state, "threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}
    minidist.shutdown()
    return result


def run_case(kind: str, world: int, allocator: str) -> list[dict]:
    """One launch: every rank's result."""
    if allocator == "minidist":
        from minidist.train.app import run_local

        return list(run_local(measure, nproc=world, args=(kind,)).values())
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = ROOT / "outputs" / "meta_wrap" / f"{kind}_{world}"
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                    __file__, "--rank", kind, str(out)], check=True, env={**env, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(world)]


def main() -> None:
    import torch
    from doc_pipeline import provenance, record

    cases = {}
    for rnd in range(ROUNDS):
        for world in WORLDS:
            for allocator in ("glibc", "minidist"):
                for kind in (("ours", "fsdp2") if rnd % 2 == 0 else ("fsdp2", "ours")):  # interleaved
                    ranks = run_case(kind, world, allocator)
                    key = f"{kind} {world} {allocator}"
                    cases.setdefault(key, []).append({f: max(r[f] for r in ranks) for f in ("peak", "kept",
                                                                                            "kept_file", "state")})
                    print(key, {f: f"{v / 2**20:.1f}" for f, v in cases[key][-1].items()}, flush=True)
    record(OUT, {"blocks": BLOCKS, "width": WIDTH, "rounds": ROUNDS, "worlds": list(WORLDS), "cases": cases},
           provenance("python scripts/measure_meta_wrap.py", torch.__version__))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:  # one rank under torchrun (glibc's default allocator)
        result = measure(sys.argv[2])
        Path(sys.argv[3], f"{os.environ['RANK']}.json").write_text(json.dumps(result))
    else:
        main()
