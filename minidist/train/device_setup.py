"""Per-run device settings and host-to-device copies for the trainer (they matter on CUDA only).

- fp32 precision: `trainer.tf32` chooses TF32 (faster on Ampere and later, a 10-bit mantissa) or
  full IEEE fp32 for matmuls and cuDNN convolutions, through torch's fp32_precision API (mixing it
  with the legacy allow_tf32 flags is an error in torch). The default, false, keeps fp32 runs
  exact, as PyTorch's own default for matmuls does.
- the allocator's peak is reset when a run starts, so a second run in one process (a test, a
  sweep) reports its own peak, not the largest so far.
- batches are copied from pinned host memory: `non_blocking=True` from pageable memory is a
  synchronous copy in disguise.
"""

from __future__ import annotations

import torch


def set_fp32_precision(tf32: bool) -> None:
    """fp32 matmuls and convolutions in TF32 (tf32=True) or in full fp32 ("ieee")."""
    mode = "tf32" if tf32 else "ieee"
    torch.backends.cuda.matmul.fp32_precision = mode
    torch.backends.cudnn.conv.fp32_precision = mode


def configure_device(device: torch.device, tf32: bool) -> None:
    """What a run sets on its device before it starts (nothing on CPU)."""
    if device.type != "cuda":
        return
    set_fp32_precision(tf32)
    torch.cuda.reset_peak_memory_stats(device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; to CUDA through pinned memory, so the copy is asynchronous."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
