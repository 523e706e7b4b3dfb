"""Prefix caching in the planner and the block pool, without a model: which blocks a starting
sequence takes, what they are keyed by, what is registered and evicted, and that two planners
with one history decide alike."""

from __future__ import annotations

import random

from lorad.protocol.messages import SamplingParams
from lorad.workers.block_manager import BlockManager
from lorad.workers.planner import Planner, PlannerLimits
from lorad.workers.prefix_cache import block_hash, root_hash
from lorad.workers.sequence import Sequence

BLOCK = 4


def params(max_tokens=3, prompt_logprobs=-1) -> SamplingParams:
    return SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, max_tokens=max_tokens,
                          stop_token_ids=[], ignore_eos=True, prompt_logprobs=prompt_logprobs)


def planner(num_blocks=64, budget=64, max_num_seqs=8, caching=True,
            max_model_len=128) -> Planner:
    return Planner(PlannerLimits(max_num_seqs, budget, max_model_len),
                   BlockManager(num_blocks, BLOCK),
                   prefix_cache=caching)


_arrivals = iter(range(1, 10**6))


def admit(p: Planner, rid: str, prompt: list[int], key: str = "", **kw) -> Sequence:
    cache_prompt = kw.pop("cache_prompt", True)
    strength = kw.pop("strength", 1.0)
    seq = Sequence(rid, list(prompt), params(**kw), adapter_slot=1 if key else 0,
                   adapter_key=key, arrival=next(_arrivals), cache_prompt=cache_prompt,
                   adapter_strength=strength)
    assert p.admit(seq) is None
    return seq


def run_all(p: Planner, token: int = 7) -> list:
    plans = []
    while p.running or p.waiting:
        plan = p.plan()
        p.apply(plan, [token] * len(plan.sampled_request_ids))
        plans.append(plan)
    return plans


def first_chunk(plans, rid: str):
    return next(c for plan in plans for c in plan.chunks if c.request_id == rid)


PROMPT = list(range(100, 130))  # 30 tokens: 7 full blocks and 2 tokens


def test_hashes_chain_from_the_adapter_key():
    base, a = root_hash(""), root_hash("a" * 64)
    assert base != a and root_hash("") == base
    first = block_hash(base, [1, 2, 3, 4])
    assert block_hash(base, [1, 2, 3, 4]) == first
    assert block_hash(a, [1, 2, 3, 4]) != first  # same tokens, another identity
    assert block_hash(first, [5, 6, 7, 8]) != block_hash(base, [5, 6, 7, 8])  # the chain counts
    assert block_hash(base, [1, 2, 3, 5]) != first


def test_a_strength_other_than_one_roots_its_own_chain():
    key = "a" * 64
    assert root_hash(key, 1.0) == root_hash(key)  # 1.0: the roots the cache always had
    roots = {root_hash(key, x) for x in (0.0, 0.5, 1.0, 2.0, 4.0)}
    assert len(roots) == 5 and root_hash(key, 2) == root_hash(key, 2.0)
    assert root_hash("", 1.0) == root_hash("")


def test_strengths_share_blocks_only_with_their_own_strength():
    p = planner()
    key = "k" * 64
    for rid, strength in (("one", 1.0), ("half", 0.5), ("half-again", 0.5), ("two", 2.0),
                          ("one-again", 1.0)):
        admit(p, rid, PROMPT, key, strength=strength)
        plans = run_all(p)
        cached = {"half-again": 28, "one-again": 28}.get(rid, 0)
        chunk = first_chunk(plans, rid)
        assert chunk.start == cached and chunk.adapter_strength == strength, rid


def test_a_repeated_prompt_starts_past_its_cached_blocks():
    p = planner()
    admit(p, "a", PROMPT)
    plans = run_all(p)
    a_blocks = first_chunk(plans, "a").block_table
    b = admit(p, "b", PROMPT + [1, 2, 3, 4, 5])
    plans = run_all(p)
    chunk = first_chunk(plans, "b")
    # a computed 30 prompt + 2 output positions: 8 full blocks; b may take all 8 (its last
    # token, position 34, is in block 8) but a's 8th block holds a's output, not b's prompt.
    assert chunk.start == 7 * BLOCK and chunk.block_table[:7] == a_blocks[:7]
    assert b.num_cached_tokens == 28


def test_the_last_tokens_block_is_never_taken():
    p = planner()
    prompt = list(range(100, 100 + 6 * BLOCK))  # exactly 6 full blocks
    admit(p, "a", prompt)
    run_all(p)
    b = admit(p, "b", prompt)
    plans = run_all(p)
    assert first_chunk(plans, "b").start == 5 * BLOCK  # the 6th block runs again to sample
    assert b.num_cached_tokens == 5 * BLOCK


def test_other_identities_and_opt_outs_share_nothing():
    p = planner()
    admit(p, "base", PROMPT)
    run_all(p)
    others = [admit(p, "a", PROMPT, key="a" * 64), admit(p, "b", PROMPT, key="b" * 64),
              admit(p, "no", PROMPT, cache_prompt=False)]
    plans = run_all(p)
    for seq in others:
        assert first_chunk(plans, seq.request_id).start == 0 and seq.num_cached_tokens == 0
    again = admit(p, "a2", PROMPT, key="a" * 64)  # a's own key finds a's blocks
    plans = run_all(p)
    assert first_chunk(plans, "a2").start == 7 * BLOCK and again.num_cached_tokens == 28
    assert first_chunk(plans, "a2").block_table[0] != first_chunk(plans, "a2").block_table[1]


