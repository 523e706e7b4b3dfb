#!/usr/bin/env python3
"""Decode attention micro-benchmark: the split-KV Triton kernel at Llama-3-8B's shape on one GPU
(32 query / 8 KV heads, head_dim 128, blocks of 16 tokens, bf16), batch 1 to 128 at contexts 1024
and 4096, with the bandwidth achieved against the K and V bytes read.

    python -m benchmarks.bench_paged_attention [--split-sizes 256] [--tile-sizes 64,128]
                                            [--warps 4,8] [--batches 1,8,32,64,128]
                                            [--contexts 1024,4096] [--iters 50]
                                            [--table-tokens 8192] [--split-programs=-1,0]
                                            [--stages 2,3] [--layouts nhd,hnd]
                                            [--preload=-1,0,1]

Each row times one kernel pair (split + reduce) replayed from a CUDA graph, as a decode step runs
it, and also launched eagerly. --layouts hnd stores each block's KV heads one after another
(a head's block_size tokens contiguous) instead of lorad's token-major blocks (nhd), passed to the
kernel as a strided view of the same shape. --preload 1 reads each split's first block ids
early (the default in steps of up to DecodeAttentionConfig.preload_max_seqs sequences), 0 in
the loop, -1 (the default) as the kernel picks. Block tables are shuffled; consecutive calls read
different blocks (several table sets per graph when one call's KV would fit in L2), so small rows
are not served from L2. Prints a table and the conditions; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import sys

import torch

from lorad.workers.kernels.configs import DecodeAttentionConfig, PdlConfig  # noqa: E402
from lorad.workers.kernels.paged_attention import paged_decode_attention  # noqa: E402
from benchmarks.common import conditions  # noqa: E402

DEFAULT = DecodeAttentionConfig()  # lorad's
PDL_ROWS = PdlConfig().max_rows  # with PDL as in lorad's steps without LoRA launches

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
L2_FLUSH_BYTES = 256 << 20  # KV bytes a graph's calls read before one repeats: well past L2


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def time_ms(fn, iters: int) -> float:
    """Milliseconds per fn() call over `iters` calls, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bench(k_cache, v_cache, batch: int, context: int, split_size: int, iters: int,
          table_tokens: int, split_programs: int, tile_size: int, num_warps: int,
          num_stages: int, preload: bool | None) -> dict:
    device = k_cache.device
    blocks_per_seq = context // BLOCK_SIZE
    width = max(blocks_per_seq, table_tokens // BLOCK_SIZE)  # a graph's table: the longest context
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    num_sets = max(1, min(L2_FLUSH_BYTES // kv_bytes, k_cache.shape[0] // (batch * blocks_per_seq)))
    perm = torch.randperm(k_cache.shape[0], device=device)[:num_sets * batch * blocks_per_seq]
    tables = torch.zeros(num_sets, batch, width, dtype=torch.int32, device=device)
    tables[:, :, :blocks_per_seq] = perm.view(num_sets, batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    out = torch.empty(batch, NUM_Q_HEADS * HEAD_DIM, device=device, dtype=DTYPE)
    scale = HEAD_DIM ** -0.5

    config = DecodeAttentionConfig(
        split_size=split_size, tile_tokens=tile_size, num_warps=num_warps, num_stages=num_stages,
        split_programs=DEFAULT.split_programs if split_programs is None else split_programs)

    def call(i: int) -> None:
        paged_decode_attention(q, k_cache, v_cache, tables[i], lens, scale, out=out,
                               config=config, preload=preload, pdl_rows=PDL_ROWS)

    for i in range(num_sets):  # compile, and touch every set once
        call(i)
    eager_ms = time_ms(lambda: [call(i) for i in range(num_sets)], iters) / num_sets
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(num_sets):
            call(i)
    graph_ms = time_ms(graph.replay, iters) / num_sets
    return dict(kv_mb=kv_bytes / 2**20, graph_us=graph_ms * 1e3, eager_us=eager_ms * 1e3,
                gbps=kv_bytes / (graph_ms * 1e-3) / 1e9, sets=num_sets,
                splits=-(-context // split_size))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split-sizes", type=ints, default=[DEFAULT.split_size])
    parser.add_argument("--tile-sizes", type=ints, default=[DEFAULT.tile_tokens],
                        help="keys per step inside a split (sizes above a split are skipped)")
    parser.add_argument("--warps", type=ints, default=[DEFAULT.num_warps],
                        help="the split kernel's warps")
    parser.add_argument("--batches", type=ints, default=[1, 8, 32, 64, 128])
    parser.add_argument("--contexts", type=ints, default=[1024, 4096])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--table-tokens", type=int, default=0,
                        help="block table width in tokens, as a CUDA graph holds it for the "
                             "longest context (lorad: --max-model-len); default: the context")
    parser.add_argument("--split-programs", type=ints, default=[-1],
                        help="programs per sequence and KV head (0: one per split of the "
                             f"table's width, -1: lorad's, {DEFAULT.split_programs}; write "
                             "--split-programs=-1,0)")
    parser.add_argument("--stages", type=ints, default=[DEFAULT.num_stages])
    parser.add_argument("--preload", type=ints, default=[-1],
                        help="0: block ids read in the split's loop; 1: each split's first "
                             "block ids read early; -1: as the kernel picks by batch "
                             "(DecodeAttentionConfig.preload_max_seqs); write --preload=-1,0,1")
    parser.add_argument("--layouts", default="nhd",
                        help="nhd (lorad's: [block, token, head, dim]) and/or hnd ([block, head, "
                             "token, dim] seen through a strided view)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_paged_attention: needs a CUDA GPU", file=sys.stderr)
        return 2

    device = torch.device("cuda")
    num_blocks = max(args.batches) * max(args.contexts) // BLOCK_SIZE
    num_blocks = max(num_blocks, 2 * L2_FLUSH_BYTES // (2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
                                                        * DTYPE.itemsize))
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = {}
    for layout in args.layouts.split(","):
        if layout == "nhd":
            caches[layout] = (torch.randn(shape, device=device, dtype=DTYPE),
                              torch.randn(shape, device=device, dtype=DTYPE))
        elif layout == "hnd":
            head_major = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
            caches[layout] = tuple(torch.randn(head_major, device=device, dtype=DTYPE)
                                   .permute(0, 2, 1, 3) for _ in range(2))
        else:
            parser.error(f"--layouts: {layout!r} is not nhd or hnd")
    k_cache, v_cache = next(iter(caches.values()))
    print(f"# decode attention, {conditions(device)}")
    print(f"# {NUM_Q_HEADS} query / {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, blocks of "
          f"{BLOCK_SIZE}, {DTYPE}, KV pool {2 * k_cache.nbytes / 2**30:.1f} GiB; "
          f"GB/s = K+V bytes read / graph time; block tables {args.table_tokens or 'context'} "
          "tokens wide; progs = split programs per sequence and KV head (0: one per split, -1: "
          "the kernel's default)")
    header = (f"{'split':>5} {'tile':>4} {'warps':>5} {'progs':>5} {'batch':>5} {'context':>7} "
              f"{'splits':>6} {'KV MiB':>8} {'graph us':>9} {'eager us':>9} {'GB/s':>7} "
              f"{'sets':>4} {'stages':>6} {'layout':>6} {'preload':>7}")
    print(header)
    print("-" * len(header))
    configs = [(s, t, w, p, n, layout, e) for s in args.split_sizes for t in args.tile_sizes
               if t <= s for w in args.warps for p in args.split_programs for n in args.stages
               for layout in caches for e in args.preload]
    for split_size, tile_size, warps, programs, stages, layout, preload in configs:
        k_cache, v_cache = caches[layout]
        for context in args.contexts:
            for batch in args.batches:
                r = bench(k_cache, v_cache, batch, context, split_size, args.iters,
                          args.table_tokens, None if programs < 0 else programs, tile_size, warps,
                          stages, None if preload < 0 else bool(preload))
                print(f"{split_size:>5} {tile_size:>4} {warps:>5} {programs:>5} {batch:>5} "
                      f"{context:>7} {r['splits']:>6} {r['kv_mb']:>8.1f} {r['graph_us']:>9.1f} "
                      f"{r['eager_us']:>9.1f} {r['gbps']:>7.0f} {r['sets']:>4} {stages:>6} "
                      f"{layout:>6} {preload:>7}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
