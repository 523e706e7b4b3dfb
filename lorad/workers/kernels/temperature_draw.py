"""One token per row drawn from softmax(logits / temperature), for rows with no top-k and no top-p:
the API's default sampling, in one launch for the whole step.

One program per row walks its vocabulary in blocks of BLOCK, three times: the largest scaled
logit; the total mass, each block's sum of exp(logit / t - max) added in block order; then the
first index whose running mass exceeds u * total (the inverse CDF, as the torch path's
searchsorted over the cumulative sum), the running mass made of the same block sums in the same
order. A row's token depends only on its logits, its temperature and its uniform: never on the
batch, the grid or the GPU's timing (torch's CUDA cumulative sum gives no such promise: it scans
one row and several rows with different kernels). A token with zero probability is never drawn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # vocabulary entries per step of a row's walk: part of a row's arithmetic


@triton.jit
def _temperature_draw_kernel(logits_ptr, stride_row, temperatures_ptr, uniforms_ptr, out_ptr,
                             vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    temperature = tl.load(temperatures_ptr + row)
    lanes = tl.arange(0, BLOCK)
    # 1. The largest logit / temperature.
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        index = start + lanes
        x = tl.load(base + index, mask=index < vocab, other=float("-inf")) / temperature
        top = tl.maximum(top, x)
    peak = tl.max(top, axis=0)
    # 2. The total mass, block sums in block order.
    total = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK):
        index = start + lanes
        x = tl.load(base + index, mask=index < vocab, other=float("-inf")) / temperature
        total += tl.sum(tl.exp(x - peak), axis=0)
    target = tl.load(uniforms_ptr + row) * total
    # 3. The first index whose running mass exceeds the target. Should rounding within a block
    # leave none (u within an ulp of 1), the last token with any mass.
    running = tl.zeros([], tl.float32)
    chosen = tl.full([], -1, tl.int32)
    last = tl.full([], -1, tl.int32)
    for start in range(0, vocab, BLOCK):
        index = start + lanes
        x = tl.load(base + index, mask=index < vocab, other=float("-inf")) / temperature
        mass = tl.exp(x - peak)
        reached = (running + tl.cumsum(mass, axis=0) > target) & (mass > 0)
        first = tl.min(tl.where(reached, index, vocab), axis=0)
        chosen = tl.where((chosen < 0) & (first < vocab), first, chosen)
        last = tl.maximum(last, tl.max(tl.where(mass > 0, index, -1), axis=0))
        running += tl.sum(mass, axis=0)
    chosen = tl.where(chosen < 0, last, chosen)
    tl.store(out_ptr + row, chosen.to(tl.int64))


def temperature_draw(logits: torch.Tensor, temperatures: torch.Tensor,
                     uniforms: torch.Tensor) -> torch.Tensor:
    """logits: [n, vocab] float32, rows contiguous; temperatures, uniforms: [n] float32 (> 0, and
    in [0, 1)) on the same device -> [n] int64 token ids."""
    num_rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    assert temperatures.shape == uniforms.shape == (num_rows,)
    assert temperatures.dtype == uniforms.dtype == torch.float32
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        _temperature_draw_kernel[(num_rows,)](logits, logits.stride(0), temperatures, uniforms,
                                              out, vocab, BLOCK=BLOCK, num_warps=4)
    return out
