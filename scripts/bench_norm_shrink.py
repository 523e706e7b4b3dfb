#!/usr/bin/env python3
"""Time residual add + RMSNorm + LoRA shrink at the Llama-3-8B shape: two launches (add_rms_norm,
then lora_shrink) against one (add_rms_norm_shrink).

Hidden 4096, rank 16, 64 adapters + slot 0; the shrinks of q/k/v (3 tables) and of gate/up (2),
each with 32 layers' worth of distinct fp32 A tables, so A streams from HBM as in serving. For
each batch (1, 8, 32, 64) and mixture (every row on one adapter; a distinct adapter per row),
32 calls are replayed as one CUDA graph; prints the time per call. The shrink's row tiles are
built outside the graph, with the bound a graph for any mixture uses (as serving does). Needs
CUDA and triton; prints the conditions with the table. Does not check results: the tests do.

Usage: scripts/bench_norm_shrink.py [--layers 32] [--batches 1,8,32,64]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HIDDEN, RANK, NUM_ADAPTERS, EPS = 4096, 16, 64, 1e-5
GROUPS = {"q/k/v": 3, "gate/up": 2}  # tables sharing the normed input


def bench(num_layers: int, batches: list[int], device: torch.device) -> list[tuple]:
    # scripts/ is on sys.path as the script's folder; its mixtures cycle over 64 adapters too
    from bench_lora_kernels import mixtures, time_graph
    from lorad.workers.kernels.fused_ops import add_rms_norm, add_rms_norm_shrink
    from lorad.workers.kernels.lora_shrink import lora_shrink
    from lorad.workers.kernels.lora_tiles import LoraTiles, max_tiles_any_mixture
    max_rows = max(batches)
    ranks = torch.full((NUM_ADAPTERS + 1,), RANK, dtype=torch.int32, device=device)
    ranks[0] = 0
    weight = torch.randn(HIDDEN, device=device).bfloat16()
    delta = torch.randn(max_rows, HIDDEN, device=device)  # fp32: a row-parallel sum
    residual = torch.randn(max_rows, HIDDEN, device=device).bfloat16()
    rows = []
    for group, num_tables in GROUPS.items():
        layers = [[torch.randn(NUM_ADAPTERS + 1, RANK, HIDDEN, device=device) / HIDDEN ** 0.5
                   for _ in range(num_tables)] for _ in range(num_layers)]
        rank_tables = [ranks] * num_tables
        for num_rows in batches:
            for mixture, slots in mixtures(num_rows).items():
                row_slots = torch.tensor(slots, dtype=torch.int64, device=device)
                tiles = LoraTiles.build(row_slots, max_tiles_any_mixture(num_rows))
                d, r = delta[:num_rows], residual[:num_rows]

                def two_launches() -> None:
                    for a_tables in layers:
                        # r updated in place; PDL up to 32 rows, as these timings always had
                        _, normed = add_rms_norm(d, r, weight, EPS, pdl_rows=32)
                        lora_shrink(normed, a_tables, rank_tables, tiles, pdl_rows=32)

                def one_launch() -> None:
                    for a_tables in layers:
                        add_rms_norm_shrink(d, r, weight, EPS, a_tables, rank_tables, row_slots)

                two = time_graph(two_launches) / num_layers
                one = time_graph(one_launch) / num_layers
                rows.append((group, num_rows, mixture, two, one))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", default="1,8,32,64")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_norm_shrink: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows = bench(args.layers, [int(b) for b in args.batches.split(",")], device)
    print(f"# residual add + RMSNorm + LoRA shrink: hidden {HIDDEN}, rank {RANK}, "
          f"{NUM_ADAPTERS} adapters + slot 0, {args.layers} layers of distinct fp32 A tables, "
          f"delta fp32, residual and normed bf16; per call, from one CUDA graph of "
          f"{args.layers} calls")
    print(f"# {datetime.date.today()}, {torch.cuda.get_device_name(device)}, torch "
          f"{torch.__version__}, triton {triton.__version__}, python {platform.python_version()}")
    print("\n| tables | batch | mixture | add_rms_norm + lora_shrink us | add_rms_norm_shrink us "
          "| speed-up |")
    print("|---|---:|---|---:|---:|---:|")
    for group, num_rows, mixture, two, one in rows:
        print(f"| {group} | {num_rows} | {mixture} | {two * 1e6:.1f} | {one * 1e6:.1f} | "
              f"{two / one:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
