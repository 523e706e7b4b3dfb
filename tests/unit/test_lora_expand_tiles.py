"""The LoRA expand's tile fits shared memory at every rank and table dtype: its block of outputs
narrows for wide ranks and fp32 tables (fitting_block_n), and stays as configured at rank 16."""

from __future__ import annotations

import importlib.util

import pytest

from lorad.workers.kernels.configs import ExpandSteps
from tests.unit.test_gemv_model_tiles import H200_SHARED

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")


@pytest.mark.parametrize("itemsize", (2, 4), ids=("bf16", "fp32"))
@pytest.mark.parametrize("rank_pad", (16, 32, 64, 128, 256, 512))
def test_b_stages_fit_shared_memory(rank_pad: int, itemsize: int) -> None:
    from lorad.workers.kernels import lora_expand
    steps = ExpandSteps()
    for config in (steps.large, steps.small):
        block_n = lora_expand.fitting_block_n(config.block_n, rank_pad, itemsize)
        assert block_n >= 16 and block_n & (block_n - 1) == 0
        stage = block_n * rank_pad * itemsize
        assert stage <= lora_expand.MAX_B_STAGE_BYTES or block_n == 16
        # B's stages leave room for the rest of the program (t's tile, the MMA's operands).
        assert stage * config.num_stages <= H200_SHARED // 2, (config, rank_pad, itemsize)


def test_rank_16_keeps_the_configured_blocks() -> None:
    from lorad.workers.kernels import lora_expand
    steps = ExpandSteps()
    for itemsize in (2, 4):
        for config in (steps.large, steps.small):
            assert lora_expand.fitting_block_n(config.block_n, 16, itemsize) == config.block_n
    assert lora_expand.fitting_block_n(256, 64, 4) == 128  # the tile that did not fit
    assert steps.config(32) is steps.small and steps.small.block_n == 256
    assert steps.config(33) is steps.large and steps.large.block_n == 128
