"""The logits transforms and min_p on the GPU, at Llama 3's vocabulary, against the CPU path on
the same inputs: logit_bias, min_tokens and the penalties give the same bits (elementwise fp32
ops and scatters of exact values), a row's result does not depend on the rows beside it, greedy
picks the same tokens, and min_p keeps the same tokens but where exp's last bit can differ
between the CPU's and the GPU's (ratios within 1e-6 of min_p)."""

from __future__ import annotations

import random

import pytest
import torch

from lorad.protocol.messages import SamplingParams, TokenBias
from lorad.workers.logits_processors import LogitsTransforms, rows_to_transform
from lorad.workers.sampler import Sampler, warp, warp_rows
from lorad.workers.sequence import Sequence

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
VOCAB = 128256
EOS = [128001, 128009]


def sp(**changed) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0,
                             "max_tokens": 4096, "stop_token_ids": EOS, "ignore_eos": False,
                             **changed})


def cases(seed: int, num_rows: int) -> list[tuple[SamplingParams, list[int], list[int]]]:
    """Rows with long prompts and outputs (repeated ids), every transform, and plain rows."""
    rng = random.Random(seed)
    made = []
    for _ in range(num_rows):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 3000))]
        output = [rng.choice(prompt[:50]) if rng.random() < 0.5 else rng.randrange(VOCAB)
                  for _ in range(rng.randrange(0, 500))]
        if rng.random() < 0.25:
            made.append((sp(), prompt, output))
            continue
        bias_ids = sorted(rng.sample(range(VOCAB), rng.choice([0, 3, 300])))
        made.append((sp(
            presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
            frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
            repetition_penalty=rng.choice([1.0, rng.uniform(0.1, 2)]),
            logit_bias=[TokenBias(t, rng.uniform(-100, 100)) for t in bias_ids],
            request_stop_token_ids=rng.choice([[], [13], [13, 30]]),
            min_tokens=rng.choice([0, 100, 1000]), ignore_eos=rng.random() < 0.3),
            prompt, output))
    return made


def run(logits: torch.Tensor, made) -> torch.Tensor:
    logits = logits.clone()
    rows = rows_to_transform([p for p, _, _ in made])
    seqs = [Sequence(f"r{i}", made[i][1], made[i][0], 0, "", i, output_ids=list(made[i][2]))
            for i in rows]
    LogitsTransforms().apply(logits, rows, seqs)
    return logits


@pytest.mark.parametrize("seed", range(4))
def test_the_gpu_path_gives_the_cpu_paths_bits(seed):
    made = cases(seed, 24)
    logits = torch.randn(len(made), VOCAB, generator=torch.Generator().manual_seed(seed)) * 6
    on_cpu = run(logits, made)
    on_gpu = run(logits.to(CUDA), made)
    assert torch.equal(on_gpu.cpu(), on_cpu)
    assert not torch.equal(on_cpu, logits)  # something was transformed
    for i in range(0, len(made), 5):  # and alone, each row gives what it gave in the batch
        alone = run(logits[i:i + 1].to(CUDA), made[i:i + 1])
        assert torch.equal(alone[0], on_gpu[i]), i


def test_greedy_picks_the_same_tokens_on_both():
    made = cases(11, 16)
    logits = torch.randn(len(made), VOCAB, generator=torch.Generator().manual_seed(11)) * 6
    params = [p for p, _, _ in made]
    picked = []
    for device in ("cpu", CUDA):
        sampler = Sampler()
        ids = [f"r{i}" for i in range(len(made))]
        for rid in ids:
            sampler.add(rid, 0)
        picked.append(sampler.sample(run(logits.to(device), made), ids, params))
    assert picked[0] == picked[1]


@pytest.mark.parametrize("min_p", [1e-4, 0.05, 0.3, 1.0])
def test_min_p_keeps_the_cpu_paths_tokens(min_p):
    rows = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    temperature = 0.8
    on_gpu = warp_rows(rows.to(CUDA), torch.full((8,), temperature, device=CUDA),
                       torch.zeros(8, dtype=torch.long, device=CUDA), torch.ones(8, device=CUDA),
                       0, False, torch.full((8,), min_p, device=CUDA)).cpu()
    for i in range(8):
        on_cpu = warp(rows[i], temperature, 0, 1.0, min_p)
        scaled = rows[i] / temperature
        ratio = torch.exp(scaled - scaled.max()).double()
        near = (ratio - min_p).abs() <= 1e-6 * min_p  # where exp's last bit may decide
        differ = torch.isfinite(on_cpu) != torch.isfinite(on_gpu[i])
        assert not (differ & ~near).any(), i


def test_min_p_on_the_sampler_kernel_path():
    from tests.kernels import sampler_min_p_checks as checks
    checks.check_min_p_on_the_kernel_path(device="cuda", vocab=checks.GPU_VOCAB)
