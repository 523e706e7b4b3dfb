"""The worker's step loop, the same on every rank: 1. receive, 2. agree, 3. plan, 4. run,
5. sample, 6. apply and publish. With async scheduling (a lone rank, plain decode steps), a step
runs ahead: its successor is planned and launched before the host applies and publishes it
(_finish_in_flight), so the device does not wait for that host work.

The one place a worker touches its sockets after start-up (the status thread, status.py, has its
own). Followers never sample and never publish step results; the leader (rank 0) does both.
Start-up (model, KV pool) is engine.py's. Each round updates the LoopProgress the status thread
reports.
"""

from __future__ import annotations

import logging
import dataclasses
import os
import time

import torch
import zmq

from lorad.config import WorkerConfig
from lorad.protocol import (
    PROTOCOL_VERSION, Admit, Cancel, Hello, LoadAdapter, ProtocolError, Ready, Shutdown,
    StepFailed, StepResult, UnloadAdapter, decode, encode)
from lorad.protocol.messages import SamplingParams, SeqOutput, choice_ids
from lorad.workers.adapter_jobs import AdapterJobs
from lorad.workers.adapter_slots import AdapterSlots
from lorad.workers.agreement import (Inbox, StepAgreement, agree_step, broadcast_ids,
                                     compare_digests, live_digest)
from lorad.workers.block_manager import BlockManager
from lorad.workers.cpu_threads import MIN_ROWS
from lorad.workers.engine import Engine
from lorad.workers import logprobs, prompt_logprobs
from lorad.workers.grammar import GrammarRows
from lorad.workers.logits_processors import LogitsTransforms, rows_to_transform
from lorad.workers.ngram_draft import may_draft
from lorad.workers.planner import Planner, PlannerLimits, StepPlan
from lorad.workers.sampler import Sampler
from lorad.workers.sequence import Sequence
from lorad.workers.spill import RankSpill
from lorad.workers.status import LoopProgress, coordinator_alive

log = logging.getLogger("lorad.worker")

# Nothing live, nothing buffered: wait this long for a message before an idle round (a message
# ends the wait at once). Every round agrees with the other ranks, a gloo or NCCL collective, so
# the wait sets what an idle server costs: at 20 ms each rank of a --parallel 2 daemon on the
# CPU took 7.5% of a core doing nothing (docs/performance-log.md: idle ranks wait 200 ms).
IDLE_POLL_MS = 200
# Live requests but nothing ran last round (all waiting for an adapter's copy, say): wait this
# long for a message before the next round. Spinning would hold the GIL, and the adapter jobs'
# thread, which gives it up at each torch op, then waits a switch interval (5 ms) to get it back
# each time: an 8B adapter's copy took ~35 s so, against ~0.1 s (benchmarks.probe_adapter_copy).
WAITING_POLL_MS = 1
HANDSHAKE_POLL_MS = 100
ACCEPTED = (Hello, Admit, Cancel, Shutdown, LoadAdapter, UnloadAdapter)
# Test hook, read only when set: the rank it names applies its next adapter admission as if the
# Admit had carried another adapter id, as a rank whose state went wrong would
# (tests/integration).
CORRUPT_SLOT_RANK_ENV = "LORAD_TEST_CORRUPT_SLOT_RANK"
# Test hooks, read only when set to "RANK" or "RANK:N": that rank blocks (sleeps) or raises inside
# its first (or N-th) step that runs the model, as a hung kernel or a crashing one would.
STALL_RANK_ENV = "LORAD_TEST_STALL_RANK"
RAISE_RANK_ENV = "LORAD_TEST_RAISE_RANK"
STALL_SLEEP_S = 3600.0


