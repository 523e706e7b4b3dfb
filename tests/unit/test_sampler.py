"""The leader's sampler: greedy, per-request seeds, and warpers against plain references."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from lorad.protocol.messages import SamplingParams
from lorad.workers.sampler import UNIFORMS_AT_ONCE, Sampler, device_columns, draw, warp


def sp(temperature=1.0, top_p=1.0, top_k=0, seed=0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          max_tokens=16, stop_token_ids=[], ignore_eos=False)


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    ids = [f"r{i}" for i in range(5)]
    sampler = Sampler()
    for rid in ids:
        sampler.add(rid, 0)
    assert sampler.sample(logits, ids, [sp(temperature=0.0)] * 5) == \
        logits.argmax(dim=-1).tolist()


def test_same_seed_same_tokens_whatever_the_neighbours():
    gen = torch.Generator().manual_seed(2)
    steps = [torch.randn(4, 40, generator=gen) for _ in range(12)]  # [rows, vocab] per step
    params = sp(temperature=0.9, top_p=0.95, top_k=20, seed=1234)

    alone = Sampler()
    alone.add("a", 1234)
    solo = [alone.sample(step[:1], ["a"], [params])[0] for step in steps]

    crowded = Sampler()
    for rid, seed in (("x", 1), ("a", 1234), ("y", 1234), ("z", 9)):
        crowded.add(rid, seed)
    mixed = []
    for i, step in enumerate(steps):
        rows = [step[1], step[0], step[2], step[3]][: 2 + i % 3]  # neighbours come and go
        rids = ["x", "a", "y", "z"][: len(rows)]
        others = [sp(temperature=1.3, seed=1), params, sp(temperature=0.0), sp(top_k=3)]
        mixed.append(crowded.sample(torch.stack(rows), rids, others[: len(rows)])[1])
    assert mixed == solo
    assert len(set(solo)) > 1  # it really sampled


def reference_top_k(row: torch.Tensor, k: int) -> set[int]:
    values = row.tolist()
    kth = sorted(values, reverse=True)[k - 1]
    return {i for i, v in enumerate(values) if v >= kth}


def reference_top_p(row: torch.Tensor, p: float) -> set[int]:
    probs = torch.softmax(row.double(), dim=-1).tolist()
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if kept and mass >= p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


@pytest.mark.parametrize("k", [1, 2, 7, 63, 64, 100])
def test_top_k_keeps_the_k_largest(k):
    row = torch.randn(64, generator=torch.Generator().manual_seed(k))
    out = warp(row, 1.0, k, 1.0)
    assert kept(out) == reference_top_k(row, min(k, 64))
    hf = TopKLogitsWarper(top_k=k)(None, row[None].clone())[0]
    assert torch.equal(out, hf)


@pytest.mark.parametrize("p", [0.01, 0.3, 0.75, 0.9, 0.999])
def test_top_p_keeps_the_smallest_set_reaching_p(p):
    row = torch.randn(64, generator=torch.Generator().manual_seed(int(p * 1000))) * 2
    out = warp(row, 1.0, 0, p)
    assert kept(out) == reference_top_p(row, p)
    hf = TopPLogitsWarper(top_p=p)(None, row[None].clone())[0]
    assert torch.equal(out, hf)


def test_temperature_then_top_k_then_top_p_matches_transformers_chain():
    row = torch.randn(100, generator=torch.Generator().manual_seed(5))
    expected = TopPLogitsWarper(top_p=0.8)(None, TopKLogitsWarper(top_k=30)(None, row[None] / 0.7))
    assert torch.equal(warp(row, 0.7, 30, 0.8), expected[0])


def test_samples_stay_in_the_kept_set_and_follow_the_distribution():
    row = torch.tensor([2.0, 1.0, 0.0, -1.0, -9.0, -9.0])
    sampler = Sampler()
    sampler.add("r", 7)
    counts = [0] * 6
    for _ in range(3000):
        counts[sampler.sample(row[None], ["r"], [sp(top_k=4)])[0]] += 1
    assert counts[4] == counts[5] == 0
    probs = torch.softmax(row[:4], dim=-1).tolist()
    for count, prob in zip(counts, probs):
        assert abs(count / 3000 - prob) < 4 * math.sqrt(prob * (1 - prob) / 3000) + 1e-3


def test_a_block_of_uniforms_is_the_generators_single_draws():
    """What the sampler relies on when it takes UNIFORMS_AT_ONCE uniforms at a time."""
    for seed in (0, 7, 2**63 + 5):
        block, single = torch.Generator(), torch.Generator()
        block.manual_seed(seed)
        single.manual_seed(seed)
        blocks = torch.cat([torch.rand(UNIFORMS_AT_ONCE, generator=block) for _ in range(3)])
        singles = torch.stack([torch.rand((), generator=single)
                               for _ in range(3 * UNIFORMS_AT_ONCE)])
        assert torch.equal(blocks, singles), seed


def test_a_request_uses_its_uniforms_in_order_across_refills():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(8))
    sampler = Sampler()
    sampler.add("r", 99)
    single = torch.Generator().manual_seed(99)
    probs = torch.softmax(warp(logits[0], 0.7, 0, 1.0), dim=-1)
    tokens, expected = [], []
    for _ in range(2 * UNIFORMS_AT_ONCE + 5):
        u = float(torch.rand((), generator=single, dtype=torch.float32))
        expected.append(int(draw(probs, u)))
        tokens += sampler.sample(logits, ["r"], [sp(temperature=0.7)])
    assert tokens == expected
    assert len(set(tokens)) > 20  # the uniforms really moved the draws


def test_removed_request_forgets_its_generator():
    sampler = Sampler()
    sampler.add("r", 3)
    first = [sampler.sample(torch.zeros(1, 1000), ["r"], [sp()])[0] for _ in range(3)]
    sampler.remove("r")
    sampler.add("r", 3)
    again = [sampler.sample(torch.zeros(1, 1000), ["r"], [sp()])[0] for _ in range(3)]
    assert first == again


def test_greedy_and_drawn_rows_in_one_step():
    """Greedy rows (one argmax for the step) and drawn rows (one at a time) keep their places,
    each row's token as if it were sampled alone; all-greedy, all-drawn and empty steps too."""
    logits = torch.randn(5, 60, generator=torch.Generator().manual_seed(4))
    params = [sp(temperature=0.0), sp(temperature=0.8, top_k=10), sp(temperature=0.0),
              sp(top_p=0.7), sp(temperature=2.0)]
    ids = [f"r{i}" for i in range(5)]
    crowd, alone = Sampler(), Sampler()
    for i, rid in enumerate(ids):
        crowd.add(rid, 40 + i)
        alone.add(rid, 40 + i)
    for rows in ([0, 1, 2, 3, 4], [1, 3, 4], [0, 2], [3]):
        step = crowd.sample(logits[rows], [ids[i] for i in rows], [params[i] for i in rows])
        solo = [alone.sample(logits[i:i + 1], [ids[i]], [params[i]])[0] for i in rows]
        assert step == solo, rows
        for i, token in zip(rows, step):
            if params[i].temperature == 0:
                assert token == int(logits[i].argmax())
    assert crowd.sample(logits[:0], [], []) == []


