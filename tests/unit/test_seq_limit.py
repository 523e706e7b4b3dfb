"""`--max-num-seqs auto` (lorad/workers/seq_limit.py) and the auto queue bound
(lorad/daemon/admission.py), against figures worked out by hand."""

from __future__ import annotations

import pytest

from lorad.daemon.admission import queue_bound
from lorad.workers.seq_limit import (
    AUTO_MAX_NUM_SEQS_CPU, AUTO_MAX_NUM_SEQS_GPU, auto_max_num_seqs, pool_sizing_seqs)

GIB = 2**30
# Llama-3-8B: 32 layers, 8 KV heads of 128, bf16: K and V of one 16-token block.
BLOCK_BYTES_8B = 2 * 32 * 8 * 128 * 2 * 16  # 2 MiB


def h200_pool_blocks() -> int:
    """The default pool of an 8B bf16 on an H200: 90% of what its 141 GB (~131 GiB) leave
    after ~15 GiB of weights (engine.py's CUDA_KV_FRACTION)."""
    free = 131 * GIB - 15 * GIB
    return int(free * 0.9) // BLOCK_BYTES_8B


@pytest.mark.parametrize("max_model_len", [8192, 131072])
def test_an_h200_sized_pool_serves_at_least_256(max_model_len):
    blocks = h200_pool_blocks()
    assert blocks == 53452
    num_seqs = auto_max_num_seqs(blocks, 16, max_model_len, 512, on_gpu=True)
    assert num_seqs >= 256 and num_seqs == AUTO_MAX_NUM_SEQS_GPU


def test_a_smaller_gpu_pool_gets_what_it_holds_at_2048_tokens_a_sequence():
    # 24 GiB of KV for the 8B: 12,288 blocks, 196,608 tokens, 96 sequences of 2,048.
    assert auto_max_num_seqs(24 * GIB // BLOCK_BYTES_8B, 16, 8192, 512, on_gpu=True) == 96
    # A short context counts at its own length: 1,000 tokens a sequence, rounded down to 8s.
    assert auto_max_num_seqs(12000, 16, 1000, 512, on_gpu=True) == 192


def test_todays_64_is_the_floor_and_the_cpu_ceiling():
    assert auto_max_num_seqs(8, 16, 128, 512, on_gpu=True) == 64  # preemption serves a small pool
    assert auto_max_num_seqs(8, 16, 128, 512, on_gpu=False) == 64
    assert auto_max_num_seqs(1 << 20, 16, 2048, 512, on_gpu=False) == AUTO_MAX_NUM_SEQS_CPU == 64


def test_one_steps_token_budget_caps_it():
    blocks = h200_pool_blocks()
    assert auto_max_num_seqs(blocks, 16, 8192, 200, on_gpu=True) == 200
    assert auto_max_num_seqs(blocks, 16, 8192, 100, on_gpu=True) == 96
    assert auto_max_num_seqs(blocks, 16, 8192, 5, on_gpu=True) == 5


def test_the_pool_is_sized_for_the_explicit_value_or_auto_ceiling():
    assert pool_sizing_seqs(12, on_gpu=True) == 12
    assert pool_sizing_seqs(None, on_gpu=True) == 256
    assert pool_sizing_seqs(None, on_gpu=False) == 64


def test_a_bad_pool_is_a_clear_error():
    with pytest.raises(ValueError, match="auto --max-num-seqs"):
        auto_max_num_seqs(0, 16, 2048, 512, on_gpu=True)


def test_the_auto_queue_holds_four_batches_and_at_least_256():
    assert queue_bound(None, 64) == 256
    assert queue_bound(None, 256) == 1024
    assert queue_bound(3, 256) == 3  # an explicit --max-queued-requests is kept
