"""kernels/pdl.py's row limits: MAX_ROWS outside a step or in one without LoRA launches,
MAX_ROWS_WITH_LORA inside one with them, the previous setting back after the block, and a
kernel's own lower limit (max_rows). The launches themselves (and that PDL changes no bit) are
checked on a GPU in tests/gpu/test_cuda_graphs.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the `gpu` extra)")


@pytest.fixture
def pdl(monkeypatch):
    from lorad.workers.kernels import pdl
    # A device taken as capable, so no CUDA call is made on this machine.
    monkeypatch.setitem(pdl._CAPABLE, 0, True)
    monkeypatch.setattr(pdl, "MAX_ROWS", 32)
    monkeypatch.setattr(pdl, "MAX_ROWS_WITH_LORA", 64)
    return pdl


def test_the_row_limit_follows_the_step(pdl):
    cuda = torch.device("cuda", 0)
    assert pdl.use_pdl(cuda, 32) and not pdl.use_pdl(cuda, 33)
    with pdl.step(with_lora=True):
        assert pdl.use_pdl(cuda, 64) and not pdl.use_pdl(cuda, 65)
        with pdl.step(with_lora=False):
            assert not pdl.use_pdl(cuda, 33)
        assert pdl.use_pdl(cuda, 64)
    assert not pdl.use_pdl(cuda, 33)
    with pytest.raises(RuntimeError), pdl.step(with_lora=True):
        raise RuntimeError("a failed forward")
    assert not pdl.use_pdl(cuda, 33)
    assert pdl.launch_options(cuda, 48) == {"PDL": False, "launch_pdl": False}


def test_never_off_cuda_or_when_disabled(pdl, monkeypatch):
    with pdl.step(with_lora=True):
        assert not pdl.use_pdl(torch.device("cpu"), 1)
        monkeypatch.setattr(pdl, "ENABLED", False)
        assert not pdl.use_pdl(torch.device("cuda", 0), 1)


def test_a_kernel_limit_only_lowers_the_step_limit(pdl):
    cuda = torch.device("cuda", 0)
    with pdl.step(with_lora=True):
        assert pdl.use_pdl(cuda, 32, max_rows=32) and not pdl.use_pdl(cuda, 33, max_rows=32)
        assert not pdl.use_pdl(cuda, 1, max_rows=0)
        assert pdl.use_pdl(cuda, 64, max_rows=None)
        assert not pdl.use_pdl(cuda, 65, max_rows=128)  # never above the step's own
        assert pdl.launch_options(cuda, 48, 32) == {"PDL": False, "launch_pdl": False}