@pytest.mark.parametrize("num", range(1, 10))
def test_device_columns_start_each_row_on_16_bytes(num):
    columns = [[float(10 * row + i) for i in range(num)] for row in range(6)]
    values = device_columns(columns, torch.device("cpu"))
    assert values.shape == (6, num) and values.dtype == torch.float32
    assert values.tolist() == columns
    assert all(values[row].data_ptr() % 16 == 0 for row in range(6))



def test_a_drafted_stream_draws_the_uniforms_of_the_undrafted_one():
    """Rows of a drafted chunk each draw the next uniform; put_back returns those of the rows
    after the first rejected one. Seeded or greedy, beside a neighbour, the tokens and the
    uniforms left in the stream are those of one row per step."""
    from lorad.workers.ngram_draft import accepted_tokens

    def logits_after(tokens: list[int]) -> torch.Tensor:  # [vocab]: a fake model's row
        gen = torch.Generator().manual_seed(hash(tuple(tokens[-3:])) % 2**31)
        return torch.randn(12, generator=gen) * 3

    for params in (sp(temperature=0.8, top_k=6, seed=77), sp(temperature=0.0)):
        plain = Sampler()
        plain.add("a", 77)
        tokens = [1, 2]
        for _ in range(40):
            tokens.append(plain.sample(logits_after(tokens)[None], ["a"], [params])[0])
        drafted = Sampler()
        drafted.add("n", 5)  # a neighbour drawing from its own stream in the same steps
        drafted.add("a", 77)
        mine, step = [1, 2], 0
        while len(mine) < len(tokens):
            step += 1
            # a draft right for a while, then wrong: what a lookup would guess
            draft = tokens[len(mine):len(mine) + step % 4] + [0] * (step % 3)
            rows = [logits_after(mine + draft[:i]) for i in range(1 + len(draft))]
            ids = ["n"] + ["a"] * len(rows)
            sampled = drafted.sample(torch.stack([rows[0]] + rows), ids,
                                     [sp(seed=5)] + [params] * len(rows), keep_drawn=True)
            taken = accepted_tokens(sampled[1:], draft)
            drafted.put_back("a", len(taken))
            mine += taken
        assert mine[:len(tokens)] == tokens
        if params.temperature:
            assert len(set(tokens)) > 3
            extra = len(mine) - len(tokens)  # the last step may have emitted past the end
            for _ in range(extra):
                plain._next_uniform("a")
            assert [drafted._next_uniform("a") for _ in range(70)] == \
                [plain._next_uniform("a") for _ in range(70)]
