"""AdapterSlots (the planner's device slot decisions) and the planner's use of them: placement,
LRU eviction of unread adapters only, pins, a failed copy, unloads, and sequences that start only
once their adapter's copy is agreed, in queue order, with those behind whose adapters are in a
slot going ahead meanwhile."""

from __future__ import annotations

import pytest

from lorad.protocol.messages import SamplingParams
from lorad.workers.adapter_slots import AdapterSlots
from lorad.workers.block_manager import BlockManager
from lorad.workers.planner import Planner, PlannerLimits
from lorad.workers.sequence import Sequence


def test_free_slots_first_then_the_least_recently_used_unread_adapter():
    slots = AdapterSlots(2)
    assert slots.place(7, set()) and slots.place(8, set())
    assert slots.take_fetches() == [(7, 1), (8, 2)]
    assert not slots.is_ready(7)
    slots.fetched(7, 1, True)
    slots.fetched(8, 2, True)
    slots.acquire(7)
    slots.release(7)  # 7 used after 8: 8 is the least recently used
    assert slots.place(9, set()) and slots.take_fetches() == [(9, 2)]
    assert slots.slot_of == {7: 1, 9: 2} and slots.num_evictions == 1


def test_read_pinned_copying_and_kept_adapters_are_never_evicted():
    slots = AdapterSlots(2, resident={1: 1, 2: 2}, pinned={1})
    slots.acquire(2)
    assert not slots.place(3, set())  # 1 pinned, 2 read by a running sequence
    slots.release(2)
    assert not slots.place(3, {2})  # 2 kept for a sequence ahead in the queue
    assert slots.place(3, set()) and slots.take_fetches() == [(3, 2)]
    assert not slots.place(4, set())  # 3's copy is pending
    assert slots.num_loads == 2


def test_a_failed_copy_gives_its_slot_back():
    slots = AdapterSlots(1)
    slots.place(5, set())
    slots.fetched(5, 1, False)
    assert slots.slot_of == {} and slots.num_loads == 0
    with pytest.raises(RuntimeError):
        slots.fetched(5, 1, True)


def test_an_unloaded_adapter_leaves_once_its_readers_end():
    slots = AdapterSlots(1, resident={4: 1})
    slots.acquire(4)
    slots.forget(4)
    assert slots.slot_of == {4: 1}
    slots.release(4)
    assert slots.slot_of == {} and slots.digest_text() == "|[]"


def _seq(rid: str, arrival: int, adapter_id: int) -> Sequence:
    sampling = SamplingParams(0.0, 1.0, 0, 0, 4, [], True)
    return Sequence(rid, [1, 2, 3], sampling, 0, f"k{adapter_id}" if adapter_id else "",
                    arrival, adapter_id=adapter_id)


def test_the_planner_starts_a_sequence_once_its_adapters_copy_is_agreed():
    planner = Planner(PlannerLimits(8, 64, 32), BlockManager(32, 4),
                      adapters=AdapterSlots(1, resident={1: 1}))
    for rid, arrival, adapter_id in (("r1", 1, 1), ("r2", 2, 2), ("r3", 3, 0)):
        assert planner.admit(_seq(rid, arrival, adapter_id)) is None
    plan = planner.plan()
    # r1 starts in slot 1; r2's adapter has no slot while r1 reads slot 1: r2 and, behind it,
    # r3 wait (first come, first served).
    assert [(c.request_id, c.adapter_slot) for c in plan.chunks] == [("r1", 1)]
    assert plan.adapter_fetches == []
    planner.apply(plan, [5])
    planner.cancel("r1")
    plan = planner.plan()
    # r2's copy into the freed slot is planned, and r3 (no adapter) goes ahead while it runs.
    assert plan.adapter_fetches == [(2, 1)]
    assert [(c.request_id, c.adapter_slot) for c in plan.chunks] == [("r3", 0)]
    planner.apply(plan, [5])
    assert [c.request_id for c in planner.plan().chunks] == ["r3"]  # the copy is not agreed
    planner.adapter_fetched(2, 1, True)
    plan = planner.plan()
    assert [(c.request_id, c.adapter_slot) for c in plan.chunks] == [("r3", 0), ("r2", 1)]


