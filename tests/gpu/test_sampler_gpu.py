"""The sampler on the GPU: a step's rows warped and drawn together give each row the bits and the
token it gets taken alone, one row at a time (both on the GPU), with mixed parameters, ties and
neighbours that come and go."""

from __future__ import annotations

import pytest
import torch

from lorad.protocol.messages import SamplingParams
from lorad.workers.sampler import Sampler, warp_rows

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
VOCAB = 128256  # Llama 3's: the sort and the scans run at the size they serve


def sp(temperature=1.0, top_p=1.0, top_k=0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=0,
                          max_tokens=16, stop_token_ids=[], ignore_eos=False)


PARAMS = [sp(temperature=0.0), sp(temperature=0.7, top_p=0.9), sp(top_k=50),
          sp(temperature=1.3, top_k=40, top_p=0.5), sp(temperature=0.7), sp(),
          sp(temperature=0.6, top_p=0.95), sp(temperature=1.0, top_p=0.999, top_k=1)]


@pytest.mark.parametrize("ties", [False, True])
def test_rows_together_equal_rows_one_by_one(ties):
    gen = torch.Generator().manual_seed(21)
    together, one_by_one = Sampler(rows_together=True), Sampler(rows_together=False)
    ids = [f"r{i}" for i in range(len(PARAMS))]
    for i, rid in enumerate(ids):
        together.add(rid, 500 + i)
        one_by_one.add(rid, 500 + i)
    for step in range(8):
        logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * 4
        if ties:
            logits = (logits * 4).round() / 4
        logits = logits.to(CUDA)
        live = list(range(len(PARAMS)))[step % 3:]  # neighbours come and go
        rows = [i for i in live if PARAMS[i].temperature != 0]
        warped = warp_rows(logits[rows], [PARAMS[i] for i in rows])
        for j, i in enumerate(rows):
            alone = warp_rows(logits[i:i + 1], [PARAMS[i]])[0]
            assert torch.equal(warped[j], alone), (step, i)
        step_ids, step_params = [ids[i] for i in live], [PARAMS[i] for i in live]
        assert together.sample(logits[live], step_ids, step_params) == \
            one_by_one.sample(logits[live], step_ids, step_params), step
