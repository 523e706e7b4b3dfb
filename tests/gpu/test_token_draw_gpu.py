"""The sampler's draw and running sum on the GPU at Llama 3's vocabulary (128,256 tokens, 32
chunks): tests/kernels/token_draw_checks.py's checks on CUDA, at the kernel's own chunk. The sampler
(repeat draws, no dependence on neighbours) is in test_sampler_gpu.py."""

from __future__ import annotations

import pytest

from tests.kernels import token_draw_checks as checks

pytestmark = pytest.mark.gpu

CUDA = "cuda"


@pytest.mark.parametrize("name", list(checks.CHECKS))
def test_check_on_cuda(name):
    check, kwargs = checks.CHECKS[name]
    check(device=CUDA, vocab=checks.GPU_VOCAB, chunk=None, **kwargs)
