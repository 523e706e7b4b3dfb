"""Admission on its own: the 503/429 checks, the queued count (admission to first token) and the
running count (first token to finish), in total and per model, a deadline that cancels the
generator it bounds (504), and a drain's cut (503) of every open request, including one cut while
its own deadline is already firing."""

from __future__ import annotations

import asyncio
import time

import pytest

from lorad.daemon.admission import Admission
from lorad.daemon.errors import ApiError
from lorad.daemon.generation import Delta, GenerationError


async def _deltas(num: int, gap_s: float, closed: list):
    """`num` one-token deltas `gap_s` apart; records that it was closed."""
    try:
        for i in range(1, num + 1):
            await asyncio.sleep(gap_s)
            yield Delta("x", "length" if i == num else None, 3, i)
    finally:
        closed.append(True)


def test_checks_refuse_while_not_serving_or_full():
    async def run():
        admission = Admission(max_queued=2, request_timeout=None)
        with pytest.raises(ApiError) as exc:
            admission.check("draining")
        assert exc.value.status == 503 and exc.value.headers["Retry-After"] == "5"
        with admission.ticket(time.monotonic()), admission.ticket(time.monotonic()):
            assert admission.num_queued == 2
            with pytest.raises(ApiError) as exc:
                admission.check("serving")
            assert exc.value.status == 429 and exc.value.code == "queue_full"
            assert exc.value.headers["Retry-After"] == "1"
        admission.check("serving")
        assert (admission.num_queued, admission.num_open) == (0, 0)

    asyncio.run(run())


def test_a_request_leaves_the_queue_at_its_first_token():
    async def run():
        admission, closed = Admission(max_queued=1, request_timeout=None), []
        with admission.ticket(time.monotonic()) as ticket:
            seen = []
            async for delta in admission.bounded(_deltas(3, 0.01, closed), ticket):
                seen.append((delta.num_completion_tokens, admission.num_queued))
            assert seen == [(1, 0), (2, 0), (3, 0)] and closed == [True]
            assert admission.num_open == 1
        assert admission.num_open == 0

    asyncio.run(run())


def test_the_deadline_cancels_and_closes_the_generator():
    async def run():
        admission, closed = Admission(max_queued=4, request_timeout=0.2), []
        started = time.monotonic()
        with admission.ticket(started) as ticket:
            with pytest.raises(GenerationError) as exc:
                async for _ in admission.bounded(_deltas(1000, 0.01, closed), ticket):
                    pass
        assert exc.value.status == 504 and exc.value.code == "request_timeout"
        assert 0.15 < time.monotonic() - started < 2 and closed == [True]

    asyncio.run(run())


def test_a_cut_ends_every_open_request_with_a_503():
    async def run():
        admission = Admission(max_queued=4, request_timeout=None)

        async def consume():
            closed = []
            with admission.ticket(time.monotonic()) as ticket:
                async for _ in admission.bounded(_deltas(1000, 0.01, closed), ticket):
                    pass

        tasks = [asyncio.create_task(consume()) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert admission.cut_all("shutting down") == 3
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, GenerationError) and r.status == 503 and r.code == "shutdown"
                   for r in results), results
        await asyncio.wait_for(admission.wait_idle(), 1)

    asyncio.run(run())


def test_a_cut_while_the_deadline_fires_does_not_raise():
    async def run():
        admission, closed = Admission(max_queued=4, request_timeout=0.05), []
        with admission.ticket(time.monotonic()) as ticket:
            consumer = asyncio.ensure_future(
                admission.bounded(_deltas(1000, 1.0, closed), ticket).__anext__())
            await asyncio.sleep(0.05)
            for _ in range(20):  # whatever state the timer is in, cutting is safe
                admission.cut_all("shutting down")
                await asyncio.sleep(0.005)
            with pytest.raises(GenerationError):
                await consumer

    asyncio.run(run())


def test_a_request_of_several_choices_is_admitted_whole_or_refused():
    async def run():
        admission = Admission(max_queued=4, request_timeout=None)
        with admission.ticket(time.monotonic(), 3) as ticket:
            assert admission.num_queued == 3
            admission.check("serving", 1)
            with pytest.raises(ApiError) as exc:
                admission.check("serving", 2)  # 3 + 2 > 4: nothing of it is admitted
            assert exc.value.status == 429 and "2 choices" in exc.value.message

            async def deltas():
                yield Delta("x", None, 3, 1, index=1)
                yield Delta("x", None, 3, 2, index=1)
                yield Delta("x", None, 3, 1, index=0)

            seen = [admission.num_queued async for _ in admission.bounded(deltas(), ticket)]
            assert seen == [2, 2, 1]
        assert admission.num_queued == 0

    asyncio.run(run())


def test_choices_count_as_queued_then_running_per_model():
    async def run():
        admission = Admission(max_queued=8, request_timeout=None)
        counts = []

        def snapshot():
            counts.append((admission.num_queued, admission.num_running,
                           dict(admission.queued_by_model), dict(admission.running_by_model)))

        async def deltas():
            yield Delta("x", None, 3, 1, index=1)
            yield Delta("x", None, 3, 2, index=1)
            yield Delta("x", "length", 3, 1, index=0)  # its first token is also its last
            yield Delta("x", "stop", 3, 3, index=1)

        with admission.ticket(time.monotonic(), 1, "tiny"):  # the base model: never started
            with admission.ticket(time.monotonic(), 2, "a") as ticket:
                snapshot()
                async for _ in admission.bounded(deltas(), ticket):
                    snapshot()
            snapshot()
        snapshot()
        assert counts == [
            (3, 0, {"tiny": 1, "a": 2}, {}),
            (2, 1, {"tiny": 1, "a": 1}, {"a": 1}),
            (2, 1, {"tiny": 1, "a": 1}, {"a": 1}),
            (1, 1, {"tiny": 1}, {"a": 1}),
            (1, 0, {"tiny": 1}, {}),
            (1, 0, {"tiny": 1}, {}),
            (0, 0, {}, {}),
        ]

    asyncio.run(run())


def test_a_request_that_ends_early_leaves_both_counts():
    async def run():
        admission, closed = Admission(max_queued=8, request_timeout=None), []
        with admission.ticket(time.monotonic(), 1, "b") as ticket:
            async for delta in admission.bounded(_deltas(1000, 0.001, closed), ticket):
                if delta.num_completion_tokens == 3:
                    assert (admission.num_running, admission.running_by_model) == (1, {"b": 1})
                    break  # the client went away
        assert (admission.num_queued, admission.num_running) == (0, 0)
        assert (admission.queued_by_model, admission.running_by_model) == ({}, {})

    asyncio.run(run())
