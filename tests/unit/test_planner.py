"""The step planner on its own: fake sampled ids, no model, no torch."""

from __future__ import annotations

from lorad.protocol.messages import SamplingParams
from lorad.workers.block_manager import BlockManager
from lorad.workers.planner import Planner, PlannerLimits
from lorad.workers.sequence import Sequence, SeqStatus


def params(max_tokens=100, stop=(), ignore_eos=False, request_stop=(),
           min_tokens=0) -> SamplingParams:
    return SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, max_tokens=max_tokens,
                          stop_token_ids=list(stop), ignore_eos=ignore_eos,
                          request_stop_token_ids=list(request_stop), min_tokens=min_tokens)


def seq(rid: str, prompt_len: int, arrival: int, **kw) -> Sequence:
    prompt = [1000 * arrival + i for i in range(prompt_len)]
    return Sequence(rid, prompt, params(**kw), adapter_slot=arrival % 3, adapter_key="",
                    arrival=arrival)


def planner(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, max_model_len=64) -> Planner:
    return Planner(PlannerLimits(max_num_seqs, budget, max_model_len),
                   BlockManager(num_blocks, block_size))


def step(p: Planner, token=7):
    plan = p.plan()
    events = p.apply(plan, [token] * len(plan.sampled_request_ids))
    return plan, events


