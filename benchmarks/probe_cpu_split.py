"""What cpu_threads.linear's column blocks buy and keep on this CPU: the products of one decode
step of SmolLM2-135M (30 layers of the fused qkv, o, gate_up and down projections, random fp32
weights) timed at each row count as F.linear on one thread, F.linear on --threads (MKL splits
the rows) and cpu_threads.linear on --threads (a one-thread product per column block); then the
block widths whose products give other bits than the whole weight's on one thread.

    python -m benchmarks.probe_cpu_split [--threads 2] [--rows 8,16,32,128,512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import conditions
from lorad.workers import cpu_threads

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of one layer
NUM_LAYERS = 30


def step_ms(matmul, weights: list[torch.Tensor], rows: dict[int, torch.Tensor],
            threads: int, repeats: int) -> float:
    """Median ms of every weight's product at `threads` torch threads."""
    torch.set_num_threads(threads)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for weight in weights:
            matmul(rows[weight.shape[1]], weight)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def differing_widths(threads: int, widths: range, in_features: int = 576) -> list[int]:
    """Block widths whose column_blocks product at `threads` threads differs from one thread's
    F.linear of the whole weight, at any row count from 8 to 63 (cpu_threads.differing_counts)."""
    return [width for width in widths if cpu_threads.differing_counts(
        threads, lambda num_rows: num_rows,
        lambda x, w: cpu_threads.column_blocks(x, w, threads),
        shape=(threads * width, in_features), max_rows=63)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="8,16,32,128,512")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(shape, generator=gen) for _ in range(NUM_LAYERS)
               for shape in LAYER_SHAPES]
    print(conditions("cpu"))
    print(f"one step's products of SmolLM2-135M ({NUM_LAYERS} layers, fp32), median of "
          f"{args.repeats}; T = {args.threads} threads; split keeps one thread's bits here: "
          f"{cpu_threads.split_keeps_bits(args.threads)}\n")
    print("| rows | F.linear, 1 thread (ms) | F.linear, T | column blocks, T | blocks / 1 thread |")
    print("|---|---|---|---|---|")
    for num_rows in (int(r) for r in args.rows.split(",")):
        rows = {k: torch.randn(num_rows, k, generator=gen) for k in (576, 1536)}
        one = step_ms(F.linear, weights, rows, 1, args.repeats)
        mkl = step_ms(F.linear, weights, rows, args.threads, args.repeats)
        split = step_ms(cpu_threads.linear, weights, rows, args.threads, args.repeats)
        print(f"| {num_rows} | {one:.1f} | {mkl:.1f} | {split:.1f} | {one / split:.2f}x |",
              flush=True)
    bad = differing_widths(args.threads, range(1, 41))
    print(f"\nblock widths 1..40 whose bits differ from one thread's: {bad} "
          f"(cpu_threads.MIN_BLOCK_WIDTH = {cpu_threads.MIN_BLOCK_WIDTH})")


if __name__ == "__main__":
    main()
