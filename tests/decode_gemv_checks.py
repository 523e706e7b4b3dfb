"""Checks of the decode GEMV kernel (lorad/workers/kernels/decode_gemv.py) against plain torch,
on any device.

tests/unit/test_triton_interpreted.py runs them on CPU tensors under TRITON_INTERPRET=1 in a
subprocess, on tiny shapes with a tiny tile and with the default one; tests/gpu/
test_decode_gemv_gpu.py calls them on CUDA at Llama-3-8B's projection shapes. Each check takes
fresh random inputs and raises AssertionError naming what differed: the result against a float64
reference (within the fp32 sum's error bound, and bit-exact on integer-valued inputs, whose sums
fp32 holds exactly), a row's bits across batch sizes, weight views, and the inputs it refuses.
The kernel module is imported inside the checks, after the interpreter is set.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from tests.lora_kernel_checks import Shape, assert_close, make_tables, mixed_slots
from tests.triton_interpreter import run_checks

# (N, K): N never a multiple of the block; K a multiple of the small tile's block_k (64) only,
# of both tiles' (256), and of neither (100: the masked path).
CPU_SHAPES = {"n40_k64": (40, 64), "n100_k192": (100, 192), "n48_k256": (48, 256),
              "n70_k100": (70, 100)}
GPU_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336)}
CPU_BATCHES = (1, 3, 16, 32)
OUT_DTYPES = {"model": None, "fp32": torch.float32}


@dataclass(frozen=True)
class LoraShape:
    n: int  # w's outputs
    k: int  # w's inputs
    tables: tuple[tuple[int, int, int], ...]  # (n_start, n_end, max_rank) of each table
    num_slots: int  # slot 0 (no adapter) included


# For the tile "lora" (block_n 16): three tables with ranks to 20 across slots and K in 4 chunks
# of the small shrink's 64; a table absent (q and v edited, k not) and the last ending at N, not
# at a multiple of block_n; one table over all of w.
LORA_CPU_SHAPES = {"qkv": LoraShape(64, 200, ((0, 32, 20), (32, 48, 8), (48, 64, 3)), 6),
                   "k_absent": LoraShape(70, 64, ((0, 32, 16), (48, 70, 5)), 5),
                   "one": LoraShape(40, 192, ((0, 40, 6),), 4)}
# Llama-3-8B's projections at rank 16 with 64 adapters.
LORA_GPU_SHAPES = {
    "qkv": LoraShape(6144, 4096, ((0, 4096, 16), (4096, 5120, 16), (5120, 6144, 16)), 65),
    "gate_up": LoraShape(28672, 4096, ((0, 14336, 16), (14336, 28672, 16)), 65),
    "o": LoraShape(4096, 4096, ((0, 4096, 16),), 65),
    "down": LoraShape(4096, 14336, ((0, 4096, 16),), 65)}


def _config(tile: str, shape_name: str = "qkv"):
    from lorad.workers.kernels.configs import GemvConfig, GemvModelTiles
    # "model": the model's tile for the projection the shape is named after (GemvModelTiles;
    # other shapes, o and down among them, which the model leaves to cuBLAS, get q/k/v's).
    # The interpreter runs programs one after another: a small tile keeps its loops short.
    # "rows16": the model's 16 rows of x per tile, with a small tile's loops.
    tiles = GemvModelTiles()
    model = tiles.gate_up if shape_name == "gate_up" else tiles.qkv
    return {"default": GemvConfig(), "model": model,
            "small": GemvConfig(block_n=32, block_k=64, num_warps=1, num_stages=2),
            "rows16": GemvConfig(block_m=16, block_n=32, block_k=32, num_warps=1,
                                 num_stages=2),
            "lora": GemvConfig(block_n=16, block_k=64, num_warps=1, num_stages=2)}[tile]


def _inputs(gen: torch.Generator, num_rows: int, n: int, k: int, dtype: torch.dtype,
            device: str, kind: str = "normal") -> tuple[torch.Tensor, torch.Tensor]:
    """x: [num_rows, k], w: [n, k], drawn on the device. normal: random normal, w scaled by
    1 / sqrt(k); integers: both in [-3, 3], so every fp32 sum is exact; one_hot: x normal, each
    row of w one +-1 at a random column, so out[:, i] = +-x[:, j] exactly (all 24 bits of an
    fp32 x)."""
    if kind == "integers":
        x = torch.randint(-3, 4, (num_rows, k), generator=gen, device=device).float()
        w = torch.randint(-3, 4, (n, k), generator=gen, device=device).float()
    else:
        x = torch.randn(num_rows, k, generator=gen, device=device)
        w = torch.zeros(n, k, device=device)
        if kind == "normal":
            w = torch.randn(n, k, generator=gen, device=device) / k ** 0.5
        else:
            signs = torch.randint(0, 2, (n,), generator=gen, device=device).float() * 2 - 1
            w[torch.arange(n, device=device),
              torch.randint(0, k, (n,), generator=gen, device=device)] = signs
    return x.to(dtype), w.to(dtype)


def _assert_close(name: str, got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within the error bound of an fp32 sum of K products, K * eps(fp32) * sum |x w| (twice the
    worst case of K + 1 roundings), plus one rounding to the output dtype."""
    x64, w64 = x.double(), w.double()
    want = x64 @ w64.T
    bound = x.shape[1] * torch.finfo(torch.float32).eps * (x64.abs() @ w64.abs().T)
    if got.dtype != torch.float32:
        bound += torch.finfo(got.dtype).eps * want.abs()
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
    if not torch.isfinite(got).all():
        raise AssertionError(f"{name}: {int((~torch.isfinite(got)).sum())} elements not finite")
    excess = ((got.double() - want).abs() - bound).max().item()
    if excess > 0:
        raise AssertionError(f"{name}: off the reference by {excess:.3g} past the error bound")


