"""Adapters taking turns in device slots on one GPU (bf16, decode CUDA graphs, copies on the
adapter jobs' own CUDA stream): a seeded burst over the base model and adapters a, b and c in one
slot equals the solo runs of the daemon serving them all resident (tests/gpu/
test_adapter_mix_gpu.py's), and the 1,000-adapter burst of tests/integration/test_many_adapters.py
runs on the GPU too; bf16 slot tables (--lora-dtype) give a bf16 adapter fp32 tables' tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.daemons import adapter_flags, start_daemon
from tests.gpu.test_adapter_mix_gpu import MODELS, ON_GPU, served  # noqa: F401 (a fixture)
from tests.integration.test_lora_dtype import check_lora_dtype
from tests.integration.test_many_adapters import check_burst_over_200, start_library_daemon
from tests.integration.test_adapter_mix import LENGTHS, run_mix
from tests.tiny_adapters import make_peft_adapter

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def one_slot(tiny_model, tiny_adapters, tmp_path_factory):
    c = make_peft_adapter(tiny_model, tmp_path_factory.mktemp("c1") / "c", r=2, lora_alpha=4,
                          seed=3, target_modules=("k_proj", "gate_proj", "up_proj"))
    daemon = start_daemon(tiny_model, *adapter_flags({**tiny_adapters, "c": c}), *ON_GPU,
                          "--max-gpu-adapters", "1")
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-3000:]


def test_one_slot_for_three_adapters_equals_them_resident(one_slot, served):  # noqa: F811
    result = run_mix("--url", one_slot.url, "--reference-url", served.url, "--seeded",
                     "--prompt-lengths", LENGTHS, "--burst", "24", models=MODELS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: all 24 streams equal their solo runs" in result.stdout
    assert all(r["adapter_evictions"] > 0 for r in one_slot.health()["ranks"])


@pytest.fixture(scope="module")
def many(tiny_model, tmp_path_factory):
    daemon = start_library_daemon(tiny_model, tmp_path_factory.mktemp("many"), *ON_GPU)
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-3000:]


def test_a_burst_over_200_adapters_in_8_slots_on_the_gpu(many):
    check_burst_over_200(many)


def test_bf16_tables_serve_bf16_adapters_as_fp32_tables_do_on_the_gpu(tiny_model, tmp_path):
    """--lora-dtype bfloat16 on the GPU: the same tokens as fp32 tables, fp32 adapters refused."""
    check_lora_dtype(tiny_model, tmp_path, *ON_GPU)
