"""The vLLM-named gauges on a fake app state, as exact text-format lines: the endpoint picker of
the Gateway API Inference Extension reads these names, labels and value formats (comma-separated
adapter names, max_lora as a decimal string, KV usage as a fraction of 1, a timestamp value)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lorad.daemon.engine_client import EngineLoad
from lorad.daemon.metrics import Metrics
from lorad.daemon.rank_watch import RankState
from lorad.daemon.router_metrics import RouterMetrics

NOW = 1767225600.25  # the fake clock's Unix time


def fake_state(adapters=("a", "b", "c"), queued=None, running=None, used=30, free=90):
    queued, running = queued or {}, running or {}
    admission = SimpleNamespace(num_queued=sum(queued.values()),
                                num_running=sum(running.values()), num_open=0,
                                queued_by_model=queued, running_by_model=running)
    ranks = [RankState(rank, "serving", 7, used, free, 0.1) for rank in range(2)]
    engine = SimpleNamespace(rank_states=lambda: ranks, load=EngineLoad(),
                             facts=SimpleNamespace(block_size=16, num_kv_blocks=used + free),
                             startup=None)
    served = tuple(SimpleNamespace(name=n) for n in adapters)
    catalog = SimpleNamespace(served=lambda: served,
                              capacity=SimpleNamespace(num_slots=len(adapters)))
    return SimpleNamespace(admission=admission, engine=engine, catalog=catalog)


def rendered(state) -> list[str]:
    """The sample lines (no HELP/TYPE) of the router gauges alone."""
    registry = CollectorRegistry(auto_describe=True)
    RouterMetrics(registry, clock=lambda: NOW).read(state)
    return [line for line in generate_latest(registry).decode().splitlines()
            if not line.startswith("#")]


def test_running_and_waiting_adapters_in_slot_order_without_the_base_model():
    # Adapter a has a running and a waiting choice, c a waiting one; the base model's requests
    # count in the totals but are no LoRA requests. c queued before a: slot order still wins.
    state = fake_state(queued={"c": 1, "tiny": 2, "a": 1}, running={"tiny": 1, "a": 2})
    assert rendered(state) == [
        "vllm:num_requests_waiting 4.0",
        "vllm:num_requests_running 3.0",
        "vllm:kv_cache_usage_perc 0.25",
        "vllm:gpu_cache_usage_perc 0.25",
        'vllm:lora_requests_info{max_lora="3",running_lora_adapters="a",'
        'waiting_lora_adapters="a,c"} 1.76722560025e+09',
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="120"} 1.0',
    ]


def test_no_busy_adapter_gives_empty_label_values():
    state = fake_state(adapters=("a", "b"), queued={"tiny": 1}, used=0, free=64)
    lines = rendered(state)
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",' \
           'waiting_lora_adapters=""} 1.76722560025e+09' in lines
    assert "vllm:kv_cache_usage_perc 0.0" in lines and "vllm:num_requests_waiting 1.0" in lines


def test_one_series_per_scrape_and_none_without_adapters():
    registry = CollectorRegistry(auto_describe=True)
    router = RouterMetrics(registry, clock=lambda: NOW)
    router.read(fake_state(running={"b": 1}))
    router.read(fake_state(running={"c": 1}))  # the earlier label set must not linger
    text = generate_latest(registry).decode()
    assert text.count("vllm:lora_requests_info{") == 1
    assert 'running_lora_adapters="c"' in text
    router.read(fake_state(adapters=()))  # as vLLM without LoRA: the family has no sample
    assert "vllm:lora_requests_info{" not in generate_latest(registry).decode()


def test_the_app_registry_renders_them_beside_lorads_own():
    text = Metrics().render(fake_state(queued={"b": 2})).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["vllm:num_requests_waiting"].samples[0].value == 2
    assert families["lorad_queued_requests"].samples[0].value == 2
    lora = families["vllm:lora_requests_info"]
    assert lora.type == "gauge" and lora.samples[0].labels == {
        "max_lora": "3", "running_lora_adapters": "", "waiting_lora_adapters": "b"}
