"""Checks of the LoRA shrink/expand kernels against the plain-torch reference, on any device.

test_triton_interpreted.py runs them on CPU tensors under TRITON_INTERPRET=1 in a subprocess
(`python -m tests.kernels.lora_kernel_checks`), so the interpreter's setting and its patch stay
out of every other test; tests/gpu/test_lora_kernels_gpu.py calls them on CUDA at the 8B model's
shapes (and checks CUDA graph replay there).
Every check takes fresh random inputs, poisons what the kernels must not touch, and raises
AssertionError naming what differed. Kernel modules are imported inside the checks, after the
interpreter is set.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from lorad.workers.batch import ForwardBatch
from tests.kernels.triton_interpreter import run_checks


@dataclass(frozen=True)
class Shape:
    num_slots: int  # slot 0 (no adapter) included
    in_features: int  # shared by the tables of one launch
    out_features: tuple[int, ...]  # one per table
    max_ranks: tuple[int, ...]  # one per table: its rank padding


# Tiny shapes for the interpreter: K and N not multiples of the blocks, a rank above the expand's
# chunk of 16, three tables as q/k/v, and K split into chunks (3 of the shrink's 512, the last
# partial, their count not a power of two).
CPU_SHAPES = {
    "qkv": Shape(6, 40, (24, 70, 8), (8, 20, 3)),
    "pair": Shape(5, 33, (17, 9), (4, 16)),
    "one": Shape(4, 50, (30,), (5,)),
    "long_k": Shape(4, 1100, (12, 20), (16, 6)),
}
# The 8B model's projections at rank 16 with 64 adapters, and one mixed-rank pair.
GPU_SHAPES = {
    "qkv": Shape(65, 4096, (4096, 1024, 1024), (16, 16, 16)),
    "gate_up": Shape(65, 4096, (14336, 14336), (16, 16)),
    "o": Shape(65, 4096, (4096,), (16,)),
    "down": Shape(65, 14336, (4096,), (16,)),
    "ranks_to_64": Shape(17, 4096, (4096, 1024), (64, 16)),
}


def shapes_on(device: str) -> dict[str, Shape]:
    """The shapes the checks take on `device`: the interpreter's tiny ones on the CPU."""
    return CPU_SHAPES if device == "cpu" else GPU_SHAPES


SENTINEL = -7777.0  # in rows the kernels must not write
X_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# What B's tables hold past each slot's rank in the checks: finite, as the expand requires (it
# multiplies them by exact zeros instead of masking them), but far from LoraSlots' zeros, so a
# kernel that let them into a result would be caught.
B_PADDING = 3.0e4


@dataclass
class Tables:
    # The table dtype (fp32 unless asked), rank padding poisoned: A's with NaN, B's with
    # B_PADDING.
    a: list[torch.Tensor]  # [num_slots, max_rank, in]
    b: list[torch.Tensor]  # [num_slots, out, max_rank]
    ranks: list[torch.Tensor]  # [num_slots] int32; slot 0 and some others 0
    scales: list[torch.Tensor]  # [num_slots] float32


def make_tables(shape: Shape, gen: torch.Generator, device: str,
                dtype: torch.dtype = torch.float32) -> Tables:
    """Random factor tables in `dtype` (random fp32 values rounded to it)."""
    tables = Tables([], [], [], [])
    for n, max_rank in zip(shape.out_features, shape.max_ranks):
        # Every rank from 0 to max_rank appears when there are slots enough; slot 0 has none.
        ranks = [0] + [(s * 7) % (max_rank + 1) for s in range(1, shape.num_slots)]
        ranks[-1] = max_rank
        a = torch.randn(shape.num_slots, max_rank, shape.in_features, generator=gen)
        b = torch.randn(shape.num_slots, n, max_rank, generator=gen)
        a /= shape.in_features ** 0.5
        for slot, rank in enumerate(ranks):
            a[slot, rank:] = float("nan")
            b[slot, :, rank:] = B_PADDING
        tables.a.append(a.to(device, dtype))
        tables.b.append(b.to(device, dtype))
        tables.ranks.append(torch.tensor(ranks, dtype=torch.int32, device=device))
        tables.scales.append((torch.rand(shape.num_slots, generator=gen) + 0.5).to(device))
    return tables


