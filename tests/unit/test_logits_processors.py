"""The logits transforms (logits_processors.py) and min_p (sampler.py) against plain
reimplementations written from their definitions, element by element in numpy float32, on random
logits: bit for bit for logit_bias, min_tokens and the penalties; the same kept set for min_p.
A row's result does not depend on the rows beside it, and rows that ask for nothing keep their
bits."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from lorad.protocol.messages import SamplingParams, TokenBias
from lorad.workers.logits_processors import LogitsTransforms, rows_to_transform
from lorad.workers.sampler import Sampler, warp, warp_rows
from lorad.workers.sequence import Sequence

VOCAB = 300
EOS = [0, 2]


def sp(**changed) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0,
                             "max_tokens": 64, "stop_token_ids": EOS, "ignore_eos": False,
                             **changed})


def transform(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
              prompts: list[list[int]], outputs: list[list[int]],
              transforms: LogitsTransforms | None = None) -> None:
    """The leader's call, with a Sequence per transformed row (request ids r0, r1, ...)."""
    seqs = [Sequence(f"r{j}", list(prompt), p, 0, "", j, output_ids=list(output))
            for j, (p, prompt, output) in enumerate(zip(params, prompts, outputs))]
    (transforms or LogitsTransforms()).apply(logits, rows, seqs)


def reference(row: torch.Tensor, p: SamplingParams, prompt: list[int],
              output: list[int]) -> torch.Tensor:
    """The definitions, one element at a time, in the documented order."""
    x = row.numpy().astype(np.float32).copy()
    f32 = np.float32
    for entry in p.logit_bias:  # OpenAI: added to the logit
        x[entry.token_id] = f32(x[entry.token_id] + f32(entry.bias))
    if len(output) < p.min_tokens:  # vLLM: the ending tokens are impossible until min_tokens
        for t in p.request_stop_token_ids + ([] if p.ignore_eos else p.stop_token_ids):
            x[t] = -np.inf
    if p.repetition_penalty != 1.0:  # CTRL, as transformers and vLLM: prompt and output
        r = f32(p.repetition_penalty)
        for t in set(prompt) | set(output):
            x[t] = f32(x[t] / r) if x[t] > 0 else f32(x[t] * r)
    counts = Counter(output)  # OpenAI: output tokens only
    for t, c in counts.items():
        x[t] = f32(x[t] - f32(f32(p.frequency_penalty) * f32(c)))
        x[t] = f32(x[t] - f32(p.presence_penalty))
    return torch.from_numpy(x)


def random_case(rng: random.Random) -> tuple[SamplingParams, list[int], list[int]]:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
    output = [rng.choice(prompt + [rng.randrange(VOCAB)]) for _ in range(rng.randrange(0, 30))]
    bias_ids = sorted(rng.sample(range(VOCAB), rng.choice([0, 1, 5, 40])))
    changed = {
        "presence_penalty": rng.choice([0.0, float(np.float32(rng.uniform(-2, 2)))]),
        "frequency_penalty": rng.choice([0.0, float(np.float32(rng.uniform(-2, 2)))]),
        "repetition_penalty": rng.choice([1.0, float(np.float32(rng.uniform(0.05, 2)))]),
        "logit_bias": [TokenBias(t, float(np.float32(rng.uniform(-100, 100))))
                       for t in bias_ids],
        "request_stop_token_ids": rng.choice([[], [7], [7, 11]]),
        "min_tokens": rng.choice([0, 0, 5, 40]),
        "ignore_eos": rng.random() < 0.3,
    }
    return sp(**changed), prompt, output


