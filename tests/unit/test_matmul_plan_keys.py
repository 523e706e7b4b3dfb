"""A layer's matmul plans are keyed the way base_matmul looks them up: by None where the
products' out_dtype is the weight's own (an fp32 model's fp32 partial sums), else by the
out_dtype. Keyed by float32 there, an fp32 model's row-parallel layers never found their plan
and ran cuBLAS at every row count (the MoE shared expert's down_proj on an H100). The plan
itself (kernels) is a stand-in here: only the keys are checked."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lorad.workers import matmul_plan
from lorad.workers.kernels.configs import MatmulTiles


def test_plans_are_keyed_as_base_matmul_reads_them(monkeypatch):
    measured = []

    def plan_matmul(weight, out_dtype, *_):
        measured.append(out_dtype)
        return SimpleNamespace(num_cublas=0, gemv_agrees=True)

    monkeypatch.setattr(matmul_plan, "plan_matmul", plan_matmul)
    fp32_down = SimpleNamespace(plans=None)
    bf16_down = SimpleNamespace(plans=None)
    bf16_qkv = SimpleNamespace(plans=None)
    matmul_plan.plan_model_matmuls(
        [(fp32_down, torch.empty(8, 16), torch.float32),
         (bf16_down, torch.empty(8, 16, dtype=torch.bfloat16), torch.float32),
         (bf16_qkv, torch.empty(24, 16, dtype=torch.bfloat16), None)], 16, MatmulTiles())
    # base_matmul's key: None if out_dtype == x.dtype else out_dtype (x has the weight's dtype)
    assert list(fp32_down.plans) == [None]
    assert list(bf16_down.plans) == [torch.float32]
    assert list(bf16_qkv.plans) == [None]
    assert measured == [None, torch.float32, None]
