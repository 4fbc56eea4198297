"""recipes/compare.py's body: check the config, start (or be) the ranks, write the report.

    status = launch(cfg, run_dir, command)   # 0, 1 (a minidist strategy off its reference), 2 (config error)

The comparison's command line: `python recipes/compare.py`, `minidist compare`.

Exit status: 0; 1 when a minidist strategy's final parameters differ from its reference's by
more than compare.tolerance (a regression check for CI); 2 for a config error (one line saying
what and how to fix it).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from omegaconf import OmegaConf

from minidist.compare.report import base_of
from minidist.dist import launch_rank
from minidist.train.app import RanksFailed, run_ranks
from minidist.train.config import ConfigError
from minidist.train.strategies import names as strategy_names, spec


def check_strategies(cfg) -> None:
    """The strategies list itself: known names, no repeats, DeepSpeed installed when asked for."""
    names = list(cfg.compare.strategies)
    if not names:
        raise ConfigError("compare.strategies is empty: name at least one, e.g. compare.strategies=[ddp,native_ddp]")
    known = strategy_names()
    variants = cfg.compare.get("variants") or {}
    for name, v in variants.items():
        if name in known:
            raise ConfigError(f"compare.variants.{name}: a strategy has that name; give the variant its own")
        if v is None or v.get("of") not in known:
            raise ConfigError(f"compare.variants.{name}: needs `of`, the strategy it varies (one of {list(known)}), "
                              "e.g. {of: zero3, param_wire: int8}")
    unknown = [n for n in names if n not in known and n not in variants]
    if unknown:
        raise ConfigError(f"compare.strategies: {unknown} unknown; choose from {list(known)} or name a "
                          "compare.variants entry")
    if len(set(names)) != len(names):
        raise ConfigError(f"compare.strategies={names} names a strategy twice: each runs once per step")
    if any(spec(base_of(n, variants)).kind == "deepspeed" for n in names):
        import torch

        from minidist.train.strategies.deepspeed import import_deepspeed

        gpu = torch.cuda.is_available() and str(cfg.launcher.backend) != "gloo"
        import_deepspeed("cuda" if gpu else "cpu")  # a ConfigError saying how to install it, if missing
    for key in ("steps", "warmup"):
        value = cfg.compare[key]
        if not isinstance(value, int) or value < (1 if key == "steps" else 0):
            raise ConfigError(f"compare.{key}={value!r} must be an integer >= {1 if key == 'steps' else 0}")
    for key in ("tolerance", "loss_tolerance"):
        if not float(cfg.compare[key]) >= 0:
            raise ConfigError(f"compare.{key}={cfg.compare[key]!r} must be >= 0")
    unknown_refs = {k: v for k, v in cfg.compare.references.items()
                    if (k not in known and k not in variants) or (v not in known and v not in variants)}
    if unknown_refs:
        raise ConfigError(f"compare.references: {unknown_refs} names unknown strategies; choose from {list(known)}")
    if str(cfg.trainer.precision) == "fp16":
        raise ConfigError("trainer.precision=fp16: the comparison runs fp32 or bf16 (loss scaling differs between "
                          "DeepSpeed and torch's GradScaler, so the runs would not be comparable); use fp32 or bf16")


def validate_each(cfg, world_size: int, run_dir: Path) -> None:
    """The trainer's own checks (model/data match, batch sizes, ranks vs samples) for every strategy."""
    from minidist.train.config_check import validate

    for name, options in cfg.compare.options.items():
        single = OmegaConf.merge(cfg, {"strategy": options})
        validate(single, world_size, run_dir)


