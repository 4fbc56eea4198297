"""Put on PYTHONPATH by test_live_recovery.py: every process of the run appends each file it opens
for reading under a checkpoints/ folder to $MINIDIST_AUDIT_OPENS (with its group), so a test can assert that a
relaunched group healed from a peer and read no checkpoint."""

import os
import sys

_log = os.environ.get("MINIDIST_AUDIT_OPENS")


def _hook(event, args):
    if event == "open" and _log and isinstance(args[0], (str, bytes, os.PathLike)):
        path, mode = os.fsdecode(args[0]), args[1]
        if "/checkpoints/" in path and isinstance(mode, str) and not set(mode) & set("wax+"):
            with open(_log, "a") as f:  # (not under checkpoints/: not audited itself)
                f.write(f"{os.environ.get('MINIDIST_FT_LAUNCHED_AT', '-')} {path}\n")


if _log:
    sys.addaudithook(_hook)
