"""Rank disagreement through the real daemon: one worker rank applies an adapter admission with
the wrong slot (the LORAD_TEST_CORRUPT_SLOT_RANK hook). Every rank fails that step together, the
affected streams end with an error, nothing hangs, and the daemon keeps serving new requests
exactly. (A rank that reads other adapter bytes refuses to start: test_worker_adapters.py.)"""

from __future__ import annotations

import json
import time

import pytest

from lorad.workers.loop import CORRUPT_SLOT_RANK_ENV
from tests.daemons import adapter_flags, post

PROMPT_IDS = [5, 17, 42, 99, 7, 250, 31, 64]


def _complete(daemon, model: str, **extra) -> tuple[int, dict]:
    body = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, **extra}
    return post(daemon.url + "/v1/completions", body)


def _stream_events(daemon, model: str) -> list[dict]:
    """Every `data:` event of a streamed completion, [DONE] as {"done": True}."""
    import urllib.request

    body = json.dumps({"model": model, "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(daemon.url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=60) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append({"done": True} if data == "[DONE]" else json.loads(data))
    return events


def test_a_wrong_slot_on_one_rank_fails_the_step_everywhere_and_serving_goes_on(
        start_lorad, tiny_adapters, monkeypatch):
    monkeypatch.setenv(CORRUPT_SLOT_RANK_ENV, "1")
    daemon = start_lorad("--parallel", "2", *adapter_flags(tiny_adapters))
    status, reference = _complete(daemon, "a")
    # The hook corrupts rank 1's first adapter admission only: this first request must fail.
    assert status == 500, reference
    assert "error" in reference and "a" != reference.get("model")
    started = time.monotonic()
    status, body = _complete(daemon, "a")
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert time.monotonic() - started < 30
    status, base = _complete(daemon, "tiny")
    assert status == 200 and base["choices"][0]["text"] != body["choices"][0]["text"]
    log = daemon.log()
    assert "rank 0" in log and "rank 1" in log
    assert daemon.proc.poll() is None


def test_a_streamed_request_failed_before_its_first_token_gets_an_error_body(
        start_lorad, tiny_adapters, monkeypatch):
    """The step fails before any token, so no stream has opened: the client gets an OpenAI error
    body with a 5xx instead of an empty 200 stream, and the next stream is served in full."""
    import urllib.error

    monkeypatch.setenv(CORRUPT_SLOT_RANK_ENV, "1")
    daemon = start_lorad("--parallel", "2", *adapter_flags(tiny_adapters))
    with pytest.raises(urllib.error.HTTPError) as failure:
        _stream_events(daemon, "b")
    assert failure.value.code == 500
    assert "error" in json.loads(failure.value.read())
    events = _stream_events(daemon, "b")
    assert events[-1] == {"done": True} and not any("error" in e for e in events)
    assert sum(1 for e in events if e.get("choices") and e["choices"][0]["text"]) >= 1
