"""Drain on a signal, through a real `lorad` on a tiny model with a 4096-token context: open
streams finish with every token while new requests get a 503 with Retry-After and /ready says
503; past --shutdown-timeout (or at a second signal) the rest end with an error event and
[DONE], or a 503; the exit status is 0 every time."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

MODEL = "long"  # the long_model fixture's folder name


def call(daemon, path: str, body: dict | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a GET (body None) or a POST."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(daemon.url + path, data,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def open_stream(daemon, max_tokens: int) -> http.client.HTTPResponse:
    """A streamed completion whose first event has arrived (so it is admitted and running)."""
    url = urlparse(daemon.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    return resp


def rest_of_stream(resp: http.client.HTTPResponse) -> list:
    """The remaining events: parsed JSON, and the final b"[DONE]" as is."""
    events = [e.strip().removeprefix(b"data: ") for e in resp.read().split(b"\n\n") if e.strip()]
    return [e if e == b"[DONE]" else json.loads(e) for e in events]


def wait_for(daemon, condition, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition(call(daemon, "/health")[2]):
        assert time.monotonic() < deadline, call(daemon, "/health")[2]
        time.sleep(0.05)


def completion_tokens(events: list) -> int:
    return next(e["usage"]["completion_tokens"] for e in events
                if isinstance(e, dict) and e.get("usage"))


def test_sigterm_lets_open_streams_finish_and_refuses_new_requests(start_lorad, long_model):
    daemon = start_lorad("--parallel", "2", "--kv-cache-blocks", "512",
                         model_dir=long_model)
    pids = daemon.worker_pids()
    streams = [open_stream(daemon, 300) for _ in range(3)]
    signalled = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    wait_for(daemon, lambda health: health["status"] == "draining")
    status, headers, body = call(daemon, "/v1/completions",
                                 {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert status == 503 and int(headers["Retry-After"]) > 0, body
    assert body["error"]["type"] == "service_unavailable" and "draining" in body["error"]["message"]
    status, _, health = call(daemon, "/health")
    assert status == 200 and health["status"] == "draining" and health["open_requests"] == 3
    status, _, ready = call(daemon, "/ready")
    assert status == 503 and not ready["ready"] and ready["status"] == "draining"
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=30) as resp:
        assert 'lorad_requests_rejected_total{model="long",status="503"} 1.0' in \
            resp.read().decode().splitlines()
    for resp in streams:
        events = rest_of_stream(resp)
        assert events[-1] == b"[DONE]" and not any("error" in e for e in events[:-1])
        assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] \
            == "length"
        assert completion_tokens(events) == 300
    assert daemon.proc.wait(30) == 0
    assert time.monotonic() - signalled < 30  # well inside the default --shutdown-timeout
    daemon.assert_cleaned_up(pids)
    assert "draining 3 open request(s)" in daemon.log()


def test_past_the_shutdown_timeout_open_requests_end_with_an_error(start_lorad, long_model):
    daemon = start_lorad("--kv-cache-blocks", "1024", "--shutdown-timeout", "1",
                         model_dir=long_model)
    stream = open_stream(daemon, 4000)  # seconds of work: far past the timeout
    full: dict = {}
    non_streamed = threading.Thread(target=lambda: full.update(zip(
        ("status", "headers", "body"),
        call(daemon, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3000,
                                         "ignore_eos": True}))))
    non_streamed.start()
    wait_for(daemon, lambda health: health["open_requests"] == 2)  # both admitted
    signalled = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    events = rest_of_stream(stream)
    cut_after = time.monotonic() - signalled
    assert events[-1] == b"[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "shutdown" and "shutting down" in error["message"]
    assert 0.8 < cut_after < 10, cut_after  # at the 1 s timeout, not at once
    non_streamed.join(30)
    assert full["status"] == 503 and full["body"]["error"]["code"] == "shutdown", full
    assert "Retry-After" in full["headers"]
    assert daemon.proc.wait(30) == 0
    assert "drain ended by --shutdown-timeout (1s): ending 2 open request(s)" in daemon.log()


def test_a_second_signal_ends_the_drain_at_once(start_lorad, long_model):
    daemon = start_lorad("--kv-cache-blocks", "1024", "--shutdown-timeout", "120",
                         model_dir=long_model)
    stream = open_stream(daemon, 4000)
    daemon.proc.send_signal(signal.SIGTERM)
    wait_for(daemon, lambda health: health["status"] == "draining")
    signalled = time.monotonic()
    daemon.proc.send_signal(signal.SIGINT)
    events = rest_of_stream(stream)
    assert events[-1] == b"[DONE]" and events[-2]["error"]["code"] == "shutdown"
    assert not any(e.get("usage") for e in events[:-1])  # no usage chunk: it did not finish
    assert daemon.proc.wait(30) == 0
    assert time.monotonic() - signalled < 20
    assert "drain ended by a second signal" in daemon.log()
