"""The adapter host cache on CUDA: page-locked host slots, copies on a side stream as the
adapter jobs run them, and the slot's contents equal a copy straight from the file's shards
(tests/unit/test_adapter_host_cache.py's check)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.unit.test_adapter_host_cache import check_bf16_tables, check_fill_through_the_cache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_a_slot_filled_through_the_pinned_cache_equals_a_copy_from_the_file(tmp_path):
    check_fill_through_the_cache(tmp_path, "cuda")


def test_bf16_tables_through_the_pinned_cache_hold_a_bf16_adapter_exactly(tmp_path):
    check_bf16_tables(tmp_path, "cuda")


def test_a_cache_after_a_collected_one_pins_its_slots(tmp_path):
    # A host slot still registered when its memory is unmapped stays registered: the next
    # cache's slot, mapped at the same address, could not be page-locked (cudaError 712), and
    # the error stayed behind for the next CUDA call (two engines in one process, on an H100).
    for attempt in range(3):
        check_fill_through_the_cache(tmp_path / str(attempt), "cuda")
        gc.collect()
    torch.empty(1, device="cuda").add_(1)
    torch.cuda.synchronize()