def check_matches_reference(device: str, dtype: torch.dtype = torch.bfloat16, out: str = "model",
                            shapes: dict | None = None, batches: tuple[int, ...] = CPU_BATCHES,
                            tile: str = "small") -> None:
    """decode_matmul against x w^T in float64: within the fp32 sum's error bound on random
    normal inputs; bit-equal to the exact result rounded once on integer-valued inputs (a lost or
    repeated product shows) and with one +-1 per row of w (out[:, n] = +-x[:, j]: a wrong column
    shows, and so would fp32 operands cut to TF32's 11 bits)."""
    from lorad.workers.kernels.decode_gemv import decode_matmul
    gen = torch.Generator(device).manual_seed(3)
    out_dtype = OUT_DTYPES[out]
    for shape_name, (n, k) in (shapes or CPU_SHAPES).items():
        for kind in ("normal", "integers", "one_hot"):
            x_all, w = _inputs(gen, max(batches), n, k, dtype, device, kind)
            config = _config(tile, shape_name)
            for num_rows in (b for b in batches if b <= config.block_m):
                where = f"{shape_name} {dtype} out {out} M={num_rows} tile {config} {kind} inputs"
                x = x_all[:num_rows]
                got = decode_matmul(x, w, out_dtype, config=config)
                if got.dtype != (out_dtype or dtype):
                    raise AssertionError(f"{where}: dtype {got.dtype}")
                if kind == "normal":
                    _assert_close(where, got, x, w)
                    continue
                want = (x.double() @ w.double().T).to(got.dtype)
                if not torch.equal(got, want):
                    raise AssertionError(f"{where}: {int((got != want).sum())} elements differ "
                                         f"from the exact result")


