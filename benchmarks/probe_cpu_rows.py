"""Which row counts give a CPU matmul's rows other bits at more than one thread (batch.py's
product_rows): for each thread count and shape, x weight^T of M rows for every M from 8 to
--max-rows, against the same rows computed 8 at a time on one thread. Prints the counts that
differ; with --padded, each M is first raised to product_rows(M), as the model does.

    python -m benchmarks.probe_cpu_rows [--threads 2,3,4] [--max-rows 256] [--padded]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from lorad.workers.batch import MIN_ROWS, product_rows

SHAPES = ((576, 1536), (1536, 576), (576, 576), (4096, 4096))  # (in, out): SmolLM2's, the 8B's


def differing_counts(weight: torch.Tensor, x: torch.Tensor, threads: int, max_rows: int,
                     padded: bool) -> list[int]:
    torch.set_num_threads(1)
    reference = torch.cat([F.linear(x[i:i + MIN_ROWS], weight)
                           for i in range(0, x.shape[0], MIN_ROWS)])
    torch.set_num_threads(threads)
    bad = []
    for m in range(MIN_ROWS, max_rows + 1):
        rows = product_rows(m) if padded else m
        if not torch.equal(F.linear(x[:rows], weight)[:m], reference[:m]):
            bad.append(m)
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="2,3,4")
    parser.add_argument("--max-rows", type=int, default=256)
    parser.add_argument("--padded", action="store_true",
                        help="raise each count to batch.product_rows first")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    total = -(-(args.max_rows + 4) // MIN_ROWS) * MIN_ROWS
    print(f"torch {torch.__version__}, {args.dtype}, M {MIN_ROWS}..{args.max_rows}"
          f"{', padded by product_rows' if args.padded else ''}")
    for threads in (int(t) for t in args.threads.split(",")):
        for k, n in SHAPES:
            weight = torch.randn(n, k, generator=gen).to(dtype)
            x = torch.randn(total, k, generator=gen).to(dtype)
            bad = differing_counts(weight, x, threads, args.max_rows, args.padded)
            print(f"{threads} threads, in {k} out {n}: {len(bad)} counts differ {bad[:20]}",
                  flush=True)


if __name__ == "__main__":
    main()
