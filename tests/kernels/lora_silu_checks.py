"""Checks of lora_expand_silu (gate/up's LoRA expand fused with silu * up) against what it
replaces: lora_expand adding into gate and up in place, then fused_ops.silu_and_mul, bit for bit.

test_triton_interpreted.py runs them on CPU tensors under TRITON_INTERPRET=1 in a subprocess;
tests/gpu/test_lora_silu_gpu.py calls them on CUDA at the 8B model's gate/up shape. Each takes
fresh random inputs: bf16 base outputs and tables, several slots among which one gate's table
does not edit, one neither edits, ranks below a table's padding, strengths other than 1.0, rows
of slot 0, and a poisoned output that every row must overwrite.
"""

from __future__ import annotations

import sys

import torch

from tests.kernels.lora_kernel_checks import Shape, make_tables, mixed_slots
from tests.kernels.triton_interpreter import run_checks

POISON = float("nan")
# Tiny gate/up for the interpreter: 3 K chunks, 3 blocks of 128 outputs (the last partial), up's
# rank padding (20, so RANK_PAD 32) above gate's.
CPU_SHAPE = Shape(7, 1100, (300, 300), (8, 20))
# The 8B model's gate/up at 64 adapters of rank 16, with a wider rank padding on up's table.
GPU_SHAPE = Shape(65, 4096, (14336, 14336), (16, 32))
# Powers of two multiply exactly; 0.7 and 1.3 catch a product taken in another order.
STRENGTHS = (0.0, 0.5, 0.7, 1.0, 1.3, 4.0)


def _ranks(tables, num_slots: int) -> None:
    """Slot 2: up's table only (gate's rank 0); slot 3: neither; the rest as make_tables made
    them (the last slot at each table's padding)."""
    tables.ranks[0][2] = 0
    tables.ranks[0][3] = 0
    tables.ranks[1][3] = 0
    if tables.ranks[1][2] == 0:
        tables.ranks[1][2] = 1


def check_expand_silu_matches_expand_then_silu(device: str, shape: Shape,
                                               batch_sizes: tuple[int, ...],
                                               num_programs: tuple[int | None, ...] = (None,),
                                               dtype: torch.dtype = torch.bfloat16,
                                               seed: int = 0) -> None:
    """For each step size and each edited pair (gate and up, gate alone, up alone):
    lora_expand_silu equals lora_expand in place into the edited halves of one gate/up output
    followed by silu_and_mul, bit for bit on every row, writing every row (its output is
    poisoned), reading gate and up only; the tiled kernel writes no row of slot 0 (told that
    every row has an adapter, the rows of slot 0 keep their poison). dtype: the base output's
    and the tables' (bf16 as served; in fp32 an fp32 ulp of the delta shows, where bf16's one
    rounding of base + delta mostly hides it)."""
    from lorad.workers.kernels.configs import TileConfig
    from lorad.workers.kernels.fused_ops import silu_and_mul
    from lorad.workers.kernels.lora_expand import lora_expand
    from lorad.workers.kernels.lora_expand_silu import lora_expand_silu
    from lorad.workers.kernels.lora_shrink import lora_shrink
    from lorad.workers.kernels.lora_tiles import LoraTiles, count_tiles
    gen = torch.Generator().manual_seed(seed)
    tables = make_tables(shape, gen, device, dtype)
    _ranks(tables, shape.num_slots)
    n = shape.out_features[0]
    for num_rows in batch_sizes:
        row_slots = mixed_slots(num_rows, shape.num_slots, gen)
        row_slots[:3] = torch.tensor([2, 3, 0])  # up only, neither, no adapter
        row_slots = row_slots.to(device)
        strengths = torch.tensor(STRENGTHS)[torch.randint(0, len(STRENGTHS), (num_rows,),
                                                          generator=gen)].to(device)
        x = torch.randn(num_rows, shape.in_features, generator=gen).to(device, dtype)
        gate_up = (torch.randn(num_rows, 2 * n, generator=gen) * 4.0).to(device, dtype)
        counts = torch.bincount(row_slots[row_slots != 0].cpu())
        tiles = LoraTiles.build(row_slots, count_tiles((int(c) for c in counts),
                                                       TileConfig().block_m))
        # A table's t is the same whatever shares its shrink: one shrink serves every pair.
        t_both = lora_shrink(x, tables.a, tables.ranks, tiles)
        for edited in ((0, 1), (0,), (1,)):
            where = f"{num_rows} rows, tables {edited}"
            t = t_both if len(edited) == 2 else t_both[edited[0]:edited[0] + 1].clone()
            pick = [[table[i] if i in edited else None for i in range(2)]
                    for table in (tables.b, tables.ranks, tables.scales)]
            added = gate_up.clone()
            halves = added.chunk(2, dim=1)
            lora_expand(t, [halves[i] for i in edited], [tables.b[i] for i in edited],
                        [tables.ranks[i] for i in edited], [tables.scales[i] for i in edited],
                        tiles, row_strengths=strengths)
            if torch.equal(added, gate_up):
                raise AssertionError(f"{where}: the expand changed nothing: this check could "
                                     f"not fail")
            want = silu_and_mul(*halves)
            before = gate_up.clone()
            gate, up = gate_up.chunk(2, dim=1)
            for programs in num_programs:
                out = torch.full((num_rows, n), POISON, dtype=dtype, device=device)
                got = lora_expand_silu(t, gate, up, *pick, tiles, row_slots,
                                       row_strengths=strengths, num_programs=programs, out=out)
                if got.data_ptr() != out.data_ptr():
                    raise AssertionError(f"{where}: not written into out")
                if not torch.equal(got, want):
                    bad = (got != want).any(1) | got.isnan().any(1)
                    first = bad.nonzero()[:5, 0].tolist()
                    raise AssertionError(
                        f"{where}, {programs or 'default'} programs: {int(bad.sum())} rows "
                        f"differ from expand in place + silu_and_mul (first {first}, slots "
                        f"{row_slots[bad][:5].tolist()}); they must be bit-equal")
                if not torch.equal(gate_up, before):
                    raise AssertionError(f"{where}: gate or up was written")
            if len(edited) == 2:
                tiled = torch.full((num_rows, n), POISON, dtype=dtype, device=device)
                lora_expand_silu(t, gate, up, *pick, tiles, torch.ones_like(row_slots),
                                 row_strengths=strengths, out=tiled)
                base = row_slots == 0
                if not tiled[base].isnan().all() or not torch.equal(tiled[~base], want[~base]):
                    raise AssertionError(f"{where}: the tiled kernel wrote a row of slot 0, or "
                                         f"missed an adapter row")


CHECKS = {
    "expand_silu_bf16": (check_expand_silu_matches_expand_then_silu,
                         dict(shape=CPU_SHAPE, batch_sizes=(263,))),
    "expand_silu_bf16_looping": (check_expand_silu_matches_expand_then_silu,
                                 dict(shape=CPU_SHAPE, batch_sizes=(256,), num_programs=(3,),
                                      seed=1)),
    "expand_silu_fp32": (check_expand_silu_matches_expand_then_silu,
                         dict(shape=CPU_SHAPE, batch_sizes=(263,), dtype=torch.float32,
                              seed=2)),
}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
