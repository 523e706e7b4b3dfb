"""The CPU's products at any torch thread count with one thread's bits: `linear`, and how many
rows a product takes (batch.product_rows): at least MIN_ROWS, and at more than one torch thread
more where this machine's threaded matmuls split a count differently, measured.

`linear` at T > 1 threads computes x W^T of a few rows as T column blocks of W in one torch.bmm,
a one-thread product per block side by side, each reading only its block of W: SmolLM2's step
products at 8 rows and 2 threads 1.77x one thread's speed, against 1.31x with MKL's own threads
(benchmarks/probe_cpu_split.py); and a column's sums are one thread's whatever the rows. Each
process checks that on first use, every count from MIN_ROWS to CHECK_MAX_ROWS against one
thread's products; where a block split would give other bits (another torch or BLAS), it keeps
F.linear with the padding below.

MKL's threaded sgemm gives a product of some row counts other bits than one thread does: it
splits the rows between threads, and a part of 1 to 3 rows takes another kernel (torch 2.13, MKL
2024.2, AVX-512: exactly 9, 10 and 11 rows at 2, 6 and 8 threads, none at 3 and 4, none from 12
to 1,024 rows; bf16 none: benchmarks/probe_cpu_rows.py). Another CPU or library may split at
other counts, so each process measures it for its thread count, once, before its first padded
product: every count from MIN_ROWS to CHECK_MAX_ROWS at those threads against the same rows
MIN_ROWS at a time on one thread; a count that differs is padded to the next count that does
not. About 20 ms at 2 threads on this project's CPU; a worker does it at start and logs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger("lorad.worker")

# MKL (torch 2.13) gives a product of fewer rows other bits: every CPU product has at least these.
MIN_ROWS = 8
CHECK_MAX_ROWS = 64
CHECK_WIDTH = 512  # in and out features: the counts measured did not depend on the shape
# linear's column blocks have at least this many columns: MKL computes a block of 2, 3 or 5 to 11
# columns with other sums than the whole weight's (torch 2.13; 1, 4 and 12 on agree).
MIN_BLOCK_WIDTH = 16
# From this many rows on MKL's own threads are faster (SmolLM2's step at 2 threads: 192 rows
# 252 vs 255 ms, 512 rows 519 vs 621; 128 rows 176 vs 144), and at those counts they keep one
# thread's bits too (none from 12 to 1,024 rows differ here, probe_cpu_rows.py).
SPLIT_MAX_ROWS = 192
Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_padding: dict[int, dict[int, int]] = {}  # threads -> {row count: the count it is padded to}
_split_keeps_bits: dict[int, bool] = {}  # threads -> whether column_blocks has one thread's bits


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for the CPU path (any device: CUDA tensors go to F.linear): at more
    than one torch thread, for fewer than SPLIT_MAX_ROWS fp32 rows of 2 dimensions and a weight
    whose out features split into one block a thread of MIN_BLOCK_WIDTH columns or more,
    column_blocks, when this process measured that it keeps one thread's bits."""
    threads = torch.get_num_threads()
    if (threads > 1 and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] < SPLIT_MAX_ROWS
            and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.shape[0] % threads == 0
            and weight.shape[0] >= threads * MIN_BLOCK_WIDTH and weight.is_contiguous()
            and split_keeps_bits(threads)):
        return column_blocks(x, weight, threads)
    return F.linear(x, weight)


def column_blocks(x: torch.Tensor, weight: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """x weight^T as num_blocks blocks of weight's rows (the output's columns), one product each
    in one torch.bmm; weight contiguous, its rows a multiple of num_blocks."""
    out_features = weight.shape[0]
    blocks = weight.view(num_blocks, out_features // num_blocks, weight.shape[1])
    out = torch.bmm(x.expand(num_blocks, *x.shape), blocks.transpose(1, 2))
    return out.transpose(0, 1).reshape(x.shape[0], out_features)


def split_keeps_bits(threads: int) -> bool:
    """Whether column_blocks at `threads` threads gives every count from MIN_ROWS to
    CHECK_MAX_ROWS one thread's bits (measured on first use in this process)."""
    if threads not in _split_keeps_bits:
        _split_keeps_bits[threads] = not any(
            differing_counts(threads, lambda num_rows: num_rows,
                             lambda x, w: column_blocks(x, w, threads),
                             shape=(threads * width, CHECK_WIDTH))
            for width in (MIN_BLOCK_WIDTH, -(-CHECK_WIDTH // threads)))
    return _split_keeps_bits[threads]


def padding_for(threads: int) -> dict[int, int]:
    """{row count: padded row count} for products at `threads` torch threads (empty at one),
    measured on first use in this process."""
    if threads <= 1:
        return {}
    if threads not in _padding:
        _padding[threads] = measure_padding(threads)
    return _padding[threads]


def measure_padding(threads: int, matmul: Matmul = F.linear) -> dict[int, int]:
    """Each count from MIN_ROWS to CHECK_MAX_ROWS whose products differ at `threads` threads,
    mapped to the next count that does not (matmul: tests pass a stand-in)."""
    bad = set(differing_counts(threads, lambda num_rows: num_rows, matmul))
    padding = {}
    for num_rows in sorted(bad):
        padded = num_rows + 1
        while padded in bad:
            padded += 1
        padding[num_rows] = padded
    return padding


def differing_counts(threads: int, rows_for: Callable[[int], int], matmul: Matmul = F.linear,
                     shape: tuple[int, int] = (CHECK_WIDTH, CHECK_WIDTH),
                     max_rows: int = CHECK_MAX_ROWS,
                     dtype: torch.dtype = torch.float32) -> list[int]:
    """The counts (MIN_ROWS..max_rows) whose products of rows_for(count) rows by a random
    [out, in] = `shape` weight of `dtype` at `threads` threads give a row other bits than one
    thread's F.linear of MIN_ROWS rows; torch's thread count is restored."""
    gen = torch.Generator().manual_seed(20261205)
    weight = torch.randn(shape, generator=gen).to(dtype)
    largest = max(rows_for(n) for n in range(MIN_ROWS, max_rows + 1))
    x = torch.randn(-(-(largest + 1) // MIN_ROWS) * MIN_ROWS, shape[1], generator=gen).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reference = torch.cat([F.linear(x[i:i + MIN_ROWS], weight)
                               for i in range(0, x.shape[0], MIN_ROWS)])
        torch.set_num_threads(threads)
        return [n for n in range(MIN_ROWS, max_rows + 1)
                if not torch.equal(matmul(x[:rows_for(n)], weight)[:n], reference[:n])]
    finally:
        torch.set_num_threads(before)


def log_padding(threads: int) -> None:
    """Measure now (a worker at start) and say how products are split and what is padded."""
    if threads > 1:
        log.info("torch threads: %d; fp32 products %s", threads,
                 "in column blocks, a thread each (one thread's bits)" if split_keeps_bits(threads)
                 else "by MKL's threads: column blocks would change their bits on this CPU")
    padding = padding_for(threads)
    if padding:
        log.info("torch threads: products of %s rows are padded (threaded MKL splits them "
                 "differently on this CPU)",
                 ", ".join(f"{n} to {m}" for n, m in padding.items()))