class WorkerLoop:
    def __init__(self, cfg: WorkerConfig, rank: int, engine: Engine, sub: zmq.Socket,
                 push: zmq.Socket, progress: LoopProgress | None = None) -> None:
        self.cfg = cfg
        self.rank = rank
        self.engine = engine
        self.sub = sub
        self.push = push
        self.is_leader = rank == 0
        limits = PlannerLimits(engine.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len,
                               cfg.speculative_ngram,
                               MIN_ROWS if engine.tp.device.type == "cpu" else None)
        opened = RankSpill.open(cfg, engine)
        self.spill, spill_index = opened if opened is not None else (None, None)
        slots = AdapterSlots(engine.store.capacity.num_slots, engine.resident,
                             set(cfg.pinned_adapters))
        self.planner = Planner(limits, BlockManager(engine.num_kv_blocks, cfg.block_size),
                               prefix_cache=cfg.prefix_cache, spill=spill_index, adapters=slots)
        self.adapter_jobs = AdapterJobs(engine.store, slots, rank, push)
        self._spill_read_failures = 0  # this rank's, of the last plan's reads
        self.sampler = Sampler() if self.is_leader else None
        # Followers never build matchers: the mask only changes what the leader samples.
        self.grammars = GrammarRows(cfg.model_dir) if self.is_leader else None
        self.transforms = LogitsTransforms() if self.is_leader else None
        self._step_logprobs: dict = {}  # request id -> TokenLogprobs of this step (leader)
        self._step_prompt: dict = {}  # request id -> echo's TokenLogprobs of this step (leader)
        self.inbox = Inbox()
        self._parent_pid = os.getppid()
        self._ready_sent = False
        # (running, waiting, free blocks) as the last StepResult said, or as the start is
        self._published_load = (0, 0, self.planner.blocks.num_free_blocks)
        self._corrupt_next_slot = os.environ.get(CORRUPT_SLOT_RANK_ENV) == str(rank)
        self._stall_at = _fault_step(STALL_RANK_ENV, rank)
        self._raise_at = _fault_step(RAISE_RANK_ENV, rank)
        self._num_model_steps = 0
        self._ran_nothing = False  # the last round's plan had no chunk
        # A lone rank may run a decode step ahead (--async-scheduling; auto: on CUDA); not with
        # drafting, whose drafts a step planned ahead would not carry.
        self._run_ahead = (engine.tp.world_size == 1 and not cfg.speculative_ngram and (
            cfg.async_scheduling if cfg.async_scheduling is not None
            else engine.tp.device.type == "cuda"))
        self._in_flight: _InFlight | None = None  # launched and sampled, not applied
        self._ran_ahead = False  # a step has run ahead (logged once)
        self.progress = progress or LoopProgress()
        self.progress.kv_blocks_free = engine.num_kv_blocks

    def run(self) -> int:
        """Serve until the agreed Shutdown (0) or until the coordinator is gone (1)."""
        while not self._ready_sent:
            if not self.coordinator_alive():
                return 1
            self._receive(HANDSHAKE_POLL_MS)
        log.info("ready; serving%s", f" (n-gram drafting: up to {self.cfg.speculative_ngram} "
                 "tokens a decode)" if self.cfg.speculative_ngram else "")
        self.progress.phase = "serving"
        while self.coordinator_alive():
            # 1. receive
            idle = (not self.planner.running and not self.planner.waiting
                    and not len(self.inbox) and not self.adapter_jobs.store.pending
                    and self._in_flight is None)
            if idle:
                self._receive(IDLE_POLL_MS)
            else:
                self._receive(WAITING_POLL_MS if self._ran_nothing and not len(self.inbox) else 0)
            self.progress.begin_round()  # from here on a blocked rank counts as stalled
            if self._step():
                return 0
            self.progress.end_round(self.planner.blocks, self.spill, self.adapter_jobs.counts())
        log.error("the coordinator (pid %d) is gone; exiting", self.cfg.coordinator_pid)
        return 1

    def _step(self) -> bool:
        """Steps 2-6 of one round; True at the agreed Shutdown."""
        if self._in_flight is not None:
            self._finish_in_flight()
            return False
        # 2. agree on the live set and on which messages every rank applies, apply them, and
        # compare what they did on each rank (a refused adapter, say) before the model runs on
        # it: a second, smaller gather, in the steps that apply any message. So an admission's
        # prefill runs in the step after its arrival rather than the one after that (a whole
        # step of time to first token: ~20 ms under load on an H100, docs/capacity.md). A lone
        # rank has no one to agree with: it applies everything it has received.
        lone = self.engine.tp.world_size == 1
        if lone and self._apply_messages(self.inbox.watermark):
            return True
        spill = self.spill
        agreed = agree_step(self.engine.tp, self.inbox.watermark, self._digest(lone),
                            spill.num_finished if spill else 0, self._spill_read_failures,
                            self.adapter_jobs.report())
        if agreed.digests_agree and agreed.watermark > self.inbox.applied:
            # Every rank takes this branch or none: both sides of the test are agreed values.
            if self._apply_messages(agreed.watermark):
                return True
            agreed = compare_digests(self.engine.tp, agreed, self._digest(lone))
        if not agreed.digests_agree:
            self._fail_step(agreed)
            return False
        # 3. plan
        self.planner.agree_spill(agreed.spill_finished, agreed.spill_read_failures)
        self._settle_adapter_jobs(agreed)
        plan = self.planner.plan()
        for adapter_id, slot in plan.adapter_fetches:  # beside this step and the next ones
            self.adapter_jobs.store.submit_fetch(adapter_id, slot)
        if spill is not None:  # blocks out of the pool before this step writes into them
            self._spill_read_failures = spill.run(plan)
        # 4. run; the leader fills the step's grammar masks meanwhile (joined in 5)
        if self.is_leader:
            self.grammars.prepare(plan.sampled_request_ids)
        if plan.chunks:
            self._count_model_step()
        rows = prompt_logprobs.take_rows(plan, self.planner)  # echo's; None in most steps
        params = self._run_ahead_sampling(plan) if rows is None else None
        if params is not None:
            self._in_flight = self._launch(plan, params)
            self._ran_nothing = False
            return False
        if rows is None:
            logits = self.engine.forward(plan) if plan.chunks else None  # [num_sampled, vocab]
        else:  # the LM head over echo's rows runs on every rank: it gathers across them
            logits, hidden = self.engine.forward(plan, rows.batch_rows)
            self._step_prompt = prompt_logprobs.compute(self.engine.model.lm_head, hidden, rows,
                                                        self.planner, self.is_leader)
        # 5. sample on the leader, ids to every rank
        sampled = self._sample(plan, logits)
        # 6. apply and publish
        self._ran_nothing = not plan.chunks
        events = self.planner.apply(plan, sampled)
        if self.is_leader and plan.num_draft_tokens:
            self._put_back_uniforms(plan, events)
        self._publish(plan, events)
        return False

    # --- async scheduling (a lone rank) -------------------------------------------------------

    def _sampling_of(self, plan: StepPlan) -> list[SamplingParams]:
        """Each sampled row's request's sampling parameters, in row order."""
        return [self.planner.sequence(r).sampling for r in plan.sampled_request_ids]

    def _run_ahead_sampling(self, plan: StepPlan) -> list[SamplingParams] | None:
        """The step's sampling parameters (_sampling_of) where it may run ahead of its apply:
        plain decodes, sampled with nothing that reads the step's ids on the host before its
        successor could run (grammar masks, log probabilities, logits transforms: their rows
        keep steps synchronous); else None."""
        if not (self._run_ahead and plan.chunks and not plan.forks and not plan.num_draft_tokens
                and all(len(c.token_ids) == 1 and c.sample for c in plan.chunks)):
            return None
        params = self._sampling_of(plan)
        if (len(self.grammars) or rows_to_transform(params)
                or any(p.num_logprobs >= 0 for p in params)):
            return None
        return params

    def _launch(self, plan: StepPlan, params: list[SamplingParams],
                before: "_InFlight | None" = None) -> "_InFlight":
        """Run a step and sample it on the device, waiting for neither (the device queues
        them); its ids reach the host through a copy queued right after the sampling, so
        reading them waits for this step alone, not for a successor queued behind it."""
        logits = self.engine.forward(plan, sampled_before=None if before is None
                                     else before.sampled)
        sampled = self.sampler.sample_on_device(logits, plan.sampled_request_ids, params)
        if sampled.device.type != "cuda":
            return _InFlight(plan, sampled, sampled, None)
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        host.copy_(sampled, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return _InFlight(plan, sampled, host, copied)

    def _finish_in_flight(self) -> None:
        """Apply and publish the step in flight, its successor launched first when nothing
        waits to be applied between them (a message, a waiting sequence: planner.
        continue_decodes says which) and the step may run ahead; else the next round plans
        as usual."""
        current, self._in_flight = self._in_flight, None
        if not len(self.inbox):
            plan = self.planner.continue_decodes(current.plan)
            if plan is not None:
                self._count_model_step()
                self._in_flight = self._launch(plan, self._sampling_of(plan), current)
                if not self._ran_ahead:
                    self._ran_ahead = True
                    log.info("async scheduling: step %d launched before step %d's apply",
                             plan.step, current.plan.step)
        if current.copied is not None:
            current.copied.synchronize()
        events = self.planner.apply(current.plan, current.host.tolist())
        self._publish(current.plan, events)

    def _digest(self, lone: bool) -> int:
        """This rank's live-set digest for the step agreement (0 alone: nothing to compare)."""
        if lone:
            return 0
        return live_digest(self.planner.live(), self.adapter_jobs.registry_text())

    def close(self) -> None:
        """Finish what outlives the loop: the disk spill's queued writes, the adapter jobs."""
        if self.spill is not None:
            self.spill.close()
        self.adapter_jobs.store.close()

    def coordinator_alive(self) -> bool:
        return coordinator_alive(self.cfg.coordinator_pid, self._parent_pid)

    def _count_model_step(self) -> None:
        """One more step that runs the model; the fault hooks' step blocks or raises here."""
        self._num_model_steps += 1
        if self._num_model_steps in (self._stall_at, self._raise_at):
            self._inject_fault()

    def _inject_fault(self) -> None:
        if self._num_model_steps == self._raise_at:
            raise RuntimeError(f"{RAISE_RANK_ENV}: injected failure in step {self.planner.step}")
        log.warning("%s: blocking in step %d", STALL_RANK_ENV, self.planner.step)
        time.sleep(STALL_SLEEP_S)

    # --- 1. receive ---------------------------------------------------------------------------

    def _receive(self, timeout_ms: int) -> None:
        """Drain the SUB socket into the inbox; answer Hello with Ready once."""
        if timeout_ms and not self.sub.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frame, ACCEPTED)
            except ProtocolError as exc:
                log.warning("dropped a frame of %d bytes: %s", len(frame), exc)
                continue
            if isinstance(msg, Hello):
                self._answer_hello(msg)
            elif not self.inbox.put(msg):
                log.warning("dropped a repeated message seq %d", msg.seq)

    def _answer_hello(self, hello: Hello) -> None:
        if self._ready_sent:
            return  # the coordinator repeats Hello until every rank is ready
        if hello.protocol_version != PROTOCOL_VERSION:
            raise RuntimeError(f"the coordinator speaks protocol {hello.protocol_version}, "
                               f"this worker speaks {PROTOCOL_VERSION}")
        if hello.instance_id != self.cfg.instance_id:
            raise RuntimeError(f"Hello from instance {hello.instance_id!r}, "
                               f"expected {self.cfg.instance_id!r}")
        self.push.send(encode(Ready(self.rank, PROTOCOL_VERSION, self.cfg.instance_id,
                                    self.engine.num_kv_blocks, self.cfg.block_size,
                                    self.engine.registry.hex(), self.engine.max_num_seqs,
                                    self.engine.startup_phases)))
        self._ready_sent = True
        self.progress.phase = "ready"

    # --- 2. agree -----------------------------------------------------------------------------

    def _fail_step(self, agreed: StepAgreement) -> None:
        # Before any model collective, so no rank can hang in one; the next step starts clean.
        request_ids = self.planner.drop_all()
        message = f"live sets differ across ranks (digests by rank: {agreed.digests})"
        log.error("step %d failed, dropping %d requests: %s", self.planner.step,
                  len(request_ids), message)
        if self.is_leader:
            for request_id in request_ids:
                self._forget_request(request_id)
            self.push.send(encode(StepFailed(self.planner.step, request_ids, message)))

    def _apply_messages(self, watermark: int) -> bool:
        """Apply every message up to the agreed watermark; True at Shutdown."""
        for msg in self.inbox.take_upto(watermark):
            if isinstance(msg, Shutdown):
                log.info("shutdown at seq %d with %d live requests", msg.seq,
                         len(self.planner.live()))
                return True
            if isinstance(msg, Cancel):
                self.planner.cancel(msg.request_id)
            elif isinstance(msg, (LoadAdapter, UnloadAdapter)):
                self.adapter_jobs.apply(msg)
            else:
                self._admit(msg)
        return False

    def _settle_adapter_jobs(self, agreed: StepAgreement) -> None:
        """Apply the adapter jobs' agreed outcomes; the sequences of a failed copy end."""
        for request_ids, message in self.adapter_jobs.settle(agreed, self.planner):
            if self.is_leader:
                for request_id in request_ids:
                    self._forget_request(request_id)
                self.push.send(encode(StepFailed(self.planner.step, request_ids, message)))

    def _forget_request(self, request_id: str) -> None:
        """The leader's per-request state of a request that ended without a terminal event."""
        self.sampler.remove(request_id)
        self.grammars.remove(request_id)
        self.transforms.remove(request_id)

    def _admit(self, msg: Admit) -> None:
        adapter_id = msg.adapter_id
        if self._corrupt_next_slot and adapter_id != 0:
            self._corrupt_next_slot = False
            adapter_id += 1
            log.warning("%s: applying request %r with adapter id %d instead of %d",
                        CORRUPT_SLOT_RANK_ENV, msg.request_id, adapter_id, msg.adapter_id)
        ids = choice_ids(msg.request_id, msg.n)
        # Choice j (ids[j]) prefills as ids[0] and forks from it (fork.py); the planner gives
        # it its adapter's device slot when it starts.
        seq = Sequence(ids[0], list(msg.prompt_ids), msg.sampling, 0, msg.adapter_key,
                       arrival=msg.seq, fork_ids=ids[1:], cache_prompt=msg.cache_prompt,
                       adapter_strength=msg.adapter_strength, adapter_id=adapter_id,
                       draft=may_draft(msg))
        # Every rank decides alone; a rank that decides otherwise has another live set, and the
        # agreement right after this fails the step on every rank before the model runs.
        refusal = (self.engine.adapter_refusal(adapter_id, msg.adapter_key)
                   or self.planner.admit(seq))
        if refusal is not None:
            log.error("refused request %r: %s", msg.request_id, refusal)
            if self.is_leader:
                self.push.send(encode(StepFailed(self.planner.step, ids, refusal)))
        elif self.is_leader:
            for j, request_id in enumerate(ids):
                # seed + j: choice j samples as a request of that seed alone would
                self.sampler.add(request_id, msg.sampling.seed + j)
                if msg.grammar:
                    self.grammars.add(request_id, msg.grammar, msg.sampling.stop_token_ids)

    # --- 5. sample ----------------------------------------------------------------------------

    def _sample(self, plan: StepPlan, logits) -> list[int]:
        request_ids = plan.sampled_request_ids
        if not request_ids:
            return []
        sampled = None
        if self.is_leader:
            if plan.forks:  # a fork's choices sample from their parent's row
                logits = logits[plan.logits_rows]  # [num_sampled_ids, vocab]
            params = self._sampling_of(plan)
            # Before the mask writes into the logits: the model's own distribution.
            pending = logprobs.compute(logits, params)
            self.grammars.mask(logits, request_ids)  # constrained rows only, in place
            rows = rows_to_transform(params)
            if rows:  # logit_bias, min_tokens, penalties: those rows only, in place
                self.transforms.apply(logits, rows,
                                      [self.planner.sequence(request_ids[i]) for i in rows])
            sampled = self.sampler.sample(logits, request_ids, params,
                                          keep_drawn=plan.num_draft_tokens > 0)
            self.grammars.advance(request_ids, sampled)
            self._step_logprobs = logprobs.complete(pending, request_ids, sampled)
        # Every row of a drafted chunk: each rank takes the accepted ones itself (apply).
        return broadcast_ids(self.engine.tp, sampled, len(request_ids))

    def _put_back_uniforms(self, plan: StepPlan, events: list[SeqOutput]) -> None:
        """A drafted chunk's rows after the first rejected one emit nothing: their uniforms go
        back to the request's stream, so a seeded stream draws the same ones drafted or not.
        The tokens each took are its event's (planner.apply; a finished one draws no more)."""
        drafted = {c.request_id for c in plan.chunks if c.num_draft}
        # apply() appends a drafted chunk's event after any it had pending: the last one counts
        taken = {e.request_id: len(e.token_ids) for e in events if e.request_id in drafted}
        for request_id, num in taken.items():
            self.sampler.put_back(request_id, num)

    # --- 6. publish ---------------------------------------------------------------------------

    def _publish(self, plan: StepPlan, events: list[SeqOutput]) -> None:
        if plan.preempted:
            log.info("step %d preempted %s", plan.step, plan.preempted)
        if not self.is_leader:
            return
        load = (len(self.planner.running), len(self.planner.waiting),
                self.planner.blocks.num_free_blocks)
        # An empty step is published only when the load changed (a Cancel freed a sequence), so
        # the coordinator's view of it never goes stale and idle rounds send nothing.
        if not (events or plan.chunks or load != self._published_load):
            return
        for event in events:
            if event.finish_reason is not None:
                self._forget_request(event.request_id)
        if self._step_logprobs:
            events = [_with_logprobs(e, self._step_logprobs) for e in events]
            self._step_logprobs = {}
        events = prompt_logprobs.attach(events, self._step_prompt, self.planner)
        self._step_prompt = {}
        num_model_tokens = sum(len(c.token_ids) for c in plan.chunks)
        self.push.send(encode(StepResult(plan.step, events, *load, num_model_tokens,
                                         plan.num_draft_tokens, self.planner.num_draft_accepted)))
        self._published_load = load


@dataclasses.dataclass
class _InFlight:
    """A step launched and sampled on the device, not yet applied (async scheduling)."""

    plan: StepPlan
    sampled: torch.Tensor  # [num_sampled] int64 on the device: a continuation's tokens
    host: torch.Tensor  # [num_sampled] int64 in host memory, once `copied` has happened
    copied: "torch.cuda.Event | None"  # None: host is sampled (a CPU step)


def _with_logprobs(event: SeqOutput, step_logprobs: dict) -> SeqOutput:
    """The event with its sampled token's log probabilities, if its request asked."""
    found = step_logprobs.get(event.request_id)
    if found is None or len(event.token_ids) != 1:
        return event
    return dataclasses.replace(event, logprobs=[found])


def _fault_step(env_name: str, rank: int) -> int | None:
    """Which of this rank's model steps a test hook names ("RANK" or "RANK:N"), or None."""
    value = os.environ.get(env_name)
    if not value:
        return None
    target, _, nth = value.partition(":")
    return int(nth or 1) if target == str(rank) else None
