"""The HTTP API of a real `lorad` (two real workers, tiny random Llama) through the official
`openai` client and raw HTTP: models, completions and chat (full and streamed), 32 concurrent
streams, stop strings, usage, disconnects, every bad input's 4xx body, and a worker's death."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

import openai
import pytest

from lorad.daemon.tokenizer import ModelTokenizer
from tests.daemons import post, wait_idle

MODEL = "tiny"  # the tiny checkpoint's folder name: the default served id
MAX_MODEL_LEN = 256
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> ModelTokenizer:
    return ModelTokenizer.from_dir(tiny_model)


def open_stream(daemon, route: str, body: dict) -> tuple[http.client.HTTPConnection,
                                                          http.client.HTTPResponse]:
    """Start a streamed request and read its first event; returns the live connection."""
    url = urlparse(daemon.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("POST", f"/v1/{route}", json.dumps({"model": MODEL, "stream": True, **body}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    return conn, resp


def rest_of_stream(resp: http.client.HTTPResponse) -> list[bytes]:
    """The remaining events' payloads, without the `data: ` prefix."""
    events = (event.strip() for event in resp.read().split(b"\n\n"))
    return [event.removeprefix(b"data: ") for event in events if event]


def test_models_and_health(daemon, client):
    models = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "lorad")]
    health = daemon.health()
    assert health["status"] == "serving" and health["ready"]
    assert [(r["rank"], r["state"]) for r in health["ranks"]] == [(0, "serving"), (1, "serving")]
    assert health["kv_blocks"]["total"] == 256
    # an explicit --max-num-seqs is kept; the auto queue holds 4 x 48, at least 256
    assert (health["max_num_seqs"], health["max_queued_requests"]) == (48, 256)
    assert health["adapters"] == []
    assert health["deterministic"] is True  # the default


def test_completion_full_and_streamed_agree(client, tokenizer):
    args = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0.8,
                seed=11, extra_body={"ignore_eos": True})
    full = client.completions.create(**args)
    assert full.object == "text_completion" and full.model == MODEL
    assert full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(tokenizer.encode("The quick brown fox"))
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_from_token_ids(client):
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3,
                                    extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 3


def test_chat_full_and_streamed(client, tokenizer):
    args = dict(model=MODEL, messages=CHAT, max_completion_tokens=9, temperature=1.0, seed=5,
                extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**args)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(tokenizer.encode_chat(CHAT))
    assert full.usage.completion_tokens == 9
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content


def test_32_concurrent_streams_finish_with_their_token_counts(daemon):
    async def one(client, max_tokens):
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request number {max_tokens}:", max_tokens=max_tokens,
            temperature=1.0, seed=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        reasons, usage = [], None
        async for chunk in stream:
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            usage = chunk.usage or usage
        return reasons, usage.completion_tokens

    async def burst():
        async with openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, n) for n in range(1, 33)))

    results = asyncio.run(burst())
    assert results == [(["length"], n) for n in range(1, 33)]
    assert wait_idle(daemon)["running"] == 0


def _sampled_text(client, seed: int) -> str:
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40,
                                    temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
    return out.choices[0].text


def _complete(client, args: dict, stream: bool) -> tuple[str, str, int | None]:
    """(text, finish_reason, completion tokens; None when streamed) of one completion."""
    if stream:
        chunks = list(client.completions.create(**args, stream=True))
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason, None
    out = client.completions.create(**args)
    return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens


@pytest.fixture(scope="module")
def stop_case(client) -> tuple[int, str, str]:
    """(seed, its unstopped text, a stop string of two plain characters well inside it)."""
    for seed in range(1, 50):
        text = _sampled_text(client, seed)
        spots = _visible(text)
        if len(spots) >= 12:
            return seed, text, text[spots[6]:spots[6] + 2]
    pytest.fail("no seed gave a text with enough plain characters")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_early_and_is_not_returned(daemon, client, stop_case, stream):
    seed, text, stop = stop_case
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=1.0,
                seed=seed, stop=[stop, "never appears §§"], extra_body={"ignore_eos": True})
    got, reason, num_tokens = _complete(client, args, stream)
    if not stream:
        assert num_tokens < 40
    assert got == text[:text.find(stop)]
    assert reason == "stop"
    assert wait_idle(daemon)["running"] == 0  # the workers were told to cancel


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_in_the_last_token_still_stops(client, stream):
    """A stop string that first appears in the text of the request's last token (max_tokens
    reached there) ends it with "stop", not "length", and is not returned."""
    for seed in range(1, 80):
        text = _sampled_text(client, seed)
        last = text[-1:]
        if last.strip() and last != "\ufffd" and text.find(last) == len(text) - 1:
            break
    else:
        pytest.fail("no seed gave a text whose last character appears nowhere before it")
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=1.0,
                seed=seed, stop=[last], extra_body={"ignore_eos": True})
    got, reason, _ = _complete(client, args, stream)
    assert got == text[:text.find(last)]
    assert reason == "stop"


