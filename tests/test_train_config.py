"""Every config error stops before any work with one line naming the key and the fix."""

import pytest
import torch

from minidist.train.config_check import validate
from minidist.train.config import ConfigError
from minidist.train.app import local_nproc
from train_cases import CONFIGS, compose_cfg, tiny_overrides

CASES = [
    # (overrides, world size, a pattern the message must contain)
    (["strategy.name=zero9"], 2, r"strategy='zero9' is unknown"),
    (["trainer.global_batch_size=30"], 2, r"trainer.global_batch_size=30 .* multiple of .* = 8"),
    (["data=text_file", "data.path=/no/such/corpus"], 2, r"data.path='/no/such/corpus' does not exist"),
    (["data=fake_images", "model=mlp", "data.train_size=6"], 2, r"6 training samples.*trainer.micro_batch_size"),
    (["trainer.precision=fp16", "strategy=ds_zero2"], 2,
     r"trainer.precision=fp16 with strategy=ds_zero2: .* use trainer.precision=bf16"),
    (["trainer.precision=fp32x"], 2, r"trainer.precision='fp32x'"),
    (["optim._target_=subprocess.Popen"], 2, r"optim._target_='subprocess.Popen' was not imported: only torch's "
                                              r"classes are.* optim.module=subprocess"),
    (["optim._target_=torch.nn.Linear"], 2, r"optim._target_='torch.nn.Linear' is not a subclass of torch.optim.optimizer.Optimizer"),
    (["optim._target_=torch.optim.NoSuch"], 2, r"optim._target_='torch.optim.NoSuch' cannot be imported"),
    # ZeRO steps flat slices across parameters: only element-wise optimizers are exact there
    (["optim._target_=torch.optim.Adafactor", "strategy=zero2", "~optim.weight_decay"], 2,
     r"optim._target_=torch.optim.Adafactor with strategy=zero2: ShardedDataParallel cannot shard Adafactor"),
    # Muon takes weight matrices only: its recipe with AdamW is optim=muon, which torch's and DeepSpeed's
    # sharding cannot take (one optimizer class over partitions of their own)
    (["optim._target_=torch.optim.Muon", "strategy=zero2"], 2,
     r"optim._target_=torch.optim.Muon: it steps weight matrices only.*use optim=muon"),
    (["optim=muon", "strategy=native_fsdp"], 2, r"optim=muon with strategy=native_fsdp: .*muon runs under single, ddp, .*zero2"),
    (["data._target_=subprocess.Popen"], 2, r"data._target_='subprocess.Popen' was not imported: only minidist's "
                                            r"classes are"),
    (["data._target_=subprocess.Popen", "data.module=subprocess"], 2, r"data._target_='subprocess.Popen' is not a "
                                                                     r"subclass of minidist.train.data.DataSource"),
    (["data.val_fraction=0"], 2, r"leaves 0 validation samples .* trainer.eval_batches=0 to train without"),
    (["data.val_fraction=-0.1"], 2, r"data.val_fraction=-0.1 must be a fraction in \[0, 1\)"),
    # keys nothing reads, values left unset, optimizer arguments torch refuses: before any work
    (["+trainer.foo=1"], 2, r"trainer.foo is not a setting minidist reads .* check its spelling"),
    (["+launcher.nprocs=4"], 2, r"launcher.nprocs is not a setting minidist reads"),
    (["data=text_file"], 2, r"data.path is required and has no value: give it, e.g. data.path=..."),
    (["optim.lr=-1"], 2, r"optim \(AdamW\): Invalid learning rate: -1; fix the optim.\* setting it names"),
    (["+optim.nosuch=1"], 2, r"optim \(AdamW\): .*unexpected keyword argument 'nosuch'"),
    (["launcher.stop_grace_s=0"], 2, r"launcher.stop_grace_s=0 must be a positive number of seconds"),
    (["trainer.stop_at=50"], 2, r"trainer.stop_at=50 must be .* trainer.max_steps=20"),
    (["trainer.micro_batch_size=0"], 2, r"trainer.micro_batch_size=0 must be an integer >= 1"),
    (["model=resnet18"], 2, r"model=resnet18 cannot train on data=stdlib_text"),
    (["data=cifar10", "model=resnet18", "data.root=/no/such/root"], 2, r"data.root='/no/such/root' has no cifar10"),
    (["trainer.resume=/no/such/ckpt"], 2, r"trainer.resume='/no/such/ckpt' is not a folder"),
    (["strategy=hsdp3", "strategy.shard_size=3"], 4, r"strategy.shard_size=3: .* does not split into shard groups of 3"),
    (["strategy=ddp_hierarchical", "strategy.shard_size=two"], 4, r"strategy.shard_size='two' must be a whole"),
    # One strategy, one pattern of collectives: ddp's all_reduce is flat, the two-level one has its own spec.
    (["strategy.comm_hook=hierarchical"], 4, r"strategy.comm_hook='hierarchical': strategy=ddp takes allreduce \| "
                                             r"fp16 \| bf16 \| powersgd; comm_hook=hierarchical is "
                                             r"strategy=ddp_hierarchical"),
    (["strategy=zero2", "strategy.collectives=gloo"], 2, r"strategy.collectives='gloo': strategy=zero2 takes auto \| "
                                                          r"backend \| ring \| shm"),
    (["strategy=native_ddp", "strategy.overlap=false"], 2, r"strategy.overlap=False: strategy=native_ddp takes "
                                                           r"True; overlap=False is strategy=ddp"),
]


