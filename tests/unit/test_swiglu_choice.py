"""Where gate/up gives silu(gate) * up in the decode GEMV's epilogue (MergedColumnParallelLinear.
swiglu_in_gemv, GemvModelTiles.swiglu_epilogue): on the kernel path, in a step of at most the
tile's rows whose LoRA kernels do not run for gate or up, never on the CPU path. The decision
only: that the variant gives the two launches' bits is checked under the interpreter
(tests/kernels/decode_swiglu_checks.py, and model_kernel_checks.py's model steps)."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

from lorad.workers.batch import ForwardBatch
from lorad.workers.fused_linear import MergedColumnParallelLinear
from lorad.workers.kernel_path import KERNELS_ON_CPU_ENV
from lorad.workers.kernels.configs import GemvModelTiles
from lorad.workers.lora_rows import LoraRows
from lorad.workers.tuning import Tuning, replaced

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the `gpu` extra)")

HIDDEN, INTER = 32, 40
BF16 = torch.bfloat16


@pytest.fixture
def layer(monkeypatch) -> MergedColumnParallelLinear:
    """gate/up with the model's GEMV tile and the switch as Tuning() sets it, on the kernel path
    (CPU tensors: the tests' hook; nothing here launches a kernel)."""
    monkeypatch.setenv(KERNELS_ON_CPU_ENV, "1")
    layer = MergedColumnParallelLinear(HIDDEN, INTER, (0, INTER), BF16, torch.device("cpu"))
    layer.gemv = GemvModelTiles().config("gate_up", BF16)
    layer.swiglu_epilogue = Tuning().gemv.swiglu_epilogue
    return layer


def rows_of(slots: list[int], launch_always: bool = False) -> tuple[torch.Tensor, LoraRows]:
    """A decode step of one sequence per slot (padded to the batch's least rows): (x, its
    kernel-path LoraRows)."""
    chunks = [([7], 3, [0], True, slot) for slot in slots]
    batch = ForwardBatch.build(chunks, 4, "cpu")
    x = torch.zeros(batch.row_adapter_slots.shape[0], HIDDEN, dtype=BF16)
    return x, LoraRows.from_batch(batch, launch_always=launch_always, use_kernels=True)


def test_on_by_default_and_a_setting_turns_it_off():
    assert Tuning().gemv.swiglu_epilogue
    assert not replaced(Tuning(), "gemv.swiglu_epilogue=False").gemv.swiglu_epilogue


def test_without_gate_or_up_tables_every_decode_step_takes_it(layer):
    for slots in ([0], [0, 0, 0], [1, 0, 2]):
        assert layer.swiglu_in_gemv(*rows_of(slots)), slots
    assert layer.swiglu_in_gemv(*rows_of([1, 2], launch_always=True))  # nothing to launch


def test_a_step_whose_adapter_edits_gate_or_up_takes_the_two_launches(layer):
    """Slot 1 edits gate, slot 2 up, slot 3 neither (its tables' rank 0): a step of base rows
    or slot 3 takes the variant; one with a row of slot 1 or 2, or a graph that launches the
    LoRA kernels whatever rows it replays, does not."""
    layer.add_lora_slots("gate", 4, 8).ranks[1] = 2
    layer.add_lora_slots("up", 4, 8).ranks[2] = 4
    assert layer.swiglu_in_gemv(*rows_of([0, 0]))
    assert layer.swiglu_in_gemv(*rows_of([3, 0, 3]))
    for slots in ([1], [0, 2], [3, 1, 0], [2, 1]):
        assert not layer.swiglu_in_gemv(*rows_of(slots)), slots
    assert not layer.swiglu_in_gemv(*rows_of([0], launch_always=True))


def test_only_where_base_matmul_takes_the_gemv(layer):
    """More rows than the tile's, no GEMV tile, a plan that found other bits than the GEMV's,
    the switch off, a bias, or the CPU path: the two launches."""
    x, rows = rows_of([0])
    assert layer.swiglu_in_gemv(x, rows)
    many = torch.zeros(layer.gemv.block_m + 1, HIDDEN, dtype=BF16)
    assert not layer.swiglu_in_gemv(many, rows)
    from lorad.workers.matmul_plan import MatmulPlan
    from lorad.workers.kernels.configs import MatmulTiles
    agrees = MatmulPlan(np.ones(17, dtype=bool), MatmulTiles())
    layer.plans = {None: agrees}
    assert layer.swiglu_in_gemv(x, rows)
    layer.plans = {None: dataclasses.replace(agrees, gemv_agrees=False)}
    assert not layer.swiglu_in_gemv(x, rows)
    layer.plans = None
    layer.swiglu_epilogue = False
    assert not layer.swiglu_in_gemv(x, rows)
    layer.swiglu_epilogue = True
    layer.bias = torch.nn.Parameter(torch.zeros(2 * INTER, dtype=BF16), requires_grad=False)
    assert not layer.swiglu_in_gemv(x, rows)
    layer.bias = None
    layer.gemv = None
    assert not layer.swiglu_in_gemv(x, rows)


def test_never_on_the_cpu_path(layer, monkeypatch):
    monkeypatch.delenv(KERNELS_ON_CPU_ENV)
    x, rows = rows_of([0])
    assert not layer.swiglu_in_gemv(x, rows)


def test_the_models_hand_the_switch_to_both_mlps(tmp_path):
    """tune() sets it on the dense MLP's gate/up and the MoE shared expert's alike."""
    from lorad.config import ModelConfig
    from lorad.workers.models import model_class
    from lorad.workers.moe import SharedExpert
    from lorad.workers.parallel import TensorParallel
    from tests.tiny_models import make_tiny_qwen2_moe
    checkpoint = make_tiny_qwen2_moe(tmp_path / "moe", with_tokenizer=False, seed=1)
    config = ModelConfig.from_dir(checkpoint)
    cpu = torch.device("cpu")
    model = model_class(config)(config, TensorParallel(0, 1, cpu), torch.float32, cpu)
    gate_ups = [m.gate_up_proj for m in model.modules()
                if isinstance(getattr(m, "gate_up_proj", None), MergedColumnParallelLinear)]
    assert any(isinstance(m, SharedExpert) for m in model.modules())
    assert len(gate_ups) == len(model.model.layers)  # a dense layer's or a shared expert's
    assert all(g.swiglu_epilogue for g in gate_ups)
    model.tune(replaced(Tuning(), "gemv.swiglu_epilogue=False"))
    assert not any(g.swiglu_epilogue for g in gate_ups)
