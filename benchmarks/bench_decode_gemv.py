#!/usr/bin/env python3
"""Decode GEMV micro-benchmark: decode_matmul against cuBLAS (F.linear) at Llama-3-8B's projection
shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336; bf16), batches 1, 4, 16
and 32, over a sweep of tile configs, with the bandwidth achieved against the weight bytes.

    python -m benchmarks.bench_decode_gemv [--batches 1,4,16,32] [--tp 1] [--budget-s 40]

Each time is one launch of a CUDA graph of back-to-back launches, as a decode step runs them,
so launch overhead stays out; the launches cycle over copies of the weight that hold well past
L2 between repeats, so the weight streams from HBM as each layer's does. Every config's result
is checked against a float64 reference first (a config that fails is marked, never ranked).
Prints the conditions, the copy bandwidth for scale, and markdown tables: cuBLAS, the default
config and the best one per shape and batch; the config with the least time over the four
shapes per batch. The sweep stops at --budget-s (compiling each config takes most of it).
(The GEMV's LoRA epilogue and this script's --lora timing of it left together; git history
holds both.)
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import conditions, copy_bandwidth, time_graph
from lorad.workers.kernels.decode_gemv import MAX_ROWS, GemvConfig, decode_matmul

# name -> (N, K, split by tensor parallelism along N (column-parallel) or K (row-parallel))
SHAPES = {"qkv": (6144, 4096, "N"), "o": (4096, 4096, "K"), "gate_up": (28672, 4096, "N"),
          "down": (4096, 14336, "K")}
DTYPE = torch.bfloat16
L2_FLUSH_BYTES = 256 << 20  # weight bytes read between two reads of one copy: well past L2
LAUNCHES = 24  # per graph replay
REPLAYS = 8  # timed replays: LAUNCHES * REPLAYS = 192 launches per time
DEFAULT_CONFIG = GemvConfig()  # the kernel's own default tile
PDL_ROWS = 32  # with PDL up to 32 rows, as these timings always had
# Most plausible first, so a budget cut drops the long shots: w tiles of 8 to 32 KiB per stage.
SWEEP = [DEFAULT_CONFIG] + sorted(
    {GemvConfig(block_n=n, block_k=k, num_warps=w, num_stages=s)
     for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4))}
    - {DEFAULT_CONFIG},
    key=lambda c: (not 4096 <= c.block_n * c.block_k <= 16384, c.num_warps, -c.num_stages,
                   c.block_n, c.block_k))


def time_per_launch(launch, num_copies: int) -> float:
    """Seconds per launch(i) (i: the weight copy), replayed from a graph of LAUNCHES launches."""
    def launches() -> None:
        for i in range(LAUNCHES):
            launch(i % num_copies)
    return time_graph(launches, REPLAYS) / LAUNCHES


class Problem:
    """One shape: copies of a random weight, a batch of x, and the float64 reference."""

    def __init__(self, name: str, n: int, k: int, device: str = "cuda"):
        self.name, self.n, self.k = name, n, k
        self.bytes = n * k * DTYPE.itemsize
        num_copies = 1 + -(-L2_FLUSH_BYTES // self.bytes)
        self.weights = [torch.randn(n, k, device=device, dtype=DTYPE) / k ** 0.5
                        for _ in range(num_copies)]  # [N, K] each
        self.x = torch.randn(MAX_ROWS, k, device=device, dtype=DTYPE)
        x64, w64 = self.x.double(), self.weights[0].double()
        self.want = x64 @ w64.T
        # The fp32 sum's error bound (twice the worst case) plus a bf16 rounding.
        self.bound = k * torch.finfo(torch.float32).eps * (x64.abs() @ w64.abs().T) \
            + torch.finfo(DTYPE).eps * self.want.abs()

    def correct(self, config: GemvConfig) -> bool:
        got = decode_matmul(self.x, self.weights[0], config=config, pdl_rows=PDL_ROWS).double()
        return bool(((got - self.want).abs() <= self.bound).all())

    def time_kernel(self, num_rows: int, config: GemvConfig) -> float:
        x = self.x[:num_rows]
        return time_per_launch(
            lambda i: decode_matmul(x, self.weights[i], config=config, pdl_rows=PDL_ROWS),
            len(self.weights))

    def time_cublas(self, num_rows: int) -> float:
        x = self.x[:num_rows]
        return time_per_launch(lambda i: F.linear(x, self.weights[i]), len(self.weights))


def sweep(problems: list[Problem], batches: list[int], budget_s: float):
    """-> ({(shape, M, config): seconds, or None where the config is wrong}, configs skipped)."""
    times: dict[tuple[str, int, GemvConfig], float | None] = {}
    started = time.monotonic()
    for index, config in enumerate(SWEEP):
        if time.monotonic() - started > budget_s:
            return times, SWEEP[index:]
        try:
            for problem in problems:
                ok = problem.correct(config)  # compiles: outside any graph capture
                for num_rows in batches:
                    times[problem.name, num_rows, config] = \
                        problem.time_kernel(num_rows, config) if ok else None
        except Exception as exc:  # out of shared memory, or a tile triton does not compile
            print(f"# {name(config)} did not run: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        # Progress, in case the run is cut short: us over the shapes per batch.
        totals = [sum(times[p.name, m, config] or float("nan") for p in problems) * 1e6
                  for m in batches]
        print(f"# {name(config)}: " + ", ".join(f"M={m} {t:.1f} us" for m, t in
                                                zip(batches, totals)), file=sys.stderr)
    return times, []


def name(config: GemvConfig) -> str:
    return f"n{config.block_n} k{config.block_k} w{config.num_warps} s{config.num_stages}"


def print_tables(problems, batches, times, cublas) -> None:
    def gbs(problem, seconds):
        return f"{problem.bytes / seconds / 1e9:.0f}"

    print("\n| shape | N x K | M | cuBLAS us | cuBLAS GB/s | default us | default GB/s "
          "| best config | best us | best GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for problem in problems:
        for num_rows in batches:
            ran = {c: s for (p, m, c), s in times.items()
                   if p == problem.name and m == num_rows and s is not None}
            base = cublas[problem.name, num_rows]
            default = ran.get(DEFAULT_CONFIG)
            best = min(ran, key=ran.get) if ran else None
            default_cells = (f"{default * 1e6:.1f} | {gbs(problem, default)}" if default
                             else "failed | -")
            best_cells = (f"{name(best)} | {ran[best] * 1e6:.1f} | {gbs(problem, ran[best])}"
                          if best else "- | - | -")
            print(f"| {problem.name} | {problem.n} x {problem.k} | {num_rows} | "
                  f"{base * 1e6:.1f} | {gbs(problem, base)} | {default_cells} | {best_cells} |")
    print("\n| M | config with the least time over the shapes | its us | default us | cuBLAS us |")
    print("|---|---|---|---|---|")
    for num_rows in batches:
        totals = {}
        for config in {c for (_, _, c) in times}:
            each = [times.get((p.name, num_rows, config)) for p in problems]
            if all(s is not None for s in each):
                totals[config] = sum(each)
        base = sum(cublas[p.name, num_rows] for p in problems)
        best = min(totals, key=totals.get) if totals else None
        default = totals.get(DEFAULT_CONFIG)
        print(f"| {num_rows} | {name(best) if best else '-'} | "
              f"{totals[best] * 1e6 if best else float('nan'):.1f} | "
              f"{default * 1e6 if default else float('nan'):.1f} | {base * 1e6:.1f} |")


def main() -> int:
    def ints(text: str) -> list[int]:
        return [int(part) for part in text.split(",")]

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=ints, default=None,
                        help="rows per launch (default 1,4,16,32)")
    parser.add_argument("--tp", type=int, default=1,
                        help="time one rank's shard: N split for qkv/gate_up, K for o/down")
    parser.add_argument("--budget-s", type=float, default=40.0,
                        help="stop sweeping configs after this many seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode_gemv: needs a CUDA GPU", file=sys.stderr)
        return 2
    args.batches = args.batches or [1, 4, 16, 32]
    if max(args.batches) > MAX_ROWS:
        parser.error(f"--batches: at most {MAX_ROWS} rows")
    torch.manual_seed(0)
    problems = [Problem(shape, n // args.tp if split == "N" else n,
                        k // args.tp if split == "K" else k)
                for shape, (n, k, split) in SHAPES.items()]
    print(f"# decode GEMV vs cuBLAS, {conditions('cuda')}, bf16, tp {args.tp}")
    print(f"# device copy {copy_bandwidth() / 1e9:.0f} GB/s (read + write); GB/s below: weight "
          f"bytes / time per launch, from a CUDA graph of {LAUNCHES} launches over weight copies "
          f"{L2_FLUSH_BYTES >> 20} MiB apart; default config {name(DEFAULT_CONFIG)} (block_n, "
          f"block_k, warps, stages)")
    cublas = {(p.name, m): p.time_cublas(m) for p in problems for m in args.batches}
    started = time.monotonic()
    times, skipped = sweep(problems, args.batches, args.budget_s)
    wrong = sorted({name(c) for (_, _, c), s in times.items() if s is None})
    print(f"# swept {len({c for (_, _, c) in times})} configs in "
          f"{time.monotonic() - started:.0f} s; wrong results: {', '.join(wrong) or 'none'}; "
          f"cut by the budget: {', '.join(name(c) for c in skipped) or 'none'}")
    print_tables(problems, args.batches, times, cublas)
    return 0


if __name__ == "__main__":
    sys.exit(main())
