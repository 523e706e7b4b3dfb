"""Checks of the decode GEMV's SwiGLU variant (decode_gemv.decode_swiglu) against the two launches
it replaces, decode_matmul on gate/up's fused weight and then fused_ops.silu_and_mul, on any
device.

test_triton_interpreted.py runs them on CPU tensors under TRITON_INTERPRET=1 in a subprocess,
on tiny shapes with a tiny tile and the model's gate/up tile; tests/gpu/test_decode_gemv_gpu.py
calls them on CUDA at Llama-3-8B's and Qwen1.5-MoE's shared-expert gate/up shapes, with PDL.
The claim is bit equality (a row's bits must not depend on which path its step took), so every
comparison is torch.equal: fresh random inputs, h written into a NaN-poisoned buffer larger
than h (an element never written, or one written past the rows, shows), a row's bits alone and
among others, and the inputs it refuses. The kernel modules are imported inside the checks,
after the interpreter is set.
"""

from __future__ import annotations

import sys

import torch

from tests.kernels.triton_interpreter import run_checks

POISON = float("nan")
# (N, K), N the intermediate size (w has 2N rows): N a multiple of the small tile's block_n (32)
# or not; K a multiple of every tile's block_k, of the small tile's (32) only, or of none (100:
# the masked path).
CPU_SHAPES = {"n64_k256": (64, 256), "n40_k96": (40, 96), "n70_k100": (70, 100)}
# Llama-3-8B's gate/up (intermediate 14336) and Qwen1.5-MoE-A2.7B's shared expert (5632).
GPU_SHAPES = {"llama3_8b": (14336, 4096), "qwen_moe_shared": (5632, 2048)}
CPU_BATCHES = (1, 2, 7, 16)


def _config(tile: str, dtype: torch.dtype):
    from lorad.workers.kernels.configs import GemvConfig, GemvModelTiles
    # "model": the model's gate/up tile for the dtype (block_k halved for fp32). "small": the
    # model's 16 rows of x with a small tile's loops (the interpreter runs programs one by one).
    if tile == "model":
        return GemvModelTiles().config("gate_up", dtype)
    return GemvConfig(block_m=16, block_n=32, block_k=32, num_warps=1, num_stages=2)


