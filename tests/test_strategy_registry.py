"""The strategy registry: every strategy declared once by its spec, and read from there.

- A strategy registered here, in a test file (the README's ten-line example), trains,
  checkpoints, resumes exactly, consolidates and takes part in a comparison, with no other
  file of minidist changed: the module registers it, and its config names the module.
- No module of minidist outside minidist/train/strategies/ spells a strategy's name.
- Each spec's theory is what the rest of minidist used to compute by hand (the comparison's
  bytes, the RSS bound and the cost model read the same spec).
- Each strategy's config (configs/strategy/NAME.yaml) holds exactly the options its spec says
  it takes, and code without Hydra reads the same file.
"""

from __future__ import annotations

import ast
import re
import contextlib
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from minidist import comm
from minidist.train.config import ConfigError
from minidist.train.strategies import Collective, Strategy, StrategySpec, register
from train_cases import ROOT, assert_same, compose_cfg, tiny, train_on_rank


# -- the example, as the README shows it ------------------------------------------------------
class AverageAfterBackward(Strategy):
    """Naive data parallelism: rank 0's weights everywhere, each gradient averaged after backward."""

    def _wrap(self, net, optim_cls, optim_kwargs):
        for t in [*net.parameters(), *net.buffers()]:
            comm.broadcast(t.data, src=0)
        return net, optim_cls(net.parameters(), **optim_kwargs)

    def no_sync(self):  # gradients accumulate locally; optimizer_step averages their sum
        return contextlib.nullcontext()

    def optimizer_step(self, max_norm, scaler):
        for p in self.net.parameters():
            p.grad.div_(self.ctx.world_size)
            comm.all_reduce(p.grad)
        return super().optimizer_step(max_norm, scaler)


register(StrategySpec("naive_example", "minidist", AverageAfterBackward, "all_reduce each gradient after backward",
                      reference="native_ddp", collectives=(Collective("all_reduce"),)))
# ----------------------------------------------------------------------------------------------

EXAMPLE = {"name": "naive_example", "module": __name__}  # the module every rank imports to find it


def with_example(cfg: dict) -> dict:
    return {**cfg, "strategy": dict(EXAMPLE)}


def test_example_strategy_trains_checkpoints_resumes_and_consolidates(ranks, tmp_path):
    from minidist.train.checkpoint import consolidate, list_checkpoints

    pool = ranks(2)
    straight = pool.run(train_on_rank, with_example(tiny()), str(tmp_path / "straight"), timeout_s=180)
    first = pool.run(train_on_rank, with_example(tiny("trainer.stop_at=10")), str(tmp_path / "split"), timeout_s=180)
    [ckpt] = list_checkpoints(tmp_path / "split")
    resumed = pool.run(train_on_rank, with_example(tiny()), str(tmp_path / "split"), str(ckpt), timeout_s=180)
    for r in range(2):
        assert_same(straight[r]["full_state"], resumed[r]["full_state"], f"rank {r}")
    assert_same(consolidate(ckpt), first[0]["full_state"])  # the plain state_dict at step 10


# slow (19 s, two ranks started for it): `make test-all` runs it; in `make test`, the example trains above.
@pytest.mark.slow(stand_in="test_example_strategy_trains_checkpoints_resumes_and_consolidates")
def test_example_strategy_takes_part_in_a_comparison(tmp_path):
    from minidist_tools.compare import check_strategies, launch
    from minidist_tools.benchmarking import strategy_options

    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="compare", overrides=[
            "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "data.max_bytes=200000",
            "trainer.micro_batch_size=4", "compare.warmup=1", "compare.steps=3", "launcher.nproc=2",
            "compare.strategies=[naive_example,native_ddp]"])
    check_strategies(cfg)
    OmegaConf.set_struct(cfg, False)
    cfg.compare.options = {"naive_example": EXAMPLE, "native_ddp": strategy_options("native_ddp")}
    assert launch(cfg, tmp_path / "run", "test") == 0
    import json

    rows = json.loads((tmp_path / "run" / "results.json").read_text())["rows"]
    row = rows["naive_example"]
    assert (row["kind"], row["reference"], row["ok"]) == ("minidist", "native_ddp", True)
    assert set(row["theory_bytes_per_step"]) == {"all_reduce"}


