"""The choices of one prompt in the planner (fork.py): one prefill, a fork into n sequences that
share its blocks by reference count, copies on write, frees, preemption, cancels and the live-set
digest. Fake sampled ids, no model, no torch."""

from __future__ import annotations

import random

from lorad.protocol.messages import SamplingParams, choice_ids
from lorad.workers.agreement import live_digest
from lorad.workers.block_manager import BlockManager
from lorad.workers.planner import Planner, PlannerLimits
from lorad.workers.sequence import Sequence


def params(max_tokens=100, ignore_eos=True) -> SamplingParams:
    return SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, max_tokens=max_tokens,
                          stop_token_ids=[3], ignore_eos=ignore_eos)


def choices(rid: str, prompt_len: int, arrival: int, n: int, **kw) -> Sequence:
    ids = choice_ids(rid, n)
    return Sequence(ids[0], [10 + i for i in range(prompt_len)], params(**kw), 0, "",
                    arrival=arrival, fork_ids=ids[1:])


def planner(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, max_model_len=64) -> Planner:
    return Planner(PlannerLimits(max_num_seqs, budget, max_model_len),
                   BlockManager(num_blocks, block_size))


def step(p: Planner, tokens=None):
    plan = p.plan()
    num = len(plan.sampled_request_ids)
    events = p.apply(plan, tokens[:num] if tokens else [7] * num)
    return plan, events


def held_refs(p: Planner) -> dict[int, int]:
    """block -> how many live tables hold it."""
    refs: dict[int, int] = {}
    for seq in p.live():
        for block in seq.block_table:
            refs[block] = refs.get(block, 0) + 1
    return refs


def assert_consistent(p: Planner) -> None:
    refs = held_refs(p)
    assert {b: p.blocks.ref_count(b) for b in refs} == refs
    assert p.blocks.num_free_blocks == p.blocks.num_blocks - len(refs)
    assert p.blocks.num_shared == sum(1 for r in refs.values() if r > 1)


def test_one_prefill_then_four_choices_sharing_its_blocks():
    p = planner()
    p.admit(choices("a", 6, 1, 4))
    plan, events = step(p, [5, 6, 7, 8])
    (chunk,) = plan.chunks  # the prompt runs once
    assert (chunk.request_id, len(chunk.token_ids), chunk.sample) == ("a/0", 6, True)
    assert plan.forks == {"a/0": ["a/1", "a/2", "a/3"]}
    assert plan.sampled_request_ids == ["a/0", "a/1", "a/2", "a/3"]
    assert plan.logits_rows == [0, 0, 0, 0]  # every choice's first token from the same row
    assert [(e.request_id, e.token_ids) for e in events] == [
        ("a/0", [5]), ("a/1", [6]), ("a/2", [7]), ("a/3", [8])]
    tables = [s.block_table for s in p.live()]
    assert tables == [[0, 1]] * 4
    assert p.blocks.ref_count(0) == p.blocks.ref_count(1) == 4
    assert p.blocks.num_free_blocks == 62
    assert_consistent(p)
    # Each choice's first decode writes position 6, in the shared partial block 1: the first
    # three get a copy, the last holder writes in place. Block 0 (full) stays shared.
    plan, _ = step(p)
    assert plan.block_copies == [(1, 2), (1, 3), (1, 4)]
    assert [c.block_table for c in plan.chunks] == [[0, 2], [0, 3], [0, 4], [0, 1]]
    assert [(c.start, c.token_ids) for c in plan.chunks] == [(6, [5]), (6, [6]), (6, [7]),
                                                              (6, [8])]
    assert p.blocks.ref_count(0) == 4 and p.blocks.num_shared == 1
    assert_consistent(p)
    plan, _ = step(p)
    assert plan.block_copies == []
    assert_consistent(p)


def test_a_block_aligned_prompt_needs_no_copy_and_all_blocks_return():
    p = planner()
    p.admit(choices("a", 8, 1, 3, max_tokens=5))
    p.admit(choices("b", 3, 2, 1, max_tokens=5))
    copies = []
    while p.live():
        plan, _ = step(p)
        copies += plan.block_copies
        assert_consistent(p)
    assert copies == [] and p.blocks.num_free_blocks == 64 and p.blocks.num_shared == 0


def test_choices_that_end_at_their_first_token_free_only_their_references():
    p = planner()
    p.admit(choices("a", 5, 1, 3, max_tokens=1))
    _, events = step(p)
    assert [(e.request_id, e.finish_reason) for e in events] == [
        ("a/0", "length"), ("a/1", "length"), ("a/2", "length")]
    assert p.live() == [] and p.blocks.num_free_blocks == 64 and p.blocks.num_shared == 0


