"""The decode GEMV on CUDA at Llama-3-8B's projection shapes (qkv 6144x4096, o 4096x4096, gate_up
28672x4096, down 4096x14336; batches 1, 2, 8, 16, 32) with the default tile and the model's tile
for each projection (configs.GemvModelTiles; 16 rows: batches to 16): against a float64
reference (bit-exact on integer and one-hot inputs), bf16 out and fp32 out, a row's bits the same
in every batch, weight views, and a CUDA graph replaying the eager bits. The checks are
tests/kernels/decode_gemv_checks.py's, which the CPU interpreter runs on tiny shapes.
Its SwiGLU variant at Llama-3-8B's gate/up (K 4096, intermediate 14336) and Qwen1.5-MoE's shared
expert (K 2048, 5632) with the model's gate/up tile and PDL: bit for bit the GEMV then silu * up
at every row count 1..16 (tests/kernels/decode_swiglu_checks.py's checks).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lorad.workers.kernels.configs import PdlConfig
from tests.kernels import decode_swiglu_checks as swiglu
from tests.kernels.decode_gemv_checks import (GPU_SHAPES, check_bias, check_matches_reference,
                                              check_refusals, check_rows_independent_of_batch,
                                              check_views)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed (the `gpu` extra)")]

BATCHES = (1, 2, 8, 16, 32)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# "model": the model's tile for the shape's projection (16 rows: the batches past 16 left out).
@pytest.mark.parametrize("tile", ["default", "model"])
@pytest.mark.parametrize("out", ["model", "fp32"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_matches_reference(shape, out, tile):
    check_matches_reference("cuda", torch.bfloat16, out, {shape: GPU_SHAPES[shape]}, BATCHES,
                            tile=tile)


@pytest.mark.parametrize("tile", ["default", "model"])
@pytest.mark.parametrize("out", ["model", "fp32"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_rows_independent_of_batch(shape, out, tile):
    check_rows_independent_of_batch("cuda", torch.bfloat16, out, {shape: GPU_SHAPES[shape]},
                                    BATCHES, tile=tile)


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_other_dtypes(dtype):
    """fp16 takes the same tensor-core path as bf16; fp32 operands take exact products."""
    shapes = {"o": GPU_SHAPES["o"]}
    check_matches_reference("cuda", DTYPES[dtype], "model", shapes, BATCHES, tile="default")
    check_rows_independent_of_batch("cuda", DTYPES[dtype], "model", shapes, BATCHES,
                                    tile="default")


@pytest.mark.parametrize("out", ["model", "fp32"])
def test_bias(out):
    """Qwen2's q/k/v bias in the epilogue: torch's add_ bit for bit, at the 8B q/k/v shape."""
    n, k = GPU_SHAPES["qkv"]
    check_bias("cuda", torch.bfloat16, n=n, k=k, tile="model", out=out)


def test_views_and_refusals():
    check_views("cuda", torch.bfloat16, n=4096, k=4096, num_rows=8, tile="default")
    check_refusals("cuda")


@pytest.mark.parametrize("num_rows", BATCHES)
def test_cuda_graph_replay(num_rows):
    """Captured once, replayed on new inputs in the same buffer: the eager call's bits."""
    from lorad.workers.kernels.decode_gemv import decode_matmul
    n, k = GPU_SHAPES["qkv"]
    gen = torch.Generator(device="cuda").manual_seed(9)
    w = torch.randn(n, k, generator=gen, device="cuda").bfloat16()
    x = torch.zeros(num_rows, k, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_matmul(x, w, torch.float32)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_matmul(x, w, torch.float32)
    for _ in range(2):
        x.copy_(torch.randn(num_rows, k, generator=gen, device="cuda"))
        graph.replay()
        if not torch.equal(out, decode_matmul(x, w, torch.float32)):
            raise AssertionError(f"M={num_rows}: the graph's replay differs from the eager call")


# The decode steps' PDL row limit without LoRA launches: every step of up to 16 rows launches
# its kernels with PDL, the SwiGLU variant and the two it replaces alike.
PDL_ROWS = PdlConfig().max_rows


@pytest.mark.parametrize("shape", swiglu.GPU_SHAPES)
def test_swiglu_matches_two_launches(shape):
    """bf16 at the model's gate/up tile, rows 1..16: decode_matmul + silu_and_mul's bits, h
    written in full and nothing past it; a row's bits alone and among others."""
    shapes = {shape: swiglu.GPU_SHAPES[shape]}
    swiglu.check_matches_two_launches("cuda", torch.bfloat16, shapes, tuple(range(1, 17)),
                                      tile="model", pdl_rows=PDL_ROWS)
    swiglu.check_rows_independent_of_batch("cuda", torch.bfloat16, shapes, tile="model",
                                           pdl_rows=PDL_ROWS)


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_swiglu_other_dtypes(dtype):
    """fp16 on the tensor cores as bf16; fp32 with exact products (the tile's block_k halved)."""
    shapes = {"qwen_moe_shared": swiglu.GPU_SHAPES["qwen_moe_shared"]}
    swiglu.check_matches_two_launches("cuda", DTYPES[dtype], shapes, (1, 2, 7, 16),
                                      tile="model", pdl_rows=PDL_ROWS)


def test_swiglu_refusals():
    swiglu.check_refusals("cuda")
