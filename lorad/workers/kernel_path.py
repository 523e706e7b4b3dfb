"""Whether a step runs lorad's Triton kernels (the CUDA path) or plain torch ops (the CPU path):
the one place the model, attention and LoRA layers ask.

The kernel path needs triton (the `gpu` extra) and a CUDA device, or, for tests only, the
LORAD_TEST_KERNELS_ON_CPU=1 hook with TRITON_INTERPRET=1: the same kernels on CPU tensors, so CI
checks the model's GPU path end to end without a GPU (tests/kernels/model_kernel_checks.py).
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
KERNELS_ON_CPU_ENV = "LORAD_TEST_KERNELS_ON_CPU"  # read at each call, set only by tests


def kernel_path(device: torch.device) -> bool:
    if not HAVE_TRITON:
        return False
    return device.type == "cuda" or os.environ.get(KERNELS_ON_CPU_ENV) == "1"