def test_a_name_registered_twice_and_an_unknown_module_are_refused():
    with pytest.raises(ValueError, match="already registered"):
        register(StrategySpec("naive_example", "minidist", AverageAfterBackward, "another one"))
    with pytest.raises(ConfigError, match="strategy.module='no_such_module' cannot be imported"):
        from minidist.train.strategies import spec

        spec("not_registered", OmegaConf.create({"name": "not_registered", "module": "no_such_module"}))


def test_the_trainer_doc_shows_this_example():
    """docs/trainer.md's "Adding a strategy" code is this file's example, line for line."""
    readme = (ROOT / "docs" / "trainer.md").read_text()
    shown = readme.split("### Adding a strategy", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    ours = Path(__file__).read_text().split("# -- the example, as the README shows it", 1)[1].split("\n# ---", 1)[0]
    assert [l for l in shown.splitlines() if l.strip()] == [l for l in ours.splitlines()[1:] if l.strip()]


# -- no strategy's name outside the registry -----------------------------------------------------
# Strings that equal a strategy's name but mean something else.
NOT_A_STRATEGY = {("minidist/dist.py", "single")}  # LaunchInfo.launcher: a process started without a launcher


def strategy_names_spelled(path: Path, names: set[str], branching_only: bool = False) -> list[tuple[int, str]]:
    """(line, text) of each string constant in `path` that is a strategy's name, or a prefix of
    one given to startswith/endswith, compared with a slice or completed in an f-string (the
    dispatch the registry replaced); docstrings aside. `branching_only` (recipes/, scripts/, which
    may name the strategies they run): a name only where it is compared (==, !=, in a literal)."""
    tree = ast.parse(path.read_text())
    # Compared: name == "ddp", name in ("ddp", "zero2") (dispatch); not "ddp" in rows (a lookup of
    # what was run, by the name the user chose).
    compared = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for left, op, right in zip([node.left, *node.comparators], node.ops, node.comparators):
                literal = isinstance(right, (ast.Tuple, ast.List, ast.Set))
                sides = (left, right) if isinstance(op, (ast.Eq, ast.NotEq)) else \
                        (right,) if isinstance(op, (ast.In, ast.NotIn)) and literal else ()
                compared |= {id(c) for side in sides for c in ast.walk(side)}
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and node.value in names and (not branching_only or id(node) in compared):
            found.append((node.lineno, node.value))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("startswith", "endswith", "removeprefix"):
            for c in (c for a in node.args for c in ast.walk(a)):
                if isinstance(c, ast.Constant) and isinstance(c.value, str) and len(c.value) >= 3 and \
                        any(n.startswith(c.value) for n in names):
                    found.append((c.lineno, f"startswith({c.value!r})"))
        if isinstance(node, ast.Compare):  # name[:4] == "zero": a prefix compared with a slice
            sides = [node.left, *node.comparators]
            if any(isinstance(x, ast.Subscript) and isinstance(x.slice, ast.Slice) for x in sides):
                for c in sides:
                    if isinstance(c, ast.Constant) and isinstance(c.value, str) and len(c.value) >= 3 and \
                            any(n.startswith(c.value) and n != c.value for n in names):
                        found.append((c.lineno, f"[:{len(c.value)}] == {c.value!r}"))
        if isinstance(node, ast.JoinedStr):  # f"hsdp{k}": a name built from a prefix
            for piece, after in zip(node.values, node.values[1:]):
                if isinstance(piece, ast.Constant) and isinstance(after, ast.FormattedValue):
                    tail = re.split(r"[^A-Za-z0-9_]", piece.value)[-1]
                    if len(tail) >= 3 and any(n.startswith(tail) and n != tail for n in names):
                        found.append((node.lineno, f"f'{tail}{{...}}'"))
    return found


def test_no_module_outside_the_registry_spells_a_strategy_name():
    from minidist.train.strategies import names

    known = set(names())
    package = ROOT / "minidist"
    spelled = {}
    for path in sorted(p for top in ("minidist", "recipes", "scripts") for p in (ROOT / top).rglob("*.py")):
        rel = path.relative_to(ROOT)
        if (package / "train" / "strategies") in path.parents:
            continue
        hits = [h for h in strategy_names_spelled(path, known, branching_only=package not in path.parents)
                if (str(rel), h[1]) not in NOT_A_STRATEGY]
        if hits:
            spelled[str(rel)] = hits
    assert not spelled, f"strategy names outside minidist/train/strategies/ (read them from the spec): {spelled}"


def test_the_scan_finds_a_name_built_or_sliced(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('if name[:4] == "zero":\n    other = f"hsdp{k}"\nok = f"strategy={name}"\n')
    assert sorted(strategy_names_spelled(f, {"zero2", "hsdp2"})) == [(1, "[:4] == 'zero'"), (2, "f'hsdp{...}'")]


def test_the_scan_finds_a_spelled_name(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""zero2 in a docstring is fine."""\nif name.startswith("hsdp") or name == "zero2":\n    pass\n')
    assert sorted(strategy_names_spelled(f, {"zero2", "hsdp2"})) == [(2, "startswith('hsdp')"), (2, "zero2")]


# -- the theory each spec declares ---------------------------------------------------------------
@pytest.mark.parametrize("name, stage_bytes", [("ddp", (16, 0)), ("zero1", (8, 8)), ("zero2", (4, 12)),
                                               ("zero3", (0, 16)), ("native_zero1", (8, 8)), ("native_fsdp", (0, 16)),
                                               ("ds_zero2", (4, 12))])
def test_model_state_is_the_zero_papers(name, stage_bytes):
    from minidist.train.strategies import spec
    from minidist_tools.theory import model_state_bytes

    whole, sharded = stage_bytes  # fp32 + Adam: bytes per parameter kept whole, and sharded over n
    assert model_state_bytes(spec(name), 1000, 4) == whole * 1000 + sharded * 1000 / 4
    assert model_state_bytes(spec(name), 1000, 4, precision="mixed") == pytest.approx(
        {0: 16, 1: 4 + 12 / 4, 2: 2 + 14 / 4, 3: 16 / 4}[spec(name).zero_stage] * 1000)


def test_hybrid_theory_needs_the_shard_size_and_splits_the_traffic():
    from minidist.train.strategies import spec
    from minidist_tools.theory import op_group_sizes, wire_bytes

    assert wire_bytes(spec("hsdp2"), 1000, 4) == {}
    # 2 replicas x 2 shard ranks: ZeRO within the pair, 2 (R-1)/R x 4 psi / S across
    assert wire_bytes(spec("ddp_hierarchical"), 1000, 4, shard=2) == {"reduce_scatter": 2000.0, "all_gather": 2000.0,
                                                                     "all_reduce": 2000.0}
    assert wire_bytes(spec("native_zero1"), 1000, 4) == {"all_reduce": 6000.0, "broadcast": 4000.0}
    # what a trace without groups is priced with: each op's group, from the same declaration
    assert op_group_sizes(spec("native_hsdp"), 8, 4) == {"reduce_scatter": 4, "all_gather": 4, "all_reduce": 2}
    assert op_group_sizes(spec("ddp"), 4, None) == {"all_reduce": 4}
    assert op_group_sizes(spec("hsdp3"), 4, None) == {}


# -- one place for a strategy's defaults ----------------------------------------------------------
def yaml_strategies() -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs" / "strategy").glob("*.yaml"))


def test_every_registered_strategy_has_a_config_and_every_config_a_strategy():
    from minidist.train.strategies import specs

    assert {s.name for s in specs(shipped_only=True)} == set(yaml_strategies())


def test_the_references_are_plugins_their_configs_name_and_one_that_does_not_import_spoils_no_other(
        tmp_path, monkeypatch):
    """The registry loads ours and every module a strategy config names (`module:`): the references
    live in minidist_tools. A config naming a module that does not import leaves every other
    strategy usable; asked for, that strategy's own lookup says why in one line."""
    from minidist.train.strategies import registry, spec, specs

    modules = registry.families()
    assert modules[0] == "minidist.train.strategies.ours"
    assert set(modules[1:]) == {"minidist_tools.native", "minidist_tools.deepspeed"}
    configs = tmp_path / "strategy"
    shutil.copytree(ROOT / "configs" / "strategy", configs)
    (configs / "mine.yaml").write_text("name: mine\nmodule: no_such_package.mine\n")
    monkeypatch.setattr(registry, "CONFIG_DIR", configs)
    monkeypatch.setattr(registry, "_families", ())  # as in a fresh process
    assert {s.name for s in specs(shipped_only=True)} == set(yaml_strategies()) - {"mine"}
    with pytest.raises(ConfigError, match="strategy.module='no_such_package.mine' cannot be imported"):
        spec("mine", OmegaConf.load(configs / "mine.yaml"))
    (configs / "broken.yaml").write_text("name: [unclosed\n")  # nor does a file that is not a config
    with pytest.raises(ConfigError, match="broken.yaml is not a strategy config"):
        registry.families()


@pytest.mark.parametrize("name", yaml_strategies())
def test_each_config_holds_the_options_its_spec_takes_and_code_reads_the_same(name):
    from minidist.train.strategies import check_options, spec
    from minidist_tools.benchmarking import strategy_options

    composed = compose_cfg([f"strategy={name}"]).strategy
    assert composed.name == name
    check_options(composed)  # every key one it takes...
    assert set(composed) - {"name", "module"} == set(spec(name).options)  # ...and every option it takes has its default there
    assert OmegaConf.to_container(strategy_options(name)) == OmegaConf.to_container(composed)


def readme_table_differences() -> dict[str, set[str]]:
    """The shipped strategies the README's table leaves out, and the names it lists that are none."""
    from minidist.train.strategies import specs

    table = (ROOT / "README.md").read_text().split("### Strategies\n\n", 1)[1].split("\n\n", 1)[0]
    listed = {n for row in table.splitlines()[2:] for n in re.findall(r"`(\w+)`", row.split("|")[1])}
    shipped = {s.name for s in specs(shipped_only=True)}
    return {"missing": shipped - listed, "not strategies": listed - shipped}


def test_the_readmes_strategy_table_lists_every_shipped_strategy():
    assert readme_table_differences() == {"missing": set(), "not strategies": set()}


def test_a_strategy_added_to_a_family_reaches_the_cost_model_the_documents_and_the_readme_check(tmp_path):
    """What adding hsdp1 to ours.py (its two lines) does, the rest of minidist unchanged (issue 27,
    part 3: that broke the cost model's plot with an IndexError at the 8th strategy): the cost
    model prices it, its plot and docs/scale.md render with it, and the README check names it as
    missing from the table. A strategy a test registers for itself (naive_example) is in none."""
    import costmodel
    from minidist.train.strategies import registry
    from minidist.train.strategies.ours import ZERO_OPTIONS, OursZero
    from minidist.train.strategies.registry import ZERO12, in_shard_groups
    from test_benchmarks_doc import SCALE, SCALE_DOC, load_script

    assert "naive_example" not in costmodel.strategies()
    before = SCALE_DOC.read_text()  # the rendering without it (test_benchmarks_doc checks that it is)
    register(StrategySpec("hsdp1", "minidist", OursZero, "ShardedDataParallel stage 1 on a mesh", checkpoint="sharded",
                          reference="native_ddp", zero_stage=1, hybrid=True, collectives=in_shard_groups(ZERO12),
                          options=ZERO_OPTIONS[1] + ("shard_size",), flat_optimizer_shards=True))
    try:
        assert costmodel.strategies()[-1] == "hsdp1" and len(costmodel.strategies()) >= 8
        after = load_script(SCALE).render(img=tmp_path)  # its plots with it
        assert (tmp_path / "scale.png").stat().st_size > 0
        assert "hsdp1" in after and "hsdp1" not in before
        assert readme_table_differences()["missing"] == {"hsdp1"}
    finally:
        registry.unregister("hsdp1")
    assert "hsdp1" not in costmodel.strategies()


def test_an_option_a_strategy_does_not_take_is_refused():
    from minidist.train.strategies import check_options

    cfg = OmegaConf.create({"name": "zero3", "bucket_cap_mb": 25, "min_unit_params": 1, "broadcast_buffers": True,
                            "collectives": "auto"})
    with pytest.raises(ConfigError, match=r"strategy.bucket_cap_mb: strategy=zero3 does not take it"):
        check_options(cfg)