def _inputs(gen: torch.Generator, num_rows: int, n: int, k: int, dtype: torch.dtype,
            device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [num_rows, k], w: [2n, k] (gate's rows, then up's), random normal drawn on the device,
    w scaled so that gate and up are of order 2: silu's curve, not only its tails."""
    x = torch.randn(num_rows, k, generator=gen, device=device)
    w = torch.randn(2 * n, k, generator=gen, device=device) * (2.0 / k ** 0.5)
    return x.to(dtype), w.to(dtype)


def _two_launches(x: torch.Tensor, w: torch.Tensor, config, pdl_rows: int) -> torch.Tensor:
    """The path the variant replaces: the GEMV's gate/up, then silu(gate) * up."""
    from lorad.workers.kernels.decode_gemv import decode_matmul
    from lorad.workers.kernels.fused_ops import silu_and_mul
    gate_up = decode_matmul(x, w, None, config, pdl_rows=pdl_rows)
    gate, up = gate_up.split(w.shape[0] // 2, dim=1)
    return silu_and_mul(gate, up, pdl_rows=pdl_rows)


def _fused_poisoned(x: torch.Tensor, w: torch.Tensor, config, pdl_rows: int,
                    where: str) -> torch.Tensor:
    """decode_swiglu into the front of a NaN buffer two rows and a few elements longer than h;
    raises if anything past h was written."""
    from lorad.workers.kernels.decode_gemv import decode_swiglu
    num_rows, n = x.shape[0], w.shape[0] // 2
    buffer = torch.full(((num_rows + 2) * n + 5,), POISON, dtype=x.dtype, device=x.device)
    out = buffer[:num_rows * n].view(num_rows, n)
    got = decode_swiglu(x, w, config, pdl_rows, out=out)
    if got.data_ptr() != out.data_ptr():
        raise AssertionError(f"{where}: h was not written into the buffer given")
    past = buffer[num_rows * n:]
    if not torch.isnan(past.float()).all():
        raise AssertionError(f"{where}: {int((~torch.isnan(past.float())).sum())} elements "
                             f"written past h's {num_rows} rows of {n}")
    return got


def _assert_equal(where: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if torch.isnan(want.float()).any():
        raise AssertionError(f"{where}: the two launches gave NaN (the inputs are too large)")
    if not torch.equal(got, want):  # an element left NaN is never equal
        unwritten = int(torch.isnan(got.float()).sum())
        raise AssertionError(f"{where}: {int((got != want).sum())} elements differ from "
                             f"decode_matmul + silu_and_mul ({unwritten} never written)")


def check_matches_two_launches(device: str, dtype: torch.dtype = torch.bfloat16,
                               shapes: dict | None = None,
                               batches: tuple[int, ...] = CPU_BATCHES, tile: str = "small",
                               pdl_rows: int = 0) -> None:
    """decode_swiglu's h bit for bit equal to decode_matmul then silu_and_mul (the same tile,
    the same PDL limit) at every batch size given, every element of h written and nothing past
    it."""
    gen = torch.Generator(device).manual_seed(13)
    config = _config(tile, dtype)
    for shape_name, (n, k) in (shapes or CPU_SHAPES).items():
        x_all, w = _inputs(gen, max(batches), n, k, dtype, device)
        for num_rows in batches:
            where = f"{shape_name} {dtype} M={num_rows} tile {config} pdl_rows {pdl_rows}"
            x = x_all[:num_rows]
            want = _two_launches(x, w, config, pdl_rows)
            _assert_equal(where, _fused_poisoned(x, w, config, pdl_rows, where), want)


def check_rows_independent_of_batch(device: str, dtype: torch.dtype = torch.bfloat16,
                                    shapes: dict | None = None, tile: str = "small",
                                    pdl_rows: int = 0) -> None:
    """A row's h alone equals its h among the tile's 16 rows and among three other rows, and
    the first rows of a batch equal the same rows in the full tile, rows past the batch in x's
    buffer (NaN) never read."""
    from lorad.workers.kernels.decode_gemv import decode_swiglu
    gen = torch.Generator(device).manual_seed(17)
    config = _config(tile, dtype)
    for shape_name, (n, k) in (shapes or CPU_SHAPES).items():
        most = config.block_m
        x, w = _inputs(gen, most, n, k, dtype, device)
        full = decode_swiglu(x, w, config, pdl_rows)
        for num_rows in (1, 5, most - 1):
            buffer = torch.full_like(x, POISON)
            buffer[:num_rows] = x[:num_rows]
            got = decode_swiglu(buffer[:num_rows], w, config, pdl_rows)
            if not torch.equal(got, full[:num_rows]):
                raise AssertionError(f"{shape_name} {dtype}: the first {num_rows} rows differ "
                                     f"from the same rows among {most}")
        for row in (0, 4, most - 1):
            other = _inputs(gen, 3, n, k, dtype, device)[0]
            mixed = torch.cat([other[:1], x[row:row + 1], other[1:]])
            for got, how in ((decode_swiglu(x[row:row + 1], w, config, pdl_rows), "alone"),
                             (decode_swiglu(mixed, w, config, pdl_rows)[1:2],
                              "among other rows")):
                if not torch.equal(got, full[row:row + 1]):
                    raise AssertionError(f"{shape_name} {dtype}: row {row} {how} differs from "
                                         f"row {row} among {most}")


def check_refusals(device: str) -> None:
    """Empty batches give empty results, K = 0 gives zeros (silu(0) * 0); a w of an odd row
    count, more rows than the tile's, inputs decode_matmul refuses and an out of the wrong
    shape raise ValueError."""
    from lorad.workers.kernels.decode_gemv import decode_swiglu
    from lorad.workers.kernels.configs import GemvConfig
    bf16 = torch.bfloat16
    config = GemvConfig(block_m=16, block_n=32, block_k=32, num_warps=1, num_stages=2)
    w = torch.randn(80, 32).to(dtype=bf16, device=device)
    x = torch.randn(2, 32).to(dtype=bf16, device=device)
    got = decode_swiglu(x[:0], w, config)
    if got.shape != (0, 40) or got.dtype != bf16:
        raise AssertionError(f"an empty batch gave {tuple(got.shape)} {got.dtype}")
    zeros = decode_swiglu(x[:, :0], w[:, :0], config)
    if zeros.shape != (2, 40) or not torch.equal(zeros, torch.zeros_like(zeros)):
        raise AssertionError("K = 0 did not give zeros")
    # name -> (x, w, out, words the error must hold)
    bad = {"odd rows": (x, w[:79], None, "halves"),
           "rows over the tile's": (torch.zeros(17, 32, dtype=bf16, device=device), w, None,
                                    "block_m 16"),
           "dtypes differ": (x, w.float(), None, "share a dtype"),
           "K differs": (x[:, :16], w, None, "columns (K)"),
           "out of another shape": (x, w, torch.empty(2, 80, dtype=bf16, device=device),
                                    "out of shape"),
           "out of another dtype": (x, w, torch.empty(2, 40, device=device), "out of shape")}
    for name, (xb, wb, out, words) in bad.items():
        try:
            decode_swiglu(xb, wb, config, out=out)
        except ValueError as exc:
            if words not in str(exc):
                raise AssertionError(f"{name}: the error does not say {words!r}: {exc}")
            continue
        raise AssertionError(f"decode_swiglu took a bad input: {name}")


CHECKS = {
    "matches_two_launches_bf16": (check_matches_two_launches, dict(dtype=torch.bfloat16)),
    "matches_two_launches_fp16": (check_matches_two_launches, dict(dtype=torch.float16)),
    "matches_two_launches_fp32": (check_matches_two_launches, dict(dtype=torch.float32)),
    # Every row count of the tile, at one shape (K = 100: the masked path, N = 70: a ragged
    # last block).
    **{f"matches_two_launches_rows_1_to_16_{name}": (
        check_matches_two_launches, dict(dtype=dtype, shapes={"n70_k100": (70, 100)},
                                         batches=tuple(range(1, 17))))
       for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                           ("fp32", torch.float32))},
    "matches_two_launches_model_tile_bf16": (
        check_matches_two_launches, dict(dtype=torch.bfloat16, tile="model",
                                         shapes={"n100_k256": (100, 256)}, batches=(1, 3, 16))),
    "matches_two_launches_model_tile_fp32": (
        check_matches_two_launches, dict(dtype=torch.float32, tile="model",
                                         shapes={"n100_k160": (100, 160)}, batches=(1, 16))),
    "rows_independent_of_batch_bf16": (check_rows_independent_of_batch,
                                       dict(dtype=torch.bfloat16)),
    "rows_independent_of_batch_fp32": (check_rows_independent_of_batch,
                                       dict(dtype=torch.float32)),
    "refusals": (check_refusals, dict()),
}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
