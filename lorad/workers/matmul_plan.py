"""Which matmul each base projection takes at each row count on the GPU, so that a row's bits
never depend on how many rows share its step.

The reference is row_matmul's arithmetic (kernels/row_matmul.py: every output one chain of fp32
multiply-adds over K in order, no split), which any of its tiles and the decode GEMV give. cuBLAS
gives the same bits at most row counts, but splits K at some (on an H100 at the 8B shapes: o_proj
at 8 and 9 rows, down_proj up to 129, benchmarks/probe_row_matmul.py), and which ones depends on
the GPU, the library and the shape. So each rank measures it at start, for its own projections'
shapes: for every row count a step can have, cuBLAS on random rows against row_matmul on the
same rows; a count where any element differs goes to row_matmul. The tiles and the GEMV are
checked against the reference the same way: one that differs is not used.

Two orders of fp32 sums differ in most elements, but rounded to bf16 (the model dtype's outputs)
only in about one element of 10,000 (a tiny model's 8-row down_proj on an H100: 2 of 230 x 96).
So every row count is checked on at least CHECK_ELEMENTS outputs, in products of that count (8
rows of 96 outputs alone show such a difference about one time in 15; 2^18 outputs show about 24
of them): many products for few rows of a narrow projection, one for the LM head.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from lorad.workers import cpu_threads
from lorad.workers.kernels.configs import GemvConfig, MatmulConfig, MatmulTiles
from lorad.workers.linear import plan_key

log = logging.getLogger("lorad.worker")

SEED = 20261205
CHECK_ELEMENTS = 1 << 18  # outputs each row count's products are checked on, at least


@dataclass(frozen=True)
class MatmulPlan:
    """One projection shape's choice by row count: cuBLAS where it gives the reference bits,
    row_matmul with the tile for the count elsewhere, the decode GEMV only if it agrees."""

    cublas_rows: np.ndarray  # [max_rows + 1] bool: cuBLAS gives the reference at that count
    tiles: MatmulTiles
    gemv_agrees: bool = True

    def tile(self, num_rows: int) -> MatmulConfig | None:
        """None: cuBLAS; else the row_matmul tile for a product of num_rows rows."""
        if num_rows < len(self.cublas_rows) and self.cublas_rows[num_rows]:
            return None
        return self.tiles.config(num_rows)

    @property
    def num_cublas(self) -> int:
        return int(self.cublas_rows.sum())


def cublas_matmul(x: torch.Tensor, weight: torch.Tensor,
                  out_dtype: torch.dtype | None) -> torch.Tensor:
    """The cuBLAS call base_matmul makes: x weight^T rounded to x's dtype, or its fp32 sum
    (on CPU tensors, in tests, the CPU path's: no mm there gives an fp32 sum of bf16)."""
    if out_dtype is None or out_dtype == x.dtype:
        return cpu_threads.linear(x, weight)
    if not x.is_cuda:
        return F.linear(x.float(), weight.float())
    return torch.mm(x, weight.t(), out_dtype=out_dtype)


def plan_matmul(weight: torch.Tensor, out_dtype: torch.dtype | None, max_rows: int,
                tiles: MatmulTiles, gemv: GemvConfig | None = None,
                cublas: Callable[[torch.Tensor], torch.Tensor] | None = None,
                check_elements: int = CHECK_ELEMENTS) -> MatmulPlan:
    """Measure the plan of x weight^T for products of 1..max_rows rows (out_dtype as
    base_matmul takes it). cublas: the library call to check (tests pass another);
    check_elements: the outputs each count is checked on, at least (tests pass fewer)."""
    from lorad.workers.kernels import decode_gemv  # the CPU path never imports triton
    from lorad.workers.kernels.row_matmul import row_matmul
    cublas = cublas or (lambda rows: cublas_matmul(rows, weight, out_dtype))
    tiles = tiles.for_dtype(weight.dtype)
    gen = torch.Generator(device=weight.device).manual_seed(SEED)
    # Room for the products of any count: ceil(check_elements / (count * out)) of them.
    check_rows = -(-check_elements // weight.shape[0])
    x = torch.randn(check_rows + max_rows, weight.shape[1], generator=gen, device=weight.device)
    x = x.to(weight.dtype)
    reference = row_matmul(x, weight, out_dtype, tiles.first)
    for tile in {t for _, t in tiles.bands[1:]} - {tiles.first}:
        if not torch.equal(row_matmul(x, weight, out_dtype, tile), reference):
            log.warning("row_matmul's tile %s gives other bits than %s at %s: the first takes "
                        "its row counts", tile, tiles.first, tuple(weight.shape))
            tiles = tiles.replacing(tile)
    gemv_agrees = True
    if gemv is not None and decode_gemv.supports(x[:gemv.block_m], weight, out_dtype, gemv):
        gemv_agrees = bool(all_products_agree(
            lambda rows: decode_gemv.decode_matmul(rows, weight, out_dtype, gemv), x, reference,
            gemv.block_m, check_rows))
        if not gemv_agrees:
            log.warning("the decode GEMV gives other bits than row_matmul at %s: not used",
                        tuple(weight.shape))
    same = torch.zeros(max_rows + 1, dtype=torch.bool, device=weight.device)
    for num_rows in range(1, max_rows + 1):  # on the device: one sync at the end
        same[num_rows] = all_products_agree(cublas, x, reference, num_rows, check_rows)
    return MatmulPlan(same.cpu().numpy(), tiles, gemv_agrees)


def all_products_agree(matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                       reference: torch.Tensor, num_rows: int, check_rows: int) -> torch.Tensor:
    """Whether matmul gives the reference's bits on products of num_rows consecutive rows of x,
    from the first, as many as cover check_rows rows (at least one): a 0-dim bool tensor on x's
    device (no sync)."""
    agree = [(matmul(x[start:start + num_rows]) == reference[start:start + num_rows]).all()
             for start in range(0, max(check_rows, 1), num_rows)]
    return torch.stack(agree).all()


def plan_model_matmuls(layers: list[tuple[object, torch.Tensor, torch.dtype | None]],
                       max_rows: int, tiles: MatmulTiles) -> dict:
    """layers: (layer, its weight, an out_dtype its base_matmul asks for, None for the model
    dtype); each layer's plans (its attribute `plans`, by out_dtype), measured once per distinct
    shape, dtype, out_dtype and decode GEMV tile (the plan says whether that tile agrees). ->
    the plans by that key."""
    started = time.monotonic()
    plans: dict = {}
    for layer, weight, out_dtype in layers:
        out_dtype = plan_key(weight.dtype, out_dtype)  # as base_matmul looks the plan up
        gemv = getattr(layer, "gemv", None)
        key = (tuple(weight.shape), weight.dtype, out_dtype, gemv)
        if key not in plans:
            plans[key] = plan_matmul(weight, out_dtype, max_rows, tiles, gemv)
        layer.plans = {**(layer.plans or {}), out_dtype: plans[key]}
    for (shape, _, out_dtype, _), plan in plans.items():
        log.info("matmul %s -> %s: cuBLAS at %d of %d row counts, row_matmul at the others%s",
                 shape, out_dtype or "model dtype", plan.num_cublas, max_rows,
                 "" if plan.gemv_agrees else "; decode GEMV not used")
    log.info("matmul plans of %d shapes measured in %.0f ms", len(plans),
             (time.monotonic() - started) * 1000)
    return plans
