"""The temperature-only draw kernel on the GPU at Llama 3's vocabulary (128,256 tokens, 126 blocks):
tests/temperature_draw_checks.py's checks on CUDA, and the sampler with it switched on drawing the
same tokens again from the same seeds, whatever rows share the step."""

from __future__ import annotations

import pytest
import torch

from lorad.protocol.messages import SamplingParams
from lorad.workers import sampler as sampler_module
from tests import temperature_draw_checks as checks

pytestmark = pytest.mark.gpu

CUDA = "cuda"


@pytest.mark.parametrize("name", list(checks.CHECKS))
def test_check_on_cuda(name):
    check, kwargs = checks.CHECKS[name]
    check(device=CUDA, vocab=checks.GPU_VOCAB, **kwargs)


def test_sampler_draws_repeat_and_ignore_neighbours(monkeypatch):
    monkeypatch.setattr(sampler_module, "TEMPERATURE_KERNEL", True)
    params = [SamplingParams(temperature=t, top_p=1.0, top_k=0, seed=0, max_tokens=8,
                             stop_token_ids=[], ignore_eos=False) for t in (0.7, 1.0, 1.3, 0.9)]
    gen = torch.Generator().manual_seed(8)
    crowd, alone, again = (sampler_module.Sampler() for _ in range(3))
    for sampler in (crowd, alone, again):
        for i in range(len(params)):
            sampler.add(f"r{i}", 70 + i)
    for step in range(6):
        logits = (torch.randn(len(params), checks.GPU_VOCAB, generator=gen) * 3).to(CUDA)
        ids = [f"r{i}" for i in range(len(params))]
        together = crowd.sample(logits, ids, params)
        one_each = [alone.sample(logits[i:i + 1], [ids[i]], [params[i]])[0]
                    for i in range(len(params))]
        assert together == one_each == again.sample(logits, ids, params), step
