"""DeepSpeed's ZeRO (stages 1-3) behind the trainer's Strategy interface, and its checkpoint layout:
a third party to compare with, optional (`pip install -e '.[deepspeed]'`), imported only when a
ds_* strategy wraps a model. A plugin of the strategy registry: configs/strategy/ds_zero*.yaml
name this module (`module: minidist_tools.deepspeed`).

    python recipes/train.py strategy=ds_zero3

What the thin adapter does, and why: docs/internals.md, "minidist_tools/deepspeed.py".
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from pathlib import Path

import torch

from minidist.measure import measure
from minidist.train.checkpoint_layouts import MODEL, Full, register_layout
from minidist.train.checkpoint_safety import DEEPSPEED_DIR, save_tensors, verify_checkpoint_files
from minidist.train.config import ConfigError
from minidist.train.strategies.base import Strategy
from minidist.train.strategies.registry import StrategySpec, ZERO12, ZERO3, register

INSTALL_HINT = "pip install -e '.[deepspeed]' (or pip install deepspeed)"


def import_deepspeed(device_type: str):
    """Import DeepSpeed for `device_type` ("cpu" or "cuda"), without its inference-only C++ op."""
    # DeepSpeed picks its accelerator once, from this variable, at first use.
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device_type == "cpu" else "cuda")
    try:
        import deepspeed
        import deepspeed.comm.torch  # noqa: F401  (the module that would build the op)
    except ImportError as e:
        raise ConfigError(f"the ds_* strategies need DeepSpeed, which is not installed ({e}): {INSTALL_HINT}") from e
    # `deepspeed.comm.torch` as an attribute is the torch package itself (that module imports
    # torch under the same name), so patch the module through sys.modules.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


def deepspeed_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:
        return None


class DeepSpeedZero(Strategy):
    """DeepSpeed ZeRO stage 1, 2 or 3 (`ds_zero1/2/3`)."""

    def __init__(self, cfg, ctx, compute_dtype=None):
        super().__init__(cfg, ctx)  # compute_dtype: unused, bf16 runs under the trainer's autocast
        self.engine = None
        self._accumulating = False

    @property
    def stage(self) -> int:
        return self.spec.zero_stage

    def config(self) -> dict:
        bucket = int(float(self.cfg.bucket_cap_mb) * 2**20 / 4)  # DeepSpeed counts elements (fp32 here)
        zero = {"stage": self.stage, "reduce_bucket_size": bucket}
        if self.stage < 3:
            zero["allgather_bucket_size"] = bucket
        return {
            # Nominal: the trainer feeds the batches; DeepSpeed only checks the product.
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True,  # our client AdamW / SGD, not DeepSpeed's fused ones
            "zero_optimization": zero,
            "gradient_clipping": 0.0,  # set per step by optimizer_step
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }

    def _wrap(self, net, optim_cls, optim_kwargs):
        deepspeed = import_deepspeed(self.ctx.device.type)
        client = optim_cls(net.parameters(), **optim_kwargs)
        self.engine, _, _, _ = deepspeed.initialize(model=net, optimizer=client, config=self.config())
        # The client optimizer is the one whose param_groups carry the lr: schedulers drive it.
        return self.engine, client

    @contextlib.contextmanager
    def no_sync(self):
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def backward(self, loss):
        self.engine.set_gradient_accumulation_boundary(not self._accumulating)
        self.engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self, max_norm, scaler):
        if scaler.is_enabled():
            raise ConfigError(f"strategy={self.name} runs fp32 or bf16 here; fp16 loss scaling is DeepSpeed's own "
                              "(its fp16 config), which this adapter does not wire: use trainer.precision=bf16")
        self.engine.optimizer.clip_grad = 0.0 if math.isinf(max_norm) else float(max_norm)
        self.engine.step()  # clips, steps the client optimizer, zeroes the gradients
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(0.0 if norm is None else norm, dtype=torch.float32)

    def clip_grad_norm_(self, max_norm):
        raise NotImplementedError("DeepSpeed clips inside engine.step(): call optimizer_step")

    def _gathered(self):
        """All parameters whole on every rank while inside (stage 3); nothing to do otherwise."""
        if self.stage < 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.net.parameters()), modifier_rank=None)

    def full_state_dict(self):
        with self._gathered():  # a collective at stage 3
            state = {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()} \
                if self.ctx.rank == 0 else {}
        return state

    def optimizer_state_dict(self):
        raise NotImplementedError("DeepSpeed's optimizer state is partitioned: see DeepSpeedLayout")

    def load_full_state_dict(self, state):
        raise NotImplementedError("DeepSpeed checkpoints are its own: see DeepSpeedLayout")

    def memory_report(self):
        """Live storages by category: the parameters this rank holds (stage 3: its partition),
        DeepSpeed's gradient partitions and buffers, and the optimizer: the client's state plus
        the fp32 master partitions DeepSpeed keeps beside the parameters."""
        opt = self.engine.optimizer
        params = [getattr(p, "ds_tensor", p) for p in self.net.parameters()]
        masters = list(getattr(opt, "single_partition_of_fp32_groups", []) or
                       getattr(opt, "fp32_partitioned_groups_flat", []))
        grads = [m.grad for m in masters if m.grad is not None]
        averaged = getattr(opt, "averaged_gradients", {}) or {}
        grads += [g for gs in averaged.values() for g in (gs or []) if torch.is_tensor(g)]
        grads += [p.grad for p in self.net.parameters() if p.grad is not None]
        state = [t for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return measure({"parameters": params, "gradients": grads, "optimizer_state": state + masters})


class DeepSpeedLayout:
    """DeepSpeed's engine writes and reads its own folder; our model.pt beside it consolidates."""

    name = "deepspeed"

    collect = None  # DeepSpeed's engine writes its own files (and communicates while it does): save only
    writer = "DeepSpeed's engine"

    def save(self, strategy, directory: Path) -> None:
        model = strategy.full_state_dict()  # a collective at stage 3
        if strategy.ctx.rank == 0:
            save_tensors(model, directory / MODEL)
        strategy.engine.save_checkpoint(str(directory / DEEPSPEED_DIR), tag="state", save_latest=False)

    def load(self, strategy, directory: Path, meta: dict) -> None:
        # DeepSpeed's loader unpickles without restriction: first prove every file holds only
        # tensors, containers and DeepSpeed's three plain classes (checkpoint_safety.py).
        verify_checkpoint_files(directory)
        path, _ = strategy.engine.load_checkpoint(str(directory / DEEPSPEED_DIR), tag="state",
                                                  load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"{directory / DEEPSPEED_DIR}: no DeepSpeed checkpoint there")

    shapes = Full.shapes
    consolidate = Full.consolidate

    def portable(self, ckpt: Path, meta: dict, names: list[str]) -> tuple[dict, dict]:
        raise ConfigError(f"{ckpt} is DeepSpeed's own checkpoint (its optimizer state partitioned its way): it "
                          f"resumes only as strategy={meta['strategy']} at {meta['world_size']} ranks; to start another "
                          "strategy from its weights, consolidate it (minidist checkpoint consolidate)")

    def describe(self, meta: dict) -> str:
        return f"DeepSpeed's own ({DEEPSPEED_DIR}/) and a full state_dict ({MODEL})"


register_layout(DeepSpeedLayout())


# -- the specs (registry.py says how they are read). DeepSpeed calls torch.distributed itself
# (traces_comm=False); its fp16 loss scaling is its own config, which this adapter does not wire.
# Its ZeRO partitions flat buffers as ours does, so its optimizer steps slices across parameters.
for _stage in (1, 2, 3):
    register(StrategySpec(f"ds_zero{_stage}", "deepspeed", DeepSpeedZero, f"DeepSpeed's ZeRO stage {_stage} "
                          "(optional: pip install -e '.[deepspeed]')", checkpoint="deepspeed", zero_stage=_stage,
                          messages="units" if _stage == 3 else "buckets",
                          collectives=ZERO3 if _stage == 3 else ZERO12,
                          options=("bucket_cap_mb",), fp16=False, traces_comm=False, flat_optimizer_shards=True,
                          several_optimizers=False))
