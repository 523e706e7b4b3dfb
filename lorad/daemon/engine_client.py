"""The coordinator's end of the wire to the workers: handshake, numbered messages, result routing.

Publishes Hello until every rank is Ready, then Admit/Cancel/Shutdown with gapless `seq`
numbers; reads StepResult/StepFailed/WorkerFailed and routes each output to its request's queue.
Every admitted request's queue receives exactly one terminal item: a finished SeqOutput or a
RequestFailed. Feeds each rank's RankStatus to a RankWatch (rank_watch.py) and fails the engine
when it finds a rank stalled. Does not start processes (supervisor.py) or speak HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from lorad.config import WorkerConfig
from lorad.config.adapters import AdapterSpec
from lorad.protocol import (
    PROTOCOL_VERSION, AdapterLoaded, AdapterRefused, Admit, Cancel, Hello, LoadAdapter,
    ProtocolError, RankStatus, Ready, SamplingParams, Shutdown, StartupPhase, StepFailed,
    StepResult, UnloadAdapter, WorkerFailed, decode, encode)
from lorad.daemon.rank_watch import DEFAULT_STEP_TIMEOUT_S, RankState, RankWatch
from lorad.daemon.startup import StartupReport, slowest_rank
from lorad.protocol.curve import server_keys, start_authenticator
from lorad.protocol.messages import choice_ids
from lorad.protocol.sockets import bind_publisher, bind_puller

log = logging.getLogger("lorad.engine")

HELLO_INTERVAL_S = 0.05
WATCH_INTERVAL_S = 0.25


class StartupError(RuntimeError):
    """The workers did not come up as one consistent engine; the message says why."""


class EngineDead(RuntimeError):
    """The engine failed earlier; nothing more can be admitted."""


class AdapterLoadError(RuntimeError):
    """A LoadAdapter failed on some rank (every rank kept its registry); the message says why."""


# How long a failed load waits for the failed ranks' own reasons (sent before the leader's
# answer, on other sockets, so almost always there already).
REFUSAL_WAIT_S = 2.0


@dataclass(frozen=True)
class RequestFailed:
    """Terminal item of a request that ended with an error instead of a finish reason."""

    message: str


@dataclass(frozen=True)
class EngineFacts:
    """What the ranks agreed on at start."""

    num_ranks: int
    num_kv_blocks: int
    block_size: int
    registry_digest: str
    max_num_seqs: int  # as the ranks resolved --max-num-seqs
    startup_phases: list[StartupPhase]  # the slowest rank's, as it measured them


@dataclass
class EngineLoad:
    """The leader's latest report (from its last StepResult)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0


# How long a failure report waits for the exit code of a peer found dead (reaped by the child
# watcher, its code not yet delivered to the event loop): 20 x 10 ms at most.
PEER_EXIT_CODE_POLLS = 20
PEER_EXIT_CODE_POLL_S = 0.01


def exit_message(rank: int, code: int | None) -> str:
    """What requests and the log are told when a worker's process ends on its own."""
    return f"worker rank {rank} exited unexpectedly with code {code}"


