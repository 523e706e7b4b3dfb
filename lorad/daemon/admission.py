"""Who gets in and how they are let out: the draining switch (503), the queue bound (429), and
each admitted request's deadline (--request-timeout, or the end of a drain).

The queue is what the coordinator can count without asking the workers: each choice of a request
(prompts x n) is *queued* from its admission until its first generated token arrives (waiting in
the workers or in its prefill), then *running* until its finish reason or the request's end; both
are counted in total and per served model id. A request is admitted whole or refused whole. Does
not tokenize, publish messages or write HTTP.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import contextmanager

from lorad.daemon.errors import ApiError
from lorad.daemon.generation import Delta, GenerationError

RETRY_AFTER_QUEUE_FULL_S = 1  # a queue slot frees as soon as any queued request gets a token
RETRY_AFTER_UNAVAILABLE_S = 5  # draining or failed: another instance, or this one restarted


class Ticket:
    """One admitted request: which of its choices are queued or running, and when it must end
    and why."""

    def __init__(self, deadline: float | None, num_choices: int = 1, model: str = "") -> None:
        self.model = model  # the served model id it runs on
        self.queued = set(range(num_choices))  # choice indexes without a token yet
        self.running: set[int] = set()  # choice indexes with a token and no finish reason yet
        self.deadline = deadline  # loop time; None: no deadline
        self.cut_message: str | None = None  # set when a drain ends it
        self._timer: asyncio.Timeout | None = None  # armed while waiting for the next delta

    def cut(self, message: str, now: float) -> None:
        self.cut_message = message
        self.deadline = now
        if self._timer is not None and not self._timer.expired():  # an expired one is firing
            self._timer.reschedule(now)

    def error(self, timeout_s: float | None) -> GenerationError:
        if self.cut_message is not None:
            return GenerationError(self.cut_message, 503, "shutdown")
        return GenerationError(f"the request ran past its deadline of {timeout_s:g}s "
                               f"(--request-timeout) and was cancelled", 504, "request_timeout")


AUTO_MIN_QUEUED = 256  # auto's floor: the fixed default before --max-num-seqs grew with the card
AUTO_QUEUED_PER_SEQ = 4  # auto: queue four steps' worth of new sequences


def queue_bound(max_queued_requests: int | None, max_num_seqs: int) -> int:
    """--max-queued-requests as given, or auto's: a burst as wide as the running batch (256
    streams arriving at once) must queue, not get 429s."""
    if max_queued_requests is not None:
        return max_queued_requests
    return max(AUTO_MIN_QUEUED, AUTO_QUEUED_PER_SEQ * max_num_seqs)


class Admission:
    def __init__(self, max_queued: int, request_timeout: float | None) -> None:
        self.max_queued = max_queued
        self.request_timeout = request_timeout
        self.num_queued = 0
        self.num_running = 0  # choices past their first token, not finished
        # served model id -> its choices queued / running; only models that have some (/metrics
        # lists the adapters found here at each scrape)
        self.queued_by_model: dict[str, int] = {}
        self.running_by_model: dict[str, int] = {}
        self._open: set[Ticket] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_open(self) -> int:
        return len(self._open)

    def check(self, status: str, num_choices: int = 1) -> None:
        """Refuse a new generation request while not serving (503) or while the queue has no
        room for all its choices (429). Call it right before tokenizing: nothing awaits between
        it and the admission."""
        if status != "serving":
            why = {"draining": "is draining before it stops", "stopping": "is stopping",
                   "failed": "has failed"}.get(status, f"is {status}")
            raise ApiError(503, f"the server {why} and admits no new requests",
                           code="unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)})
        if self.num_queued + num_choices > self.max_queued:
            asked = f"; this request has {num_choices} choices" if num_choices > 1 else ""
            raise ApiError(429, f"too many requests waiting for their first token "
                                f"({self.num_queued} choices, --max-queued-requests "
                                f"{self.max_queued}{asked}); retry shortly", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_QUEUE_FULL_S)})

    @contextmanager
    def ticket(self, started: float, num_choices: int = 1, model: str = ""):
        """Count one admitted request on the served model id `model` (its choices in the queue)
        from here until the handler is done with it; `started` (time.monotonic()) is its arrival,
        where --request-timeout counts from."""
        deadline = None
        if self.request_timeout is not None:  # on the loop's clock, which timeouts run on
            remaining = started + self.request_timeout - time.monotonic()
            deadline = asyncio.get_running_loop().time() + remaining
        ticket = Ticket(deadline, num_choices, model)
        self._open.add(ticket)
        self._count(model, num_choices, 0)
        self._idle.clear()
        try:
            yield ticket
        finally:
            self._open.discard(ticket)
            self._count(model, -len(ticket.queued), -len(ticket.running))
            ticket.queued.clear()
            ticket.running.clear()
            if not self._open:
                self._idle.set()

    async def bounded(self, deltas: AsyncIterator[Delta], ticket: Ticket) -> AsyncIterator[Delta]:
        """The deltas until the ticket's deadline; past it the request is cancelled (closing
        generate() sends Cancel) and GenerationError says why."""
        try:
            while True:
                try:
                    async with asyncio.timeout_at(ticket.deadline) as timer:
                        ticket._timer = timer
                        delta = await anext(deltas)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise ticket.error(self.request_timeout) from None
                finally:
                    ticket._timer = None
                # Two set look-ups a delta: the counts change only at a choice's first token
                # and at its finish.
                if delta.index in ticket.queued and delta.num_completion_tokens:
                    ticket.queued.discard(delta.index)
                    ticket.running.add(delta.index)
                    self._count(ticket.model, -1, 1)
                if delta.finish_reason is not None:
                    self._finish(ticket, delta.index)
                yield delta
        finally:
            await deltas.aclose()

    def cut_all(self, message: str) -> int:
        """End every open request now with `message` (the end of a drain); returns how many."""
        now = asyncio.get_running_loop().time()
        for ticket in self._open:
            ticket.cut(message, now)
        return len(self._open)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def _finish(self, ticket: Ticket, index: int) -> None:
        """A choice's finish reason came (after its tokens, or with none: max_tokens 0)."""
        if index in ticket.running:
            ticket.running.discard(index)
            self._count(ticket.model, 0, -1)
        elif index in ticket.queued:
            ticket.queued.discard(index)
            self._count(ticket.model, -1, 0)

    def _count(self, model: str, num_queued: int, num_running: int) -> None:
        """Add to the queued and running counts, in total and for `model`."""
        self.num_queued += num_queued
        self.num_running += num_running
        _add(self.queued_by_model, model, num_queued)
        _add(self.running_by_model, model, num_running)


def _add(counts: dict[str, int], key: str, num: int) -> None:
    """counts[key] += num, leaving out a key whose count is 0."""
    if num:
        left = counts.get(key, 0) + num
        if left:
            counts[key] = left
        else:
            del counts[key]
