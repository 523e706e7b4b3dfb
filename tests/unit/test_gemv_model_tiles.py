"""The decode GEMV's model tiles (decode_gemv.model_config): each projection's MODEL_TILES fields
over MODEL_CONFIG, block_k halved for fp32 weights, and every tile the model can pick fitting an
H200's shared memory (an fp32 q/k/v tile of 64 x 256 at 4 stages did not: 240 KiB asked, 227
there, and the fp32 model's warm-up failed on it)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

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
    from lorad.workers.kernels.decode_gemv import model_config
    config = model_config(projection, dtype)
    assert pipelined_bytes(config, dtype) <= H200_SHARED, (projection, dtype, config)


def test_tiles_follow_model_tiles_and_dtype(monkeypatch):
    from lorad.workers.kernels import decode_gemv
    monkeypatch.setattr(decode_gemv, "MODEL_TILES", {"gate_up": {"block_k": 128}})
    base = decode_gemv.MODEL_CONFIG
    assert decode_gemv.model_config("qkv") is base
    assert decode_gemv.model_config("gate_up").block_k == 128
    assert decode_gemv.model_config("gate_up").block_n == base.block_n
    assert decode_gemv.model_config("gate_up", torch.float32).block_k == 64
    assert decode_gemv.model_config("qkv", torch.float32).block_k == base.block_k // 2
    assert decode_gemv.model_config("qkv", torch.float16) is base
    # The fp32 figure the H200 refused is what the check above measures against.
    assert pipelined_bytes(decode_gemv.GemvConfig(block_m=16, block_n=64, block_k=256),
                           torch.float32) == 245760 > H200_SHARED
