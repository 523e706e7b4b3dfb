#!/usr/bin/env python3
"""Which row counts give a row of a base projection other bits: x W^T at the 8B shapes (bf16,
random), rows 0..7 of an M-row product against the same rows computed in a product of 8 rows,
for cuBLAS (F.linear) and, up to its rows, the decode GEMV with the model's tile. Prints, per
shape and path, the row counts whose rows differ and in how many elements.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import conditions
from lorad.workers.kernels import decode_gemv
from lorad.workers.tuning import Tuning

CUDA = torch.device("cuda", 0)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
ROWS = (1, 2, 3, 8, 9, 16, 17, 31, 32, 33, 48, 64, 65, 96, 128, 129, 192, 256, 384, 512, 777,
        1024, 2048, 4096)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    print(conditions(CUDA))
    gen = torch.Generator(device=CUDA).manual_seed(0)
    tiles = Tuning().gemv
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device=CUDA, generator=gen) * k**-0.5).to(torch.bfloat16)
        x = torch.randn(max(ROWS), k, device=CUDA, generator=gen).to(torch.bfloat16)
        ref = F.linear(x[:8], w)
        differ = []
        for m in ROWS:
            got = F.linear(x[:m], w)[:8]
            rows = min(m, 8)
            bad = int((got[:rows] != ref[:rows]).sum())
            if bad:
                differ.append(f"{m}:{bad}")
        print(f"{name} cuBLAS, rows differing from M=8 (M:elements): {' '.join(differ) or 'none'}")
        tile = tiles.config(name, torch.bfloat16) if name in ("qkv", "gate_up") else None
        if tile is not None:
            differ = []
            for m in (1, 2, 3, 8, 9, 16):
                got = decode_gemv.decode_matmul(x[:m], w, None, tile)
                rows = min(m, 8)
                bad = int((got[:rows] != ref[:rows]).sum())
                differ.append(f"{m}:{bad}")
            print(f"{name} GEMV vs cuBLAS M=8 (M:elements): {' '.join(differ)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
