"""Checks of the decode GEMV kernel (lorad/workers/kernels/decode_gemv.py) against plain torch,
on any device.

test_triton_interpreted.py runs them on CPU tensors under TRITON_INTERPRET=1 in a
subprocess, on tiny shapes with a tiny tile and with the default one; tests/gpu/
test_decode_gemv_gpu.py calls them on CUDA at Llama-3-8B's projection shapes. Each check takes
fresh random inputs and raises AssertionError naming what differed: the result against a float64
reference (within the fp32 sum's error bound, and bit-exact on integer-valued inputs, whose sums
fp32 holds exactly), a row's bits across batch sizes, weight views, and the inputs it refuses.
The kernel module is imported inside the checks, after the interpreter is set.
"""

from __future__ import annotations

import sys
import torch

from tests.kernels.triton_interpreter import run_checks

# (N, K): N never a multiple of the block; K a multiple of the small tile's block_k (64) only,
# of both tiles' (256), and of neither (100: the masked path).
CPU_SHAPES = {"n40_k64": (40, 64), "n100_k192": (100, 192), "n48_k256": (48, 256),
              "n70_k100": (70, 100)}
GPU_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336)}
CPU_BATCHES = (1, 3, 16, 32)
OUT_DTYPES = {"model": None, "fp32": torch.float32}


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
                                 num_stages=2)}[tile]


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


def check_bias(device: str, dtype: torch.dtype = torch.bfloat16, n: int = 70, k: int = 100,
               tile: str = "small", out: str = "model") -> None:
    """A bias in the epilogue gives torch's add_ of it to the product, bit for bit (n not a
    multiple of block_n, 1 to 16 rows); a bias of the wrong shape, dtype or stride is
    refused."""
    from lorad.workers.kernels.decode_gemv import decode_matmul
    gen = torch.Generator(device).manual_seed(11)
    config, out_dtype = _config(tile), OUT_DTYPES[out]
    for num_rows in (1, 5, 16):
        x, w = _inputs(gen, num_rows, n, k, dtype, device)
        bias = torch.randn(n, generator=gen, device=device).to(out_dtype or dtype)
        got = decode_matmul(x, w, out_dtype, config, bias=bias)
        want = decode_matmul(x, w, out_dtype, config).add_(bias)
        if not torch.equal(got, want):
            raise AssertionError(f"bias {dtype} out {out} rows {num_rows}: "
                                 f"{int((got != want).sum())} elements differ from add_")
    for bad in (bias[:-1], bias.to(torch.float16), torch.stack([bias, bias], 1)[:, 0]):
        try:
            decode_matmul(x, w, out_dtype, config, bias=bad)
        except ValueError as exc:
            if "bias" not in str(exc):
                raise AssertionError(f"the bias refusal does not name it: {exc}")
            continue
        raise AssertionError(f"decode_matmul took a bias of {tuple(bad.shape)} {bad.dtype}")


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
    "bias_bf16": (check_bias, dict(dtype=torch.bfloat16)),
    "bias_bf16_rows16": (check_bias, dict(dtype=torch.bfloat16, tile="rows16")),
    "bias_fp32": (check_bias, dict(dtype=torch.float32)),
}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
