"""The trainer's per-run device settings (minidist/train/state.py), checked without a GPU:
the fp32-precision flags are process settings torch keeps on any machine."""

import torch

from minidist.train.state import configure_device, set_fp32_precision, to_device


def test_tf32_is_chosen_through_torchs_fp32_precision_api():
    before = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    try:
        set_fp32_precision(True)
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("tf32", "tf32")
        set_fp32_precision(False)
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("ieee", "ieee")
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before


def test_on_cpu_nothing_is_set_and_copies_are_plain():
    before = torch.backends.cuda.matmul.fp32_precision
    configure_device(torch.device("cpu"), tf32=True)
    assert torch.backends.cuda.matmul.fp32_precision == before
    x = torch.arange(4)
    assert to_device(x, torch.device("cpu")) is x
