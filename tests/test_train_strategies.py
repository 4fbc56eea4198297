"""The trainer with every strategy, on the rank pool: exact resume, consolidation, equal results.

Exact resume: 4 steps straight equal 2 steps (trainer.stop_at=2) and then 2 more from the
checkpoint — model, optimizer, RNG states, data position, bitwise (fp32 on CPU). (Any state a
resume did not restore shows in the first step after it.)
"""

import pytest
import torch

from minidist.train.checkpoint import consolidate, list_checkpoints, read_meta
from minidist.train.models import build_model
from minidist.train.data import data_info
from minidist.train.strategies import names
from omegaconf import OmegaConf
from train_cases import CONFIGS, assert_same, load_everything, mesh_options, tiny, train_on_rank, world_for


# The native and DeepSpeed strategies' resume runs in `make test-all`; `make test` keeps ours, but
# ddp_hierarchical, whose checkpoint is ddp's (test_hierarchical_all_reduce_in_the_trainer_trains_like_ddp
# runs it in the trainer), zero1, whose flat shards are zero2's, and hsdp2, whose mesh is hsdp3's.
SLOW_RESUME = {"ddp_hierarchical", "zero1", "hsdp2", "diloco_streaming"}  # and diloco_streaming, whose layout is diloco's
SLOW_RESUME_MARK = pytest.mark.slow(stand_in="test_resume_is_exact_and_consolidates[ddp]")


@pytest.mark.parametrize("strategy", [pytest.param(s, marks=SLOW_RESUME_MARK)
                                      if s.startswith(("native_", "ds_")) or s in SLOW_RESUME else s
                                      for s in names() if (CONFIGS / "strategy" / f"{s}.yaml").is_file()])
def test_resume_is_exact_and_consolidates(strategy, ranks, tmp_path):
    """4 steps straight = 2 + 2 resumed, bitwise. Dropout is on: its masks come from each
    rank's random stream, so only a resume that restores that stream stays exact."""
    # DiLoCo with each rank a worker (2 workers, no mesh): its workers layout is the same; its
    # workers of several ranks resume in test_diloco.py.
    world, mesh = (2, ()) if strategy.startswith("diloco") else (world_for(strategy), mesh_options(strategy))
    pool = ranks(world)
    common = (*mesh, "model.dropout=0.1", "trainer.max_steps=4", "trainer.log_every=2")
    cfg = tiny(*common, strategy=strategy)
    straight = pool.run(train_on_rank, cfg, str(tmp_path / "straight"), timeout_s=180)
    first = pool.run(train_on_rank, tiny("trainer.stop_at=2", *common, strategy=strategy), str(tmp_path / "split"),
                     timeout_s=180)
    ckpts = list_checkpoints(tmp_path / "split")
    assert [c.name for c in ckpts] == ["step_00000002"]
    assert first[0]["step"] == 2
    second = pool.run(train_on_rank, cfg, str(tmp_path / "split"), str(ckpts[0]), timeout_s=180)
    assert second[0]["step"] == 4

    a, b = (list_checkpoints(tmp_path / d)[-1] for d in ("straight", "split"))
    assert a.name == b.name == "step_00000004"
    assert_same(load_everything(a), load_everything(b), strategy)  # model, optimizer, every rank's own state
    assert_same(read_meta(a)["data"], read_meta(b)["data"])
    assert straight[0]["train/loss"] == second[0]["train/loss"]

    # Consolidated: a plain state_dict for the bare model, equal to what the strategy holds.
    full = consolidate(b)
    bare = build_model(OmegaConf.create(cfg["model"]), data_info(OmegaConf.create(cfg["data"])))
    bare.load_state_dict(full)  # strict: same keys, same shapes
    assert list(full) == list(bare.state_dict())
    assert_same(full, {k: v.cpu() for k, v in second[0]["full_state"].items()})


@pytest.mark.slow(stand_in="test_resume_is_exact_and_consolidates[hsdp3]")
@pytest.mark.parametrize("strategy", ["hsdp2", "hsdp3"])
def test_hybrid_checkpoint_is_written_once_per_shard_group_and_resumes_at_another_mesh(strategy, ranks, tmp_path):
    """At 4 ranks as 2x2 only the first replica writes its 2 shards; the run resumes from them as
    1x4 and 4x1 (shards re-cut) and ends as the 2x2 run does (within rounding: other sums)."""
    pool = ranks(4)
    straight = pool.run(train_on_rank, tiny("strategy.shard_size=2", strategy=strategy), str(tmp_path / "straight"),
                        timeout_s=180)
    pool.run(train_on_rank, tiny("trainer.stop_at=10", "strategy.shard_size=2", strategy=strategy),
             str(tmp_path / "split"), timeout_s=180)
    ckpt = list_checkpoints(tmp_path / "split")[0]
    assert sorted(f.name for f in ckpt.glob("shard_rank*.pt")) == ["shard_rank00000.pt", "shard_rank00001.pt"]
    assert read_meta(ckpt)["shards"] == 2
    for shard_size in (4, 1):
        run = tmp_path / f"resumed_as_{4 // shard_size}x{shard_size}"
        out = pool.run(train_on_rank, tiny(f"strategy.shard_size={shard_size}", strategy=strategy), str(run),
                       str(ckpt), timeout_s=180)
        assert out[0]["step"] == 20
        for key, ref in straight[0]["full_state"].items():
            diff = (out[0]["full_state"][key] - ref).abs().max().item()
            assert diff <= 1e-5 * max(1.0, ref.abs().max().item()), f"{shard_size}: {key} differs by {diff}"


