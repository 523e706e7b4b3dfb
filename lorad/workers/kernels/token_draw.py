"""The sampler's two sums on the GPU, made repeatable: one token per row drawn from
softmax(logits / temperature), and a row's cumulative sum (top-p's cutoff).

torch's CUDA cumulative sum gives neither promise we need: it scans a one-row tensor with a
device-wide scan whose float sums changed between two calls on the same row (seen on the H200),
and several rows with a kernel whose layout depends on the row count. Here a row is cut into
fixed chunks of CHUNK entries; each chunk's sums are a fixed tree over its entries, and chunks
combine in chunk order. So a row's result depends only on the row (and its temperature and
uniform): never on the batch, the grid or the GPU's timing.

The draw is an inverse CDF in two levels, two launches for the whole step:
1. per (row, chunk): the chunk's largest scaled logit m_c and its mass, sum(exp(x / t - m_c));
2. per row: the chunks' masses rescaled to the row's largest logit, the first chunk whose running
   mass exceeds u * total, then inside it the first entry whose running mass (the chunk's own
   cumulative sum) exceeds what is left of the target. Should rounding leave none, the last entry
   with mass. A token of zero probability (a -inf logit) is never drawn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorad.workers.kernels.launch_math import cdiv, next_power_of_2

CHUNK = 4096  # vocabulary entries per chunk: part of a row's arithmetic (interpreter checks: less)


@triton.jit
def _chunk_stats_kernel(logits_ptr, stride_row, temperatures_ptr, peaks_ptr, masses_ptr, vocab,
                        num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    index = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + index, mask=index < vocab,
                other=float("-inf")) / tl.load(temperatures_ptr + row)
    peak = tl.max(x, axis=0)
    mass = tl.sum(tl.exp(x - peak), axis=0)  # NaN when the whole chunk is -inf: ignored below
    out = row * num_chunks + chunk
    tl.store(peaks_ptr + out, peak)
    tl.store(masses_ptr + out, tl.where(peak == float("-inf"), 0.0, mass))


@triton.jit
def _pick_kernel(logits_ptr, stride_row, temperatures_ptr, uniforms_ptr, peaks_ptr, masses_ptr,
                 out_ptr, vocab, num_chunks, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS)
    valid = chunks < num_chunks
    peaks = tl.load(peaks_ptr + row * num_chunks + chunks, mask=valid, other=float("-inf"))
    masses = tl.load(masses_ptr + row * num_chunks + chunks, mask=valid, other=0.0)
    peak = tl.max(peaks, axis=0)
    weights = tl.where(masses > 0, masses * tl.exp(peaks - peak), 0.0)  # [CHUNKS], row's scale
    running = tl.cumsum(weights, axis=0)
    target = tl.load(uniforms_ptr + row) * tl.sum(weights, axis=0)
    first = tl.min(tl.where((running > target) & (weights > 0), chunks, CHUNKS), axis=0)
    last = tl.max(tl.where(weights > 0, chunks, 0), axis=0)
    chunk = tl.where(first < CHUNKS, first, last)
    # What the chunk must still cover, in its own scale (exp(x / t - m_c)).
    before = tl.sum(tl.where(chunks == chunk - 1, running, 0.0), axis=0)
    own_peak = tl.max(tl.where(chunks == chunk, peaks, float("-inf")), axis=0)
    left = (target - before) / tl.exp(own_peak - peak)
    index = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + index, mask=index < vocab,
                other=float("-inf")) / tl.load(temperatures_ptr + row)
    mass = tl.exp(x - own_peak)
    inside = tl.min(tl.where((tl.cumsum(mass, axis=0) > left) & (mass > 0), index, vocab), axis=0)
    last_inside = tl.max(tl.where(mass > 0, index, 0), axis=0)
    tl.store(out_ptr + row, tl.where(inside < vocab, inside, last_inside).to(tl.int64))


def _warps(chunk: int) -> int:
    """Warps for a program over one chunk: one per 512 entries, 1 to 8."""
    return max(1, min(8, chunk // 512))


def draw_tokens(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor,
                chunk: int = CHUNK) -> torch.Tensor:
    """logits: [n, vocab] float32, rows contiguous (-inf for removed tokens, at least one finite
    per row); temperatures, uniforms: [n] float32 (> 0, and in [0, 1)) on the same device ->
    [n] int64 token ids."""
    num_rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    assert temperatures.shape == uniforms.shape == (num_rows,)
    assert temperatures.dtype == uniforms.dtype == torch.float32
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if not num_rows:
        return out
    num_chunks = cdiv(vocab, chunk)
    peaks = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    masses = torch.empty_like(peaks)
    warps = _warps(chunk)
    _chunk_stats_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), temperatures, peaks, masses, vocab, num_chunks, CHUNK=chunk,
        num_warps=warps)
    _pick_kernel[(num_rows,)](
        logits, logits.stride(0), temperatures, uniforms, peaks, masses, out, vocab, num_chunks,
        CHUNK=chunk, CHUNKS=next_power_of_2(num_chunks), num_warps=warps)
    return out


@triton.jit
def _cumulative_sum_kernel(x_ptr, out_ptr, length, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    lanes = tl.arange(0, CHUNK)
    base = row.to(tl.int64) * length
    carry = tl.zeros([], tl.float32)
    for earlier in range(0, chunk):  # the chunks before this one, each one sum, in order
        index = earlier * CHUNK + lanes
        carry += tl.sum(tl.load(x_ptr + base + index, mask=index < length, other=0.0), axis=0)
    index = chunk * CHUNK + lanes
    x = tl.load(x_ptr + base + index, mask=index < length, other=0.0)
    tl.store(out_ptr + base + index, carry + tl.cumsum(x, axis=0), mask=index < length)


def cumulative_sum(x: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """x: [n, length] float32, contiguous -> [n, length] its running sums along each row."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()
    out = torch.empty_like(x)
    if x.numel():
        _cumulative_sum_kernel[(x.shape[0], cdiv(x.shape[1], chunk))](
            x, out, x.shape[1], CHUNK=chunk, num_warps=_warps(chunk))
    return out