def check_rows_independent_of_batch(device: str, dtype: torch.dtype = torch.bfloat16,
                                    out: str = "model", shapes: dict | None = None,
                                    batches: tuple[int, ...] = (1, 5, 16, 32),
                                    tile: str = "small") -> None:
    """A row's bits alone equal its bits among 5, 16 or 32 rows, whatever the other rows hold, and
    rows past the batch in x's buffer (NaN here) are never read."""
    from lorad.workers.kernels.decode_gemv import decode_matmul
    gen = torch.Generator(device).manual_seed(5)
    out_dtype = OUT_DTYPES[out]
    for shape_name, (n, k) in (shapes or CPU_SHAPES).items():
        config = _config(tile, shape_name)
        most = config.block_m  # the tile's rows: the widest batch
        x, w = _inputs(gen, most, n, k, dtype, device)
        full = decode_matmul(x, w, out_dtype, config=config)
        for num_rows in (b for b in batches if b <= most):
            buffer = torch.full_like(x, float("nan"))
            buffer[:num_rows] = x[:num_rows]
            got = decode_matmul(buffer[:num_rows], w, out_dtype, config=config)
            if not torch.equal(got, full[:num_rows]):
                raise AssertionError(f"{shape_name} {dtype} out {out}: the first {num_rows} "
                                     f"rows differ from the same rows among {most}")
        for row in (0, 4, most - 1):
            other = torch.randn(3, k, generator=gen, device=device).to(dtype)
            mixed = torch.cat([other[:1], x[row:row + 1], other[1:]])
            for got, how in ((decode_matmul(x[row:row + 1], w, out_dtype, config=config),
                              "alone"),
                             (decode_matmul(mixed, w, out_dtype, config=config)[1:2],
                              "among other rows")):
                if not torch.equal(got, full[row:row + 1]):
                    raise AssertionError(f"{shape_name} {dtype} out {out}: row {row} {how} "
                                         f"differs from row {row} among {most}")


def check_views(device: str, dtype: torch.dtype = torch.bfloat16, n: int = 70, k: int = 64,
                num_rows: int = 3, tile: str = "small") -> None:
    """w as a slice of a larger matrix's rows or of its columns, and x with strided rows, give
    the bits of packed copies, within the reference's bound."""
    from lorad.workers.kernels.decode_gemv import decode_matmul
    gen = torch.Generator(device).manual_seed(7)
    config = _config(tile)
    x_wide, big = _inputs(gen, num_rows, n + 20, k + 16, dtype, device)  # [M, k+16], [n+20, k+16]
    x = x_wide[:, :k].contiguous()
    cases = {"w a row slice": (x, big[:, :k].contiguous()[10:10 + n]),  # 10 rows into storage
             "w a column slice": (x, big[:n, 8:8 + k]),  # rows of stride k + 16
             "x strided": (x_wide[:, 16:], big[:n, :k].contiguous())}
    for name, (x, w) in cases.items():
        got = decode_matmul(x, w, config=config)
        want = decode_matmul(x.contiguous(), w.contiguous(), config=config)
        if not torch.equal(got, want):
            raise AssertionError(f"{name} {dtype}: the result differs from packed copies'")
        _assert_close(f"{name} {dtype}", got, x, w)


def check_refusals(device: str) -> None:
    """Empty batches give empty results; inputs the kernel does not take raise ValueError (and
    supports() says False); bad tile configs raise ValueError."""
    from lorad.workers.kernels.decode_gemv import (MAX_ROWS, GemvConfig, decode_matmul,
                                                   supports)
    bf16 = torch.bfloat16
    w = torch.randn(40, 32).to(dtype=bf16, device=device)
    x = torch.randn(2, 32).to(dtype=bf16, device=device)
    for out_dtype in (None, torch.float32):
        got = decode_matmul(x[:0], w, out_dtype)
        if got.shape != (0, 40) or got.dtype != (out_dtype or bf16):
            raise AssertionError(f"an empty batch gave {tuple(got.shape)} {got.dtype}")
    if not supports(x, w) or not supports(x, w, torch.float32):
        raise AssertionError("supports() refuses a good input")
    # name -> (x, w, out_dtype, words the error must hold)
    bad = {"rows over MAX_ROWS": (torch.zeros(MAX_ROWS + 1, 32, dtype=bf16, device=device), w,
                                  None, "block_m 32"),
           "K differs": (x[:, :16], w, None, "columns (K)"),
           "dtypes differ": (x, w.float(), None, "share a dtype"),
           "out_dtype fp16 for bf16": (x, w, torch.float16, "out_dtype"),
           "integer dtype": (x.to(torch.int32), w.to(torch.int32), None, "share a dtype"),
           "w's columns strided": (x[:, :16], w[:, ::2], None, "rows must be contiguous"),
           "x 1-D": (x[0], w, None, "2-D")}
    for name, (xb, wb, out_dtype, words) in bad.items():
        if supports(xb, wb, out_dtype):
            raise AssertionError(f"supports() takes a bad input: {name}")
        try:
            decode_matmul(xb, wb, out_dtype)
        except ValueError as exc:
            if words not in str(exc):
                raise AssertionError(f"{name}: the error does not say {words!r}: {exc}")
            continue
        raise AssertionError(f"decode_matmul took a bad input: {name}")
    narrow = GemvConfig(block_m=16)
    if supports(torch.zeros(17, 32, dtype=bf16, device=device), w, config=narrow):
        raise AssertionError("supports() takes 17 rows for a tile of 16")
    for fields in (dict(block_n=24), dict(block_k=8), dict(num_warps=3), dict(num_stages=0),
                   dict(block_m=8), dict(block_m=64)):
        try:
            GemvConfig(**fields)
        except ValueError:
            continue
        raise AssertionError(f"GemvConfig took {fields}")