def write_report(results: dict, cfg, run_dir: Path, command: str) -> int:
    """Rank 0's (or the launching process's) last part: every output, the console table, the status."""
    from minidist.compare.report import all_plots
    from minidist.compare.report import (build_rows, console_table, environment_info, regressions, targets_lines,
                                         write_outputs)
    from minidist.profiling import write_chrome_trace

    rows = build_rows(results, cfg.compare)
    timeline_files = []
    if bool(cfg.compare.timeline):
        for name, traces in results["timelines"].items():
            path = run_dir / f"timeline_{name}.json"
            write_chrome_trace(traces, path, name)
            timeline_files.append(path.name)
    results["timeline_files"] = timeline_files
    files = write_outputs(results, rows, run_dir, environment_info(results["backend"]), command)
    plots = all_plots(results, rows, run_dir, bool(cfg.compare.timeline))
    print("\n" + console_table(rows))
    for line in targets_lines(rows):
        print(line)
    print(f"\nreport       {files['report']}\nresults      {files['csv']}, {files['json']}, {files['losses']}\n"
          f"plots        {', '.join(p.name for p in plots)}\n"
          f"tensorboard  tensorboard --logdir {files['tensorboard']}")
    failed = regressions(rows)
    if failed:
        by_params = [n for n in failed if rows[n]["checked_by"] == "parameters"]
        by_loss = [n for n in failed if rows[n]["checked_by"] == "loss"]
        problems = []
        if by_params:
            details = ", ".join(f"{n} vs {rows[n]['reference']}: {rows[n]['final_param_diff']:.3g}" for n in by_params)
            problems.append(f"final parameters differ beyond compare.tolerance={float(cfg.compare.tolerance):g} "
                            f"({details})")
        if by_loss:
            details = ", ".join(f"{n} vs {rows[n]['reference']}: {rows[n]['final_loss_diff']:.2%}" for n in by_loss)
            problems.append(f"final loss differs beyond compare.loss_tolerance="
                            f"{float(cfg.compare.loss_tolerance):g} ({details})")
        print(f"error: {'; '.join(problems)}", file=sys.stderr)
        return 1
    return 0


def _rank_main(cfg_dict: dict, run_dir: str, command: str) -> int | None:
    """One rank: compare, then rank 0 writes the report and returns the status (None elsewhere)."""
    from minidist.compare.run import compare_rank

    results = compare_rank(cfg_dict, run_dir)
    if results is None:
        return None
    return write_report(results, OmegaConf.create(cfg_dict), Path(run_dir), command)


def launch(cfg, run_dir: Path, command: str) -> int:
    from minidist.train.app import world_size_for

    run_dir = Path(run_dir).absolute()
    try:
        world = world_size_for(cfg)
        validate_each(cfg, world, run_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    if launch_rank() == 0:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))  # the resolved config, once
    try:
        statuses = run_ranks(_rank_main, nproc=world, args=(OmegaConf.to_container(cfg, resolve=True), str(run_dir),
                                                            command))
    except RanksFailed as e:
        print(f"error: the comparison failed on rank(s) {e.ranks} (their traceback is above)", file=sys.stderr)
        return 1
    return statuses.get(0) or 0


def strategy_options(name: str, compare_cfg):
    """configs/strategy/NAME.yaml (composed, so its defaults apply; a variant's: its `of`'s, with
    the variant's options), then compare.bucket_cap_mb, compare.shard_size and
    compare.overrides.NAME on top."""
    from hydra import compose
    from omegaconf import OmegaConf

    from minidist.compare.report import base_of, variant_options

    variants = compare_cfg.get("variants") or {}
    options = compose(config_name="train", overrides=[f"strategy={base_of(name, variants)}"]).strategy
    options = OmegaConf.merge(options, variant_options(name, variants))
    if compare_cfg.bucket_cap_mb is not None and "bucket_cap_mb" in options:
        options.bucket_cap_mb = float(compare_cfg.bucket_cap_mb)
    # (DiLoCo with inner=null: every rank is a worker, there are no shard groups to size)
    if compare_cfg.get("shard_size") is not None and "shard_size" in options and options.get("inner", "") is not None:
        options.shard_size = int(compare_cfg.shard_size)
    return OmegaConf.merge(options, compare_cfg.overrides.get(name, {}))


def compare(cfg) -> None:
    """Check the strategies named, then run the comparison (launch_compare.launch); exit with its status."""
    import hydra.errors
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from minidist.dist import launch_rank
    from minidist.train.config import ConfigError

    try:
        check_strategies(cfg)
        options = {name: strategy_options(name, cfg.compare) for name in cfg.compare.strategies}
    except (ConfigError, hydra.errors.MissingConfigException) as e:
        if launch_rank() == 0:
            print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    OmegaConf.set_struct(cfg, False)
    cfg.compare.options = options
    command = f"{sys.argv[0]} " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    status = launch(cfg, Path(HydraConfig.get().runtime.output_dir), command.strip())
    if status:
        sys.exit(status)


def main(argv: list[str] | None = None, prog: str = "minidist compare") -> None:
    from minidist.train.app import run_app

    run_app("compare", compare, sys.argv[1:] if argv is None else argv, prog)
