"""The adapter host cache on CUDA: page-locked host slots, copies on a side stream as the
adapter jobs run them, and the slot's contents equal a copy straight from the file's shards
(tests/unit/test_adapter_host_cache.py's check)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_adapter_host_cache import check_fill_through_the_cache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_a_slot_filled_through_the_pinned_cache_equals_a_copy_from_the_file(tmp_path):
    check_fill_through_the_cache(tmp_path, "cuda")