def test_cancels_before_the_fork():
    p = planner(budget=4)
    p.admit(choices("a", 10, 1, 4))
    step(p)  # 4 of 10 prompt tokens
    assert p.cancel("a/2")  # not forked yet: dropped from the list
    assert p.cancel("a/0")  # the prefilling choice: a/1 takes its sequence over
    assert not p.cancel("a/0") and not p.cancel("a/2")
    assert [s.request_id for s in p.live()] == ["a/1"] and p.live()[0].fork_ids == ["a/3"]
    assert p.live()[0].num_computed == 4  # its prefill goes on, nothing recomputed
    plan, events = step(p)
    assert [(e.request_id, e.finish_reason) for e in events] == [
        ("a/2", "cancelled"), ("a/0", "cancelled")]
    plan, events = step(p)
    assert plan.forks == {"a/1": ["a/3"]} and [e.request_id for e in events] == ["a/1", "a/3"]
    assert_consistent(p)


def test_admission_refusals_and_immediate_ends_name_every_choice():
    p = planner(max_num_seqs=4)
    assert "5 choices" in p.admit(choices("a", 3, 1, 5))
    assert p.admit(choices("b", 3, 2, 2, max_tokens=0)) is None
    assert p.admit(choices("c", 3, 3, 2)) is None
    assert "already live" in p.admit(choices("c", 3, 4, 2))
    _, events = step(p)
    assert [(e.request_id, e.finish_reason) for e in events[:2]] == [
        ("b/0", "length"), ("b/1", "length")]


def test_a_failed_step_drops_the_choices_not_forked_yet():
    p = planner(budget=4)
    p.admit(choices("a", 10, 1, 3))
    step(p)
    assert p.drop_all() == ["a/0", "a/1", "a/2"]
    assert p.blocks.num_free_blocks == 64 and not p.forks.unforked


def test_width_counts_choices_before_they_fork():
    p = planner(max_num_seqs=4)
    p.admit(choices("a", 3, 1, 3))
    p.admit(choices("b", 3, 2, 2))  # 3 + 2 > 4: waits for room
    plan, _ = step(p)
    assert [c.request_id for c in plan.chunks] == ["a/0"]
    assert len(p.running) == 3 and [s.request_id for s in p.waiting] == ["b/0"]


def test_the_digest_covers_forks_and_each_choices_table():
    one, other = planner(), planner()
    one.admit(choices("a", 6, 1, 3))
    other.admit(choices("a", 6, 1, 3))
    assert live_digest(one.live()) == live_digest(other.live())
    assert other.cancel("a/2")
    assert live_digest(one.live()) != live_digest(other.live())  # a choice fewer to fork
    one, other = planner(), planner()
    for p in (one, other):
        p.admit(choices("a", 6, 1, 3))
        step(p)
    assert live_digest(one.live()) == live_digest(other.live())
    other.live()[2].block_table[1] = 9  # a rank whose child holds another block
    assert live_digest(one.live()) != live_digest(other.live())


def test_preempted_choices_release_their_references():
    p = planner(num_blocks=8, block_size=4, budget=32, max_model_len=32)
    p.admit(choices("a", 6, 1, 4, max_tokens=12))
    p.admit(choices("b", 3, 2, 1, max_tokens=12))
    num_preempted = 0
    while p.live():
        plan, _ = step(p)
        num_preempted += len(plan.preempted)
        assert_consistent(p)
    assert num_preempted > 0
    assert p.blocks.num_free_blocks == 8 and p.blocks.num_shared == 0


def test_random_traces_keep_every_reference_counted():
    for seed in range(40):
        rng = random.Random(seed)
        p = planner(num_blocks=rng.choice([12, 20, 40]), block_size=rng.choice([2, 4]),
                    max_num_seqs=rng.choice([4, 8]), budget=rng.choice([6, 32]),
                    max_model_len=24)
        pending: list[str] = []
        for arrival in range(1, 120):
            if rng.random() < 0.25:
                n = rng.randrange(1, 5)
                seq = choices(f"r{arrival}", rng.randrange(1, 12), arrival, n,
                              max_tokens=rng.randrange(1, 10), ignore_eos=rng.random() < 0.5)
                p.admit(seq)
                pending += choice_ids(f"r{arrival}", n)
            if rng.random() < 0.1 and pending:
                p.cancel(pending.pop(rng.randrange(len(pending))))
            plan = p.plan()
            p.apply(plan, [rng.choice([3, 5, 6]) for _ in plan.sampled_request_ids])
            assert_consistent(p)
        while p.live():
            step(p)
        assert p.blocks.num_free_blocks == p.blocks.num_blocks, seed
        assert p.blocks.num_shared == 0 and not p.forks.unforked
