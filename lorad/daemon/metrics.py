"""/metrics: Prometheus text format from one registry per app (never the process-wide one).

Request metrics are counted as requests go; the engine's state (queue, sequences, KV blocks per
rank) is read when scraped. `model` labels are served model ids (the base id or an adapter's
name), never a string a client made up, so the label set stays bounded. The vLLM-named gauges a
router reads are router_metrics.py's, in the same registry.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import (
    CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest)

from lorad.daemon.generation import Delta, GenerationError
from lorad.daemon.router_metrics import RouterMetrics
from lorad.protocol import StepResult

# Histogram buckets in seconds: a first token waits for a prefill (and a queue); later tokens
# and steps take one decode step each.
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# How a GenerationError's code shows as an outcome.
OUTCOME_BY_CODE = {"request_timeout": "timeout", "shutdown": "shutdown"}
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
MODEL_KEY = web.RequestKey("lorad_model", str)  # the served id, once the request resolved it
ADMITTED_KEY = web.RequestKey("lorad_admitted", bool)
RANK_COUNTERS = (  # (RankState field, metric, help) of the counts a rank reports
    ("prefix_evictions", "lorad_prefix_cache_evictions",
     "Cached KV blocks taken back for other contents"),
    ("spill_writes", "lorad_kv_spill_writes", "Evicted prefix-cache blocks written to the spill"),
    ("spill_reads", "lorad_kv_spill_reads", "Spilled blocks read back for a prompt"),
    ("spill_read_failures", "lorad_kv_spill_read_failures", "Spill reads that found the file "
     "missing, truncated or failing its checksum (the blocks were recomputed)"),
    ("spill_drops", "lorad_kv_spill_drops", "Spill entries dropped as invalid at start or by a "
     "failed read"),
    ("adapter_loads", "lorad_adapter_slot_loads", "Adapters copied into a device slot (those "
     "copied at start included)"),
    ("adapter_evictions", "lorad_adapter_slot_evictions", "Device slots taken back from an "
     "unused adapter for another one"),
    ("adapter_host_hits", "lorad_adapter_host_cache_hits", "Slot copies served from the host "
     "memory cache (--max-cpu-adapters)"),
    ("adapter_disk_reads", "lorad_adapter_disk_reads", "Slot copies read from the adapter's "
     "folder (and checked against its identity key)"),
)
RANK_GAUGES = (  # (RankState field, metric, help) of the levels a rank reports
    ("prefix_cached_blocks", "lorad_prefix_cache_blocks", "Full KV blocks in the prefix cache's "
     "index (held or evictable)"),
    ("spill_blocks", "lorad_kv_spill_blocks", "Prefix-cache blocks in the rank's disk spill "
     "(--kv-spill-dir)"),
    ("adapters_registered", "lorad_adapters_registered", "Adapter versions registered on the "
     "rank (served, or draining after a reload or unload)"),
    ("adapter_slots", "lorad_adapter_slots", "Device slots for adapters (--max-gpu-adapters)"),
    ("adapter_slots_used", "lorad_adapter_slots_used", "Device slots holding an adapter"),
)


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series beside every counter
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "lorad_requests", "Admitted generation requests by how they ended: stop, length, "
            "cancelled (client gone), timeout (--request-timeout), shutdown (cut at the end of a "
            "drain), error (the engine failed it)", ["model", "outcome"], registry=registry)
        self.rejected = Counter(
            "lorad_requests_rejected", "Generation requests answered with an error before "
            "admission, by HTTP status (model is empty when the request named no served model)",
            ["model", "status"], registry=registry)
        self.prompt_tokens = Counter(
            "lorad_prompt_tokens", "Prompt tokens of admitted requests that produced a token",
            ["model"], registry=registry)
        self.cached_prompt_tokens = Counter(
            "lorad_prompt_tokens_cached", "Prompt tokens of admitted requests that produced a "
            "token whose KV came from the prefix cache (part of lorad_prompt_tokens_total)",
            ["model"], registry=registry)
        self.generation_tokens = Counter(
            "lorad_generation_tokens", "Generated tokens (each end-of-sequence token included)",
            ["model"], registry=registry)
        self.model_tokens = Counter(
            "lorad_model_tokens", "Tokens the workers ran through the model (prompt chunks, "
            "decodes and recomputes after preemption), from the leader's step results: the "
            "choices of one prompt (n) run its prompt once", registry=registry)
        self.draft_tokens = Counter(
            "lorad_draft_tokens", "Draft tokens (--speculative-ngram) the model verified, from "
            "the leader's step results (part of lorad_model_tokens_total)", registry=registry)
        self.draft_accepted = Counter(
            "lorad_draft_accepted", "Draft tokens the sequences took: each one a generated token "
            "that needed no step of its own", registry=registry)
        self.first_token = Histogram(
            "lorad_time_to_first_token_seconds", "From the request's arrival to its first "
            "generated token reaching the coordinator", ["model"], buckets=FIRST_TOKEN_BUCKETS,
            registry=registry)
        self.inter_token = Histogram(
            "lorad_inter_token_latency_seconds", "Between consecutive generated tokens of one "
            "request, as the coordinator receives them", ["model"], buckets=STEP_BUCKETS,
            registry=registry)
        self.step_interval = Histogram(
            "lorad_step_interval_seconds", "Between consecutive step results from the leader "
            "while it had work (one engine step plus its transport; idle gaps excluded)",
            buckets=STEP_BUCKETS, registry=registry)
        self.queued = Gauge("lorad_queued_requests", "Admitted requests still waiting for their "
                            "first token (bounded by --max-queued-requests)", registry=registry)
        self.open = Gauge("lorad_open_requests", "Admitted requests whose handler has not "
                          "finished", registry=registry)
        self.running = Gauge("lorad_running_sequences", "Sequences the leader scheduled, at its "
                             "last step result", registry=registry)
        self.waiting = Gauge("lorad_waiting_sequences", "Sequences waiting in the workers, at "
                             "the leader's last step result", registry=registry)
        self.kv_used = Gauge("lorad_kv_blocks_used", "KV cache blocks in use", ["rank"],
                             registry=registry)
        self.kv_free = Gauge("lorad_kv_blocks_free", "KV cache blocks free", ["rank"],
                             registry=registry)
        self.rank_levels = [(field, Gauge(name, doc, ["rank"], registry=registry))
                            for field, name, doc in RANK_GAUGES]
        # Counts each rank keeps since its start, exposed as counters: (RankState field, counter)
        self.rank_counts = [(field, Counter(name, doc, ["rank"], registry=registry))
                            for field, name, doc in RANK_COUNTERS]
        self._counts_seen: dict[tuple[str, int], int] = {}  # (field, rank) -> at the last scrape
        # Totals since the start, for /health.
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0
        self.rank_serving = Gauge("lorad_rank_serving", "1 if the rank's state is serving, else 0",
                                  ["rank"], registry=registry)
        self.startup = Gauge("lorad_startup_seconds", "From the coordinator's process start to "
                             "serving (READY)", registry=registry)
        self.startup_phase = Gauge("lorad_startup_phase_seconds", "Start-up time by phase: the "
                                   "coordinator's, then the slowest rank's", ["phase"],
                                   registry=registry)
        self.router = RouterMetrics(registry)
        self._last_step_at: float | None = None
        self._engine_busy = False

    async def observe(self, deltas: AsyncIterator[Delta], model: str,
                      started: float) -> AsyncIterator[Delta]:
        """Pass the deltas through, counting tokens, latencies and the outcome. `started` is
        the request's arrival on time.monotonic()."""
        outcome = "cancelled"  # unless a finish reason or an error says otherwise
        # choice index -> (its tokens so far, when its last one came); prompts counted once
        counts: dict[int, tuple[int, float]] = {}
        counted_prompts: set[int] = set()
        # The request's series, each looked up once, when first used (so a series appears
        # exactly when it did with a look-up per token): labels() per token was a tenth of the
        # coordinator's time per streamed token (docs/performance-log.md: coordinator per-token
        # trims).
        inter_token = generation_tokens = None
        try:
            async for delta in deltas:
                now = time.monotonic()
                num_tokens, last_at = counts.get(delta.index, (0, started))
                num_new = delta.num_completion_tokens - num_tokens
                if num_new > 0:
                    if not counts:
                        self.first_token.labels(model).observe(now - started)
                    if delta.prompt_index not in counted_prompts:
                        counted_prompts.add(delta.prompt_index)
                        self.prompt_tokens.labels(model).inc(delta.num_prompt_tokens)
                        self.num_prompt_tokens += delta.num_prompt_tokens
                        if delta.num_cached_tokens:
                            self.cached_prompt_tokens.labels(model).inc(delta.num_cached_tokens)
                            self.num_cached_prompt_tokens += delta.num_cached_tokens
                    if num_tokens == 0:
                        num_gaps, gap = num_new - 1, 0.0  # tokens that came with the first one
                    else:
                        num_gaps, gap = num_new, (now - last_at) / num_new
                    if num_gaps and inter_token is None:
                        inter_token = self.inter_token.labels(model)
                    for _ in range(num_gaps):
                        inter_token.observe(gap)
                    if generation_tokens is None:
                        generation_tokens = self.generation_tokens.labels(model)
                    generation_tokens.inc(num_new)
                    counts[delta.index] = (delta.num_completion_tokens, now)
                if delta.finish_reason is not None:
                    outcome = delta.finish_reason  # the last choice to finish says
                yield delta
        except GenerationError as exc:
            outcome = OUTCOME_BY_CODE.get(exc.code, "error")
            raise
        finally:
            self.requests.labels(model, outcome).inc()
            await deltas.aclose()

    def step_result(self, result: StepResult) -> None:
        """EngineClient's per-StepResult hook."""
        now = time.monotonic()
        self.model_tokens.inc(result.num_model_tokens)
        if result.num_draft_tokens:
            self.draft_tokens.inc(result.num_draft_tokens)
            self.draft_accepted.inc(result.num_draft_accepted)
        if self._engine_busy and self._last_step_at is not None:
            self.step_interval.observe(now - self._last_step_at)
        self._last_step_at = now
        self._engine_busy = result.num_running + result.num_waiting > 0

    def render(self, state) -> bytes:
        """The text format, after reading the engine's state into the gauges."""
        self.queued.set(state.admission.num_queued)
        self.open.set(state.admission.num_open)
        self.running.set(state.engine.load.num_running)
        self.waiting.set(state.engine.load.num_waiting)
        for gauge in (self.kv_used, self.kv_free, self.rank_serving,
                      *(gauge for _, gauge in self.rank_levels)):
            gauge.clear()
        for rank in state.engine.rank_states():
            label = str(rank.rank)
            self.kv_used.labels(label).set(rank.kv_blocks_used)
            self.kv_free.labels(label).set(rank.kv_blocks_free)
            for field, gauge in self.rank_levels:
                gauge.labels(label).set(getattr(rank, field))
            for field, counter in self.rank_counts:
                value, seen = getattr(rank, field), self._counts_seen.get((field, rank.rank), 0)
                if value > seen:
                    counter.labels(label).inc(value - seen)
                    self._counts_seen[field, rank.rank] = value
            self.rank_serving.labels(label).set(1 if rank.state == "serving" else 0)
        report = state.engine.startup
        if report is not None:
            self.startup.set(report.total_s)
            for name, seconds in report.phases:
                self.startup_phase.labels(name).set(seconds)
        self.router.read(state)
        return generate_latest(self.registry)

    content_type = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes


def metrics_middleware(metrics_of):
    """Count generation requests refused before admission (any 4xx/5xx answer without an
    Admit), by the model they resolved to. `metrics_of(app)` gives the app's Metrics."""

    @web.middleware
    async def count_rejections(request: web.Request, handler) -> web.StreamResponse:
        response = await handler(request)
        if (request.method == "POST" and request.path in GENERATION_PATHS
                and response.status >= 400 and not request.get(ADMITTED_KEY, False)):
            metrics_of(request.app).rejected.labels(request.get(MODEL_KEY, ""),
                                                    str(response.status)).inc()
        return response

    return count_rejections