def test_hierarchical_all_reduce_in_the_trainer_trains_like_ddp(ranks, tmp_path):
    """strategy=ddp_hierarchical on a 2x2 mesh: the same model as plain ddp, within rounding."""
    finals = {}
    for name, strategy, extra in (("flat", "ddp", ()), ("hierarchical", "ddp_hierarchical", ("strategy.shard_size=2",))):
        out = ranks(4).run(train_on_rank, tiny(*extra, strategy=strategy), str(tmp_path / name), timeout_s=180)
        finals[name] = out[0]["full_state"]
    for key, ref in finals["flat"].items():
        diff = (finals["hierarchical"][key] - ref).abs().max().item()
        assert diff <= 1e-5 * max(1.0, ref.abs().max().item()), f"{key}: {diff}"


def test_strategies_train_alike(ranks, tmp_path):
    """ddp, zero2 and native_ddp from the same seed end within 1e-5 of each other after 20 steps."""
    finals = {}
    for strategy in ("ddp", "zero2", "native_ddp"):
        out = ranks(2).run(train_on_rank, tiny(strategy=strategy), str(tmp_path / strategy), timeout_s=180)
        finals[strategy] = out[0]["full_state"]
        if strategy != "native_ddp":  # (whose collectives are not traced) ranks on one host: shared memory
            assert out[0]["comm/shm_share"] > 0.5, out[0]
    for name in ("zero2", "native_ddp"):
        for key, ref in finals["ddp"].items():
            diff = (finals[name][key] - ref).abs().max().item()
            assert diff <= 1e-5 * max(1.0, ref.abs().max().item()), f"{name} {key}: {diff}"


def test_keep_last_and_auto_resume(ranks, tmp_path):
    cfg = tiny("trainer.ckpt_every=4", "trainer.keep_last=2", "trainer.stop_at=12")
    ranks(2).run(train_on_rank, cfg, str(tmp_path), timeout_s=120)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_00000008", "step_00000012"]


def test_classifier_on_images_reports_accuracy(ranks, tmp_path):
    cfg = tiny("model=mlp", "data=fake_images", "data.train_size=64", "data.val_size=16", "trainer.max_steps=4",
               "trainer.eval_every=2", strategy="zero1")
    out = ranks(2).run(train_on_rank, cfg, str(tmp_path), timeout_s=120)
    assert 0.0 <= out[0]["val/accuracy"] <= 1.0 and out[0]["val/loss"] > 0
    assert out[0]["val/accuracy"] == out[1]["val/accuracy"]  # reduced over ranks


def test_bf16_autocast_trains(ranks, tmp_path):
    """bf16 trains close to fp32 but not bitwise like it: ignored autocast would be bitwise fp32."""
    bf16 = ranks(2).run(train_on_rank, tiny("trainer.precision=bf16", "trainer.max_steps=6"), str(tmp_path / "bf16"),
                        timeout_s=120)
    fp32 = ranks(2).run(train_on_rank, tiny("trainer.max_steps=6"), str(tmp_path / "fp32"), timeout_s=120)
    a, b = bf16[0]["train/loss"], fp32[0]["train/loss"]
    assert torch.isfinite(torch.tensor(a)) and a != b and abs(a - b) < 0.05 * abs(b), (a, b)
    assert any(not torch.equal(bf16[0]["full_state"][k], v) for k, v in fp32[0]["full_state"].items())


def stage3_dtypes(cfg_dict: dict, run_dir: str) -> dict:
    """Rank function: what a bf16 run's stage-3 strategy gathers parameters and reduces gradients in."""
    from minidist.train.trainer import Trainer

    trainer = Trainer(OmegaConf.create(cfg_dict), run_dir)
    try:
        model = trainer.model
        if hasattr(model, "param_dtype"):  # ours
            return {"param": model.param_dtype, "reduce": model.reduce_dtype}
        policy = model._get_fsdp_state()._mp_policy  # FSDP2's MixedPrecisionPolicy on the root
        return {"param": policy.param_dtype, "reduce": policy.reduce_dtype}
    finally:
        trainer.close()


@pytest.mark.parametrize("strategy", ["zero3", "native_fsdp"])
def test_bf16_stage3_gathers_bf16_parameters_and_reduces_in_fp32(ranks, tmp_path, strategy):
    """Without param_dtype, autocast's cast cache keeps a bf16 copy of every unit's weights from
    forward to backward: the trainer passes param_dtype (ours) / a MixedPrecisionPolicy (FSDP2)."""
    out = ranks(2).run(stage3_dtypes, tiny("trainer.precision=bf16", strategy=strategy), str(tmp_path))
    assert out[0] == out[1] == {"param": torch.bfloat16, "reduce": torch.float32}


