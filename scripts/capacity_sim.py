"""A discrete-event simulation of lorad replicas behind a router: each replica plans its steps as
lorad's planner does (FCFS, decodes first, chunked prefill, device slots with LRU copies) and
takes each step's time from a step table. Stdlib only; the workloads and the search for the
replicas a target needs are capacity.py's.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from capacity_table import StepTable


@dataclass(frozen=True)
class ReplicaConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    num_slots: int = 8  # --max-gpu-adapters
    num_host_cache: int = 64  # --max-cpu-adapters
    overhead_ms: float = 0.0  # added to every request's TTFT (HTTP, tokenizer, coordinator)
    # lorad's async scheduling (by default on for a lone rank on CUDA, workers/loop.py): a
    # decode-only step that starts with no request waiting for a free place has its successor,
    # the same decodes, launched with it, so a request that arrives meanwhile waits for that
    # successor too.
    async_steps: bool = False


@dataclass
class Request:
    arrival: float  # seconds
    adapter: int  # 0: the base model
    prompt_len: int
    output_len: int
    num_computed: int = 0  # prompt tokens prefilled
    num_output: int = 0
    first_token: float | None = None
    finish: float | None = None
    replica: int = -1

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass
class Replica:
    index: int
    config: ReplicaConfig
    table: StepTable
    fleet: "Fleet"
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    slots: OrderedDict = field(default_factory=OrderedDict)  # adapter -> ready time, LRU first
    users: dict = field(default_factory=dict)  # adapter -> running sequences reading it
    host_cache: OrderedDict = field(default_factory=OrderedDict)
    copy_free_at: float = 0.0  # copies run one after another on one thread
    busy: bool = False
    ahead: bool = False  # the step running has its successor launched (async_steps)
    num_steps: int = 0
    num_loads: int = 0

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def ready(self, adapter: int, now: float) -> bool:
        return adapter == 0 or (adapter in self.slots and self.slots[adapter] <= now)

    # --- planning, as lorad/workers/planner.py -------------------------------------------------

    def plan(self, now: float, decodes_only: bool = False) -> list[tuple[Request, int]]:
        cfg = self.config
        budget, scheduled = cfg.max_num_batched_tokens, []
        for seq in self.running:  # 1. decodes, then 2. prompts already started
            if budget and seq.num_computed == seq.prompt_len:
                scheduled.append((seq, 1))
                budget -= 1
        if decodes_only:  # the successor of a step that ran ahead: its decodes continued
            return scheduled
        for seq in self.running:
            if budget and seq.num_computed < seq.prompt_len:
                num = min(seq.prompt_len - seq.num_computed, budget)
                scheduled.append((seq, num))
                budget -= num
        i, kept = 0, 0  # 3. new ones; kept: places left to those whose copies run
        while i < len(self.waiting) and budget and len(self.running) + kept < cfg.max_num_seqs:
            seq = self.waiting[i]
            if not self.ready(seq.adapter, now):
                if i == 0:
                    self._place_adapters(now)
                if seq.adapter not in self.slots:
                    break  # no slot could be had: nobody goes ahead of it
                kept += 1
                i += 1
                continue  # its copy runs: those behind it with ready adapters go ahead
            del self.waiting[i]
            if seq.adapter:
                self.users[seq.adapter] = self.users.get(seq.adapter, 0) + 1
                self.slots.move_to_end(seq.adapter)
            self.running.append(seq)
            num = min(seq.prompt_len, budget)
            scheduled.append((seq, num))
            budget -= num
        return scheduled

    def _place_adapters(self, now: float) -> None:
        keep: set[int] = set()
        for seq in self.waiting:
            if len(keep) >= self.config.num_slots:
                return
            if not seq.adapter or seq.adapter in keep:
                continue
            if not self._place(seq.adapter, keep, now):
                return
            keep.add(seq.adapter)

    def _place(self, adapter: int, keep: set[int], now: float) -> bool:
        if adapter in self.slots:
            return True
        if len(self.slots) >= self.config.num_slots:
            victim = next((a for a, at in self.slots.items() if not self.users.get(a)
                           and at <= now and a not in keep), None)
            if victim is None:
                return False
            del self.slots[victim]
            self.fleet.holders[victim].discard(self.index)
        source = "host" if adapter in self.host_cache else "disk"
        self.host_cache[adapter] = None
        self.host_cache.move_to_end(adapter)
        while len(self.host_cache) > self.config.num_host_cache:
            self.host_cache.popitem(last=False)
        self.copy_free_at = max(now, self.copy_free_at) + self.table.load_ms[source] / 1e3
        self.slots[adapter] = self.copy_free_at
        self.fleet.holders.setdefault(adapter, set()).add(self.index)
        self.num_loads += 1
        self.fleet.copies.append(now)
        self.fleet.push(self.copy_free_at, "wake", self.index)
        return True

    # --- steps ---------------------------------------------------------------------------------

    def try_step(self, now: float) -> None:
        if self.busy:
            return
        # A step that ran ahead had its successor launched: the same decodes again, without
        # those it ended; where none goes on there was none, and this plan is the usual one.
        scheduled = self.plan(now, decodes_only=True) if self.ahead else []
        scheduled = scheduled or self.plan(now)
        if not scheduled:
            self.ahead = False
            return  # idle, or the head waits for a copy (its end wakes us)
        num_decode = sum(1 for seq, num in scheduled if seq.num_computed == seq.prompt_len)
        num_prefill = sum(num for seq, num in scheduled if seq.num_computed < seq.prompt_len)
        # As the worker loop (planner.continue_decodes): a plain decode step launches its
        # successor, planned from its decodes alone, before its own end, unless a request
        # waits with room to start.
        waits = self.waiting and len(self.running) < self.config.max_num_seqs
        self.ahead = self.config.async_steps and not num_prefill and not waits
        adapters = len({seq.adapter for seq, _ in scheduled if seq.adapter})
        seconds = self.table.step_ms(num_decode, num_prefill, adapters) / 1e3
        self.busy, self.num_steps = True, self.num_steps + 1
        self.fleet.push(now + seconds, "step", (self.index, scheduled))

    def end_step(self, now: float, scheduled: list[tuple[Request, int]]) -> None:
        self.busy = False
        for seq, num in scheduled:
            if seq.num_computed < seq.prompt_len:
                seq.num_computed += num
                if seq.num_computed < seq.prompt_len:
                    continue
                seq.first_token = now + self.config.overhead_ms / 1e3
            seq.num_output += 1
            if seq.num_output >= seq.output_len:
                seq.finish = now
                self.running.remove(seq)
                if seq.adapter:
                    self.users[seq.adapter] -= 1
                self.fleet.finished(self, seq, now)
        self.try_step(now)


class Fleet:
    """R replicas, one event queue, and a router: "round-robin", "least-loaded" (fewest open
    requests) or "affinity" (a replica holding the adapter in a slot, unless its open requests
    exceed the least-loaded replica's by more than `slack`)."""

    ROUTERS = ("round-robin", "least-loaded", "affinity")

    def __init__(self, num_replicas: int, config: ReplicaConfig, table: StepTable,
                 router: str, slack: int = 4) -> None:
        if router not in self.ROUTERS:
            raise ValueError(f"router {router!r}: one of {', '.join(self.ROUTERS)}")
        self.replicas = [Replica(i, config, table, self) for i in range(num_replicas)]
        self.router, self.slack = router, slack
        self.holders: dict[int, set[int]] = {}  # adapter -> replicas with it in a slot
        self.events: list = []
        self._order = itertools.count()
        self._loads: list = [(0, next(self._order), r.index) for r in self.replicas]
        self.on_finish = None  # callback(request, now): a closed-loop client's next request
        self._arrived: set[int] = set()  # replicas given a request at this instant
        self.copies: list[float] = []  # when each adapter copy was planned

    def push(self, when: float, kind: str, payload) -> None:
        heapq.heappush(self.events, (when, next(self._order), kind, payload))

    def _note_load(self, replica: Replica) -> None:
        heapq.heappush(self._loads, (replica.load, next(self._order), replica.index))

    def least_loaded(self) -> Replica:
        while True:  # entries whose load has changed since are stale
            load, _, index = self._loads[0]
            if self.replicas[index].load == load:
                return self.replicas[index]
            heapq.heappop(self._loads)

    def route(self, request: Request, number: int) -> Replica:
        if self.router == "round-robin":
            return self.replicas[number % len(self.replicas)]
        least = self.least_loaded()
        if self.router == "least-loaded" or not request.adapter:
            return least
        held = self.holders.get(request.adapter)
        if held:
            best = min((self.replicas[i] for i in held), key=lambda r: (r.load, r.index))
            if best.load <= least.load + self.slack:
                return best
        return least

    def arrive(self, request: Request, number: int, now: float) -> None:
        replica = self.route(request, number)
        request.replica = replica.index
        replica.waiting.append(request)
        self._note_load(replica)
        self._arrived.add(replica.index)

    def finished(self, replica: Replica, request: Request, now: float) -> None:
        self._note_load(replica)
        if self.on_finish is not None:
            self.on_finish(request, now)

    def run(self, requests: list[Request], until: float = float("inf")) -> float:
        """Serve `requests` (by arrival) and any a closed loop adds -> the last event's time."""
        for number, request in enumerate(requests):
            self.push(request.arrival, "arrive", (request, number))
        now = 0.0
        arrivals = itertools.count(len(requests))
        while self.events and self.events[0][0] <= until:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                request, number = payload
                self.arrive(request, number if number >= 0 else next(arrivals), now)
            elif kind == "step":
                index, scheduled = payload
                self.replicas[index].end_step(now, scheduled)
            else:  # a copy ended
                self.replicas[payload].try_step(now)
            if self._arrived and not (self.events and self.events[0][0] == now):
                for index in sorted(self._arrived):  # arrivals of one instant share a step
                    self.replicas[index].try_step(now)
                self._arrived.clear()
        return now
