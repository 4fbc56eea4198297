"""The command line of every recipe, wherever it is started from: `python recipes/train.py`,
`minidist train` (the installed command), `python -m minidist.train` (so that
`torchrun --nproc_per_node 4 -m minidist.train strategy=zero3` works from any directory).

Hydra overrides as usual; outputs under the current directory (outputs/train/DATE/TIME, or
hydra.run.dir); the configs from minidist.train.config (the repository's, or the copy a
wheel carries). A mistake in an override (`trainer.max_step=5`, `strategy=zer3`) is one line
naming it and the closest valid names, exit status 2; `HYDRA_FULL_ERROR=1` shows Hydra's own.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from typing import Callable


# A --multirun sweep's jobs as they end: (the job, its exit status). The train body records them and
# goes on to the next job; run_app ends the sweep with a tally. VARYING: the keys the sweep varies,
# which name its jobs.
JOBS: list[tuple[str, int]] = []
VARYING: set[str] = set()


def run_app(config_name: str, body: Callable, argv: list[str], prog: str,
            precheck: Callable | None = None) -> None:
    """Run `body(cfg)` as a Hydra app on configs/<config_name>.yaml with `argv`'s overrides.

    A sweep (-m) first composes every job's config and runs `precheck(cfg)` on each (raising
    ConfigError), so that a bad setting in any job is said, one line a job, before any launches."""
    import hydra

    from minidist.dist import launch_rank
    from minidist.train.config import config_dir

    sys.argv = [prog, *argv]
    if launch_rank() != 0:
        sys.argv.append("hydra/hydra_logging=disabled")  # Hydra's own lines come from rank 0 only
    wants_full = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its errors to us instead of printing them
    JOBS.clear()
    VARYING.clear()
    try:
        if {"-m", "--multirun"} & set(argv):
            jobs = sweep_jobs(config_name, argv)
            VARYING.update(k for k in {o.split("=", 1)[0] for job in jobs for o in job}
                           if len({o for job in jobs for o in job if o.split("=", 1)[0] == k}) > 1)
            if precheck is not None:
                check_every_job(config_name, jobs, precheck)
        hydra.main(config_path=str(config_dir()), config_name=config_name, version_base="1.3")(body)()
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors, re-raised unless one line says it
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if wants_full or not isinstance(e, (HydraException, OmegaConfBaseException)):
            raise
        if launch_rank() == 0:
            print(f"error: {override_error(e, config_name, argv)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        if not wants_full:
            os.environ.pop("HYDRA_FULL_ERROR", None)
    failed = [(job, status) for job, status in JOBS if status]
    if JOBS and launch_rank() == 0:
        print(f"sweep: {len(JOBS)} job(s), {len(JOBS) - len(failed)} done, {len(failed)} failed"
              + (f" ({'; '.join(job for job, _ in failed)})" if failed else ""), file=sys.stderr, flush=True)
    if failed:
        raise SystemExit(max(status for _, status in failed))


def sweep_jobs(config_name: str, argv: list[str]) -> list[list[str]]:
    """The override list of every job a sweep runs, as Hydra's basic sweeper expands them (the
    command line's sweeps, and those the config itself declares under hydra.sweeper.params)."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from minidist.train.config import config_dir

    parser = OverridesParser.create()
    given = parser.parse_overrides([a for a in argv if not a.startswith("-")])
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=[o.input_line for o in given if not o.is_sweep_override()],
                          return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    declared = [f"{k}={v}" for k, v in (cfg.hydra.sweeper.get("params") or {}).items()]
    return [job for batch in BasicSweeper.split_arguments(parser.parse_overrides(declared) + given, None)
            for job in batch]


def job_name(num: int, overrides) -> str:
    """`job 1 (strategy=zero3)`: its number and what the sweep varies (all its overrides if nothing)."""
    varying = [o for o in overrides if o.split("=", 1)[0] in VARYING] or list(overrides)
    return f"job {num} ({' '.join(varying)})"


