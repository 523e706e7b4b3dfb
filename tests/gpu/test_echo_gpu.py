"""Completions' echo on a GPU: a real daemon on one GPU (fp32, decode CUDA graphs captured) with
adapters a and b, its prompt log probabilities against transformers' (and peft's) fp32
log-softmax on the CPU within 5e-5 (fp32 sums in cuBLAS's order) over several prefill chunks, max_tokens 0, and a mixed burst whose
requests without echo get their solo tokens (their decodes replay the graphs, which echo's rows,
only ever in prefill chunks, never enter).

The checks are tests/integration/test_echo.py's, collected here with a daemon placed on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.daemons import adapter_flags, start_daemon
from tests.integration.test_echo import (  # noqa: F401 (tests and fixtures collected here)
    references, test_a_mixed_burst_gives_other_requests_their_solo_tokens,
    test_echo_logprobs_equal_transformers, test_max_tokens_0_scores_the_prompt_alone)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ON_GPU = ("--parallel", "1", "--device", "cuda", "--dtype", "float32", "--kv-cache-blocks", "128",
          "--max-num-batched-tokens", "8")


@pytest.fixture
def tol() -> float:
    # fp32 on CUDA against the CPU's fp32 references: on the H200 (2026-12-04) one position of
    # adapter a was 1.05e-5 off at 1e-5, every other value within it.
    return 5e-5


@pytest.fixture(scope="module")
def served(tiny_model, tiny_adapters):
    daemon = start_daemon(tiny_model, *adapter_flags(tiny_adapters), *ON_GPU)
    assert "captured CUDA graphs of decode steps" in daemon.log(), daemon.log()[-3000:]
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-3000:]