@pytest.mark.parametrize("strategy", [pytest.param(s, marks=pytest.mark.slow(  # resnet18's 11M parameters
    stand_in="test_resume_is_exact_and_consolidates[zero2]")) for s in ("ddp", "zero2", "native_fsdp")])
def test_resume_is_exact_on_every_rank_with_batchnorm(strategy, ranks, tmp_path):
    """torchvision's resnet18 (BatchNorm): after 4 steps straight or 2 + 2 resumed, every rank holds
    the same parameters and the same buffers, including BatchNorm statistics a strategy leaves
    rank-local (fully_shard does not broadcast buffers)."""
    extra = ["model=resnet18", "data=fake_images", "data.image_size=8", "data.train_size=64",
             "trainer.micro_batch_size=2", "trainer.max_steps=4", "trainer.eval_batches=0", "optim=sgd",
             "++strategy.min_unit_params=1000000"]
    pool = ranks(2)
    straight = pool.run(train_on_rank, tiny(*extra, strategy=strategy), str(tmp_path / "a"), timeout_s=180)
    pool.run(train_on_rank, tiny(*extra, "trainer.stop_at=2", strategy=strategy), str(tmp_path / "b"),
             timeout_s=180)
    resumed = pool.run(train_on_rank, tiny(*extra, strategy=strategy), str(tmp_path / "b"),
                       str(list_checkpoints(tmp_path / "b")[-1]), timeout_s=180)
    assert resumed[0]["step"] == 4
    assert_same(straight[0]["full_state"], resumed[0]["full_state"], strategy)
    for rank in range(2):
        assert_same(straight[rank]["buffers"], resumed[rank]["buffers"], f"{strategy} rank {rank}")
    if strategy == "native_fsdp":  # the case the rank files exist for: statistics differ across ranks
        bn = "bn1.running_mean"
        assert not torch.equal(straight[0]["buffers"][bn], straight[1]["buffers"][bn])


def test_trainer_writes_the_timeline_of_a_chosen_step(ranks, tmp_path):
    """trainer.timeline_step=3: that step under the profiler, as a Chrome trace of both ranks and a PNG."""
    import json

    out = ranks(2).run(train_on_rank, tiny("trainer.timeline_step=3", "trainer.max_steps=4", strategy="zero2"),
                       str(tmp_path), timeout_s=120)
    assert out[0]["step"] == 4
    trace = json.loads((tmp_path / "timeline_step_3.json").read_text())["traceEvents"]
    assert {e["pid"] for e in trace} == {0, 1}
    assert {e["name"] for e in trace if e["ph"] == "X"} >= {"forward", "backward", "optimizer", "compute"}
    assert any(e["name"].startswith(("ring:", "gloo:")) for e in trace if e["ph"] == "X")
    assert (tmp_path / "timeline_step_3.png").stat().st_size > 0


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "hsdp2"])
def test_sharded_accumulation_trains_as_local_and_as_fsdp2s_default(strategy, ranks, tmp_path):
    """strategy.accumulate=sharded at trainer.grad_accum=4: every micro-batch's backward reduce_scatters
    into the gradient shard (4x the gradient's bytes of local: its reduce_scatter, and on a mesh its
    all_reduce across the replicas; the same all_gather bytes), and the model ends where local
    accumulation (one reduction of the summed gradient) and FSDP2's own default loop (backward after
    backward, no set_requires_gradient_sync) end, within 1e-6."""
    def run(name, mode):
        cfg = tiny(*mesh_options(name), "trainer.grad_accum=4", "trainer.max_steps=3", f"strategy.accumulate={mode}",
                   strategy=name)
        return ranks(world_for(name)).run(train_on_rank, cfg, str(tmp_path / f"{name}_{mode}"), timeout_s=120)[0]
    local, sharded = run(strategy, "local"), run(strategy, "sharded")
    assert sharded["comm/reduce_scatter_bytes_per_step"] == 4 * local["comm/reduce_scatter_bytes_per_step"]
    if strategy == "hsdp2":  # + the clipping norm's few bytes of all_reduce, once a step in both
        assert sharded["comm/all_reduce_bytes_per_step"] == pytest.approx(4 * local["comm/all_reduce_bytes_per_step"],
                                                                          rel=1e-3)
    assert sharded["comm/all_gather_bytes_per_step"] == local["comm/all_gather_bytes_per_step"]
    finals = {"local": local["full_state"]}
    if strategy == "zero3":
        finals["native_fsdp"] = run("native_fsdp", "sharded")["full_state"]
    for name, final in finals.items():
        for key, ref in final.items():
            diff = (sharded["full_state"][key] - ref).abs().max().item()
            assert diff <= 1e-6 * max(1.0, ref.abs().max().item()), f"{name} {key}: {diff}"
