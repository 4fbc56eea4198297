"""What a stuck NCCL collective leaves behind for the person who has to find it.

On gloo a collective that times out raises in the rank that called it, and collective_failure.py
names the step and the collective. On NCCL the waiting happens on the GPU: the host never blocks inside a
collective (wait() only makes a stream wait), and at launcher.timeout_s NCCL's watchdog thread
tears the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING's default) before Python code can name
anything. So every run switches on NCCL's flight recorder: each rank keeps a record of its last
collectives (op, sizes, process group, scheduled / started / completed) and the watchdog dumps
it, when it fires, into the run's logs folder. The launcher's failure message then says where
the dumps are and how to read them: torch's fr_trace reports the first collective the ranks
disagree on. Settings the user exported win (os.environ.setdefault).
"""

from __future__ import annotations

import os
from pathlib import Path

FLIGHT_RECORDER_ENTRIES = 2000  # collectives remembered per rank: a few steps of a large model
DUMP_PREFIX = "nccl_trace_rank_"  # torch appends the rank


def flight_recorder_env(log_dir: Path) -> dict[str, str]:
    """The environment that makes NCCL's watchdog dump its flight recorder into `log_dir`."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(log_dir) / DUMP_PREFIX)}


def enable_flight_recorder(log_dir: Path) -> None:
    """Before the process group exists (NCCL reads these when it is created)."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    for key, value in flight_recorder_env(log_dir).items():
        os.environ.setdefault(key, value)


def dumps_line(log_dir: Path) -> str | None:
    """One line naming the flight recorder's dumps in `log_dir`, or None when there are none."""
    dumps = sorted(Path(log_dir).glob(f"{DUMP_PREFIX}*"))
    if not dumps:
        return None
    return (f"NCCL's watchdog dumped the last collectives of rank(s) "
            f"{', '.join(d.name[len(DUMP_PREFIX):] for d in dumps)} into {log_dir}/{DUMP_PREFIX}*: "
            f"python -m torch.distributed.flight_recorder.fr_trace {log_dir} --prefix {DUMP_PREFIX} "
            "names the collective the ranks disagree on")
