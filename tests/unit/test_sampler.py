"""The leader's sampler: greedy, per-request seeds, and warpers against plain references."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from lorad.protocol.messages import SamplingParams
from lorad.workers.sampler import Sampler, warp, warp_rows


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


@pytest.mark.parametrize("rows_together", [True, False])
def test_same_seed_same_tokens_whatever_the_neighbours(rows_together):
    gen = torch.Generator().manual_seed(2)
    steps = [torch.randn(4, 40, generator=gen) for _ in range(12)]  # [rows, vocab] per step
    params = sp(temperature=0.9, top_p=0.95, top_k=20, seed=1234)

    alone = Sampler(rows_together)
    alone.add("a", 1234)
    solo = [alone.sample(step[:1], ["a"], [params])[0] for step in steps]

    crowded = Sampler(rows_together)
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


def test_removed_request_forgets_its_generator():
    sampler = Sampler()
    sampler.add("r", 3)
    first = [sampler.sample(torch.zeros(1, 1000), ["r"], [sp()])[0] for _ in range(3)]
    sampler.remove("r")
    sampler.add("r", 3)
    again = [sampler.sample(torch.zeros(1, 1000), ["r"], [sp()])[0] for _ in range(3)]
    assert first == again


# --- the batched sampler against one row at a time ------------------------------------------

def row_by_row_warp(row: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """What the sampler did before it warped a step's rows together: one row, op by op."""
    row = row / temperature
    if 0 < top_k < row.shape[-1]:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=False, stable=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[-1] = False
        row = row.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return row


def row_by_row_sample(generators: dict, logits, request_ids, params) -> list[int]:
    chosen = []
    for row, rid, p in zip(logits.float(), request_ids, params):
        if p.temperature == 0:
            chosen.append(int(torch.argmax(row)))
            continue
        probs = torch.softmax(row_by_row_warp(row, p.temperature, p.top_k, p.top_p), dim=-1)
        u = torch.rand((), generator=generators[rid], dtype=torch.float32)
        cdf = probs.cumsum(dim=-1)
        chosen.append(min(int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True)),
                          probs.shape[-1] - 1))
    return chosen


MIXED = [sp(temperature=0.0), sp(temperature=0.7, top_p=0.9), sp(temperature=1.0, top_k=5),
         sp(temperature=1.3, top_k=40, top_p=0.5), sp(temperature=0.7), sp(temperature=0.0),
         sp(temperature=1.0, top_p=0.999, top_k=1)]


@pytest.mark.parametrize("rows_together", [True, False])
@pytest.mark.parametrize("ties", [False, True])
def test_batched_rows_equal_row_by_row(ties, rows_together):
    """Whole steps of mixed parameters: the batched warp gives each row the bits of warping it
    alone, and the sampler, taking the rows together (as on a GPU) or one by one (as on the
    CPU), draws the tokens the row-by-row reference draws from the same seeds. With ties
    (logits rounded to a coarse grid, as bf16 logits often tie) too."""
    gen = torch.Generator().manual_seed(11)
    sampler = Sampler(rows_together)
    generators = {}
    ids = [f"r{i}" for i in range(len(MIXED))]
    for i, rid in enumerate(ids):
        sampler.add(rid, 100 + i)
        generators[rid] = torch.Generator().manual_seed(100 + i)
    for step in range(6):
        logits = torch.randn(len(MIXED), 300, generator=gen) * 3
        if ties:
            logits = (logits * 2).round() / 2
        rows = [i for i in range(len(MIXED)) if MIXED[i].temperature != 0]
        batched = warp_rows(logits[rows], [MIXED[i] for i in rows])
        for j, i in enumerate(rows):
            p = MIXED[i]
            assert torch.equal(batched[j], row_by_row_warp(logits[i], p.temperature, p.top_k,
                                                           p.top_p)), (step, i)
        assert sampler.sample(logits, ids, MIXED) == \
            row_by_row_sample(generators, logits, ids, MIXED), step


@pytest.mark.parametrize("rows_together", [True, False])
def test_all_greedy_and_all_drawn_steps(rows_together):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    sampler = Sampler(rows_together)
    for rid in ("a", "b", "c"):
        sampler.add(rid, 5)
    assert sampler.sample(logits, ["a", "b", "c"], [sp(temperature=0.0)] * 3) == \
        logits.argmax(dim=-1).tolist()
    generators = {rid: torch.Generator().manual_seed(5) for rid in ("a", "b", "c")}
    drawn = [sp(temperature=0.8, top_k=10), sp(top_p=0.7), sp(temperature=2.0)]
    assert sampler.sample(logits, ["a", "b", "c"], drawn) == \
        row_by_row_sample(generators, logits, ["a", "b", "c"], drawn)
    assert sampler.sample(logits[:0], [], []) == []
