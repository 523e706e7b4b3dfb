"""The decode GEMV's model tiles (configs.GemvModelTiles) and row_matmul's (MatmulTiles):
block_k halved for fp32 weights, and every tile the model can pick fitting an H200's shared
memory (an fp32 q/k/v tile of 64 x 256 at 4 stages did not: 240 KiB asked, 227 there, and the
fp32 model's warm-up failed on it)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lorad.workers.kernels.configs import GemvConfig, GemvModelTiles

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the `gpu` extra)")

# An H200's shared memory per program (bytes), as triton's OutOfResources gave it.
H200_SHARED = 232448
PROJECTIONS = ("qkv", "o", "gate_up", "down")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def pipelined_bytes(config, dtype: torch.dtype) -> int:
    """Shared memory of the GEMV's loads in flight: num_stages - 1 buffers of an x tile and a w
    tile (the figure triton asked for the fp32 tile: 3 x (16 + 64) x 256 x 4 = 245,760)."""
    return (config.num_stages - 1) * (config.block_m + config.block_n) * config.block_k \
        * dtype.itemsize


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("projection", PROJECTIONS)
def test_model_tiles_fit_shared_memory(projection, dtype):
    config = GemvModelTiles().config(projection, dtype)
    if config is None:  # cuBLAS
        assert projection in ("o", "down")
        return
    assert pipelined_bytes(config, dtype) <= H200_SHARED, (projection, dtype, config)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_swiglu_variant_fits_shared_memory(dtype):
    """decode_swiglu takes gate/up's tile with two w tiles in flight (gate's and up's)."""
    config = GemvModelTiles().config("gate_up", dtype)
    two_w = (config.num_stages - 1) * (config.block_m + 2 * config.block_n) * config.block_k \
        * dtype.itemsize
    assert two_w <= H200_SHARED, (dtype, config)


def test_tiles_follow_the_projection_and_dtype():
    tiles = GemvModelTiles()
    qkv = tiles.config("qkv", torch.bfloat16)
    assert qkv == GemvConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4)
    assert tiles.config("gate_up", torch.bfloat16) == GemvConfig(
        block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    assert tiles.config("o", torch.bfloat16) is None and tiles.config("down", torch.float32) is None
    assert tiles.config("gate_up", torch.float32).block_k == 64
    assert tiles.config("qkv", torch.float32).block_k == qkv.block_k // 2
    assert tiles.config("qkv", torch.float16) is qkv
    # The fp32 figure the H200 refused is what the check above measures against.
    assert pipelined_bytes(GemvConfig(block_m=16, block_n=64, block_k=256),
                           torch.float32) == 245760 > H200_SHARED


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_matmul_tiles_fit_shared_memory(dtype):
    """row_matmul's tiles for the plan (MatmulTiles.for_dtype): the fp32 small tile at the bf16
    block_k asks the GEMV's 245,760 bytes (an H100 ran out: the fp32 daemons' start failed), the
    halved one fits, as every tile of every dtype does."""
    from lorad.workers.kernels.configs import MatmulTiles
    tiles = MatmulTiles()
    assert pipelined_bytes(tiles.first, torch.float32) == 245760 > H200_SHARED
    fitted = tiles.for_dtype(dtype)
    for most, tile in fitted.bands:
        assert pipelined_bytes(tile, dtype) <= H200_SHARED, (most, dtype)
    assert (fitted is tiles) == (dtype.itemsize <= 2)
