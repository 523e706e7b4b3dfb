#!/usr/bin/env python3
"""The pieces of one MoE layer's decode step on their own, at the Qwen1.5-MoE-A2.7B shape (bf16,
random weights, a decode step of --rows real rows padded to MIN_ROWS): the fused MoE kernel's
tile table build by its pair block and warps, the routed experts' two kernels by MoeConfig, and
each base projection through the decode GEMV by tile against cuBLAS (the router and the shared
expert's gate apart and as one weight). Each figure: microseconds a call, the median of graph
replays of --calls calls, each call on weights of its own (as the layers of a step; the experts on
one of --expert-copies sets), so that they come from memory, not the L2 cache; bytes of weights
read over the time beside it (issue 34: batch 1 at 60% of its floor). Prints one table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import conditions, copy_bandwidth, time_graph
from lorad.workers.batch import MIN_ROWS
from lorad.workers.kernels.decode_gemv import decode_matmul
from lorad.workers.kernels.fused_moe import (TILE_KERNEL_MAX_PAIRS, expert_pairs,
                                             expert_tiles_kernel)
from lorad.workers.tuning import Tuning, replaced

REPO = Path(__file__).resolve().parent.parent
CUDA = torch.device("cuda")

MOE_VARIANTS = ("main", "block_n=32", "block_n=128", "num_stages=3", "num_stages=5",
                "num_warps=2", "num_warps=8", "block_k=64", "block_k=256+num_stages=3",
                "block_k=64+num_stages=3", "block_n=32+num_stages=5")
GEMV_VARIANTS = ("block_n=64+block_k=256+num_stages=4", "block_n=64+block_k=128+num_stages=3",
                 "block_n=32+block_k=256+num_stages=4", "block_n=16+block_k=256+num_stages=4",
                 "block_n=16+block_k=512+num_stages=3", "block_n=32+block_k=512+num_stages=3")


def config_of(field: str, text: str):
    """Tuning()'s `field` (a dotted path: moe, gemv.o) with 'name=value+...' applied (tuning
    .replaced; 'main': the defaults; a field that holds None starts from its type's)."""
    settings = "+".join(f"{field}.{part}" for part in text.split("+") if part != "main")
    tuning = replaced(Tuning(), settings)
    for name in field.split("."):
        tuning = getattr(tuning, name)
    return tuning


def micros(fn, calls: int) -> float:
    """Microseconds of one fn(i) call: a graph of fn(0) ... fn(calls - 1), its median replay /
    calls; NaN (and the error printed) where fn fails."""
    def many():
        for i in range(calls):
            fn(i)
    try:
        return time_graph(many) / calls * 1e6
    except (ValueError, RuntimeError) as exc:  # a tile that does not fit or compile
        print(f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
        return float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "scripts/configs/qwen1.5-moe-a2.7b"))
    p.add_argument("--rows", type=int, default=1, help="real rows of the decode step")
    p.add_argument("--calls", type=int, default=24, help="calls a graph holds (one a layer)")
    p.add_argument("--expert-copies", type=int, default=4,
                   help="sets of expert weights the calls take in turn (each ~1 GB)")
    p.add_argument("--moe", default=",".join(MOE_VARIANTS), help="MoeConfig variants, commas")
    p.add_argument("--gemv", default=",".join(GEMV_VARIANTS), help="GemvConfig variants, commas")
    args = p.parse_args()
    cfg = json.loads((Path(args.config) / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    shared, num_experts, top_k = (cfg["shared_expert_intermediate_size"], cfg["num_experts"],
                                  cfg["num_experts_per_tok"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads
    rows = max(args.rows, MIN_ROWS)
    gen = torch.Generator(device=CUDA).manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=CUDA, generator=gen) * 0.02).to(torch.bfloat16)

    bandwidth = copy_bandwidth(CUDA)
    print(conditions(CUDA), f"copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    lines = ["| piece | variant | us | weight MB | of copy bandwidth |", "|---|---|---|---|---|"]

    def row(piece: str, variant: str, us: float, nbytes: int = 0) -> None:
        share = f"{nbytes / (us * 1e-6) / bandwidth:.0%}" if nbytes else ""
        mb = f"{nbytes / 1e6:.1f}" if nbytes else ""
        lines.append(f"| {piece} | {variant} | {us:.2f} | {mb} | {share} |")
        print(lines[-1], flush=True)

    x = weight(rows, hidden)
    # Each real row's top_k distinct experts, ascending; padding rows none (num_experts).
    experts = torch.full((rows, top_k), num_experts, dtype=torch.int64, device=CUDA)
    for r in range(args.rows):
        experts[r] = torch.randperm(num_experts, device=CUDA, generator=gen)[:top_k].sort().values
    weights = torch.rand(rows, top_k, device=CUDA, generator=gen).to(torch.bfloat16)
    pairs = rows * top_k
    block_ps = [b for b in (16, 32, 64, 128, 256, 512) if b >= pairs] or [TILE_KERNEL_MAX_PAIRS]
    for block_p in block_ps:
        for warps in (1, 4):
            us = micros(lambda i: expert_tiles_kernel(experts, num_experts, 16,
                                                      block_p=block_p, num_warps=warps),
                        args.calls)
            row("expert tiles", f"block_p={block_p}+num_warps={warps}", us)

    copies = max(1, args.expert_copies)
    gate_ups = [weight(num_experts, 2 * inter, hidden) for _ in range(copies)]
    downs = [weight(num_experts, hidden, inter) for _ in range(copies)]
    touched = len(set(experts[:args.rows].flatten().tolist()))
    expert_bytes = touched * 3 * inter * hidden * 2
    for text in [v for v in args.moe.split(",") if v]:
        config = config_of("moe", text)
        us = micros(lambda i: expert_pairs(x, gate_ups[i % copies], downs[i % copies], weights,
                                           experts, config), args.calls)
        row("routed experts (tiles + gate/up + down)", text, us, expert_bytes)

    projections = {"qkv": (heads + 2 * kv_heads) * head_dim, "o": hidden,
                   "shared gate_up": 2 * shared, "router": num_experts, "shared gate": 1,
                   "router + shared gate": num_experts + 1}
    ins = {"o": heads * head_dim}
    h = weight(rows, shared)
    cases = [(name, (n, ins.get(name, hidden)), x) for name, n in projections.items()]
    cases.append(("shared down", (hidden, shared), h))
    for name, shape, inp in cases:
        ws = [weight(*shape) for _ in range(args.calls)]  # a layer's own
        nbytes = ws[0].numel() * ws[0].element_size()
        row(name, "cuBLAS", micros(lambda i: inp @ ws[i].t(), args.calls), nbytes)
        for text in [v for v in args.gemv.split(",") if v]:
            config = config_of("gemv.o", f"block_m=16+{text}")
            us = micros(lambda i: decode_matmul(inp, ws[i], config=config), args.calls)
            row(name, f"GEMV {text}", us, nbytes)
    print("\n".join(["", f"# {args.rows} real rows of {rows}, {touched} experts touched"] + lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
