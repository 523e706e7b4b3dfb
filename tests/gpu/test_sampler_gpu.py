"""The sampler on the GPU, at Llama 3's vocabulary: a seeded request draws the same tokens when the
same logits come again, its warped row (top-k, top-p: warp_rows) comes out with the same bits,
and a row's token does not depend on the rows beside it; with mixed parameters, ties and
neighbours that come and go. (torch's own CUDA cumulative sum of one row failed the bit check on
the H200, which is why the sampler does not use it there: kernels/token_draw.py.)"""

from __future__ import annotations

import pytest
import torch

from lorad.protocol.messages import SamplingParams
from lorad.workers.sampler import Sampler, warm_up, warp_rows
from tests.kernels.compiled_variants import forget_compiled, num_compiled

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
VOCAB = 128256


def sp(temperature=1.0, top_p=1.0, top_k=0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=0,
                          max_tokens=16, stop_token_ids=[], ignore_eos=False)


PARAMS = [sp(temperature=0.0), sp(temperature=0.7, top_p=0.9), sp(top_k=50),
          sp(temperature=1.3, top_k=40, top_p=0.5), sp(temperature=0.7), sp(),
          sp(temperature=0.6, top_p=0.95), sp(temperature=1.0, top_p=0.999, top_k=1)]


def samplers(count: int) -> list[Sampler]:
    made = [Sampler() for _ in range(count)]
    for sampler in made:
        for i in range(len(PARAMS)):
            sampler.add(f"r{i}", 500 + i)
    return made


def steps(ties: bool):
    gen = torch.Generator().manual_seed(21)
    for step in range(8):
        logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * 4
        if ties:
            logits = (logits * 4).round() / 4
        yield step, logits.to(CUDA), list(range(len(PARAMS)))[step % 3:]


@pytest.mark.parametrize("ties", [False, True])
def test_seeded_draws_repeat(ties):
    first, second = samplers(2)
    for step, logits, live in steps(ties):
        ids, params = [f"r{i}" for i in live], [PARAMS[i] for i in live]
        assert first.sample(logits[live], ids, params) == \
            second.sample(logits[live], ids, params), step
        for i in live:
            if PARAMS[i].temperature:
                p = PARAMS[i]
                args = (torch.tensor([p.temperature], device=CUDA),
                        torch.tensor([p.top_k], device=CUDA),
                        torch.tensor([p.top_p], device=CUDA), p.top_k, p.top_p < 1.0)
                assert torch.equal(warp_rows(logits[i:i + 1], *args),
                                   warp_rows(logits[i:i + 1], *args)), (step, i)


@pytest.mark.parametrize("ties", [False, True])
def test_a_row_does_not_depend_on_its_neighbours(ties):
    crowd, alone = samplers(2)
    for step, logits, live in steps(ties):
        together = crowd.sample(logits[live], [f"r{i}" for i in live], [PARAMS[i] for i in live])
        one_each = [alone.sample(logits[i:i + 1], [f"r{i}"], [PARAMS[i]])[0] for i in live]
        assert together == one_each, step


def test_after_the_warm_up_no_step_compiles_a_draw_kernel():
    """The engine's warm-up (sampler.warm_up) compiles every variant of the draw kernels a step
    needs: steps of 1 to 9 rows, plain, warped and mixed, compile nothing after it (triton
    compiles a variant per pointer alignment; each row of the step's device values starts on 16
    bytes)."""
    from lorad.workers.kernels import token_draw
    kernels = (token_draw._chunk_stats_kernel, token_draw._pick_kernel,
               token_draw._cumulative_sum_kernel)
    for kernel in kernels:  # forget what earlier tests compiled
        forget_compiled(kernel)

    def compiled() -> list[int]:
        return [num_compiled(kernel) for kernel in kernels]

    warm_up(torch.zeros(2, VOCAB, device=CUDA))
    assert compiled() == [1, 1, 1]
    sampler = Sampler()
    gen = torch.Generator().manual_seed(4)
    for num in range(1, 10):
        ids = [f"n{num}-{i}" for i in range(num)]
        for request_id in ids:
            sampler.add(request_id, num)
        logits = (torch.randn(num, VOCAB, generator=gen) * 4).to(CUDA)
        for params in ([PARAMS[i % len(PARAMS)] for i in range(num)], [PARAMS[5]] * num,
                       [PARAMS[1]] * num, [PARAMS[2]] * num):
            sampler.sample(logits, ids, params)
            assert compiled() == [1, 1, 1], (num, params[0])