@pytest.mark.parametrize("seed", range(6))
def test_each_row_equals_the_reference_whatever_its_neighbours(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cases = [random_case(rng) for _ in range(12)] + [(sp(), [1, 2], [3])] * 3  # plain rows
    rng.shuffle(cases)
    params, prompts, outputs = (list(column) for column in zip(*cases))
    logits = torch.randn(len(cases), VOCAB, generator=gen) * 5
    logits[0, 5] = 0.0  # a zero and a -0.0 logit under the repetition penalty
    logits[1, 6] = -0.0
    before = logits.clone()
    rows = rows_to_transform(params)
    assert rows == [i for i, p in enumerate(params) if p != sp()]
    transform(logits, rows, [params[i] for i in rows], [prompts[i] for i in rows],
              [outputs[i] for i in rows])
    for i, (p, prompt, output) in enumerate(cases):
        expected = reference(before[i], p, prompt, output) if i in rows else before[i]
        assert torch.equal(logits[i], expected), (i, p)
        assert torch.equal(torch.signbit(logits[i]), torch.signbit(expected)), i  # -0.0 too
        alone = before[i:i + 1].clone()
        transform(alone, [0] if i in rows else [], [p], [prompt], [output])
        assert torch.equal(alone[0], logits[i]), i


def test_counts_kept_between_steps_follow_the_growing_output():
    """The leader counts each request's new tokens once per step (and forgets it at remove):
    every step equals the reference over the whole history."""
    rng = random.Random(5)
    p = sp(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=-0.7,
           min_tokens=4, request_stop_token_ids=[9])
    transforms = LogitsTransforms()
    prompt = [rng.randrange(VOCAB) for _ in range(30)]
    seq = Sequence("r", prompt, p, 0, "", 1)
    gen = torch.Generator().manual_seed(5)
    for _ in range(12):
        logits = torch.randn(2, VOCAB, generator=gen)
        before = logits.clone()
        transforms.apply(logits, [1], [seq])
        assert torch.equal(logits[1], reference(before[1], p, prompt, seq.output_ids))
        assert torch.equal(logits[0], before[0])
        seq.output_ids.append(rng.choice(prompt[:5] + [rng.randrange(VOCAB)]))
    transforms.remove("r")
    fresh = Sequence("r", [3], p, 0, "", 2)  # the same id again: nothing of the old one stays
    logits = torch.ones(1, VOCAB)
    transforms.apply(logits, [0], [fresh])
    assert torch.equal(logits[0], reference(torch.ones(VOCAB), p, [3], []))


def test_rows_that_ask_for_nothing_cost_nothing():
    logits = torch.randn(3, VOCAB)
    params = [sp(), sp(temperature=0.7, top_k=5), sp(min_p=0.2)]  # min_p is the sampler's
    assert rows_to_transform(params) == []


def test_each_field_alone_changes_what_its_definition_says():
    logits = torch.zeros(1, VOCAB)
    transform(logits, [0], [sp(logit_bias=[TokenBias(9, 100.0)])], [[1]], [[]])
    assert logits[0, 9] == 100.0 and logits[0].count_nonzero() == 1
    logits = torch.ones(1, VOCAB)
    transform(logits, [0], [sp(min_tokens=2, request_stop_token_ids=[7])], [[1]], [[4]])
    assert set(torch.isinf(logits[0]).nonzero().flatten().tolist()) == {0, 2, 7}
    for output in ([4], []):  # min_tokens reached; and EOS is no stop with ignore_eos
        logits = torch.ones(1, VOCAB)
        transform(logits, [0], [sp(min_tokens=1, ignore_eos=True)], [[1]], [output])
        assert torch.equal(logits, torch.ones(1, VOCAB))
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    transform(logits, [0], [sp(repetition_penalty=2.0)], [[0]], [[1]])
    assert logits.tolist() == [[1.0, -4.0, 2.0, -2.0]]
    logits = torch.zeros(1, 4)
    transform(logits, [0], [sp(frequency_penalty=0.5, presence_penalty=1.0)], [[1, 1]], [[2, 2, 3]])
    assert logits.tolist() == [[0.0, 0.0, -2.0, -1.5]]  # the prompt's 1 is not counted


def reference_min_p(row: torch.Tensor, min_p: float) -> set[int]:
    """vLLM's definition: probabilities after temperature, below min_p times the largest."""
    probs = torch.softmax(row.double(), dim=-1)
    return set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())


@pytest.mark.parametrize("min_p", [0.0, 1e-4, 0.05, 0.3, 1.0])
def test_min_p_keeps_what_its_definition_keeps(min_p):
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(6, VOCAB, generator=gen) * 3
    for temperature in (0.5, 1.0, 1.7):
        batch = warp_rows(rows, torch.full((6,), temperature), torch.zeros(6, dtype=torch.long),
                          torch.ones(6), 0, False, torch.full((6,), min_p))
        for i in range(6):
            kept = warp(rows[i], temperature, 0, 1.0, min_p)
            expected = reference_min_p(rows[i] / temperature, min_p)
            assert set(torch.isfinite(kept).nonzero().flatten().tolist()) == expected
            assert torch.equal(torch.isfinite(batch[i]), torch.isfinite(kept))


def test_min_p_follows_top_k_and_top_p():
    gen = torch.Generator().manual_seed(8)
    row = torch.randn(VOCAB, generator=gen) * 2
    top_k_only = warp(row, 0.8, 20, 0.9)
    both = warp(row, 0.8, 20, 0.9, 0.2)
    assert set(torch.isfinite(both).nonzero().flatten().tolist()) == \
        set(torch.isfinite(top_k_only).nonzero().flatten().tolist()) & reference_min_p(
            row / 0.8, 0.2)


def test_a_greedy_row_takes_the_argmax_of_its_transformed_logits():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [sp(logit_bias=[TokenBias(17, 100.0)]), sp()]
    expected_plain = int(logits[1].argmax())
    transform(logits, rows_to_transform(params), params[:1], [[1]], [[]])
    sampler = Sampler()
    for rid in ("a", "b"):
        sampler.add(rid, 0)
    assert sampler.sample(logits, ["a", "b"], params) == [17, expected_plain]
