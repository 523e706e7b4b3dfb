"""kernels/moe_math.py, the router's and gate's arithmetic that the MoE glue kernels repeat:
its exp against float64, its softmax, top-k and sigmoid against torch's own (which the block
used before, and transformers uses) within a few ulp, its ties and its sum order by example.
The kernels' bits against it: tests/kernels/moe_glue_checks.py."""

from __future__ import annotations

import struct

import pytest
import torch

from lorad.workers.kernels import moe_math


def _is_float32(value: float) -> bool:
    return struct.unpack("f", struct.pack("f", value))[0] == value


def test_constants_are_float32_values():
    for value in (moe_math.EXP_MIN, moe_math.EXP_MAX, moe_math.LOG2E, moe_math.LN2_HI,
                  moe_math.LN2_LO, *moe_math.EXP_POLY):
        assert _is_float32(value), value


def test_exp_within_two_ulp_and_zero_below_the_range():
    x = torch.linspace(-80, 80, 400_001)
    got = moe_math.exp_fp32(x).double()
    want = x.double().exp()
    ulp = torch.finfo(torch.float32).eps * want  # one ulp, within a factor 2
    assert ((got - want).abs() <= 2 * ulp).all()
    assert torch.equal(moe_math.exp_fp32(torch.tensor([-80.5, -1e30, float("-inf"), 0.0])),
                       torch.tensor([0.0, 0.0, 0.0, 1.0]))


def test_pairwise_sum_adds_halves():
    """[1e8, 1, -1e8, 1]: (1e8 + -1e8) + (1 + 1) = 2, one after another 1 (1e8 + 1 rounds to
    1e8); three columns pad with a zero: (1e8 + -1e8) + (1 + 0) = 1, one after another 0."""
    x = torch.tensor([[1e8, 1.0, -1e8, 1.0], [1.0, 2.0, 3.0, 0.0]])
    assert moe_math.pairwise_row_sum(x).flatten().tolist() == [2.0, 6.0]
    assert moe_math.pairwise_row_sum(x[:, :3]).flatten().tolist() == [1.0, 6.0]


@pytest.mark.parametrize("norm", [False, True])
def test_route_is_torchs_softmax_and_topk_within_ulps(norm):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(500, 60, generator=gen) * 3
    weights, experts = moe_math.route(logits, 4, norm)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    old_weights, old_experts = torch.topk(probs, 4, dim=-1)
    if norm:
        old_weights = old_weights / old_weights.sum(dim=-1, keepdim=True)
    old_experts, order = old_experts.sort(dim=-1)
    assert torch.equal(experts, old_experts)
    torch.testing.assert_close(weights, old_weights.gather(-1, order), rtol=1e-6, atol=0)


def test_route_ties_padding_and_dtype():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0]],
                          dtype=torch.bfloat16)
    weights, experts = moe_math.route(logits, 2, False, torch.tensor([True, False]))
    assert experts.tolist() == [[1, 3], [5, 5]]  # ties: the lowest experts; padding: none
    assert weights.dtype == torch.bfloat16 and weights[1].tolist() == [0.0, 0.0]
    assert weights[0, 0] == weights[0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_is_torchs_within_ulps(dtype):
    x = (torch.linspace(-30, 30, 10_001)).to(dtype)
    got = moe_math.sigmoid(x)
    assert got.dtype == dtype
    tolerance = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), torch.sigmoid(x.float()), rtol=tolerance, atol=0)
