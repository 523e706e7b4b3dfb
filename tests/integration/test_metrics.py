"""/metrics, /health and /ready of a real `lorad` (one worker, tiny model, adapters a and b):
after a known set of requests on the base model and both adapters, the request counters, token
totals and histogram counts are the exact numbers those requests imply, read with
prometheus_client's own parser; the probes report every rank, the registry and the adapters'
identity keys."""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorad.config import ModelConfig
from lorad.config.adapters import AdapterArg, load_registry
from tests.daemons import adapter_flags, start_daemon

BASE = "tiny"
PROMPT_IDS = [5, 17, 42, 99, 7, 250, 31, 64]


@pytest.fixture(scope="module")
def served(tiny_model, tiny_adapters):
    daemon = start_daemon(tiny_model, "--kv-cache-blocks", "256", *adapter_flags(tiny_adapters))
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


def get(daemon, path: str) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(daemon.url + path, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def post(daemon, route: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{daemon.url}/v1/{route}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def stream_usage(daemon, route: str, body: dict) -> dict:
    """Run a streamed request to its end; returns its usage chunk."""
    url = urlparse(daemon.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", f"/v1/{route}", json.dumps(
        {**body, "stream": True, "stream_options": {"include_usage": True}}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = [e.strip().removeprefix(b"data: ") for e in resp.read().split(b"\n\n") if e.strip()]
    assert events[-1] == b"[DONE]"
    return json.loads(events[-2])["usage"]


def scrape(daemon) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}."""
    status, headers, text = get(daemon, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_probes_while_serving(served, tiny_model, tiny_adapters):
    model = ModelConfig.from_dir(tiny_model)
    specs = load_registry(tuple(AdapterArg(n, str(p), 1.0) for n, p in tiny_adapters.items()),
                          model, reserved_names=(BASE,))
    for path in ("/health", "/ready"):
        status, _, raw = get(served, path)
        body = json.loads(raw)
        assert status == 200 and body["status"] == "serving" and body["ready"] is True
        assert [(r["rank"], r["state"]) for r in body["ranks"]] == [(0, "serving")]
        assert body["ranks"][0]["kv_blocks_free"] + body["ranks"][0]["kv_blocks_used"] == 256
        assert re.fullmatch(r"[0-9a-f]{16,}", body["registry_digest"]), body["registry_digest"]
        assert [(a["name"], a["id"], a["key"]) for a in body["adapters"]] == \
            [(s.name, s.adapter_id, s.key) for s in specs]
        assert body["kv_blocks"] == {"used": 0, "free": 256, "total": 256}
        assert (body["queued"], body["open_requests"]) == (0, 0)


def test_counters_and_histograms_are_exact(served):
    # The base model: 5 + 4 tokens, both to the length limit.
    status, full = post(served, "completions", {"model": BASE, "prompt": PROMPT_IDS,
                                                "max_tokens": 5, "ignore_eos": True})
    assert status == 200 and full["usage"]["completion_tokens"] == 5
    streamed = stream_usage(served, "completions", {"model": BASE, "prompt": "Hello there",
                                                    "max_tokens": 4, "ignore_eos": True})
    # Adapter a, chosen by model id: 6 tokens.
    status, chat = post(served, "chat/completions", {
        "model": "a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
        "ignore_eos": True})
    assert status == 200 and chat["usage"]["completion_tokens"] == 6
    # Adapter b, chosen by the adapter field: a stop string taken from its own greedy text.
    greedy = {"model": BASE, "adapter": "b", "prompt": PROMPT_IDS, "max_tokens": 8,
              "temperature": 0, "ignore_eos": True}
    text = post(served, "completions", greedy)[1]["choices"][0]["text"]
    assert len(text.strip()) >= 2, text
    stop_at = text.strip()[0]  # matched as soon as it is generated, well before the limit
    status, stopped = post(served, "completions", {**greedy, "stop": stop_at})
    assert status == 200 and stopped["choices"][0]["finish_reason"] == "stop", (text, stopped)
    # Adapter b again, cancelled: the client hangs up after the first event.
    url = urlparse(served.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "b", "prompt": "Bye", "max_tokens": 200, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    conn.close()
    # Refused before admission: no served model named (404, bad value), and one on adapter a.
    assert post(served, "completions", {"model": "nope", "prompt": "x"})[0] == 404
    assert post(served, "completions", {"model": "b", "prompt": "x", "temperature": 5})[0] == 400
    assert post(served, "completions", {"model": "a", "prompt": [1] * 300})[0] == 400

    deadline = time.monotonic() + 20
    while True:
        samples = scrape(served)
        idle = value(samples, "lorad_open_requests") == 0 and \
            value(samples, "lorad_kv_blocks_used", rank="0") == 0 and \
            value(samples, "lorad_running_sequences") == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    requests = {(dict(labels)["model"], dict(labels)["outcome"]): v
                for (name, labels), v in samples.items() if name == "lorad_requests_total"}
    assert requests == {(BASE, "length"): 2, ("a", "length"): 1, ("b", "length"): 1,
                        ("b", "stop"): 1, ("b", "cancelled"): 1}
    rejected = {(dict(labels)["model"], dict(labels)["status"]): v
                for (name, labels), v in samples.items()
                if name == "lorad_requests_rejected_total"}
    assert rejected == {("", "404"): 1, ("", "400"): 1, ("a", "400"): 1}
    assert value(samples, "lorad_prompt_tokens_total", model=BASE) == \
        len(PROMPT_IDS) + streamed["prompt_tokens"]
    assert value(samples, "lorad_prompt_tokens_total", model="a") == chat["usage"]["prompt_tokens"]
    assert value(samples, "lorad_generation_tokens_total", model=BASE) == 9
    assert value(samples, "lorad_generation_tokens_total", model="a") == 6
    num_b = value(samples, "lorad_generation_tokens_total", model="b")
    assert num_b >= 8 + stopped["usage"]["completion_tokens"] + 1  # + the cancelled one's
    first = {m: value(samples, "lorad_time_to_first_token_seconds_count", model=m)
             for m in (BASE, "a", "b")}
    assert first == {BASE: 2, "a": 1, "b": 3}
    inter = {m: value(samples, "lorad_inter_token_latency_seconds_count", model=m)
             for m in (BASE, "a", "b")}
    assert inter == {BASE: 4 + 3, "a": 5, "b": num_b - 3}
    assert value(samples, "lorad_time_to_first_token_seconds_sum", model=BASE) > 0
    assert value(samples, "lorad_time_to_first_token_seconds_bucket", model=BASE,
                 le="+Inf") == 2
    assert value(samples, "lorad_step_interval_seconds_count") >= 5
    assert value(samples, "lorad_queued_requests") == 0
    assert value(samples, "lorad_running_sequences") == 0
    assert value(samples, "lorad_kv_blocks_free", rank="0") == 256
    assert value(samples, "lorad_rank_serving", rank="0") == 1
