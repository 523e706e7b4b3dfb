"""The vLLM-named gauges a router reads from a model server, in the same registry as lorad's own.

The Gateway API Inference Extension's endpoint picker (as llm-d and KServe's LLMInferenceService
deploy it) scrapes these by vLLM's names to route on queue depth, KV usage and LoRA affinity.
Read from admission's counts and the ranks' reports at each scrape; per-request work stays in
admission.py. Only the names and meanings a router reads are mirrored, not vLLM's whole set.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Gauge

LORA_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, clock=time.time) -> None:
        self._clock = clock  # wall-clock seconds: vllm:lora_requests_info's value
        self.waiting = Gauge("vllm:num_requests_waiting", "Admitted requests (choices) still "
                             "waiting for their first token: lorad_queued_requests",
                             registry=registry)
        self.running = Gauge("vllm:num_requests_running", "Admitted requests (choices) past "
                             "their first token and not finished", registry=registry)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of rank 0's KV blocks in "
                              "use, 0 to 1 (cached blocks no sequence holds count as free)",
                              registry=registry)
        # The endpoint picker read this older name before its v1.3.0; vLLM deprecated it in 0.9.
        self.gpu_cache_usage = Gauge("vllm:gpu_cache_usage_perc", "Same as "
                                     "vllm:kv_cache_usage_perc (the older name)", registry=registry)
        # The picker keeps the series with the highest value (a timestamp) and splits the adapter
        # labels at commas; lorad writes one series per scrape.
        self.lora = Gauge("vllm:lora_requests_info", "Served adapters with running and with "
                          "waiting requests (comma-separated names); max_lora is the number of "
                          "device slots for adapters (--max-gpu-adapters). Value: the scrape's "
                          "Unix time",
                          LORA_LABELS, registry=registry)
        self.cache_config = Gauge("vllm:cache_config_info", "KV block size in tokens and KV "
                                  "blocks per rank (always 1)", ["block_size", "num_gpu_blocks"],
                                  registry=registry)

    def read(self, state) -> None:
        """Set the gauges from the app's state (routes.AppState) just before a scrape renders."""
        admission = state.admission
        self.waiting.set(admission.num_queued)
        self.running.set(admission.num_running)
        usage = kv_usage(state.engine.rank_states())
        self.kv_usage.set(usage)
        self.gpu_cache_usage.set(usage)
        self.lora.clear()
        names = [spec.name for spec in state.catalog.served()]
        num_slots = state.catalog.capacity.num_slots
        if names or num_slots:  # as vLLM: no series when LoRA is off
            self.lora.labels(max_lora=str(num_slots),
                             waiting_lora_adapters=adapter_list(names, admission.queued_by_model),
                             running_lora_adapters=adapter_list(names, admission.running_by_model)
                             ).set(self._clock())
        self.cache_config.clear()
        facts = state.engine.facts
        if facts is not None:
            self.cache_config.labels(block_size=str(facts.block_size),
                                     num_gpu_blocks=str(facts.num_kv_blocks)).set(1)


def adapter_list(names: list[str], counts: dict[str, int]) -> str:
    """The adapters of `names` (slot order, so one set always reads the same) with a count, as
    "a,b" (an adapter name holds no comma: config.adapters.ADAPTER_NAME); the base model's id is
    never among `names`."""
    return ",".join(name for name in names if counts.get(name, 0) > 0)


def kv_usage(ranks) -> float:
    """Rank 0's used share of its KV blocks (every rank walks the same pool identically)."""
    if not ranks:
        return 0.0
    total = ranks[0].kv_blocks_used + ranks[0].kv_blocks_free
    return ranks[0].kv_blocks_used / total if total else 0.0