@pytest.mark.parametrize("overrides,world,pattern", CASES, ids=[c[2][:30] for c in CASES])
def test_config_errors(overrides, world, pattern, tmp_path):
    cfg = compose_cfg(tiny_overrides(*overrides))
    with pytest.raises(ConfigError, match=pattern):
        validate(cfg, world, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_target_outside_the_trusted_packages_is_not_imported(tmp_path, monkeypatch):
    """Importing runs a module's code: a _target_ from a package the config does not name in
    `module` is refused from its name alone (issue 26, item 8)."""
    (tmp_path / "evilmod.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\nclass X: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="'evilmod.X' was not imported: .* data.module=evilmod"):
        validate(compose_cfg(tiny_overrides("data._target_=evilmod.X")), 2, tmp_path / "run")
    assert not (tmp_path / "imported").exists()


def test_no_validation_when_asked(tmp_path):
    assert validate(compose_cfg(tiny_overrides("data.val_fraction=0", "trainer.eval_batches=0")), 2, tmp_path) is None


def test_single_needs_one_rank(tmp_path):
    with pytest.raises(ConfigError, match="strategy=single runs on one rank.*launcher.nproc=1"):
        validate(compose_cfg(tiny_overrides(strategy="single")), 2, tmp_path)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3", "native_fsdp"])
def test_fp16_accepted_on_cpu_for_every_non_deepspeed_strategy(tmp_path, strategy):
    assert validate(compose_cfg(tiny_overrides("trainer.precision=fp16", strategy=strategy)), 2, tmp_path) is None


def test_nproc_must_be_positive():
    with pytest.raises(ConfigError, match="launcher.nproc=0"):
        local_nproc(compose_cfg(["launcher.nproc=0"]).launcher)
    assert local_nproc(compose_cfg(["launcher.backend=gloo"]).launcher) == 2  # auto on CPU: cpu_nproc


def test_the_good_default_passes(tmp_path):
    assert validate(compose_cfg([]), 2, tmp_path) is None


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml")))
def test_experiment_presets_compose(experiment, tmp_path):
    first = (CONFIGS / "experiment" / f"{experiment}.yaml").read_text().splitlines()
    assert first[0].startswith("# ") and any("python recipes/train.py" in line for line in first[:4])
    cfg = compose_cfg([f"experiment={experiment}"])
    if cfg.data.name not in ("cifar10", "mnist"):  # those need their files
        validate(cfg, 2, tmp_path)


def test_peak_tflops_auto_comes_from_the_device(monkeypatch):
    """MFU's denominator: a CPU core's rough figure, a known GPU's data-sheet peak in the run's
    precision, none for an unknown GPU (MFU is then left out); a number is taken as given."""
    import torch

    from minidist.train.state import CPU_TFLOPS, peak_tflops
    assert peak_tflops("auto", torch.device("cpu"), "fp32") == CPU_TFLOPS
    assert peak_tflops(12.5, torch.device("cpu"), "bf16") == 12.5
    for name, precision, expected in (("NVIDIA H100 80GB HBM3", "bf16", 989.0), ("NVIDIA H200", "fp32", 67.0),
                                      ("NVIDIA A100-SXM4-80GB", "fp16", 312.0), ("NVIDIA A10G", "bf16", 70.0),
                                      ("NVIDIA L4", "bf16", 121.0), ("Some Future GPU", "bf16", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert peak_tflops("auto", torch.device("cuda", 0), precision) == expected, name


def test_peak_tflops_must_be_auto_or_a_positive_number(tmp_path):
    from minidist.train.config_check import validate
    from minidist.train.config import ConfigError
    from train_cases import compose_cfg, tiny_overrides
    with pytest.raises(ConfigError, match="trainer.peak_tflops='fast' must be auto"):
        validate(compose_cfg(tiny_overrides("trainer.peak_tflops=fast")), 2, tmp_path / "run")


def test_the_optimizer_is_the_groups_target_with_its_arguments():
    from omegaconf import OmegaConf

    from minidist.train.optim import optimizer_spec

    adamw = OmegaConf.load(CONFIGS / "optim" / "adamw.yaml")
    adamw_args = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    # fused: auto takes the fused kernels on CPU and CUDA, where the class has them; false never does
    assert optimizer_spec(adamw) == (torch.optim.AdamW, {**adamw_args, "fused": True})
    assert optimizer_spec(OmegaConf.merge(adamw, {"fused": False})) == (torch.optim.AdamW, adamw_args)
    sgd = OmegaConf.load(CONFIGS / "optim" / "sgd.yaml")
    assert optimizer_spec(sgd, torch.device("cuda")) == (
        torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4, "fused": True})
    rmsprop = OmegaConf.create({"_target_": "torch.optim.RMSprop", "lr": 0.01, "fused": "auto"})
    assert optimizer_spec(rmsprop) == (torch.optim.RMSprop, {"lr": 0.01})  # no fused kernels: no `fused`
