"""init_distributed's view of torchrun, SLURM and plain-python environments."""


import pytest
import torch
import torch.distributed as dist

import minidist
from minidist.dist import choose_backend, detect_launch, first_slurm_host


def test_torchrun_environment():
    env = dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", GROUP_RANK="1",
               MASTER_ADDR="10.1.2.3", MASTER_PORT="29400")
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size,
            info.node_rank, info.master_addr, info.master_port) == (
        "torchrun", 5, 8, 1, 4, 1, "10.1.2.3", 29400)


def test_slurm_environment():
    env = dict(SLURM_PROCID="6", SLURM_NTASKS="8", SLURM_LOCALID="2", SLURM_NODEID="1",
               SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[07-08]", SLURM_JOB_ID="123456")
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size,
            info.node_rank, info.master_addr) == ("slurm", 6, 8, 2, 4, 1, "gpu07")
    assert info.master_port == 15000 + 123456 % 20000
    # every task of the job derives the same address and port
    assert detect_launch({**env, "SLURM_PROCID": "0", "SLURM_NODEID": "0"}).master_port == info.master_port


def test_torchrun_wins_over_slurm():
    # torchrun started inside a SLURM allocation: torchrun's ranks are the real ones
    env = dict(RANK="1", WORLD_SIZE="2", SLURM_PROCID="0", SLURM_NTASKS="1")
    assert detect_launch(env).launcher == "torchrun"


def test_no_environment_is_a_single_process():
    info = detect_launch({})
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.node_rank) == ("single", 0, 1, 0, 0)


@pytest.mark.parametrize("nodelist,first", [
    ("node01", "node01"), ("gpu[03-05,9],cpu1", "gpu03"), ("a[1,4]", "a1"), ("x-y-[010-012]", "x-y-010"),
    ("n1,n2", "n1"),
])
def test_slurm_node_list(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_bad_integer_names_the_variable():
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        detect_launch(dict(RANK="0", WORLD_SIZE="two"))


def test_backend_auto_picks_gloo_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_backend("auto", 1) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert choose_backend("auto", 2) == "nccl"
    assert choose_backend("auto", 4, env={}) == "gloo"  # not one device per local rank
    assert choose_backend("gloo", 2) == "gloo"


def test_a_gpu_bound_per_slurm_task_is_used_and_ranks_never_share_one(monkeypatch):
    """srun --gpus-per-task=1: each task sees one GPU (device 0) though 4 run on the node."""
    from minidist.dist import cuda_device_for
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    bound = {"SLURM_LOCALID": "3", "SLURM_STEP_GPUS": "3"}
    assert choose_backend("auto", 4, env=bound) == "nccl"
    assert cuda_device_for(3, 4, env=bound) == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="4 ranks on this machine but 1 visible GPU.*--nproc_per_node"):
        cuda_device_for(3, 4, env={})  # four ranks would share the one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert cuda_device_for(5, 8, env={}) == torch.device("cuda", 5)  # every GPU visible: one each
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        cuda_device_for(0, 1, env={})


def test_single_process_init_is_idempotent_and_shuts_down(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    ctx = minidist.init_distributed(backend="gloo")
    try:
        assert (ctx.rank, ctx.world_size, ctx.device.type, ctx.backend) == (0, 1, "cpu", "gloo")
        assert minidist.init_distributed() is ctx
        with pytest.raises(Exception):
            ctx.rank = 3  # immutable
        t = torch.ones(2)
        dist.all_reduce(t)
        assert torch.equal(t, torch.ones(2))
    finally:
        minidist.shutdown()
    assert not dist.is_initialized()


def rank_view():
    ctx = minidist.init_distributed()
    return ctx.rank, ctx.world_size, ctx.local_rank, ctx.node_rank, ctx.backend, minidist.is_main()


def test_context_under_a_launcher(ranks):
    assert ranks(3).run(rank_view) == [(r, 3, r, 0, "gloo", r == 0) for r in range(3)]


def log_and_print():
    import contextlib
    import io
    import uuid
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        minidist.print0("print0 line")
        minidist.get_logger(f"minidist.test.{uuid.uuid4().hex}").info("logger line")
    return buf.getvalue()


def test_print0_and_logger_speak_on_rank_zero_only(ranks):
    out0, out1 = ranks(2).run(log_and_print)
    assert "print0 line" in out0 and "logger line" in out0
    assert out1 == ""


def test_one_rank_zero_rule_before_the_process_group():
    from minidist.dist import launch_rank

    assert launch_rank({"RANK": "3", "WORLD_SIZE": "4"}) == 3                   # torchrun
    assert launch_rank({"SLURM_PROCID": "2", "SLURM_NTASKS": "4"}) == 2         # srun, no torchrun
    assert launch_rank({}) == 0                                                 # a lone process
