"""The device a rank trains on: its settings (TF32, pinned copies, peak reset) and its peak FLOP/s for MFU.

Per-run device settings and host-to-device copies for the trainer (they matter on CUDA only).

- fp32 precision: `trainer.tf32` chooses TF32 (faster on Ampere and later, a 10-bit mantissa) or
  full IEEE fp32 for matmuls and cuDNN convolutions, through torch's fp32_precision API (mixing it
  with the legacy allow_tf32 flags is an error in torch). The default, false, keeps fp32 runs
  exact, as PyTorch's own default for matmuls does.
- the allocator's peak is reset when a run starts, so a second run in one process (a test, a
  sweep) reports its own peak, not the largest so far.
- batches are copied from pinned host memory: `non_blocking=True` from pageable memory is a
  synchronous copy in disguise.

The peak a rank's device could compute, for MFU: trainer.peak_tflops=auto looks it up.

MFU = model FLOPs per second / peak. The peak depends on the device and on the precision the
matrix multiplies run in: dense (no sparsity) vendor figures, TFLOP/s per GPU, for bf16/fp16
tensor cores and for plain fp32 (minidist does not switch TF32 on). A GPU not in the table
gets no MFU, with a line saying to set trainer.peak_tflops; on CPU the figure is a rough one
for one core in fp32.
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


# name fragment (as torch.cuda.get_device_name reports it): (bf16/fp16, fp32) dense TFLOP/s.
# Longer names first where one contains another (A100 before A10, L40S before L4).
KNOWN_GPUS = {
    "H200": (989.0, 67.0), "H100 PCIe": (756.0, 51.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5),
    "L40S": (362.0, 91.6), "L40": (181.0, 90.5), "L4": (121.0, 30.3), "A10G": (70.0, 31.2), "A10": (125.0, 31.2),
    "V100": (125.0, 15.7), "RTX 4090": (165.0, 82.6),
}
CPU_TFLOPS = 0.2  # one CPU core in fp32, roughly


def peak_tflops(setting, device: torch.device, precision: str) -> float | None:
    """trainer.peak_tflops resolved: a number as given; auto from the device (None: unknown GPU)."""
    if str(setting) != "auto":
        return float(setting)
    if device.type != "cuda":
        return CPU_TFLOPS
    name = torch.cuda.get_device_name(device)
    for fragment, (half, fp32) in KNOWN_GPUS.items():
        if fragment in name:
            return half if precision in ("bf16", "fp16") else fp32
    return None