def mixed_slots(num_rows: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """Some rows of slot 0, a run of one slot longer than a tile, the rest random."""
    slots = torch.randint(0, num_slots, (num_rows,), generator=gen)
    hot = torch.rand(num_rows, generator=gen) < 0.4
    return torch.where(hot, torch.full_like(slots, num_slots - 1), slots)


def run_kernels(x: torch.Tensor, outs: list[torch.Tensor], tables: Tables, row_slots: torch.Tensor,
                max_tiles: int | None = None, num_programs: int | None = None,
                t: torch.Tensor | None = None, deltas: bool = False,
                row_strengths: torch.Tensor | None = None, tile_config=None) -> torch.Tensor:
    """The shrink, then the expand into outs (in place); -> t. tile_config: the row tiles'
    TileConfig (None: the default)."""
    from lorad.workers.kernels.lora_expand import lora_expand
    from lorad.workers.kernels.lora_shrink import lora_shrink
    from lorad.workers.kernels.configs import TileConfig
    from lorad.workers.kernels.lora_tiles import LoraTiles, count_tiles
    tile_config = tile_config or TileConfig()
    if max_tiles is None:  # exact, from the slots (a test may read them; the model does not)
        counts = torch.bincount(row_slots[row_slots != 0].cpu())
        max_tiles = count_tiles((int(c) for c in counts), tile_config.block_m)
    tiles = LoraTiles.build(row_slots, max_tiles, tile_config)
    t = lora_shrink(x, tables.a, tables.ranks, tiles, out=t, num_programs=num_programs)
    lora_expand(t, outs, tables.b, tables.ranks, tables.scales, tiles,
                row_strengths=row_strengths, num_programs=num_programs, deltas=deltas)
    return t


def empty_t(shape: Shape, num_rows: int, device: str) -> torch.Tensor:
    """The shrink's output for `shape`, poisoned with NaN: [num_tables, num_rows, num_k_chunks,
    max rank]."""
    from lorad.workers.kernels.lora_shrink import num_k_chunks
    return torch.full((len(shape.out_features), num_rows, num_k_chunks(shape.in_features),
                       max(shape.max_ranks)), float("nan"), device=device)


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4) -> None:
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got - want).abs().max().item() if want.numel() else 0.0
    if not err <= rel * max(scale, 1e-30) or got.isnan().any():
        raise AssertionError(f"{name}: max |kernel - reference| = {err:.3g}, "
                             f"max |reference| = {scale:.3g} (allowed {rel:g} of it)")


def check_matches_reference(device: str, shape: Shape, x_dtype: torch.dtype,
                            batch_sizes: tuple[int, ...], num_programs: int | None = None,
                            seed: int = 0, table_dtype: torch.dtype = torch.float32) -> None:
    """Edited rows equal the reference; every other element of t and out keeps its poison. The
    same with the expand writing the deltas alone (deltas=True) into fp32 buffers."""
    from lorad.workers.kernels.lora_reference import lora_delta_reference, lora_shrink_reference
    gen = torch.Generator().manual_seed(seed)
    tables = make_tables(shape, gen, device, table_dtype)
    for num_rows in batch_sizes:
        row_slots = mixed_slots(num_rows, shape.num_slots, gen).to(device)
        x = torch.randn(num_rows, shape.in_features, generator=gen).to(device, x_dtype)
        outs = [torch.randn(num_rows, n, generator=gen).to(device) for n in shape.out_features]
        for out, ranks in zip(outs, tables.ranks):
            out[ranks[row_slots] == 0] = SENTINEL
        before = [out.clone() for out in outs]
        t = empty_t(shape, num_rows, device)
        run_kernels(x, outs, tables, row_slots, num_programs=num_programs, t=t)
        want_t = lora_shrink_reference(x, tables.a, tables.ranks, row_slots)
        want = lora_delta_reference(x, before, tables.a, tables.b, tables.ranks, tables.scales,
                                    row_slots)
        for i, (out, old, ranks) in enumerate(zip(outs, before, tables.ranks)):
            where = f"{num_rows} rows, table {i}"
            written = torch.zeros_like(t[i, :, 0], dtype=torch.bool)  # [num_rows, width]
            for row, t_row in want_t[i].items():
                written[row, :t_row.shape[0]] = True
            # Row by row into one tensor: a rank-1 row's t can be near 0, its error not.
            want_flat = torch.cat([t_row for t_row in want_t[i].values()] + [t.new_empty(0)])
            assert_close(f"{where}: t", t[i].sum(1)[written], want_flat)  # chunks summed
            if not t[i].transpose(0, 1)[:, ~written].isnan().all():
                raise AssertionError(f"{where}: the shrink wrote outside edited rows' ranks")
            edited = ranks[row_slots] != 0
            if not torch.equal(out[~edited], old[~edited]):
                raise AssertionError(f"{where}: a row of slot 0 or of an unedited slot changed")
            assert_close(f"{where}: out", out[edited], want[i][edited])
        buffers = [torch.full((num_rows, n), float("nan"), device=device)
                   for n in shape.out_features]
        run_kernels(x, buffers, tables, row_slots, num_programs=num_programs, deltas=True)
        want = lora_delta_reference(x, [torch.zeros_like(b) for b in buffers], tables.a,
                                    tables.b, tables.ranks, tables.scales, row_slots)
        for i, (buffer, ranks) in enumerate(zip(buffers, tables.ranks)):
            where = f"{num_rows} rows, table {i}, deltas alone"
            edited = ranks[row_slots] != 0
            if not buffer[~edited].isnan().all():
                raise AssertionError(f"{where}: a row of slot 0 or of an unedited slot written")
            assert_close(where, buffer[edited], want[i][edited])


