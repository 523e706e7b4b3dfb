"""Limits through a real `lorad` (one worker, tiny model with a 4096-token context, one sequence
at a time): a flood past --max-queued-requests gets quick 429s while every admitted request
completes; --request-timeout cancels a long request with the documented error and frees its KV
blocks; hostile bodies on every POST route are 4xx with an OpenAI error body, never a 5xx, and
the daemon serves on."""

from __future__ import annotations

import gzip
import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorad.daemon.json_body import MAX_BODY_BYTES
from lorad.daemon.adapter_routes import ADMIN_PREFIXES
from lorad.daemon.routes import build_app

MODEL = "long"
REQUEST_TIMEOUT_S = 2
MAX_QUEUED = 2


@pytest.fixture(scope="module")
def limited(long_model):
    from tests.daemons import start_daemon

    daemon = start_daemon(long_model, "--kv-cache-blocks", "1024", "--max-num-seqs", "1",
                          "--max-queued-requests", str(MAX_QUEUED))
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


def send(daemon, path: str, raw: bytes | None, method: str = "POST", headers: dict | None = None,
         raw_body: bool = False) -> tuple[int, dict, object, float]:
    """(status, headers, JSON body or text, seconds) of one request on a fresh connection."""
    url = urlparse(daemon.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    started = time.monotonic()
    conn.request(method, path, raw, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    seconds = time.monotonic() - started
    conn.close()
    return resp.status, dict(resp.headers), data.decode() if raw_body else json.loads(data), \
        seconds


def post(daemon, path: str, body: dict) -> tuple[int, dict, object, float]:
    return send(daemon, path, json.dumps(body).encode())


def completion(max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True}


def health(daemon) -> dict:
    return send(daemon, "/health", None, "GET")[2]


def counts(daemon) -> dict[tuple[str, str], float]:
    """lorad_requests_total by outcome and lorad_requests_rejected_total by status."""
    text = send(daemon, "/metrics", None, "GET", raw_body=True)[2]
    return {(s.name, s.labels.get("outcome") or s.labels.get("status")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in ("lorad_requests_total", "lorad_requests_rejected_total")}


def test_a_flood_past_the_queue_bound_gets_quick_429s(limited):
    h = health(limited)  # explicit values, kept as given
    assert (h["max_num_seqs"], h["max_queued_requests"]) == (1, MAX_QUEUED), h
    before = counts(limited)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: post(limited, "/v1/completions", completion(1000)),
                                range(16)))
    admitted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(admitted) + len(refused) == 16, [r[:3] for r in results if r[0] not in (200, 429)]
    # One runs and MAX_QUEUED wait: the rest of a burst cannot get in.
    assert 1 <= len(admitted) <= 8 and len(refused) >= 8, (len(admitted), len(refused))
    for status, _, body, _ in admitted:
        assert body["usage"]["completion_tokens"] == 1000
        assert body["choices"][0]["finish_reason"] == "length"
    for status, headers, body, _ in refused:
        assert int(headers["Retry-After"]) >= 1
        assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
    slowest_refusal = max(seconds for *_, seconds in refused)
    quickest_admitted = min(seconds for *_, seconds in admitted)
    assert slowest_refusal < quickest_admitted / 4, (slowest_refusal, quickest_admitted)
    assert health(limited)["queued"] == 0
    after = counts(limited)
    for key, num in ((("lorad_requests_total", "length"), len(admitted)),
                     (("lorad_requests_rejected_total", "429"), len(refused))):
        assert after.get(key, 0) - before.get(key, 0) == num, (key, before, after)


def test_the_request_timeout_cancels_a_long_request(start_lorad, long_model):
    # --no-deterministic changes no arithmetic on the CPU; /health says which mode runs.
    limited = start_lorad("--kv-cache-blocks", "1024", "--request-timeout",
                          str(REQUEST_TIMEOUT_S), "--no-deterministic", model_dir=long_model)
    # --max-num-seqs and --max-queued-requests auto, as the workers resolved them: 64 on the CPU
    h = health(limited)
    assert (h["max_num_seqs"], h["max_queued_requests"]) == (64, 256), h
    assert h["deterministic"] is False
    # 4000 tokens take several seconds on one worker (about 2 ms a token on a fast core).
    status, _, body, seconds = post(limited, "/v1/completions", completion(4000))
    assert status == 504, body
    assert body["error"]["code"] == "request_timeout" and body["error"]["type"] == "timeout_error"
    assert f"{REQUEST_TIMEOUT_S}s" in body["error"]["message"]
    assert REQUEST_TIMEOUT_S - 0.2 < seconds < REQUEST_TIMEOUT_S + 5
    url = urlparse(limited.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**completion(4000), "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = [e.strip().removeprefix(b"data: ") for e in resp.read().split(b"\n\n") if e.strip()]
    assert events[-1] == b"[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    # Cancelled, not left running: the blocks come back and a short request is served at once.
    deadline = time.monotonic() + 10
    while (h := health(limited))["kv_blocks"]["used"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h["kv_blocks"]["used"] == 0 and h["running"] == 0, h
    status, _, body, _ = post(limited, "/v1/completions", completion(5))
    assert status == 200 and body["usage"]["completion_tokens"] == 5
    assert limited.stop() == 0


def _post_paths() -> list[str]:
    """The generation routes that take a body (the adapter admin routes' bodies:
    test_adapter_lifecycle.py)."""
    app = build_app(state=None)  # only the route table is read
    return [path for r in app.router.routes() if r.method == "POST"
            and not (path := r.resource.get_info()["path"]).startswith(ADMIN_PREFIXES)]


# ignore_eos: the random model samples its end-of-sequence token now and then, and the last
# request of a hostile-body test counts its tokens.
GOOD = {"model": MODEL, "prompt": "Hello", "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 2, "ignore_eos": True}


def _with(**fields) -> bytes:
    return json.dumps({**GOOD, **fields}).encode()


def _literal(name: str, text: str) -> bytes:
    """GOOD with `name` set to a raw JSON literal (NaN, 1e400, ...)."""
    return _with(**{name: "@@"}).replace(b'"@@"', text.encode())


# (case, raw body, expected status, the `param` the error must name or None)
HOSTILE = [
    ("oversized", _with(prompt="x" * (MAX_BODY_BYTES + 1024)), 413, None),
    ("nested 40 deep", _with(stop=None).replace(b'"stop": null', b'"x": ' + b"[" * 40
                                                 + b"]" * 40), 400, None),
    ("nested 100000 deep", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("invalid UTF-8", _with(prompt="@@").replace(b"@@", b"\xff\xfe\xc3"), 400, None),
    ("truncated", _with()[:-5], 400, None),
    ("empty", b"", 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("NaN", _literal("temperature", "NaN"), 400, None),
    ("Infinity", _literal("top_p", "Infinity"), 400, None),
    ("-Infinity", _literal("temperature", "-Infinity"), 400, None),
    ("float max_tokens", _literal("max_tokens", "1e308"), 400, "max_tokens"),
    ("huge max_tokens", _literal("max_tokens", "1" + "0" * 400), 400, "max_tokens"),
    ("5000-digit integer", _literal("max_tokens", "9" * 5000), 400, None),
    ("temperature 1e400", _literal("temperature", "1e400"), 400, "temperature"),
    ("top_p -1e400", _literal("top_p", "-1e400"), 400, "top_p"),
    ("huge top_k", _literal("top_k", "1" + "0" * 400), 400, "top_k"),
    ("huge seed", _literal("seed", "1" + "0" * 30), 400, "seed"),
    ("huge n", _literal("n", "1" + "0" * 400), 400, "n"),
    ("model not a string", _with(model=5), 400, "model"),
    ("max_tokens a string", _with(max_tokens="5"), 400, "max_tokens"),
    ("stream not a boolean", _with(stream="yes"), 400, "stream"),
    ("stop a number", _with(stop=5), 400, "stop"),
    ("stream_options a list", _with(stream=True, stream_options=[]), 400, "stream_options"),
    ("lone surrogate", _literal("prompt", '"\\ud800"').replace(
        b'"content": "Hello"', b'"content": "\\udc00"'), 400, None),
    ("token ids past 64 bits", _with(prompt=[10**30], messages="x"), 400, None),
]


@pytest.mark.parametrize("path", _post_paths())
def test_hostile_bodies_are_4xx_and_the_daemon_serves_on(limited, path):
    for case, raw, status, param in HOSTILE:
        got, headers, body, _ = send(limited, path, raw)
        assert got == status, (case, got, body)
        assert headers["Content-Type"].startswith("application/json"), case
        assert set(body["error"]) == {"message", "type", "param", "code"}, (case, body)
        if param is not None:
            assert body["error"]["param"] == param, (case, body)
    assert "unexpected error" not in limited.log()
    assert health(limited)["status"] == "serving"
    body = GOOD if path == "/v1/completions" else {**GOOD, "prompt": None}
    got, _, reply, _ = post(limited, path, body)
    assert got == 200 and reply["usage"]["completion_tokens"] == 2, reply


@pytest.mark.parametrize("path", _post_paths())
def test_compressed_bodies_are_limited_after_decompression(limited, path):
    cases = [(b"not gzip at all", "gzip", 400, "invalid_body"),
             (b"not deflate either", "deflate", 400, "invalid_body"),
             (gzip.compress(b"[" * (MAX_BODY_BYTES + 1024)), "gzip", 413, "request_too_large"),
             (gzip.compress(_with()), "gzip", 200, None)]
    for raw, encoding, status, code in cases:
        got, _, body, _ = send(limited, path, raw, headers={"Content-Encoding": encoding})
        assert got == status, (encoding, status, body)
        assert code is None or body["error"]["code"] == code, body
    assert "unexpected error" not in limited.log()
