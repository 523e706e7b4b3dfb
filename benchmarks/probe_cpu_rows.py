"""Which row counts give a CPU matmul's rows other bits at more than one thread (batch.py's
product_rows): for each thread count and shape, x weight^T of M rows for every M from 8 to
--max-rows, against the same rows computed 8 at a time on one thread. Prints the counts that
differ; with --padded, each M is first raised to product_rows(M), as the model does.

    python -m benchmarks.probe_cpu_rows [--threads 2,3,4] [--max-rows 256] [--padded]
"""

from __future__ import annotations

import argparse

import torch

from lorad.workers.batch import MIN_ROWS, product_rows
from lorad.workers.cpu_threads import differing_counts

SHAPES = ((576, 1536), (1536, 576), (576, 576), (4096, 4096))  # (in, out): SmolLM2's, the 8B's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="2,3,4")
    parser.add_argument("--max-rows", type=int, default=256)
    parser.add_argument("--padded", action="store_true",
                        help="raise each count to batch.product_rows first")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {args.dtype}, M {MIN_ROWS}..{args.max_rows}"
          f"{', padded by product_rows' if args.padded else ''}")
    for threads in (int(t) for t in args.threads.split(",")):
        for k, n in SHAPES:
            bad = differing_counts(threads, product_rows if args.padded else lambda m: m,
                                   shape=(n, k), max_rows=args.max_rows, dtype=dtype)
            print(f"{threads} threads, in {k} out {n}: {len(bad)} counts differ {bad[:20]}",
                  flush=True)


if __name__ == "__main__":
    main()