def test_an_opt_out_leaves_nothing_in_the_cache():
    p = planner()
    admit(p, "no", PROMPT, cache_prompt=False)
    run_all(p)
    assert p.blocks.num_cached_blocks == 0
    admit(p, "b", PROMPT)
    assert first_chunk(run_all(p), "b").start == 0


def test_echo_prompts_compute_every_position():
    p = planner()
    admit(p, "a", PROMPT)
    run_all(p)
    echo = admit(p, "e", PROMPT, max_tokens=0, prompt_logprobs=0)
    assert first_chunk(run_all(p), "e").start == 0 and echo.num_cached_tokens == 0


def test_live_sequences_share_blocks_and_free_them_to_the_cache():
    p = planner(budget=64)
    admit(p, "a", PROMPT, max_tokens=20)
    plan = p.plan()
    p.apply(plan, [7])
    admit(p, "b", PROMPT, max_tokens=20)
    plan = p.plan()
    chunk = next(c for c in plan.chunks if c.request_id == "b")
    shared = chunk.block_table[:7]
    assert chunk.start == 28 and all(p.blocks.ref_count(b) == 2 for b in shared)
    p.apply(plan, [7] * len(plan.sampled_request_ids))
    run_all(p)
    assert all(p.blocks.ref_count(b) == 0 for b in shared)
    assert p.blocks.num_free_blocks == p.blocks.num_blocks  # cached blocks count as free


def test_cached_blocks_are_evicted_least_recently_freed_first():
    p = planner(num_blocks=20, max_model_len=64)
    admit(p, "a", PROMPT[:17], max_tokens=1)  # 5 blocks, 4 of them full
    run_all(p)
    admit(p, "b", PROMPT[13:30], max_tokens=1)  # other tokens: 4 more cached blocks
    run_all(p)
    assert p.blocks.num_cached_blocks == 8 and p.blocks.num_evictions == 0
    admit(p, "big", list(range(500, 500 + 14 * BLOCK)), max_tokens=1)  # 15 of 20 blocks
    run_all(p)
    assert p.blocks.num_evictions > 0
    b = admit(p, "b2", PROMPT[13:30], max_tokens=1)
    run_all(p)
    a = admit(p, "a2", PROMPT[:17], max_tokens=1)
    run_all(p)
    # a's blocks were freed first, so they went first: b's survived.
    assert b.num_cached_tokens == 16 and a.num_cached_tokens < 16


def test_a_preempted_sequence_resumes_from_its_own_blocks():
    p = planner(num_blocks=12, budget=64, max_num_seqs=2, max_model_len=40)
    old = admit(p, "old", list(range(200, 216)), max_tokens=20)  # 4 blocks, grows to 9
    young = admit(p, "young", list(range(300, 320)), max_tokens=20)  # 5 blocks, grows to 10
    preempted = []
    for _ in range(40):
        if not (p.running or p.waiting):
            break
        plan = p.plan()
        preempted += plan.preempted
        restart = next((c for c in plan.chunks if c.request_id == "young" and "young"
                        in preempted and c.start > 0 and len(c.token_ids) > 1), None)
        if restart is not None:
            assert restart.start % BLOCK == 0  # it resumed past blocks it had cached itself
            break
        p.apply(plan, [7] * len(plan.sampled_request_ids))
    assert "young" in preempted and restart is not None
    assert young.num_cached_tokens == 0 and old.num_cached_tokens == 0


def test_a_failed_step_forgets_the_cache():
    p = planner()
    admit(p, "a", PROMPT)
    run_all(p)
    assert p.blocks.num_cached_blocks > 0
    admit(p, "b", PROMPT, max_tokens=5)
    p.drop_all()
    assert p.blocks.num_cached_blocks == 0 and p.blocks.num_free_blocks == p.blocks.num_blocks
    c = admit(p, "c", PROMPT)
    assert first_chunk(run_all(p), "c").start == 0 and c.num_cached_tokens == 0


def test_two_planners_with_one_history_agree():
    rng = random.Random(4)
    stems = [[rng.randrange(50, 90) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    traces = []
    for _ in range(2):
        p, trace, seqs = planner(num_blocks=40, budget=24), [], []
        local = random.Random(5)
        for i in range(60):
            if local.random() < 0.4:
                stem = stems[local.randrange(4)]
                seqs.append(admit(p, f"r{i}", stem + [local.randrange(50, 90) for _ in range(3)],
                                  key=local.choice(["", "k" * 64]),
                                  max_tokens=local.randrange(1, 6)))
            if p.running or p.waiting:
                plan = p.plan()
                p.apply(plan, [local.randrange(3, 9) for _ in plan.sampled_request_ids])
                trace.append([(c.request_id, c.start, tuple(c.block_table)) for c in plan.chunks])
        traces.append((trace, p.blocks.num_evictions, p.blocks.num_cached_blocks,
                       [s.num_cached_tokens for s in seqs]))
    assert traces[0] == traces[1]
    assert sum(traces[0][3]) > 0 and traces[0][1] > 0  # hits and evictions both happened