class EngineClient:
    def __init__(self, config: WorkerConfig,
                 step_timeout: float = DEFAULT_STEP_TIMEOUT_S) -> None:
        self._config = config
        # PUB is a plain socket: with no high-water mark it never blocks, so a synchronous
        # send keeps `seq` order without awaiting between numbering and sending.
        self._sync_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context.shadow(self._sync_ctx.underlying)
        keys = server_keys(config.cluster_key_dir) if config.nnodes > 1 else None
        # Between hosts only listed worker keys connect (curve.py); None on one host.
        self._auth = start_authenticator(self._sync_ctx, keys) if keys is not None else None
        self._pub = bind_publisher(self._sync_ctx, config.admit_endpoint, keys)
        self._pull = bind_puller(self._ctx, config.results_endpoint, keys)
        self._next_seq = 1
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._ranks = RankWatch(config.parallel, step_timeout)
        self.stalled: list[int] = []  # the ranks found stalled, when that failed the engine
        self.num_ranks_ready = 0
        self.failure: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.load = EngineLoad()
        self.facts: EngineFacts | None = None
        self.startup: StartupReport | None = None  # set by service.py once the port is open
        self.num_failed_by_engine = 0  # open requests ended with an error by fail()
        self.on_step_result = None  # called with each StepResult (metrics.py times the steps)
        # -> the ranks whose process has ended, (rank, exit code): Supervisor.exited_now.
        self.exited_ranks = lambda: []
        self._loads: dict[int, asyncio.Future] = {}  # adapter id -> its AdapterLoaded
        self._refusals: dict[tuple[int, int], str] = {}  # (adapter id, rank) -> why

    # --- start ---------------------------------------------------------------------------------

    async def handshake(self, num_ranks: int, timeout_s: float) -> EngineFacts:
        """Repeat Hello until every rank sent Ready; check that they all agree."""
        hello = encode(Hello(PROTOCOL_VERSION, self._config.instance_id))
        deadline = time.monotonic() + timeout_s
        ready: dict[int, Ready] = {}
        while len(ready) < num_ranks:
            if time.monotonic() > deadline:
                missing = sorted(set(range(num_ranks)) - set(ready))
                raise StartupError(f"workers did not report ready within {timeout_s:g}s "
                                   f"(ranks still loading: {missing})")
            self._pub.send(hello)
            if await self._pull.poll(HELLO_INTERVAL_S * 1000):
                while await self._pull.poll(0):
                    self._take_ready(await self._pull.recv(), num_ranks, ready)
            self.num_ranks_ready = len(ready)
        self.facts = _agree(ready)
        self.load.num_free_blocks = self.facts.num_kv_blocks
        return self.facts

    def _take_ready(self, frame: bytes, num_ranks: int, ready: dict[int, Ready]) -> None:
        try:
            msg = decode(frame, (Ready, WorkerFailed, RankStatus))
        except ProtocolError as exc:
            raise StartupError(f"a worker sent an invalid start-up message: {exc}") from None
        if isinstance(msg, RankStatus):
            self._take_status(msg)
            return
        if isinstance(msg, WorkerFailed):
            raise StartupError(f"worker rank {msg.rank} failed to start: {msg.message}")
        if msg.protocol_version != PROTOCOL_VERSION:
            raise StartupError(f"worker rank {msg.rank} speaks protocol {msg.protocol_version}, "
                               f"the coordinator speaks {PROTOCOL_VERSION}")
        if msg.instance_id != self._config.instance_id or not 0 <= msg.rank < num_ranks:
            raise StartupError(f"unexpected Ready from rank {msg.rank} of instance "
                               f"{msg.instance_id!r}")
        if msg.block_size != self._config.block_size:
            raise StartupError(f"worker rank {msg.rank} uses block size {msg.block_size}, "
                               f"expected {self._config.block_size}")
        if msg.rank not in ready:
            log.info("worker rank %d ready: %d KV blocks", msg.rank, msg.num_kv_blocks)
        ready[msg.rank] = msg
        self._ranks.mark_ready(msg.rank, msg.num_kv_blocks)

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read_results(), name="engine-results")
        self._reader.add_done_callback(self._task_done)
        self._watcher = asyncio.create_task(self._watch_ranks(), name="engine-watch")
        self._watcher.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        # A bug in routing must not leave every stream waiting forever: it becomes a failure.
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())
            self.fail(f"the coordinator's {task.get_name()} task failed: {task.exception()!r}")

    # --- requests ------------------------------------------------------------------------------

    def admit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
              adapter_id: int = 0, adapter_key: str = "", grammar: str = "", n: int = 1,
              queue: asyncio.Queue | None = None, cache_prompt: bool = True,
              adapter_strength: float = 1.0, draft: bool = True) -> list[str]:
        """Publish the admission of one prompt's n choices (adapter id 0, key "": the base model;
        grammar "": unconstrained) and return the choices' request ids; `queue` (a new one if
        None) yields their SeqOutputs, then, for each choice, a finished SeqOutput or a
        RequestFailed. Several admissions may share one queue."""
        if self.failure.done():
            raise EngineDead(self.failure.result())
        queue = queue if queue is not None else asyncio.Queue()
        # Published first: an Admit over the frame limit raises ProtocolError and leaves nothing
        # registered (and no gap in `seq`).
        self._publish(Admit(self._next_seq, request_id, prompt_ids, sampling, adapter_id,
                            adapter_key, grammar, n, cache_prompt, adapter_strength, draft))
        ids = choice_ids(request_id, n)
        for choice_id in ids:
            self._queues[choice_id] = queue
        return ids

    async def load_adapter(self, spec: AdapterSpec, pinned: bool = False) -> None:
        """Register a validated adapter version on every rank (its adapter_id new); raises
        AdapterLoadError naming each failed rank's reason when any rank refused it."""
        if self.failure.done():
            raise EngineDead(self.failure.result())
        answer = asyncio.get_running_loop().create_future()
        self._loads[spec.adapter_id] = answer
        self._publish(LoadAdapter(self._next_seq, spec.adapter_id, spec.name, spec.path,
                                  spec.strength, spec.key, pinned))
        try:
            failed_ranks = await answer
        finally:
            self._loads.pop(spec.adapter_id, None)
        if not failed_ranks:
            return
        deadline = time.monotonic() + REFUSAL_WAIT_S
        while (any((spec.adapter_id, r) not in self._refusals for r in failed_ranks)
               and time.monotonic() < deadline):
            await asyncio.sleep(0.01)
        reasons = [f"rank {r}: {self._refusals.pop((spec.adapter_id, r), 'no reason received')}"
                   for r in failed_ranks]
        raise AdapterLoadError("; ".join(reasons))

    def unload_adapter(self, adapter_id: int) -> None:
        """Forget a registry id on every rank; the caller has ended its requests."""
        if not self.failure.done():
            self._publish(UnloadAdapter(self._next_seq, adapter_id))

    def cancel(self, request_id: str) -> None:
        """Stop a request early (client gone, stop string); its queue gets nothing more."""
        if self._queues.pop(request_id, None) is not None and not self.failure.done():
            self._publish(Cancel(self._next_seq, request_id))

    def shutdown(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()  # ranks that exit after Shutdown are not stalled
        if not self.failure.done():
            self._publish(Shutdown(self._next_seq))

    def fail(self, message: str) -> None:
        """The engine cannot go on: end every open request with an error, refuse new ones."""
        if not self.failure.done():
            self.failure.set_result(message)
        self.num_failed_by_engine += self.num_open_requests
        self.abort_all(message)
        for answer in self._loads.values():
            if not answer.done():
                answer.set_exception(EngineDead(message))

    def abort_all(self, message: str) -> None:
        """End every open request with an error (the workers are told separately, if at all)."""
        self._fail_requests(list(self._queues), message)

    def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        self._pub.close(linger=0)
        self._pull.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._sync_ctx.term()

    def rank_states(self) -> list[RankState]:
        """One entry per rank, from its own latest RankStatus."""
        return self._ranks.states(self.failure.done())

    def mark_exited(self, rank: int) -> None:
        """The supervisor saw this rank's process end."""
        self._ranks.mark_ended(rank, "exited")

    @property
    def num_open_requests(self) -> int:
        """Requests, not choices: a request's choices share one queue."""
        return len({id(queue) for queue in self._queues.values()})

    def _publish(self, msg) -> None:
        self._pub.send(encode(msg))
        self._next_seq += 1

    # --- results -------------------------------------------------------------------------------

    async def _read_results(self) -> None:
        accept = (Ready, StepResult, StepFailed, WorkerFailed, RankStatus, AdapterLoaded,
                  AdapterRefused)
        while True:
            frame = await self._pull.recv()
            try:
                msg = decode(frame, accept)
            except ProtocolError as exc:
                log.error("dropped an invalid message of %d bytes from a worker: %s", len(frame),
                          exc)
                continue
            if isinstance(msg, RankStatus):
                self._take_status(msg)
            elif isinstance(msg, Ready):
                pass  # a rank answering a Hello repeated after the others were ready
            elif isinstance(msg, StepResult):
                self._route(msg)
            elif isinstance(msg, AdapterLoaded):
                answer = self._loads.get(msg.adapter_id)
                if answer is not None and not answer.done():
                    answer.set_result(msg.failed_ranks)
            elif isinstance(msg, AdapterRefused):
                log.error("worker rank %d refused adapter id %d: %s", msg.rank, msg.adapter_id,
                          msg.message)
                if msg.adapter_id in self._loads:
                    self._refusals[(msg.adapter_id, msg.rank)] = msg.message
            elif isinstance(msg, StepFailed):
                log.error("step %d failed for %d requests: %s", msg.step, len(msg.request_ids),
                          msg.message)
                self._fail_requests(msg.request_ids, f"the engine failed this request: "
                                                     f"{msg.message}")
            elif isinstance(msg, WorkerFailed):
                log.error("worker rank %d failed: %s", msg.rank, msg.message)
                self._ranks.mark_ended(msg.rank, "failed")
                dead = await self._peer_death(msg.rank)
                self.fail(exit_message(*dead) if dead
                          else f"worker rank {msg.rank} failed: {msg.message}")

    async def _peer_death(self, rank: int) -> tuple[int, int | None] | None:
        """A rank other than `rank` whose process has ended, with its exit code: a rank whose
        peer was killed fails on the broken connection, and the death is the cause to report,
        though it may not have reached the supervisor's watch yet. None if all others run."""
        for _ in range(PEER_EXIT_CODE_POLLS):
            dead = [(r, code) for r, code in self.exited_ranks() if r != rank]
            if not dead or dead[0][1] is not None:
                break
            await asyncio.sleep(PEER_EXIT_CODE_POLL_S)  # reaped: its code is on its way
        return dead[0] if dead else None

    def _take_status(self, msg: RankStatus) -> None:
        refusal = self._ranks.take(msg)
        if refusal is not None:
            log.error("%s", refusal)

    async def _watch_ranks(self) -> None:
        """Fail the engine when a rank stalls. Only ranks that have reported are watched
        (start-up has --startup-timeout)."""
        woke = time.monotonic()
        while not self.failure.done():
            await asyncio.sleep(WATCH_INTERVAL_S)
            slept, woke = time.monotonic() - woke, time.monotonic()
            if slept > 4 * WATCH_INTERVAL_S:
                continue  # this event loop was blocked: reports may be waiting unread
            stalls = self._ranks.stalls()
            if stalls:
                self.stalled = [rank for rank, _ in stalls]
                rank, why = stalls[0]
                also = f" (also stalled: ranks {self.stalled[1:]})" if len(stalls) > 1 else ""
                self.fail(f"worker rank {rank} stalled: {why}{also}")

    def _route(self, result: StepResult) -> None:
        self.load = EngineLoad(result.num_running, result.num_waiting, result.num_free_blocks)
        if self.on_step_result is not None:
            self.on_step_result(result)
        for output in result.outputs:
            queue = self._queues.get(output.request_id)
            if queue is None:
                continue  # cancelled here already; the workers are catching up
            queue.put_nowait(output)
            if output.finish_reason is not None:
                del self._queues[output.request_id]

    def _fail_requests(self, request_ids: list[str], message: str) -> None:
        for request_id in request_ids:
            queue = self._queues.pop(request_id, None)
            if queue is not None:
                queue.put_nowait(RequestFailed(message))


def _agree(ready: dict[int, Ready]) -> EngineFacts:
    for field in ("registry_digest", "num_kv_blocks", "max_num_seqs"):
        values = {rank: getattr(msg, field) for rank, msg in sorted(ready.items())}
        if len(set(values.values())) > 1:
            listed = ", ".join(f"rank {rank}: {value}" for rank, value in values.items())
            raise StartupError(f"workers disagree on {field} ({listed}); refusing to serve")
    first = ready[0]
    return EngineFacts(len(ready), first.num_kv_blocks, first.block_size, first.registry_digest,
                       first.max_num_seqs,
                       slowest_rank({rank: msg.startup_phases for rank, msg in ready.items()}))


__all__ = ["AdapterLoadError", "DEFAULT_STEP_TIMEOUT_S", "EngineClient", "EngineDead",
           "EngineFacts", "RankState", "RequestFailed", "StartupError"]
