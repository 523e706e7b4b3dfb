"""The leader's log probabilities (workers/logprobs.py): the fp32 log-softmax of the rows that
asked, taken before a mask writes into the logits, and nothing for rows that did not ask."""

from __future__ import annotations

import torch

from lorad.protocol.messages import SamplingParams
from lorad.workers import logprobs


def params(num_logprobs: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, max_tokens=4,
                          stop_token_ids=[], ignore_eos=False, num_logprobs=num_logprobs)


def test_only_asking_rows_get_values_and_a_later_mask_does_not_change_them():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))  # [rows, vocab]
    before = logits.clone()
    pending = logprobs.compute(logits, [params(-1), params(3), params(-1), params(0)])
    logits[1, :25] = float("-inf")  # what the grammar mask does, in place
    sampled = [7, 30, 2, 11]
    found = logprobs.complete(pending, ["w", "x", "y", "z"], sampled)
    assert set(found) == {"x", "z"}
    reference = torch.log_softmax(before, dim=-1)  # [rows, vocab]
    values, ids = torch.topk(reference[1], 3)
    assert found["x"].top_ids == ids.tolist()
    assert found["x"].top_logprobs == values.tolist()
    assert found["x"].logprob == reference[1, 30].item()
    assert found["z"].top_ids == [] and found["z"].logprob == reference[3, 11].item()


def test_no_asking_row_computes_nothing():
    logits = torch.randn(3, 20)
    assert logprobs.compute(logits, [params(-1)] * 3) is None
    assert logprobs.complete(None, ["a", "b", "c"], [1, 2, 3]) == {}