def test_while_a_copy_runs_those_behind_go_ahead_leaving_its_blocks_and_its_place():
    """r1's adapter is being copied: r2 (resident adapter), r3 and r4 (base) start meanwhile,
    r5 does not (it would take the last of the 4 places among the running sequences, which r1
    keeps); r1 starts as soon as its copy is agreed."""
    planner = Planner(PlannerLimits(4, 64, 32), BlockManager(32, 4),
                      adapters=AdapterSlots(2, resident={2: 1}))
    for rid, arrival, adapter_id in (("r1", 1, 1), ("r2", 2, 2), ("r3", 3, 0), ("r4", 4, 0),
                                     ("r5", 5, 2)):
        planner.admit(_seq(rid, arrival, adapter_id))
    plan = planner.plan()
    assert plan.adapter_fetches == [(1, 2)]
    assert [c.request_id for c in plan.chunks] == ["r2", "r3", "r4"]
    planner.apply(plan, [5, 5, 5])
    assert [c.request_id for c in planner.plan().chunks] == ["r2", "r3", "r4"]
    planner.adapter_fetched(1, 2, True)
    plan = planner.plan()
    assert [c.request_id for c in plan.chunks] == ["r2", "r3", "r4", "r1"]  # decodes first
    assert [s.request_id for s in planner.waiting] == ["r5"]


def test_those_that_go_ahead_leave_the_blocks_of_the_waiting_prompt():
    """8 blocks of 4 tokens: r1 (adapter 1, being copied) needs 5 blocks for its 17-token
    prompt, so r2 (3 blocks) may go ahead and r3 (1 block) may not: 5 + 3 + 1 > 8."""
    planner = Planner(PlannerLimits(8, 64, 32), BlockManager(8, 4), adapters=AdapterSlots(1))
    sampling = SamplingParams(0.0, 1.0, 0, 0, 4, [], True)
    for rid, arrival, adapter_id, length in (("r1", 1, 1, 17), ("r2", 2, 0, 9), ("r3", 3, 0, 1)):
        planner.admit(Sequence(rid, list(range(1, length + 1)), sampling, 0,
                               f"k{adapter_id}" if adapter_id else "", arrival,
                               adapter_id=adapter_id))
    plan = planner.plan()
    assert plan.adapter_fetches == [(1, 1)]
    assert [c.request_id for c in plan.chunks] == ["r2"]


def test_a_failed_copy_ends_only_its_adapters_sequences():
    planner = Planner(PlannerLimits(8, 64, 32), BlockManager(32, 4), adapters=AdapterSlots(1))
    planner.admit(_seq("r1", 1, 3))
    planner.admit(_seq("r2", 2, 0))
    plan = planner.plan()
    assert plan.adapter_fetches == [(3, 1)]
    assert [c.request_id for c in plan.chunks] == ["r2"]  # goes ahead while the copy runs
    planner.apply(plan, [5])
    assert planner.adapter_fetched(3, 1, False) == ["r1"]
    assert [c.request_id for c in planner.plan().chunks] == ["r2"]


def test_no_adapter_starves_behind_a_resident_one():
    """One slot, adapter 1 resident and busy: a request for adapter 2 waits for the slot, and
    the adapter-1 requests that came after it wait behind it (nobody overtakes a head whose
    adapter has no slot: they would keep the slot busy)."""
    planner = Planner(PlannerLimits(8, 64, 32), BlockManager(64, 4),
                      adapters=AdapterSlots(1, resident={1: 1}))
    planner.admit(_seq("a0", 1, 1))
    planner.admit(_seq("b", 2, 2))
    for k in range(1, 5):
        planner.admit(_seq(f"a{k}", 2 + k, 1))
    started: list[str] = []
    fetches: list[tuple[int, int, list[str]]] = []  # (id, slot, started before it)
    for _ in range(60):
        plan = planner.plan()
        started += [c.request_id for c in plan.chunks if c.start == 0]
        fetches += [(a, slot, list(started)) for a, slot in plan.adapter_fetches]
        planner.apply(plan, [5] * len(plan.sampled_request_ids))
        for adapter_id in sorted(planner.adapters.fetching):  # agreed by the next step
            planner.adapter_fetched(adapter_id, planner.adapters.slot_of[adapter_id], True)
        if not planner.live():
            break
    # b's adapter comes in once a0 is done; adapter 1 comes back once b is done
    assert fetches == [(2, 1, ["a0"]), (1, 1, ["a0", "b"])]
    assert started == ["a0", "b", "a1", "a2", "a3", "a4"]