def test_chunked_prefill_under_budget_samples_only_at_the_end():
    p = planner(budget=8)
    p.admit(seq("a", 20, 1))
    plans = [step(p) for _ in range(3)]
    assert [(c.start, len(c.token_ids), c.sample) for pl, _ in plans for c in pl.chunks] == \
        [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert plans[0][1] == [] and plans[1][1] == []
    (event,) = plans[2][1]
    assert (event.request_id, event.token_ids, event.finish_reason, event.num_prompt_tokens) == \
        ("a", [7], None, 20)
    assert plans[2][0].chunks[0].token_ids == p.running[0].prompt_ids[16:]


def test_budget_is_shared_oldest_first():
    p = planner(budget=10)
    p.admit(seq("a", 6, 1))
    p.admit(seq("b", 6, 2))
    plan, _ = step(p)
    assert [(c.request_id, len(c.token_ids), c.sample) for c in plan.chunks] == \
        [("a", 6, True), ("b", 4, False)]
    plan, _ = step(p)  # a decodes first, then b finishes its prompt
    assert [(c.request_id, c.start, len(c.token_ids), c.sample) for c in plan.chunks] == \
        [("a", 6, 1, True), ("b", 4, 2, True)]


def test_decodes_batch_and_carry_their_last_sampled_token():
    p = planner(budget=16)
    for i, rid in enumerate("abc", start=1):
        p.admit(seq(rid, 3, i))
    step(p, token=5)
    p.admit(seq("d", 30, 4))
    plan, events = step(p, token=9)
    assert [(c.request_id, c.token_ids, c.start, c.sample) for c in plan.chunks[:3]] == \
        [("a", [5], 3, True), ("b", [5], 3, True), ("c", [5], 3, True)]
    assert (plan.chunks[3].request_id, len(plan.chunks[3].token_ids)) == ("d", 13)
    assert [e.request_id for e in events] == ["a", "b", "c"]
    assert all(s.output_ids == [5, 9] for s in p.running[:3])


def test_blocks_are_allocated_lazily():
    p = planner(num_blocks=16, block_size=4)
    p.admit(seq("a", 5, 1))
    plan, _ = step(p)
    assert len(plan.chunks[0].block_table) == 2 and p.blocks.num_free_blocks == 14
    for _ in range(3):  # positions 5, 6, 7 fit the second block
        step(p)
    assert p.blocks.num_free_blocks == 14
    plan, _ = step(p)  # position 8 needs a third
    assert plan.chunks[0].start == 8 and len(plan.chunks[0].block_table) == 3
    assert p.blocks.num_free_blocks == 13


def test_preemption_is_newest_first_and_recomputes_later():
    # 4 blocks of 4: two sequences of 6 prompt tokens fill them after 2 decodes each.
    p = planner(num_blocks=4, block_size=4, budget=16, max_model_len=16)
    p.admit(seq("old", 6, 1))
    p.admit(seq("new", 6, 2))
    step(p, token=1)  # prefill both: positions 0..5 in 2 blocks each
    step(p, token=2)
    assert p.blocks.num_free_blocks == 0
    step(p, token=3)  # position 7 still fits the second block
    plan, events = step(p, token=4)  # position 8 needs a third block each: the newest yields
    assert plan.preempted == ["new"]
    assert [c.request_id for c in plan.chunks] == ["old"]
    new = p.waiting[0]
    assert (new.request_id, new.status, new.num_computed, new.block_table) == \
        ("new", SeqStatus.WAITING, 0, [])
    assert new.output_ids == [1, 2, 3]
    while p.waiting:  # old runs on until it finishes at max_model_len, then new recomputes
        plan, events = step(p, token=5)
    recompute = next(c for c in plan.chunks if c.request_id == "new")
    assert recompute.start == 0 and recompute.token_ids == new.prompt_ids + [1, 2, 3]
    assert recompute.sample
    assert [e.token_ids for e in events if e.request_id == "new"] == [[5]]


def test_decode_preempts_itself_when_no_newer_sequence_exists():
    p = planner(num_blocks=3, block_size=4, budget=16, max_model_len=12)
    p.admit(seq("old", 4, 1))
    p.admit(seq("new", 4, 2))
    step(p, token=1)  # one block each, one free
    plan, _ = step(p, token=2)  # both need a block for position 4: old takes the last one
    assert plan.preempted == ["new"] and [c.request_id for c in plan.chunks] == ["old"]
    assert p.waiting[0].output_ids == [1] and p.blocks.num_free_blocks == 1
    for _ in range(6):  # old runs alone to max_model_len; new cannot restart meanwhile
        plan, events = step(p, token=3)
        assert [c.request_id for c in plan.chunks] == ["old"]
    assert events[0].finish_reason == "length" and p.blocks.num_free_blocks == 3
    plan, events = step(p, token=4)
    assert [(c.request_id, c.start, len(c.token_ids), c.sample) for c in plan.chunks] == \
        [("new", 0, 5, True)]
    assert events[0].token_ids == [4] and p.running[0].output_ids == [1, 4]


def test_stop_token_is_included_and_ignore_eos_skips_it():
    p = planner()
    p.admit(seq("a", 3, 1, stop=[2]))
    p.admit(seq("b", 3, 2, stop=[2], ignore_eos=True))
    _, events = step(p, token=2)
    assert [(e.request_id, e.token_ids, e.finish_reason) for e in events] == \
        [("a", [2], "stop"), ("b", [2], None)]
    assert [s.request_id for s in p.live()] == ["b"]
    assert p.blocks.num_free_blocks == 63


def test_request_stop_ids_stop_even_with_ignore_eos_and_min_tokens_holds_every_stop():
    p = planner()
    p.admit(seq("a", 3, 1, stop=[2], request_stop=[5], ignore_eos=True))
    p.admit(seq("b", 3, 2, stop=[2], request_stop=[5], min_tokens=2))
    _, events = step(p, token=5)
    assert [(e.request_id, e.finish_reason) for e in events] == [("a", "stop"), ("b", None)]
    _, events = step(p, token=2)  # b's second token: min_tokens generated, an EOS stops it
    assert [(e.request_id, e.token_ids, e.finish_reason) for e in events] == [("b", [2], "stop")]


def test_max_tokens_and_max_model_len_finish_with_length():
    p = planner(max_model_len=10)
    p.admit(seq("a", 3, 1, max_tokens=2))
    p.admit(seq("b", 8, 2))
    _, events = step(p)
    assert [e.finish_reason for e in events] == [None, None]
    _, events = step(p)  # a has 2 tokens; b reaches 10 = max_model_len
    assert [(e.request_id, e.finish_reason) for e in events] == [("a", "length"), ("b", "length")]
    assert p.live() == [] and p.blocks.num_free_blocks == 64


def test_prompt_at_max_model_len_ends_at_once():
    p = planner(max_model_len=10)
    p.admit(seq("a", 10, 1))
    plan, events = step(p)
    assert plan.chunks == []
    assert [(e.request_id, e.token_ids, e.finish_reason) for e in events] == [("a", [], "length")]


def test_cancel_running_and_waiting_frees_blocks():
    p = planner(max_num_seqs=1)
    p.admit(seq("a", 9, 1))
    p.admit(seq("b", 3, 2))
    step(p)
    assert p.blocks.num_free_blocks == 61 and [s.request_id for s in p.waiting] == ["b"]
    assert p.cancel("a") and p.cancel("b")
    assert not p.cancel("a") and not p.cancel("never")
    plan, events = step(p)
    assert plan.chunks == []
    assert [(e.request_id, e.finish_reason) for e in events] == \
        [("a", "cancelled"), ("b", "cancelled")]
    assert p.blocks.num_free_blocks == 64 and p.live() == []


def test_max_num_seqs_bounds_running():
    p = planner(max_num_seqs=2, budget=64)
    for i in range(1, 5):
        p.admit(seq(f"r{i}", 3, i, max_tokens=2))
    plan, _ = step(p)
    assert [c.request_id for c in plan.chunks] == ["r1", "r2"]
    plan, _ = step(p)  # r1, r2 finish on their second token
    assert [c.request_id for c in plan.chunks] == ["r1", "r2"]
    plan, _ = step(p)
    assert [c.request_id for c in plan.chunks] == ["r3", "r4"]


def test_refusals_and_identical_plans_on_two_planners():
    a, b = planner(budget=8), planner(budget=8)
    for p in (a, b):
        assert p.admit(seq("x", 0, 1)) is not None
        assert p.admit(seq("y", 11, 2)) is None
        assert p.admit(seq("y", 11, 3)) is not None
        p.admit(seq("z", 5, 4))
    for _ in range(6):
        pa, ea = step(a)
        pb, eb = step(b)
        assert pa == pb and ea == eb