def check_every_job(config_name: str, jobs: list[list[str]], precheck: Callable) -> None:
    """Compose each job of a sweep and `precheck` it; any job's ConfigError: one line each, then
    exit 2 with nothing launched."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from minidist.train.config import config_dir
    from minidist.train.config import ConfigError

    bad = []
    for n, job in enumerate(jobs):
        overrides = [o for o in job if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
                precheck(compose(config_name=config_name, overrides=overrides))
        except ConfigError as e:
            bad.append(f"{job_name(n, overrides)}: {e}")
        finally:
            GlobalHydra.instance().clear()
    if bad:
        for line in bad:
            print(f"error: {line}", file=sys.stderr, flush=True)
        print(f"sweep: {len(bad)} of {len(jobs)} job(s) have settings to fix: nothing was launched", file=sys.stderr,
              flush=True)
        raise SystemExit(2)


def hydra_app(config_name: str):
    """`@hydra_app("bench_ddp")` on a recipe's `main(cfg)`: run_app's command line for it."""
    def decorate(body: Callable) -> Callable:
        def main(argv: list[str] | None = None, prog: str | None = None) -> None:
            run_app(config_name, body, sys.argv[1:] if argv is None else argv, prog or sys.argv[0])
        return main
    return decorate


def override_error(e: Exception, config_name: str, argv: list[str]) -> str:
    """Hydra's composition error as one line: the override, what is wrong, the closest valid names."""
    text, cause = str(e), str(e.__cause__ or "")
    missing = re.search(r"Could not find '([^']+)/([^']+)'", text)
    if missing and getattr(e, "options", None):
        group, name = missing.groups()
        return f"{group}={name}: no such {group}{_did_you_mean(name, e.options)} (the choices: {', '.join(e.options)})"
    unknown = re.search(r"full_key: (\S+)", cause)
    if "not in struct" in cause and unknown:
        key = unknown.group(1)
        parent, _, leaf = key.rpartition(".")
        siblings = [str(k) for k in _keys_at(config_name, argv, parent)]
        close = difflib.get_close_matches(leaf, siblings, n=2, cutoff=0.6)
        full = [f"{parent}.{k}" if parent else k for k in (close or siblings)]
        return f"{key}: no such key" + (f"; did you mean {' or '.join(full)}?" if close else
                                        f" (the keys there: {', '.join(full)})")
    appended = re.search(r"An item is already at '([^']+)'", text)
    if appended:
        return f"+{appended.group(1)}: the key exists already; set it without the +: {appended.group(1)}=..."
    bad = [a for a in argv if not _parses(a)]
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return f"{bad[0]}: not an override Hydra can parse ({first})" if bad else first


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _keys_at(config_name: str, argv: list[str], path: str) -> list[str]:
    """The keys under `path` of the config as composed with argv's group choices (strategy=zero3)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from minidist.train.config import config_dir

    choices = [a for a in argv if "=" in a and "." not in a.split("=", 1)[0] and not a.startswith(("+", "~", "-"))]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            try:
                cfg = compose(config_name=config_name, overrides=choices)
            except Exception:  # noqa: BLE001 - a bad choice too: the defaults then
                cfg = compose(config_name=config_name)
    finally:
        GlobalHydra.instance().clear()
    node = OmegaConf.select(cfg, path) if path else cfg
    return list(node.keys()) if hasattr(node, "keys") else []


def _parses(override: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if override.startswith("-"):  # --multirun, -m, --help, ...: Hydra's flags
        return True
    try:
        OverridesParser.create().parse_overrides([override])
        return True
    except Exception:  # noqa: BLE001
        return False


def train(cfg) -> None:
    """Validate and train (launch_train.launch); exit with its status. In a sweep, a job that failed
    is recorded (JOBS) and the next one runs; a stop signal (status 128 + N) ends the sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from minidist.train.launch_train import launch

    hydra = HydraConfig.get()
    job = job_name(hydra.job.num, hydra.overrides.task) if hydra.mode == RunMode.MULTIRUN else None
    status = launch(cfg, hydra.runtime.output_dir, job=job)
    if job is not None and status < 128:
        JOBS.append((job, status))
    elif status:
        sys.exit(status)


def check_job(cfg) -> None:
    """A sweep's job's settings, checked before any job launches (the run directory is checked at
    the job's own launch)."""
    import tempfile
    from pathlib import Path

    from minidist.train.config_check import validate
    from minidist.train.launch_train import world_size_for

    validate(cfg, world_size_for(cfg), Path(tempfile.gettempdir()) / "minidist-sweep-check-no-run-dir")


def main(argv: list[str] | None = None, prog: str = "python -m minidist.train") -> None:
    run_app("train", train, sys.argv[1:] if argv is None else argv, prog, precheck=check_job)
