"""The vLLM-named gauges of a real `lorad` (one worker, the tiny model with a 4096-token context,
adapters a and b, one sequence a step) as the inference gateway's endpoint picker would read them:
a long stream on adapter a shows a as running and a stream on b held behind it as waiting; once a
is gone b runs, and once b has finished neither is listed, nothing runs and the KV cache reads
empty again (its blocks stay cached, which counts as free)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request
from urllib.parse import urlparse

from prometheus_client.parser import text_string_to_metric_families

from tests.daemons import adapter_flags
from tests.integration.streams import Stream


def scrape(daemon) -> dict[str, list]:
    """Each family's samples by name (one sample for every gauge read here)."""
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def wait_for(daemon, check, timeout_s: float = 30.0) -> dict[str, list]:
    """Scrape until check(samples) holds; fail with the last scrape's router gauges."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(daemon)
        if check(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError({name: s for name, s in samples.items() if ":" in name})
        time.sleep(0.02)


def lora(samples) -> tuple[str, str]:
    """(running_lora_adapters, waiting_lora_adapters) of the one lora_requests_info series."""
    [sample] = samples["vllm:lora_requests_info"]
    assert sample.labels["max_lora"] == "2"
    assert abs(sample.value - time.time()) < 60  # a Unix timestamp
    return sample.labels["running_lora_adapters"], sample.labels["waiting_lora_adapters"]


def value(samples, name: str) -> float:
    [sample] = samples[name]
    return sample.value


def test_running_and_waiting_adapters_follow_the_requests(start_lorad, long_model,
                                                          tiny_adapters):
    daemon = start_lorad("--kv-cache-blocks", "1024", "--max-num-seqs", "1",
                         *adapter_flags(tiny_adapters), model_dir=long_model)
    idle = scrape(daemon)
    assert lora(idle) == ("", "")
    assert value(idle, "vllm:num_requests_running") == value(idle, "vllm:num_requests_waiting") \
        == 0
    assert value(idle, "vllm:kv_cache_usage_perc") == 0
    [config] = idle["vllm:cache_config_info"]
    assert config.labels["num_gpu_blocks"] == "1024" and int(config.labels["block_size"]) > 0

    # Adapter a: 4000 tokens run for seconds; its first event means it has a token.
    url = urlparse(daemon.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "a", "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True,
        "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    # Adapter b waits behind it (--max-num-seqs 1); its 1500 tokens then run for about two
    # seconds, long enough to be seen running.
    queued_b = Stream(daemon.url, max_tokens=1500, prompt="Hello", model="b")
    busy = wait_for(daemon, lambda s: lora(s) == ("a", "b")
                    and value(s, "vllm:kv_cache_usage_perc") > 0)
    assert value(busy, "vllm:num_requests_running") == 1
    assert value(busy, "vllm:num_requests_waiting") == 1 == value(busy, "lorad_queued_requests")
    assert value(busy, "vllm:gpu_cache_usage_perc") == value(busy, "vllm:kv_cache_usage_perc")

    conn.close()  # a's client goes away: a is cancelled and b gets its turn
    running_b = wait_for(daemon, lambda s: lora(s) == ("b", ""))
    assert value(running_b, "vllm:num_requests_running") == 1
    assert value(running_b, "vllm:num_requests_waiting") == 0

    queued_b.join(120)
    assert queued_b.status == 200 and queued_b.events[-1] == b"[DONE]"
    done = wait_for(daemon, lambda s: lora(s) == ("", "")
                    and value(s, "vllm:kv_cache_usage_perc") == 0)
    assert value(done, "vllm:num_requests_running") == value(done, "vllm:num_requests_waiting") \
        == 0
    assert value(done, "lorad_prefix_cache_blocks") > 0  # cached, yet counted as free