def check_rows_independent_of_batch(device: str, shape: Shape, x_dtype: torch.dtype,
                                    num_rows: int, num_programs: tuple[int | None, ...],
                                    seed: int = 1) -> None:
    """A row's t and out bits depend only on its own x, slot and base output: the same probe rows
    alone, together, inside larger mixed batches at other positions, beside many rows of their
    own slot, with a graph's tile bound and with persistent programs looping over items."""
    gen = torch.Generator().manual_seed(seed)
    tables = make_tables(shape, gen, device)
    probe_slots = torch.tensor([shape.num_slots - 1, 1, 0, 2, shape.num_slots - 1])
    num_probes = probe_slots.shape[0]
    probe_x = torch.randn(num_probes, shape.in_features, generator=gen).to(x_dtype)
    probe_out = [torch.randn(num_probes, n, generator=gen) for n in shape.out_features]

    def run(filler_slots: torch.Tensor, positions: torch.Tensor, max_tiles: int | None,
            programs: int | None) -> list[torch.Tensor]:
        n = filler_slots.shape[0]
        x = torch.randn(n, shape.in_features, generator=gen).to(x_dtype)
        outs = [torch.randn(n, m, generator=gen) for m in shape.out_features]
        slots = filler_slots.clone()
        slots[positions], x[positions] = probe_slots, probe_x
        for out, probe in zip(outs, probe_out):
            out[positions] = probe
        outs = [out.to(device) for out in outs]
        t = empty_t(shape, n, device)
        run_kernels(x.to(device), outs, tables, slots.to(device), max_tiles, programs, t)
        positions = positions.to(device)
        return [out[positions].cpu() for out in outs] + [t[:, positions].cpu()]

    alone = run(torch.zeros(num_probes, dtype=torch.int64), torch.arange(num_probes), None, None)
    mixed = mixed_slots(num_rows, shape.num_slots, gen)
    variants = {
        "padded to 8 rows": (torch.zeros(8, dtype=torch.int64), torch.arange(num_probes), None,
                             None),
        f"{num_rows} mixed rows": (mixed, torch.randperm(num_rows, generator=gen)[:num_probes],
                                   None, None),
        f"{num_rows} rows of one slot": (torch.full((num_rows,), shape.num_slots - 1),
                                         torch.randperm(num_rows, generator=gen)[:num_probes],
                                         None, None),
    }
    for programs in num_programs:  # a graph's tile bound, each program looping over items
        variants[f"{num_rows} mixed rows, graph bound, {programs} programs"] = (
            mixed, torch.randperm(num_rows, generator=gen)[:num_probes], num_rows, programs)
    for name, (filler, positions, max_tiles, programs) in variants.items():
        got = run(filler, positions, max_tiles, programs)
        for i, (g, a) in enumerate(zip(got, alone)):
            if not torch.equal(g.nan_to_num(0.0), a.nan_to_num(0.0)):
                what = "t" if i == len(got) - 1 else f"out {i}"
                raise AssertionError(f"{what} of a probe row differs between alone and {name}")


