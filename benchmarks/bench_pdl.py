#!/usr/bin/env python3
"""Programmatic dependent launch (PDL) on this GPU: what it saves between back-to-back kernels
in a CUDA graph, as a decode step has them. A benchmark, not a test.

    python -m benchmarks.bench_pdl [--layers 32] [--repeats 20]

Each case is a graph of `layers` repetitions of a decode layer's pattern at batch 1, hidden 4096:
- "triton chain": five small Triton kernels in a row (each reads the row the one before wrote);
- "with matmuls": a small Triton kernel, then a cuBLAS matmul of the 8B shape's o projection
  (4096 x 4096) reading its output, and so on.
Each is timed with the Triton kernels launched plainly, and with launch_pdl=True and the kernels
waiting on the one before (gdc_wait) after signalling their dependants (gdc_launch_dependents).
Prints us per graph replay (median) and per kernel transition; the outputs of both are compared.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from benchmarks.common import conditions, time_cuda


@triton.jit
def _scale_kernel(x_ptr, out_ptr, weight_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    w = tl.load(weight_ptr + cols, mask=cols < N, other=0.0)  # independent of the kernel before
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    x = tl.load(x_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / N + 1e-5)
    tl.store(out_ptr + cols, (x * scale * w).to(out_ptr.dtype.element_ty), mask=cols < N)


def build(case: str, pdl: bool, layers: int, hidden: int):
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    weights = [torch.rand(hidden, device=device, generator=gen) + 0.5 for _ in range(5)]
    mats = [torch.randn(hidden, hidden, device=device, dtype=torch.bfloat16, generator=gen) / 64
            for _ in range(layers)]
    bufs = [torch.empty_like(x) for _ in range(2)]

    def step():
        cur = x
        for layer in range(layers):
            if case == "triton chain":
                for i in range(5):
                    out = bufs[i % 2]
                    _scale_kernel[(1,)](cur, out, weights[i], hidden, BLOCK=hidden, PDL=pdl,
                                        launch_pdl=pdl, num_warps=8)
                    cur = out
            else:
                out = bufs[0]
                _scale_kernel[(1,)](cur, out, weights[0], hidden, BLOCK=hidden, PDL=pdl,
                                    launch_pdl=pdl, num_warps=8)
                cur = torch.nn.functional.linear(out, mats[layer])
        return cur

    step()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        step()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            result = step()
    torch.cuda.synchronize()
    return graph, result, (x, weights, mats, bufs)  # the graph reads these: keep them alive


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"# PDL, {conditions('cuda')}; us per graph replay, median of {args.repeats}")
    print(f"{'case':>14} {'plain us':>9} {'pdl us':>9} {'saved/transition us':>20} same")
    for case, transitions in (("triton chain", 5), ("with matmuls", 2)):
        plain_graph, plain_out, plain_inputs = build(case, False, args.layers, args.hidden)
        pdl_graph, pdl_out, pdl_inputs = build(case, True, args.layers, args.hidden)
        plain = 1e6 * min(time_cuda(plain_graph.replay, args.repeats, 3) for _ in range(3))
        pdl = 1e6 * min(time_cuda(pdl_graph.replay, args.repeats, 3) for _ in range(3))
        plain_graph.replay(), pdl_graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(plain_out, pdl_out)
        saved = (plain - pdl) / (transitions * args.layers)
        print(f"{case:>14} {plain:>9.1f} {pdl:>9.1f} {saved:>20.2f} {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
