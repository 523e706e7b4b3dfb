"""200 streaming clients that hang up: half right after sending the request (before any token),
half after their first token, and one more that hangs up once both ranks have reported blocks in
use. Every sequence must be cancelled and its KV blocks freed on every rank (each rank's own
report, through /health), and the daemon must then serve normally.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

NUM_CLIENTS = 200
# Every client runs in the first wave (--max-num-seqs), so the last one hangs up a few steps in;
# letting the sequences run out would then take ~200 steps of a 200-row batch, longer than
# FREED_WITHIN_S: blocks freed sooner were freed by cancellation.
MAX_TOKENS = 200
NUM_KV_BLOCKS = 4096
FREED_WITHIN_S = 3.0


async def _request(port: int, method: str, path: str, body: bytes = b"") -> tuple[
        asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 "Content-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    return reader, writer


async def _health(port: int) -> dict:
    reader, writer = await _request(port, "GET", "/health")
    raw = await reader.read()
    writer.close()
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


async def _client(port: int, hang_up_after_first_token: bool, got_token: list[int]) -> None:
    body = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": MAX_TOKENS,
                       "ignore_eos": True, "stream": True}).encode()
    reader, writer = await _request(port, "POST", "/v1/completions", body)
    if hang_up_after_first_token:
        seen = b""
        while b"data: {" not in seen:
            chunk = await asyncio.wait_for(reader.read(4096), 60)
            assert chunk, f"the stream ended before its first token: {seen[-300:]!r}"
            seen += chunk
        got_token.append(1)
    writer.transport.abort()  # a reset, as a client that goes away does


async def _holder(port: int, peak_used: dict[int, int]) -> None:
    """A stream that hangs up only once every rank has reported blocks in use: a rank reports
    every 0.25 s, and the other clients may all have hung up before one of them did."""
    body = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": MAX_TOKENS,
                       "ignore_eos": True, "stream": True}).encode()
    _, writer = await _request(port, "POST", "/v1/completions", body)
    deadline = time.monotonic() + 30
    while not (sorted(peak_used) == [0, 1] and min(peak_used.values()) > 0):
        assert time.monotonic() < deadline, f"no rank reported blocks in use: {peak_used}"
        await asyncio.sleep(0.05)
    writer.transport.abort()


async def _run(port: int) -> tuple[list[int], dict[int, int]]:
    got_token: list[int] = []
    peak_used: dict[int, int] = {}
    clients = [asyncio.create_task(_client(port, i % 2 == 1, got_token))
               for i in range(NUM_CLIENTS)] + [asyncio.create_task(_holder(port, peak_used))]
    while not all(c.done() for c in clients):
        for rank in (await _health(port))["ranks"]:
            peak_used[rank["rank"]] = max(peak_used.get(rank["rank"], 0),
                                          rank["kv_blocks_used"])
        await asyncio.sleep(0.05)
    await asyncio.gather(*clients)
    return got_token, peak_used


def test_hung_up_streams_free_their_blocks_on_every_rank(start_lorad):
    daemon = start_lorad("--parallel", "2", "--kv-cache-blocks", str(NUM_KV_BLOCKS),
                         "--max-num-seqs", str(NUM_CLIENTS + 1))
    port = int(daemon.url.rsplit(":", 1)[1])
    got_token, peak_used = asyncio.run(_run(port))
    hung_up = time.monotonic()
    assert len(got_token) == NUM_CLIENTS // 2
    assert sorted(peak_used) == [0, 1] and min(peak_used.values()) > 0, peak_used

    deadline = time.monotonic() + FREED_WITHIN_S
    while True:
        health = daemon.health()
        ranks = health["ranks"]
        # The ranks' block counts come from their status reports, running/waiting from the
        # leader's step results: two channels, so all of them are waited for, not just one.
        if (health["open_requests"], health["running"], health["waiting"]) == (0, 0, 0) and all(
                (r["kv_blocks_used"], r["kv_blocks_free"]) == (0, NUM_KV_BLOCKS) for r in ranks):
            break
        assert time.monotonic() < deadline, (health, daemon.log()[-3000:])
        time.sleep(0.1)
    print(f"every block free {time.monotonic() - hung_up:.2f}s after the last hang-up")
    assert [r["state"] for r in ranks] == ["serving", "serving"]

    body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "ignore_eos": True}
    request = urllib.request.Request(daemon.url + "/v1/completions",
                                     data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=30) as resp:
        answer = json.loads(resp.read())
    assert answer["usage"]["completion_tokens"] == 5
    pids = daemon.worker_pids()
    assert daemon.stop() == 0, daemon.log()[-3000:]
    daemon.assert_cleaned_up(pids)
