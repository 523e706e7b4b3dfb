#!/usr/bin/env python3
"""Can one matmul arithmetic serve every step size on the GPU? The question behind invariant
prefill (issue 29): a prompt token's row goes through steps of any row count, and cuBLAS gives a
row other bits as the count changes (probe_matmul_rows.py). row_matmul.py sweeps K in order with
no split, for any tile; this measures, at the 8B projection shapes (bf16 in, fp32 out: the
unrounded sums, the strictest comparison):

1. bits: rows 0..7 of an M-row product, for each tile below and for cuBLAS, against the same
   rows from the decode GEMV (decode_gemv.py, 16 rows a tile: the decode steps' arithmetic for
   q/k/v and gate/up). A tile of 64 rows or more compiles to Hopper's wgmma, 16 rows to mma.sync:
   "0" everywhere for a tile means both instructions give the same bits, and the prefill can take
   a large tile while decode keeps the GEMV;
2. speed: each tile's time against cuBLAS (F.linear to fp32) at M from 1 to 4,096.

    python -m benchmarks.probe_row_matmul [--shapes qkv,o,gate_up,down] [--rows 1,16,...]
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import conditions, time_cuda
from lorad.workers.kernels import decode_gemv
from lorad.workers.kernels.configs import GemvConfig, MatmulConfig
from lorad.workers.kernels.row_matmul import row_matmul

CUDA = torch.device("cuda", 0)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
BITS_ROWS = (8, 9, 17, 33, 64, 65, 129, 256, 512, 1000, 2048, 4096)
SPEED_ROWS = (1, 8, 16, 64, 128, 256, 512, 1024, 2048, 4096)
GEMV = GemvConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4)
TILES = {
    "m16": MatmulConfig(block_m=16, block_n=64, block_k=256, group_m=8, num_warps=4,
                        num_stages=4),
    "m64n64": MatmulConfig(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4,
                           num_stages=4),
    "m64": MatmulConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4,
                        num_stages=4),
    "m128": MatmulConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8,
                         num_stages=4),
    "m128n256": MatmulConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8,
                             num_stages=3),
    "m128k128": MatmulConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8,
                             num_stages=3),
}


def per_call(fn, calls: int = 20) -> float:
    """Median seconds of one call, from runs of `calls` calls back to back."""
    return time_cuda(lambda: [fn() for _ in range(calls)], 5) / calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tiles", default=",".join(TILES))
    p.add_argument("--rows", default=",".join(map(str, SPEED_ROWS)), help="speed rows")
    args = p.parse_args()
    tiles = {name: TILES[name] for name in args.tiles.split(",")}
    speed_rows = [int(m) for m in args.rows.split(",")]
    print(conditions(CUDA))
    gen = torch.Generator(device=CUDA).manual_seed(0)
    bits_lines, speed_lines = [], []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device=CUDA, generator=gen) * k ** -0.5).to(torch.bfloat16)
        x = torch.randn(max(BITS_ROWS + tuple(speed_rows)), k, device=CUDA,
                        generator=gen).to(torch.bfloat16)
        ref = decode_gemv.decode_matmul(x[:8], w, torch.float32, GEMV)
        paths = {"cuBLAS": lambda m: torch.mm(x[:m], w.t(), out_dtype=torch.float32)}
        paths.update({tile: (lambda m, c=config: row_matmul(x[:m], w, torch.float32, c))
                      for tile, config in tiles.items()})
        for path, fn in paths.items():
            differ = [f"{m}:{int((fn(m)[:8] != ref).sum())}" for m in BITS_ROWS]
            bits_lines.append(f"| {name} | {path} | {' '.join(differ)} |")
        for m in speed_rows:
            flops = 2 * m * n * k
            times = {path: per_call(lambda fn=fn: fn(m)) for path, fn in paths.items()}
            if m <= GEMV.block_m:
                times["GEMV"] = per_call(
                    lambda: decode_gemv.decode_matmul(x[:m], w, torch.float32, GEMV))
            base = times["cuBLAS"]
            cells = " ".join(f"{path} {t * 1e6:,.1f} ({base / t:.2f}x)"
                             for path, t in times.items())
            speed_lines.append(f"| {name} | {m} | {flops / base / 1e12:,.0f} | {cells} |")
        print(f"{name}: done", flush=True)
    print("\nElements of rows 0..7 that differ from the decode GEMV's (M:count), fp32 out\n")
    print("| shape | path | M:differing |\n|---|---|---|")
    print("\n".join(bits_lines))
    print("\nMicroseconds per call (cuBLAS's time / the path's: above 1 is faster than cuBLAS)\n")
    print("| shape | M | cuBLAS TFLOP/s | paths |\n|---|---|---|---|")
    print("\n".join(speed_lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
