"""The planner's side of the disk spill, without files: which evicted blocks are written, when
they become findable (only once every rank finished them), the budget and the queue bound, and
how a prompt restores spilled blocks over two steps, with a failed read dropping its hash."""

from __future__ import annotations

from lorad.protocol.messages import SamplingParams
from lorad.workers.block_manager import BlockManager
from lorad.workers.planner import Planner, PlannerLimits
from lorad.workers.sequence import Sequence
from lorad.workers.spill_index import SpillIndex

BLOCK = 4
H = [bytes([i]) * 16 for i in range(10)]


def test_a_write_is_findable_only_once_every_rank_finished_it():
    index, deletes = SpillIndex(max_blocks=3, max_pending=4), []
    assert index.plan_write(H[0], deletes) and index.plan_write(H[1], deletes)
    assert not index.plan_write(H[0], deletes)  # being written already
    assert index.cached_run([H[0], H[1]]) == 0 and index.num_pending == 2
    index.agreed(1)
    assert index.cached_run([H[0], H[1]]) == 1 and H[0] in index
    index.agreed(0)  # an older minimum changes nothing
    assert index.cached_run([H[0], H[1]]) == 1
    index.agreed(2)
    assert index.cached_run([H[0], H[1], H[2]]) == 2 and deletes == []


def test_the_budget_deletes_the_least_recently_used_and_the_queue_is_bounded():
    index, deletes = SpillIndex(max_blocks=2, max_pending=3), []
    for h in H[:2]:
        index.plan_write(h, deletes)
    index.agreed(2)
    index.touch([H[0]])  # H[1] is now the least recently used
    assert index.plan_write(H[2], deletes) and deletes == [H[1]]
    assert H[1] not in index and index.num_pending == 2
    assert not index.plan_write(H[3], deletes)  # a delete and a write more would pass 3
    index.agreed(4)
    index.drop([H[0], H[9]], deletes)  # H[9] was never held
    assert deletes == [H[1], H[0]] and H[0] not in index and len(index) == 1


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, max_tokens=1,
                          stop_token_ids=[], ignore_eos=True)


def run(planner: Planner, rid: str, prompt: list[int], arrival: int,
        failures: int = 0) -> list:
    """Run one request to its end, agreeing every issued spill operation as finished on every
    rank before each step and `failures` for the first step after a plan with reads."""
    seq = Sequence(rid, prompt, params(), 0, "", arrival)
    planner.admit(seq)
    plans = []
    while planner.running or planner.waiting:
        planner.agree_spill(10**9, failures if plans and plans[-1].spill_reads else 0)
        plan = planner.plan()
        planner.apply(plan, [5] * len(plan.sampled_request_ids))
        plans.append(plan)
    return plans


def spilled_planner() -> tuple[Planner, list[int], list]:
    planner = Planner(PlannerLimits(2, 64, 32), BlockManager(12, BLOCK), prefix_cache=True,
                      spill=SpillIndex(max_blocks=100, max_pending=64))
    prompt = list(range(100, 121))  # 5 full blocks before the last token's
    run(planner, "a", prompt, 1)
    writes = [w for i in range(3) for plan in run(planner, f"x{i}",
                                                  list(range(200 + 40 * i, 230 + 40 * i)), 2 + i)
              for w in plan.spill_writes]
    return planner, prompt, writes


def test_evicted_blocks_are_written_and_a_prompt_restores_them_over_two_steps():
    planner, prompt, writes = spilled_planner()
    assert len(writes) >= 5  # a's blocks among them, written before anything reused them
    plans = run(planner, "b", prompt, 9)
    reads = plans[0].spill_reads
    assert len(reads) == 5 and not plans[0].chunks  # b waits while its blocks are read
    assert [c.start for c in plans[1].chunks if c.request_id == "b"] == [5 * BLOCK]
    assert planner.blocks.num_free_blocks == planner.blocks.num_blocks


def test_a_read_failed_on_any_rank_is_recomputed_and_dropped_everywhere():
    planner, prompt, _ = spilled_planner()
    plans = run(planner, "b", prompt, 9, failures=0b100)  # the third read failed somewhere
    third = plans[0].spill_reads[2][1]
    assert [c.start for c in plans[1].chunks if c.request_id == "b"] == [2 * BLOCK]
    assert third in plans[1].spill_deletes and third not in planner.reuse.spill
    # Blocks b computed again are cached now; the next run takes all of them from memory.
    again = run(planner, "c", prompt, 10)
    assert not again[0].spill_reads and again[0].chunks[0].start == 5 * BLOCK


def test_two_planners_with_one_history_decide_alike():
    first, second = spilled_planner(), spilled_planner()
    assert first[2] == second[2]
    assert ([p.spill_reads for p in run(first[0], "b", first[1], 9)]
            == [p.spill_reads for p in run(second[0], "b", second[1], 9)])
