"""Checks of the row-invariant matmul (lorad/workers/kernels/row_matmul.py) against plain torch,
on any device.

test_triton_interpreted.py runs them on CPU tensors under TRITON_INTERPRET=1 in a subprocess,
on tiny shapes and tiles (several row tiles per group, a partial last group, N and K not
multiples of the tile); benchmarks/probe_row_matmul.py measures the GPU's side (bits against the
decode GEMV's, speed against cuBLAS). Each raises AssertionError naming what differed.
"""

from __future__ import annotations

import sys

import torch

from tests.kernels.triton_interpreter import run_checks

# The interpreter's MMA adds each tl.dot's products apart, so there a tile's block_k changes
# the sums (on Hopper it does not: the MMAs chain in steps of 16 whatever block_k is).

# (N, K): N a multiple of no tile's block_n; K of the tile's block_k (64) and not (100).
SHAPES = ((40, 64), (70, 100))
BATCHES = (1, 3, 16, 37, 70)
OUT_DTYPES = {"model": None, "fp32": torch.float32}


def _config(name: str):
    from lorad.workers.kernels.configs import MatmulConfig
    return {"tiny": MatmulConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=1,
                                 num_stages=2),
            "wide": MatmulConfig(block_m=32, block_n=64, block_k=16, group_m=3, num_warps=2,
                                 num_stages=1)}[name]


def check_integers_exact(device: str, config: str = "tiny", dtype: torch.dtype = torch.float32,
                         out: str = "fp32") -> None:
    """Integer inputs in [-3, 3] (every fp32 sum exact): the result equals a float64 x w^T
    bit for bit, every row count and shape, every row and output written."""
    from lorad.workers.kernels.row_matmul import row_matmul
    gen = torch.Generator().manual_seed(1)
    for n, k in SHAPES:
        w = torch.randint(-3, 4, (n, k), generator=gen).to(dtype=dtype, device=device)
        for m in BATCHES:
            x = torch.randint(-3, 4, (m, k), generator=gen).to(dtype=dtype, device=device)
            got = row_matmul(x, w, OUT_DTYPES[out], _config(config))
            want = (x.double() @ w.double().t()).to(got.dtype)
            if not torch.equal(got, want):
                bad = int((got != want).sum())
                raise AssertionError(f"{config} {dtype} out {out}, M {m} N {n} K {k}: {bad} "
                                     "elements differ from the exact product")


def check_rows_alone(device: str, config: str = "tiny", dtype: torch.dtype = torch.bfloat16
                     ) -> None:
    """Random normal inputs: each row's bits in an M-row product are its bits alone, for every
    M; and within the fp32 sum's error of a float64 reference."""
    from lorad.workers.kernels.row_matmul import row_matmul
    gen = torch.Generator().manual_seed(2)
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype=dtype, device=device)
        x = torch.randn(max(BATCHES), k, generator=gen).to(dtype=dtype, device=device)
        alone = torch.cat([row_matmul(x[i:i + 1], w, torch.float32, _config(config))
                           for i in range(x.shape[0])])
        want = x.double() @ w.double().t()
        if (alone.double() - want).abs().max() > 1e-4 * k ** 0.5:
            raise AssertionError(f"{config} {dtype} N {n} K {k}: far from the float64 product")
        for m in BATCHES:
            got = row_matmul(x[:m], w, torch.float32, _config(config))
            if not torch.equal(got, alone[:m]):
                rows = sorted(set(torch.nonzero(got != alone[:m])[:, 0].tolist()))
                raise AssertionError(f"{config} {dtype} N {n} K {k}: rows {rows} of {m} get other "
                                     "bits than alone")


