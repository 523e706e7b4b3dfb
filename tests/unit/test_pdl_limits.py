"""kernels/pdl.py's row limits: a step's limit from its PdlConfig (max_rows without LoRA
launches, max_rows_with_lora with them), the limit a kernel is given deciding its launch, and
never PDL off CUDA or at a limit of 0. The launches themselves (and that PDL changes no bit) are
checked on a GPU in tests/gpu/test_cuda_graphs.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lorad.workers.kernels.configs import PdlConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the `gpu` extra)")


@pytest.fixture
def pdl(monkeypatch):
    from lorad.workers.kernels import pdl
    # A device taken as capable, so no CUDA call is made on this machine.
    monkeypatch.setitem(pdl._CAPABLE, 0, True)
    return pdl


def test_a_steps_limit_follows_its_lora_launches():
    config = PdlConfig()
    assert (config.step_rows(with_lora=False), config.step_rows(with_lora=True)) == (32, 64)
    config = PdlConfig(max_rows=8, max_rows_with_lora=16)
    assert (config.step_rows(with_lora=False), config.step_rows(with_lora=True)) == (8, 16)


def test_the_limit_given_decides_the_launch(pdl):
    cuda = torch.device("cuda", 0)
    assert pdl.use_pdl(cuda, 32, 32) and not pdl.use_pdl(cuda, 33, 32)
    assert pdl.use_pdl(cuda, 64, 64) and not pdl.use_pdl(cuda, 65, 64)
    assert pdl.launch_options(cuda, 48, 32) == {"PDL": False, "launch_pdl": False}
    assert pdl.launch_options(cuda, 48, 64) == {"PDL": True, "launch_pdl": True}


def test_never_off_cuda_or_at_a_limit_of_zero(pdl):
    assert not pdl.use_pdl(torch.device("cpu"), 1, 64)
    assert not pdl.use_pdl(torch.device("cuda", 0), 1, 0)
