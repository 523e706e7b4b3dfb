"""How many rows a CPU product takes (batch.product_rows): at least MIN_ROWS, and at more than
one torch thread more where this machine's threaded matmuls split a count differently, measured.

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
Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_padding: dict[int, dict[int, int]] = {}  # threads -> {row count: the count it is padded to}


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
    thread's products of MIN_ROWS rows; torch's thread count is restored."""
    gen = torch.Generator().manual_seed(20261205)
    weight = torch.randn(shape, generator=gen).to(dtype)
    largest = max(rows_for(n) for n in range(MIN_ROWS, max_rows + 1))
    x = torch.randn(-(-(largest + 1) // MIN_ROWS) * MIN_ROWS, shape[1], generator=gen).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reference = torch.cat([matmul(x[i:i + MIN_ROWS], weight)
                               for i in range(0, x.shape[0], MIN_ROWS)])
        torch.set_num_threads(threads)
        return [n for n in range(MIN_ROWS, max_rows + 1)
                if not torch.equal(matmul(x[:rows_for(n)], weight)[:n], reference[:n])]
    finally:
        torch.set_num_threads(before)


def log_padding(threads: int) -> None:
    """Measure now (a worker at start) and say what is padded."""
    padding = padding_for(threads)
    if padding:
        log.info("torch threads: products of %s rows are padded (threaded MKL splits them "
                 "differently on this CPU)",
                 ", ".join(f"{n} to {m}" for n, m in padding.items()))