def make_lora_case(shape: LoraShape, gen: torch.Generator, device: str):
    """-> (factor tables from lora_kernel_checks.make_tables, poisoned beyond each slot's rank; the
    GemvLoraTables over them)."""
    from lorad.workers.kernels.decode_gemv import GemvLoraTable
    tables = make_tables(Shape(shape.num_slots, shape.k, tuple(e - s for s, e, _ in shape.tables),
                               tuple(r for _, _, r in shape.tables)), gen, device)
    return tables, tuple(GemvLoraTable(b, ranks, scales, n_start, n_end)
                         for b, ranks, scales, (n_start, n_end, _) in
                         zip(tables.b, tables.ranks, tables.scales, shape.tables))


def run_shrink(x: torch.Tensor, tables, row_slots: torch.Tensor, tile: str):
    """-> (t from lora_shrink, NaN where it writes nothing; the tiles), K chunks of 64 on the
    interpreter's tile (so tiny K makes several), the default's 512 otherwise."""
    from lorad.workers.kernels.lora_shrink import ShrinkConfig, lora_shrink
    from lorad.workers.kernels.lora_tiles import LoraTiles, count_tiles
    config = ShrinkConfig(block_k=32, k_chunk=64) if tile == "lora" else ShrinkConfig()
    counts = torch.bincount(row_slots[row_slots != 0].cpu())
    tiles = LoraTiles.build(row_slots, count_tiles((int(c) for c in counts), 16))
    num_chunks = -(-x.shape[1] // config.k_chunk)
    t = torch.full((len(tables.a), x.shape[0], num_chunks, max(a.shape[1] for a in tables.a)),
                   float("nan"), device=x.device)
    return lora_shrink(x, tables.a, tables.ranks, tiles, out=t, config=config), tiles


def check_lora_matches_expand(device: str, dtype: torch.dtype = torch.bfloat16,
                              out: str = "model", shapes: dict | None = None,
                              batches: tuple[int, ...] = (1, 5, 32), tile: str = "lora") -> None:
    """The epilogue against lora_expand adding into the plain GEMV's output: elements of rows
    whose slot a table does not edit (slot 0 among them) and of columns no table covers keep the
    plain GEMV's bits; the rest match within fp32 rounding (a bf16 out: one rounding apart).
    Rank padding of B and t is NaN, and so are x and row_slots past the batch: never read."""
    from lorad.workers.kernels.decode_gemv import GemvLora, decode_matmul
    from lorad.workers.kernels.lora_expand import lora_expand
    gen = torch.Generator().manual_seed(11)
    out_dtype, config = OUT_DTYPES[out], _config(tile)
    for shape_name, shape in (shapes or LORA_CPU_SHAPES).items():
        tables, lora_tables = make_lora_case(shape, gen, device)
        x_all, w = _inputs(torch.Generator(device).manual_seed(12), max(batches), shape.n,
                           shape.k, dtype, device)
        for num_rows in batches:
            where = f"{shape_name} {dtype} out {out} M={num_rows}"
            slots = mixed_slots(num_rows, shape.num_slots, gen)
            slots[0] = shape.num_slots - 1  # every table's largest rank
            if num_rows > 1:
                slots[-1] = 0
            slot_buffer = torch.full((num_rows + 3,), 1 << 40, dtype=torch.int64)
            slot_buffer[:num_rows] = slots
            slot_buffer = slot_buffer.to(device)
            x_buffer = torch.full_like(x_all, float("nan"))
            x_buffer[:num_rows] = x_all[:num_rows]
            x = x_buffer[:num_rows]
            t, tiles = run_shrink(x, tables, slot_buffer[:num_rows], tile)
            base = decode_matmul(x, w, out_dtype, config)
            want = base.clone()
            lora_expand(t, [want[:, s:e] for s, e, _ in shape.tables], tables.b, tables.ranks,
                        tables.scales, tiles)
            lora = GemvLora(t, slot_buffer[:num_rows], lora_tables)
            got = decode_matmul(x, w, out_dtype, config, lora=lora)
            edited = torch.zeros(num_rows, shape.n, dtype=torch.bool, device=device)
            for (s, e, _), ranks in zip(shape.tables, tables.ranks):
                edited[:, s:e] = (ranks[slot_buffer[:num_rows]] > 0)[:, None]
            if got.dtype != base.dtype or not torch.equal(got[~edited], base[~edited]):
                raise AssertionError(f"{where}: an element with no delta differs from the plain "
                                     f"GEMV's")
            if not edited.any():
                raise AssertionError(f"{where}: no element edited, nothing checked")
            rel = 1e-4 if got.dtype == torch.float32 else 1e-2  # bf16: one rounding apart
            assert_close(where, got[edited].float(), want[edited].float(), rel)


def check_lora_rows_independent(device: str, dtype: torch.dtype = torch.bfloat16,
                                out: str = "model", shapes: dict | None = None,
                                batches: tuple[int, ...] = (1, 5, 16), tile: str = "lora") -> None:
    """A row's bits with LoRA among MAX_ROWS rows equal its bits among the first 1, 5 or 16
    rows (t a view of the whole batch's), and alone, and among rows of other slots and ranks
    (one slot of the largest ranks, or none) at other positions."""
    from lorad.workers.kernels.decode_gemv import MAX_ROWS, GemvLora, decode_matmul
    gen = torch.Generator().manual_seed(13)
    out_dtype, config = OUT_DTYPES[out], _config(tile)
    for shape_name, shape in (shapes or LORA_CPU_SHAPES).items():
        tables, lora_tables = make_lora_case(shape, gen, device)
        x, w = _inputs(torch.Generator(device).manual_seed(14), MAX_ROWS, shape.n, shape.k,
                       dtype, device)
        slots = mixed_slots(MAX_ROWS, shape.num_slots, gen).to(device)
        t, _ = run_shrink(x, tables, slots, tile)
        full = decode_matmul(x, w, out_dtype, config, GemvLora(t, slots, lora_tables))
        for num_rows in batches:
            got = decode_matmul(x[:num_rows], w, out_dtype, config,
                                GemvLora(t[:, :num_rows], slots[:num_rows], lora_tables))
            if not torch.equal(got, full[:num_rows]):
                raise AssertionError(f"{shape_name} {dtype} out {out}: the first {num_rows} "
                                     f"rows differ from the same rows among {MAX_ROWS}")
        for row in (0, 7, MAX_ROWS - 1):
            for filler_slot, num_rows, at in ((shape.num_slots - 1, 20, 13), (0, 4, 0),
                                              (None, 1, 0)):
                fill_x = torch.randn(num_rows, shape.k, generator=gen).to(device, dtype)
                fill_t = torch.randn(t.shape[0], num_rows, *t.shape[2:], generator=gen)
                fill_slots = torch.full((num_rows,), filler_slot or 0, dtype=torch.int64)
                fill_x[at], fill_t[:, at], fill_slots[at] = x[row], t[:, row].cpu(), slots[row]
                got = decode_matmul(fill_x, w, out_dtype, config,
                                    GemvLora(fill_t.to(device), fill_slots.to(device),
                                             lora_tables))[at]
                if not torch.equal(got, full[row]):
                    how = "alone" if filler_slot is None else f"among slot {filler_slot}'s rows"
                    raise AssertionError(f"{shape_name} {dtype} out {out}: row {row} (slot "
                                         f"{int(slots[row])}) {how} differs from the row among "
                                         f"{MAX_ROWS}")


def check_lora_refusals(device: str) -> None:
    """GemvLora inputs that do not fit raise ValueError naming the fault."""
    from dataclasses import replace

    from lorad.workers.kernels.decode_gemv import GemvLora, decode_matmul
    gen = torch.Generator().manual_seed(15)
    shape = LORA_CPU_SHAPES["qkv"]
    tables, lora_tables = make_lora_case(shape, gen, device)
    x, w = _inputs(torch.Generator(device).manual_seed(16), 3, shape.n, shape.k,
                   torch.bfloat16, device)
    slots = torch.tensor([1, 0, 5], device=device)
    t, _ = run_shrink(x, tables, slots, "lora")
    first, *rest = lora_tables
    bad = {"a boundary off block_n": (GemvLora(t, slots, (replace(first, n_end=24, b=first.b[
               :, :24].contiguous()),) + tuple(rest)), "multiple of block_n"),
           "t of another batch": (GemvLora(t[:, :2], slots, lora_tables), "another batch"),
           "tables overlapping": (GemvLora(t, slots, (first, replace(rest[0], n_start=16),
                                                      rest[1])), "disjoint"),
           "b's width": (GemvLora(t, slots, (replace(first, b=first.b[:, :16].contiguous()),)
                                  + tuple(rest)), "b must be"),
           "int32 slots": (GemvLora(t, slots.int(), lora_tables), "int64"),
           "four tables": (GemvLora(t, slots, lora_tables + (rest[0],)), "1 to 3 tables")}
    for name, (lora, words) in bad.items():
        try:
            decode_matmul(x, w, config=_config("lora"), lora=lora)
        except ValueError as exc:
            if words not in str(exc):
                raise AssertionError(f"{name}: the error does not say {words!r}: {exc}")
            continue
        raise AssertionError(f"decode_matmul took a bad GemvLora: {name}")


CHECKS = {
    "matches_reference_bf16": (check_matches_reference, dict(dtype=torch.bfloat16)),
    "matches_reference_bf16_fp32_out": (check_matches_reference,
                                        dict(dtype=torch.bfloat16, out="fp32")),
    "matches_reference_fp16": (check_matches_reference, dict(dtype=torch.float16)),
    "matches_reference_fp32": (check_matches_reference, dict(dtype=torch.float32)),
    "matches_reference_default_tile": (check_matches_reference,
                                       dict(dtype=torch.bfloat16, tile="default",
                                            batches=(1, 32))),
    "matches_reference_rows16": (check_matches_reference,
                                 dict(dtype=torch.bfloat16, tile="rows16")),
    "matches_reference_rows16_fp32_out": (check_matches_reference,
                                          dict(dtype=torch.bfloat16, out="fp32",
                                               tile="rows16")),
    "rows_independent_of_batch_bf16": (check_rows_independent_of_batch,
                                       dict(dtype=torch.bfloat16)),
    "rows_independent_of_batch_rows16": (check_rows_independent_of_batch,
                                         dict(dtype=torch.bfloat16, tile="rows16")),
    "rows_independent_of_batch_fp32_out": (check_rows_independent_of_batch,
                                           dict(dtype=torch.bfloat16, out="fp32")),
    "rows_independent_of_batch_fp32": (check_rows_independent_of_batch,
                                       dict(dtype=torch.float32)),
    "views_bf16": (check_views, dict(dtype=torch.bfloat16)),
    "refusals": (check_refusals, dict()),
    "lora_matches_expand_bf16": (check_lora_matches_expand, dict(dtype=torch.bfloat16)),
    "lora_matches_expand_fp32_out": (check_lora_matches_expand,
                                     dict(dtype=torch.bfloat16, out="fp32")),
    "lora_matches_expand_fp32": (check_lora_matches_expand, dict(dtype=torch.float32,
                                                                 batches=(3,))),
    "lora_rows_independent_bf16": (check_lora_rows_independent, dict(dtype=torch.bfloat16)),
    "lora_rows_independent_fp32_out": (check_lora_rows_independent,
                                       dict(dtype=torch.bfloat16, out="fp32")),
    "lora_matches_expand_default_tile": (check_lora_matches_expand, dict(
        shapes={"pair": LoraShape(96, 300, ((0, 64, 16), (64, 96, 16)), 9)}, batches=(1, 32),
        tile="default")),
    "lora_refusals": (check_lora_refusals, dict()),
}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
