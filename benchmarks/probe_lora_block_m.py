#!/usr/bin/env python3
"""Do the LoRA kernels give a row the same bits at every tile height?

TileConfig.block_m is the M side of the shrink's and the expand's MMAs; a server keeps one because
a row's bits might depend on it (another MMA shape, another order inside the tensor core). Prompt
steps of one adapter might gain from taller tiles (16-row tiles re-read A and B for every 16
rows), so this asks the hardware: for each 8B projection (bf16 x, bf16 tables as LoraSlots holds
them), rows of one adapter and of mixed adapters, it runs shrink + expand with tiles of each
height and compares t and the outputs bit for bit with 16-row tiles. Runs on CUDA, or at the
interpreter's tiny shapes under TRITON_INTERPRET=1 (where every height agrees: the interpreter's
dot is numpy's). Exit status 1 when any height changes a bit; a height whose tiles do not fit
the card's shared memory is marked so. The steps' speed by height: profile_prefill --variant
"main;tiles.block_m=64" (docs/performance-log.md: LoRA tiles of 32 to 128 rows).

--expand-only gives every height's expand the 16-row shrink's t, so that only the expand's MMA
shape differs: whether the expand alone (a rank-deep MMA) keeps a row's bits at other heights.

Usage: python -m benchmarks.probe_lora_block_m [--heights 16,32,64,128] [--rows 1,5,100,512]
       [--expand-only]
"""

from __future__ import annotations

import argparse
import sys


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heights", type=_ints, default=[16, 32, 64, 128])
    p.add_argument("--rows", type=_ints, default=[1, 5, 100, 512, 2048])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--expand-only", action="store_true",
                   help="every height's expand reads the 16-row shrink's t")
    args = p.parse_args()
    import torch

    from tests.kernels.triton_interpreter import probe_device
    device = probe_device("probe_lora_block_m")
    if device is None:
        return 2
    from lorad.workers.kernels.configs import TileConfig
    from tests.kernels import lora_kernel_checks as checks
    from triton.runtime.errors import OutOfResources

    shapes = checks.shapes_on(device)
    names = [n for n in ("qkv", "gate_up", "o", "down", "one", "pair") if n in shapes]
    gen = torch.Generator().manual_seed(args.seed)

    def run(x, outs, tables, slots, height, shape, t16=None):
        got = [o.clone() for o in outs]
        if t16 is not None:  # the expand alone, on the 16-row shrink's t
            return t16, expand_only(t16, got, tables, slots.to(device), height)
        # NaN where the shrink writes nothing (ranks past a slot's rank), zero after
        t = checks.run_kernels(x, got, tables, slots.to(device),
                               t=checks.empty_t(shape, x.shape[0], device),
                               tile_config=TileConfig(block_m=height))
        return t, got

    def expand_only(t, outs, tables, slots, height):
        from lorad.workers.kernels.lora_expand import lora_expand
        from lorad.workers.kernels.lora_tiles import LoraTiles, count_tiles
        config = TileConfig(block_m=height)
        counts = torch.bincount(slots[slots != 0].cpu())
        tiles = LoraTiles.build(slots, count_tiles((int(c) for c in counts), height), config)
        lora_expand(t, outs, tables.b, tables.ranks, tables.scales, tiles)
        return outs

    differing = 0
    print(f"# {device}: rows of one adapter ('one') or mixed; '=' same bits as 16-row tiles")
    for name in names:
        shape = shapes[name]
        tables = checks.make_tables(shape, gen, device, torch.bfloat16)
        for rows in args.rows if device == "cuda" else [r for r in args.rows if r <= 100]:
            x = torch.randn(rows, shape.in_features, generator=gen).to(device, torch.bfloat16)
            outs = [torch.randn(rows, n, generator=gen).to(device, torch.bfloat16)
                    for n in shape.out_features]
            for kind, slots in (("one", torch.full((rows,), shape.num_slots - 1)),
                                ("mixed", checks.mixed_slots(rows, shape.num_slots, gen))):
                if not (slots != 0).any():
                    continue
                want_t, want = run(x, outs, tables, slots, 16, shape)
                t16 = want_t if args.expand_only else None
                marks = []
                for height in args.heights:
                    try:
                        t, got = run(x, outs, tables, slots, height, shape, t16)
                    except OutOfResources:
                        marks.append(f"{height}:no-fit")
                        continue
                    same = torch.equal(t.nan_to_num(0.0), want_t.nan_to_num(0.0)) and all(
                        torch.equal(a, b) for a, b in zip(got, want))
                    differing += not same
                    marks.append(f"{height}:{'=' if same else 'DIFFERS'}")
                print(f"{name:8} {rows:5} rows {kind:5}  {' '.join(marks)}")
    print(f"\nheights that changed a bit: {differing} cases")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
