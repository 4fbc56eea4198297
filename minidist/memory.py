"""Measure memory from live tensors' storages, counting a shared storage once.

    report = measure({"parameters": params, "gradients": grads, "comm_buffers": buckets})

A storage is charged to the first category (in dict order) that references it:
with gradient_as_bucket_view the gradients *are* the buckets, and the report
shows that as zero extra bytes of communication buffers.
"""

from __future__ import annotations

import gc
import warnings
from typing import Iterable

import torch


def _storages(tensors: Iterable[torch.Tensor]):
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            yield (t.device, s.data_ptr()), s.nbytes()


def measure(categories: dict[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Bytes per category plus "total"; each distinct storage is counted once overall."""
    seen: set = set()
    report: dict[str, int] = {}
    for name, tensors in categories.items():
        total = 0
        for key, nbytes in _storages(tensors):
            if key not in seen and nbytes > 0:
                seen.add(key)
                total += nbytes
        report[name] = total
    report["total"] = sum(report.values())
    return report


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor in an optimizer's state (exp_avg, momentum_buffer, step, ...)."""
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def live_tensor_bytes(device_type: str = "cpu", collect: bool = True) -> int:
    """Bytes of every live tensor storage on `device_type` ("cpu", "cuda": pass the device the
    model lives on) in this process, found through the garbage collector.

    Independent of any bookkeeping of ours: what a strategy's memory_report claims can be
    checked against it. Slow (a scan of all Python objects): for tests and benchmarks only.
    collect=False skips the full garbage collection first (tensors die by reference
    counting anyway; only cycles would be missed) for frequent sampling.
    """
    if collect:
        gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated torch aliases warns
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type == device_type:
                    s = obj.untyped_storage()
                    if s.data_ptr() not in seen and s.nbytes() > 0:
                        seen.add(s.data_ptr())
                        total += s.nbytes()
            except Exception:  # noqa: BLE001 - tensors without storage (meta, sparse, ...)
                continue
    return total
