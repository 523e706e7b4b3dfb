"""A test kernel for lora_shrink.exact_dot: one [16, 16] x [16, 16] product, with the number of
bf16 terms each side is split into chosen by the caller. Imported by the checks once the
interpreter is set (lora_kernel_checks.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from lorad.workers.kernels.lora_common import exact_dot


@triton.jit
def exact_dot_kernel(a_ptr, b_ptr, out_ptr, A_PARTS: tl.constexpr, B_PARTS: tl.constexpr):
    i = tl.arange(0, 16)
    a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
    b = tl.load(b_ptr + i[:, None] * 16 + i[None, :])
    acc = exact_dot(a, b, tl.zeros([16, 16], dtype=tl.float32), A_PARTS, B_PARTS)
    tl.store(out_ptr + i[:, None] * 16 + i[None, :], acc)