def check_matmul_plan(device: str) -> None:
    """matmul_plan.plan_matmul against a stand-in for cuBLAS that splits K at 16 of 64 at some
    row counts (another order of sums) and computes row_matmul's sums at the others: the plan takes
    the stand-in exactly where it agrees and the tile for the count elsewhere, including a count
    where one element of one later product differs by one ulp (a bf16 output shows another
    order of sums that rarely); a tile or a decode GEMV whose sums run in other steps (here:
    other block_k under the interpreter, whose MMA adds each block's products apart) is found
    and not used."""
    from lorad.workers.kernels.configs import GemvConfig, MatmulConfig, MatmulTiles
    from lorad.workers.kernels.row_matmul import row_matmul
    from lorad.workers.matmul_plan import plan_matmul
    gen = torch.Generator().manual_seed(4)
    n, k, max_rows, split_at, check_rows = 40, 64, 24, {3, 9, 17, 24}, 48
    check = {"check_elements": check_rows * n}  # products of 48 rows of 40 outputs
    # bf16 weights: the plan halves an fp32 tile's block_k (MatmulTiles.for_dtype).
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device=device, dtype=torch.bfloat16)
    medium = MatmulConfig(block_m=32, block_n=32, block_k=32, group_m=1, num_warps=1,
                          num_stages=1)
    large = MatmulConfig(block_m=16, block_n=32, block_k=16, group_m=1, num_warps=1,
                         num_stages=1)
    small = _config("tiny")
    tiles = MatmulTiles(bands=((4, small), (12, medium), (1 << 30, large)))

    calls = {}

    def stand_in(x):
        calls[x.shape[0]] = calls.get(x.shape[0], 0) + 1
        if x.shape[0] == 5 and calls[5] == 8:  # rows 35-39: one element one ulp up
            out = row_matmul(x, w, torch.float32, small)
            out[2, 7] = torch.nextafter(out[2, 7], out[2, 7] + 1)
            return out
        if x.shape[0] in split_at:
            return (row_matmul(x[:, :16].contiguous(), w[:, :16].contiguous(), torch.float32)
                    + row_matmul(x[:, 16:].contiguous(), w[:, 16:].contiguous(), torch.float32))
        return row_matmul(x, w, torch.float32, small)

    same_k = GemvConfig(block_m=16, block_n=32, block_k=32, num_warps=1, num_stages=2)
    plan = plan_matmul(w, torch.float32, max_rows, tiles, same_k, cublas=stand_in, **check)
    if calls[5] != -(-check_rows // 5):
        raise AssertionError(f"5 rows checked in {calls[5]} products, want {-(-check_rows // 5)}")
    want = [m not in split_at | {5} for m in range(1, max_rows + 1)]
    if plan.cublas_rows[1:].tolist() != want or plan.cublas_rows[0]:
        raise AssertionError(f"cuBLAS rows {plan.cublas_rows.tolist()}, want {want}")
    if not plan.gemv_agrees:
        raise AssertionError("a GEMV with the tile's block_k was found to differ")
    # The medium tile's sums run in blocks of 32 like the small one's; the large one's of 16.
    if plan.tiles.bands != ((4, small), (12, medium), (1 << 30, small)):
        raise AssertionError(f"tiles kept {plan.tiles}")
    for m, tile in ((3, small), (9, medium), (17, small), (6, None), (5, medium), (25, small)):
        if plan.tile(m) != tile:
            raise AssertionError(f"{m} rows take {plan.tile(m)}, want {tile}")
    other_k = GemvConfig(block_m=16, block_n=32, block_k=16, num_warps=1, num_stages=2)
    if plan_matmul(w, torch.float32, 4, tiles, other_k, cublas=stand_in,
                   **check).gemv_agrees:
        raise AssertionError("a GEMV summing in other steps was taken for the reference's")


def check_refusals(device: str) -> None:
    """What it does not take is refused with a ValueError naming it."""
    from lorad.workers.kernels.row_matmul import row_matmul
    x = torch.zeros(3, 8, device=device)
    cases = {"columns (K)": (x, torch.zeros(4, 9, device=device), None),
             "share a dtype": (x, torch.zeros(4, 8, dtype=torch.float64, device=device), None),
             "out_dtype": (x, torch.zeros(4, 8, device=device), torch.float16),
             "contiguous": (x, torch.zeros(8, 4, device=device).t(), None)}
    for words, (a, b, out_dtype) in cases.items():
        try:
            row_matmul(a, b, out_dtype)
        except ValueError as exc:
            if words not in str(exc):
                raise AssertionError(f"refusal {exc} does not say {words!r}") from None
        else:
            raise AssertionError(f"{words}: taken")
    empty = row_matmul(torch.zeros(0, 8, device=device), torch.zeros(4, 8, device=device))
    if empty.shape != (0, 4):
        raise AssertionError(f"0 rows gave {tuple(empty.shape)}")
    zero_k = row_matmul(torch.zeros(2, 0, device=device), torch.zeros(4, 0, device=device))
    if not torch.equal(zero_k, torch.zeros(2, 4, device=device)):
        raise AssertionError("K 0 did not give zeros")


CHECKS = {
    "row_matmul_integers_tiny_fp32": (check_integers_exact, dict(config="tiny")),
    "row_matmul_integers_wide_bf16_out": (check_integers_exact,
                                          dict(config="wide", dtype=torch.bfloat16,
                                               out="model")),
    "row_matmul_rows_alone_tiny_bf16": (check_rows_alone, dict(config="tiny")),
    "row_matmul_rows_alone_wide_fp32": (check_rows_alone, dict(config="wide",
                                                               dtype=torch.float32)),
    "row_matmul_refusals": (check_refusals, {}),
    "matmul_plan": (check_matmul_plan, {}),
}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