def check_narrow_tables_read_exactly(device: str, shape: Shape, x_dtype: torch.dtype,
                                     table_dtype: torch.dtype, num_rows: int = 19) -> None:
    """Tables of bf16 (or fp16) factors give t, the in-place outputs and the delta buffers of fp32
    tables holding the same values, bit for bit: the kernels widen the factors exactly as they
    read them and do the rest in fp32."""
    gen = torch.Generator().manual_seed(4)
    narrow = make_tables(shape, gen, device, table_dtype)
    wide = Tables([a.float() for a in narrow.a], [b.float() for b in narrow.b], narrow.ranks,
                  narrow.scales)
    row_slots = mixed_slots(num_rows, shape.num_slots, gen).to(device)
    x = torch.randn(num_rows, shape.in_features, generator=gen).to(device, x_dtype)
    base = [torch.randn(num_rows, n, generator=gen).to(device, x_dtype)
            for n in shape.out_features]
    results = []
    for tables in (narrow, wide):
        outs = [b.clone() for b in base]
        t = run_kernels(x, outs, tables, row_slots, t=empty_t(shape, num_rows, device))
        buffers = [torch.full((num_rows, n), float("nan"), device=device)
                   for n in shape.out_features]
        run_kernels(x, buffers, tables, row_slots, deltas=True)
        results.append([t] + outs + buffers)
    if all(torch.equal(o, b) for o, b in zip(results[0][1:1 + len(base)], base)):
        raise AssertionError("the kernels changed no output: this check could not fail")
    for i, (got, want) in enumerate(zip(*results)):
        if not torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)):
            what = "t" if i == 0 else ("out" if i <= len(base) else "delta buffer")
            raise AssertionError(f"{table_dtype} tables: {what} {i} differs from fp32 tables of "
                                 f"the same values")


def check_chunk_groups_change_no_bit(device: str, shape: Shape, x_dtype: torch.dtype,
                                     num_rows: int = 21,
                                     targets: tuple[int, ...] = (1, 5, 40)) -> None:
    """The shrink's t is the same bits whether each work item takes one K chunk (target 0) or
    groups of several (a small target: all of a row's chunks in one item; larger: fewer per
    group, the last group shorter), with many programs or few looping over the items; and
    nothing outside edited rows' ranks is written."""
    from lorad.workers.kernels.lora_shrink import lora_shrink, num_k_chunks
    from lorad.workers.kernels.lora_tiles import LoraTiles, count_tiles
    if num_k_chunks(shape.in_features) < 3:
        raise AssertionError(f"{shape}: fewer than 3 K chunks, nothing to group")
    gen = torch.Generator().manual_seed(6)
    tables = make_tables(shape, gen, device)
    row_slots = mixed_slots(num_rows, shape.num_slots, gen).to(device)
    x = torch.randn(num_rows, shape.in_features, generator=gen).to(device, x_dtype)
    counts = torch.bincount(row_slots[row_slots != 0].cpu())
    tiles = LoraTiles.build(row_slots, count_tiles((int(c) for c in counts), 16))

    def shrink(target: int, programs: int | None) -> torch.Tensor:
        return lora_shrink(x, tables.a, tables.ranks, tiles, out=empty_t(shape, num_rows, device),
                           num_programs=programs, num_target_items=target)

    want = shrink(0, None)
    if want.isnan().all():
        raise AssertionError("the shrink wrote nothing: this check could not fail")
    for target in targets:
        for programs in (None, 3):
            got = shrink(target, programs)
            if not torch.equal(got.nan_to_num(12345.0), want.nan_to_num(12345.0)):
                raise AssertionError(f"target {target}, {programs or 'default'} programs: t "
                                     f"differs from one chunk per item")


