#!/usr/bin/env python3
"""Which rows of a mixed batch get other LoRA bits than alone, and in which tile lane they sat.

tests/gpu/test_lora_kernels_gpu.py::test_rows_independent_of_batch says whether probe rows keep
their bits; this says which rows of one mixed batch do not, with each one's slot, (tile, lane) and
largest difference, and whether the same batch run twice repeats (a race would not), so a kernel
change that breaks the invariance for some lanes or tables only shows where. It runs the LoRA
shrink and expand of the checkout it runs from (a tried kernel's copy: run it from that copy's
root with this checkout on PYTHONPATH), at the 8B model's shapes on CUDA, or at the
interpreter's tiny shapes on the CPU under TRITON_INTERPRET=1. Exit status 1 when any row
differs.

Usage: python -m benchmarks.probe_lora_row_bits [--shape qkv] [--rows 128] [--seed 1]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qkv", help="a GPU_SHAPES (CUDA) or CPU_SHAPES (CPU) name "
                                                  "of tests/kernels/lora_kernel_checks.py")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    import torch

    from tests.kernels.triton_interpreter import probe_device
    device = probe_device("probe_lora_row_bits")
    if device is None:
        return 2
    import lorad
    from lorad.workers.kernels.lora_tiles import LoraTiles, count_tiles
    from tests.kernels import lora_kernel_checks as checks

    shapes = checks.shapes_on(device)
    if args.shape not in shapes:
        print(f"probe_lora_row_bits: no shape {args.shape!r}; one of {', '.join(shapes)}",
              file=sys.stderr)
        return 2
    shape = shapes[args.shape]
    gen = torch.Generator().manual_seed(args.seed)
    tables = checks.make_tables(shape, gen, device)
    slots = checks.mixed_slots(args.rows, shape.num_slots, gen)
    x = torch.randn(args.rows, shape.in_features, generator=gen).to(torch.bfloat16)
    outs = [torch.randn(args.rows, n, generator=gen) for n in shape.out_features]

    def run(row_slots, rows_x, rows_out):
        got = [o.to(device, copy=True) for o in rows_out]
        t = checks.empty_t(shape, row_slots.shape[0], device)
        checks.run_kernels(rows_x.to(device), got, tables, row_slots.to(device), t=t)
        return [o.cpu() for o in got], t.cpu().nan_to_num(0.0)

    batch_out, batch_t = run(slots, x, outs)
    again_out, again_t = run(slots, x, outs)
    repeats = all(torch.equal(a, b) for a, b in zip(batch_out, again_out)) and torch.equal(
        batch_t, again_t)
    edited = slots != 0
    counts = torch.bincount(slots[edited])
    tiles = LoraTiles.build(slots.to(device), count_tiles((int(c) for c in counts if c), 16))
    lane_of = {row: (tile, lane) for tile, lanes in enumerate(tiles.tile_rows.cpu().tolist())
               for lane, row in enumerate(lanes) if row >= 0}
    differing = []
    for row in edited.nonzero().flatten().tolist():
        one_out, one_t = run(slots[row:row + 1], x[row:row + 1], [o[row:row + 1] for o in outs])
        tables_out = [i for i, (a, b) in enumerate(zip(one_out, batch_out))
                      if not torch.equal(a[0], b[row])]
        t_differs = not torch.equal(one_t[:, 0], batch_t[:, row])
        if tables_out or t_differs:
            diff = max((a[0].float() - b[row].float()).abs().max().item()
                       for a, b in zip(one_out, batch_out))
            differing.append((row, int(slots[row]), lane_of.get(row), t_differs, tables_out, diff))
    print(f"# {device}, shape {args.shape} {shape}, {args.rows} rows, seed {args.seed}, "
          f"lorad from {Path(lorad.__file__).parent.parent}")
    print(f"the same batch twice gives the same bits: {repeats}")
    print(f"rows with other bits alone than in the batch: {len(differing)} of {int(edited.sum())}")
    for row, slot, where, t_differs, tables_out, diff in differing[:20]:
        print(f"  row {row}: slot {slot}, (tile, lane) {where}, t differs: {t_differs}, "
              f"outputs differing: {tables_out}, largest difference {diff:.3g}")
    print(f"lanes of those rows: {dict(Counter(w[1] for _, _, w, _, _, _ in differing if w))}")
    return 0 if repeats and not differing else 1


if __name__ == "__main__":
    sys.exit(main())