def _visible(text: str) -> list[int]:
    """Positions i where text[i:i+2] is two ordinary characters."""
    return [i for i in range(len(text) - 1)
            if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2]]


def test_client_disconnect_cancels_the_sequence(daemon):
    conn, _ = open_stream(daemon, "completions",
                          {"prompt": "Hello", "max_tokens": 240, "ignore_eos": True})
    conn.sock.shutdown(2)
    conn.close()
    # 240 tokens take several seconds at this speed; a cancelled sequence is gone far sooner.
    health = wait_idle(daemon, timeout_s=2.0)
    assert health["running"] == 0 and health["open_requests"] == 0, health


LONG = "word " * 300


@pytest.mark.parametrize("route,body,status,param", [
    ("completions", {"prompt": "hi", "max_tokens": "3"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("completions", {"prompt": LONG}, 400, "prompt"),
    ("completions", {"prompt": [1, 2, 100000]}, 400, "prompt"),
    ("completions", {"prompt": 3}, 400, "prompt"),
    ("completions", {"prompt": "hi", "temperature": 3}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_k": "x"}, 400, "top_k"),
    ("completions", {"prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "hi", "model": "other"}, 404, "model"),
    ("completions", {"prompt": "hi", "adapter": "other"}, 400, "adapter"),  # none served
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("chat/completions", {"messages": CHAT, "n": 17}, 400, "n"),
    ("chat/completions", {"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 6}, 400,
     "max_completion_tokens"),
    ("chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("chat/completions", {"messages": CHAT, "model": "gpt-4"}, 404, "model"),
])
def test_bad_input_is_a_4xx_openai_error(daemon, route, body, status, param):
    code, reply = post(f"{daemon.url}/v1/{route}", {"model": MODEL, **body})
    assert code == status, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["param"] == param and reply["error"]["message"]
    if status == 404:
        assert reply["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe", b'"text"'])
def test_malformed_bodies_are_400(daemon, raw):
    code, reply = post(f"{daemon.url}/v1/chat/completions", None, raw=raw)
    assert code == 400 and reply["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("route, raw, param, message", [
    ("completions", b'{"model": "tiny", "prompt": "hi", "model": "other"}', "model",
     'duplicated key "model" in the request body'),
    ("chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a",'
     b' "role": "system"}]}', "messages[0].role", 'duplicated key "role" in messages[0]'),
])
def test_duplicated_keys_are_400(daemon, route, raw, param, message):
    code, reply = post(f"{daemon.url}/v1/{route}", None, raw=raw)
    assert code == 400 and reply["error"] == {
        "message": message, "type": "invalid_request_error", "param": param,
        "code": "duplicated_key"}


def test_unknown_model_through_the_client(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="nope", messages=CHAT)
    assert exc.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1/nothing", 404), ("POST", "/v1/embeddings", 404),
    ("GET", "/v1/completions", 405), ("DELETE", "/v1/chat/completions", 405),
    ("POST", "/health", 405), ("GET", "/v1/models/other", 404)])
def test_wrong_routes_answer_json(daemon, method, path, status):
    code, reply = post(daemon.url + path, {}, method=method)
    assert code == status and "error" in reply and reply["error"]["message"]


def test_worker_death_ends_streams_with_an_error_and_exits_nonzero(start_lorad):
    daemon = start_lorad("--kv-cache-blocks", "64")
    pids = daemon.worker_pids()
    _, resp = open_stream(daemon, "completions",
                          {"prompt": "Hello", "max_tokens": 240, "ignore_eos": True})
    os.kill(pids[0], signal.SIGKILL)
    events = rest_of_stream(resp)
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])
    assert error["error"]["type"] == "server_error" and "worker rank 0" in error["error"]["message"]
    assert daemon.proc.wait(30) == 1
    daemon.assert_cleaned_up(pids)
    assert "worker rank 0 exited unexpectedly" in daemon.log()


def test_sigterm_without_drain_time_ends_open_streams_and_exits_zero(start_lorad):
    """--shutdown-timeout 0: the drain ends at once (tests/integration/test_drain.py drains)."""
    daemon = start_lorad("--kv-cache-blocks", "64", "--shutdown-timeout", "0")
    pids = daemon.worker_pids()
    _, resp = open_stream(daemon, "chat/completions",
                          {"messages": CHAT, "max_tokens": 200, "ignore_eos": True})
    daemon.proc.send_signal(signal.SIGTERM)
    events = rest_of_stream(resp)
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert "shutting down" in error["message"] and error["code"] == "shutdown"
    assert daemon.proc.wait(30) == 0
    daemon.assert_cleaned_up(pids)