def _expand_runner(device: str, shape: Shape, x_dtype: torch.dtype, num_rows: int, seed: int,
                   table_dtype: torch.dtype = torch.float32):
    """-> (expand, base) over one step's fixed inputs (random tables, mixed slots, x and its
    shrink): expand(deltas, **kwargs) runs lora_expand with those keyword arguments into fresh
    NaN delta buffers (deltas) or into copies of the base outputs `base`, and returns them."""
    from lorad.workers.kernels.lora_expand import lora_expand
    from lorad.workers.kernels.lora_shrink import lora_shrink
    from lorad.workers.kernels.lora_tiles import LoraTiles, count_tiles
    gen = torch.Generator().manual_seed(seed)
    tables = make_tables(shape, gen, device, table_dtype)
    row_slots = mixed_slots(num_rows, shape.num_slots, gen).to(device)
    x = torch.randn(num_rows, shape.in_features, generator=gen).to(device, x_dtype)
    base = [torch.randn(num_rows, n, generator=gen).to(device, x_dtype)
            for n in shape.out_features]
    counts = torch.bincount(row_slots[row_slots != 0].cpu())
    tiles = LoraTiles.build(row_slots, count_tiles((int(c) for c in counts), 16))
    t = lora_shrink(x, tables.a, tables.ranks, tiles)

    def expand(deltas: bool, **kwargs) -> list[torch.Tensor]:
        if deltas:
            outs = [torch.full((num_rows, n), float("nan"), device=device)
                    for n in shape.out_features]
        else:
            outs = [b.clone() for b in base]
        lora_expand(t, outs, tables.b, tables.ranks, tables.scales, tiles, deltas=deltas,
                    **kwargs)
        return outs

    return expand, base


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, NaN (an element never written) equal to NaN."""
    return torch.equal(got.nan_to_num(12345.0), want.nan_to_num(12345.0))


def check_block_groups_change_no_bit(device: str, shape: Shape, x_dtype: torch.dtype,
                                     num_rows: int = 21, targets: tuple[int, ...] = (1, 5, 40),
                                     block_n: int | None = None) -> None:
    """The expand's outputs are the same bits whether each work item takes one block of outputs
    (target 0) or groups of consecutive blocks (a small target: a table's blocks in one item;
    larger: fewer per group, the last shorter), with many programs or few looping over the
    items, into delta buffers and in place; and they write exactly where one block per item
    writes (NaN buffers keep their NaN elsewhere).
    block_n: the expand's block (None: its default), small to give tiny tables several."""
    from lorad.workers.kernels.configs import ExpandConfig
    config = ExpandConfig(block_n=block_n) if block_n else ExpandConfig()
    if max(-(-n // config.block_n) for n in shape.out_features) < 3:
        raise AssertionError(f"{shape}: fewer than 3 blocks of {config.block_n} outputs in every "
                             f"table, nothing to group")
    expand, _ = _expand_runner(device, shape, x_dtype, num_rows, seed=7)
    for deltas in (True, False):
        want = expand(deltas, config=config, num_target_items=0)
        if deltas and all(w.isnan().all() for w in want):
            raise AssertionError("the expand wrote nothing: this check could not fail")
        for target in targets:
            for programs in (None, 3):
                got = expand(deltas, config=config, num_target_items=target,
                             num_programs=programs)
                for i, (g, w) in enumerate(zip(got, want)):
                    if not _same_bits(g, w):
                        raise AssertionError(
                            f"target {target}, {programs or 'default'} programs, "
                            f"{'deltas' if deltas else 'in place'}: output {i} differs from one "
                            f"block per item")


def check_block_widths_change_no_bit(device: str, shape: Shape, x_dtype: torch.dtype,
                                     num_rows: int = 21, widths: tuple[int, ...] = (16, 32, 64),
                                     table_dtype: torch.dtype = torch.float32) -> None:
    """The expand's outputs are the same bits at every width of its blocks of outputs (the
    step's config picks one, configs.ExpandSteps), into delta buffers and in place, and it
    writes the same elements (NaN buffers keep their NaN elsewhere)."""
    from lorad.workers.kernels.lora_expand import ExpandConfig
    expand, base = _expand_runner(device, shape, x_dtype, num_rows, seed=11,
                                  table_dtype=table_dtype)
    for deltas in (True, False):
        want = expand(deltas, config=ExpandConfig(block_n=widths[0]))
        changed = (any(not w.isnan().all() for w in want) if deltas
                   else any(not torch.equal(w, b) for w, b in zip(want, base)))
        if not changed:
            raise AssertionError("the expand wrote nothing: this check could not fail")
        for width in widths[1:]:
            got = expand(deltas, config=ExpandConfig(block_n=width))
            for i, (g, w) in enumerate(zip(got, want)):
                if not _same_bits(g, w):
                    raise AssertionError(
                        f"{'deltas' if deltas else 'in place'}: output {i} at blocks of {width} "
                        f"outputs differs from blocks of {widths[0]}")


def check_exact_dot_keeps_every_bit(device: str) -> None:
    """exact_dot's split into bf16 terms loses nothing: an fp32 (3 terms) or fp16 (2 terms) tile
    times a permutation matrix comes back bit for bit on either side of the product, where one
    term fewer does not (so the check can fail)."""
    from tests.kernels.exact_dot_kernel import exact_dot_kernel
    gen = torch.Generator().manual_seed(8)
    perm = torch.eye(16)[torch.randperm(16, generator=gen)]
    for dtype, parts in ((torch.float32, 3), (torch.float16, 2)):
        values = (torch.randn(16, 16, generator=gen) * 3.0).to(dtype)
        for side in ("a", "b"):
            for used in (parts, parts - 1):
                if side == "a":
                    a, b, want = values, perm.bfloat16(), values.float() @ perm
                    a_parts, b_parts = used, 1
                else:
                    a, b, want = perm.bfloat16(), values, perm @ values.float()
                    a_parts, b_parts = 1, used
                out = torch.full((16, 16), float("nan"), device=device)
                exact_dot_kernel[(1,)](a.to(device), b.to(device), out, A_PARTS=a_parts,
                                       B_PARTS=b_parts)
                same = torch.equal(out.cpu(), want)
                if used == parts and not same:
                    raise AssertionError(f"{dtype} on side {side}: {parts} bf16 terms lost bits")
                if used < parts and same:
                    raise AssertionError(f"{dtype} on side {side}: {used} bf16 terms kept every "
                                         f"bit: this check could not fail")


def check_no_adapter_rows(device: str, shape: Shape, x_dtype: torch.dtype) -> None:
    """Only slot-0 rows, kernels launched anyway (a CUDA graph's mode): nothing is written."""
    gen = torch.Generator().manual_seed(2)
    tables = make_tables(shape, gen, device)
    num_rows = 12
    x = torch.randn(num_rows, shape.in_features, generator=gen).to(device, x_dtype)
    outs = [torch.randn(num_rows, n, generator=gen).to(device) for n in shape.out_features]
    before = [out.clone() for out in outs]
    t = empty_t(shape, num_rows, device)
    slots = torch.zeros(num_rows, dtype=torch.int64, device=device)
    run_kernels(x, outs, tables, slots, max_tiles=num_rows, t=t)
    if not t.isnan().all() or not all(torch.equal(o, b) for o, b in zip(outs, before)):
        raise AssertionError("a kernel wrote with no adapter rows")


def fill_lora_slots(lora, tables: Tables, i: int) -> None:
    """Give a LoraSlots table i's factors (the poisoned padding zeroed: LoraSlots pads with
    zeros)."""
    lora.lora_a.copy_(tables.a[i].nan_to_num(0.0))
    b = tables.b[i].clone()
    for slot, rank in enumerate(tables.ranks[i].tolist()):
        b[slot, :, rank:] = 0.0
    lora.lora_b.copy_(b)
    lora.ranks = tables.ranks[i].tolist()
    lora.scales = tables.scales[i].tolist()
    lora.rank_table.copy_(tables.ranks[i])
    lora.scale_table.copy_(tables.scales[i])


def check_mixed_strengths(device: str, shape: Shape, x_dtype: torch.dtype,
                          num_rows: int = 19) -> None:
    """Rows of several request strengths (0, 0.5, 1, 2, 4) of the same slots in one launch: each
    row equals the reference with its strength, in place and as deltas alone; rows at 1.0 keep
    the bits of a launch without strengths, and rows at 0 keep their base output's."""
    from lorad.workers.kernels.lora_reference import lora_delta_reference
    gen = torch.Generator().manual_seed(11)
    tables = make_tables(shape, gen, device, torch.float32)
    row_slots = mixed_slots(num_rows, shape.num_slots, gen).to(device)
    choices = torch.tensor([0.0, 0.5, 1.0, 2.0, 4.0])
    strengths = choices[torch.randint(0, len(choices), (num_rows,), generator=gen)].to(device)
    x = torch.randn(num_rows, shape.in_features, generator=gen).to(device, x_dtype)
    before = [torch.randn(num_rows, n, generator=gen).to(device) for n in shape.out_features]
    for deltas in (False, True):
        plain = [torch.zeros_like(o) if deltas else o.clone() for o in before]
        mixed = [torch.zeros_like(o) if deltas else o.clone() for o in before]
        run_kernels(x, plain, tables, row_slots, deltas=deltas)
        run_kernels(x, mixed, tables, row_slots, deltas=deltas, row_strengths=strengths)
        base = [torch.zeros_like(o) for o in before] if deltas else before
        want = lora_delta_reference(x, base, tables.a, tables.b, tables.ranks, tables.scales,
                                    row_slots, strengths)
        for i, (p, m, w, ranks) in enumerate(zip(plain, mixed, want, tables.ranks)):
            where = f"table {i}, deltas={deltas}"
            edited = ranks[row_slots] != 0
            assert_close(f"{where}: mixed strengths", m[edited], w[edited])
            at_one = edited & (strengths == 1.0)
            if not _same_bits(m[at_one], p[at_one]):
                raise AssertionError(f"{where}: a row at strength 1.0 changed bits")
            at_zero = edited & (strengths == 0.0)
            if not deltas and not _same_bits(m[at_zero], base[i][at_zero]):
                raise AssertionError(f"{where}: a row at strength 0 changed its base output")


def check_layer_path(device: str, shape: Shape, x_dtype: torch.dtype,
                     table_dtype: torch.dtype = torch.float32,
                     strengths: tuple[float, ...] | None = None) -> None:
    """add_lora_deltas and LoraSlots.add_delta on the kernel path equal the torch path (the CPU's,
    on CPU copies), for bf16 and fp32 outputs, with a projection no adapter edits beside them;
    launch_always gives the same bits as launching by the chunk list. strengths: each chunk's
    request strength (None: the chunks carry none, 1.0)."""
    from lorad.workers.lora import LoraSlots, add_lora_deltas
    from lorad.workers.lora_rows import LoraRows
    gen = torch.Generator().manual_seed(3)
    tables = make_tables(shape, gen, "cpu", table_dtype)
    loras = {}
    for dev in ("cpu", device):
        loras[dev] = []
        for i, (n, max_rank) in enumerate(zip(shape.out_features, shape.max_ranks)):
            lora = LoraSlots(shape.num_slots, max_rank, shape.in_features, n,
                             (0, shape.in_features), (0, n), torch.device(dev), table_dtype)
            fill_lora_slots(lora, tables, i)
            loras[dev].append(lora)
        loras[dev].insert(1, None)  # a projection no adapter edits
    # Chunks: (tokens, start, block table, sample, slot); a prompt chunk and decodes.
    slots = [shape.num_slots - 1, 0, 1, shape.num_slots - 1, 2, 3]
    chunks = [([5] * (9 if i == 0 else 1), 0, [i], True, slot) for i, slot in enumerate(slots)]
    if strengths is not None:
        chunks = [chunk + (x,) for chunk, x in zip(chunks, strengths)]
    batches = {dev: ForwardBatch.build(chunks, 16, dev) for dev in ("cpu", device)}
    num_rows = batches["cpu"].input_ids.shape[0]
    x = torch.randn(num_rows, shape.in_features, generator=gen).to(x_dtype)
    out_dims = [shape.out_features[0]] + list(shape.out_features)
    for out_dtype in (x_dtype, torch.float32):
        outs = [torch.randn(num_rows, n, generator=gen).to(out_dtype) for n in out_dims]
        rows = LoraRows.from_batch(batches["cpu"], use_kernels=False)
        want = add_lora_deltas(loras["cpu"], [o.clone() for o in outs], x, rows)
        got = {}
        for always in (False, True):
            rows = LoraRows.from_batch(batches[device], launch_always=always, use_kernels=True)
            got[always] = [o.cpu() for o in add_lora_deltas(
                loras[device], [o.to(device, copy=True) for o in outs], x.to(device), rows)]
        single = loras[device][0].add_delta(outs[0].to(device, copy=True), x.to(device), rows)
        if not torch.equal(single.cpu(), got[True][0]):
            raise AssertionError("add_delta differs from add_lora_deltas on the kernel path")
        for i, (g, w, o) in enumerate(zip(got[False], want, outs)):
            where = f"projection {i}, out {out_dtype}"
            if not torch.equal(g, got[True][i]):
                raise AssertionError(f"{where}: launch_always changed bits")
            edited = w != o
            if not torch.equal(g[~edited], o[~edited]):
                raise AssertionError(f"{where}: an element the torch path leaves was changed")
            rel = 1e-4 if out_dtype == torch.float32 else 1e-2  # bf16: one rounding apart
            assert_close(where, g.float(), w.float(), rel)


CHECKS = {
    **{f"reference_{name}_{dt}": (check_matches_reference,
                                  dict(shape=shape, x_dtype=d, batch_sizes=(1, 8, 19)))
       for name, shape in CPU_SHAPES.items() for dt, d in X_DTYPES.items()},
    "reference_qkv_bf16_looping": (check_matches_reference,
                                   dict(shape=CPU_SHAPES["qkv"], x_dtype=torch.bfloat16,
                                        batch_sizes=(21,), num_programs=3)),
    "batch_invariance_qkv_bf16": (check_rows_independent_of_batch,
                                  dict(shape=CPU_SHAPES["qkv"], x_dtype=torch.bfloat16,
                                       num_rows=21, num_programs=(2,))),
    "batch_invariance_one_fp32": (check_rows_independent_of_batch,
                                  dict(shape=CPU_SHAPES["one"], x_dtype=torch.float32,
                                       num_rows=21, num_programs=(2,))),
    "batch_invariance_long_k_bf16": (check_rows_independent_of_batch,
                                     dict(shape=CPU_SHAPES["long_k"], x_dtype=torch.bfloat16,
                                          num_rows=21, num_programs=(2,))),
    "no_adapter_rows": (check_no_adapter_rows, dict(shape=CPU_SHAPES["pair"],
                                                    x_dtype=torch.bfloat16)),
    "layer_path_bf16": (check_layer_path, dict(shape=CPU_SHAPES["qkv"], x_dtype=torch.bfloat16)),
    "layer_path_strengths": (check_layer_path, dict(shape=CPU_SHAPES["qkv"],
                                                    x_dtype=torch.bfloat16,
                                                    strengths=(2.0, 1.0, 0.5, 0.0, 1.0, 4.0))),
    "mixed_strengths_qkv_bf16": (check_mixed_strengths, dict(shape=CPU_SHAPES["qkv"],
                                                             x_dtype=torch.bfloat16)),
    "mixed_strengths_one_fp32": (check_mixed_strengths, dict(shape=CPU_SHAPES["one"],
                                                             x_dtype=torch.float32)),
    "chunk_groups_long_k": (check_chunk_groups_change_no_bit,
                            dict(shape=CPU_SHAPES["long_k"], x_dtype=torch.bfloat16)),
    "exact_dot": (check_exact_dot_keeps_every_bit, {}),
    "block_groups_qkv": (check_block_groups_change_no_bit,
                         dict(shape=CPU_SHAPES["qkv"], x_dtype=torch.bfloat16, block_n=16)),
    "block_widths_qkv": (check_block_widths_change_no_bit,
                         dict(shape=CPU_SHAPES["qkv"], x_dtype=torch.bfloat16)),
    "block_widths_pair_bf16_tables": (check_block_widths_change_no_bit,
                                      dict(shape=CPU_SHAPES["pair"], x_dtype=torch.bfloat16,
                                           table_dtype=torch.bfloat16)),
    "reference_qkv_bf16_tables": (check_matches_reference,
                                  dict(shape=CPU_SHAPES["qkv"], x_dtype=torch.bfloat16,
                                       batch_sizes=(1, 19), table_dtype=torch.bfloat16)),
    "narrow_tables_exact_bf16": (check_narrow_tables_read_exactly,
                                 dict(shape=CPU_SHAPES["qkv"], x_dtype=torch.bfloat16,
                                      table_dtype=torch.bfloat16)),
    "narrow_tables_exact_fp16": (check_narrow_tables_read_exactly,
                                 dict(shape=CPU_SHAPES["long_k"], x_dtype=torch.float16,
                                      table_dtype=torch.float16)),
    "layer_path_bf16_tables": (check_layer_path, dict(shape=CPU_SHAPES["pair"],
                                                      x_dtype=torch.bfloat16,
                                                      table_dtype=torch.bfloat16)),
}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
